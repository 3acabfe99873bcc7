"""Setup progress: the stages that take seconds on large models (the compiler's front end,
each subgraph's emission, each ONNX Runtime session) report their duration to the
`kfac_compiler.setup` logger, at INFO level; the library prints nothing by itself (logging's
default shows only warnings). The command line shows a stage on stderr when it took
`SHOW_SECONDS` or more (`show_on_stderr`), so that a deep plan's minutes of setup are not
silent; a program embedding the library attaches its own handler to the same logger.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

LOGGER = logging.getLogger("kfac_compiler.setup")
SHOW_SECONDS = 2.0  # a stage this long or longer gets a line from the command line


@contextmanager
def stage(what: str) -> Iterator[None]:
    """Report `what` and its duration when the block completes (not when it raises)."""
    began = time.perf_counter()
    yield
    if LOGGER.isEnabledFor(logging.INFO):
        seconds = time.perf_counter() - began
        LOGGER.info("%s: %.1f s", what, seconds, extra={"seconds": seconds})


class _Slow(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return float(getattr(record, "seconds", 0.0)) >= SHOW_SECONDS


@contextmanager
def show_on_stderr(enabled: bool = True) -> Iterator[None]:
    """Within the block, print the stages of SHOW_SECONDS or more on stderr, one line each
    (`setup: <stage>: <seconds> s`)."""
    if not enabled:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("setup: %(message)s"))
    handler.addFilter(_Slow())
    level = LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
