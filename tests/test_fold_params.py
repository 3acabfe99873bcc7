"""Recurrent weights an exporter assembles at run time (Slice/Concat/Unsqueeze of torch-order
initializers, as torch.export without its optimizer writes them), folded into initializers at
canonicalization (passes/fold_params.py) so that the lowered LSTM/GRU gets structured blocks.

Truth: the original (unfolded, fused) graph run by onnx.reference in float64: the folded
model's outputs, and float64 central differences of its loss along random directions of the
torch-order initializers against our gradients mapped back by `fold_recurrent_params`. The
torch-generated case is tests/fixtures/real/{lstm,gru,bilstm}-dynamo_noopt (torch autograd,
tests/test_real_exports.py)."""
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
from kfac_compiler.graph import fold_recurrent_params, source_holders
from kfac_compiler.passes.autodiff import gradient_model
from kfac_compiler.passes.canonicalize import canonicalize
from kfac_compiler.passes.fold_params import fold_assembled

T, N, I, H = 4, 3, 5, 4
# torch's gate order -> ONNX's: LSTM torch (i, f, g, o) -> (i, o, f, c); GRU torch (r, z, n) -> (z, r, h)
ORDER = {"LSTM": (0, 3, 1, 2), "GRU": (1, 0, 2)}
GATES = {"LSTM": 4, "GRU": 3}


def assembled_model(op: str, direction: str = "forward", *, extra_reader: bool = False, dup: bool = False,
                    seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A float64 LSTM/GRU whose W, R, B are Concat(Unsqueeze(Concat(Slice(torch tensor, gate)...)))
    of torch-order initializers `{w_ih,w_hh,b_ih,b_hh}_{d}`; the slice bounds come from the
    Shape of a zero state, as torch.export writes them. loss = sum(Y * U). `extra_reader`: w_ih_0
    is also read by another node (then nothing folds); `dup`: W reads gate 0 twice (not a
    permutation). Returns (model, {input: value})."""
    rng = np.random.default_rng(seed)
    G, D = GATES[op], 2 if direction == "bidirectional" else 1
    inits, nodes = {}, []
    for d in range(D):
        inits.update({f"w_ih_{d}": rng.standard_normal((G * H, I)) * 0.5, f"w_hh_{d}": rng.standard_normal((G * H, H)) * 0.5,
                      f"b_ih_{d}": rng.standard_normal(G * H) * 0.5, f"b_hh_{d}": rng.standard_normal(G * H) * 0.5})
    consts = {"zero": np.array([0], np.int64), "k": np.arange(G + 1, dtype=np.int64)}
    nodes.append(helper.make_node("ConstantOfShape", ["state_shape"], ["zeros"], value=numpy_helper.from_array(np.zeros(1))))
    consts["state_shape"] = np.array([D, N, H], np.int64)
    nodes.append(helper.make_node("Shape", ["zeros"], ["hidden"], start=2, end=3))  # [H], static

    def gate(src: str, g: int, name: str) -> str:
        kk = f"{name}/k"
        nodes.append(helper.make_node("Constant", [], [kk + "0"], value=numpy_helper.from_array(np.array([g], np.int64))))
        nodes.append(helper.make_node("Constant", [], [kk + "1"], value=numpy_helper.from_array(np.array([g + 1], np.int64))))
        nodes.append(helper.make_node("Mul", ["hidden", kk + "0"], [f"{name}/start"]))
        nodes.append(helper.make_node("Mul", ["hidden", kk + "1"], [f"{name}/end"]))
        nodes.append(helper.make_node("Slice", [src, f"{name}/start", f"{name}/end", "zero"], [name]))
        return name

    def onnx_order(src: str, tag: str) -> str:
        order = list(ORDER[op])
        if dup and tag.startswith("W"):
            order[1] = order[0]
        parts = [gate(src, g, f"{tag}/g{g}_{k}") for k, g in enumerate(order)]
        nodes.append(helper.make_node("Concat", parts, [f"{tag}/cat"], axis=0))
        return f"{tag}/cat"

    per_dir = {"W": [], "R": [], "B": []}
    for d in range(D):
        for key, src in (("W", f"w_ih_{d}"), ("R", f"w_hh_{d}")):
            nodes.append(helper.make_node("Unsqueeze", [onnx_order(src, f"{key}{d}"), "zero"], [f"{key}{d}/u"]))
            per_dir[key].append(f"{key}{d}/u")
        cat = [onnx_order(f"b_ih_{d}", f"Bi{d}"), onnx_order(f"b_hh_{d}", f"Bh{d}")]
        nodes.append(helper.make_node("Concat", cat, [f"B{d}/cat"], axis=0))
        nodes.append(helper.make_node("Unsqueeze", [f"B{d}/cat", "zero"], [f"B{d}/u"]))
        per_dir["B"].append(f"B{d}/u")
    for key, parts in per_dir.items():
        nodes.append(helper.make_node("Concat", parts, [key], axis=0))
    rnn_attrs = {"hidden_size": H, "direction": direction}
    if op == "GRU":
        rnn_attrs["linear_before_reset"] = 1  # torch's GRU
    nodes.append(helper.make_node(op, ["X", "W", "R", "B"], ["Y"], name="rnn", **rnn_attrs))
    u = rng.standard_normal((T, D, N, H))
    nodes += [helper.make_node("Mul", ["Y", "U"], ["YU"]), helper.make_node("ReduceSum", ["YU"], ["loss"], keepdims=0)]
    if extra_reader:
        nodes += [helper.make_node("ReduceSum", ["w_ih_0"], ["wsum"], keepdims=0),
                  helper.make_node("Add", ["loss", "wsum"], ["loss_"])]
    out = "loss_" if extra_reader else "loss"
    tensors = [numpy_helper.from_array(v, k) for k, v in inits.items()]
    tensors += [numpy_helper.from_array(v, k) for k, v in consts.items()] + [numpy_helper.from_array(u, "U")]
    graph = helper.make_graph(nodes, "assembled", [helper.make_tensor_value_info("X", TensorProto.DOUBLE, [T, N, I])],
                              [helper.make_tensor_value_info(out, TensorProto.DOUBLE, [])], initializer=tensors)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m, {"X": rng.standard_normal((T, N, I))}


def _torch_order(op: str, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name[:4] in ("w_ih", "w_hh", "b_ih", "b_hh")}


CASES = [("LSTM", "forward"), ("LSTM", "bidirectional"), ("GRU", "forward"), ("GRU", "bidirectional")]


@pytest.mark.parametrize("op,direction", CASES, ids=[f"{o}-{d}" for o, d in CASES])
def test_assembled_weights_fold_into_initializers_with_the_elements_mapped_back(op, direction):
    model, feeds = assembled_model(op, direction)
    canon = canonicalize(model, "loss")
    sources = _torch_order(op, model)
    inits = {t.name: numpy_helper.to_array(t) for t in canon.graph.initializer}
    assert not set(sources) & set(inits)  # replaced by the folded W, R, B (lowered into pieces)
    record = json.loads({p.key: p.value for p in canon.metadata_props}[FOLDED_PARAMS_KEY])
    assert sorted(record) == ["B", "R", "W"]
    # the folded W is the gates in ONNX order: rows [i, o, f, c] of torch's [i, f, g, o]
    D = 2 if direction == "bidirectional" else 1
    rows = np.concatenate([np.arange(g * H, (g + 1) * H) for g in ORDER[op]])
    W = fold_recurrent_params(canon, inits)["W"]
    for d in range(D):
        np.testing.assert_array_equal(W[d], sources[f"w_ih_{d}"][rows])
    # every element back where it came from, bit for bit
    back = fold_recurrent_params(canon, inits)
    for name, value in sources.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    # which pieces hold what: torch's input weight in the input weight's piece, its biases in the bias pieces
    holders = source_holders(canon)
    dirs = ("forward", "reverse") if D == 2 else ("forward",)
    for d, tag in enumerate(dirs):
        assert holders[f"w_ih_{d}"] == [f"W.{tag}"] and holders[f"w_hh_{d}"] == [f"R.{tag}"]
        assert holders[f"b_ih_{d}"] == [f"B.{tag}.input"] and holders[f"b_hh_{d}"] == [f"B.{tag}.recurrent"]
    # the lowered, folded graph computes the original's loss
    (ours,) = ReferenceEvaluator(canon).run(None, feeds)
    assert abs(float(ours) - reference_loss(model, feeds)) <= 1e-12 * max(1.0, abs(float(ours)))


@pytest.mark.parametrize("op,direction", CASES, ids=[f"{o}-{d}" for o, d in CASES])
def test_gradients_of_the_folded_weights_match_finite_differences_of_the_original(op, direction):
    model, feeds = assembled_model(op, direction, seed=1)
    canon = canonicalize(model, "loss")
    params = [t.name for t in canon.graph.initializer if t.data_type == TensorProto.DOUBLE and t.name != "U"]
    gm = gradient_model(canon, "loss", params)
    outs = ReferenceEvaluator(gm).run([f"grad/{p}" for p in params], {**feeds, "loss_grad": np.asarray(1.0)})
    grads = fold_recurrent_params(canon, dict(zip(params, outs)))
    sources = _torch_order(op, model)
    rng = np.random.default_rng(5)
    for _ in range(2):
        v = {k: rng.standard_normal(a.shape) for k, a in sources.items()}
        eps = 1e-6
        lp = reference_loss(model, feeds, {k: a + eps * v[k] for k, a in sources.items()})
        lm = reference_loss(model, feeds, {k: a - eps * v[k] for k, a in sources.items()})
        fd = (lp - lm) / (2 * eps)
        an = sum(float(np.sum(grads[k] * v[k])) for k in sources)
        assert abs(fd - an) <= 1e-8 * max(1.0, abs(an)), (fd, an)


def test_folded_lstm_gets_structured_blocks(tmp_path):
    """compile: W (one use over all steps, kron) and R (one use per step, kron_indep) are fully
    connected layers with their biases linked, not generic layers of torch's tensors. (The trained values written back into the
    source graph: tests/test_real_exports.py's export test on the dynamo_noopt fixtures.)"""
    model, _ = assembled_model("LSTM", "bidirectional")
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    plan = kc.compile(str(path), loss="squared_error", output="Y", emit=False)
    kinds = {layer.name: (layer.kind, layer.approximation, layer.params, layer.num_uses) for layer in plan.layers}
    assert kinds == {f"{w}.{d}": ("fully_connected", approx, (f"{w}.{d}", f"B.{d}.{part}"), uses)
                     for d in ("forward", "reverse")
                     for w, part, approx, uses in (("W", "input", "kron", 1), ("R", "recurrent", "kron_indep", T))}
    assert sorted(plan.holders("w_ih_1")) == ["W.reverse"]


@pytest.mark.parametrize("edit", ["extra_reader", "dup"])
def test_what_is_not_a_permutation_of_its_initializers_is_not_folded(edit):
    """W's source also read elsewhere, or one of W's gates copied twice (one source element in
    two places, another in none): W's construction stays and w_ih_0 is trained where it is;
    R and B, assembled from their own initializers, still fold."""
    model, feeds = assembled_model("LSTM", **{edit: True})
    out = model.graph.output[0].name
    canon = canonicalize(model, out)
    record = json.loads({p.key: p.value for p in canon.metadata_props}[FOLDED_PARAMS_KEY])
    assert sorted(record) == ["B", "R"]
    inits = {t.name for t in canon.graph.initializer}
    assert "w_ih_0" in inits and "w_hh_0" not in inits
    (ours,) = ReferenceEvaluator(canon).run(None, feeds)
    assert abs(float(ours) - reference_loss(model, feeds)) <= 1e-12 * max(1.0, abs(float(ours)))


def test_fold_leaves_a_model_without_targets_alone():
    model, _ = assembled_model("GRU")
    assert fold_assembled(model, []) is model
    assert fold_assembled(model, ["X"]) is model  # a graph input: nothing to fold


def test_inspect_gives_the_users_shapes_and_the_export_writes_them_back(tmp_path):
    """The plan holds torch's w_ih_d [G H, I] ... in its own initializers (W.forward, B.forward.input,
    ...): inspect lists each source initializer with its shape in the source file and its
    holders; the default export of a plan compiled from the file writes the source's
    initializers with their own names and shapes; a plan compiled from an in-memory model
    exports its own graph and says so, naming a parameter it holds in another layout."""
    import warnings

    from kfac_compiler.report import render
    from kfac_compiler.runtime import Trainer

    model, _ = assembled_model("LSTM", "bidirectional")
    source = {t.name: list(t.dims) for t in model.graph.initializer if t.name[:4] in ("w_ih", "w_hh", "b_ih", "b_hh")}
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    plan = kc.compile(str(path), loss="squared_error", output="Y", emit=False)
    held = {h["name"]: h for h in json.loads(render(plan, "json"))["held_elsewhere"]}
    assert {n: h["shape"] for n, h in held.items()} == source
    assert held["w_ih_1"]["holders"] == [{"name": "W.reverse", "shape": [4 * H, I]}]
    assert f"  w_ih_1 [{4 * H}, {I}]: W.reverse [{4 * H}, {I}]" in render(plan, "table").splitlines()

    out = onnx.load(Trainer(plan, optimizer="sgd").export(tmp_path / "out.onnx"))
    assert {t.name: list(t.dims) for t in out.graph.initializer if t.name in source} == source
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        in_memory = kc.compile(model, loss="squared_error", output="Y", emit=False)
        Trainer(in_memory, optimizer="sgd").export(tmp_path / "plan.onnx")
    (msg,) = [str(w.message) for w in caught if str(w.message).startswith("export:")]
    assert "the plan was compiled from an in-memory model" in msg and "holds 8 of the source's initializers" in msg
