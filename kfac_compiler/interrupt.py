"""Ctrl-C, SIGTERM and SIGHUP: stop at the next step boundary instead of in the middle of one.

A KeyboardInterrupt raised inside a step would lose everything since the last checkpoint;
with `StopOnInterrupt` the first stop signal only sets `requested`, the training loop stops
after the step in progress and writes what was asked. A second one raises `Interrupted` (a
KeyboardInterrupt) at once (every file is written atomically, so nothing is left torn).

SIGTERM is what SLURM, Kubernetes, `docker stop` and `timeout` send, SIGHUP what a closed
terminal sends: they stop a run as Ctrl-C does. The exit code is the shell's for the signal
(128 + its number: 130, 143, 129). Outside a training loop (`raise_on_stop`, held by the
command line for the whole command) they raise `Interrupted`, so that every `finally` of ours
runs and no lock or temp file is left behind; while the command line imports its libraries
(`deferred_stop`) they are held back until the imports are done.

Under MPI (`kfac_compiler.ranks`) the ranks also stop on SIGUSR1: Open MPI's mpirun answers
Ctrl-C by terminating the job, but forwards SIGUSR1 to every rank.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what ends a run like Ctrl-C
# a signal that stands for another: mpirun forwards SIGUSR1 to the ranks where a user's Ctrl-C
# would kill the job, so it is a Ctrl-C (exit 130, "interrupted")
STANDS_FOR = {signal.SIGUSR1: signal.SIGINT}


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by `signum` (128 + its number)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(KeyboardInterrupt):
    """A stop signal that ends the command now; `exit_code` is the signal's."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal_name(signum))
        self.signum = int(signum)
        self.exit_code = exit_code(signum)


def signal_of(e: BaseException) -> int:
    """The signal behind an interrupt (a plain KeyboardInterrupt is Ctrl-C's)."""
    return getattr(e, "signum", signal.SIGINT)


def describe(signum: int | None) -> str:
    """`interrupted` for Ctrl-C (or none: a rank stopped because another one was), `stopped
    by SIGTERM` for another signal."""
    return "interrupted" if signum in (None, signal.SIGINT) else f"stopped by {signal_name(signum)}"


@contextlib.contextmanager
def _handlers(signals: Sequence[int], handler: Any) -> Iterator[bool]:
    """Hold `handler` for `signals` (main thread only; yields whether it was installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield True
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def raise_on_stop() -> contextlib.AbstractContextManager[bool]:
    """Every stop signal raises `Interrupted` while held (SIGTERM's and SIGHUP's default is
    death, which leaves locks and temp files behind): the command unwinds through its
    `finally` blocks."""
    return _handlers(STOP_SIGNALS, _raise_interrupted)


@contextlib.contextmanager
def deferred_stop() -> Iterator[None]:
    """A stop signal received inside is raised as `Interrupted` when the block ends: C
    extensions turn an exception raised while they import (numpy, onnx) into an ImportError
    with a traceback."""
    received: list[int] = []
    with _handlers(STOP_SIGNALS, lambda signum, frame: received.append(signum)):
        yield
    if received:
        raise Interrupted(received[0])


class StopOnInterrupt:
    """Context manager holding the handler of the stop signals (`signals`; main thread
    only; elsewhere the previous handlers stay). `signum`: the first one received."""

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS) -> None:
        self.signum: int | None = None
        self.signals = tuple(signals)
        self._held: contextlib.AbstractContextManager[bool] | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """The exit code of the signal that stopped the run (Ctrl-C's when none did here: a
        rank stopped because another rank was interrupted)."""
        return EXIT_CODE if self.signum is None else exit_code(self.signum)

    def describe(self) -> str:
        return describe(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        signum = STANDS_FOR.get(signal.Signals(signum), signum)
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum

    def __enter__(self) -> StopOnInterrupt:
        self._held = _handlers(self.signals, self._handle)
        self._held.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._held is not None:
            self._held.__exit__(None, None, None)
            self._held = None
