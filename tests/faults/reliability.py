"""The fault census's cases for issue 39 (reliability under signals, schedulers and mismatches):
special files as outputs, ranks that disagree under mpirun, sizes and nesting, threads, reruns
and odd runs. Registered in faults.cases.CASES with their topic (faults.cases.TOPICS); the
behaviour each checks is in docs (cli.md, distributed.md, runtime.md) and its unit tests
(test_run_io, test_mpi_cli, test_budget, test_nesting, test_trainer_threads, test_reproducible,
test_load_validation, test_cli, test_train_cli), which these do not replace: the census runs
them as a user would meet them, judged by one standard.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from faults.cases import MODEL_ARGS, TRAIN, _batch, _external_model, _j, _no_steps, _trainer, case
from faults.harness import (
    ASSETS,
    REPO_DIR,
    Judge,
    Result,
    Verdict,
    call,
    cli_command,
    listing,
    metrics_rows,
    read_checkpoint,
    run_cli,
    same_checkpoint_state,
    snapshot,
    subprocess_env,
)

DEEP = "[" * 100_000 + "]" * 100_000  # past any recursion limit
NOT_REGULAR = "not a regular file"


# =========================================================================== special outputs
@contextmanager
def _special(d: str, kind: str) -> Iterator[str]:
    """A device, a FIFO or a bound UNIX socket to hand over as an output path."""
    if kind == "device":
        yield "/dev/null"
        return
    path = _j(d, kind)
    if kind == "fifo":
        os.mkfifo(path)
        yield path
        return
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    try:
        yield path
    finally:
        sock.close()


def _cli_special_output(d: str, flag: str, kind: str) -> Verdict:
    """`train FLAG <special file>`: one line naming it before the first step; it stays what it was."""
    j = Judge()
    j.mechanism = kind
    metrics = _j(d, "m.csv")
    with _special(d, kind) as target:
        mode = os.stat(target).st_mode
        before = listing(d)
        steps = [] if flag == "--metrics" else ["--metrics", metrics]
        j.error_line(run_cli([*TRAIN, flag, target, *steps]), [target, NOT_REGULAR], if_accepted="overwritten")
        _no_steps(j, metrics)
        j.check(os.stat(target).st_mode == mode, "overwritten", f"{target} is no longer a {kind}")
        j.no_strays(d, before)
    return j.verdict()


@case("overwritten", topic="special outputs")
def checkpoint_onto_a_fifo(d: str) -> Verdict:
    return _cli_special_output(d, "--checkpoint", "fifo")


@case("overwritten", topic="special outputs")
def metrics_onto_a_socket(d: str) -> Verdict:
    return _cli_special_output(d, "--metrics", "socket")


@case("overwritten", fast=True, topic="special outputs")
def save_onto_dev_null(d: str) -> Verdict:
    return _cli_special_output(d, "--save", "device")


def _api_special_output(d: str, kind: str, write: Callable[[Any, str], Any]) -> Verdict:
    j = Judge()
    j.mechanism = kind
    tr = _trainer()
    with _special(d, kind) as target:
        mode = os.stat(target).st_mode
        _, exc = call(lambda: write(tr, target))
        j.api_error(exc, [target], if_accepted="overwritten")
        j.check(os.stat(target).st_mode == mode, "overwritten", f"{target} is no longer a {kind}")
    return j.verdict()


@case("overwritten", topic="special outputs")
def api_checkpoint_onto_a_fifo(d: str) -> Verdict:
    return _api_special_output(d, "fifo", lambda tr, p: tr.save_checkpoint(p))


@case("overwritten", topic="special outputs")
def api_export_onto_a_socket(d: str) -> Verdict:
    return _api_special_output(d, "socket", lambda tr, p: tr.export(p))


# =========================================================================== ranks
# rank 1 adds EXTRA to its command line; with PER_RANK each rank runs in its own folder rank<r>
OTHER_RANK = """\
import os, sys
from kfac_compiler.cli import main
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
argv = sys.argv[1:] + ({extra!r} if rank == "1" else [])
if {per_rank!r}:
    os.chdir(os.path.join({folder!r}, "rank" + rank))
sys.exit(main(argv))
"""


def _ranks(d: str, argv: list[str], extra: list[str] = (), per_rank: bool = False,  # type: ignore[assignment]
           timeout: float = 180) -> Result | None:
    """`mpirun -n 2 kfac-compiler ARGV` (rank 1 with EXTRA); None when it ran past `timeout`."""
    from mpi_util import own_lines, require_mpi, run_ranks

    require_mpi()
    script = _j(d, "rank_args.py")
    with open(script, "w") as f:
        f.write(OTHER_RANK.format(extra=list(extra), per_rank=per_rank, folder=d))
    try:
        p = run_ranks(2, [sys.executable, script, *argv], timeout=timeout, cwd=d,
                      env={"PYTHONPATH": REPO_DIR, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return None
    return Result(p.returncode, p.stdout, "\n".join(own_lines(p.stderr)))


def _rank_mismatch(d: str, extra: list[str], words: list[str], per_rank: bool = False,
                   argv: list[str] | None = None) -> Verdict:
    """Ranks that run other commands or data: one line naming rank 1 and what differs, exit 2, never a hang."""
    j = Judge()
    j.mechanism = "mpirun"
    before = listing(d)
    r = _ranks(d, argv or ["train", "--steps", "4", "--batch-size", "64", "-q"], extra, per_rank)
    if r is None:
        j.problem("hang", "mpirun ran past 180 s")
        return j.verdict()
    j.error_line(r, words)
    j.check("rank 1" in r.err, "unclear", f"the line does not name rank 1: {r.err[:200]}")
    j.no_strays(d, before, [_j(d, "rank_args.py")])
    return j.verdict()


@case("hang", topic="ranks")
def ranks_with_other_steps(d: str) -> Verdict:
    """Was: other --steps hung for ever."""
    return _rank_mismatch(d, ["--steps", "3"], ["--steps 3"])


@case("hang", topic="ranks")
def ranks_with_other_optimizers(d: str) -> Verdict:
    """Was: other --optimizer hung for ever."""
    return _rank_mismatch(d, ["--optimizer", "sgd", "--learning-rate", "0.1"], ["--learning-rate", "--optimizer"])


@case("silent", topic="ranks")
def ranks_with_other_seeds(d: str) -> Verdict:
    """Was: other --seed trained apart to exit 0."""
    return _rank_mismatch(d, ["--seed", "1"], ["--seed 1"])


@case("hang", topic="ranks")
def ranks_with_other_data(d: str) -> Verdict:
    with np.load(ASSETS.data()) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(_j(d, "a.npz"), **arrays)
    np.savez(_j(d, "b.npz"), **{k: v[::-1].copy() for k, v in arrays.items()})
    return _rank_mismatch(d, ["--data", _j(d, "b.npz")], ["--data"],
                          argv=["train", "--steps", "2", "--batch-size", "64", "-q", "--data", _j(d, "a.npz")])


@case("hang", topic="ranks")
def ranks_with_plans_of_one_path_and_other_contents(d: str) -> Verdict:
    """Each rank's folder has a plan named `plan`, compiled with other approximations: the command
    lines agree, the plans' fingerprints do not."""
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    ASSETS.copy(ASSETS.plan(), _j(d, "rank0", "plan"))
    cfg = _j(d, "other.json")
    with open(cfg, "w") as f:
        json.dump({"layers": {"fc1": "kron_out_diag"}}, f)
    r = run_cli(["compile", model, *MODEL_ARGS, "--config", cfg, "-q", "-o", _j(d, "rank1", "plan")])
    if r.code != 0:
        return Verdict("unclear", f"could not compile the other plan: {r.err[:200]}")
    return _rank_mismatch(d, [], ["plan fingerprint"], per_rank=True,
                          argv=["train", "plan", "--steps", "2", "--batch-size", "64", "-q"])


@case("overwritten", topic="ranks")
def compile_and_inspect_under_mpirun(d: str) -> Verdict:
    """Was: two ranks raced on the plan folder (exit 2, sometimes no plan and a stale lock) and
    inspect printed two JSON documents: now rank 0 alone writes and prints."""
    j = Judge()
    j.mechanism = "mpirun"
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    before = listing(d)
    r = _ranks(d, ["compile", model, *MODEL_ARGS, "-q", "-o", _j(d, "plan")])
    if r is None:
        j.problem("hang", "mpirun compile ran past 180 s")
        return j.verdict()
    if j.success(r):
        j.check(r.err.strip() == "", "unclear", f"stderr: {r.err[:200]}")
        j.check(os.path.isfile(_j(d, "plan", "plan.json")), "lost", "no plan written")
    j.no_strays(d, before, [_j(d, "plan"), _j(d, "rank_args.py")])
    j.no_strays(_j(d, "plan"), {p for p in listing(_j(d, "plan")) if ".kfac-" not in p})
    r = _ranks(d, ["inspect", _j(d, "plan"), "--format", "json"])
    if r is None:
        j.problem("hang", "mpirun inspect ran past 180 s")
    elif j.success(r):
        _, exc = call(lambda: json.loads(r.out))
        j.check(exc is None, "silent", f"inspect's output is not one JSON document: {exc}")
    return j.verdict()


# =========================================================================== lying sizes
@case("traceback", fast=True, topic="lying sizes")
def approximation_over_the_memory_budget(d: str) -> Verdict:
    """A chosen kron whose state is bigger than budget.memory_gb: refused at compile time with
    one line naming the layer and what fits, instead of running out of memory in training."""
    j = Judge()
    cfg = _j(d, "config.json")
    with open(cfg, "w") as f:
        json.dump({"budget": {"memory_gb": 2e-4}, "layers": {"fc1": "kron"}}, f)
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    before = listing(d)
    j.error_line(run_cli(["compile", model, *MODEL_ARGS, "--config", cfg, "-o", _j(d, "plan")]), ["'fc1'"])
    j.no_strays(d, before)
    return j.verdict()


@case("traceback", fast=True, topic="lying sizes")
def approximations_together_over_the_memory_budget(d: str) -> Verdict:
    """Three chosen krons that each fit budget.memory_gb but not together: refused at compile
    time with one line naming the total and the largest layer."""
    j = Judge()
    cfg = _j(d, "config.json")
    with open(cfg, "w") as f:
        json.dump({"budget": {"memory_gb": 1e-3}, "layers": {"fc1": "kron", "fc2": "kron", "fc3": "kron"}}, f)
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    before = listing(d)
    j.error_line(run_cli(["compile", model, *MODEL_ARGS, "--config", cfg, "-o", _j(d, "plan")]),
                 ["'fc2'", "budget.memory_gb"])
    j.no_strays(d, before)
    return j.verdict()


# =========================================================================== nesting
@case("traceback", fast=True, topic="nesting")
def toml_config_nested_100000_deep(d: str) -> Verdict:
    j = Judge()
    cfg = _j(d, "config.toml")
    with open(cfg, "w") as f:
        f.write(f"a = {DEEP}\n")
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    j.error_line(run_cli(["compile", model, *MODEL_ARGS, "--config", cfg, "-o", _j(d, "plan")]), ["config.toml"])
    return j.verdict()


@case("traceback", topic="nesting")
def plan_json_nested_100000_deep(d: str) -> Verdict:
    j = Judge()
    plan = ASSETS.copy(ASSETS.plan(), _j(d, "plan"))
    with open(_j(plan, "plan.json"), "w") as f:
        f.write(f'{{"schema_version": {DEEP}}}')
    j.error_line(run_cli(["train", plan, "--steps", "2", "-q"]), ["plan.json"])
    return j.verdict()


@case("traceback", topic="nesting")
def checkpoint_metadata_nested_100000_deep(d: str) -> Verdict:
    j = Judge()
    ckpt = _j(d, "run.ckpt")
    with open(ckpt, "wb") as f:
        np.savez(f, __meta__=np.frombuffer(f'{{"format": {DEEP}}}'.encode(), dtype=np.uint8))
    files = snapshot(ckpt)
    j.error_line(run_cli(["train", "--steps", "3", "-q", "--resume", ckpt]), ["run.ckpt"])
    j.unchanged(files)
    return j.verdict()


# =========================================================================== threads
@case("silent", topic="threads")
def one_trainer_stepped_from_two_threads(d: str) -> Verdict:
    """Two threads step one K-FAC Trainer 5 times each on one batch: the parameters are those of
    the same 10 steps in sequence (a step reads and flips double-buffered state; unserialized
    steps would mix buffers without an error)."""
    j = Judge()
    j.mechanism = "threads"
    x, y = _batch(64)
    sequential, shared = _trainer(optimizer="kfac"), _trainer(optimizer="kfac")
    for _ in range(10):
        sequential.step({"input": x}, y)
    go, errors = threading.Barrier(2), []

    def work() -> None:
        go.wait()
        for _ in range(5):
            _, exc = call(lambda: shared.step({"input": x}, y))
            if exc is not None:
                errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        j.problem("traceback", f"{type(errors[0]).__name__}: {errors[0]}")
    want, got = sequential.parameters(), shared.parameters()
    differ = [p for p in want if not np.array_equal(got[p], want[p])]
    j.check(not differ, "silent", f"parameters differ from the sequential steps': {differ[:3]}")
    return j.verdict()


@case("silent", fast=True, topic="threads")
def a_million_threads(d: str) -> Verdict:
    """`train --threads 1000000`: capped at the CPUs this process may use, with one warning
    naming the flag; the run trains."""
    j = Judge()
    metrics = _j(d, "m.csv")
    r = run_cli([*TRAIN, "--threads", "1000000", "--metrics", metrics])
    if j.success(r):
        warned = [line for line in r.err.splitlines() if line.startswith("warning: ") and "1000000" in line]
        j.check(len(warned) == 1, "silent", f"no one warning naming the thread count: {r.err[:200]}")
        j.check(len(metrics_rows(metrics)) == 2, "lost", f"{len(metrics_rows(metrics))} steps ran, not 2")
    return j.verdict()


# =========================================================================== reruns
@case("silent", topic="reruns")
def a_rerun_gives_the_same_bits(d: str) -> Verdict:
    """The same command twice (K-FAC, 3 steps, seed 0): checkpoints with bit-identical state
    and equal metrics rows but for time."""
    j = Judge()
    runs = []
    for k in range(2):
        ckpt, metrics = _j(d, f"run{k}.ckpt"), _j(d, f"m{k}.csv")
        if not j.success(run_cli(["train", "--steps", "3", "-q", "--checkpoint", ckpt, "--metrics", metrics])):
            return j.verdict()
        runs.append((ckpt, [{k: v for k, v in row.items() if "time" not in k and not k.endswith("_s")}
                            for row in metrics_rows(metrics)]))
    differ = same_checkpoint_state(runs[0][0], runs[1][0])
    j.check(differ is None, "silent", f"the rerun's checkpoint differs: {differ}")
    j.check(runs[0][1] == runs[1][1], "silent", "the rerun's metrics differ")
    return j.verdict()


# =========================================================================== odd runs
@case("silent", fast=True, topic="odd runs")
def batch_size_larger_than_the_data(d: str) -> Verdict:
    """--batch-size 64 on 20 examples: one warning naming --batch-size, then every batch is all 20."""
    j = Judge()
    with np.load(ASSETS.data()) as z:
        np.savez(_j(d, "small.npz"), **{k: z[k][:20] for k in z.files})
    metrics = _j(d, "m.csv")
    r = run_cli([*TRAIN, "--data", _j(d, "small.npz"), "--batch-size", "64", "--metrics", metrics])
    if j.success(r):
        warned = [line for line in r.err.splitlines() if line.startswith("warning: ") and "--batch-size" in line]
        j.check(len(warned) == 1, "silent", f"no one warning naming --batch-size: {r.err[:200]}")
        j.check(len(metrics_rows(metrics)) == 2, "lost", f"{len(metrics_rows(metrics))} steps ran, not 2")
    return j.verdict()


@case("traceback", topic="odd runs")
def train_with_stdout_closed(d: str) -> Verdict:
    """`kfac-compiler train ... >&-` (not quiet): the progress is discarded, the run trains and
    writes its model."""
    j = Judge()
    j.mechanism = "subprocess"
    model = _j(d, "trained.onnx")
    p = subprocess.run(cli_command(["train", "--steps", "2", "--save", model]), cwd=d, env=subprocess_env(),
                       stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1))
    if j.success(Result(p.returncode, "", p.stderr)):
        j.check(os.path.isfile(model), "lost", "no model written")
    return j.verdict()


@case("traceback", topic="signals")
def ctrl_c_twice_during_training(d: str) -> Verdict:
    """Two SIGINTs: the second ends the run at once, exit 130, one line; the periodic checkpoint
    is complete (or the final one), no temp file or lock is left."""
    j = Judge()
    j.mechanism = "SIGINT x2"
    ckpt, metrics = _j(d, "run.ckpt"), _j(d, "steps.csv")
    argv = ["train", "--steps", "100000", "-q", "--checkpoint", ckpt, "--checkpoint-every", "3", "--metrics", metrics]
    before = listing(d)
    p = subprocess.Popen(cli_command(argv), cwd=d, env=subprocess_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(metrics_rows(metrics)) < 5 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        j.problem("hang", "no exit within 120 s of two SIGINTs")
        return j.verdict()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    j.error_line(Result(p.returncode, out, err), ["interrupted"], code=130, prefix="")
    if os.path.isfile(ckpt):
        _, exc = call(lambda: read_checkpoint(ckpt))
        j.check(exc is None, "lost", f"the checkpoint does not read: {exc}")
    else:
        j.problem("lost", "no checkpoint (the periodic one every 3 steps)")
    j.no_strays(d, before, [ckpt, metrics])
    return j.verdict()


def _external_not_a_file(d: str, kind: str) -> Verdict:
    """A model whose external data file is a FIFO or a folder: one line naming it (a FIFO opened
    for reading would block until a writer comes: for ever)."""
    j = Judge()
    j.mechanism = kind
    model = _j(d, "m", "model.onnx")
    _external_model(model, "w.bin", _j(d, "secret.bin"))
    if kind == "fifo":
        os.mkfifo(_j(d, "m", "w.bin"))
    else:
        os.mkdir(_j(d, "m", "w.bin"))
    try:
        p = subprocess.run(cli_command(["compile", model, *MODEL_ARGS, "-q", "-o", _j(d, "plan")]), cwd=d,
                           env=subprocess_env(), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        j.problem("hang", "compile ran past 120 s")
        return j.verdict()
    j.error_line(Result(p.returncode, p.stdout, p.stderr), ["w.bin"])
    j.check(not os.path.exists(_j(d, "plan")), "leftover", "a plan folder was left")
    return j.verdict()


@case("hang", topic="odd runs")
def a_fifo_as_external_data(d: str) -> Verdict:
    return _external_not_a_file(d, "fifo")


@case("traceback", topic="odd runs")
def a_folder_as_external_data(d: str) -> Verdict:
    return _external_not_a_file(d, "folder")

