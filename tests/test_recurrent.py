"""Fused recurrent ops (LSTM, GRU, RNN) lowered during canonicalization (passes/recurrent.py):
forward equivalence with ONNX Runtime's kernels, gradients against finite differences and
torch autograd, the compiled plan's layers, and a short K-FAC run. No torch needed: the
torch values are stored fixtures (tests/fixtures/recurrent/make_fixtures.py)."""
from __future__ import annotations

import itertools
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.errors import UnsupportedOpError
from kfac_compiler.graph import fold_recurrent_params
from kfac_compiler.passes.autodiff import gradient_model, jvp_model
from kfac_compiler.passes.canonicalize import canonicalize
from kfac_compiler.passes.recurrent import METADATA_KEY, lower_recurrent
from kfac_compiler.runtime import Trainer
from recurrent_util import make_model, run, run_reference

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "recurrent")
T = 5


# ------------------------------------------------------------------------ forward equivalence
def _forward_cases():
    cases = []
    for op in ("LSTM", "GRU", "RNN"):
        extra = {"LSTM": [{}, {"peep": True}, {"input_forget": 1}], "GRU": [{"lbr": 0}, {"lbr": 1}], "RNN": [{}]}[op]
        for direction, layout, seq, init, e in itertools.product(
                ("forward", "reverse", "bidirectional"), (0, 1), (False, True), (False, True), extra):
            cases.append((op, dict(direction=direction, layout=layout, seq=seq, init=init, **e)))
    cases += [
        ("LSTM", dict(clip=0.7, direction="bidirectional", peep=True, seq=True, init=True)),
        ("LSTM", dict(clip=0.7, input_forget=1, layout=1)),
        ("GRU", dict(clip=0.5, lbr=0, direction="bidirectional")),
        ("GRU", dict(clip=0.5, lbr=1, seq=True)),
        ("RNN", dict(clip=0.3, direction="reverse", seq=True)),
        ("LSTM", dict(bias=False, direction="bidirectional")),
        ("GRU", dict(bias=False, lbr=0)),
        ("RNN", dict(bias=False, init=True)),
    ]
    acts = ["Sigmoid", "Tanh", "Relu", "HardSigmoid", "LeakyRelu", "Affine", "ScaledTanh", "Elu", "Softsign",
            "Softplus", "ThresholdedRelu"]
    for act in acts:
        cases.append(("RNN", dict(acts=[act])))  # default alpha/beta
        cases.append(("RNN", dict(acts=[act, act], direction="bidirectional", alphas=[0.3, 0.6], betas=[0.4, 0.8])))
    cases.append(("LSTM", dict(acts=["HardSigmoid", "Affine", "ScaledTanh"], alphas=[0.3, 0.6, 0.9],
                               betas=[0.4, 0.1, 0.5], peep=True)))
    cases.append(("GRU", dict(acts=["HardSigmoid", "LeakyRelu", "Sigmoid", "Elu"], direction="bidirectional",
                              alphas=[0.3, 0.6, 0.9], betas=[0.4], lbr=0)))
    cases.append(("LSTM", dict(acts=["Sigmoid", "Softsign", "Softplus", "Sigmoid", "Tanh", "Relu"],
                               direction="bidirectional", seq=True)))
    return cases


FORWARD_CASES = _forward_cases()


def _id(case):
    op, kw = case
    return op + "-" + "-".join(f"{k}={'+'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in kw.items())


@pytest.mark.slow
@pytest.mark.parametrize("case", FORWARD_CASES, ids=[_id(c) for c in FORWARD_CASES])
def test_forward_matches_onnxruntime(case):
    op, kw = case
    model, feeds = make_model(op, **kw)
    ref = run_reference(op, feeds, **kw)
    lowered = lower_recurrent(onnx.shape_inference.infer_shapes(model))
    assert not any(n.op_type in ("LSTM", "GRU", "RNN") for n in lowered.graph.node)
    got = run(lowered, feeds)
    assert len(got) == len(ref) == (3 if op == "LSTM" else 2)
    for name, r, g in zip(("Y", "Y_h", "Y_c"), ref, got):
        assert r.shape == g.shape, name
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("output", ["Y", "Y_h", "Y_c"])
def test_canonicalize_lowers_each_output_and_replaces_the_initializers(output):
    kw = dict(direction="bidirectional", seq=True, init=True, peep=True)
    model, feeds = make_model("LSTM", **kw)
    canon = canonicalize(model, output)
    ops = {n.op_type for n in canon.graph.node}
    assert not ops & {"LSTM", "GRU", "RNN"} and {"Gemm", "Where", "Sigmoid"} <= ops
    inits = {t.name: tuple(t.dims) for t in canon.graph.initializer}
    H, I = 4, 3
    assert inits == {
        "W.forward": (4 * H, I), "W.reverse": (4 * H, I), "R.forward": (4 * H, H), "R.reverse": (4 * H, H),
        "B.forward.input": (4 * H,), "B.forward.recurrent": (4 * H,), "B.reverse.input": (4 * H,),
        "B.reverse.recurrent": (4 * H,), "P.forward": (3 * H,), "P.reverse": (3 * H,),
    }
    ref = run_reference("LSTM", feeds, **kw)[("Y", "Y_h", "Y_c").index(output)]
    np.testing.assert_allclose(run(canon, feeds)[0], ref, rtol=0, atol=1e-5)
    # the record maps the pieces back onto the original initializers
    values = {t.name: numpy_helper.to_array(t) for t in canon.graph.initializer}
    folded = fold_recurrent_params(canon, values)
    originals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert set(folded) == set(originals)
    for k in originals:
        np.testing.assert_array_equal(folded[k], originals[k])
    assert any(p.key == METADATA_KEY for p in canon.metadata_props)


def test_gru_linear_before_reset_0_splits_r_into_two_layers_of_its_own():
    model, feeds = make_model("GRU", lbr=0)
    canon = canonicalize(model, "Y")
    inits = {t.name: tuple(t.dims) for t in canon.graph.initializer}
    assert inits == {"W.forward": (12, 3), "R.forward": (8, 4), "R.forward.candidate": (4, 4),
                     "B.forward.input": (12,), "B.forward.recurrent": (8,), "B.forward.recurrent.candidate": (4,)}


def test_dynamic_batch_is_fine_and_dynamic_sequence_length_is_a_one_line_error():
    model, feeds = make_model("LSTM", batch="N", seq=True)
    canon = canonicalize(model, "Y_h")
    np.testing.assert_allclose(run(canon, feeds)[0], run_reference("LSTM", feeds, seq=True)[1], atol=1e-5)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    with pytest.raises(UnsupportedOpError) as e:
        canonicalize(model, "Y")
    msg = str(e.value)
    assert "\n" not in msg and "'rnn_node'" in msg and "static sequence length" in msg


def test_unknown_activation_is_a_one_line_error():
    model, _ = make_model("RNN", acts=["Gelu"])
    with pytest.raises(UnsupportedOpError, match=r"node 'rnn_node': op RNN uses activation 'Gelu'"):
        canonicalize(model, "Y")


def test_weights_that_are_graph_inputs_are_sliced_with_ops():
    model, feeds = make_model("GRU", direction="bidirectional", lbr=0)
    g = model.graph
    w = next(t for t in g.initializer if t.name == "W")
    feeds = dict(feeds, W=numpy_helper.to_array(w))
    g.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w.dims)))
    kept = [t for t in g.initializer if t.name != "W"]
    del g.initializer[:]
    g.initializer.extend(kept)
    canon = canonicalize(model, "Y")
    assert "W" in [i.name for i in canon.graph.input]
    ref = run_reference("GRU", feeds, direction="bidirectional", lbr=0)[0]
    np.testing.assert_allclose(run(canon, feeds)[0], ref, atol=1e-5)


# ------------------------------------------------------------------------------ gradients
GRAD_CASES = [
    ("LSTM", dict(direction="bidirectional", seq=True, init=True, peep=True)),
    ("LSTM", dict(direction="reverse", layout=1, seq=True, init=True, input_forget=1, clip=0.8)),
    ("GRU", dict(lbr=0, direction="bidirectional", seq=True, init=True)),
    ("GRU", dict(lbr=1, direction="reverse", layout=1, clip=0.9, init=True)),
    ("RNN", dict(direction="bidirectional", seq=True, init=True)),
    ("RNN", dict(acts=["Relu"], layout=1)),
    # HardSigmoid 0.1x + 0.5: kinks at +-5, out of reach of the float32 differences of (c)
    ("LSTM", dict(acts=["HardSigmoid", "Softplus", "ScaledTanh"], alphas=[0.1, 0.9], betas=[0.5, 0.7])),
    ("GRU", dict(acts=["Sigmoid", "LeakyRelu"], alphas=[0.2], lbr=0, seq=True)),
    # a symbolic batch: the steps' shared batch symbol, Y's gradient split in equal parts
    ("LSTM", dict(batch="N", direction="bidirectional", layout=1)),
    ("LSTM", dict(batch="N", seq=True, clip=0.9)),
    ("GRU", dict(batch="N", lbr=1, direction="bidirectional")),
]
OUTS = {"LSTM": ("Y", "Y_h", "Y_c"), "GRU": ("Y", "Y_h"), "RNN": ("Y", "Y_h")}


def _with_loss(model, op, shapes, seed=0):
    """loss = sum_o sum(o * U_o) over the op's outputs, U_o fixed random Constants."""
    rng = np.random.default_rng(seed + 100)
    g = model.graph
    dt = g.input[0].type.tensor_type.elem_type
    npf = np.float64 if dt == TensorProto.DOUBLE else np.float32
    terms = []
    for o, shape in zip(OUTS[op], shapes):
        u = rng.standard_normal(shape).astype(npf)
        g.node.extend([
            helper.make_node("Constant", [], [f"U_{o}"], value=numpy_helper.from_array(u, f"U_{o}")),
            helper.make_node("Mul", [o, f"U_{o}"], [f"{o}_u"]),
            helper.make_node("ReduceSum", [f"{o}_u"], [f"{o}_s"], keepdims=0),
        ])
        terms.append(f"{o}_s")
    g.node.append(helper.make_node("Sum", terms, ["loss"]))
    g.output.append(helper.make_tensor_value_info("loss", dt, []))
    return model


def _as_inputs(model, names):
    """A copy with the initializers `names` turned into graph inputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    moved = [t for t in g.initializer if t.name in names]
    kept = [t for t in g.initializer if t.name not in names]
    del g.initializer[:]
    g.initializer.extend(kept)
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
    return m, {t.name: numpy_helper.to_array(t) for t in moved}


def _loss(model, feeds):
    return float(run(model, feeds, ["loss"])[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", GRAD_CASES, ids=[_id(c) for c in GRAD_CASES])
def test_gradients_match_finite_differences(case):
    op, kw = case
    shapes = [r.shape for r in run_reference(op, make_model(op, **kw)[1], **kw)]
    m64, feeds = make_model(op, dtype=TensorProto.DOUBLE, **kw)
    canon = canonicalize(_with_loss(m64, op, shapes), "loss")
    params = [t.name for t in canon.graph.initializer]
    states = [k for k in ("X", "initial_h", "initial_c") if k in feeds]
    gm = gradient_model(canon, "loss", params, extra_wrt=states)
    outs = run(gm, dict(feeds, loss_grad=np.asarray(1.0)), [f"grad/{p}" for p in params + states])
    grads = dict(zip(params + states, outs))
    # (a) float64 central differences on the lowered graph, along random directions
    fm, pvals = _as_inputs(canon, params)
    point = {**feeds, **pvals}
    rng = np.random.default_rng(7)
    for _ in range(2):
        v = {k: rng.standard_normal(point[k].shape) for k in params + states}
        eps = 1e-6
        lp = _loss(fm, {**point, **{k: point[k] + eps * v[k] for k in v}})
        lm = _loss(fm, {**point, **{k: point[k] - eps * v[k] for k in v}})
        fd = (lp - lm) / (2 * eps)
        an = sum(float(np.sum(grads[k] * v[k])) for k in v)
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), (fd, an)
    # (b) forward mode on the lowered graph: J v == <grad, v>
    jm = jvp_model(canon, "loss", params)
    v = {k: rng.standard_normal(point[k].shape) for k in params}
    (jv,) = run(jm, {**feeds, **{f"tangent/{k}": v[k] for k in params}}, ["jvp/loss"])
    an = sum(float(np.sum(grads[k] * v[k])) for k in params)
    assert abs(float(jv) - an) <= 1e-9 * max(1.0, abs(an))
    # (c) float32 central differences on ONNX Runtime's fused op (it has no float64 kernels),
    # gradients folded back to W/R/B/P. Only for smooth cells: a float32 step large enough to
    # beat rounding (1e-3) crosses kinks of Clip/Relu/LeakyRelu (errors up to 30% seen), and
    # those cases are covered by the float64 differences of (a).
    if kw.get("clip") is not None or {"Relu", "LeakyRelu"} & set(kw.get("acts", ())):
        return
    folded = fold_recurrent_params(canon, grads)
    m32, feeds32 = make_model(op, **kw)
    originals = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in m32.graph.initializer}
    assert set(folded) == set(originals)
    v = {k: rng.standard_normal(a.shape) for k, a in originals.items()}
    eps = 1e-3

    def loss32(sign):
        m, f = make_model(op, inits={k: a + sign * eps * v[k] for k, a in originals.items()}, **kw)
        ys = run_reference(op, f, inits={k: a + sign * eps * v[k] for k, a in originals.items()}, **kw)
        rng_u = np.random.default_rng(100)
        return sum(float(np.sum(y.astype(np.float64) * rng_u.standard_normal(s))) for y, s in zip(ys, shapes))

    fd = (loss32(1) - loss32(-1)) / (2 * eps)
    an = sum(float(np.sum(folded[k] * v[k])) for k in originals)
    assert abs(fd - an) <= 1e-3 * max(1.0, abs(an)), (fd, an)


# ------------------------------------------------------------------------ torch autograd
@pytest.mark.parametrize("name", ["lstm2", "gru", "rnn_bidirectional"])
def test_gradients_match_torch_autograd(name):
    data = np.load(os.path.join(FIXTURES, f"{name}.npz"))
    plan = kc.compile(os.path.join(FIXTURES, f"{name}.onnx"), loss="softmax_cross_entropy", output="logits",
                      emit=False)
    loss, grads = kc.gradients(plan, {"input": data["input"]}, data["targets"])
    assert abs(float(loss) - float(data["loss"])) <= 1e-5
    ours = {**grads, **fold_recurrent_params(plan.model, grads)}
    keys = [k[len("grad:"):] for k in data.files if k.startswith("grad:")]
    assert len(keys) >= 5
    for k in keys:
        ref = data[f"grad:{k}"]
        np.testing.assert_allclose(ours[k], ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())), err_msg=k)


def test_each_concatenation_of_the_steps_cotangents_is_emitted_once():
    """W's gradient (one Gemm over the T*N rows: the cotangents of its Split, concatenated in
    time order) and R's fused per-step gradients read the same gate cotangents: one Concat
    of them, not one per order (issue 40: no value computed twice; 8 MB a step on the byte LM)."""
    from kfac_compiler.backend.registry import emit_subgraph
    plan = kc.compile(os.path.join(FIXTURES, "lstm2.onnx"), loss="softmax_cross_entropy", output="logits",
                      emit=False)
    model, _ = emit_subgraph(plan, "adam_step")
    concats = [frozenset(n.input) for n in model.graph.node if n.op_type == "Concat" and len(n.input) >= T]
    assert len(concats) >= 4  # per layer: the forward's outputs, the states R reads, the gate cotangents
    assert len(set(concats)) == len(concats)


# ----------------------------------------------------------------------------- the plan
def test_plan_makes_w_one_use_over_all_steps_and_r_multi_use_fully_connected_layers_with_linked_biases():
    plan = kc.compile(os.path.join(FIXTURES, "lstm2.onnx"), loss="softmax_cross_entropy", output="logits",
                      emit=False)
    nodes = [n for n in onnx.load(os.path.join(FIXTURES, "lstm2.onnx")).graph.node if n.op_type == "LSTM"]
    assert len(nodes) == 2
    rec = [l for l in plan.layers if l.name != "fc"]
    assert len(rec) == 4
    for node in nodes:
        W, R, B = node.input[1:4]
        for weight, bias in ((W, f"{B}.forward.input"), (R, f"{B}.forward.recurrent")):
            layer = plan.layer(f"{weight}.forward")
            assert layer.kind == "fully_connected" and layer.pattern == "gemm_out_in_bias"
            assert layer.params == (f"{weight}.forward", bias)
            # W: one Gemm over the T*N time-major rows (the input projection hoisted out of the
            # recurrence); R: one use per step
            uses, approx = (1, "kron") if weight == W else (T, "kron_indep")
            assert layer.num_uses == uses and layer.approximation == approx
    assert plan.layer("fc").num_uses == 1
    series = kc.compile(os.path.join(FIXTURES, "lstm2.onnx"), loss="softmax_cross_entropy", output="logits",
                        emit=False, approximations={"fully_connected_multi": "kron_series_1"})
    got = {l.name: l.approximation for l in series.layers if l.name != "fc"}
    assert got == {f"{n.input[k]}.forward": a for n in nodes for k, a in ((1, "kron"), (2, "kron_series_1"))}


def test_bidirectional_plan_has_one_layer_per_direction():
    plan = kc.compile(os.path.join(FIXTURES, "rnn_bidirectional.onnx"), loss="softmax_cross_entropy",
                      output="logits", emit=False)
    rec = [l for l in plan.layers if l.name != "fc"]
    assert sorted(l.name.rsplit(".", 1)[1] for l in rec) == ["forward", "forward", "reverse", "reverse"]
    assert all(len(l.params) == 2 for l in rec)
    assert sorted(l.num_uses for l in rec) == [1, 1, T, T]  # W over all steps at once, R per step


# ----------------------------------------------------------------------------- training
def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, T, 3)).astype(np.float32)
    return x, np.argmax(x[:, 0, :] + x[:, -1, :], axis=1).astype(np.int64)


@pytest.mark.parametrize("approx", ["kron_indep", pytest.param("kron_series_1", marks=pytest.mark.slow)])
def test_kfac_training_lowers_the_loss_and_exports_the_lowered_model(approx, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kc.compile(os.path.join(FIXTURES, "gru.onnx"), loss="softmax_cross_entropy", output="logits",
                          emit=False, approximations={"fully_connected_multi": approx})
    x, y = _data(64, 0)
    tr = Trainer(plan, optimizer="kfac", seed=0, inv_update_period=2)
    before = tr.evaluate({"input": x}, y)["loss"]
    for _ in range(12):
        tr.step({"input": x}, y)
    after = tr.evaluate({"input": x}, y)["loss"]
    assert after < 0.8 * before, (before, after)
    path = tr.export(tmp_path / "trained.onnx", graph="plan")
    trained = onnx.load(path)
    assert not any(n.op_type == "GRU" for n in trained.graph.node)
    values = {t.name: numpy_helper.to_array(t) for t in trained.graph.initializer}
    folded = fold_recurrent_params(trained, values)
    assert {a.shape for a in folded.values()} == {(1, 12, 3), (1, 12, 4), (1, 24)}


# --------------------------------------------------------------- K-FAC's view of the hoisting
def _torch_lstm2_cotangents(model: onnx.ModelProto, x: np.ndarray, targets: np.ndarray):
    """torch autograd on lstm2's two LSTM layers written out gate by gate from the ONNX
    initializers (ONNX gate order i, o, f, c): per layer its input rows x_t [N, I] and the
    cotangents dz_t [N, 4H] of the gate pre-activations under the summed cross-entropy (the
    empirical statistics' per-example losses), and the logits' cotangent."""
    torch = pytest.importorskip("torch")
    inits = {t.name: torch.tensor(numpy_helper.to_array(t), dtype=torch.float64, requires_grad=True)
             for t in model.graph.initializer}
    lstms = [n for n in model.graph.node if n.op_type == "LSTM"]
    h_in = list(torch.tensor(x, dtype=torch.float64).unbind(1))  # batch_first: T tensors [N, I]
    layers = []
    for node in lstms:
        W, R, B = (inits[k][0] for k in node.input[1:4])
        H = R.shape[1]
        h = c = torch.zeros(x.shape[0], H, dtype=torch.float64)
        zs, outs = [], []
        for xt in h_in:
            z = xt @ W.T + B[:4 * H] + h @ R.T + B[4 * H:]
            z.retain_grad()
            i, o, f = torch.sigmoid(z[:, :3 * H]).split(H, dim=1)
            c = f * c + i * torch.tanh(z[:, 3 * H:])
            h = o * torch.tanh(c)
            zs.append(z)
            outs.append(h)
        layers.append(([t.detach().numpy() for t in h_in], zs))
        h_in = outs
    logits = h_in[-1] @ inits["fc.weight"].T + inits["fc.bias"]
    logits.retain_grad()
    torch.nn.functional.cross_entropy(logits, torch.tensor(targets), reduction="sum").backward()
    per_layer = [(xs, [z.grad.numpy() for z in zs]) for xs, zs in layers]
    return per_layer, logits.grad.numpy()


def test_hoisted_input_projection_keeps_the_kronecker_factors():
    """The input weight W is one Gemm over the T*N time-major rows; its factors must be what
    the per-step form (T uses, kron_indep) gave: A = 1/(T N) sum_{t,n} a~ a~^T over the
    steps' inputs, G = 1/N sum_{t,n} dz dz^T over the gate pre-activations' cotangents, the
    same G as the recurrent weight R (per step, unchanged) sees. Truth: torch autograd in
    float64 on the two layers written out, the empirical statistics of one batch."""
    from kfac_compiler.backend import emit_subgraph
    path = os.path.join(FIXTURES, "lstm2.onnx")
    data = np.load(os.path.join(FIXTURES, "lstm2.npz"))
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False)
    sub, _ = emit_subgraph(plan, "statistics", mode="empirical")
    feeds = {"input": data["input"], "targets": data["targets"].astype(np.int64)}
    feeds.update({t.name: numpy_helper.to_array(t) for t in plan.model.graph.initializer if t.name in plan.trainable})
    got = dict(zip([o.name for o in sub.graph.output], run(sub, feeds, [o.name for o in sub.graph.output])))
    model = onnx.load(path)
    per_layer, dlogits = _torch_lstm2_cotangents(model, data["input"], data["targets"])
    n = data["input"].shape[0]

    def close(ours, truth, what):
        np.testing.assert_allclose(ours, truth, rtol=2e-5, atol=2e-6 * float(np.abs(truth).max()), err_msg=what)

    # the head (no recurrence) calibrates the convention: G = 1/N sum_n d d^T of the summed loss
    close(got["stat/fc/G"], dlogits.T @ dlogits / n, "fc G")
    for node, (xs, dzs) in zip([nd for nd in model.graph.node if nd.op_type == "LSTM"], per_layer):
        W, R = (f"{node.input[k]}.forward" for k in (1, 2))
        assert plan.layer(W).num_uses == 1 and plan.layer(R).num_uses == T
        rows = np.concatenate([np.concatenate([x, np.ones((n, 1))], 1) for x in xs])  # [T*N, I+1] time-major
        close(got[f"stat/{W}/A"], rows.T @ rows / len(rows), f"{W} A")
        G = sum(d.T @ d for d in dzs) / n
        close(got[f"stat/{W}/G"], G, f"{W} G")
        close(got[f"stat/{R}/G"], G, f"{R} G")
        np.testing.assert_allclose(got[f"stat/{W}/G"], got[f"stat/{R}/G"], rtol=1e-6, atol=1e-7, err_msg=W)
