"""Ctrl-C during training: stop at the next step boundary instead of in the middle of one.

A KeyboardInterrupt raised inside a step would lose everything since the last checkpoint;
with `StopOnInterrupt` the first SIGINT only sets `requested`, the training loop stops after
the step in progress and writes what was asked. A second SIGINT raises KeyboardInterrupt at
once (every file is written atomically, so nothing is left torn).

Under MPI (`kfac_compiler.ranks`) the ranks also stop on SIGUSR1: Open MPI's mpirun answers
Ctrl-C by terminating the job, but forwards SIGUSR1 to every rank.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


class StopOnInterrupt:
    """Context manager holding the handler of SIGINT (and of `signals`, when given) (main
    thread only; elsewhere Python's default KeyboardInterrupt stays)."""

    def __init__(self, signals: Sequence[int] = (signal.SIGINT,)) -> None:
        self.requested = False
        self.signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._installed = False
