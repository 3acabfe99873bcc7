"""Making faults: full disks, read-only folders, and injected write errors where we may not mount.

Where this process may mount (root, `mount` works, KFAC_FAULTS_NO_MOUNT unset) a full disk is
a small tmpfs and a read-only folder a tmpfs remounted read-only: real file systems, nothing
patched. Elsewhere (CI without mount rights) a read-only folder is a chmod when that binds us
(not root), and otherwise both are an OSError (ENOSPC / EROFS) raised by the lowest Python
write functions for paths under the folder. Each context manager yields the mechanism's name
so that a test reports which one ran.
"""
from __future__ import annotations

import builtins
import errno
import functools
import io
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

from faults.hooked import HookedFile

Populate = Callable[[str], None]


# --------------------------------------------------------------------------- mounts
def can_mount() -> bool:
    """True where a tmpfs can be mounted and unmounted here (tried once); KFAC_FAULTS_NO_MOUNT=1
    forces the fallbacks (as on CI without mount rights)."""
    return not os.environ.get("KFAC_FAULTS_NO_MOUNT") and _mount_works()


@functools.cache
def _mount_works() -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return False
    d = tempfile.mkdtemp(prefix="kfac-faults-mount-")
    try:
        if _run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d]) != 0:
            return False
        return _run(["umount", d]) == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run(cmd: list[str]) -> int:
    return subprocess.run(cmd, capture_output=True).returncode


@contextmanager
def tmpfs(path: str, size: str) -> Iterator[str]:
    """A tmpfs of `size` mounted at `path` (created), unmounted afterwards."""
    os.makedirs(path, exist_ok=True)
    if _run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path]) != 0:
        raise RuntimeError(f"cannot mount a tmpfs at {path}")
    try:
        yield path
    finally:
        if _run(["umount", path]) != 0:
            _run(["umount", "-l", path])


def fill(path: str, free: int = 0) -> None:
    """Fill the file system of `path` so that about `free` bytes stay available."""
    st = os.statvfs(path)
    avail = st.f_bavail * st.f_frsize
    with open(os.path.join(path, "filler.bin"), "wb") as f:
        want = avail - free
        chunk = b"\0" * 4096
        try:
            while want > 0:
                f.write(chunk[:min(len(chunk), want)])
                f.flush()
                want -= len(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


# --------------------------------------------------------------------------- public faults
@contextmanager
def full_disk(path: str, populate: Populate | None = None, free: int | None = 0,
              size: int = 64 * 1024) -> Iterator[str]:
    """A folder `path` on a small file system of `size` bytes: first `populate(path)`, then the
    disk filled up to `free` bytes (None: not filled, the `size` limit only)."""
    if can_mount():
        with tmpfs(path, f"{size // 1024}k"):
            if populate:
                populate(path)
            if free is not None:
                fill(path, free)
            yield "tmpfs"
        return
    os.makedirs(path, exist_ok=True)
    if populate:
        populate(path)
    budget = size if free is None else free
    with inject_errors(path, errno.ENOSPC, budget=budget):
        yield "injected ENOSPC"


@contextmanager
def read_only(path: str, populate: Populate | None = None) -> Iterator[str]:
    """A read-only folder `path` holding what `populate(path)` wrote."""
    if can_mount():
        with tmpfs(path, "4m"):
            if populate:
                populate(path)
            if _run(["mount", "-o", "remount,ro", path]) != 0:
                raise RuntimeError(f"cannot remount {path} read-only")
            yield "remount-ro"
        return
    os.makedirs(path, exist_ok=True)
    if populate:
        populate(path)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    os.chmod(path, 0o555)
    try:
        if not os.access(path, os.W_OK):  # chmod binds us (not root)
            yield "chmod"
            return
    finally:
        os.chmod(path, mode)
    with inject_errors(path, errno.EROFS):
        yield "injected EROFS"


# --------------------------------------------------------------------------- injected errors
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _writing(mode: str) -> bool:
    return any(c in mode for c in "wax+")


class _Budget:
    """Bytes that still fit on the pretend disk (None: every write fails)."""

    def __init__(self, left: int | None) -> None:
        self.left = left

    def take(self, n: int, path: str) -> None:
        if self.left is None or n > self.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        self.left -= n


@contextmanager
def inject_errors(root: str, code: int, budget: int | None = None) -> Iterator[None]:
    """Make writes under `root` fail with OSError(`code`), at the lowest Python functions:
    EROFS: opening for writing, mkdir, rename/replace, unlink, rmdir; ENOSPC: writes beyond
    `budget` bytes (files can still be created, as on a real full disk)."""
    root = os.path.realpath(root)
    real = {name: getattr(os, name) for name in ("open", "fdopen", "mkdir", "rename", "replace", "unlink",
                                                 "remove", "rmdir", "write")}
    real_open = io.open
    pool = _Budget(budget)

    def under(p: Any) -> bool:
        if isinstance(p, int):
            p = _fd_path(p)
        if p is None or isinstance(p, bytes):
            return False
        rp = os.path.realpath(os.fspath(p))
        return rp == root or rp.startswith(root + os.sep)

    def refuse(p: Any) -> None:
        raise OSError(code, os.strerror(code), os.fspath(p) if not isinstance(p, int) else _fd_path(p))

    def p_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if _writing(mode) and under(file):
            if code == errno.EROFS:
                refuse(file)
            path = _fd_path(file) if isinstance(file, int) else os.fspath(file)
            return HookedFile(real_open(file, mode, *a, **k), lambda n, path=path: pool.take(n, path))
        return real_open(file, mode, *a, **k)

    def p_os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if code == errno.EROFS and flags & _WRITE_FLAGS and under(path):
            refuse(path)
        return real["open"](path, flags, *a, **k)

    def p_fdopen(fd: int, mode: str = "r", *a: Any, **k: Any) -> Any:
        return p_open(fd, mode, *a, **k)

    def p_write(fd: int, data: Any) -> int:
        if under(fd):
            if code == errno.EROFS:
                refuse(fd)
            pool.take(len(data), _fd_path(fd) or "")
        return real["write"](fd, data)

    def guard(name: str) -> Callable[..., Any]:
        def wrapped(*paths: Any, **k: Any) -> Any:
            if code == errno.EROFS and any(under(p) for p in paths[:2] if isinstance(p, (str, os.PathLike))):
                refuse(paths[0])
            return real[name](*paths, **k)
        return wrapped

    with ExitStack() as stack:
        for target, name, value in ((builtins, "open", p_open), (io, "open", p_open), (os, "open", p_os_open),
                                    (os, "fdopen", p_fdopen), (os, "write", p_write)):
            stack.enter_context(mock.patch.object(target, name, value))
        for name in ("mkdir", "rename", "replace", "unlink", "remove", "rmdir"):
            stack.enter_context(mock.patch.object(os, name, guard(name)))
        yield
