"""`kfac-compiler train` end to end (few steps): metrics files, --save, checkpoints, bad data."""
from __future__ import annotations

import csv
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import kfac_compiler as kc
from kfac_compiler.models import ZOO, save_model


def _wired() -> bool:
    """True once kfac_compiler/cli.py delegates `train` to kfac_compiler.train_cli."""
    try:
        from kfac_compiler.cli import build_parser

        build_parser().parse_args(["train", "--optimizer", "sgd"])
        return True
    except Exception:  # noqa: BLE001
        return False


def run(argv, capsys):
    if _wired():
        from kfac_compiler.cli import main
    else:
        from kfac_compiler.train_cli import main
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_train_with_no_arguments(capsys):
    code, out, err = run([], capsys)
    assert code == 0, err
    line = [l for l in out.splitlines() if l.startswith("final train loss")]
    assert line and "accuracy" in line[0]
    loss = float(line[0].split()[3])
    acc = float(line[0].split()[5])
    assert loss < 0.05 and acc > 0.98  # 200 K-FAC steps on the digits classifier


def test_metrics_csv_save_and_checkpoint_resume(tmp_path, capsys):
    m1, model, ck = tmp_path / "m.csv", tmp_path / "trained.onnx", tmp_path / "run.ckpt"
    code, out, err = run(["mlp_classifier", "--steps", "4", "--batch-size", "64", "--metrics", str(m1),
                          "--save", str(model), "--checkpoint", str(ck), "-q"], capsys)
    assert code == 0, err
    rows = list(csv.DictReader(open(m1)))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert all(float(r["loss"]) > 0 for r in rows) and rows[0]["damping"] and rows[0]["rejected"] == "0"
    assert all(0 < float(r["update_scale"]) <= 1 for r in rows)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    x, y = ZOO["mlp_classifier"].make_data(16)
    (logits,) = sess.run(None, {"input": x["input"]})
    assert logits.shape == (16, 10) and np.all(np.isfinite(logits))
    onnx.checker.check_model(onnx.load(str(model)))
    # resume to 7 steps: appends steps 4..6 to the metrics file
    code, out, err = run(["mlp_classifier", "--steps", "7", "--batch-size", "64", "--metrics", str(m1),
                          "--resume", str(ck), "-q"], capsys)
    assert code == 0, err
    assert [int(r["step"]) for r in csv.DictReader(open(m1))] == list(range(7))


@pytest.mark.slow
def test_resume_matches_uninterrupted_run(tmp_path, capsys):
    common = ["digits_autoencoder", "--batch-size", "128", "-q", "--knob", "inv_update_period=3"]
    a, b, ck = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "c.npz"
    assert run([*common, "--steps", "6", "--save", str(a)], capsys)[0] == 0
    assert run([*common, "--steps", "3", "--checkpoint", str(ck)], capsys)[0] == 0
    assert run([*common, "--steps", "6", "--resume", str(ck), "--save", str(b)], capsys)[0] == 0
    wa = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(a)).graph.initializer}
    wb = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(b)).graph.initializer}
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_user_onnx_with_npz_data_and_jsonl(tmp_path, capsys, opt):
    path = save_model("mlp_classifier", tmp_path / "model.onnx")
    x, y = ZOO["mlp_classifier"].make_data(300, seed=1)
    np.savez(tmp_path / "d.npz", input=x["input"], targets=y)
    mj = tmp_path / "m.jsonl"
    code, out, err = run([path, "--loss", "softmax_cross_entropy", "--data", str(tmp_path / "d.npz"),
                          "--optimizer", opt, "--steps", "5", "--learning-rate", "0.01", "--metrics", str(mj), "-q"], capsys)
    assert code == 0, err
    rows = [json.loads(l) for l in open(mj)]
    assert len(rows) == 5 and all(r["learning_rate"] == 0.01 for r in rows)
    assert "final train loss" in out


def _bad(tmp_path, **arrays):
    p = tmp_path / "bad.npz"
    np.savez(p, **arrays)
    return str(p)


@pytest.mark.parametrize("case", ["missing", "shape", "labels", "nan", "dtype", "no_targets", "rows"])
def test_bad_data_is_one_line_error_before_training(tmp_path, capsys, case):
    x, y = ZOO["mlp_classifier"].make_data(50)
    x = x["input"]
    arrays = {
        "missing": dict(pixels=x, targets=y),
        "shape": dict(input=x[:, :32], targets=y),
        "labels": dict(input=x, targets=y + 5),
        "nan": dict(input=np.where(x > 0.5, np.nan, x), targets=y),
        "dtype": dict(input=np.array(["a"] * 50), targets=y),
        "no_targets": dict(input=x),
        "rows": dict(input=x, targets=y[:40]),
    }[case]
    m = tmp_path / "m.csv"
    code, out, err = run(["mlp_classifier", "--data", _bad(tmp_path, **arrays), "--steps", "3", "--metrics", str(m)], capsys)
    assert code == 2
    lines = [l for l in err.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "bad.npz" in lines[0], err
    assert not m.exists()  # nothing trained


@pytest.mark.slow
def test_unknown_model_and_missing_matplotlib_message(tmp_path, capsys):
    code, out, err = run(["no_such_model", "--steps", "1"], capsys)
    assert code == 2 and "error:" in err and "zoo" in err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, out, err = run(["--steps", "1", "--plot", str(tmp_path / "p.png")], capsys)
        assert code == 2 and "matplotlib" in err
    else:
        code, out, err = run(["--steps", "3", "--plot", str(tmp_path / "p.png"), "-q"], capsys)
        assert code == 0 and os.path.getsize(tmp_path / "p.png") > 0


# --------------------------------------------------------------------------- held-out evaluation
def _held_out_loss(model_path, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean softmax cross-entropy and accuracy of the saved model on (x, y), in numpy: the
    independent truth for the CLI's eval_loss."""
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(None, {"input": x.astype(np.float32)})
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean()), float((logits.argmax(axis=1) == y).mean())


def test_holdout_evaluates_the_held_out_rows_and_trains_on_the_rest(tmp_path, capsys):
    from kfac_compiler.train_cli import validation_split

    metrics, model = tmp_path / "m.csv", tmp_path / "trained.onnx"
    code, out, err = run(["mlp_classifier", "--steps", "12", "--batch-size", "64", "--val-split", "0.25",
                          "--eval-every", "5", "--metrics", str(metrics), "--save", str(model), "-q"], capsys)
    assert code == 0, err
    rows = list(csv.DictReader(open(metrics)))
    assert list(rows[0])[-2:] == ["eval_loss", "eval_accuracy"]
    assert [int(r["step"]) for r in rows if r["eval_loss"]] == [4, 9, 11]  # every 5 steps, and the last
    x, y = ZOO["mlp_classifier"].make_data(None, seed=0)
    train, ty, (hx, hy) = validation_split(x, y, 0.25, seed=0)
    assert len(hy) == 450 and len(ty) == 1347  # ceil(0.25 x 1797) held out
    assert not set(map(bytes, hx["input"])) & set(map(bytes, train["input"][:200]))
    loss, acc = _held_out_loss(model, hx["input"], hy)
    assert float(rows[-1]["eval_loss"]) == pytest.approx(loss, rel=1e-5)
    assert float(rows[-1]["eval_accuracy"]) == pytest.approx(acc)
    assert f"held-out loss {float(rows[-1]['eval_loss']):.6f} accuracy {acc:.4f}" in out
    train_line = next(l for l in out.splitlines() if l.startswith("final train loss"))
    assert float(train_line.split()[3]) == pytest.approx(_held_out_loss(model, train["input"], ty)[0], rel=1e-5)


@pytest.mark.slow
def test_eval_data_file_and_resume_keep_the_columns(tmp_path, capsys):
    x, y = ZOO["mlp_classifier"].make_data(None, seed=0)
    ev = tmp_path / "held.npz"
    np.savez(ev, input=x["input"][:100], targets=y[:100])
    metrics, model, ck = tmp_path / "m.csv", tmp_path / "trained.onnx", tmp_path / "c.ckpt"
    common = ["mlp_classifier", "--batch-size", "64", "--val-data", str(ev), "--eval-every", "2", "--metrics",
              str(metrics), "-q"]
    assert run([*common, "--steps", "4", "--checkpoint", str(ck)], capsys)[0] == 0
    code, out, err = run([*common, "--steps", "6", "--resume", str(ck), "--save", str(model)], capsys)
    assert code == 0, err
    rows = list(csv.DictReader(open(metrics)))
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert [int(r["step"]) for r in rows if r["eval_loss"]] == [1, 3, 5]
    assert float(rows[-1]["eval_loss"]) == pytest.approx(_held_out_loss(model, x["input"][:100], y[:100])[0],
                                                         rel=1e-5)


def test_keep_best_saves_the_best_evaluation_s_model(tmp_path, capsys):
    """SGD at lr 1.5 passes its best held-out loss early and ends above it: --save writes
    the model whose held-out loss is the metrics file's lowest, at the step the summary
    names; the checkpoint holds the last step's model (its held-out loss is the last row's)."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.train_cli import validation_split

    metrics, model, ck = tmp_path / "m.csv", tmp_path / "best.onnx", tmp_path / "c.ckpt"
    code, out, err = run(["mlp_classifier", "--steps", "30", "--batch-size", "64", "--val-split", "0.25",
                          "--eval-every", "1", "--optimizer", "sgd", "--learning-rate", "1.5", "--keep-best",
                          "--metrics", str(metrics), "--save", str(model), "--checkpoint", str(ck), "-q"], capsys)
    assert code == 0, err
    rows = [r for r in csv.DictReader(open(metrics)) if r["eval_loss"]]
    losses = [float(r["eval_loss"]) for r in rows]
    best = int(np.argmin(losses))
    assert best < len(rows) - 1 and losses[-1] > 1.1 * losses[best]
    x, y = ZOO["mlp_classifier"].make_data(None, seed=0)
    tx, ty, (hx, hy) = validation_split(x, y, 0.25, seed=0)
    assert _held_out_loss(model, hx["input"], hy)[0] == pytest.approx(losses[best], rel=1e-5)
    assert f"kept the model of step {rows[best]['step']}: held-out loss {losses[best]:.6f}" in out
    z = ZOO["mlp_classifier"]
    plan = kc.compile(z.build(seed=0), loss=z.loss, output=z.output_name, emit=False)
    last = Trainer.load_checkpoint(str(ck), plan)
    assert last.evaluate(hx, hy)["loss"] == pytest.approx(losses[-1], rel=1e-5)
    # the summary's training loss is the last step's model's: the kept one was written, then put back
    train_line = next(line for line in out.splitlines() if line.startswith("final train loss"))
    assert float(train_line.split()[3]) == pytest.approx(last.evaluate(tx, ty)["loss"], rel=1e-5)


def test_patience_ends_the_run_and_keep_best_saves_the_best_evaluation_s_model(tmp_path, capsys):
    """The run above with --patience 2: it ends after the second evaluation in a row above the
    lowest held-out loss (the metrics file's rows, by the rule), says so, and --save writes
    the kept model."""
    metrics, model = tmp_path / "m.csv", tmp_path / "best.onnx"
    code, out, err = run(["mlp_classifier", "--steps", "30", "--batch-size", "64", "--val-split", "0.25",
                          "--eval-every", "1", "--optimizer", "sgd", "--learning-rate", "1.5", "--keep-best",
                          "--patience", "2", "--metrics", str(metrics), "--save", str(model), "-q"], capsys)
    assert code == 0, err
    rows = list(csv.DictReader(open(metrics)))
    losses = [float(r["eval_loss"]) for r in rows]
    best = int(np.argmin(losses))
    assert len(rows) < 30 and len(rows) == best + 3  # the best, then two evaluations not below it
    assert f"stopped early after step {len(rows) - 1}: the held-out loss did not fall below {losses[best]:.6g}" in out
    from kfac_compiler.train_cli import validation_split

    x, y = ZOO["mlp_classifier"].make_data(None, seed=0)
    _, _, (hx, hy) = validation_split(x, y, 0.25, seed=0)
    assert _held_out_loss(model, hx["input"], hy)[0] == pytest.approx(losses[best], rel=1e-5)


@pytest.mark.parametrize("argv,line", [(["--patience", "3"], "--patience needs held-out data"),
                                       (["--val-split", "0.2", "--patience", "0"], "--patience must be >= 1")])
def test_patience_without_held_out_data_is_one_line(capsys, argv, line):
    code, _, err = run(["mlp_classifier", "--steps", "2", *argv], capsys)
    assert code != 0 and line in err and "Traceback" not in err


def test_keep_best_survives_a_resume(tmp_path, capsys):
    """Stopped at step 12 and resumed to 30, --keep-best saves the model of the best
    evaluation over both runs (the checkpoint carries the kept model): the metrics file's
    lowest held-out loss, reached in the first run."""
    from kfac_compiler.train_cli import validation_split

    metrics, model, ck = tmp_path / "m.csv", tmp_path / "best.onnx", tmp_path / "c.ckpt"
    common = ["mlp_classifier", "--batch-size", "64", "--val-split", "0.25", "--eval-every", "1", "--optimizer", "sgd",
              "--learning-rate", "1.5", "--keep-best", "--metrics", str(metrics), "--checkpoint", str(ck), "-q"]
    assert run([*common, "--steps", "12"], capsys)[0] == 0
    code, out, err = run([*common, "--steps", "30", "--resume", str(ck), "--save", str(model)], capsys)
    assert code == 0, err
    rows = [r for r in csv.DictReader(open(metrics)) if r["eval_loss"]]
    assert [int(r["step"]) for r in rows] == list(range(30))
    losses = [float(r["eval_loss"]) for r in rows]
    best = int(np.argmin(losses))
    assert best < 12 and min(losses[12:]) > losses[best]
    x, y = ZOO["mlp_classifier"].make_data(None, seed=0)
    _, _, (hx, hy) = validation_split(x, y, 0.25, seed=0)
    assert _held_out_loss(model, hx["input"], hy)[0] == pytest.approx(losses[best], rel=1e-5)
    assert f"kept the model of step {best}: held-out loss {losses[best]:.6f}" in out


@pytest.mark.parametrize("argv,line", [
    (["--keep-best"], "error: --keep-best needs held-out data: --val-data FILE.npz or --val-split FRACTION"),
    (["--eval-every", "5"], "error: --eval-every needs held-out data: --val-data FILE.npz or --val-split FRACTION"),
    (["--val-split", "0.2", "--val-data", "x.npz"], "error: --val-data and --val-split both name held-out data; give one"),
    (["--val-split", "0.2", "--eval-every", "0"], "error: --eval-every must be >= 1, got 0"),
], ids=["keep-best-alone", "eval-every-alone", "both", "eval-every-0"])
def test_held_out_options_that_do_not_fit_are_one_line(tmp_path, capsys, argv, line):
    code, out, err = run(["mlp_classifier", "--steps", "2", *argv], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == line


def test_resuming_with_another_holdout_is_other_training_data(tmp_path, capsys):
    ck = tmp_path / "c.ckpt"
    assert run(["mlp_classifier", "--steps", "2", "--val-split", "0.2", "--checkpoint", str(ck), "-q"], capsys)[0] == 0
    code, out, err = run(["mlp_classifier", "--steps", "4", "--val-split", "0.3", "--resume", str(ck), "-q"], capsys)
    assert code == 2 and "is not the data checkpoint" in err and "1437 examples" in err


def test_a_batch_larger_than_the_data_is_said(capsys):
    code, out, err = run(["mlp_classifier", "--steps", "1", "--batch-size", "5000", "-q"], capsys)
    assert code == 0 and ("warning: --batch-size 5000 is larger than the 1797 training examples; every batch is "
                          "all 1797") in err


@pytest.mark.slow
def test_a_large_plan_says_it_is_setting_up_sessions(monkeypatch, capsys, tmp_path):
    """ONNX Runtime's setup of a large plan takes long (a 2,000-layer MLP: minutes): `train`
    says what it is doing before, one line per session of SHOW_SECONDS or more, and how long
    it took after."""
    from kfac_compiler import progress, train_cli
    from kfac_compiler.cli import main
    from kfac_compiler.models import ZOO, save_model

    x, y = ZOO["mlp_classifier"].make_data(256, seed=0)
    np.savez(tmp_path / "d.npz", targets=y, **x)
    model = save_model("mlp_classifier", tmp_path / "m.onnx")
    assert main(["compile", str(model), "--loss", "softmax_cross_entropy", "-q", "-o", str(tmp_path / "plan")]) == 0
    run = ["train", str(tmp_path / "plan"), "--data", str(tmp_path / "d.npz"), "--steps", "1"]
    monkeypatch.setattr(train_cli, "SETUP_NOTICE_NODES", 1)  # any plan counts as large
    monkeypatch.setattr(progress, "SHOW_SECONDS", 0.0)  # and any session as slow
    capsys.readouterr()
    assert main(run) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("setting up ONNX Runtime sessions for ") and err[0].endswith(" subgraphs ...")
    ready = next(i for i, line in enumerate(err) if line.startswith("sessions ready in "))
    stages = err[1:ready]  # "setup: STAGE: T s", the graphs emitted for this batch size included
    assert stages and all(line.startswith("setup: ") and line.endswith(" s") for line in stages), stages
    # the K-FAC trainer's sessions, each "setup: ONNX Runtime session NAME (N nodes): T s"
    names = [line.split(" (")[0].removeprefix("setup: ONNX Runtime session ") for line in stages
             if line.startswith("setup: ONNX Runtime session ")]
    assert "kfac_step" in names and "inverse_update" in names, stages
    from kfac_compiler.runtime import program  # a graph cut for its size: its cut and its sessions, a line each
    monkeypatch.setattr(program, "STAGED_ABOVE_NODES", 0)
    monkeypatch.setattr(program, "STAGE_NODES", 40)
    assert main(run) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("setup: cut kfac_step (") and " nodes) in stages: " in line for line in err), err
    assert any(line.startswith("setup: ONNX Runtime sessions kfac_step (") and " stages): " in line for line in err)
    monkeypatch.setattr(train_cli, "SETUP_NOTICE_NODES", 10 ** 9)
    monkeypatch.setattr(progress, "SHOW_SECONDS", 10.0 ** 9)
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "setting up" not in err and "setup:" not in err
    monkeypatch.setattr(progress, "SHOW_SECONDS", 0.0)
    assert main(run + ["-q"]) == 0
    assert "setup:" not in capsys.readouterr().err
