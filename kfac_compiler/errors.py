"""User-facing errors.

Every error a user can provoke (bad model file, unsupported op, bad config, bad data, stale
plan) is a `KfacError` whose message is ONE line naming the culprit (file, node, op,
parameter, layer) and what to do. The CLI prints `error: <message>` and exits with code 2;
anything else escaping is a bug in kfac_compiler.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np


class KfacError(Exception):
    """Base class: a one-line, actionable message for the user."""

    exit_code = 2


class ModelError(KfacError):
    """The ONNX model cannot be used (missing, corrupt, unsupported opset, bad output name)."""


class UnsupportedOpError(KfacError):
    """An op on the loss path has no gradient rule (or other per-op knowledge) for its opset."""


class ConfigError(KfacError):
    """A compile or training option is invalid (unknown block kind, bad regex, bad value)."""


class PlanError(KfacError):
    """A plan directory is missing, of another schema version, or stale w.r.t. its model."""


class DataError(KfacError):
    """Training or evaluation data has the wrong shape, dtype, range or contains NaN."""


class DeviceError(KfacError):
    """The requested execution device is not available (e.g. CUDA asked, CPU fallback found)."""


class CheckpointError(KfacError):
    """A checkpoint is unreadable or belongs to another plan."""


class DivergedError(KfacError):
    """Training ended with a non-finite loss, or one far above where it started (what was
    asked for is still written)."""

    exit_code = 1


class OutputError(KfacError):
    """An output cannot or must not be written: unwritable, the same file as another output or
    an input, no room on its disk, or being written by another run."""


# ------------------------------------------------------------------ OSError -> one line
_REASONS = {
    errno.ENOSPC: "the disk is full: free space or choose another location",
    errno.EDQUOT: "the disk quota is exceeded: free space or choose another location",
    errno.EROFS: "the file system is read-only: choose another location",
    errno.EISDIR: "it is a directory: give a file path",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EEXIST: "a part of the path is a file, not a directory",  # os.makedirs(exist_ok=True) over a file
    errno.ENAMETOOLONG: "the path is too long",
    errno.EMFILE: "too many open files",
}


def os_reason(e: OSError, writing: bool | None) -> str:
    """What an OSError means for the user, with what to do (the errno, not the bare strerror);
    `writing` None: the operation is not known."""
    if e.errno in (errno.EACCES, errno.EPERM):
        fix = {True: ": make it writable or choose another path", False: ": make it readable", None: ""}[writing]
        return f"permission denied{fix}"
    if e.errno == errno.ENOENT:
        return {True: "its directory does not exist", False: "it does not exist", None: "no such file or directory"}[writing]
    return _REASONS.get(e.errno, e.strerror or str(e) or type(e).__name__)


@contextmanager
def os_errors(error: type[KfacError], what: str, path: str | os.PathLike, writing: bool) -> Iterator[None]:
    """Turn an OSError inside the block into `error`: one line naming `what` and `path`, why
    it failed and what to do. Used where the file is known (plans, checkpoints, data, outputs),
    so that the CLI's last-resort OSError handler stays a last resort."""
    try:
        yield
    except OSError as e:
        verb = "write" if writing else "read"
        raise error(f"cannot {verb} {what} {os.fspath(path)!r}: {os_reason(e, writing)}") from None


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as `Type: message` on one line, at most `limit` characters (for the
    cause inside a one-line error)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:limit]


def human_bytes(n: float | None) -> str:
    """`512 B`, `1.5 KiB`, ... `46.4 TiB` (None: `?`): sizes in one-line messages and tables."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n}"


class CorruptEntry(ValueError):
    """A file's content contradicts itself (an .npz entry's header declares more than the
    entry holds); the message names the entry and is the whole reason."""


def npz_reason(e: BaseException) -> str:
    """Why numpy could not read a file as an .npz, in one line. numpy's own text for a file
    that is not an array file suggests loading it with allow_pickle, which must never be done
    with a file one did not write: say what the file is not instead."""
    text = " ".join(str(e).split())
    if isinstance(e, CorruptEntry):
        return text
    if isinstance(e, ValueError) and "allow_pickle" in text:
        if text.startswith("Object arrays"):
            return "it holds object (pickled) arrays, which are never loaded: save plain numeric arrays"
        return "it is not an .npz file"
    return one_line(e)


def range_problem(a: np.ndarray, dtype: Any, what: str) -> str | None:
    """Why converting `a` to `dtype` would not keep its values, naming `what`, or None: a
    float64 beyond float32's range would become inf, an integer beyond the type's range would
    wrap. NaN/Inf are left to the callers' own checks, which name them."""
    dtype = np.dtype(dtype)
    if not a.size or a.dtype.kind not in "iuf" or dtype.kind not in "iuf" or np.can_cast(a.dtype, dtype, "safe"):
        return None
    info = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
    lo, hi = a.min(), a.max()
    if a.dtype.kind == "f" and not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    if lo < info.min or hi > info.max:
        worst = hi if hi > info.max else lo
        return f"{what} holds {worst:g}, beyond {dtype.name}'s range [{info.min:g}, {info.max:g}]; rescale the data"
    return None
