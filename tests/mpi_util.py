"""Running a command on P ranks under the MPI extra's mpirun, on loopback, from a test.

    out = run_ranks(2, [sys.executable, script, ...])   # skips the test without the extra

The extra (`pip install -e '.[mpi]'`: mpi4py and Open MPI from PyPI) puts `mpirun` beside the
interpreter; without it a test that needs ranks is skipped with the install command. Open MPI
refuses root unless told, and a 2-core machine runs 4 ranks only oversubscribed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import pytest

SKIP_REASON = "the MPI extra is not installed (pip install -e '.[mpi]': mpi4py and Open MPI)"


def mpirun() -> str | None:
    """The mpirun beside this interpreter (the extra's), else one on PATH; None without mpi4py."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def require_mpi() -> str:
    found = mpirun()
    if found is None:
        pytest.skip(SKIP_REASON)
    return found


def rank_command(ranks: int, command: Sequence[str]) -> list[str]:
    """mpirun -n `ranks` `command` on this machine, as root too, oversubscribed."""
    launcher = require_mpi()
    extra = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [launcher, *extra, "--oversubscribe", "--bind-to", "none", "-n", str(ranks), *command]


def run_ranks(ranks: int, command: Sequence[str], timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    """Run `command` on `ranks` ranks; the completed process (text output)."""
    env = dict(os.environ, **kwargs.pop("env", {}))
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return subprocess.run(rank_command(ranks, command), capture_output=True, text=True, timeout=timeout, env=env,
                          **kwargs)


def own_lines(stderr: str) -> list[str]:
    """stderr's lines without mpirun's reports (blocks between lines of dashes), the Open MPI
    runtime's own "[host:pid] PMIX ERROR: ..." and "[warn] Epoll ..." lines (seen on a loaded
    machine) and the NULs its abort report interleaves (seen in CI at the start of our own
    error line)."""
    lines, inside = [], False
    for line in stderr.replace("\x00", "").splitlines():
        if line.startswith("-----"):
            inside = not inside
        elif "] PMIX ERROR:" in line and line.startswith("[") or line.startswith("[warn] Epoll "):
            continue  # the runtime's own complaints (libevent's "[warn] Epoll MOD(...) ...: Bad file descriptor")
        elif not inside and line.strip():
            lines.append(line)
    return lines
