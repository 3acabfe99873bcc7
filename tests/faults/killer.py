"""Run the kfac-compiler CLI and SIGKILL it at a chosen write event (a real kill -9, at a
reproducible moment rather than a random time).

    python -m faults.killer [--kill-at N | --kill-on KIND:N] [--signal KILL|INT|TERM|HUP] [--events-log FILE]
                            [--root DIR] -- train ...

Write events are the calls, for paths under --root (default: the working folder), of
os.open with write flags, open/io.open/os.fdopen for writing, write() on such a file, os.write,
os.fsync, os.mkdir, os.rename, os.replace, os.unlink/remove and os.rmdir. The process kills
itself *before* the chosen event runs: --kill-at N at the N-th event, --kill-on fsync:2 at the
second fsync. --signal INT sends SIGINT instead (a Ctrl-C at that moment), TERM and HUP
SIGTERM (a scheduler's stop) and SIGHUP (a closed terminal), once.
--events-log appends one line per event ("N KIND PATH") to FILE (outside --root),
to count them in a run without a kill.
"""
from __future__ import annotations

import argparse
import builtins
import io
import os
import runpy
import signal
import sys
from collections.abc import Callable
from typing import Any

from faults.hooked import HookedFile

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Events:
    """Counts write events under `root` and kills this process at the chosen one."""

    def __init__(self, root: str, kill_at: int | None, kill_on: tuple[str, int] | None, log: str | None,
                 sig: int = signal.SIGKILL) -> None:
        self.root = os.path.realpath(root)
        self.kill_at, self.kill_on, self.sig = kill_at, kill_on, sig
        self.count = 0
        self.kinds: dict[str, int] = {}
        self.log = open(log, "a", encoding="utf-8") if log else None  # noqa: SIM115 - lives as long as the process

    def under(self, p: Any) -> str | None:
        if isinstance(p, int):
            try:
                p = os.readlink(f"/proc/self/fd/{p}")
            except OSError:
                return None
        if p is None or isinstance(p, bytes):
            return None
        rp = os.path.realpath(os.fspath(p))
        return rp if rp == self.root or rp.startswith(self.root + os.sep) else None

    def event(self, kind: str, path: str) -> None:
        self.count += 1
        n = self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if self.log is not None:
            self.log.write(f"{self.count} {kind} {os.path.relpath(path, self.root)}\n")
            self.log.flush()
        if self.count == self.kill_at or (self.kill_on is not None and self.kill_on == (kind, n)):
            os.kill(os.getpid(), self.sig)


def install(ev: Events) -> None:
    """Patch the write functions (for the rest of this process)."""
    real_open = io.open
    real = {name: getattr(os, name) for name in ("open", "write", "fsync", "mkdir", "rename", "replace", "unlink",
                                                 "remove", "rmdir")}

    def p_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        path = ev.under(file) if any(c in mode for c in "wax+") else None
        if path is None:
            return real_open(file, mode, *a, **k)
        ev.event("open", path)
        return HookedFile(real_open(file, mode, *a, **k), lambda n, path=path: ev.event("write", path))

    def p_os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        p = ev.under(path) if flags & _WRITE_FLAGS else None
        if p is not None:
            ev.event("open", p)
        return real["open"](path, flags, *a, **k)

    def on_fd(name: str) -> Callable[..., Any]:
        def wrapped(fd: int, *a: Any) -> Any:
            p = ev.under(fd)
            if p is not None:
                ev.event(name, p)
            return real[name](fd, *a)
        return wrapped

    def on_path(name: str) -> Callable[..., Any]:
        def wrapped(path: Any, *a: Any, **k: Any) -> Any:
            p = ev.under(path) if isinstance(path, (str, os.PathLike)) else None
            if p is not None:
                ev.event(name, p)
            return real[name](path, *a, **k)
        return wrapped

    builtins.open = io.open = p_open
    os.fdopen = lambda fd, mode="r", *a, **k: p_open(fd, mode, *a, **k)
    os.open = p_os_open
    os.write = on_fd("write")
    os.fsync = on_fd("fsync")
    for name in ("mkdir", "rename", "replace", "unlink", "remove", "rmdir"):
        setattr(os, name, on_path(name))


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: python -m faults.killer [options] -- CLI ARGS")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="faults.killer", allow_abbrev=False)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--kill-on", help="KIND:N")
    ap.add_argument("--signal", default="KILL", choices=("KILL", "INT", "TERM", "HUP"))
    ap.add_argument("--events-log")
    ap.add_argument("--root", default=os.getcwd())
    opts = ap.parse_args(argv[:cut])
    kill_on = None
    if opts.kill_on:
        kind, _, n = opts.kill_on.partition(":")
        kill_on = (kind, int(n or 1))
    install(Events(opts.root, opts.kill_at, kill_on, opts.events_log, getattr(signal, "SIG" + opts.signal)))
    sys.argv = ["kfac-compiler", *argv[cut + 1:]]
    runpy.run_module("kfac_compiler.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
