"""Rule 6 of the constants rule (passes/input_free.py): initializers whose input-free
computation is rotation tables (rotary embeddings) or is overwritten by Where (Swin's shifted-
window mask) are constants; learnt weights in the same places stay parameters. The real exports
(tests/test_real_exports.py: swin and llama from torch.export, checked against torch's
parameters) are the end-to-end check."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from helpers import randn

T, D = 4, 4  # positions, features


def _model(nodes, inits, consts=()):
    """x [N, T, D] -> ... -> `z` [N, T, D] -> Flatten -> head.weight [T*D, 3] -> y."""
    nodes = list(consts) + list(nodes) + [helper.make_node("Flatten", ["z"], ["f"], axis=1),
                                          helper.make_node("MatMul", ["f", "head.weight"], ["y"])]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _rotate(cos: str, sin: str):
    """z = x cos + rotate_half(x) sin, rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])."""
    return [helper.make_node("Slice", ["x", "h", "end", "last"], ["x2"]),
            helper.make_node("Slice", ["x", "zero", "h", "last"], ["x1"]),
            helper.make_node("Neg", ["x2"], ["nx2"]),
            helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
            helper.make_node("Mul", ["x", cos], ["xc"]),
            helper.make_node("Mul", ["rot", sin], ["rs"]),
            helper.make_node("Add", ["xc", "rs"], ["z"])]


_SLICES = [_const("h", np.array([D // 2])), _const("end", np.array([D])), _const("zero", np.array([0])),
           _const("last", np.array([-1]))]
_ANGLES = np.arange(T, dtype=np.float32)[:, None] * np.array([1.0, 0.1], np.float32)  # positions x inv_freq


def test_folded_rotary_tables_are_constants(rng):
    """torch.export's optimizer folds Llama's cos/sin tables into initializers."""
    angles = np.concatenate([_ANGLES, _ANGLES], axis=-1)
    inits = {"cos": np.cos(angles), "sin": np.sin(angles), "head.weight": randn(rng, T * D, 3)}
    plan = kc.compile(_model(_rotate("cos", "sin"), inits, _SLICES), loss="squared_error", emit=False)
    assert plan.trainable == ["head.weight"]
    for name in ("cos", "sin"):
        assert "a rotation table (cos^2 + sin^2 = 1" in plan.frozen_reasons[name]


def test_inverse_frequencies_of_rotary_tables_are_constants(rng):
    """Without the optimizer: cos and sin computed from positions x inv_freq (a torch buffer)."""
    nodes = [helper.make_node("Mul", ["pos", "inv_freq"], ["a"]),
             helper.make_node("Concat", ["a", "a"], ["ang"], axis=-1),
             helper.make_node("Cos", ["ang"], ["cos"]), helper.make_node("Sin", ["ang"], ["sin"]),
             *_rotate("cos", "sin")]
    inits = {"inv_freq": np.array([1.0, 0.1], np.float32), "head.weight": randn(rng, T * D, 3)}
    consts = [*_SLICES, _const("pos", np.arange(T, dtype=np.float32)[:, None])]
    plan = kc.compile(_model(nodes, inits, consts), loss="squared_error", emit=False)
    assert plan.trainable == ["head.weight"]
    assert "computes rotation tables" in plan.frozen_reasons["inv_freq"]


@pytest.mark.parametrize("case", ["gains", "learnt_frequencies"])
def test_learnt_weights_in_the_same_places_stay_parameters(rng, case):
    """Two per-position gains of one shape in [-1, 1] (no cos^2 + sin^2 = 1), and frequencies
    multiplied into the data before Cos and Sin (Fourier features: they meet the data first)."""
    if case == "gains":
        inits = {"g1": rng.uniform(-1, 1, (T, D)).astype(np.float32),
                 "g2": rng.uniform(-1, 1, (T, D)).astype(np.float32)}
        nodes = _rotate("g1", "g2")
    else:
        inits = {"freq": rng.uniform(-1, 1, (D,)).astype(np.float32)}
        nodes = [helper.make_node("Mul", ["x", "freq"], ["ang"]),
                 helper.make_node("Cos", ["ang"], ["c"]), helper.make_node("Sin", ["ang"], ["s"]),
                 helper.make_node("Add", ["c", "s"], ["z"])]
    inits["head.weight"] = randn(rng, T * D, 3)
    plan = kc.compile(_model(nodes, inits, _SLICES), loss="squared_error", emit=False)
    assert plan.trainable == list(inits) and not plan.frozen


def _masked(ids_where: list):
    """scores x + mask(ids): mask = Where(ids != 0, -100, ids), then each Where of `ids_where`
    (condition tensor, then-value): Swin's masked_fill(mask != 0, -100).masked_fill(mask == 0, 0)."""
    nodes = [helper.make_node("Equal", ["ids", "zero_f"], ["is0"]), helper.make_node("Not", ["is0"], ["not0"]),
             helper.make_node("Where", ["not0", "m100", "ids"], ["m1"])]
    last = "m1"
    for k, (cond, then) in enumerate(ids_where):
        nodes.append(helper.make_node("Where", [cond, then, last], [f"m{k + 2}"]))
        last = f"m{k + 2}"
    nodes.append(helper.make_node("Add", ["x", last], ["z"]))
    return nodes, [_const("zero_f", np.float32(0)), _const("m100", np.float32(-100))]


def test_a_mask_overwritten_by_where_is_a_constant(rng):
    """Every element of `ids` is replaced (by -100 where non-zero, by 0 where zero): no element
    reaches the data; the same graph without the second Where passes the zeros on."""
    ids = np.repeat(np.repeat(np.array([[0, 1], [2, 3]], np.float32), 2, 0), 2, 1)  # window region ids
    inits = {"ids": ids, "head.weight": randn(rng, T * D, 3)}
    nodes, consts = _masked([("is0", "zero_f")])
    plan = kc.compile(_model(nodes, inits, consts), loss="squared_error", emit=False)
    assert plan.trainable == ["head.weight"]
    assert "has no influence on the output" in plan.frozen_reasons["ids"]
    nodes, consts = _masked([])  # ids' zeros reach the scores: a parameter (a gradient flows there)
    plan = kc.compile(_model(nodes, inits, consts), loss="squared_error", emit=False)
    assert plan.trainable == ["ids", "head.weight"]
    x, t = randn(rng, 5, T, D), randn(rng, 5, 3)
    _, grads = kc.gradients(plan, inputs={"x": x}, targets=t)
    w = inits["head.weight"]  # numpy: loss = mean_n 0.5 |flatten(x + mask) w - t|^2
    z = x + np.where(ids != 0, -100.0, ids)
    dz = ((z.reshape(5, -1) @ w - t) @ w.T / 5).reshape(5, T, D)
    np.testing.assert_allclose(grads["ids"], np.where(ids == 0, dz.sum(0), 0.0), rtol=1e-5, atol=1e-6)
