"""Lock files: one run at a time writes a given output.

Two runs writing one checkpoint would silently take turns replacing it. While a command
writes an output it holds `.<name>.kfac-lock` next to it: JSON {"pid", "host"}, created
complete in one step (a hard link of a written temp file, or O_CREAT|O_EXCL where the file
system has no hard links). A second run is refused with one line naming the holder. A lock
whose process is no longer running on this host (a kill -9) is taken over with a warning; a
lock from another host is never taken over (its pid means nothing here). Takeovers of one
stale lock are serialized by an flock on it, and each checks that the path still names that
file before removing it: of several runs starting at once, one gets the lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import warnings
from collections.abc import Iterator, Sequence

from kfac_compiler.atomic import pid_alive, remove_stale, temp_path
from kfac_compiler.errors import OutputError, os_reason
from kfac_compiler.parsing import nesting_checked

LOCK_TAG = ".kfac-lock"
_held: set[str] = set()  # lock files this process holds


def lock_path(path: str | os.PathLike) -> str:
    d, base = os.path.split(os.path.realpath(os.fspath(path)))  # a symlink and its target: one lock
    return os.path.join(d, f".{base}{LOCK_TAG}")


def _holder(lock: str) -> dict | None:
    try:
        with open(lock, encoding="utf-8") as f:
            doc = nesting_checked(lambda: json.load(f))
        return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _stale(holder: dict, lock: str) -> bool:
    if holder.get("host") != socket.gethostname():
        return False
    if holder["pid"] == os.getpid():
        return lock not in _held
    return not pid_alive(holder["pid"])


def acquire(option: str, path: str | os.PathLike) -> str:
    """Take the lock of output `path` (given as `option`) or raise a one-line OutputError;
    returns the lock file. Also removes the temp files dead writers of `path` left."""
    lock = lock_path(path)
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    tmp = temp_path(lock)
    for attempt in range(2):
        try:
            os.makedirs(os.path.dirname(lock), exist_ok=True)  # the output's folder, created anyway to write it
            if _create(lock, tmp, mine):
                break
        except OSError as e:
            raise OutputError(f"{option} {os.fspath(path)!r}: cannot create its lock file {lock!r} "
                              f"({os_reason(e, writing=True)})") from None
        holder = _holder(lock)
        if holder is None:
            raise OutputError(f"{option} {os.fspath(path)!r} is locked by {lock!r}, which is not a lock file of ours "
                              "or is unreadable; delete it if no other run writes there")
        if attempt == 0 and _stale(holder, lock) and _take_over(lock, holder):
            warnings.warn(f"{option} {os.fspath(path)!r}: taking over the lock of process {holder['pid']}, "
                          "which is no longer running", stacklevel=2)
            continue
        raise OutputError(f"{option} {os.fspath(path)!r} is being written by another run (process {holder['pid']} "
                          f"on {holder.get('host')!r}); wait for it, or give another path (its lock: {lock!r})")
    _held.add(lock)
    remove_stale(os.path.realpath(os.fspath(path)))
    remove_stale(lock)
    return lock


def _take_over(lock: str, holder: dict) -> bool:
    """Remove the stale `lock` of `holder` unless another run is taking it over (False then):
    an flock on the lock file serializes the takeovers, and the file is removed only if the
    path still names it and it still names `holder`."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return True  # gone already: the next attempt creates it, or finds the new holder
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            if os.fstat(fd).st_ino != os.stat(lock).st_ino:
                return True  # replaced meanwhile: the next attempt judges the new one
        except FileNotFoundError:
            return True
        with os.fdopen(os.dup(fd), encoding="utf-8") as f:
            try:
                still = nesting_checked(lambda: json.load(f)) == holder
            except (ValueError, UnicodeDecodeError):
                still = False
        if still:
            os.unlink(lock)
        return still
    finally:
        os.close(fd)


def _create(lock: str, tmp: str, content: str) -> bool:
    """Create `lock` holding `content` in one step; False if it exists. The temp file goes
    whatever happens (on a full disk its write fails)."""
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(content)
        try:
            os.link(tmp, lock)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: exclusive create, then write
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(content)
            return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def release(lock: str) -> None:
    """Remove `lock` if it is still ours."""
    _held.discard(lock)
    holder = _holder(lock)
    if holder and holder["pid"] == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(OSError):
            os.unlink(lock)


@contextlib.contextmanager
def locked(outputs: Sequence[tuple[str, str | None]]) -> Iterator[None]:
    """Hold the locks of the given (option, path) outputs (None paths skipped) for the block."""
    taken: list[str] = []
    try:
        for option, path in outputs:
            if path:
                taken.append(acquire(option, path))
        yield
    finally:
        for lock in reversed(taken):
            release(lock)
