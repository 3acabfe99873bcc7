"""Running the CLI and the API under faults, and judging what came out.

A case ends "clean" when every check it asks for holds; otherwise its Verdict carries the worst
problem found, in the order of STATUSES (a traceback outranks a lost file, which outranks a
silent wrong result, ...). The checks are the project's standard for bad input: exactly one
`error: ...` line naming the culprit, exit code 2, nothing of the user's changed, no stray files.
"""
from __future__ import annotations

import atexit
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import zipfile
from collections.abc import Callable, Iterable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

STATUSES = ("hang", "traceback", "lost", "overwritten", "leftover", "silent", "unclear")
"""Problem kinds, worst first: a run that did not end / an exception escaped / results lost / a user file changed /
stray files left / a wrong result without an error / an error that is not one line naming the
culprit with the right exit code."""

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_DIR = os.path.dirname(TESTS_DIR)


# --------------------------------------------------------------------------- outcomes
@dataclass
class Result:
    """What a CLI run gave: exit code, stdout, stderr and the traceback of an escaped exception."""

    code: int | None
    out: str
    err: str
    exc: str | None = None

    @property
    def crashed(self) -> bool:
        return self.exc is not None or "Traceback (most recent call last)" in self.err

    def err_lines(self) -> list[str]:
        """stderr without blank lines, warnings and progress bars."""
        return [line for line in self.err.splitlines()
                if line.strip() and not line.startswith("warning: ") and not line.startswith("\r")]


@dataclass
class Verdict:
    status: str               # "clean" or one of STATUSES
    detail: str = ""
    mechanism: str = ""       # how the fault was made: tmpfs, remount-ro, chmod, injected, kill -9, ...

    @property
    def clean(self) -> bool:
        return self.status == "clean"

    def __str__(self) -> str:
        mech = f" [{self.mechanism}]" if self.mechanism else ""
        return f"{self.status}{mech}: {self.detail}" if self.detail else f"{self.status}{mech}"


class Judge:
    """Collects the problems of one case; `verdict()` reports the worst."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []
        self.mechanism = ""

    def problem(self, status: str, detail: str) -> None:
        assert status in STATUSES, status
        self.problems.append((status, detail))

    def check(self, ok: bool, status: str, detail: str) -> bool:
        if not ok:
            self.problem(status, detail)
        return ok

    # ---------------------------------------------------------------- CLI outcomes
    def error_line(self, r: Result, culprit: str | Sequence[str] = (), code: int = 2,
                   if_accepted: str = "silent", prefix: str = "error: ") -> None:
        """An expected failure: exit `code`, exactly one stderr line starting with `prefix` that
        names one of `culprit`, no traceback. A run that succeeded is `if_accepted`."""
        if r.crashed:
            self.problem("traceback", _last_line(r.exc or r.err))
            return
        if r.code == 0:
            self.problem(if_accepted, "exit 0: the bad input was accepted")
            return
        lines = r.err_lines()
        if len(lines) != 1 or not lines[0].startswith(prefix):
            self.problem("unclear", f"expected one '{prefix}...' line, got {len(lines)}: {' | '.join(lines)[:300]}")
            return
        if r.code != code:
            self.problem("unclear", f"exit code {r.code}, expected {code}: {lines[0][:200]}")
        names = [culprit] if isinstance(culprit, str) else list(culprit)
        if names and not any(n in lines[0] for n in names):
            self.problem("unclear", f"the line names none of {names}: {lines[0][:200]}")

    def success(self, r: Result) -> bool:
        """An expected success: exit 0, no traceback."""
        if r.crashed:
            self.problem("traceback", _last_line(r.exc or r.err))
            return False
        if r.code != 0:
            self.problem("unclear", f"exit {r.code}: {' | '.join(r.err_lines())[:300]}")
            return False
        return True

    # ---------------------------------------------------------------- API outcomes
    def api_error(self, exc: BaseException | None, culprit: str | Sequence[str] = (),
                  if_accepted: str = "silent") -> None:
        """An expected KfacError with a one-line message naming `culprit`."""
        from kfac_compiler.errors import KfacError

        if exc is None:
            self.problem(if_accepted, "no error: the bad argument was accepted")
            return
        if not isinstance(exc, KfacError):
            self.problem("traceback", f"{type(exc).__name__}: {_last_line(str(exc))}")
            return
        msg = str(exc)
        if "\n" in msg.strip():
            self.problem("unclear", f"{type(exc).__name__} message has {len(msg.strip().splitlines())} lines")
        names = [culprit] if isinstance(culprit, str) else list(culprit)
        if names and not any(n in msg for n in names):
            self.problem("unclear", f"the message names none of {names}: {msg[:200]}")

    # ---------------------------------------------------------------- files
    def unchanged(self, before: dict[str, str], status: str = "overwritten") -> None:
        """Every file of the snapshot `before` still exists with the same bytes."""
        now = snapshot_files(before)
        for path, digest in before.items():
            if now.get(path) != digest:
                what = "deleted" if path not in now else "changed"
                self.problem(status, f"{os.path.basename(path)} {what}")

    def no_strays(self, directory: str, before: Iterable[str], expected: Iterable[str] = ()) -> None:
        """No entry in `directory` (recursively) that was not there `before` and is not `expected`
        (a path, or a folder whose contents are expected)."""
        strays = strays_in(directory, before, expected)
        if strays:
            self.problem("leftover", "left behind: " + ", ".join(sorted(strays))[:300])

    def verdict(self) -> Verdict:
        if not self.problems:
            return Verdict("clean", mechanism=self.mechanism)
        rank = {s: i for i, s in enumerate(STATUSES)}
        worst = min(self.problems, key=lambda p: rank[p[0]])
        others = [d for s, d in self.problems if (s, d) != worst]
        detail = worst[1] + (f" (+{len(others)} more: {others[0][:80]})" if others else "")
        return Verdict(worst[0], detail, self.mechanism)


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# --------------------------------------------------------------------------- running
def run_cli(argv: Sequence[Any]) -> Result:
    """kfac_compiler.cli.main(argv) in this process, stdout and stderr captured; an exception
    escaping main is recorded (with its traceback), not raised."""
    from kfac_compiler.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    exc = None
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's --help, or a sys.exit somewhere
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - the escaped exception is the outcome being judged
            exc = traceback.format_exc()
    return Result(code, out.getvalue(), err.getvalue(), exc)


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI subprocess: tests/ importable (for faults.killer), one ORT thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, REPO_DIR, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc writes among the write events
    env.update(extra or {})
    return env


def cli_command(argv: Sequence[Any], kill_at: int | None = None, kill_on: str | None = None,
                events_log: str | None = None, sig: str | None = None) -> list[str]:
    """The command line of a CLI subprocess; with a kill or an events log it runs under
    faults.killer (SIGKILL, or `sig`, at write event number `kill_at`, or at `kill_on` = "KIND:N")."""
    args = [str(a) for a in argv]
    opts = []
    for flag, value in (("--kill-at", kill_at), ("--kill-on", kill_on), ("--events-log", events_log),
                        ("--signal", sig)):
        if value is not None:
            opts += [flag, str(value)]
    if not opts:
        return [sys.executable, "-m", "kfac_compiler.cli", *args]
    return [sys.executable, "-m", "faults.killer", *opts, "--", *args]


def run_subprocess(argv: Sequence[Any], cwd: str, timeout: float = 300, kill_at: int | None = None,
                   kill_on: str | None = None, events_log: str | None = None, sig: str | None = None) -> Result:
    """The CLI in a child process (for kills and signals); code -9 means it was SIGKILLed."""
    p = subprocess.run(cli_command(argv, kill_at, kill_on, events_log, sig), cwd=cwd, env=subprocess_env(),
                       capture_output=True, text=True, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr, None)


def call(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, the exception fn raised)."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - judged by the caller
        return None, e


# --------------------------------------------------------------------------- files
def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def snapshot(*paths: str) -> dict[str, str]:
    """{file: sha256} of the given files and of every file under the given folders."""
    out: dict[str, str] = {}
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                for f in files:
                    full = os.path.join(root, f)
                    if os.path.isfile(full):
                        out[full] = sha256(full)
        elif os.path.isfile(p):
            out[p] = sha256(p)
    return out


def snapshot_files(before: dict[str, str]) -> dict[str, str]:
    return {p: sha256(p) for p in before if os.path.isfile(p)}


def listing(directory: str) -> set[str]:
    """Every path under `directory` (files and folders, hidden ones included)."""
    out: set[str] = set()
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            out.add(os.path.join(root, name))
    return out


def strays_in(directory: str, before: Iterable[str], expected: Iterable[str] = ()) -> list[str]:
    exp = [os.path.abspath(e).rstrip(os.sep) for e in expected]
    old = set(before)
    strays = []
    for p in listing(directory) - old:
        a = os.path.abspath(p)
        if any(a == e or a.startswith(e + os.sep) for e in exp):
            continue
        strays.append(os.path.relpath(p, directory))
    return strays


def metrics_rows(path: str) -> list[dict[str, str]]:
    """The rows of a metrics CSV (or JSONL) file; [] when it does not exist."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".csv"):
            return list(csv.DictReader(f))
        return [json.loads(line) for line in f if line.strip()]


def read_checkpoint(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, {slot name: array}) of a checkpoint, read with numpy (independently of the
    product's reader)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["__meta__"]).decode("utf-8"))
        slots = {s: z[f"slot_{i:05d}"] for i, s in enumerate(meta["slots"])}
    return meta, slots


def same_checkpoint_state(a: str, b: str) -> str | None:
    """None when the two checkpoints hold bit-identical slots and host state, else what differs."""
    ma, sa = read_checkpoint(a)
    mb, sb = read_checkpoint(b)
    if ma["host"] != mb["host"]:
        return f"host state {ma['host']} != {mb['host']}"
    if ma["rng"] != mb["rng"]:
        return "random generator state differs"
    if set(sa) != set(sb):
        return f"slots differ: {sorted(set(sa) ^ set(sb))[:3]}"
    for s in sa:
        if sa[s].dtype != sb[s].dtype or not np.array_equal(sa[s], sb[s]):
            return f"slot {s!r} differs"
    return None


# --------------------------------------------------------------------------- shared assets
@dataclass
class Assets:
    """Inputs built once per process (a zoo model file, its data, a compiled plan, a
    checkpoint) and copied into each case's folder."""

    root: str = ""
    made: dict[str, str] = field(default_factory=dict)

    def _root(self) -> str:
        if not self.root:
            self.root = tempfile.mkdtemp(prefix="kfac-faults-assets-")
            atexit.register(shutil.rmtree, self.root, True)
        return self.root

    def _once(self, key: str, make: Callable[[str], None]) -> str:
        if key not in self.made:
            path = os.path.join(self._root(), key)
            make(path)
            self.made[key] = path
        return self.made[key]

    def model(self) -> str:
        """The zoo's mlp_classifier (seed 0) as an .onnx file."""
        from kfac_compiler.models import save_model

        return self._once("mlp_classifier.onnx", lambda p: save_model("mlp_classifier", p, seed=0))

    def data(self) -> str:
        """Its digits data as an .npz (arrays 'input' and 'targets')."""
        def make(p: str) -> None:
            from kfac_compiler.models import ZOO

            x, y = ZOO["mlp_classifier"].make_data(None, seed=0)
            np.savez(p, input=x["input"] if isinstance(x, dict) else x, targets=y)

        return self._once("digits.npz", make)

    def plan(self) -> str:
        """The model compiled into a plan folder (with its default subgraphs)."""
        def make(p: str) -> None:
            import kfac_compiler as kc

            kc.compile(self.model(), loss="softmax_cross_entropy", output="logits").save(p)

        return self._once("plan", make)

    def checkpoint(self) -> str:
        """A checkpoint of the zoo's default model after 2 K-FAC steps (`train --steps 2`)."""
        def make(p: str) -> None:
            r = run_cli(["train", "--steps", "2", "-q", "--checkpoint", p])
            if r.code != 0:
                raise RuntimeError(f"could not make the checkpoint asset: {r.err or r.exc}")

        return self._once("run2.ckpt", make)

    def copy(self, asset: str, dest: str) -> str:
        if os.path.isdir(asset):
            shutil.copytree(asset, dest)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
            shutil.copyfile(asset, dest)
        return dest


ASSETS = Assets()


def lying_npz(path: str, arrays: dict[str, np.ndarray], liar: str, shape: tuple[int, ...]) -> None:
    """An .npz of `arrays` whose entry `liar` has a header declaring `shape` (its data
    unchanged): what numpy would allocate before reading, were the size not checked."""
    with zipfile.ZipFile(path, "w") as z:
        for k, a in arrays.items():
            f = io.BytesIO()
            if k == liar:
                np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(a.dtype),
                                                        "fortran_order": False, "shape": shape})
                f.write(a.tobytes())
            else:
                np.lib.format.write_array(f, a)
            z.writestr(f"{k}.npy", f.getvalue())
