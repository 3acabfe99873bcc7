"""Several loss heads with coefficients against independent numpy truth.

A tiny two-head model (shared tanh trunk, a softmax cross-entropy head `logits` and a
squared-error head `aux`) built with onnx.helper. The objective is sum_h c_h mean-loss_h and
the Fisher sum_h c_h J_h^T F_h J_h; the truth is a float64 numpy forward pass, finite
differences of the objective and per-example Jacobians by central differences
(tests/test_fisher_bruteforce.py's helper), with F_h written out by hand per head.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.errors import ConfigError, DataError, ModelError
from kfac_compiler.losses import Head
from kfac_compiler.runtime import Curvature, Trainer
from test_fisher_bruteforce import _layer_jacobian

IN, HID, CLS, AUX = 3, 4, 3, 2
C_CLS, C_AUX, VAR = 1.0, 0.3, 0.5
HEADS = [Head("logits", "softmax_cross_entropy", C_CLS, "labels"),
         Head("aux", "squared_error", C_AUX, "values", {"variance": VAR})]


def _two_head_model(seed: int = 0):
    rng = np.random.default_rng(seed)
    values = {"fc1.weight": rng.normal(size=(HID, IN)), "fc1.bias": rng.normal(size=HID) * 0.5,
              "cls.weight": rng.normal(size=(CLS, HID)), "cls.bias": rng.normal(size=CLS) * 0.5,
              "reg.weight": rng.normal(size=(AUX, HID)), "reg.bias": rng.normal(size=AUX) * 0.5}
    nodes = [helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"], name="fc1", transB=1),
             helper.make_node("Tanh", ["h"], ["a"], name="act"),
             helper.make_node("Gemm", ["a", "cls.weight", "cls.bias"], ["logits"], name="cls", transB=1),
             helper.make_node("Gemm", ["a", "reg.weight", "reg.bias"], ["aux"], name="reg", transB=1)]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in values.items()]
    graph = helper.make_graph(nodes, "two_heads", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", IN])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLS]),
                               helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["N", AUX])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {n: numpy_helper.to_array(t).astype(np.float64) for n, t in zip(values, inits)}


def _forward(p, x):
    a = np.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    return a @ p["cls.weight"].T + p["cls.bias"], a @ p["reg.weight"].T + p["reg.bias"]


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _objective(p, x, labels, values):
    logits, aux = _forward(p, x)
    ce = -np.log(_softmax(logits)[np.arange(len(x)), labels]).mean()
    se = (0.5 / VAR * (aux - values) ** 2).sum(axis=1).mean()
    return C_CLS * ce + C_AUX * se, ce, se


def _jacobian(p, x_n, layer):
    """d [logits, aux] / d vec_rowmajor([W | b]) of one example, by central differences."""
    return _layer_jacobian(p, x_n, layer, forward=lambda q, x: np.concatenate(_forward(q, x), axis=1))


def _output_fisher(logits_n):
    """blockdiag(c_cls (diag(p) - p p^T), c_aux I / variance), written out by hand."""
    pr = _softmax(logits_n)
    f = np.zeros((CLS + AUX, CLS + AUX))
    f[:CLS, :CLS] = C_CLS * (np.diag(pr) - np.outer(pr, pr))
    f[CLS:, CLS:] = C_AUX * np.eye(AUX) / VAR
    return f


def _exact_fisher(p, x, layer):
    logits, _ = _forward(p, x)
    return sum(_jacobian(p, x[n], layer).T @ _output_fisher(logits[n]) @ _jacobian(p, x[n], layer)
               for n in range(len(x))) / len(x)


def _data(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, IN)), rng.integers(0, CLS, n), rng.normal(size=(n, AUX))


@pytest.fixture(scope="module")
def two_heads():
    model, params = _two_head_model()
    return kc.compile(model, heads=HEADS, emit=False), params


def test_plan_records_the_heads_and_one_packed_targets_tensor(two_heads):
    plan, _ = two_heads
    heads = plan.loss.to_json()["heads"]
    assert [(h["output"], h["loss"], h["coefficient"], h["targets"], h["shape"]) for h in heads] == [
        ("logits", "softmax_cross_entropy", 1.0, "labels", [CLS]), ("aux", "squared_error", 0.3, "values", [AUX])]
    assert heads[1]["options"] == {"variance": VAR}
    assert plan.targets.shape[1:] == [1 + AUX] and plan.targets.dtype == "float32"
    assert {"cls", "reg", "fc1"} <= {layer.name for layer in plan.layers}


def test_loss_and_gradients_equal_the_weighted_sum_by_finite_differences(two_heads):
    plan, p = two_heads
    x, labels, values = _data(5)
    curv = Curvature(plan)
    loss, grads = curv.gradients({"input": x}, {"labels": labels, "values": values})
    total, _, _ = _objective(p, x, labels, values)
    assert loss == pytest.approx(total, rel=1e-5)
    eps = 1e-6
    for name in ("fc1.weight", "cls.bias", "reg.weight"):
        fd = np.zeros_like(p[name])
        for idx in np.ndindex(*p[name].shape):
            hi, lo = dict(p), dict(p)
            hi[name], lo[name] = p[name].copy(), p[name].copy()
            hi[name][idx] += eps
            lo[name][idx] -= eps
            fd[idx] = (_objective(hi, x, labels, values)[0] - _objective(lo, x, labels, values)[0]) / (2 * eps)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["exact", "exact_GGN"])
def test_kron_factors_of_one_example_equal_the_weighted_exact_fisher(two_heads, mode):
    """One example: A (x) G is the exact block of c_cls J^T F_cls J + c_aux J^T F_aux J."""
    plan, p = two_heads
    x, labels, values = _data(1, seed=4)
    stats = Curvature(plan).estimate({"input": x}, {"labels": labels, "values": values}, mode=mode)
    for layer in ("fc1", "cls", "reg"):
        exact = _exact_fisher(p, x, layer)
        np.testing.assert_allclose(np.kron(stats[layer]["G"], stats[layer]["A"]), exact, rtol=1e-4, atol=1e-6)


def test_diagonal_blocks_of_a_batch_equal_the_weighted_exact_fisher():
    model, p = _two_head_model(3)
    plan = kc.compile(model, heads=HEADS, emit=False, layers={".*": "diagonal"})
    x, labels, values = _data(4, seed=5)
    stats = Curvature(plan).estimate({"input": x}, {"labels": labels, "values": values}, mode="exact")
    for layer, out in (("fc1", HID), ("cls", CLS), ("reg", AUX)):
        diag = np.diag(_exact_fisher(p, x, layer)).reshape(out, -1)
        np.testing.assert_allclose(stats[layer]["diag"], diag, rtol=1e-4, atol=1e-6)


def test_sampled_estimate_converges_to_the_exact_one(two_heads):
    """gradients mode samples a class (one uniform, inverse CDF) and a normal value
    (Box-Muller of two uniforms) per example: the error of G shrinks like 1/sqrt(N)."""
    plan, _ = two_heads
    x1, labels, values = _data(1, seed=6)
    exact = Curvature(plan).estimate({"input": x1}, {"labels": labels, "values": values}, mode="exact")
    errors = []
    for n in (50, 5000):
        batch = {"labels": np.repeat(labels, n), "values": np.repeat(values, n, axis=0)}
        got = Curvature(plan, seed=n).estimate({"input": np.repeat(x1, n, axis=0)}, batch, mode="gradients")
        errors.append(max(np.abs(got[layer]["G"] - exact[layer]["G"]).max() / np.abs(exact[layer]["G"]).max()
                          for layer in ("fc1", "cls", "reg")))
    assert errors[1] < 0.06
    assert errors[1] < errors[0] / 3


def test_trainer_lowers_the_loss_and_reports_each_head(two_heads):
    plan, p = two_heads
    x, labels, values = _data(64, seed=8)
    values = np.tanh(x[:, :AUX])  # learnable targets
    targets = {"labels": labels, "values": values}
    tr = Trainer(plan, learning_rate=0.05, damping=1e-2)
    before = tr.evaluate({"input": x}, targets)
    _, ce, se = _objective(p, x, labels, values)
    assert before["loss"] == pytest.approx(C_CLS * ce + C_AUX * se, rel=1e-5)
    assert before["loss_labels"] == pytest.approx(ce, rel=1e-5)
    assert before["loss_values"] == pytest.approx(se, rel=1e-5)
    assert before["accuracy_labels"] == np.mean(np.argmax(_forward(p, x)[0], axis=1) == labels)
    for _ in range(8):
        m = tr.step({"input": x}, targets)
    assert m["loss"] == pytest.approx(C_CLS * m["loss_labels"] + C_AUX * m["loss_values"], rel=1e-5)
    after = tr.evaluate({"input": x}, targets)
    assert after["loss"] < 0.7 * before["loss"]
    assert after["loss_values"] < before["loss_values"]


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("heads, error, words", [
    ([("nope", "squared_error", 1.0, "y")], ModelError, "'nope'"),
    ([("logits", "hinge", 1.0, "y")], ConfigError, "unknown loss 'hinge'"),
    ([("logits", "softmax_cross_entropy", 0.0, "y")], ConfigError, "coefficient must be a finite number > 0"),
    ([("logits", "softmax_cross_entropy", 1.0, "y"), ("aux", "squared_error", 1.0, "y")], ConfigError,
     "targets name 'y' is already head 0's"),
    (Head("logits", "softmax_cross_entropy"), ConfigError, "expected a list of heads"),
    ([("logits", "softmax_cross_entropy", 1.0, "input")], ConfigError, "'input' is a model input's"),
])
def test_bad_heads_are_one_line_errors(heads, error, words):
    model, _ = _two_head_model()
    with pytest.raises(error) as e:
        kc.compile(model, heads=heads, emit=False)
    assert words in _one_line(e)


@pytest.mark.parametrize("kwargs", [{"output": ["logits", "aux"], "loss": "squared_error"},
                                    {"output": "logits", "loss": ["softmax_cross_entropy", "squared_error"]}])
def test_a_list_where_one_output_or_loss_is_expected_is_a_one_line_error(kwargs):
    model, _ = _two_head_model()
    with pytest.raises(ConfigError) as e:
        kc.compile(model, emit=False, **kwargs)
    assert "heads=" in _one_line(e)


def test_a_data_file_missing_a_heads_array_is_a_one_line_error(two_heads, tmp_path):
    from kfac_compiler.runtime.data import load_npz

    plan, _ = two_heads
    loss = plan.loss.build()
    x, labels, values = _data(4)
    path = str(tmp_path / "d.npz")
    np.savez(path, input=x, labels=labels)
    with pytest.raises(DataError) as e:
        load_npz(path, loss.target_arrays())
    assert "'values'" in _one_line(e) and "'aux'" in str(e.value)
    np.savez(path, input=x, labels=labels, values=values[:, :1])
    inputs, targets = load_npz(path, loss.target_arrays())
    with pytest.raises(DataError) as e:
        Curvature(plan).gradients(inputs, targets)
    assert "'values'" in _one_line(e) and "head 'aux'" in str(e.value)
    with pytest.raises(DataError) as e:
        Curvature(plan).gradients({"input": x}, labels)
    assert "dict" in _one_line(e)
    big = values.astype(np.float64)
    big[0, 0] = 1e39  # a float64 beyond float32's range, which the packing would turn into inf
    with pytest.raises(DataError) as e:
        Curvature(plan).gradients({"input": x}, {"labels": labels, "values": big})
    assert _one_line(e).startswith("batch: array 'values' (head 'aux') holds 1e+39, beyond float32's range")


def test_a_packed_targets_array_is_checked_per_head(two_heads):
    """The packed float32 [N, 1 + AUX] array (what the CLI's batches hand to step) gets each
    head's own checks: a label out of range or not an integer and a NaN value are one-line
    DataErrors naming their head; a sound packed array gives the dict's loss and gradients."""
    plan, _ = two_heads
    x, labels, values = _data(6)
    packed = np.concatenate([labels[:, None], values], axis=1).astype(np.float32)
    curv = Curvature(plan)
    loss, grads = curv.gradients({"input": x}, packed)
    want_loss, want = curv.gradients({"input": x}, {"labels": labels, "values": values.astype(np.float32)})
    assert loss == want_loss
    for p in want:
        np.testing.assert_array_equal(grads[p], want[p])
    for row, col, value, words in [(2, 0, CLS + 2, "head 'logits'"), (1, 0, 1.5, "integer class indices"),
                                   (3, 2, np.nan, "head 'aux'")]:
        bad = packed.copy()
        bad[row, col] = value
        with pytest.raises(DataError) as e:
            curv.gradients({"input": x}, bad)
        assert words in _one_line(e), words


def _custom_head_loss(monkeypatch, **attrs):
    """A squared_error variant registered as 'custom_se' with `attrs` overridden."""
    from kfac_compiler.losses import LOSSES

    cls = type("CustomSE", (LOSSES["squared_error"],), {"kind": "custom_se", **attrs})
    monkeypatch.setitem(LOSSES, "custom_se", cls)


@pytest.mark.parametrize("attrs, words", [
    ({"noise_shape": lambda self, shape: (shape[0], 2 * int(np.prod(shape[1:])))},
     "head 'aux': loss 'custom_se' draws noise of shape [4] per example for an output of shape [2]"),
    ({"noise": "gamma"}, "head 'aux': loss 'custom_se' samples with 'gamma' noise"),
])
def test_a_head_loss_whose_noise_does_not_fit_the_packing_is_refused(monkeypatch, attrs, words):
    """The heads' noise is packed one value per output entry (uniform, normal by Box-Muller):
    a custom loss drawing another shape or kind would be sampled wrongly, so compile refuses
    it in one line naming the head and the loss."""
    _custom_head_loss(monkeypatch, **attrs)
    model, _ = _two_head_model()
    with pytest.raises(ConfigError) as e:
        kc.compile(model, heads=[HEADS[0], ("aux", "custom_se", 0.3, "values")], emit=False)
    assert words in _one_line(e)
    _custom_head_loss(monkeypatch)  # the same loss with fitting noise compiles
    kc.compile(model, heads=[HEADS[0], ("aux", "custom_se", 0.3, "values")], emit=False)


@pytest.mark.slow
def test_config_heads_tables_compile_the_same_plan(tmp_path, two_heads):
    model, _ = _two_head_model()
    cfg = tmp_path / "heads.toml"
    cfg.write_text('[[heads]]\noutput = "logits"\nloss = "softmax_cross_entropy"\ntargets = "labels"\n'
                   '[[heads]]\noutput = "aux"\nloss = "squared_error"\ncoefficient = 0.3\ntargets = "values"\n'
                   'options = { variance = 0.5 }\n')
    plan = kc.compile(model, config=str(cfg), emit=False)
    assert plan.loss.to_json() == two_heads[0].loss.to_json()
    plan.save(str(tmp_path / "plan"))
    loaded = kc.load_plan(str(tmp_path / "plan"))
    x, labels, values = _data(3)
    pred = Trainer(loaded).predict({"input": x})
    logits, aux = _forward(_two_head_model()[1], x)
    np.testing.assert_allclose(pred["logits"], logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pred["aux"], aux, rtol=1e-5, atol=1e-6)
    import onnxruntime as ort  # the exported model answers with the heads' outputs

    exported = Trainer(loaded).export(str(tmp_path / "trained.onnx"))
    sess = ort.InferenceSession(exported, providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()][:2] == ["logits", "aux"]
    got = sess.run(["logits", "aux"], {"input": x.astype(np.float32)})
    np.testing.assert_allclose(got[0], logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], aux, rtol=1e-5, atol=1e-6)


def test_one_loss_plans_keep_their_plan_json(tmp_path):
    model, _ = _two_head_model()
    plan = kc.compile(model, loss="squared_error", output="aux", emit=False)
    assert "heads" not in plan.config and plan.output == "aux" and plan.loss.to_json()["kind"] == "squared_error"


@pytest.mark.slow
def test_cli_compile_inspect_and_train_with_heads(tmp_path, capsys):
    from kfac_compiler.cli import main

    model, _ = _two_head_model()
    onnx_path, plan_dir = tmp_path / "m.onnx", tmp_path / "plan"
    import onnx

    onnx.save(model, str(onnx_path))
    assert main(["compile", str(onnx_path), "--head", "logits,softmax_cross_entropy,1,labels",
                 "--head", "aux,squared_error,0.3,values", "-o", str(plan_dir), "-q", "--frontend-only"]) == 0
    assert main(["inspect", str(plan_dir)]) == 0
    out = capsys.readouterr().out
    assert "1 x softmax_cross_entropy on logits [3], targets 'labels'" in out
    assert "0.3 x squared_error on aux [2], targets 'values'" in out
    x, labels, values = _data(40)
    np.savez(tmp_path / "d.npz", input=x, labels=labels, values=values)
    metrics = tmp_path / "m.jsonl"
    assert main(["train", str(plan_dir), "--data", str(tmp_path / "d.npz"), "--steps", "3", "--batch-size", "20",
                 "--metrics", str(metrics), "-q"]) == 0
    import json

    rows = [json.loads(line) for line in open(metrics)]
    assert len(rows) == 3 and all(r["loss"] == pytest.approx(r["loss_labels"] + 0.3 * r["loss_values"], rel=1e-5)
                                  for r in rows)
    assert "accuracy_labels" in capsys.readouterr().out
    np.savez(tmp_path / "bad.npz", input=x, labels=labels)
    assert main(["train", str(plan_dir), "--data", str(tmp_path / "bad.npz"), "--steps", "1", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'values'" in err[0] and "'aux'" in err[0]
    # a stray array, and a missing input, name the heads' target arrays (not 'targets')
    np.savez(tmp_path / "extra.npz", input=x, labels=labels, values=values, stray=values)
    assert main(["train", str(plan_dir), "--data", str(tmp_path / "extra.npz"), "--steps", "1", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "array 'stray' is not a model input" in err[0] and "plus 'labels', 'values'" in err[0]
    np.savez(tmp_path / "noinput.npz", labels=labels, values=values)
    assert main(["train", str(plan_dir), "--data", str(tmp_path / "noinput.npz"), "--steps", "1", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no array named 'input'" in err[0] and "plus 'labels', 'values'" in err[0]
    assert main(["compile", str(onnx_path), "--head", "logits", "-o", str(tmp_path / "p2")]) == 2
    assert "--head 'logits': expected OUTPUT,LOSS" in capsys.readouterr().err
    # multi_head is what the heads compile to, not a kind to name: --loss does not offer it
    assert main(["train", str(onnx_path), "--loss", "multi_head", "--steps", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'multi_head'" in err and "softmax_cross_entropy" in err
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = capsys.readouterr().out
    assert "softmax_cross_entropy" in out and "multi_head" not in out


def _data_parallel_run(comm) -> list[list[float]]:
    """Six K-FAC steps (sampled Fisher, inverses every 3 steps) of 64-row global batches."""
    from kfac_compiler.runtime.data import batch_indices

    model, _ = _two_head_model()
    x, labels, values = _data(256, seed=3)
    tr = Trainer(kc.compile(model, heads=HEADS), seed=0, batch_size=64, comm=comm, inv_update_period=3)
    out = []
    for s in range(6):
        idx = batch_indices(256, 64, s, 0)
        m = tr.step({"input": x[idx]}, {"labels": labels[idx], "values": values[idx]})
        out.append([m["loss"], m["loss_labels"], m["loss_values"]])
    return out


@pytest.mark.slow
@pytest.mark.mpi
def test_two_ranks_take_the_one_process_steps_with_heads(tmp_path):
    """The ranks draw the global batch's noise for both heads (uniform and Box-Muller columns)
    and keep their rows; losses and each head's loss (a mean over the ranks) are one process's."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from mpi_util import require_mpi, run_ranks

    require_mpi()
    proc = run_ranks(2, [sys.executable, __file__, str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = _data_parallel_run(None)
    for r in range(2):
        np.testing.assert_allclose(json.load(open(tmp_path / f"rank{r}.json")), single, rtol=1e-5)


if __name__ == "__main__":  # a rank of test_two_ranks_take_the_one_process_steps_with_heads
    import json
    import sys

    from kfac_compiler.runtime.comm import as_communicator

    comm = as_communicator("auto")
    result = _data_parallel_run(comm)
    with open(f"{sys.argv[1]}/rank{comm.rank}.json", "w") as f:
        json.dump(result, f)
