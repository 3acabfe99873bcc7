"""The fault census of issue 24: one small function per case, grouped by the issue's bullets.

Each case gets an empty folder, sets up its files there, runs the CLI (in this process, or as a
subprocess where a kill or a signal is involved) or the API, and returns a Verdict: "clean"
(the right error as one line with exit code 2, or the right result, and nothing of the user's
changed, no stray files) or the worst problem found (harness.STATUSES).

`CASES` is the registry; `fast` cases run in the default test run, the others (several runs,
subprocesses) are marked slow.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from faults.harness import (
    ASSETS,
    Judge,
    Result,
    Verdict,
    call,
    cli_command,
    listing,
    lying_npz,
    metrics_rows,
    read_checkpoint,
    run_cli,
    run_subprocess,
    snapshot,
    subprocess_env,
)
from faults.inject import full_disk, read_only

CATEGORIES = {
    "lost": "trained results lost (unwritable outputs, data that aborts a run)",
    "overwritten": "user files overwritten",
    "traceback": "tracebacks instead of one line",
    "silent": "silent wrong results",
    "leftover": "leftovers after a kill -9",
    "outside": "plans reading files outside their folder",
    "hang": "runs that hang instead of stopping with one line (ranks that disagree, pipes read as files)",
}

TOPICS = {
    "signals": "SIGTERM/SIGHUP/SIGINT (twice) during train: a step boundary, the outputs, 143/129/130, no strays",
    "special outputs": "devices, FIFOs and sockets as output paths (CLI and API)",
    "ranks": "mpirun ranks whose options, plan, data or seed differ; compile/inspect write on rank 0 alone",
    "lying sizes": "npz headers, checkpoint slots, initializers and approximations bigger than they can be",
    "nesting": "nesting depth in JSON/TOML configs, plan.json, checkpoint metadata",
    "threads": "one Trainer stepped from two threads; absurd thread counts",
    "reruns": "a rerun with the same seed gives the same bits",
    "odd runs": "--batch-size beyond the data, stdout closed, a FIFO or folder as external data",
}
"""Issue 39's reliability topics: a case may belong to one (the census counts them apart)."""


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    run: Callable[[str], Verdict]
    fast: bool = False
    doc: str = ""
    topic: str = ""


CASES: list[Case] = []


def case(category: str, fast: bool = False,
         topic: str = "") -> Callable[[Callable[[str], Verdict]], Callable[[str], Verdict]]:
    def register(fn: Callable[[str], Verdict]) -> Callable[[str], Verdict]:
        assert category in CATEGORIES and (not topic or topic in TOPICS)
        CASES.append(Case(fn.__name__.replace("_", "-"), category, fn, fast, (fn.__doc__ or "").strip(), topic))
        return fn
    return register


TRAIN = ["train", "--steps", "2", "-q"]
INPUT = ["'input'", '"input"']  # the data array named in a message
MODEL_ARGS = ["--loss", "softmax_cross_entropy", "--output", "logits"]


def _j(*parts: str) -> str:
    return os.path.join(*parts)


def _no_steps(j: Judge, metrics: str) -> None:
    """The failure came before the first step (else the run's training was thrown away)."""
    n = len(metrics_rows(metrics))
    j.check(n == 0, "lost", f"{n} step(s) ran before the error: the training was thrown away")


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


# =========================================================================== lost
def _unwritable(d: str, flag: str, name: str, fault: str) -> Verdict:
    """`train --FLAG <unwritable>/name`: refused before the first step, one line naming it."""
    j = Judge()
    target, metrics = _j(d, "target"), _j(d, "m.csv")
    previous = {"full": b"the user's previous file\n"}.get(fault)

    def populate(p: str) -> None:
        if previous:
            _write(_j(p, name), previous)

    maker = read_only if fault == "ro" else full_disk
    with maker(target, populate) as mech:
        j.mechanism = mech
        before, files = listing(target), snapshot(target)
        steps = [] if flag == "--metrics" else ["--metrics", metrics]  # the metrics file shows steps ran
        r = run_cli([*TRAIN, flag, _j(target, name), *steps])
        j.error_line(r, [name], if_accepted="lost")
        _no_steps(j, metrics)
        j.unchanged(files)
        j.no_strays(target, before)
    return j.verdict()


@case("lost", fast=True)
def save_into_read_only_folder(d: str) -> Verdict:
    """--save into a read-only folder: found before training, not after."""
    return _unwritable(d, "--save", "trained.onnx", "ro")


@case("lost")
def checkpoint_into_read_only_folder(d: str) -> Verdict:
    return _unwritable(d, "--checkpoint", "run.ckpt", "ro")


@case("lost")
def metrics_into_read_only_folder(d: str) -> Verdict:
    return _unwritable(d, "--metrics", "steps.csv", "ro")


@case("lost")
def save_onto_full_disk(d: str) -> Verdict:
    """--save onto a full disk: found before training; the previous file there kept."""
    return _unwritable(d, "--save", "trained.onnx", "full")


@case("lost")
def checkpoint_onto_full_disk(d: str) -> Verdict:
    return _unwritable(d, "--checkpoint", "run.ckpt", "full")


def _trailing_slash(d: str, flag: str) -> Verdict:
    j = Judge()
    metrics = _j(d, "m.csv")
    before = listing(d)
    r = run_cli([*TRAIN, flag, _j(d, "out") + "/", "--metrics", metrics])
    j.error_line(r, [_j(d, "out")], if_accepted="lost")
    _no_steps(j, metrics)
    j.no_strays(d, before, [metrics])
    return j.verdict()


@case("lost")
def save_path_ending_in_slash(d: str) -> Verdict:
    return _trailing_slash(d, "--save")


@case("lost")
def checkpoint_path_ending_in_slash(d: str) -> Verdict:
    return _trailing_slash(d, "--checkpoint")


@case("lost", fast=True)
def float64_data_beyond_float32(d: str) -> Verdict:
    """float64 data beyond float32's range: refused by the data check, not mid-run."""
    j = Judge()
    with np.load(ASSETS.data()) as z:
        x, y = z["input"].astype(np.float64), z["targets"]
    x[5, 3] = 1e39
    data, metrics = _j(d, "big.npz"), _j(d, "m.csv")
    np.savez(data, input=x, targets=y)
    r = run_cli([*TRAIN, "--data", data, "--metrics", metrics])
    j.error_line(r, INPUT, if_accepted="silent")
    _no_steps(j, metrics)
    return j.verdict()


@case("lost")
def kill_9_at_each_step_of_a_plan_resave(d: str) -> Verdict:
    """kill -9 at every file-system event (not the data writes) of `compile -o` over an
    existing plan: afterwards a plan loads from the folder (the old or the new one)."""
    from kfac_compiler.plan import load_plan

    j = Judge()
    j.mechanism = "kill -9"
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    argv = ["compile", model, *MODEL_ARGS, "-q", "-o", _j(d, "plan")]
    log = _j(os.path.dirname(d), os.path.basename(d) + ".events")
    ASSETS.copy(ASSETS.plan(), _j(d, "plan"))
    r = run_subprocess(argv, d, events_log=log)
    if not j.success(r):
        return j.verdict()
    with open(log, encoding="utf-8") as f:
        events = [line.split(" ", 2) for line in f.read().splitlines()]
    os.unlink(log)
    points = [int(n) for n, kind, _ in events if kind != "write"]
    for n in points:
        shutil.rmtree(d)
        os.makedirs(d)
        ASSETS.copy(ASSETS.model(), model)
        ASSETS.copy(ASSETS.plan(), _j(d, "plan"))
        r = run_subprocess(argv, d, kill_at=n)
        _, exc = call(lambda: load_plan(_j(d, "plan")))
        if exc is not None:
            kind, path = events[n - 1][1], events[n - 1][2]
            j.problem("lost", f"killed before event {n} ({kind} {path}): no plan loads ({type(exc).__name__})")
            break
    return j.verdict()


# =========================================================================== overwritten
@case("overwritten")
def save_and_checkpoint_same_path(d: str) -> Verdict:
    """--save X --checkpoint X: refused before training."""
    j = Judge()
    metrics = _j(d, "m.csv")
    r = run_cli([*TRAIN, "--save", _j(d, "out.bin"), "--checkpoint", _j(d, "out.bin"), "--metrics", metrics])
    j.error_line(r, ["out.bin"], if_accepted="overwritten")
    _no_steps(j, metrics)
    return j.verdict()


@case("overwritten")
def checkpoint_is_a_symlink_to_save(d: str) -> Verdict:
    """--checkpoint LINK where LINK points at the --save file: the same file, refused."""
    j = Judge()
    os.symlink("trained.onnx", _j(d, "link.ckpt"))
    r = run_cli([*TRAIN, "--save", _j(d, "trained.onnx"), "--checkpoint", _j(d, "link.ckpt")])
    j.error_line(r, ["link.ckpt", "trained.onnx"], if_accepted="overwritten")
    return j.verdict()


@case("overwritten")
def metrics_and_checkpoint_same_path(d: str) -> Verdict:
    j = Judge()
    r = run_cli([*TRAIN, "--metrics", _j(d, "run.csv"), "--checkpoint", _j(d, "run.csv")])
    j.error_line(r, ["run.csv"], if_accepted="overwritten")
    return j.verdict()


@case("overwritten", fast=True)
def checkpoint_onto_the_data_file(d: str) -> Verdict:
    """--checkpoint pointing at the --data file: refused, the data set byte-identical."""
    j = Judge()
    data = ASSETS.copy(ASSETS.data(), _j(d, "data.npz"))
    files = snapshot(data)
    r = run_cli([*TRAIN, "--data", data, "--checkpoint", data])
    j.error_line(r, ["data.npz"], if_accepted="overwritten")
    j.unchanged(files)
    return j.verdict()


@case("overwritten")
def save_onto_the_model_file(d: str) -> Verdict:
    """train model.onnx --save model.onnx: the source model is an input."""
    j = Judge()
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    files = snapshot(model)
    r = run_cli(["train", model, *MODEL_ARGS, "--steps", "2", "-q", "--save", model])
    j.error_line(r, ["model.onnx"], if_accepted="overwritten")
    j.unchanged(files)
    return j.verdict()


@case("overwritten")
def checkpoint_onto_the_plans_source_model(d: str) -> Verdict:
    """train PLAN --checkpoint SOURCE, SOURCE the model PLAN was compiled from: an input too
    (was: the model replaced by a checkpoint, exit 0, and the plan stale from then on)."""
    j = Judge()
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    plan = _j(d, "plan")
    r = run_cli(["compile", model, *MODEL_ARGS, "-q", "-o", plan])
    if j.success(r):
        files = snapshot(model)
        r = run_cli(["train", plan, "--steps", "2", "-q", "--checkpoint", model])
        j.error_line(r, ["model.onnx", "source model"], if_accepted="overwritten")
        j.unchanged(files)
    return j.verdict()


@case("overwritten")
def checkpoint_onto_the_models_external_data(d: str) -> Verdict:
    """train MODEL --checkpoint DATA, DATA the file MODEL keeps its weights in (external data)."""
    import onnx

    j = Judge()
    model = _j(d, "model.onnx")
    onnx.save(onnx.load(ASSETS.model()), model, save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    files = snapshot(model, _j(d, "weights.bin"))
    r = run_cli(["train", model, *MODEL_ARGS, "--steps", "2", "-q", "--checkpoint", _j(d, "weights.bin")])
    j.error_line(r, ["weights.bin", "external data"], if_accepted="overwritten")
    j.unchanged(files)
    return j.verdict()


@case("overwritten")
def save_onto_the_resumed_checkpoint(d: str) -> Verdict:
    j = Judge()
    ckpt = ASSETS.copy(ASSETS.checkpoint(), _j(d, "run.ckpt"))
    files = snapshot(ckpt)
    r = run_cli(["train", "--steps", "3", "-q", "--resume", ckpt, "--save", ckpt])
    j.error_line(r, ["run.ckpt"], if_accepted="overwritten")
    j.unchanged(files)
    return j.verdict()


@case("overwritten", fast=True)
def recompile_keeps_other_files_in_the_plan_folder(d: str) -> Verdict:
    """compile -o PLAN over an existing plan: the user's other files in PLAN survive."""
    from kfac_compiler.plan import load_plan

    j = Judge()
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    plan = ASSETS.copy(ASSETS.plan(), _j(d, "plan"))
    notes = _write(_j(plan, "notes.txt"), b"my notes on this plan\n")
    os.makedirs(_j(plan, "runs"))
    run_log = _write(_j(plan, "runs", "log.txt"), b"run 1\n")
    files = snapshot(notes, run_log)
    r = run_cli(["compile", model, *MODEL_ARGS, "-q", "-o", plan])
    if j.success(r):
        _, exc = call(lambda: load_plan(plan))
        j.check(exc is None, "lost", f"the recompiled plan does not load: {exc}")
    j.unchanged(files)
    return j.verdict()


@case("overwritten")
def compile_into_a_folder_with_other_files(d: str) -> Verdict:
    """compile -o DIR where DIR holds files and no plan: refused (unless asked), files kept."""
    j = Judge()
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    out = _j(d, "work")
    os.makedirs(out)
    files = snapshot(_write(_j(out, "thesis.tex"), b"\\documentclass{article}\n"))
    before = listing(d)
    r = run_cli(["compile", model, *MODEL_ARGS, "-q", "-o", out])
    j.error_line(r, ["work"], if_accepted="overwritten")
    j.unchanged(files)
    j.no_strays(d, before)
    return j.verdict()


# =========================================================================== tracebacks
@case("traceback")
def compile_into_a_read_only_folder(d: str) -> Verdict:
    j = Judge()
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    with read_only(_j(d, "ro")) as mech:
        j.mechanism = mech
        r = run_cli(["compile", model, *MODEL_ARGS, "-q", "-o", _j(d, "ro", "plan")])
        j.error_line(r, ["plan", "ro"])
    return j.verdict()


def _disk_full_during(d: str, args: list[str], name: str, free: int | None) -> Verdict:
    """A write that runs out of space: one line naming the file, the user's other files on
    that disk kept, no temp files left."""
    j = Judge()
    disk = _j(d, "disk")
    with full_disk(disk, lambda p: _write(_j(p, "notes.txt"), b"keep me\n"), free=free) as mech:
        j.mechanism = mech
        before, files = listing(disk), snapshot(disk)
        r = run_cli([a.replace("DISK", disk) for a in args])
        j.error_line(r, [name])
        j.unchanged(files)
        j.no_strays(disk, before, [_j(disk, name)] if name.endswith((".csv", ".jsonl")) else [])
    return j.verdict()


@case("traceback", fast=True)
def disk_full_during_checkpoint_write(d: str) -> Verdict:
    return _disk_full_during(d, [*TRAIN, "--checkpoint", "DISK/run.ckpt"], "run.ckpt", None)


@case("traceback")
def disk_full_during_model_write(d: str) -> Verdict:
    return _disk_full_during(d, [*TRAIN, "--save", "DISK/trained.onnx"], "trained.onnx", None)


@case("traceback")
def disk_full_during_metrics_write(d: str) -> Verdict:
    return _disk_full_during(d, ["train", "--steps", "40", "-q", "--metrics", "DISK/steps.jsonl"], "steps.jsonl",
                             4096)


def _resume(d: str, ckpt: str, name: str) -> Verdict:
    j = Judge()
    r = run_cli(["train", "--steps", "3", "-q", "--resume", ckpt])
    j.error_line(r, [name])
    return j.verdict()


@case("traceback", fast=True)
def resume_from_a_checkpoint_with_a_flipped_byte(d: str) -> Verdict:
    """A flipped byte inside a slot's data (zip CRC mismatch)."""
    ckpt = ASSETS.copy(ASSETS.checkpoint(), _j(d, "run.ckpt"))
    with open(ckpt, "r+b") as f:
        f.seek(os.path.getsize(ckpt) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    return _resume(d, ckpt, "run.ckpt")


@case("traceback")
def resume_from_a_truncated_checkpoint(d: str) -> Verdict:
    ckpt = ASSETS.copy(ASSETS.checkpoint(), _j(d, "run.ckpt"))
    os.truncate(ckpt, os.path.getsize(ckpt) * 3 // 5)
    return _resume(d, ckpt, "run.ckpt")


def edit_checkpoint_meta(src: str, dst: str, edit: Callable[[dict[str, Any]], None]) -> str:
    """A copy of checkpoint `src` at `dst` with its metadata JSON edited in place by `edit`."""
    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(bytes(arrays["__meta__"]).decode("utf-8"))
    edit(meta)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    with open(dst, "wb") as f:
        np.savez(f, **arrays)
    return dst


def _meta_case(d: str, edit: Callable[[dict[str, Any]], None]) -> Verdict:
    ckpt = edit_checkpoint_meta(ASSETS.checkpoint(), _j(d, "edited.ckpt"), edit)
    return _resume(d, ckpt, "edited.ckpt")


@case("traceback")
def checkpoint_meta_step_count_a_string(d: str) -> Verdict:
    return _meta_case(d, lambda m: m["host"].update(step_count="two"))


@case("traceback")
def checkpoint_meta_negative_step_count(d: str) -> Verdict:
    return _meta_case(d, lambda m: m["host"].update(step_count=-3))


@case("traceback")
def checkpoint_meta_without_host_state(d: str) -> Verdict:
    return _meta_case(d, lambda m: m.pop("host"))


@case("traceback")
def checkpoint_meta_slots_not_a_list(d: str) -> Verdict:
    return _meta_case(d, lambda m: m.update(slots=7))


@case("traceback")
def checkpoint_meta_unknown_optimizer(d: str) -> Verdict:
    return _meta_case(d, lambda m: m.update(optimizer="lbfgs"))


@case("traceback")
def checkpoint_meta_damping_a_string(d: str) -> Verdict:
    return _meta_case(d, lambda m: m["host"].update(damping="high"))


@case("traceback")
def checkpoint_meta_knob_a_string(d: str) -> Verdict:
    return _meta_case(d, lambda m: m["knobs"].update(inv_update_period="ten"))


@case("traceback")
def checkpoint_meta_rng_garbage(d: str) -> Verdict:
    return _meta_case(d, lambda m: m.update(rng={"bit_generator": "PCG64", "state": "x"}))


def _plan_case(d: str, edit: Callable[[dict[str, Any]], None]) -> Verdict:
    """A hand-edited plan.json: `inspect` and `train` each end with one line naming the plan."""
    j = Judge()
    plan = ASSETS.copy(ASSETS.plan(), _j(d, "myplan"))
    pj = _j(plan, "plan.json")
    with open(pj, encoding="utf-8") as f:
        doc = json.load(f)
    edit(doc)
    with open(pj, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    for argv in (["inspect", plan], ["train", plan, "--steps", "2", "-q"]):
        jj = Judge()
        jj.error_line(run_cli(argv), ["myplan", "plan.json"])
        for status, detail in jj.problems:
            j.problem(status, f"{argv[0]}: {detail}")
    return j.verdict()


@case("traceback", fast=True)
def plan_with_an_unknown_parameter_in_a_layer(d: str) -> Verdict:
    return _plan_case(d, lambda doc: doc["layers"][0].update(params=["no_such_param", *doc["layers"][0]["params"][1:]]))


@case("traceback")
def plan_with_no_layers(d: str) -> Verdict:
    return _plan_case(d, lambda doc: doc.update(layers=[]))


@case("traceback")
def plan_with_the_loss_as_a_string(d: str) -> Verdict:
    return _plan_case(d, lambda doc: doc.update(loss="softmax_cross_entropy"))


@case("traceback")
def plan_with_an_output_that_does_not_exist(d: str) -> Verdict:
    return _plan_case(d, lambda doc: doc.update(output="no_such_output"))


def _stop_signal_during_training(d: str, sig: int, words: list[str]) -> Verdict:
    """`sig` mid-run: stops at a step boundary, writes the checkpoint, metrics and model,
    one line, the shell's exit code for it (128 + its number), and leaves no temp file or lock."""
    j = Judge()
    j.mechanism = signal.Signals(sig).name
    ckpt, metrics, model = _j(d, "run.ckpt"), _j(d, "steps.csv"), _j(d, "trained.onnx")
    argv = ["train", "--steps", "100000", "-q", "--checkpoint", ckpt, "--metrics", metrics, "--save", model]
    before = listing(d)
    p = subprocess.Popen(cli_command(argv), cwd=d, env=subprocess_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(metrics_rows(metrics)) < 3 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    r = Result(p.returncode, out, err)
    j.error_line(r, words, code=128 + sig, prefix="")
    rows = metrics_rows(metrics)
    if not os.path.isfile(ckpt):
        j.problem("lost", "no checkpoint written")
    else:
        meta, _ = read_checkpoint(ckpt)
        done = meta["host"]["step_count"] + meta["host"].get("burn_in_count", 0)
        j.check(done == len(rows), "lost", f"checkpoint at step {done}, metrics file has {len(rows)} rows")
    j.check(os.path.isfile(model), "lost", "no model written")
    j.no_strays(d, before, [ckpt, metrics, model])  # no temp file, no stale lock
    return j.verdict()


@case("traceback", topic="signals")
def ctrl_c_during_training(d: str) -> Verdict:
    return _stop_signal_during_training(d, signal.SIGINT, ["interrupt", "Ctrl-C", "step"])


@case("lost", topic="signals")
def sigterm_during_training(d: str) -> Verdict:
    """SLURM, Kubernetes, docker stop and timeout send SIGTERM: as Ctrl-C, exit 143."""
    return _stop_signal_during_training(d, signal.SIGTERM, ["stopped by SIGTERM at step"])


@case("lost", topic="signals")
def sighup_during_training(d: str) -> Verdict:
    """A closed terminal sends SIGHUP: as Ctrl-C, exit 129."""
    return _stop_signal_during_training(d, signal.SIGHUP, ["stopped by SIGHUP at step"])


@case("traceback", fast=True)
def knob_seed(d: str) -> Verdict:
    """--knob seed=2: seed has its own flag."""
    j = Judge()
    r = run_cli([*TRAIN, "--knob", "seed=2"])
    j.error_line(r, ["seed"])
    return j.verdict()


def _external_model(path: str, location: str, secret: str) -> None:
    """The zoo model with its first initializer's data in `secret`, referenced as `location`."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(ASSETS.model())
    t = model.graph.initializer[0]
    with open(secret, "wb") as f:
        f.write(numpy_helper.to_array(t).tobytes())
    n = len(t.raw_data) or numpy_helper.to_array(t).nbytes
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(n))):
        e = t.external_data.add()
        e.key, e.value = k, v
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


@case("traceback")
def compile_a_model_with_external_data_outside_its_folder(d: str) -> Verdict:
    j = Judge()
    model = _j(d, "models", "model.onnx")
    _external_model(model, "../weights.bin", _j(d, "weights.bin"))
    r = run_cli(["compile", model, *MODEL_ARGS, "-q", "-o", _j(d, "plan")])
    j.error_line(r, ["model.onnx", "weights.bin"])
    return j.verdict()


def _token_data(d: str, bad: int) -> str:
    from kfac_compiler.models import ZOO

    inputs, y = ZOO["transformer_block"].make_data(None, seed=0)
    x = np.array(inputs["input"])
    x[7, 2] = bad
    path = _j(d, "tokens.npz")
    np.savez(path, input=x, targets=y)
    return path


@case("traceback")
def token_ids_beyond_the_vocabulary(d: str) -> Verdict:
    """An id >= the vocabulary (17) in one row: the data check names it before training."""
    j = Judge()
    metrics = _j(d, "m.csv")
    r = run_cli(["train", "transformer_block", "--data", _token_data(d, 17), "--steps", "15", "-q",
                 "--metrics", metrics])
    j.error_line(r, INPUT)
    _no_steps(j, metrics)
    return j.verdict()


# --------------------------------------------------------------------------- API arguments
@functools.cache
def _plan() -> Any:
    from kfac_compiler.plan import load_plan

    return load_plan(ASSETS.plan())


def _batch(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    with np.load(ASSETS.data()) as z:
        return z["input"][:n].copy(), z["targets"][:n].copy()


def _trainer(**kw: Any) -> Any:
    from kfac_compiler.runtime import Trainer

    return Trainer(_plan(), batch_size=32, seed=0, threads=1, **kw)


def _same_as_float32(j: Judge, got: Any, want: Any, what: str) -> None:
    ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(_flat(got), _flat(want)))
    j.check(ok, "silent", f"{what} differs from the float32 result")


def _flat(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [x for k in sorted(v) for x in _flat(v[k])]
    if isinstance(v, (tuple, list)):
        return [x for e in v for x in _flat(e)]
    return [v]


def _api_converts(run: Callable[[Any, Any], Any], convert: Callable[[np.ndarray], Any], what: str) -> Verdict:
    """`run(x, y)` with converted inputs either gives the float32 result or a one-line KfacError."""
    j = Judge()
    x, y = _batch()
    want = run(x, y)
    got, exc = call(lambda: run(convert(x), convert(y) if convert is list_of else y))
    if exc is not None:
        j.api_error(exc, ["input", "float64", "list"])
    else:
        _same_as_float32(j, got, want, what)
    return j.verdict()


def list_of(a: np.ndarray) -> list[Any]:
    return a.tolist()


def float64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


def _step_loss(x: Any, y: Any) -> float:
    return _trainer().step({"input": x}, y)["loss"]


@case("traceback")
def api_step_with_float64_inputs(d: str) -> Verdict:
    return _api_converts(_step_loss, float64, "the step's loss")


@case("traceback")
def api_step_with_list_inputs(d: str) -> Verdict:
    return _api_converts(_step_loss, list_of, "the step's loss")


@case("traceback")
def api_evaluate_with_list_inputs(d: str) -> Verdict:
    t = _trainer()
    return _api_converts(lambda x, y: t.evaluate({"input": x}, y), list_of, "the evaluation")


@case("traceback", fast=True)
def api_predict_with_float64_inputs(d: str) -> Verdict:
    t = _trainer()
    return _api_converts(lambda x, y: t.predict({"input": x}), float64, "the prediction")


@case("traceback")
def api_predict_with_list_inputs(d: str) -> Verdict:
    t = _trainer()
    return _api_converts(lambda x, y: t.predict({"input": x}), list_of, "the prediction")


@case("traceback")
def api_gradients_with_float64_inputs(d: str) -> Verdict:
    import kfac_compiler as kc

    return _api_converts(lambda x, y: kc.gradients(_plan(), {"input": x}, y), float64, "the gradients")


@case("traceback")
def api_gradients_with_list_inputs(d: str) -> Verdict:
    import kfac_compiler as kc

    return _api_converts(lambda x, y: kc.gradients(_plan(), {"input": x}, y), list_of, "the gradients")


def _curvature() -> Any:
    from kfac_compiler.runtime import Curvature

    c = Curvature(_plan(), device="cpu")
    x, y = _batch()
    c.update({"input": x}, y)
    c.update_inverses(1e-3)
    return c


def _wrong_shape(fn: Callable[[Any, dict[str, np.ndarray]], Any]) -> Verdict:
    """A vector of the wrong shape for the first layer's first parameter: a KfacError naming it."""
    j = Judge()
    c = _curvature()
    shapes = _plan().param_shapes
    p0 = _plan().layers[0].params[0]
    vecs = {p: np.zeros(shapes[p], np.float32) for p in _plan().trainable}
    vecs[p0] = np.zeros((3, 5), np.float32)
    _, exc = call(lambda: fn(c, vecs))
    j.api_error(exc, [p0], if_accepted="silent")
    return j.verdict()


@case("traceback")
def api_set_parameters_wrong_shape(d: str) -> Verdict:
    j = Judge()
    t = _trainer()
    p0 = _plan().trainable[0]
    _, exc = call(lambda: t.set_parameters({p0: np.zeros((3, 5), np.float32)}))
    j.api_error(exc, [p0])
    return j.verdict()


@case("traceback")
def api_precondition_wrong_shape(d: str) -> Verdict:
    return _wrong_shape(lambda c, v: c.precondition(v))


@case("traceback")
def api_multiply_all_wrong_shape(d: str) -> Verdict:
    return _wrong_shape(lambda c, v: c.multiply_all(v))


@case("traceback")
def api_multiply_inverse_wrong_shape(d: str) -> Verdict:
    layer = _plan().layers[0]
    return _wrong_shape(lambda c, v: c.multiply_inverse(layer.name, {p: v[p] for p in layer.params}))


# =========================================================================== silent
@case("silent", fast=True)
def knob_adapt_damping_no(d: str) -> Verdict:
    """--knob adapt_damping=no turns adaptation off (or is refused), never on."""
    j = Judge()
    ckpt = _j(d, "run.ckpt")
    r = run_cli([*TRAIN, "--knob", "adapt_damping=no", "--checkpoint", ckpt])
    if r.code == 0 and not r.crashed:
        meta, _ = read_checkpoint(ckpt)
        j.check(meta["knobs"].get("adapt_damping") is False, "silent",
                f"adapt_damping=no gave adapt_damping={meta['knobs'].get('adapt_damping')!r}")
    else:
        j.error_line(r, ["adapt_damping"])
    return j.verdict()


def _api_bool(value: Any) -> Verdict:
    j = Judge()
    t, exc = call(lambda: _trainer(adapt_damping=value))
    if exc is not None:
        j.api_error(exc, ["adapt_damping"])
    else:
        j.check(t.config.adapt_damping is False, "silent",
                f"adapt_damping={value!r} gave adapt_damping={t.config.adapt_damping!r}")
    return j.verdict()


@case("silent")
def api_adapt_damping_the_string_no(d: str) -> Verdict:
    return _api_bool("no")


@case("silent")
def api_adapt_damping_the_string_false(d: str) -> Verdict:
    return _api_bool("False")


def _resume_with(d: str, first: list[str], changed: list[str], check: Callable[[dict[str, Any]], str | None],
                 option: str) -> Verdict:
    """Resume with a changed option: refused with one line naming it, or honoured (`check` of
    the final checkpoint's metadata returns None)."""
    j = Judge()
    a, b = _j(d, "a.ckpt"), _j(d, "b.ckpt")
    r = run_cli([*TRAIN, *first, "--checkpoint", a])
    if not j.success(r):
        return j.verdict()
    r = run_cli(["train", "--steps", "4", "-q", "--resume", a, *changed, "--checkpoint", b])
    if r.code == 0 and not r.crashed:
        meta, _ = read_checkpoint(b)
        wrong = check(meta)
        if wrong:
            j.problem("silent", f"{option} on resume ignored: {wrong}")
    else:
        j.error_line(r, [option])
    return j.verdict()


@case("silent")
def resume_with_a_changed_damping(d: str) -> Verdict:
    def check(meta: dict[str, Any]) -> str | None:
        got = meta["host"].get("damping")
        return None if got == 0.5 else f"damping {got}"

    return _resume_with(d, ["--knob", "adapt_damping=false"], ["--damping", "0.5"], check, "--damping")


@case("silent")
def resume_with_a_changed_learning_rate(d: str) -> Verdict:
    def check(meta: dict[str, Any]) -> str | None:
        got = meta["knobs"].get("learning_rate")
        return None if got == 0.05 else f"learning_rate {got}"

    fixed = ["--knob", "use_qmodel=false", "--learning-rate", "0.01", "--momentum", "0.9"]
    return _resume_with(d, fixed, ["--learning-rate", "0.05"], check, "--learning-rate")


@case("silent")
def resume_with_a_changed_knob(d: str) -> Verdict:
    def check(meta: dict[str, Any]) -> str | None:
        got = meta["knobs"].get("inv_update_period")
        return None if got == 7 else f"inv_update_period {got}"

    return _resume_with(d, [], ["--knob", "inv_update_period=7"], check, "inv_update_period")


@case("silent")
def resume_with_changed_param_group_options(d: str) -> Verdict:
    """A K-FAC parameter group's options given anew on resuming are honoured."""
    def check(meta: dict[str, Any]) -> str | None:
        got = (meta["knobs"].get("param_groups") or [{}])[0].get("learning_rate")
        return None if got == 0.01 else f"the group's learning_rate {got}"

    return _resume_with(d, ["--param-group", "layers=fc1 lr=0.001"], ["--param-group", "layers=fc1 lr=0.01"], check,
                        "param_groups")


@case("silent")
def resume_with_another_param_group_selection(d: str) -> Verdict:
    """A group selecting other layers on resuming: refused with one line (the state slots are the
    checkpoint's groups'), or honoured."""
    def check(meta: dict[str, Any]) -> str | None:
        got = (meta["knobs"].get("param_groups") or [{}])[0].get("layers")
        return None if got == ["fc2"] else f"the group's layers {got}"

    return _resume_with(d, ["--param-group", "layers=fc1"], ["--param-group", "layers=fc2"], check, "param_groups")


@case("traceback", fast=True)
def param_group_with_part_of_a_layer(d: str) -> Verdict:
    """--param-group selecting a bias without its weight: one line naming the layer."""
    j = Judge()
    r = run_cli([*TRAIN, "--param-group", r"params=fc1\.bias optimizer=adam"])
    j.error_line(r, ["'fc1'"])
    return j.verdict()


@case("silent", fast=True)
def resume_after_a_crash_repeats_no_metrics_rows(d: str) -> Verdict:
    """Rows written after the last checkpoint (a crash) are not duplicated by the resumed run."""
    j = Judge()
    a, a2, metrics = _j(d, "run.ckpt"), _j(d, "at2.ckpt"), _j(d, "steps.csv")
    if not j.success(run_cli([*TRAIN, "--checkpoint", a, "--metrics", metrics])):
        return j.verdict()
    shutil.copyfile(a, a2)  # the last checkpoint before the "crash": at step 2
    # a run that writes row 2 (and a checkpoint nobody keeps), then "crashes"
    if not j.success(run_cli(["train", "--steps", "3", "-q", "--resume", a, "--checkpoint", a, "--metrics", metrics])):
        return j.verdict()
    if not j.success(run_cli(["train", "--steps", "4", "-q", "--resume", a2, "--metrics", metrics])):
        return j.verdict()
    steps = [int(float(row["step"])) for row in metrics_rows(metrics)]
    j.check(steps == [0, 1, 2, 3], "silent", f"metrics steps {steps}")
    return j.verdict()


@case("silent", fast=True)
def abbreviated_train_option(d: str) -> Verdict:
    j = Judge()
    r = run_cli([*TRAIN, "--learning-rat", "0.1"])
    j.error_line(r, ["--learning-rat"])
    return j.verdict()


@case("silent")
def abbreviated_compile_option(d: str) -> Verdict:
    j = Judge()
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    r = run_cli(["compile", model, *MODEL_ARGS, "-q", "--front", "-o", _j(d, "plan")])
    j.error_line(r, ["--front"])
    return j.verdict()


@case("silent")
def non_finite_final_loss_exits_non_zero(d: str) -> Verdict:
    """A row of 3e38 (finite float32) makes the final loss NaN: exit 1 with one line, the
    checkpoint asked for written. (Diverging learning rates do not get there: the steps
    with a non-finite loss are rejected.)"""
    j = Judge()
    with np.load(ASSETS.data()) as z:
        x, y = z["input"].copy(), z["targets"]
    x[5, :] = 3e38
    data, ckpt = _j(d, "huge.npz"), _j(d, "run.ckpt")
    np.savez(data, input=x, targets=y)
    r = run_cli(["train", "--steps", "3", "-q", "--data", data, "--checkpoint", ckpt])
    j.error_line(r, ["loss"], code=1)
    j.check(os.path.isfile(ckpt), "lost", "the checkpoint asked for was not written")
    return j.verdict()


@case("silent")
def damping_flag_nan(d: str) -> Verdict:
    j = Judge()
    r = run_cli([*TRAIN, "--damping", "nan"])
    j.error_line(r, ["damping"])
    return j.verdict()


@case("silent")
def two_runs_writing_one_checkpoint(d: str) -> Verdict:
    """A second run writing the checkpoint a running one writes is refused, naming its pid."""
    j = Judge()
    j.mechanism = "subprocess"
    ckpt = _j(d, "run.ckpt")
    p = subprocess.Popen(cli_command(["train", "--steps", "100000", "-q", "--checkpoint", ckpt,
                                      "--checkpoint-every", "1"]),
                         cwd=d, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not os.path.isfile(ckpt) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        r = run_cli([*TRAIN, "--checkpoint", ckpt])
        running = p.poll() is None
    finally:
        p.kill()
        p.wait()
    if not running:
        j.problem("unclear", "the first run was not running any more")
    j.error_line(r, [str(p.pid)])
    return j.verdict()


@case("silent", fast=True)
def api_update_inverses_inf(d: str) -> Verdict:
    j = Judge()
    c = _curvature()
    ok, exc = call(lambda: c.update_inverses(float("inf")))
    j.api_error(exc, ["damping"], if_accepted="silent")
    return j.verdict()


@case("silent")
def api_set_parameters_nan(d: str) -> Verdict:
    j = Judge()
    t = _trainer()
    p0 = _plan().trainable[0]
    before = t.parameters()[p0]
    _, exc = call(lambda: t.set_parameters({p0: np.full(before.shape, np.nan, np.float32)}))
    j.api_error(exc, [p0])
    j.check(np.array_equal(t.parameters()[p0], before), "silent", f"{p0} changed")
    return j.verdict()


@case("silent")
def token_ids_negative(d: str) -> Verdict:
    """id -1 would silently pick the last embedding row (ONNX Gather wraps negative indices)."""
    j = Judge()
    r = run_cli(["train", "transformer_block", "--data", _token_data(d, -1), "--steps", "2", "-q"])
    j.error_line(r, INPUT)
    return j.verdict()


@case("silent")
def saved_files_get_the_usual_permissions(d: str) -> Verdict:
    """--save and --checkpoint files are readable like any file the user writes (umask), not 0600."""
    j = Judge()
    umask = os.umask(0)
    os.umask(umask)
    r = run_cli([*TRAIN, "--save", _j(d, "trained.onnx"), "--checkpoint", _j(d, "run.ckpt")])
    if j.success(r):
        for name in ("trained.onnx", "run.ckpt"):
            mode = stat.S_IMODE(os.stat(_j(d, name)).st_mode)
            j.check(mode == 0o666 & ~umask, "silent", f"{name} has mode {mode:o}, umask gives {0o666 & ~umask:o}")
    return j.verdict()


# =========================================================================== leftovers
def _kill_then_rerun(d: str, argv: list[str], kill_on: str, rerun: list[str], expected: list[str]) -> Verdict:
    j = Judge()
    j.mechanism = f"kill -9 at {kill_on}"
    r = run_subprocess(argv, d, kill_on=kill_on)
    if r.code != -signal.SIGKILL:
        j.problem("unclear", f"the run was not killed (exit {r.code}): the write event {kill_on} never came")
        return j.verdict()
    r = run_cli(rerun)
    j.success(r)
    j.no_strays(d, [], expected)
    return j.verdict()


@case("leftover")
def kill_9_during_a_checkpoint_write(d: str) -> Verdict:
    """Killed while the 2nd checkpoint's temp file is complete but not yet renamed; the next
    run (resuming, same --checkpoint) leaves nothing but the checkpoint."""
    ckpt = _j(d, "run.ckpt")
    return _kill_then_rerun(d, ["train", "--steps", "5", "-q", "--checkpoint", ckpt, "--checkpoint-every", "1"],
                            "fsync:2", ["train", "--steps", "3", "-q", "--resume", ckpt, "--checkpoint", ckpt],
                            [ckpt])


@case("leftover")
def kill_9_during_a_model_write(d: str) -> Verdict:
    model = _j(d, "trained.onnx")
    return _kill_then_rerun(d, [*TRAIN, "--save", model], "fsync:1", [*TRAIN, "--save", model], [model])


@case("leftover")
def kill_9_during_a_plan_write(d: str) -> Verdict:
    """Killed while compile writes the plan's second file; the next compile leaves only the plan."""
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    plan = _j(d, "plan")
    argv = ["compile", model, *MODEL_ARGS, "-q", "-o", plan]
    return _kill_then_rerun(d, argv, "open:2", argv, [model, plan])


# =========================================================================== outside
def _outside(d: str, edit: Callable[[str, dict[str, Any]], None]) -> Verdict:
    j = Judge()
    plan = ASSETS.copy(ASSETS.plan(), _j(d, "myplan"))
    os.makedirs(_j(d, "elsewhere"))
    pj = _j(plan, "plan.json")
    with open(pj, encoding="utf-8") as f:
        doc = json.load(f)
    edit(plan, doc)
    with open(pj, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    r = run_cli(["inspect", plan])
    j.error_line(r, ["myplan", "plan.json"])
    return j.verdict()


def _move_out(plan: str, name: str) -> str:
    dest = _j(os.path.dirname(plan), "elsewhere", name)
    shutil.move(_j(plan, name), dest)
    return dest


@case("outside", fast=True)
def plan_model_path_outside_the_folder(d: str) -> Verdict:
    def edit(plan: str, doc: dict[str, Any]) -> None:
        _move_out(plan, "model.onnx")
        doc["model"] = "../elsewhere/model.onnx"

    return _outside(d, edit)


@case("outside")
def plan_model_path_absolute(d: str) -> Verdict:
    def edit(plan: str, doc: dict[str, Any]) -> None:
        doc["model"] = _move_out(plan, "model.onnx")

    return _outside(d, edit)


@case("outside")
def plan_subgraph_path_outside_the_folder(d: str) -> Verdict:
    def edit(plan: str, doc: dict[str, Any]) -> None:
        name = next(iter(doc["subgraphs"]))
        _move_out(plan, f"{name}.onnx")
        doc["subgraphs"][name]["file"] = f"../elsewhere/{name}.onnx"

    return _outside(d, edit)


@case("outside")
def plan_model_with_external_data_outside_the_folder(d: str) -> Verdict:
    def edit(plan: str, doc: dict[str, Any]) -> None:
        _external_model(_j(plan, "model.onnx"), "../elsewhere/weights.bin", _j(os.path.dirname(plan), "elsewhere",
                                                                                "weights.bin"))

    return _outside(d, edit)


def by_name() -> dict[str, Case]:
    return {c.name: c for c in CASES}


# --------------------------------------------------------------------------- sizes, nesting, shapes
@case("traceback", fast=True, topic="lying sizes")
def data_file_header_claiming_51_tb(d: str) -> Verdict:
    """An .npz whose input header claims 51 TB: one line before numpy allocates it."""
    j = Judge()
    with np.load(ASSETS.data()) as z:
        arrays = {k: z[k] for k in z.files}
    data = _j(d, "data.npz")
    first = next(k for k in arrays if k != "targets")
    lying_npz(data, arrays, first, (arrays[first].shape[0], 12_750_000_000_000 // arrays[first].shape[0]))
    j.error_line(run_cli([*TRAIN, "--data", data]), ["data.npz", "declares"])
    return j.verdict()


@case("traceback", topic="lying sizes")
def checkpoint_slot_claiming_400_tb(d: str) -> Verdict:
    """A checkpoint slot whose header claims 400 TB: refused before allocation."""
    j = Judge()
    ckpt = ASSETS.copy(ASSETS.checkpoint(), _j(d, "src.ckpt"))
    with np.load(ckpt) as z:
        arrays = {k: z[k] for k in z.files}
    bad = _j(d, "run.ckpt")
    lying_npz(bad, arrays, "slot_00000", (10**8, 10**6))
    j.error_line(run_cli(["train", "--steps", "3", "-q", "--resume", bad]), ["run.ckpt", "declares"])
    return j.verdict()


@case("traceback", fast=True, topic="nesting")
def config_nested_100000_deep(d: str) -> Verdict:
    j = Judge()
    cfg = _j(d, "config.json")
    with open(cfg, "w") as f:
        f.write('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    model = ASSETS.copy(ASSETS.model(), _j(d, "model.onnx"))
    j.error_line(run_cli(["compile", model, *MODEL_ARGS, "--config", cfg, "-o", _j(d, "plan")]), ["config.json"])
    return j.verdict()


@case("traceback", fast=True, topic="lying sizes")
def model_initializer_larger_than_its_data(d: str) -> Verdict:
    """An initializer whose dims claim 1000x the values it holds."""
    import onnx

    j = Judge()
    m = onnx.load(ASSETS.model())
    t = next(t for t in m.graph.initializer if len(t.dims) == 2)
    t.dims[0] *= 1000
    path = _j(d, "model.onnx")
    onnx.save(m, path)
    j.error_line(run_cli(["compile", path, *MODEL_ARGS, "-o", _j(d, "plan")]), [t.name])
    return j.verdict()


@case("silent")
def model_input_shape_contradicting_its_weight(d: str) -> Verdict:
    """The input declared narrower than the first layer's weight: compiled, then failed in ONNX
    Runtime at training; now one line naming the node."""
    import onnx

    j = Judge()
    m = onnx.load(ASSETS.model())
    dim = m.graph.input[0].type.tensor_type.shape.dim[-1]
    dim.dim_value = max(1, dim.dim_value // 2)
    path = _j(d, "model.onnx")
    onnx.save(m, path)
    j.error_line(run_cli(["compile", path, *MODEL_ARGS, "-o", _j(d, "plan")]), ["contradict"])
    return j.verdict()


def _edited_model(d: str, edit: Callable[[Any], None]) -> str:
    """The census model edited by `edit(model)`, saved as model.onnx in `d`."""
    import onnx

    m = onnx.load(ASSETS.model())
    edit(m)
    path = _j(d, "model.onnx")
    onnx.save(m, path)
    return path


def _if_reading(m: Any, name: str) -> None:
    """Route the first layer's activations through an If whose branches multiply them by `name`
    (a tensor of the enclosing graph) and add the result."""
    import onnx
    from onnx import TensorProto, helper

    act = m.graph.node[1].output[0]
    body = helper.make_graph([helper.make_node("Mul", [act, name], ["branch_out"], name="branch/Mul")], "body", [],
                             [helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, None)])
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), "branch_cond"))
    nodes = list(m.graph.node)
    nodes.insert(2, helper.make_node("If", ["branch_cond"], ["branched"], then_branch=body, else_branch=body,
                                     name="branch"))
    for node in nodes[3:]:
        node.input[:] = ["branched" if i == act else i for i in node.input]
    del m.graph.node[:]
    m.graph.node.extend(nodes)


@case("silent", fast=True)
def model_if_reading_a_parameter_from_the_enclosing_graph(d: str) -> Verdict:
    """An If whose branches read a trainable bias from the enclosing graph: its gradient lacked
    the branches' share (the parameter was frozen as reaching the output only through settings);
    now one line naming the node and the parameter."""
    j = Judge()
    path = _edited_model(d, lambda m: _if_reading(m, "fc1.bias"))
    j.error_line(run_cli(["compile", path, *MODEL_ARGS, "-o", _j(d, "plan")]), ["'branch'"])
    return j.verdict()


@case("silent", fast=True)
def model_node_with_an_unknown_attribute(d: str) -> Verdict:
    """A node with an attribute its op does not have (onnx.checker's node spec): compiled, then
    refused by ONNX Runtime when training started; now one line naming the node."""
    from onnx import helper

    j = Judge()
    path = _edited_model(d, lambda m: m.graph.node[1].attribute.append(helper.make_attribute("alpha", 0.5)))
    j.error_line(run_cli(["compile", path, *MODEL_ARGS, "-o", _j(d, "plan")]), ["fc1/Relu"])
    return j.verdict()


@case("silent", fast=True)
def model_with_a_duplicate_initializer(d: str) -> Verdict:
    """Two initializers of one name (ONNX Runtime uses the later one, with a warning): now one
    line naming the tensor."""
    j = Judge()
    path = _edited_model(d, lambda m: m.graph.initializer.append(m.graph.initializer[0]))
    j.error_line(run_cli(["compile", path, *MODEL_ARGS, "-o", _j(d, "plan")]), ["defined twice"])
    return j.verdict()


@case("silent", fast=True)
def model_initializer_that_is_an_input_of_another_shape(d: str) -> Verdict:
    """An initializer also declared as a graph input of another shape: compiled, then refused by
    ONNX Runtime when training started; now one line naming the tensor."""
    from onnx import TensorProto, helper

    j = Judge()
    path = _edited_model(d, lambda m: m.graph.input.append(helper.make_tensor_value_info(
        m.graph.initializer[0].name, TensorProto.FLOAT, [3])))
    j.error_line(run_cli(["compile", path, *MODEL_ARGS, "-o", _j(d, "plan")]), ["also a graph input"])
    return j.verdict()


@case("silent", fast=True)
def model_input_type_contradicting_its_weight(d: str) -> Verdict:
    """The input declared int64 where the first layer takes float: compiled, then refused by
    ONNX Runtime when training started; now one line naming the node."""
    from onnx import TensorProto

    def edit(m: Any) -> None:
        m.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64

    j = Judge()
    j.error_line(run_cli(["compile", _edited_model(d, edit), *MODEL_ARGS, "-o", _j(d, "plan")]), ["contradict"])
    return j.verdict()


@case("overwritten", fast=True, topic="special outputs")
def api_export_onto_a_device(d: str) -> Verdict:
    """Trainer.export('/dev/null') replaced the device by a regular file (as root)."""
    from kfac_compiler.plan import load_plan
    from kfac_compiler.runtime import Trainer

    j = Judge()
    tr = Trainer(load_plan(ASSETS.copy(ASSETS.plan(), _j(d, "plan"))), optimizer="sgd", learning_rate=0.1)
    before = os.stat("/dev/null").st_mode
    _, exc = call(lambda: tr.export("/dev/null"))
    j.api_error(exc, ["/dev/null"], if_accepted="overwritten")
    j.check(os.stat("/dev/null").st_mode == before, "overwritten", "/dev/null is no longer a device")
    return j.verdict()


@case("overwritten", fast=True, topic="special outputs")
def api_export_onto_the_source_models_external_data(d: str) -> Verdict:
    """Trainer.export(DATA), DATA the file the plan's source model keeps its weights in: the
    API's own list of inputs missed it and replaced the user's weights (the CLI refused)."""
    import onnx

    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    j = Judge()
    model = _j(d, "model.onnx")
    onnx.save(onnx.load(ASSETS.model()), model, save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    files = snapshot(model, _j(d, "weights.bin"))
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.1)
    _, exc = call(lambda: tr.export(_j(d, "weights.bin")))
    j.api_error(exc, ["weights.bin", "external data"], if_accepted="overwritten")
    j.unchanged(files)
    return j.verdict()


from faults import reliability  # noqa: E402,F401  (registers issue 39's cases)
