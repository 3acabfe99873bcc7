"""Atomic writes of files and folders, under temp names of our own that a later run can clean.

Every file or folder kfac_compiler writes goes first to `.<name>.kfac-tmp-<pid>` next to its
target, then is renamed over it: a kill at any moment leaves the old version or the new one
under the target's name, never a torn one. The temp name says whose it is, so that the next
run writing the same target removes what a dead writer left (`remove_stale`) and nothing else.

A folder (a plan) is replaced as a whole by swapping a complete new folder in (Linux
`renameat2(RENAME_EXCHANGE)`, else two renames). The files of the old folder that are not
the writer's own (a user's notes, a checkpoint) are hard-linked into the new one first, so
replacing a plan never deletes anything else in its folder.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
import sys
import warnings
from collections.abc import Callable, Collection

TMP_TAG = ".kfac-tmp-"
OLD_TAG = ".kfac-old-"  # the old folder during a two-rename swap (no RENAME_EXCHANGE)
_OURS = re.compile(r"^\.(?P<base>.+)(?P<tag>\.kfac-tmp-|\.kfac-old-)(?P<pid>\d+)$")


# --------------------------------------------------------------------------- names
def temp_path(path: str | os.PathLike, tag: str = TMP_TAG) -> str:
    """`.<name>.kfac-tmp-<our pid>` in the folder of `path`."""
    d, base = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(d, f".{base}{tag}{os.getpid()}")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a pid we may not signal counts too). A zombie
    does not: it has exited and only waits to be reaped, which in a container whose init does
    not reap orphans (a killed MPI rank's, a `docker run` without --init) never happens."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not _exited(pid)


def _exited(pid: int) -> bool:
    """True for a zombie (state Z or X in /proc/<pid>/stat); False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return False
    return stat_line[stat_line.rfind(b")") + 2:][:1] in (b"Z", b"X")  # the state follows "(command) "


def stale_temps(path: str | os.PathLike) -> list[str]:
    """Our temp files and folders for `path` whose writer is no longer running."""
    d, base = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        m = _OURS.match(name)
        if m and m["base"] == base and not pid_alive(int(m["pid"])):
            out.append(os.path.join(d, name))
    return sorted(out)


def remove_stale(path: str | os.PathLike) -> list[str]:
    """Remove what dead writers of `path` left (temp files; temp and old plan folders, see
    discard_folder); returns what was removed or restored."""
    target = os.path.abspath(os.fspath(path))
    done = []
    for p in sorted(stale_temps(target), key=lambda p: OLD_TAG not in os.path.basename(p)):  # restores first
        try:
            if not os.path.isdir(p) or os.path.islink(p):
                os.unlink(p)
                done.append(p)
            elif OLD_TAG in os.path.basename(p) and not os.path.lexists(target):
                os.rename(p, target)  # killed between the two renames of a swap: put the old one back
                done.append(p)
            elif discard_folder(p, target):
                done.append(p)
        except OSError:
            pass  # another run got there first, or not ours to touch: leave it
    return done


# --------------------------------------------------------------------------- files
def file_target_problem(path: str) -> str | None:
    """Why `path` cannot receive a file written here, or None: a folder, or an existing
    device, pipe or socket (replacing one by a regular file would destroy it). The one check
    of every file output: the command line's before a run (outputs.check_outputs), the API's
    at the write (Trainer.export, save_checkpoint)."""
    if path.endswith(("/", os.sep)) or os.path.basename(path) in ("", ".", ".."):
        return "names a folder; give a file path"
    if os.path.isdir(path):
        return "is a folder; give a file path"
    if os.path.exists(path) and not os.path.isfile(path):
        return "is not a regular file (a device, pipe or socket); give a file path"
    return None


def write_file(path: str | os.PathLike, write: Callable[[object], object]) -> str:
    """Write `path` atomically: `write(f)` fills a temp file of ours (fsynced), which then
    replaces `path`; any failure removes the temp file and leaves `path` as it was. OSError
    propagates (callers turn it into their one-line error). A symlink is written through: its
    target is replaced, the link stays."""
    path = os.path.realpath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = temp_path(path)
    fd = _create(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    return path


def _create(tmp: str) -> int:
    try:
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:  # left by an earlier write of this very process that was cut short
        _unlink(tmp)
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


# --------------------------------------------------------------------------- folders
def replace_folder(path: str | os.PathLike, fill: Callable[[str], None], replaces: Collection[str]) -> str:
    """Replace folder `path` atomically by one that `fill(tmp_dir)` writes; the entries of
    the old folder not named in `replaces` (top-level names: the old and new owner's files)
    are carried over as hard links. Returns the real path written."""
    path = os.path.realpath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    remove_stale(path)
    tmp = temp_path(path)
    if os.path.lexists(tmp):
        discard_folder(tmp, path)
    os.mkdir(tmp)
    try:
        fill(tmp)
        existed = os.path.isdir(path)
        if existed:
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            for name in os.listdir(path):
                if name not in replaces and not os.path.lexists(os.path.join(tmp, name)):
                    _link_tree(os.path.join(path, name), os.path.join(tmp, name))
        _fsync_dir(tmp)
        if not existed:
            os.rename(tmp, path)
            _fsync_dir(parent)
            return path
        if _exchange(tmp, path):
            old = tmp
        else:
            old = temp_path(path, OLD_TAG)
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
        _fsync_dir(parent)
    except BaseException:
        if os.path.isdir(tmp):
            discard_folder(tmp, path, replaces)
        raise
    if not discard_folder(old, path, replaces):
        warnings.warn(f"kept {old!r}: it holds files that changed while {path!r} was replaced; "
                      "move what you need out of it and delete it", stacklevel=2)
    return path


def _link_tree(src: str, dst: str) -> None:
    """Hard-link `src` (a file, symlink or folder, recursively) as `dst`."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.mkdir(dst)
        os.chmod(dst, stat.S_IMODE(os.stat(src).st_mode))
        for name in os.listdir(src):
            _link_tree(os.path.join(src, name), os.path.join(dst, name))
    else:
        os.link(src, dst, follow_symlinks=False)


def discard_folder(folder: str, live: str, owned: Collection[str] = ()) -> bool:
    """Remove a temp or old folder of ours: the entries that are the same file as the one at
    the same place in `live` (hard links carried over), its top-level files in `owned` or that
    a plan writes (plan.json, *.onnx: plans are the only folders written here), and the
    folders left empty. Anything else stays; True when nothing did."""

    def walk(d: str, mirror: str, top: bool) -> bool:
        empty = True
        for name in os.listdir(d):
            p, twin = os.path.join(d, name), os.path.join(mirror, name)
            if os.path.isdir(p) and not os.path.islink(p):
                if walk(p, twin, False):
                    os.rmdir(p)
                else:
                    empty = False
            elif (top and (name in owned or name == "plan.json" or name.endswith(".onnx"))) or _same(p, twin):
                os.unlink(p)
            else:
                empty = False
        return empty

    try:
        if walk(folder, live, True):
            os.rmdir(folder)
            return True
    except OSError:
        pass
    return False


def _same(a: str, b: str) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    if stat.S_ISLNK(sa.st_mode):
        return stat.S_ISLNK(sb.st_mode) and os.readlink(a) == os.readlink(b)
    return (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev)


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap paths `a` and `b` in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or the file system cannot (the caller then renames twice)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)
