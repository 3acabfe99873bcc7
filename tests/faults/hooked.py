"""A file object whose write() calls run a hook first: the full-disk budget of inject.py
(ENOSPC when it runs out) and the write events of killer.py (a kill at a chosen write)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class HookedFile:
    """Wraps an open file; `before_write(nbytes)` runs before each write."""

    def __init__(self, f: Any, before_write: Callable[[int], None]) -> None:
        self._f, self._before_write = f, before_write

    def write(self, data: Any) -> int:
        self._before_write(len(data))
        return self._f.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self) -> HookedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
