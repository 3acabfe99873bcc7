"""A run's outputs and lifecycle: every output checked before the first step, user files never
overwritten, plan folders replaced atomically without touching other files, lock files, stale
temp files, Ctrl-C at a step boundary, resume (metrics continued, changed options honoured or
refused), non-finite final loss. Real CLI runs (kfac_compiler.cli.main in-process; subprocesses
where a process must die or be signalled)."""
from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest

import kfac_compiler as kc
from helpers import Lines
from kfac_compiler.cli import main
from kfac_compiler.errors import ConfigError
from kfac_compiler.models import ZOO, save_model
from kfac_compiler.plan import load_plan
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.checkpoint import read_meta

FAST = ["--steps", "3", "--batch-size", "64", "-q"]


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(folder) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes), hidden ones included."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


def ours(folder) -> list[str]:
    """Temp files and folders, and locks, of ours left in `folder`."""
    return sorted(n for n in os.listdir(folder) if ".kfac-tmp-" in n or ".kfac-old-" in n or n.endswith(".kfac-lock"))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@contextlib.contextmanager
def tmpfs(path, options: str):
    """A tmpfs mounted at `path` (root only; yields False where it cannot be mounted)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        yield False
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture()
def readonly_dir(tmp_path):
    """A folder nobody can write in: a read-only tmpfs as root, else chmod 555."""
    d = tmp_path / "ro"
    with tmpfs(d, "ro,size=64k") as mounted:
        if not mounted:
            d.chmod(0o555)
            if os.access(d, os.W_OK):
                pytest.skip("cannot make a read-only folder here")
        yield d
        if not mounted:
            d.chmod(0o755)


def rows(path) -> list[int]:
    text = open_text(path)
    if str(path).endswith(".csv"):
        return [int(r["step"]) for r in csv.DictReader(text.splitlines())]
    return [int(json.loads(l)["step"]) for l in text.splitlines() if l.strip()]


def open_text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


# --------------------------------------------------------------------------- outputs checked first
@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A data file, a checkpoint (kfac, 2 steps of 64) and a plan folder, shared read-only."""
    d = tmp_path_factory.mktemp("inputs")
    x, y = ZOO["mlp_classifier"].make_data(200, seed=1)
    np.savez(d / "d.npz", input=x["input"], targets=y)
    assert main(["train", "--steps", "2", "--batch-size", "64", "-q", "--checkpoint", str(d / "ck.npz")]) == 0
    assert main(["compile", save_model("mlp_classifier", d / "m.onnx"), "--loss", "softmax_cross_entropy",
                 "-o", str(d / "plan"), "-q"]) == 0
    onnx.save(onnx.load(d / "m.onnx"), d / "e.onnx", save_as_external_data=True, location="e.data", size_threshold=0)
    return d


@pytest.mark.parametrize("case", ["save_is_checkpoint", "checkpoint_is_data", "metrics_is_data", "trailing_slash",
                                  "folder", "parent_is_file", "resume_is_save", "plan_file", "plan_source",
                                  "save_is_plan_source", "external_data", "plan_model_data"])
def test_bad_outputs_fail_before_training_and_touch_nothing(tmp_path, capsys, inputs, case):
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("mine")
    data, ck, plan, t = inputs / "d.npz", inputs / "ck.npz", inputs / "plan", str(tmp_path)
    argv, expected = {
        "save_is_checkpoint": (["--save", f"{t}/x", "--checkpoint", f"{t}/x"],
                               f"error: --save '{t}/x' and --checkpoint '{t}/x' are the same file; give each output its "
                               "own path"),
        "checkpoint_is_data": (["--checkpoint", str(data)],
                               f"error: --checkpoint '{data}' would overwrite '{data}' (the --data input); "
                               "give the output another path"),
        "metrics_is_data": (["--metrics", f"{inputs}/./d.npz"], "(the --data input)"),
        "trailing_slash": (["--save", f"{t}/out/"], f"error: --save '{t}/out/' names a folder; give a file path"),
        "folder": (["--checkpoint", f"{t}/folder"], f"error: --checkpoint '{t}/folder' is a folder; give a file path"),
        "parent_is_file": (["--metrics", f"{t}/afile/m.csv"],
                           f"error: --metrics '{t}/afile/m.csv': '{t}/afile' is a file, not a folder"),
        "resume_is_save": (["--resume", str(ck), "--save", str(ck), "--steps", "5"],
                           f"error: --save '{ck}' would overwrite '{ck}' (the --resume input)"),
        "plan_file": ([str(plan), "--save", f"{plan}/model.onnx"],
                      f"error: --save '{plan}/model.onnx' would overwrite a file of the plan folder '{plan}' "
                      "(the MODEL input)"),
        # the model a plan folder was compiled from: written over, the user's model is lost and
        # the plan stale ("its source model changed"); the same for an .onnx's external data
        "plan_source": ([str(plan), "--checkpoint", f"{inputs}/m.onnx"],
                        f"error: --checkpoint '{inputs}/m.onnx' would overwrite '{inputs}/m.onnx' (the plan's "
                        "source model input); give the output another path"),
        "save_is_plan_source": ([str(plan), "--save", f"{inputs}/./m.onnx"], "(the plan's source model input)"),
        "external_data": ([f"{inputs}/e.onnx", "--loss", "softmax_cross_entropy", "--checkpoint", f"{inputs}/e.data"],
                          f"error: --checkpoint '{inputs}/e.data' would overwrite '{inputs}/e.data' (the external data "
                          f"of '{inputs}/e.onnx' input)"),
        # a plan of a model over 1 GiB keeps its values in model.onnx.data beside model.onnx
        "plan_model_data": ([f"{t}/big", "--checkpoint", f"{t}/big/model.onnx.data"],
                            f"error: --checkpoint '{t}/big/model.onnx.data' would overwrite a file of the plan folder "
                            f"'{t}/big' (the MODEL input)"),
    }[case]
    if case == "plan_model_data":
        shutil.copytree(plan, tmp_path / "big")
        onnx.save(onnx.load(plan / "model.onnx"), tmp_path / "big" / "model.onnx", save_as_external_data=True,
                  location="model.onnx.data", size_threshold=0)
    before = snapshot(tmp_path), snapshot(inputs)
    code, out, err = run(["train", *FAST, "--data", str(data), *argv], capsys)
    assert code == 2 and "final train loss" not in out
    line = error_line(err)
    assert line.startswith(expected) if expected.startswith("error") else expected in line
    assert (snapshot(tmp_path), snapshot(inputs)) == before


def test_readonly_output_folder_fails_before_training(readonly_dir, capsys, tmp_path):
    code, out, err = run(["train", *FAST, "--save", str(readonly_dir / "m.onnx")], capsys)
    assert code == 2 and "final train loss" not in out
    assert error_line(err).startswith(f"error: --save '{readonly_dir}/m.onnx': cannot write in '{readonly_dir}' (")
    model = save_model("mlp_classifier", tmp_path / "m.onnx")
    code, out, err = run(["compile", model, "--loss", "softmax_cross_entropy", "-o", str(readonly_dir / "plan")], capsys)
    assert code == 2 and error_line(err).startswith(f"error: -o '{readonly_dir}/plan': cannot write in '{readonly_dir}' (")
    assert os.listdir(readonly_dir) == []


def test_no_room_for_the_checkpoint_fails_before_training(tmp_path, capsys, monkeypatch):
    small = tmp_path / "small"
    with tmpfs(small, "size=256k") as mounted:
        if not mounted:  # no real small disk here: report little free space
            real = os.statvfs
            monkeypatch.setattr("kfac_compiler.outputs.os.statvfs",
                                lambda p: os.statvfs_result((*real(p)[:4], 50, *real(p)[5:])) if p == str(small) else real(p))
            # (f_bavail = 50 blocks)
        code, out, err = run(["train", *FAST, "--checkpoint", str(small / "c.ckpt"), "--metrics",
                              str(tmp_path / "m.csv")], capsys)
        assert code == 2 and "final train loss" not in out
        line = error_line(err)
        assert line.startswith(f"error: --checkpoint '{small}/c.ckpt' needs about 0.8 MB but its disk has ")
        assert line.endswith(" free; free some space or write elsewhere")
        assert os.listdir(small) == [] and not (tmp_path / "m.csv").exists()


def test_disk_full_at_the_end_still_writes_the_other_outputs(tmp_path, capsys):
    """The checkpoint's disk fills during the run: the model and metrics are still written,
    one line says what failed and what was written, no temp file is left."""
    small = tmp_path / "small"
    with tmpfs(small, "size=1m") as mounted:
        if not mounted:
            pytest.skip("needs root to mount a small tmpfs")
        metrics, model, ck = tmp_path / "m.csv", tmp_path / "s.onnx", small / "c.ckpt"

        def fill_then_interrupt():
            _wait_rows(metrics, 2)
            with open(small / "filler", "wb") as f:
                f.write(b"\0" * (640 << 10))
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=fill_then_interrupt, daemon=True).start()
        code, out, err = run(["train", "--steps", "100000", "-q", "--metrics", str(metrics), "--save", str(model),
                              "--checkpoint", str(ck)], capsys)
        assert code == 2
        line = error_line(err)
        assert line == (f"error: --checkpoint: cannot write the checkpoint '{ck}': the disk is full: free space "
                        "or choose another location (written: "
                        f"metrics '{metrics}', model '{model}')"), line
        onnx.checker.check_model(onnx.load(str(model)))
        assert sorted(os.listdir(small)) == ["filler"]


@pytest.mark.slow
def test_disk_full_on_the_metrics_file_stops_the_run_and_writes_the_rest(tmp_path, capsys):
    small = tmp_path / "small"
    with tmpfs(small, "size=16k") as mounted:
        if not mounted:
            pytest.skip("needs root to mount a small tmpfs")
        metrics, model, ck = small / "m.csv", tmp_path / "s.onnx", tmp_path / "c.ckpt"
        code, out, err = run(["train", "--steps", "100000", "-q", "--metrics", str(metrics), "--save", str(model),
                              "--checkpoint", str(ck)], capsys)
        assert code == 2
        k = read_meta(ck)["host"]["step_count"]
        assert error_line(err) == (f"error: stopped at step {k}: --metrics: cannot write '{metrics}': the disk is full: "
                                   f"free space or choose another location (step {k - 1}'s row is missing) "
                                   f"(written: checkpoint '{ck}', model '{model}')")
        onnx.checker.check_model(onnx.load(str(model)))
        assert ours(small) == [] and ours(tmp_path) == []


# --------------------------------------------------------------------------- plan folders
def _compiled(tmp_path, capsys, out, *extra):
    model = tmp_path / "m.onnx"
    if not model.exists():
        save_model("mlp_classifier", model)
    return run(["compile", str(model), "--loss", "softmax_cross_entropy", "-o", str(out), "-q", *extra], capsys)


def test_recompiling_keeps_the_other_files_of_the_plan_folder(tmp_path, capsys):
    plan = tmp_path / "plan"
    assert _compiled(tmp_path, capsys, plan)[0] == 0
    (plan / "notes.txt").write_text("mine")
    (plan / "runs").mkdir()
    (plan / "runs" / "a.ckpt").write_bytes(b"\1\2\3")
    mine = {k: v for k, v in snapshot(plan).items() if k in ("notes.txt", "runs/a.ckpt")}
    old_model = (plan / "model.onnx").stat().st_ino
    assert _compiled(tmp_path, capsys, plan, "--approx", "fc.*=diagonal")[0] == 0
    after = snapshot(plan)
    assert {k: after[k] for k in mine} == mine  # the user's files, byte-identical
    assert (plan / "model.onnx").stat().st_ino != old_model  # the plan's own files are new
    assert {l.approximation for l in load_plan(plan).layers} == {"diagonal"}
    assert ours(tmp_path) == [] and ours(plan) == []


def test_non_plan_folder_needs_force_and_the_source_model_is_never_replaced(tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    code, out, err = _compiled(tmp_path, capsys, other)
    assert code == 2 and error_line(err) == (
        f"error: refusing to overwrite '{other}': it is a non-empty directory that is not a plan (no plan.json of "
        "ours); "
        "give an empty or new folder, or pass overwrite=True (--force)")
    assert os.listdir(other) == ["precious.txt"]
    assert _compiled(tmp_path, capsys, other, "--force")[0] == 0
    assert (other / "precious.txt").read_text() == "keep me" and load_plan(other).layers
    # the plan's model.onnx as the source of a plan saved into its own folder
    src = other / "model.onnx"
    before = src.read_bytes()
    code, out, err = run(["compile", str(src), "--loss", "softmax_cross_entropy", "-o", str(other)], capsys)
    assert code == 2 and error_line(err) == (f"error: -o '{other}' would overwrite '{src}' (the MODEL input); "
                                             "give the output another path")
    assert src.read_bytes() == before


def test_another_tools_plan_json_does_not_make_a_folder_ours(tmp_path, capsys):
    """A folder whose plan.json is not one of ours is a non-plan folder: refused without
    --force, and the files that plan.json names are never swapped away or deleted."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "plan.json").write_text('{"model": "best.onnx"}')
    (proj / "best.onnx").write_bytes(b"user's model")
    before = snapshot(proj)
    code, out, err = _compiled(tmp_path, capsys, proj)
    assert code == 2 and "it is a non-empty directory that is not a plan (no plan.json of ours)" in error_line(err)
    assert snapshot(proj) == before
    assert _compiled(tmp_path, capsys, proj, "--force")[0] == 0  # asked for: written into, file by file
    assert (proj / "best.onnx").read_bytes() == b"user's model" and load_plan(proj).layers


def test_outputs_through_symlinks_and_devices(tmp_path, capsys):
    """A symlinked checkpoint is written through (the link stays, its target is the new
    checkpoint); a device as an output is refused before training."""
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "run.ckpt"
    target.write_bytes(b"old")
    link = tmp_path / "link.ckpt"
    link.symlink_to(target)
    assert run(["train", "--steps", "3", "-q", "--checkpoint", str(link)], capsys)[0] == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert read_meta(target)["host"]["step_count"] == 3
    code, out, err = run(["train", "--steps", "3", "-q", "--save", "/dev/null"], capsys)
    assert code == 2 and error_line(err) == ("error: --save '/dev/null' is not a regular file (a device, pipe or "
                                             "socket); give a file path")



def test_the_api_refuses_devices_pipes_and_sockets_as_outputs(tmp_path):
    """Trainer.export and save_checkpoint check their target as the command line does: a
    device, a FIFO or a socket stays what it was (replacing it would destroy it)."""
    import socket

    import kfac_compiler as kc
    from kfac_compiler.errors import CheckpointError, OutputError

    e = ZOO["mlp_classifier"]
    tr = Trainer(kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False), optimizer="sgd")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        for target in ("/dev/null", str(fifo), str(sock_path)):
            kind = os.stat(target).st_mode
            reason = "is not a regular file (a device, pipe or socket); give a file path"
            with pytest.raises(OutputError) as got:
                tr.export(target)
            assert str(got.value) == f"cannot write the trained model {target!r}: it {reason}"
            with pytest.raises(CheckpointError) as got:
                tr.save_checkpoint(target)
            assert str(got.value) == f"cannot write the checkpoint {target!r}: it {reason}"
            assert os.stat(target).st_mode == kind
        with pytest.raises(CheckpointError, match="is a folder; give a file path"):
            tr.save_checkpoint(tmp_path)
    finally:
        sock.close()
    assert sorted(os.listdir(tmp_path)) == ["fifo", "sock"]

RACE = r"""
import os, sys, warnings
from kfac_compiler import locks
from kfac_compiler.errors import OutputError
warnings.simplefilter("ignore")
print("ready", flush=True)  # imports done
sys.stdin.readline()  # all start together
try:
    locks.acquire("--checkpoint", sys.argv[1])
    print("got", os.getpid(), flush=True)
    sys.stdin.readline()  # the holder stays alive until every other run has tried
except OutputError:
    print("refused", flush=True)
"""


@pytest.mark.slow
def test_runs_racing_for_a_stale_lock_get_exactly_one_holder(tmp_path):
    from kfac_compiler.locks import lock_path

    target = str(tmp_path / "out.ckpt")
    for trial in range(3):
        with open(lock_path(target), "w") as f:
            json.dump({"pid": dead_pid(), "host": __import__("socket").gethostname()}, f)
        procs = [subprocess.Popen([sys.executable, "-c", RACE, target], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
        try:
            lines = [Lines(p.stdout) for p in procs]
            assert [out.next() for out in lines] == ["ready"] * 4
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            outcomes = sorted(out.next() for out in lines)
            for p in procs:  # every run has answered: let the holder go
                with contextlib.suppress(OSError):  # a refused run has exited already
                    p.stdin.write("done\n")
                    p.stdin.close()
            assert all(p.wait(timeout=60) == 0 for p in procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [o.split()[0] for o in outcomes] == ["got", "refused", "refused", "refused"], (trial, outcomes)
        with open(lock_path(target)) as f:  # the winner's lock (it exits without releasing it)
            assert json.load(f)["pid"] == int(outcomes[0].split()[1])


# kill -9 at each point of a plan save (a subprocess kills itself there): the old or the new
# plan loads, the user's file is intact, and the next save leaves nothing of ours behind
KILL_SAVE = r"""
import os, signal, sys
from kfac_compiler import atomic
from kfac_compiler.plan import load_plan
plan = load_plan(sys.argv[1])
plan.notes.append("new")
point, calls = sys.argv[3], []
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
def on_call(n, fn):
    def f(*a, **k):
        calls.append(1)
        if len(calls) == n:
            die()
        return fn(*a, **k)
    return f
if point == "writing":
    os.fsync = on_call(2, os.fsync)
elif point == "before_swap":
    atomic._exchange = die
elif point == "after_swap":
    atomic.discard_folder = die
elif point == "between_renames":  # where no RENAME_EXCHANGE: two renames
    atomic._exchange = lambda a, b: False
    os.rename = on_call(2, os.rename)
plan.save(sys.argv[2])
"""


@pytest.mark.parametrize("point", [pytest.param("writing", marks=pytest.mark.slow), "before_swap",
                                   pytest.param("after_swap", marks=pytest.mark.slow), "between_renames"])
@pytest.mark.slow
def test_kill_during_plan_save(tmp_path, capsys, point):
    plan = tmp_path / "plan"
    assert _compiled(tmp_path, capsys, plan)[0] == 0
    (plan / "notes.txt").write_text("mine")
    src = tmp_path / "src"
    assert _compiled(tmp_path, capsys, src)[0] == 0
    r = subprocess.run([sys.executable, "-c", KILL_SAVE, str(src), str(plan), point], capture_output=True)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    if point == "between_renames":  # the plan folder is gone for a moment: the next save puts it back
        assert not plan.exists() and len(ours(tmp_path)) == 2  # the old folder and the new one
    else:
        assert load_plan(plan).notes[-1:] == (["new"] if point == "after_swap" else [])
        assert (plan / "notes.txt").read_text() == "mine"
    assert _compiled(tmp_path, capsys, plan)[0] == 0
    assert load_plan(plan).notes[-1:] != ["new"] and (plan / "notes.txt").read_text() == "mine"
    assert ours(tmp_path) == [] and ours(plan) == []


# --------------------------------------------------------------------------- locks and temp files
HOLD_LOCK = r"""
import sys
from kfac_compiler.locks import acquire
acquire("--checkpoint", sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_writer_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys):
    ck = tmp_path / "c.ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(ck)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        code, out, err = run(["train", *FAST, "--checkpoint", str(ck)], capsys)
        assert code == 2 and error_line(err).startswith(
            f"error: --checkpoint '{ck}' is being written by another run (process {holder.pid} on ")
        assert not ck.exists()
    finally:
        holder.stdin.close()
        holder.wait()
    # the holder exited without releasing its lock: taken over, with a warning
    code, out, err = run(["train", *FAST, "--checkpoint", str(ck)], capsys)
    assert code == 0, err
    assert f"warning: --checkpoint '{ck}': taking over the lock of process {holder.pid}, which is no longer running" in err
    assert ck.exists() and ours(tmp_path) == []


def _proc_state(pid: int) -> bytes:
    """The state letter of /proc/<pid>/stat (after the parenthesized command name)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1][1:2]


def test_a_killed_writer_left_unreaped_is_not_running_and_its_lock_is_taken_over(tmp_path, capsys):
    """A holder killed and never reaped stays a zombie (in a container whose init does not reap
    orphans, such as a killed MPI rank's, for good): kill(pid, 0) still finds it, but it runs
    no more, so its lock is taken over."""
    if not os.path.isdir("/proc"):
        pytest.skip("a zombie is told by /proc")
    ck = tmp_path / "c.ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(ck)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        os.kill(holder.pid, signal.SIGKILL)  # not waited for: a zombie until holder.wait()
        deadline = time.monotonic() + 30
        while _proc_state(holder.pid) != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        code, out, err = run(["train", *FAST, "--checkpoint", str(ck)], capsys)
        assert code == 0, err
        assert f"taking over the lock of process {holder.pid}, which is no longer running" in err
        assert ck.exists() and ours(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()


def test_locks_of_another_host_or_unreadable_are_never_taken_over(tmp_path, capsys):
    ck = tmp_path / "c.ckpt"
    lock = tmp_path / ".c.ckpt.kfac-lock"
    lock.write_text(json.dumps({"pid": dead_pid(), "host": "another-host"}))
    code, out, err = run(["train", *FAST, "--checkpoint", str(ck)], capsys)
    assert code == 2 and error_line(err).startswith(
        f"error: --checkpoint '{ck}' is being written by another run (process ") and "'another-host'" in err
    lock.write_text("garbage")
    code, out, err = run(["train", *FAST, "--checkpoint", str(ck)], capsys)
    assert code == 2 and error_line(err) == (
        f"error: --checkpoint '{ck}' is locked by '{lock}', which is not a lock file of ours or is unreadable; "
        "delete it if no other run writes there")
    assert lock.read_text() == "garbage" and not ck.exists()


KILL_CHECKPOINT = r"""
import os, signal, sys
import numpy as np
import kfac_compiler as kc
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
e = ZOO["mlp_classifier"]
tr = Trainer(kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False), optimizer="sgd")
x, y = e.make_data(64)
tr.step(x, y)
tr.save_checkpoint(sys.argv[1])
tr.step(x, y)
def torn(f, **arrays):
    f.write(b"PK" + b"\0" * 4096)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
np.savez = torn
tr.save_checkpoint(sys.argv[1])
"""


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_it_and_the_next_run_removes_the_temp_file(tmp_path, capsys):
    ck = tmp_path / "c.ckpt"
    r = subprocess.run([sys.executable, "-c", KILL_CHECKPOINT, str(ck)], capture_output=True)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    assert read_meta(ck)["host"]["step_count"] == 1  # the last complete checkpoint
    left = ours(tmp_path)
    assert left == [f".c.ckpt.kfac-tmp-{left[0].rsplit('-', 1)[1]}"]
    # a temp file of a live process and one of another output are not ours to remove
    live = tmp_path / f".c.ckpt.kfac-tmp-{os.getppid()}"
    other = tmp_path / f".other.ckpt.kfac-tmp-{dead_pid()}"
    live.write_bytes(b"live")
    other.write_bytes(b"other")
    code, out, err = run(["train", *FAST, "--optimizer", "sgd", "--resume", str(ck), "--checkpoint", str(ck)], capsys)
    assert code == 0, err
    assert read_meta(ck)["host"]["step_count"] == 3
    assert ours(tmp_path) == sorted([live.name, other.name])


# --------------------------------------------------------------------------- Ctrl-C
def _wait_rows(path, n: int, timeout: float = 120.0) -> None:
    """Until the file has more than n lines (or the timeout: the test's asserts then say why)."""
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and len(open_text(path).splitlines()) > n) and time.monotonic() < deadline:
        time.sleep(0.01)


STOPS = [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM"),
         (signal.SIGHUP, 129, "stopped by SIGHUP")]


@pytest.mark.parametrize("signum,code,said", STOPS, ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_stops_at_a_step_boundary_writes_everything_and_resumes(tmp_path, capsys, signum, code, said):
    """Ctrl-C, and SIGTERM (SLURM, Kubernetes, docker stop, timeout) and SIGHUP the same way:
    the step in progress ends, what was asked is written, one line, the shell's exit code."""
    metrics, model, ck = tmp_path / "m.csv", tmp_path / "s.onnx", tmp_path / "c.ckpt"

    def interrupt():
        _wait_rows(metrics, 3)
        os.kill(os.getpid(), signum)

    threading.Thread(target=interrupt, daemon=True).start()
    got, out, err = run(["train", "--steps", "100000", "--batch-size", "64", "-q", "--metrics", str(metrics),
                          "--save", str(model), "--checkpoint", str(ck)], capsys)
    assert got == code, err
    k = read_meta(ck)["host"]["step_count"]
    assert err.strip().splitlines()[-1] == f"{said} at step {k}; checkpoint written to {ck}"
    assert rows(metrics) == list(range(k)) and k >= 3
    onnx.checker.check_model(onnx.load(str(model)))
    assert ours(tmp_path) == []
    code, out, err = run(["train", "--steps", str(k + 2), "-q", "--metrics", str(metrics), "--resume", str(ck)], capsys)
    assert code == 0, err
    assert rows(metrics) == list(range(k + 2))


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_to_a_training_process(tmp_path, signals):
    """A real SIGINT (twice: abort at once) to `kfac-compiler train`: exit 130, one line,
    no traceback, the checkpoint complete or absent, no temp file."""
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "c.ckpt"
    p = subprocess.Popen([sys.executable, "-m", "kfac_compiler.cli", "train", "--steps", "1000000", "-q",
                          "--metrics", str(metrics), "--checkpoint", str(ck), "--checkpoint-every", "7"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_rows(metrics, 30)
    for _ in range(signals):
        p.send_signal(signal.SIGINT)
    out, err = p.communicate()
    assert p.returncode == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    if signals == 1:
        k = read_meta(ck)["host"]["step_count"]
        assert last == f"interrupted at step {k}; checkpoint written to {ck}" and rows(metrics) == list(range(k))
    else:
        k = read_meta(ck)["host"]["step_count"]  # complete whichever signal won
        if last == "interrupted":  # the second aborted before the final checkpoint: a periodic one
            assert k % 7 == 0, k
        else:  # both arrived while the step finished: handled as one
            assert last == f"interrupted at step {k}; checkpoint written to {ck}", err
    assert ours(tmp_path) == []


# --------------------------------------------------------------------------- resume
@pytest.mark.parametrize("name", ["m.csv", pytest.param("m.jsonl", marks=pytest.mark.slow)])
def test_resume_continues_metrics_without_repeating_steps(tmp_path, capsys, name):
    """A run killed after its last checkpoint wrote metrics rows past it: resuming replaces
    them, every step has one row."""
    m, ck2, ck4 = tmp_path / name, tmp_path / "c2", tmp_path / "c4"
    common = ["--batch-size", "64", "-q", "--metrics", str(m)]
    assert run(["train", *common, "--steps", "2", "--checkpoint", str(ck2)], capsys)[0] == 0
    assert run(["train", *common, "--steps", "4", "--resume", str(ck2), "--checkpoint", str(ck4)], capsys)[0] == 0
    assert rows(m) == [0, 1, 2, 3]
    first = open_text(m).splitlines()
    assert run(["train", *common, "--steps", "5", "--resume", str(ck2), "--checkpoint", str(ck2)], capsys)[0] == 0
    again = open_text(m).splitlines()
    assert rows(m) == [0, 1, 2, 3, 4]
    key = (lambda l: l.split(",")[:3]) if name.endswith(".csv") else (lambda l: json.loads(l)["loss"])
    assert [key(l) for l in again[:len(first)]] == [key(l) for l in first]  # bit-for-bit: the same rows again
    (tmp_path / "bad.csv").write_text("not,a,metrics,file\n")
    code, out, err = run(["train", "--steps", "5", "-q", "--metrics", str(tmp_path / "bad.csv"), "--resume", str(ck2)],
                         capsys)
    assert code == 2 and error_line(err) == (f"error: --metrics '{tmp_path}/bad.csv' is not a metrics file of this run "
                                             "(other columns); give another path to resume")
    assert (tmp_path / "bad.csv").read_text() == "not,a,metrics,file\n"


@pytest.mark.slow
def test_resume_defaults_to_the_checkpoints_batch_size_and_seed(tmp_path, capsys):
    a, b, ck = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "c.ckpt"
    common = ["--batch-size", "32", "--seed", "3", "-q"]
    assert run(["train", *common, "--steps", "4", "--save", str(a)], capsys)[0] == 0
    assert run(["train", *common, "--steps", "2", "--checkpoint", str(ck)], capsys)[0] == 0
    assert run(["train", "--steps", "4", "-q", "--resume", str(ck), "--save", str(b)], capsys)[0] == 0
    wa = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(a)).graph.initializer}
    wb = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(b)).graph.initializer}
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("argv, expected", [
    (["--seed", "1"], "error: --seed 1 differs from the seed 0 of checkpoint '{ck}' (it fixes the batch order and the "
                      "estimator's random stream); drop --seed to resume"),
    (["--optimizer", "adam"], "error: checkpoint '{ck}' was written by optimizer 'kfac', not 'adam'; drop --optimizer "
                              "to resume"),
    (["--steps", "1"], "error: --steps 1 is below step 2 of checkpoint '{ck}'; --steps is the total number of steps "
                       "(>= 2)"),
    # (a learning rate alone switches a qmodel run to regular, as on a fresh run: test_momentum_types)
    (["--knob", "momentum_type=qmodel", "--learning-rate", "0.1"], "error: K-FAC with use_qmodel=True chooses learning rate and momentum itself; drop "
                                 "learning_rate/momentum or pass use_qmodel=False"),
])
def test_resume_refuses_options_that_cannot_change(tmp_path, capsys, inputs, argv, expected):
    ck = tmp_path / "c.ckpt"
    shutil.copy(inputs / "ck.npz", ck)
    before = ck.read_bytes()
    code, out, err = run(["train", "--steps", "4", "-q", "--resume", str(ck), "--checkpoint", str(ck), *argv], capsys)
    assert code == 2 and error_line(err) == expected.format(ck=ck)
    assert ck.read_bytes() == before


def test_resume_refuses_other_data_and_takes_the_same(tmp_path, capsys, inputs):
    """The fixture's checkpoint trained on the digits: its metadata records them, a resume on
    the 200-row data file is refused before anything is written, and one on the digits runs."""
    ck = tmp_path / "c.ckpt"
    shutil.copy(inputs / "ck.npz", ck)
    before = ck.read_bytes()
    assert read_meta(str(ck))["data"]["examples"] == 1797
    code, out, err = run(["train", "--steps", "4", "-q", "--resume", str(ck), "--checkpoint", str(ck),
                          "--data", str(inputs / "d.npz")], capsys)
    line = error_line(err)
    assert code == 2 and line.startswith(f"error: --data '{inputs}/d.npz' is not the data checkpoint '{ck}' was "
                                         "trained on (1797 examples, sha256 ")
    assert "this data: 200 examples" in line and line.endswith("resume with the same --data, or start a new run "
                                                               "without --resume")
    assert ck.read_bytes() == before
    assert run(["train", "--steps", "3", "-q", "--resume", str(ck), "--checkpoint", str(ck)], capsys)[0] == 0
    assert read_meta(str(ck))["host"]["step_count"] == 3 and read_meta(str(ck))["data"]["examples"] == 1797


@pytest.mark.slow
def test_damping_given_on_resume_is_used_from_the_resumed_step(tmp_path, capsys):
    ck, m = tmp_path / "c.ckpt", tmp_path / "m.csv"
    assert run(["train", "--steps", "2", "--batch-size", "64", "-q", "--checkpoint", str(ck)], capsys)[0] == 0
    kept = read_meta(ck)["host"]["damping"]
    assert run(["train", "--steps", "3", "-q", "--resume", str(ck), "--metrics", str(m)], capsys)[0] == 0
    assert float(next(csv.DictReader(open_text(m).splitlines()))["damping"]) == kept
    m.unlink()
    assert run(["train", "--steps", "3", "-q", "--resume", str(ck), "--metrics", str(m), "--damping", "0.5"],
               capsys)[0] == 0
    assert float(next(csv.DictReader(open_text(m).splitlines()))["damping"]) == 0.5 != kept
    # the API alike; a seed other than the checkpoint's is refused there too
    plan = _zoo_plan()
    assert Trainer.load_checkpoint(ck, plan, damping=0.25).damping == 0.25
    assert Trainer.load_checkpoint(ck, plan).damping == kept
    with pytest.raises(ConfigError, match=r"seed 5 differs from the seed 0 of checkpoint"):
        Trainer.load_checkpoint(ck, plan, seed=5)


def _zoo_plan():
    import kfac_compiler as kc

    e = ZOO["mlp_classifier"]
    return kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)


def test_non_finite_final_loss_exits_1_after_writing_the_outputs(tmp_path, capsys):
    model, ck = tmp_path / "s.onnx", tmp_path / "c.ckpt"
    code, out, err = run(["train", "--optimizer", "sgd", "--learning-rate", "1e6", "--steps", "5", "-q",
                          "--save", str(model), "--checkpoint", str(ck)], capsys)
    assert code == 1
    assert error_line(err).startswith("error: training ended with a non-finite loss (nan)")
    assert "final train loss nan" in out and read_meta(ck)["host"]["step_count"] == 5
    onnx.checker.check_model(onnx.load(str(model)))


def test_save_graph_source_without_a_source_fails_before_training(tmp_path, capsys):
    """--save-graph source on a model compiled in memory (the zoo's) cannot export: refused
    before the first step, not after the run (which then saved no model at all)."""
    metrics = tmp_path / "m.csv"
    code, out, err = run(["train", *FAST, "--save", str(tmp_path / "out.onnx"), "--save-graph", "source",
                          "--metrics", str(metrics)], capsys)
    assert code == 2 and "final train loss" not in out
    assert error_line(err) == ("error: --save-graph source: cannot export the source graph: the plan was compiled "
                               "from an in-memory model; use --save-graph plan (or auto)")
    assert not (tmp_path / "out.onnx").exists() and not metrics.exists()


def test_an_export_without_its_source_says_it_writes_the_plans_graph(tmp_path):
    """A plan compiled from a file whose source is gone (a plan folder moved without it, the
    model deleted): the export is the plan's graph, the trained output and what feeds it,
    which a warning says (it had been written with none: the file's other outputs, inputs and
    nodes lost silently)."""
    src = save_model("mlp_classifier", tmp_path / "m.onnx", hidden=(8,))
    plan = kc.compile(src, loss="softmax_cross_entropy", output="logits", emit=False)
    os.remove(src)
    tr = Trainer(plan, optimizer="sgd", threads=1)
    with pytest.warns(UserWarning, match=r"export: the plan's graph is written, not the source model .*m\.onnx' "
                                         r"\(.*\): it holds the trained output"):
        tr.export(str(tmp_path / "out.onnx"))
    assert [o.name for o in onnx.load(str(tmp_path / "out.onnx")).graph.output] == ["logits"]
