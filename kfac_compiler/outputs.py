"""Checks of everything a command will write, before it compiles or trains.

A training run that finds out at its end that `--save` points into a read-only folder, or
that `--checkpoint` is the data set, has lost its work or the user's. So every output
(train's --save, --checkpoint, --metrics, --plot; compile's -o) is checked first: its folder
can be written (probed with a temp file of ours, created and removed), it is not a folder
(or, for -o, not a file), no two outputs are the same file and no output is an input; and
once the sizes are known, before the first step, that their disks have room for them. Each
failure is a one-line OutputError naming the option and the path.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kfac_compiler.atomic import file_target_problem, temp_path
from kfac_compiler.errors import OutputError, os_reason


@dataclass(frozen=True)
class Output:
    """A path a command writes: `option` names it in messages; `folder` for a plan folder."""

    option: str
    path: str
    folder: bool = False


def check_outputs(outputs: Iterable[Output], inputs: Sequence[tuple[str, str | None]] = (),
                  may_equal: Iterable[tuple[str, str]] = ()) -> None:
    """Raise a one-line OutputError for the first output that cannot or must not be written.
    `inputs`: (option, path) of what the command reads (a folder stands for its files);
    `may_equal`: (output option, input option) pairs allowed to be one file (--checkpoint and
    --resume: the usual way to continue a run)."""
    outs = [o for o in outputs if o.path]
    allowed = set(may_equal)
    for o in outs:
        _check_target(o)
    for i, a in enumerate(outs):
        for b in outs[:i]:
            if _same_file(a.path, b.path):
                raise OutputError(f"{b.option} {b.path!r} and {a.option} {a.path!r} are the same file; "
                                  "give each output its own path")
    for o in outs:
        for option, path in inputs:
            if not path or (o.option, option) in allowed:
                continue
            hit = _input_hit(o, path)
            if hit:
                raise OutputError(f"{o.option} {o.path!r} would overwrite {hit} (the {option} input); "
                                  "give the output another path")


def model_inputs(model: str | None, outputs: Iterable[Output]) -> list[tuple[str, str | None]]:
    """check_outputs' inputs for a MODEL argument: the model itself, and what a plan reads
    (plan.plan_inputs, which the API's checks use too): for a plan folder its files and the
    source model its plan.json names (train reads it to tell a stale plan: written over, the
    user's model is lost and the plan stale), and the external data of these models."""
    if not model:
        return []
    from kfac_compiler.plan import plan_inputs, plan_source

    existing = [os.path.realpath(o.path) for o in outputs if o.path and not o.folder and os.path.isfile(o.path)]
    if not os.path.isdir(model):
        return [("MODEL", model), *plan_inputs(model, None, existing)]
    return [("MODEL", model), *plan_inputs(plan_source(model), model, existing)]


def _check_target(o: Output) -> None:
    path = o.path
    if o.folder:
        if os.path.exists(path) and not os.path.isdir(path):
            raise OutputError(f"{o.option} {path!r} is a file; give a folder")
    else:
        problem = file_target_problem(path)
        if problem:
            raise OutputError(f"{o.option} {path!r} {problem}")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise OutputError(f"{o.option} {path!r} is read-only; make it writable or give another path")
    where = _existing_folder(o)
    probe = temp_path(os.path.join(where, os.path.basename(os.path.abspath(path))))
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        pass  # a temp file of this very process: the folder is writable
    except OSError as e:
        raise OutputError(f"{o.option} {path!r}: cannot write in {where!r} ({os_reason(e, writing=True)}); "
                          "give a path in a writable folder") from None


def _existing_folder(o: Output) -> str:
    """The folder the output's file (or a plan folder's temp sibling) will be created in, or
    its nearest existing ancestor (the missing ones are created then)."""
    d = os.path.dirname(os.path.realpath(o.path))  # a symlink's target is what gets written
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise OutputError(f"{o.option} {o.path!r}: {d!r} is a file, not a folder")
    return d


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _input_hit(o: Output, path: str) -> str | None:
    """What of input `path` output `o` would overwrite: the file itself, or for an input
    folder (a plan) one of its files; for a folder output (a plan), an input in it."""
    if o.folder:  # a plan writes plan.json, model.onnx and <subgraph>.onnx (Plan.save checks those)
        d = os.path.realpath(o.path)
        if os.path.isfile(path) and os.path.dirname(os.path.realpath(path)) == d and (
                os.path.basename(path) in ("plan.json", "model.onnx")):
            return repr(path)
        return repr(path) if _same_file(o.path, path) else None
    if os.path.isdir(path):
        from kfac_compiler.plan import plan_files

        real = os.path.realpath(o.path)
        if os.path.dirname(real) == os.path.realpath(path) and os.path.basename(real) in plan_files(path):
            return f"a file of the plan folder {path!r}"
        return None
    return repr(path) if os.path.exists(path) and _same_file(o.path, path) else None


def check_space(needs: Sequence[tuple[Output, int]]) -> None:
    """Raise a one-line OutputError when the outputs' estimated sizes (bytes) do not fit the
    free space of their disks (an atomic write holds the new file while the old still exists)."""
    by_disk: dict[int, list[tuple[Output, int, str]]] = {}
    for o, size in needs:
        if not o.path:
            continue
        where = _existing_folder(o)
        by_disk.setdefault(os.stat(where).st_dev, []).append((o, size, where))
    for items in by_disk.values():
        total = sum(size for _, size, _ in items)
        st = os.statvfs(items[0][2])
        free = st.f_bavail * st.f_frsize
        if total > free:
            names = " and ".join(f"{o.option} {o.path!r}" for o, _, _ in items)
            verb, their = ("needs", "its") if len(items) == 1 else ("need", "their")
            raise OutputError(f"{names} {verb} about {_mb(total)} but {their} disk has {_mb(free)} free; "
                              "free some space or write elsewhere")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"
