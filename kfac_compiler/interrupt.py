"""Ctrl-C during training: stop at the next step boundary instead of in the middle of one.

A KeyboardInterrupt raised inside a step would lose everything since the last checkpoint;
with `StopOnInterrupt` the first SIGINT only sets `requested`, the training loop stops after
the step in progress and writes what was asked. A second SIGINT raises KeyboardInterrupt at
once (every file is written atomically, so nothing is left torn).
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


class StopOnInterrupt:
    """Context manager holding the SIGINT handler (main thread only; elsewhere Python's
    default KeyboardInterrupt stays)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
