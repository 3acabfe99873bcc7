"""Loss masks for language models: softmax cross-entropy's ignore_index and per-position
weights, in the loss, the gradients, the curvature statistics, training and evaluation.

Truth: torch's cross_entropy(ignore_index=...) and autograd on a twin of the model (float64),
a brute-force numpy computation of the masked Kronecker factors (per-position Jacobians of a
model without position mixing, exact mode), and runs on data that differs only where it is
masked (bit-identical results) or is the same data without its padding."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.errors import ConfigError, DataError
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.runtime import Curvature, Trainer

V, D, H, T = 7, 5, 6, 4
IGNORE = -100
SCE = "softmax_cross_entropy"


def lm(causal: bool = True, seq: int | str = T, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """tokens [N, seq] -> embedding -> fc1 + tanh -> (causal: a running sum over the positions)
    -> head -> logits [N, seq, V]; the model and its parameters."""
    rng = np.random.default_rng(seed)
    w = {"emb.weight": rng.normal(size=(V, D)), "fc1.weight": rng.normal(size=(D, H)) / np.sqrt(D),
         "fc1.bias": 0.1 * rng.normal(size=H), "head.weight": rng.normal(size=(H, V)) / np.sqrt(H),
         "head.bias": 0.1 * rng.normal(size=V)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    inits = [numpy_helper.from_array(v, k) for k, v in w.items()]
    nodes = [helper.make_node("Gather", ["emb.weight", "tokens"], ["e"], name="emb/Gather"),
             helper.make_node("MatMul", ["e", "fc1.weight"], ["m1"], name="fc1/MatMul"),
             helper.make_node("Add", ["m1", "fc1.bias"], ["u1"], name="fc1/Add"),
             helper.make_node("Tanh", ["u1"], ["h1"], name="tanh")]
    h = "h1"
    if causal:
        inits.append(numpy_helper.from_array(np.array(1, np.int64), "time_axis"))
        nodes.append(helper.make_node("CumSum", ["h1", "time_axis"], ["c"], name="causal/CumSum"))
        h = "c"
    nodes += [helper.make_node("MatMul", [h, "head.weight"], ["m2"], name="head/MatMul"),
              helper.make_node("Add", ["m2", "head.bias"], ["logits"], name="head/Add")]
    g = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["N", seq])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", seq, V])],
                          initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, w


def lm_plan(causal: bool = True, seq: int | str = T, **options) -> tuple[kc.Plan, dict[str, np.ndarray]]:
    model, w = lm(causal, seq)
    return kc.compile(model, loss=SCE, output="logits", loss_options=options, emit=False), w


def padded_batch(rng, n: int = 6, seq: int = T):
    """Tokens and labels [n, seq] with a right padding of 0..seq-1 positions per example:
    (tokens, labels with IGNORE at the padding, the 0/1 mask of the positions that count)."""
    x = rng.integers(0, V, size=(n, seq))
    y = rng.integers(0, V, size=(n, seq))
    lengths = rng.integers(1, seq + 1, size=n)
    lengths[0] = seq  # one example without padding
    keep = np.arange(seq)[None, :] < lengths[:, None]
    return x, np.where(keep, y, IGNORE), keep


def repadded(rng, x, y, keep):
    """The same batch with other tokens and labels at the masked positions."""
    x2 = np.where(keep, x, rng.integers(0, V, size=x.shape))
    y2 = np.where(keep, y, rng.integers(0, V, size=y.shape))
    return x2, y2


# ------------------------------------------------------------------------------ vs torch
def torch_loss_and_grads(w, x, y, reduce):
    """torch's loss `reduce(per-position cross-entropy [N, T] with ignore_index, logits)`
    and its gradients, float64, on the causal model's twin."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    tw = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    h = torch.tanh(F.embedding(torch.tensor(x), tw["emb.weight"]) @ tw["fc1.weight"] + tw["fc1.bias"]).cumsum(1)
    logits = h @ tw["head.weight"] + tw["head.bias"]
    loss = reduce(F, logits, torch.tensor(y))
    loss.backward()
    return loss.item(), {k: t.grad.numpy() for k, t in tw.items()}


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-12))


@pytest.mark.parametrize("case", ["ignore_index", "position_weights", "example_weights", "both"])
def test_loss_and_gradients_match_torch_cross_entropy(case):
    """ignore_index is torch's: the mean over the targets that count (reduction="mean");
    weights w multiply each position's loss, L = 1/N sum w l (with ignore_index: divided by
    the number of targets that count instead of N). Max relative errors against torch's
    float64 values: below 4e-7 for the loss and 3e-7 for every parameter gradient."""
    rng = np.random.default_rng(3)
    x, y, keep = padded_batch(rng)
    n = len(x)
    w_pos = rng.uniform(0.0, 2.0, size=y.shape).astype(np.float32)
    w_ex = rng.uniform(0.0, 2.0, size=n).astype(np.float32)

    def ce(F, logits, labels):  # per position, 0 where ignored
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE,
                               reduction="none").reshape(labels.shape)

    torch = pytest.importorskip("torch")
    if case == "ignore_index":
        options, weights, labels = {"ignore_index": IGNORE}, None, y

        def reduce(F, logits, t):
            return F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), ignore_index=IGNORE)
    elif case == "position_weights":  # no ignore_index: the masked labels are any class
        options, weights, labels = {}, w_pos * keep, np.where(keep, y, 0)

        def reduce(F, logits, t):
            return (torch.tensor(w_pos * keep, dtype=torch.float64) * ce(F, logits, t)).sum() / n
    elif case == "example_weights":
        options, weights, labels = {}, w_ex, np.where(keep, y, 0)

        def reduce(F, logits, t):
            return (torch.tensor(w_ex[:, None], dtype=torch.float64) * ce(F, logits, t)).sum() / n
    else:
        options, weights, labels = {"ignore_index": IGNORE}, w_pos, y

        def reduce(F, logits, t):
            return (torch.tensor(w_pos, dtype=torch.float64) * ce(F, logits, t)).sum() / keep.sum()
    plan, w = lm_plan(**options)
    loss, grads = kc.gradients(plan, {"tokens": x}, labels, weights=weights)
    ref_loss, ref_grads = torch_loss_and_grads(w, x, labels, reduce)
    assert abs(loss - ref_loss) / ref_loss < 4e-7
    for p, g in ref_grads.items():
        assert rel_err(grads[p], g) < 3e-7, p


def test_evaluate_masks_loss_and_accuracy_and_does_not_depend_on_chunks():
    """Trainer.evaluate with ignore_index: torch's masked mean loss and the accuracy over the
    targets that count, the same in chunks of 2 examples (the mean is over the whole set)."""
    rng = np.random.default_rng(4)
    x, y, keep = padded_batch(rng, n=7)
    plan, w = lm_plan(ignore_index=IGNORE)
    tr = Trainer(plan)
    whole, chunked = tr.evaluate({"tokens": x}, y), tr.evaluate({"tokens": x}, y, batch_size=2)
    ref, _ = torch_loss_and_grads(w, x, y, lambda F, logits, t: F.cross_entropy(
        logits.reshape(-1, V), t.reshape(-1), ignore_index=IGNORE))
    logits = tr.predict({"tokens": x})
    accuracy = np.sum((np.argmax(logits, -1) == y) & keep) / keep.sum()
    assert whole["loss"] == pytest.approx(ref, rel=1e-6) and chunked["loss"] == pytest.approx(ref, rel=1e-6)
    assert whole["accuracy"] == pytest.approx(accuracy, abs=1e-12) and chunked["accuracy"] == whole["accuracy"]


# ------------------------------------------------------------------------------ curvature
def brute_force_factors(w, x, weights):
    """The Kronecker factors of the weighted loss 1/N sum w_nt l_nt in exact mode, from
    their definitions (float64), on the model without position mixing: G = 1/N sum_nt w_nt
    J_nt^T F_nt J_nt with J_nt = dz_nt / d(layer output at n, t), F = diag(p) - p p^T; A (and
    the embedding's token frequencies) the mean over the positions with w_nt > 0."""
    W = {k: v.astype(np.float64) for k, v in w.items()}
    n = len(x)
    e = W["emb.weight"][x]                                   # [N, T, D]
    h1 = np.tanh(e @ W["fc1.weight"] + W["fc1.bias"])        # [N, T, H]
    z = h1 @ W["head.weight"] + W["head.bias"]
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    G = {"head": np.zeros((V, V)), "fc1": np.zeros((H, H)), "emb": np.zeros((D, D))}
    for i, t in np.ndindex(*x.shape):
        F = np.diag(p[i, t]) - np.outer(p[i, t], p[i, t])
        J_u1 = W["head.weight"].T * (1 - h1[i, t] ** 2)       # dz / du1 [V, H]
        J_e = J_u1 @ W["fc1.weight"].T                        # dz / de  [V, D]
        for layer, J in (("head", np.eye(V)), ("fc1", J_u1), ("emb", J_e)):
            G[layer] += weights[i, t] * J.T @ F @ J / n
    kept = weights > 0
    ones = np.ones((int(kept.sum()), 1))
    A_head = np.hstack([h1[kept], ones])
    A_fc1 = np.hstack([e[kept], ones])
    return {"head": {"A": A_head.T @ A_head / len(A_head), "G": G["head"]},
            "fc1": {"A": A_fc1.T @ A_fc1 / len(A_fc1), "G": G["fc1"]},
            "emb": {"A": np.bincount(x[kept], minlength=V) / kept.sum(), "G": G["emb"]}}


@pytest.mark.parametrize("case", ["ignore_index", "weights"])
def test_exact_masked_factors_equal_the_brute_force_ones(case):
    """Exact mode: every layer's A and G against brute_force_factors. ignore_index weighs
    each position that counts N / #kept (torch's mean); explicit weights (here 0, 0.5..2)
    weigh the G terms and drop the zero-weight positions from A. Max relative error 3e-6
    (measured: 1.6e-7)."""
    rng = np.random.default_rng(5)
    x, y, keep = padded_batch(rng)
    if case == "ignore_index":
        plan, w = lm_plan(causal=False, ignore_index=IGNORE)
        stats = Curvature(plan).estimate({"tokens": x}, y, mode="exact")
        weights = keep * len(x) / keep.sum()
    else:
        plan, w = lm_plan(causal=False)
        weights = keep * rng.uniform(0.5, 2.0, size=keep.shape)
        stats = Curvature(plan).estimate({"tokens": x}, np.where(keep, y, 0), mode="exact", weights=weights)
    truth = brute_force_factors(w, x, weights)
    for layer, factors in truth.items():
        for f, ref in factors.items():
            assert rel_err(stats[layer][f], ref) < 3e-6, (layer, f)


@pytest.mark.parametrize("mode", ["gradients", "empirical", "curvature_prop", "exact"])
def test_masked_positions_change_no_statistic(mode):
    """Every estimation mode: other tokens and other labels at the masked positions (weights
    0 there) leave every factor bit-identical (the causal model: a masked position's output
    depends on the positions before it, which count). Without the mask they do change A."""
    rng = np.random.default_rng(6)
    x, y, keep = padded_batch(rng)
    x2, y2 = repadded(rng, x, y, keep)
    plan, _ = lm_plan()
    mask = keep.astype(np.float32)
    first = Curvature(plan, seed=1).estimate({"tokens": x}, y.clip(0), mode=mode, weights=mask)
    second = Curvature(plan, seed=1).estimate({"tokens": x2}, y2.clip(0), mode=mode, weights=mask)
    for layer in first:
        for f in first[layer]:
            np.testing.assert_array_equal(first[layer][f], second[layer][f], err_msg=f"{layer} {f}")
    unmasked = Curvature(plan, seed=1).estimate({"tokens": x2}, y2.clip(0), mode=mode)
    assert not np.array_equal(unmasked["fc1"]["A"], first["fc1"]["A"])


# ------------------------------------------------------------------------------ training
@pytest.mark.slow
@pytest.mark.parametrize("how", ["ignore_index", "weights"])
def test_kfac_training_does_not_see_the_padding(how):
    """The zoo's causal transformer LM (tied embedding head, LayerNorms, attention), four
    K-FAC steps with its defaults (sampled Fisher, quadratic model, damping adaptation) on
    right-padded batches: other padding tokens (and, with weights, other padding labels)
    give bit-identical parameters, losses and evaluation."""
    inputs, y = ZOO["transformer_block"].make_data(24, seed=0)
    x = inputs["input"]
    rng = np.random.default_rng(7)
    seq = x.shape[1]
    keep = np.arange(seq)[None, :] < rng.integers(2, seq + 1, size=len(x))[:, None]
    x2, y2 = repadded(rng, x, y, keep)  # padding tokens and labels 0..6 of the 17

    def run(tokens, labels):
        if how == "ignore_index":
            plan = kc.compile(get_model("transformer_block"), loss=SCE, output="logits",
                              loss_options={"ignore_index": IGNORE}, emit=False)
            labels, weights = np.where(keep, labels, IGNORE), None
        else:
            plan = kc.compile(get_model("transformer_block"), loss=SCE, output="logits", emit=False)
            weights = keep.astype(np.float32)
        tr = Trainer(plan, seed=3)
        losses = [tr.step({"input": tokens}, labels, weights=weights)["loss"] for _ in range(4)]
        return losses, tr.parameters(), tr.evaluate({"input": tokens}, labels, weights=weights)

    first, second = run(x, y), run(x2, y2)
    assert first[0] == second[0] and first[2] == second[2]
    for p in first[1]:
        np.testing.assert_array_equal(first[1][p], second[1][p], err_msg=p)
    assert first[0][-1] < first[0][0]


@pytest.mark.slow
def test_padded_batches_train_like_the_unpadded_data():
    """A model of any length (tokens [N, "T"]) trained by K-FAC (empirical Fisher: no noise,
    whose shape would follow the length) on batches padded from 4 to 6 positions with
    ignore_index, and on the same batches without the padding: the same losses and
    parameters up to float32 rounding (max relative difference 2e-6 over 3 steps; measured:
    losses 6e-8, parameters 3.5e-7)."""
    rng = np.random.default_rng(8)
    plan, _ = lm_plan(seq="T", ignore_index=IGNORE)
    x = rng.integers(0, V, size=(8, 4))
    y = rng.integers(0, V, size=(8, 4))
    xp = np.concatenate([x, rng.integers(0, V, size=(8, 2))], axis=1)
    yp = np.concatenate([y, np.full((8, 2), IGNORE)], axis=1)
    runs = []
    for tokens, labels in ((x, y), (xp, yp)):
        tr = Trainer(plan, mode="empirical")
        losses = [tr.step({"tokens": tokens}, labels)["loss"] for _ in range(3)]
        runs.append((losses, tr.parameters()))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=2e-6)
    for p, ref in runs[0][1].items():
        assert rel_err(runs[1][1][p], ref) < 2e-6, p


# ------------------------------------------------------------------------------ other losses
def test_squared_error_takes_weights_per_position():
    """squared_error on an output [N, T, 3] with weights [N, T] (a prefix of the output's
    shape, broadcast over the last axis): loss and gradients of z = x W + b against the
    numpy twin 1/N sum_nt w_nt |z_nt - y_nt|^2 / 2."""
    rng = np.random.default_rng(9)
    Wt, bt = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["m"], name="fc/MatMul"),
         helper.make_node("Add", ["m", "b"], ["z"], name="fc/Add")], "reg",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 5, 3])],
        initializer=[numpy_helper.from_array(Wt, "W"), numpy_helper.from_array(bt, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    plan = kc.compile(model, loss="squared_error", output="z", emit=False)
    x = rng.normal(size=(6, 5, 4)).astype(np.float32)
    y = rng.normal(size=(6, 5, 3)).astype(np.float32)
    w = rng.uniform(0, 2, size=(6, 5)).astype(np.float32)
    loss, grads = kc.gradients(plan, {"x": x}, y, weights=w)
    X, d = x.astype(np.float64), x.astype(np.float64) @ Wt + bt - y
    wd = w[..., None] * d / len(x)
    assert loss == pytest.approx(float(np.sum(w[..., None] * d ** 2) / 2 / len(x)), rel=1e-6)
    assert rel_err(grads["W"], np.einsum("ntk,nto->ko", X, wd)) < 1e-6
    assert rel_err(grads["b"], wd.sum((0, 1))) < 1e-6


# ------------------------------------------------------------------------------ bad input
def test_bad_weights_and_ignore_index_are_one_line_errors():
    rng = np.random.default_rng(10)
    x, y, keep = padded_batch(rng)
    plan, _ = lm_plan(ignore_index=IGNORE)
    tr = Trainer(plan)
    good = keep.astype(np.float32)
    bad = [(good[:, :2], r"weights: got shape \[6, 2\]; expected one weight per example \(\[6\]\) or per position "
                         r"\(\[6, 4\], or its leading axes\)"),
           (good[..., None], r"got shape \[6, 4, 1\]"),
           (-good, "weights must be finite and >= 0; got a minimum of -1"),
           (np.where(keep, np.nan, 1.0), r"weights must be finite and >= 0; got \d+ NaN/Inf value"),
           (np.full(good.shape, "a"), "weights: got dtype <U1; expected numbers")]
    for weights, message in bad:
        with pytest.raises(DataError, match=message) as err:
            tr.step({"tokens": x}, y, weights=weights)
        assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"labels in \[9, 9\] besides ignore_index -100; the model has 7 classes"):
        tr.step({"tokens": x}, np.where(keep, 9, IGNORE))
    for value in (1.5, True, "-100"):
        with pytest.raises(ConfigError, match=f"softmax_cross_entropy ignore_index must be an integer or none, got "
                                              f"{value!r}".replace("(", r"\(")):
            lm_plan(ignore_index=value)
    with pytest.raises(ConfigError, match="loss 'squared_error' takes no option 'ignore_index'"):
        kc.compile(lm()[0], loss="squared_error", output="logits", loss_options={"ignore_index": IGNORE})
    with pytest.raises(ConfigError, match="head 'logits': softmax_cross_entropy cannot mask targets"):
        kc.compile(lm()[0], heads=[{"output": "logits", "loss": SCE, "options": {"ignore_index": IGNORE}}])


def test_a_recognised_loss_op_brings_its_ignore_index():
    """A graph ending in SoftmaxCrossEntropyLoss(ignore_index=-100) (torch's exported loss)
    compiles to softmax cross-entropy with that ignore_index; loss_options override it."""
    model = get_model("mlp_classifier", hidden=(8,))
    g = model.graph
    g.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]))
    g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="loss/sce",
                                   ignore_index=IGNORE))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    plan = kc.compile(model, emit=False)
    assert plan.loss.options == {"ignore_index": IGNORE} and plan.loss.build().summary() == f"{SCE} (ignore_index -100)"
    assert kc.compile(model, loss_options={"ignore_index": 3}, emit=False).loss.options == {"ignore_index": 3}
    x, labels = ZOO["mlp_classifier"].make_data(10)
    labels = labels.copy()
    labels[::2] = IGNORE
    loss, _ = kc.gradients(plan, x, labels)
    full, _ = kc.gradients(kc.compile(model, loss_options={"ignore_index": 12345}, emit=False),
                           {k: v[1::2] for k, v in x.items()}, labels[1::2])
    assert loss == pytest.approx(full, rel=1e-6)  # the mean over the examples that count


# ------------------------------------------------------------------------------ command line
@pytest.mark.slow
def test_cli_trains_with_ignore_index_and_a_weights_array(tmp_path, capsys):
    """`train model.onnx --ignore-index -100` on an .npz with per-position `weights`, held-out
    data with its own: the summary's losses are the saved model's sum w l / #kept over the
    training and the held-out data (numpy on ONNX Runtime's logits, 1e-5)."""
    import onnxruntime as ort

    from kfac_compiler.cli import main

    rng = np.random.default_rng(11)
    model, _ = lm()
    onnx.save(model, tmp_path / "lm.onnx")
    data = []
    for name, n in (("train", 16), ("val", 6)):
        x, y, keep = padded_batch(rng, n=n)
        w = rng.uniform(0.5, 1.5, size=y.shape).astype(np.float32)
        np.savez(tmp_path / f"{name}.npz", tokens=x, targets=y, weights=w)
        data.append((x, y, keep, w))
    code = main(["train", str(tmp_path / "lm.onnx"), "--loss", SCE, "--ignore-index", "-100", "--data",
                 str(tmp_path / "train.npz"), "--val-data", str(tmp_path / "val.npz"), "--steps", "3",
                 "--batch-size", "8", "--save", str(tmp_path / "out.onnx"), "-q"])
    out = capsys.readouterr().out
    assert code == 0, out
    sess = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"])
    expect = []
    for x, y, keep, w in data:
        z = sess.run(None, {"tokens": x})[0].astype(np.float64)
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, np.where(keep, y, 0)[..., None], -1)[..., 0]
        expect.append(np.sum(w * keep * nll) / keep.sum())
    train_loss = float(out.split("final train loss ")[1].split()[0])
    held_loss = float(out.split("held-out loss ")[1].split()[0])
    assert train_loss == pytest.approx(expect[0], rel=1e-5) and held_loss == pytest.approx(expect[1], rel=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--ignore-index", "x"], "argument --ignore-index: invalid integer value: 'x'"),
    (["--ignore-index", "-100", "--loss", "squared_error"], "loss 'squared_error' takes no option 'ignore_index'"),
])
def test_cli_bad_ignore_index_is_one_line(tmp_path, capsys, argv, message):
    from kfac_compiler.cli import main

    onnx.save(lm()[0], tmp_path / "lm.onnx")
    argv = ["compile", str(tmp_path / "lm.onnx"), *argv, "-o", str(tmp_path / "plan")]
    if "--loss" not in argv:
        argv[2:2] = ["--loss", SCE]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# ------------------------------------------------------------------------------ blocks
def _masked_stats(blk, inputs, cots):
    """The block's emitted statistics with masked=True, run in ONNX Runtime."""
    from helpers import run_graph
    from kfac_compiler.blocks._parts import emit_statistic

    feeds = {f"x{u}": x for u, x in enumerate(inputs)}
    feeds.update({f"d{u}_{s}": d for u, ds in enumerate(cots) for s, d in enumerate(ds)})
    names_in = [f"x{u}" for u in range(len(inputs))]
    names_cot = [[f"d{u}_{s}" for s in range(len(ds))] for u, ds in enumerate(cots)]
    return run_graph(lambda b: {k: emit_statistic(b, v) for k, v in
                                blk.emit_statistics(b, names_in, names_cot, masked=True).items()}, feeds)


def _row_masked_cases():
    """test_blocks' cases whose blocks mask rows, and a transposed convolution's."""
    from test_blocks import CASES, make_block
    from test_conv_transpose_block import convt_case

    cases = []
    for name, build in CASES:
        layer, shapes, inputs, cots = build()
        if make_block(layer, shapes, [np.shape(x) for x in inputs]).masks_rows:
            cases.append(name)
    return cases + ["convt-kron"], convt_case


MASKED_CASES, _CONVT = _row_masked_cases()


def _case(name):
    from test_blocks import CASES, make_block

    if name == "convt-kron":
        layer, blk, inputs, cots = _CONVT(np.random.default_rng(0), group=2, C_out=4)
        return layer, blk, inputs, cots
    layer, shapes, inputs, cots = dict(CASES)[name]()
    return layer, make_block(layer, shapes, [np.shape(x) for x in inputs]), inputs, cots


@pytest.mark.parametrize("name", MASKED_CASES)
def test_blocks_leave_masked_examples_out_of_their_activation_statistics(name):
    """Every block that masks rows, with the cotangents of whole examples zeroed in every
    seed (what a weight of 0 gives): its statistics with masked=True equal its unmasked ones
    on the other examples alone (G scaled by N_kept / N: G stays a sum over N), emitted and
    numpy twin (max relative error 1e-4 / 1e-10)."""
    layer, blk, inputs, cots = _case(name)
    n = np.shape(cots[0][0])[0]
    kept = np.arange(n) % 3 != 1
    cots = [[np.where(kept.reshape(-1, *[1] * (np.ndim(d) - 1)), d, 0).astype(np.float32) for d in ds] for ds in cots]
    ref = blk.numpy_statistics([x[kept] for x in inputs], [[d[kept] for d in ds] for ds in cots])
    got, twin = _masked_stats(blk, inputs, cots), blk.numpy_statistics(inputs, cots, masked=True)
    for f, want in ref.items():
        if f.startswith("G") or f in ("S", "B"):  # statistics of the cotangents: a sum over all N examples
            want = want * kept.sum() / n
        assert rel_err(got[f], want) < 1e-4, f
        assert rel_err(twin[f], want) < 1e-10, f


@pytest.mark.parametrize("name", ["fc-kron", "fc-kron_in_diag", "fc-kron_indep", "embedding-kron", "tied-kron_tied",
                                  "conv-kron", "conv-kron-group"])
def test_blocks_leave_masked_positions_out_of_their_activation_statistics(name):
    """Positions (tokens; conv output locations) whose cotangent is 0 in every seed leave A:
    A is the mean over the other positions, from the definitions (fc: a~ a~^T; embedding:
    token frequencies; tied: the lookups' frequencies and the head's a a^T; conv: the explicit
    patch loop's columns, per group)."""
    from test_blocks import explicit_patches, fc_tilde

    layer, blk, inputs, cots = _case(name)
    rng = np.random.default_rng(12)
    lives = []
    for u, ds in enumerate(cots):
        shape = list(np.shape(ds[0]))
        live_shape = [shape[0], 1, *shape[2:]] if "conv" in name else shape[:-1] + [1]
        live = rng.random(live_shape) < 0.6
        lives.append(live)
        cots[u] = [np.where(live, d, 0).astype(np.float32) for d in ds]
    got = _masked_stats(blk, inputs, cots)
    if name.startswith("fc"):
        a = np.concatenate([fc_tilde(x, blk.n_in, blk.alpha, blk.beta, blk.has_bias).reshape(-1, blk.nA)[m.reshape(-1)]
                            for x, m in zip(inputs, lives)])
        want = a.T @ a / len(a)
        assert rel_err(got["A"], np.diag(want) if blk.a_diag else want) < 1e-5
    elif name.startswith("embedding"):
        ids = inputs[0].reshape(-1)[lives[0].reshape(-1)]
        assert rel_err(got["A"], np.bincount(ids, minlength=blk.vocab) / len(ids)) < 1e-6
    elif name.startswith("tied"):
        ids = np.concatenate([inputs[u].reshape(-1)[lives[u].reshape(-1)] for u in blk.lookups])
        a = np.concatenate([blk.alphas[u] * inputs[u].reshape(-1, blk.dim)[lives[u].reshape(-1)] for u in blk.heads])
        assert rel_err(got["A_V"], np.bincount(ids, minlength=blk.vocab) / len(ids)) < 1e-6
        assert rel_err(got["A_D"], a.T @ a / len(a)) < 1e-5
    else:
        P = np.concatenate([explicit_patches(np.asarray(x, np.float64), layer.attrs, blk.group, blk.has_bias)
                            * m.reshape(m.shape[0], 1, 1, -1) for x, m in zip(inputs, lives)], axis=3)
        count = sum(m.sum() for m in lives)
        want = np.einsum("njat,njbt->jab", P, P) / count
        assert rel_err(got["A"], want[0] if blk.group == 1 else want) < 1e-5


@pytest.mark.slow
def test_fit_takes_weighted_batches_and_a_weighted_validation():
    """runtime.fit on batches(..., weights=mask) with validation (inputs, targets, mask): the
    same losses, parameters and held-out metrics as the hand-written loop of step(weights=)
    and evaluate(weights=) (bit-identical), and the held-out loss is the masked mean."""
    from kfac_compiler.runtime import batches, fit

    rng = np.random.default_rng(13)
    x, y, keep = padded_batch(rng, n=24)
    hx, hy, hkeep = padded_batch(rng, n=8)
    plan, _ = lm_plan()
    mask, hmask = keep.astype(np.float32), hkeep.astype(np.float32)
    labels = np.where(keep, y, 0)
    history = fit(Trainer(plan, seed=2), batches({"tokens": x}, labels, 8, seed=1, weights=mask), steps=4,
                  validation=({"tokens": hx}, np.where(hkeep, hy, 0), hmask), eval_every=2)
    by_hand = Trainer(plan, seed=2)
    losses, held = [], []
    for step, (bx, by, bw) in zip(range(4), batches({"tokens": x}, labels, 8, seed=1, weights=mask)):
        losses.append(by_hand.step(bx, by, weights=bw)["loss"])
        if step % 2 == 1:
            held.append(by_hand.evaluate({"tokens": hx}, np.where(hkeep, hy, 0), weights=hmask)["loss"])
    assert history.losses == losses and [m["eval_loss"] for m in history.evaluations] == held
    z = by_hand.predict({"tokens": hx}).astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.where(hkeep, hy, 0)[..., None], -1)[..., 0]
    assert held[-1] == pytest.approx(float(np.sum(hmask * nll) / len(hx)), rel=1e-5)
