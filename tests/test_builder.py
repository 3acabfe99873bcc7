"""GraphBuilder pieces with control flow, run in ONNX Runtime."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, checker, helper

from kfac_compiler.builder import GraphBuilder, value_info


def test_conditional_runs_its_nodes_only_when_asked():
    """then() nodes live in the If's branch: with cond false the alternative passes through
    and the branch's work is not done (its Log of a negative input would give NaN)."""
    b = GraphBuilder(17, taken={"x", "flag"})
    cond = b.op("Greater", ["flag", b.const(0.0)])
    calls = []

    def then():
        calls.append(1)
        return [b.op("Log", [b.mul("x", b.const(2.0))]), b.op("Neg", ["x"])]

    out = b.conditional(cond, then, ["x", b.const(np.zeros(3))], [[3], ["n"]], hint="demo")
    assert len(calls) == 1 and [n.op_type for n in b.nodes] == ["Greater", "If"]
    model = b.make_model(
        "t",
        [value_info("x", TensorProto.FLOAT, [3]), value_info("flag", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [3]) for o in out],
    )
    checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([1.0, 2.0, 3.0], np.float32)
    on = sess.run(None, {"x": x, "flag": np.array(1.0, np.float32)})
    np.testing.assert_allclose(on[0], np.log(2 * x), rtol=1e-6)
    np.testing.assert_array_equal(on[1], -x)
    off = sess.run(None, {"x": -x, "flag": np.array(0.0, np.float32)})
    np.testing.assert_array_equal(off[0], -x)
    np.testing.assert_array_equal(off[1], np.zeros(3, np.float32))


def test_make_model_drops_what_no_output_needs():
    """Dead nodes and their constants are not emitted (ONNX Runtime would run them); nodes an
    If branch reads from the outer scope stay; the model still computes the same output."""
    b = GraphBuilder(17, taken={"x", "flag"})
    dead = b.op("Exp", [b.mul("x", b.const(np.full(3, 7.0), hint="dead_c"))])  # never used
    outer = b.op("Neg", ["x"])  # read only inside the branch
    cond = b.op("Greater", ["flag", b.const(0.0)])
    (y,) = b.conditional(cond, lambda: [b.add(outer, b.const(1.0))], ["x"], [[3]])
    model = b.make_model(
        "t",
        [value_info("x", TensorProto.FLOAT, [3]), value_info("flag", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [3])],
    )
    checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["Neg", "Greater", "If"]
    assert all(dead not in n.output for n in model.graph.node)
    assert not [t.name for t in model.graph.initializer if t.name.startswith("dead_c")]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([1.0, 2.0, 3.0], np.float32)
    (on,) = sess.run(None, {"x": x, "flag": np.array(1.0, np.float32)})
    np.testing.assert_array_equal(on, 1.0 - x)
