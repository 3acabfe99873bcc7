"""A differentiation rule registered from one file (tests/extensions/mish_rule.py): its
reverse- and forward-mode products match float64 central differences, and a model using the
op compiles and trains."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

import kfac_compiler as kc
from extensions import mish_rule  # noqa: F401  (registers the rule; tests/ is on sys.path)
from kfac_compiler.oprules import find
from kfac_compiler.oprules.check import fd_check, one_node_model
from kfac_compiler.runtime import Trainer


def test_mish_rule_matches_finite_differences():
    x = np.random.default_rng(1).normal(0, 2, (3, 5))
    model, feeds = one_node_model("Mish", [("X", x)], {}, opset=18)
    assert find(model.graph.node[0], 18) is not None
    rep = fd_check(model, feeds)
    assert rep.ok, rep


def test_a_model_with_mish_trains():
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [8, 16], rng.normal(0, 0.4, (8, 16)).astype(np.float32).ravel())
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [16, 3], rng.normal(0, 0.3, (16, 3)).astype(np.float32).ravel())
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Mish", ["h"], ["a"]),
         helper.make_node("MatMul", ["a", "w2"], ["logits"])],
        "mish_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], initializer=[w1, w2])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    assert [l.kind for l in plan.layers] == ["fully_connected", "fully_connected"]
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = (x[:, :3].argmax(1)).astype(np.int64)
    tr = Trainer(plan, optimizer="kfac")
    losses = [tr.step({"x": x}, y)["loss"] for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0]
