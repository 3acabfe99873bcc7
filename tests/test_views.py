"""Parameters an exporter re-lays out or looks up at run time, made visible to the patterns at
canonicalization: a re-layout chain of one initializer (torch.export's Unsqueeze + CastLike of
a GroupNorm's affine) folded into an initializer of the re-laid shape that keeps the
parameter's name (passes/fold_params.py, `relayout_ends`); a constant-index lookup (Swin's
GatherND of its relative position bias table) rewritten as one Gather of the flattened table
(passes/index_views.py); a sequence length read as `x.size(1)` where the model declares it
(canonicalize's static dims) a constant.

Truth: the original graph on onnx.reference in float64 (its outputs, and central differences
of its loss along random directions of the source initializers against our gradients mapped
back to the source's shapes by `fold_recurrent_params`). Torch-generated cases:
tests/fixtures/real/{groupnorm,swin,wav2vec2}-dynamo_noopt and bert-ts (tests/test_real_exports.py).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import kfac_compiler as kc
from helpers import reference_loss
from kfac_compiler.contract import FOLDED_PARAMS_KEY
from kfac_compiler.graph import fold_recurrent_params
from kfac_compiler.passes.autodiff import gradient_model
from kfac_compiler.passes.canonicalize import canonicalize

N, C, S, HEADS, W = 2, 3, 4, 2, 3  # batch, channels, spatial side, heads, window side


def _model(nodes, inits, x_shape, out_shape=()) -> onnx.ModelProto:
    tensors = [numpy_helper.from_array(v, k) for k, v in inits.items()]
    graph = helper.make_graph(nodes, "views", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x_shape))],
                              [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, list(out_shape))], initializer=tensors)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    return m


def affine_model(seed: int = 0) -> onnx.ModelProto:
    """x * CastLike(Unsqueeze(w, [1, 2]), x) + CastLike(Unsqueeze(b, [1, 2]), .), as torch.export
    without its optimizer writes a GroupNorm's affine; then a mean and a weighted sum."""
    rng = np.random.default_rng(seed)
    inits = {"w": rng.standard_normal(C), "b": rng.standard_normal(C), "axes": np.array([1, 2]),
             "u": rng.standard_normal((N, C, S, S))}
    nodes = [helper.make_node("Unsqueeze", ["w", "axes"], ["w_u"]), helper.make_node("CastLike", ["w_u", "x"], ["w_c"]),
             helper.make_node("Mul", ["x", "w_c"], ["s"]),
             helper.make_node("Unsqueeze", ["b", "axes"], ["b_u"]), helper.make_node("CastLike", ["b_u", "s"], ["b_c"]),
             helper.make_node("Add", ["s", "b_c"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["au"]), helper.make_node("ReduceSum", ["au"], ["loss"], keepdims=0)]
    return _model(nodes, inits, ("N", C, S, S))


def table_model(seed: int = 0) -> onnx.ModelProto:
    """Swin's relative position bias: table [R, HEADS] -> GatherND(table, idx [W*W*W*W, 1]) ->
    Reshape [W*W, W*W, HEADS] -> Transpose [2, 0, 1] -> Unsqueeze 0 -> Add to scores; the
    indices repeat rows (every relative offset is read several times)."""
    rng = np.random.default_rng(seed)
    r = (2 * W - 1) ** 2
    coords = np.stack(np.meshgrid(np.arange(W), np.arange(W), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + (W - 1)
    index = (rel[0] * (2 * W - 1) + rel[1]).reshape(-1, 1).astype(np.int64)
    inits = {"table": rng.standard_normal((r, HEADS)), "index": index,
             "shape": np.array([W * W, W * W, HEADS]), "zero": np.array([0]),
             "u": rng.standard_normal((N, HEADS, W * W, W * W))}
    nodes = [helper.make_node("Transpose", ["table"], ["t0"], perm=[0, 1]),  # torch.export's no-op
             helper.make_node("GatherND", ["t0", "index"], ["g"]),
             helper.make_node("Reshape", ["g", "shape"], ["v"]),
             helper.make_node("Transpose", ["v"], ["p"], perm=[2, 0, 1]),
             helper.make_node("Unsqueeze", ["p", "zero"], ["bias"]),
             helper.make_node("Add", ["x", "bias"], ["a"]),
             helper.make_node("Softmax", ["a"], ["sm"], axis=-1),
             helper.make_node("Mul", ["sm", "u"], ["su"]), helper.make_node("ReduceSum", ["su"], ["loss"], keepdims=0)]
    return _model(nodes, inits, ("N", HEADS, W * W, W * W))


def shared_transpose_model(seed: int = 0) -> onnx.ModelProto:
    """One Transpose of a weight W [4, 3] read by two MatMuls (a weight applied twice, as in a
    tied autoencoder written with W.t() once): no pattern is closed over the shared Transpose."""
    rng = np.random.default_rng(seed)
    inits = {"W": rng.standard_normal((4, C)), "u": rng.standard_normal((N, 4))}
    mix = numpy_helper.from_array(rng.standard_normal((4, C)), "mix")
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["h"]),
             helper.make_node("Constant", [], ["V"], value=mix), helper.make_node("MatMul", ["h", "V"], ["g"]),
             helper.make_node("Tanh", ["g"], ["t"]), helper.make_node("MatMul", ["t", "Wt"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["au"]), helper.make_node("ReduceSum", ["au"], ["loss"], keepdims=0)]
    return _model(nodes, inits, ("N", C))


def flipped_model(seed: int = 0) -> onnx.ModelProto:
    """A weight W [C, 4] read through a Slice that reverses its rows (steps -1: flax's
    ConvTranspose flips its kernel so), then MatMul(x, .)."""
    rng = np.random.default_rng(seed)
    inits = {"W": rng.standard_normal((C, 4)), "u": rng.standard_normal((N, 4)), "starts": np.array([-1]),
             "ends": np.array([-(2 ** 62)]), "axes": np.array([0]), "steps": np.array([-1])}
    nodes = [helper.make_node("Slice", ["W", "starts", "ends", "axes", "steps"], ["Wf"]),
             helper.make_node("MatMul", ["x", "Wf"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["au"]), helper.make_node("ReduceSum", ["au"], ["loss"], keepdims=0)]
    return _model(nodes, inits, ("N", C))


MODELS = {"affine": (affine_model, ("w", "b"), (N, C, S, S)), "table": (table_model, ("table",), (N, HEADS, W * W, W * W)),
          "shared_transpose": (shared_transpose_model, ("W",), (N, C)), "flipped": (flipped_model, ("W",), (N, C))}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_views_fold_into_initializers_that_keep_the_parameters_names(case):
    make, params, x_shape = MODELS[case]
    model = make()
    canon = canonicalize(model, "loss")
    inits = {t.name: numpy_helper.to_array(t) for t in canon.graph.initializer}
    ops = {n.op_type for n in canon.graph.node}
    record = json.loads({p.key: p.value for p in canon.metadata_props}[FOLDED_PARAMS_KEY])
    assert sorted(record) == sorted(params)
    if case == "affine":
        assert not ops & {"Unsqueeze", "CastLike"}
        assert inits["w"].shape == inits["b"].shape == (C, 1, 1)
    elif case == "shared_transpose":
        assert "Transpose" not in ops and inits["W"].shape == (C, 4)
    elif case == "flipped":
        assert "Slice" not in ops and inits["W"].shape == (C, 4)
    else:
        assert not ops & {"GatherND", "Transpose", "Reshape", "Unsqueeze"} and "Gather" in ops
        assert inits["table"].shape == ((2 * W - 1) ** 2 * HEADS,)
    back = fold_recurrent_params(canon, inits)  # the source's shapes, bit for bit
    for p in params:
        np.testing.assert_array_equal(back[p], numpy_helper.to_array(next(t for t in model.graph.initializer
                                                                          if t.name == p)))
    feeds = {"x": np.random.default_rng(3).standard_normal(x_shape)}
    (ours,) = ReferenceEvaluator(canon).run(None, feeds)
    assert abs(float(ours) - reference_loss(model, feeds)) <= 1e-12 * max(1.0, abs(float(ours)))


@pytest.mark.parametrize("case", sorted(MODELS))
def test_gradients_of_the_views_match_finite_differences_of_the_original(case):
    make, params, x_shape = MODELS[case]
    model = make(seed=1)
    canon = canonicalize(model, "loss")
    gm = gradient_model(canon, "loss", list(params))
    feeds = {"x": np.random.default_rng(4).standard_normal(x_shape)}
    outs = ReferenceEvaluator(gm).run([f"grad/{p}" for p in params], {**feeds, "loss_grad": np.asarray(1.0)})
    grads = fold_recurrent_params(canon, dict(zip(params, outs)))
    sources = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in params}
    rng = np.random.default_rng(5)
    for _ in range(2):
        v = {k: rng.standard_normal(a.shape) for k, a in sources.items()}
        eps = 1e-6
        fd = (reference_loss(model, feeds, {k: a + eps * v[k] for k, a in sources.items()})
              - reference_loss(model, feeds, {k: a - eps * v[k] for k, a in sources.items()})) / (2 * eps)
        an = sum(float(np.sum(grads[k] * v[k])) for k in sources)
        assert abs(fd - an) <= 1e-8 * max(1.0, abs(an)), (fd, an)


@pytest.mark.parametrize("case", sorted(MODELS))
def test_views_get_structured_blocks(case):
    """The affine: a scale_and_shift layer of (w, b); the table: a broadcast layer (its K
    looked-up elements' per-example gradients added into the flat table's rows); the shared
    transpose: one fully connected layer with both MatMuls as its uses."""
    make, params, _ = MODELS[case]
    plan = kc.compile(make(), loss="squared_error", output="a", emit=False)
    layers = [(layer.kind, layer.params, len(layer.uses)) for layer in plan.layers]
    assert layers == {"affine": [("scale_and_shift", ("w", "b"), 1)], "table": [("broadcast", ("table",), 1)],
                      "shared_transpose": [("fully_connected", ("W",), 2)], "flipped": [("fully_connected", ("W",), 1)]}[case]
    assert all(plan.holders(p) == [p] for p in params)


def positions_model(seq: int | str) -> onnx.ModelProto:
    """TorchScript's BERT positions: Gather(P, Slice(arange [1, 16], 0, x.size(1), axis 1))
    added to x [N, seq, D]; the sequence length read from Shape(x) at run time."""
    rng = np.random.default_rng(0)
    inits = {"P": rng.standard_normal((16, 3)), "ids": np.arange(16).reshape(1, 16), "one": np.array([1]),
             "zero": np.array([0]), "axis1": np.array(1)}
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "axis1"], ["t"], axis=0),
             helper.make_node("Unsqueeze", ["t", "zero"], ["end"]),
             helper.make_node("Slice", ["ids", "zero", "end", "one", "one"], ["pos"]),
             helper.make_node("Gather", ["P", "pos"], ["pe"], axis=0), helper.make_node("Add", ["x", "pe"], ["loss"])]
    return _model(nodes, inits, ("N", seq, 3), ("N", seq, 3))


def test_a_declared_sequence_length_read_at_run_time_is_a_constant():
    """Declared static: the positions are batch-less (a broadcast layer, as the exporters that
    write the length as a constant give them); the batch dim N stays read at run time.
    Undeclared: the lookup's indices may have a batch axis for all the compiler knows."""
    static = kc.compile(positions_model(8), loss="squared_error", output="loss", emit=False)
    assert [(layer.kind, layer.params) for layer in static.layers] == [("broadcast", ("P",))]
    dynamic = kc.compile(positions_model("T"), loss="squared_error", output="loss", emit=False)
    assert [layer.kind for layer in dynamic.layers] != ["broadcast"]
    canon = canonicalize(positions_model(8), "loss")
    x = np.random.default_rng(1).standard_normal((N, 8, 3))
    np.testing.assert_array_equal(ReferenceEvaluator(canon).run(None, {"x": x})[0],
                                  ReferenceEvaluator(positions_model(8)).run(None, {"x": x})[0])
