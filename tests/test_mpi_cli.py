"""`mpirun -n P kfac-compiler train`: rank 0 alone prints and writes, the run equals the
one-process run, and an error on one rank stops every rank with one line naming it.

Every test runs real ranks under the MPI extra's mpirun on loopback (tests/mpi_util.py) and
is skipped, with the install command, without it.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from kfac_compiler.cli import main
from kfac_compiler.locks import lock_path
from kfac_compiler.runtime.checkpoint import read_meta
from mpi_util import own_lines as ours
from mpi_util import rank_command, run_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # mpirun subprocesses: CI runs these
TRAIN = [sys.executable, "-m", "kfac_compiler.train_cli"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a rank that fails where the others wait in a collective: Trainer.step raises on rank 1 at step 2
INJECT = """\
import sys
from kfac_compiler.errors import DataError
from kfac_compiler.runtime.trainer import Trainer
from kfac_compiler.train_cli import main

real = Trainer.step
def step(self, *args, **kwargs):
    if self.rank == 1 and self.step_count == 2:
        raise {error}
    return real(self, *args, **kwargs)
Trainer.step = step
sys.exit(main(sys.argv[1:]))
"""


def errors(stderr: str) -> list[str]:
    return [line for line in ours(stderr) if line.startswith("error:")]


def rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def one_process(tmp_path, *argv: str) -> list[dict[str, str]]:
    metrics = tmp_path / "one.csv"
    assert main(["train", *argv, "--metrics", str(metrics), "-q"]) == 0
    return rows(metrics)


# Past step 3 of the default digits run (mlp_classifier, batch 64, seed 0) the metrics of two
# runs that differ by rounding part at a ReLU kink: on step 4's batch one fc2 pre-activation
# is within 1e-5 of zero, and which side it falls on is decided by rounding. Two ranks (their
# sums in another order) and one process started with every parameter one float32 ulp up
# both flip it (1 and 2 example-units), four ranks and one ulp down do not; the gradient
# norm then parts by 2.8e-4 (ranks) and 2.4e-4 (ulp up) at step 4, and at step 6 the loss by
# 6.8e-4 and 2.1e-4, the update norm by 7.6e-3 and 5.5e-3 (damping: equal). Four ranks
# taking the same step as one process to the bit when every rank has the same rows
# (tests/test_distributed.py) shows the ranks compute nothing else: this is rounding.
# benchmarks/results/2026-11-29-regram.md.
PAST_KINK = {"loss": 2e-3, "damping": 1e-4, "update_norm": 2e-2}


def assert_same_run(a: list[dict[str, str]], b: list[dict[str, str]],
                    rtol: float | dict[str, float] = 1e-4) -> None:
    """The same steps with the same metrics up to float32 rounding (the ranks sum in another
    order; K-FAC's adaptive damping and step scale amplify it over the steps); `rtol` one
    bound or one per metric (PAST_KINK)."""
    assert [int(float(r["step"])) for r in a] == [int(float(r["step"])) for r in b]
    for key in ("loss", "damping", "update_norm"):
        tol = rtol[key] if isinstance(rtol, dict) else rtol
        np.testing.assert_allclose([float(r[key]) for r in a], [float(r[key]) for r in b], rtol=tol, err_msg=key)


def params(path) -> list[np.ndarray]:
    meta = read_meta(path)
    with np.load(path) as z:
        return [z[f"slot_{i:05d}"] for i, s in enumerate(meta["slots"]) if s in meta["plan"]["params"]]


# --------------------------------------------------------------------------- runs
def test_two_ranks_train_like_one_process_and_rank_0_alone_writes(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    metrics, ckpt, model = d / "m.csv", d / "run.ckpt", d / "trained.onnx"
    out = run_ranks(2, [*TRAIN, "--steps", "6", "--batch-size", "64", "--metrics", str(metrics),
                        "--checkpoint", str(ckpt), "--save", str(model)], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert ours(out.stderr) == ["training mlp_classifier with kfac on cpu: 1797 examples, 2 ranks, batch 64 "
                                "(32 per rank), steps 0..6"]
    lines = out.stdout.splitlines()
    assert len(lines) == 5 and lines[0].startswith("final train loss ") and "(6 steps" in lines[0]
    assert lines[1].startswith("sent per step by each of 2 ranks (mean of 6 steps): gradients ")
    assert lines[2:] == [f"metrics written to {metrics}", f"checkpoint written to {ckpt}", f"model written to {model}"]
    assert sorted(os.listdir(d)) == ["m.csv", "run.ckpt", "trained.onnx"]  # no locks, no temp files left
    assert read_meta(ckpt)["ranks"] == 2
    two, one = rows(metrics), one_process(tmp_path, "--steps", "6", "--batch-size", "64")
    assert_same_run(two[:3], one[:3])  # before the kink: 2.9e-6 at most (loss), 1.5e-5 (update norm)
    assert_same_run(two[3:], one[3:], PAST_KINK)


def test_two_ranks_with_default_sub_batches_train_like_one_process(tmp_path):
    """Batch 128 takes the default statistics sub-batch (64 of 128): each of two ranks uses
    every other row of its 64, the rows one process uses. Was: different rows, a 22% loss gap
    within 10 steps; now float rounding (the ranks sum in another order), which the quadratic
    model's choice of step amplifies in the update norms."""
    metrics = tmp_path / "m.csv"
    out = run_ranks(2, [*TRAIN, "--steps", "10", "--batch-size", "128", "--metrics", str(metrics), "-q"])
    assert out.returncode == 0, out.stderr
    two, one = rows(metrics), one_process(tmp_path, "--steps", "10", "--batch-size", "128")
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for key, rtol in (("loss", 5e-3), ("damping", 1e-6), ("update_norm", 5e-2)):
        np.testing.assert_allclose([float(r[key]) for r in two], [float(r[key]) for r in one], rtol=rtol, err_msg=key)


def test_keep_best_on_two_ranks_saves_rank_0_s_best_evaluation(tmp_path):
    """Rank 0 alone evaluates the held-out rows and keeps the best model; the saved model's
    held-out loss is the metrics file's lowest (an earlier step's: SGD at lr 1.5 overshoots).
    With --patience 2 rank 0 decides to stop after the second evaluation in a row above it,
    and both ranks stop there (no hang, one summary)."""
    import onnxruntime as ort

    from kfac_compiler.models import ZOO
    from kfac_compiler.train_cli import validation_split

    metrics, model = tmp_path / "m.csv", tmp_path / "best.onnx"
    out = run_ranks(2, [*TRAIN, "--steps", "20", "--batch-size", "64", "--val-split", "0.25", "--eval-every", "1",
                        "--optimizer", "sgd", "--learning-rate", "1.5", "--keep-best", "--patience", "2",
                        "--metrics", str(metrics), "--save", str(model), "-q"])
    assert out.returncode == 0, out.stderr
    evaluated = [r for r in rows(metrics) if r["eval_loss"]]
    losses = [float(r["eval_loss"]) for r in evaluated]
    best = int(np.argmin(losses))
    assert best < len(losses) - 1 and out.stdout.count("kept the model of step") == 1
    assert len(losses) == best + 3 < 20 and out.stdout.count("stopped early after step") == 1
    x, y = ZOO["mlp_classifier"].make_data(None, seed=0)
    _, _, (hx, hy) = validation_split(x, y, 0.25, seed=0)
    logits = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"input": hx["input"]})[0]
    z = logits - logits.max(axis=1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(hy)), hy]))
    assert loss == pytest.approx(losses[best], rel=1e-5)


@pytest.mark.slow
def test_four_ranks_train_like_one_process(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = run_ranks(4, [*TRAIN, "--steps", "5", "--batch-size", "64", "--metrics", str(metrics), "-q"])
    assert out.returncode == 0, out.stderr
    assert ours(out.stderr) == [] and out.stdout.count("final train loss") == 1
    four = [{k: str(v) for k, v in json.loads(line).items()} for line in open(metrics)]
    assert_same_run(four, one_process(tmp_path, "--steps", "5", "--batch-size", "64"), rtol=1e-3)


def test_batch_that_does_not_split_is_refused_once(tmp_path):
    out = run_ranks(2, [*TRAIN, "--steps", "2", "--batch-size", "63", "--metrics", str(tmp_path / "m.csv")])
    assert out.returncode == 2 and out.stdout == ""
    assert errors(out.stderr) == ["error: rank 0: --batch-size 63 does not split evenly over 2 ranks; "
                                  "use a multiple of 2"]
    assert ours(out.stderr) == errors(out.stderr) and not os.listdir(tmp_path)


# --------------------------------------------------------------------------- errors
def test_output_lock_only_rank_0_sees_stops_every_rank(tmp_path):
    save = str(tmp_path / "trained.onnx")
    lock = lock_path(save)
    with open(lock, "w") as f:  # another live run (this test's process) holds --save
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
    out = run_ranks(2, [*TRAIN, "--steps", "2", "--batch-size", "64", "--save", save])
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert ours(out.stderr) == [
        f"error: rank 0: --save {save!r} is being written by another run (process {os.getpid()} on "
        f"{socket.gethostname()!r}); wait for it, or give another path (its lock: {lock!r})"]
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(lock)]


def test_a_bug_on_one_rank_aborts_every_rank(tmp_path):
    script = tmp_path / "inject.py"
    script.write_text(INJECT.format(error='RuntimeError("injected failure")'))
    metrics = tmp_path / "m.csv"
    out = run_ranks(2, [sys.executable, str(script), "train", "--steps", "6", "--batch-size", "64",
                        "--metrics", str(metrics), "-q"], env={"PYTHONPATH": ROOT})
    assert out.returncode == 2 and out.stdout == ""
    assert errors(out.stderr) == ["error: rank 1: RuntimeError: injected failure"]
    assert "Traceback" in out.stderr  # a bug keeps its traceback
    assert "MPI_ABORT was invoked on rank 1" in out.stderr  # mpirun's report: it stopped rank 0
    assert [r["step"] for r in rows(metrics)] == ["0", "1"]  # rank 0 wrote the steps before


# rank 1 gets other arguments than rank 0 (a job script that differs per rank)
OTHER_ARGS = """\
import os, sys
from kfac_compiler.train_cli import main
argv = sys.argv[1:]
if os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK")) == "1":
    argv += {extra!r}
sys.exit(main(argv))
"""


@pytest.mark.parametrize("extra,line", [
    (["--steps", "3"], "error: rank 1: --steps 3 differs from rank 0's 4; every rank must run the same command on the "
                       "same data"),
    (["--optimizer", "sgd", "--learning-rate", "0.1"], "error: rank 1: --learning-rate 0.1 differs from rank 0's "
                                                        "None; every rank must run the same command on the same data"),
    (["--seed", "1"], "error: rank 1: --seed 1 differs from rank 0's 0; every rank must run the same command on the "
                      "same data"),
], ids=["steps", "optimizer", "seed"])
def test_ranks_with_other_options_stop_with_one_line_instead_of_hanging(tmp_path, extra, line):
    """Was: other --steps or --optimizer hung for ever, other --seed trained apart to rc 0."""
    script = tmp_path / "other_args.py"
    script.write_text(OTHER_ARGS.format(extra=extra))
    out = run_ranks(2, [sys.executable, str(script), "train", "--steps", "4", "--batch-size", "64", "-q"],
                    env={"PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert ours(out.stderr) == [line]


def test_ranks_with_other_data_stop_with_one_line(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.savez(tmp_path / f"{name}.npz", input=rng.normal(size=(64, 64)).astype(np.float32),
                 targets=rng.integers(0, 10, 64))
    script = tmp_path / "other_data.py"
    script.write_text(OTHER_ARGS.format(extra=["--data", str(tmp_path / "b.npz")]))
    out = run_ranks(2, [sys.executable, str(script), "train", "--steps", "2", "--batch-size", "64", "-q",
                        "--data", str(tmp_path / "a.npz")], env={"PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    (got,) = ours(out.stderr)
    assert got.startswith("error: rank 1: --data ") and "differs from rank 0's" in got


def test_compile_and_inspect_under_mpirun_run_on_rank_0_alone(tmp_path):
    """Was: two ranks raced on the plan folder (rc 2, sometimes no plan and a stale lock) and
    inspect printed two JSON documents."""
    from kfac_compiler.models import save_model

    model = save_model("mlp_classifier", tmp_path / "m.onnx")
    plan = tmp_path / "plan"
    cli = [sys.executable, "-m", "kfac_compiler.cli"]
    out = run_ranks(2, [*cli, "compile", str(model), "--loss", "softmax_cross_entropy", "-q", "-o", str(plan)],
                    timeout=120)
    assert out.returncode == 0 and ours(out.stderr) == [], out.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "plan"]
    out = run_ranks(2, [*cli, "inspect", str(plan), "--format", "json"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["layers"]  # one document


@pytest.mark.slow
def test_a_kfac_error_on_one_rank_aborts_with_one_line(tmp_path):
    script = tmp_path / "inject.py"
    script.write_text(INJECT.format(error='DataError("batch 2 is unreadable here")'))
    out = run_ranks(2, [sys.executable, str(script), "train", "--steps", "6", "--batch-size", "64", "-q"],
                    env={"PYTHONPATH": ROOT})
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert ours(out.stderr) == ["error: rank 1: batch 2 is unreadable here"]
    assert "MPI_ABORT was invoked on rank 1" in out.stderr


@pytest.mark.slow
def test_bad_rows_on_one_rank_are_agreed_and_raised_on_every_rank(tmp_path):
    """The API: rank 1 alone reads a batch with a NaN (a damaged read there); every rank raises
    rank 1's DataError, none steps."""
    script = tmp_path / "bad_rows.py"
    script.write_text("""\
import numpy as np
import kfac_compiler as kc
from kfac_compiler.errors import DataError
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer

entry = ZOO["mlp_classifier"]
plan = kc.compile(entry.build(seed=0), loss=entry.loss, output=entry.output_name, emit=False)
x, y = entry.make_data(64, seed=0)
trainer = Trainer(plan, batch_size=64)
trainer.step(x, y)
if trainer.rank == 1:
    x["input"][40, 3] = np.nan
try:
    trainer.step(x, y)
except DataError as e:
    print(f"rank {trainer.rank} raised: {e} | steps {trainer.step_count}", flush=True)
""")
    out = run_ranks(2, [sys.executable, str(script)], env={"PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert len(lines) == 2 and lines[0].startswith("rank 0 raised: rank 1: ") and lines[1].startswith("rank 1 raised: rank 1: ")
    assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1] == (
        "rank 1: batch: array 'input' contains 1 NaN/Inf value(s) | steps 1")


# --------------------------------------------------------------------------- interrupt, resume
def _interrupted_run(tmp_path, send, wait: float = 180) -> tuple[subprocess.CompletedProcess, str, str]:
    """`mpirun -n 2 train` with metrics and a checkpoint: `send(proc)` once 3 steps are in the
    metrics, then the run's end within `wait` seconds (a hang fails)."""
    metrics, ckpt = str(tmp_path / "m.csv"), str(tmp_path / "run.ckpt")
    proc = subprocess.Popen(rank_command(2, [*TRAIN, "--steps", "100000", "--batch-size", "64", "--metrics", metrics,
                                             "--checkpoint", ckpt]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1"))
    try:
        deadline = time.monotonic() + 180
        while not (os.path.exists(metrics) and len(open(metrics).read().splitlines()) > 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        send(proc)
        stdout, stderr = proc.communicate(timeout=wait)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), metrics, ckpt


def _rank_pid(mpirun_pid: int, rank: int) -> int:
    """The pid of `rank` among mpirun's children (read off their environment)."""
    for pid in subprocess.run(["pgrep", "-P", str(mpirun_pid)], capture_output=True, text=True).stdout.split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in f.read().split(b"\0"):
                return int(pid)
    raise AssertionError(f"no rank {rank} under mpirun {mpirun_pid}")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGUSR1 to mpirun", "SIGINT to rank 1 alone"])
def test_interrupt_stops_every_rank_at_one_step(tmp_path, how):
    if how == "SIGUSR1 to mpirun":
        send = lambda proc: os.kill(proc.pid, signal.SIGUSR1)  # noqa: E731 (mpirun forwards it)
    else:
        if not os.path.isdir("/proc"):
            pytest.skip("finding a rank's pid reads /proc")
        send = lambda proc: os.kill(_rank_pid(proc.pid, 1), signal.SIGINT)  # noqa: E731
    out, metrics, ckpt = _interrupted_run(tmp_path, send)
    assert out.returncode == 130
    steps = [int(r["step"]) for r in rows(metrics)]
    last = len(steps)
    assert steps == list(range(last))
    assert [line for line in ours(out.stderr) if not line.startswith("training ")] == [
        f"interrupted at step {last}; checkpoint written to {ckpt}"]
    assert read_meta(ckpt)["host"]["step_count"] == last  # the step every rank stopped at


@pytest.mark.slow
def test_resume_on_two_ranks_continues_the_straight_run(tmp_path):
    common = ["--batch-size", "64", "-q"]
    straight, half = tmp_path / "straight.ckpt", tmp_path / "half.ckpt"
    a = run_ranks(2, [*TRAIN, "--steps", "6", "--checkpoint", str(straight), "--checkpoint-every", "3",
                      "--metrics", str(tmp_path / "straight.csv"), *common])
    assert a.returncode == 0, a.stderr
    b = run_ranks(2, [*TRAIN, "--steps", "3", "--checkpoint", str(half), "--metrics", str(tmp_path / "half.csv"),
                      *common])
    assert b.returncode == 0, b.stderr
    c = run_ranks(2, [*TRAIN, "--steps", "6", "--resume", str(half), "--checkpoint", str(half),
                      "--metrics", str(tmp_path / "half.csv"), *common])
    assert c.returncode == 0, c.stderr
    assert ours(c.stderr) == []  # the same number of ranks: no note
    assert_same_run(rows(tmp_path / "half.csv"), rows(tmp_path / "straight.csv"))
    for p, q in zip(params(half), params(straight)):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-7)
    assert read_meta(half)["host"]["step_count"] == 6


@pytest.mark.slow
def test_resume_on_another_number_of_ranks_is_allowed_with_a_note(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    b = run_ranks(2, [*TRAIN, "--steps", "3", "--batch-size", "64", "--checkpoint", str(ckpt), "-q"])
    assert b.returncode == 0, b.stderr
    c = run_ranks(4, [*TRAIN, "--steps", "6", "--resume", str(ckpt), "--checkpoint", str(ckpt),
                      "--metrics", str(tmp_path / "m.csv"), "-q"])
    assert c.returncode == 0, c.stderr
    assert ours(c.stderr) == [f"warning: checkpoint {str(ckpt)!r} was written by 2 ranks, resuming on 4: the same run "
                              "up to float rounding (the batches, noise and factors do not depend on the number of "
                              "ranks)"]
    assert read_meta(ckpt)["ranks"] == 4
    straight = one_process(tmp_path, "--steps", "6", "--batch-size", "64")
    assert_same_run(rows(tmp_path / "m.csv"), straight[3:], PAST_KINK)  # steps 4-6: past the kink


@pytest.mark.slow
def test_rank_0_failing_to_write_a_checkpoint_stops_every_rank_at_that_step(tmp_path):
    """A full disk when rank 0 writes the periodic checkpoint at step 4 (the others have moved
    on): every rank stops there, the metrics stay, one line names rank 0."""
    script = tmp_path / "full_disk.py"
    script.write_text("""\
import errno, sys
import kfac_compiler.runtime.checkpoint as checkpoint
from kfac_compiler.train_cli import main

def full(trainer, path):
    raise OSError(errno.ENOSPC, "No space left on device")
checkpoint.save_checkpoint = full
sys.exit(main(sys.argv[1:]))
""")
    metrics, ckpt = tmp_path / "m.csv", tmp_path / "run.ckpt"
    out = run_ranks(2, [sys.executable, str(script), "train", "--steps", "8", "--batch-size", "64", "-q",
                        "--metrics", str(metrics), "--checkpoint", str(ckpt), "--checkpoint-every", "4"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert ours(out.stderr) == [f"error: rank 0: stopped at step 4: --checkpoint: cannot write {str(ckpt)!r}: "
                                f"the disk is full: free space or choose another location (written: metrics {str(metrics)!r})"]
    lines = out.stdout.splitlines()  # as in one process: the summary of the steps taken, what was written
    assert len(lines) == 3 and "(4 steps" in lines[0] and lines[2] == f"metrics written to {metrics}"
    assert [r["step"] for r in rows(metrics)] == ["0", "1", "2", "3"] and not ckpt.exists()


@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_the_job_and_the_next_run_takes_its_locks_over(tmp_path):
    """kill -9 of rank 1 while both ranks train (rank 0 then waits in a collective that will
    never complete): mpirun ends the job, killing rank 0, well within the 60 s the test waits
    (measured 0.6 s); rank 0's output locks are left by a kill that no handler sees, and the
    next run on the same paths takes them over (their process is gone) and trains to rc 0."""
    if not os.path.isdir("/proc"):
        pytest.skip("finding a rank's pid reads /proc")
    done, metrics, ckpt = _interrupted_run(tmp_path, lambda proc: os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL),
                                           wait=60)  # a hang fails there
    assert done.returncode != 0 and "exited on signal 9" in " ".join(done.stderr.replace("\x00", "").split())  # mpirun's report
    assert lock_path(metrics) in [str(tmp_path / f) for f in os.listdir(tmp_path)]  # rank 0's, left by the kill
    out = run_ranks(2, [*TRAIN, "--steps", "2", "--batch-size", "64", "--metrics", metrics, "--checkpoint", ckpt, "-q"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert [int(r["step"]) for r in rows(metrics)] == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["m.csv", "run.ckpt"]
