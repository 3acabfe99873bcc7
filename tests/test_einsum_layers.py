"""Dense layers written as Einsum (jax2onnx, flax's nnx.Einsum, hand-written attention) are
rewritten as MatMuls at canonicalization (passes/einsum.py), so they get structured blocks
(they were generic diagonal layers: 11.8%, 26.3% and 43.2% of three models' parameters in
structured blocks, a tied Einsum head 45%); their gradients through the plan, mapped back to
the file's layout, are JAX's (float64 gradients stored with the fixtures,
tests/fixtures/jax_einsum/README.md)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import kfac_compiler as kc
from kfac_compiler.graph import fold_recurrent_params
from kfac_compiler.passes.einsum import einsum_to_matmul

FIX = Path(__file__).parent / "fixtures" / "jax_einsum"
INPUTS = {"einsum": "input", "plainfn": "input", "attn_einsum": "tokens", "tied": "tokens"}


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_einsum_dense_layers_get_structured_blocks_and_jaxs_gradients(name):
    truth = np.load(FIX / f"{name}.npz")
    plan = kc.compile(str(FIX / f"{name}.onnx"), loss="squared_error", output="logits", emit=False)
    assert [layer.name for layer in plan.layers if layer.kind == "generic"] == []
    assert plan.totals()["structured_elements"] == plan.totals()["param_elements"]
    if name == "tied":
        assert "tied_embedding" in {layer.kind for layer in plan.layers}
    n = truth["x"].shape[0]
    y = (truth["out64"] - n * truth["u"]).astype(np.float32)  # squared error: dL/dlogits = u
    _, grads = kc.gradients(plan, {INPUTS[name]: truth["x"]}, y)
    grads = {**grads, **fold_recurrent_params(plan.model, grads)}  # the file's layout
    for key in truth.files:
        if key.startswith("g64/"):
            p, want = key[4:], truth[key]
            err = np.abs(grads[p] - want).max() / np.abs(want).max()
            assert err < 2e-6, (p, err)


@pytest.mark.parametrize("equation,shapes,weight_at", [
    ("btd,df->btf", [(2, 3, 4), (4, 5)], 1),
    ("btf,fhk->bthk", [(2, 3, 4), (4, 2, 3)], 1),
    ("bqhk,hkd->bqd", [(2, 3, 2, 4), (2, 4, 5)], 1),
    ("abc,bd->acd", [(2, 3, 4), (3, 5)], 1),
    ("df,btd->tbf", [(4, 5), (2, 3, 4)], 0),  # the weight first, the output transposed
    ("bd,fd->bf", [(2, 4), (5, 4)], 1),
])
def test_the_rewrite_computes_the_einsum(equation, shapes, weight_at):
    """The MatMul form equals the Einsum on onnx.reference in float64."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s) for s in shapes]
    names = ["W" if i == weight_at else "x" for i in range(2)]
    x = values[1 - weight_at]
    node = helper.make_node("Einsum", names, ["y"], name="e", equation=equation)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
                              [numpy_helper.from_array(values[weight_at], "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert einsum_to_matmul(model) == 1
    assert "Einsum" not in {n.op_type for n in model.graph.node}
    (got,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_allclose(got, np.einsum(equation, *values), rtol=1e-12, atol=1e-12)


def test_an_einsum_that_is_no_dense_layer_is_left_alone():
    """A trace-like repeated index, an index summed within one operand, a batch index shared
    by both operands: not a matrix product with a parameter."""
    for equation, w_shape in (("bii,ij->bj", (3, 5)), ("bd,de->b", (4, 5)), ("bd,bd->b", (2, 4))):
        x_rank = len(equation.split(",")[0])
        node = helper.make_node("Einsum", ["x", "W"], ["y"], equation=equation)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [None] * x_rank)],
                                  [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
                                  [numpy_helper.from_array(np.ones(w_shape), "W")])
        assert einsum_to_matmul(helper.make_model(graph)) == 0, equation
