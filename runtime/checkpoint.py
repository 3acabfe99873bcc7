"""Checkpoints: one .npz file holding everything a run needs to continue bit-for-bit.

Layout (numpy .npz, written atomically: a temporary file `.<name>.kfac-tmp-<pid>` in the same
directory, fsync, then os.replace, so a crash never leaves a truncated checkpoint under the
final name; the next run writing that name removes the temp file a dead writer left):

    __meta__      uint8 array: UTF-8 JSON (see below)
    slot_00000    the value of state slot meta["slots"][0] (parameters, velocity/<p>,
    slot_00001    adam_m/<p>, adam_v/<p>, factor/<layer>/<f>, inverse/<layer>/<i>), ...

A multi-tensor update's flat slots (velocity/*, grad_velocity/*, adam_m/*, adam_v/*;
optimizers/multi_tensor.py) are stored as the per-parameter slots they concatenate (those of
the optimizer's flat_params) and joined again on loading, so a
checkpoint resumes in either layout.

meta = {"format": "kfac_compiler.checkpoint", "version": 1,
        "plan": {"schema_version", "fingerprint", "layers", "params"},
        "optimizer": "kfac", "knobs": {...resolved optimizer config...}, "seed": 0,
        "host": {"step_count", "applied_steps", "batch_size", + the optimizer's host state (K-FAC:
                 "burn_in_count", "ema_weight", "damping", "inverses_ready")},
        "rng": numpy bit_generator.state, "slots": [...], "device": "cpu", "ranks": 1, "created": ...,
        "data": {"examples", "sha256"} (optional: the trainer's data_fingerprint, set by `train`)}

Loading a checkpoint of another plan (different fingerprint) raises CheckpointError.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
import tokenize
import warnings
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import onnx

from kfac_compiler.atomic import file_target_problem, write_file
from kfac_compiler.contract import GRAD_ACCUM, GRAD_VELOCITY, flat_kind, parse_slot
from kfac_compiler.errors import CheckpointError, CorruptEntry, KfacError, OutputError, npz_reason, one_line, os_errors
from kfac_compiler.npz_files import read_entry
from kfac_compiler.optimizers.multi_tensor import join_flat, split_flat
from kfac_compiler.parsing import nesting_checked
from kfac_compiler.plan import Plan
from kfac_compiler.runtime.best_model import BestModel

if TYPE_CHECKING:
    from kfac_compiler.runtime.trainer import Trainer

FORMAT = "kfac_compiler.checkpoint"
VERSION = 1


# --------------------------------------------------------------------------- atomic files
def atomic_write_bytes(path: str, data: bytes, error: type[KfacError] = OutputError, what: str = "the file") -> None:
    _atomic(path, lambda f: f.write(data), error, what)


def atomic_write(path: str, write: Callable[[BinaryIO], Any], what: str = "the file") -> None:
    """`write(f)` into a temp file of ours that replaces `path` once complete (as atomic_write_bytes)."""
    _atomic(path, write, OutputError, what)


def write_with_external_data(path: str, model: onnx.ModelProto, values: Mapping[str, np.ndarray],
                             what: str = "the trained model") -> None:
    """Write `model` with `values` (onnx_files.write_onnx) to `path`, its large values to the
    external-data file `path` + ".data" beside it, each through a temp file of ours that
    replaces its target only once complete (the data first: a model file never names data
    that is not there)."""
    from kfac_compiler.atomic import temp_path
    from kfac_compiler.onnx_files import write_onnx

    data_path = path + ".data"
    for p in (path, data_path):
        problem = file_target_problem(p)
        if problem:
            raise OutputError(f"cannot write {what} {p!r}: it {problem}")
    tmp = temp_path(os.path.realpath(data_path))
    with os_errors(OutputError, what, data_path, writing=True):
        try:
            buf = io.BytesIO()
            write_onnx(model, buf, tmp, os.path.basename(data_path), values)
            os.replace(tmp, os.path.realpath(data_path))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    atomic_write_bytes(path, buf.getvalue(), what=what)


def _atomic(path: str, write, error: type[KfacError] = CheckpointError, what: str = "the checkpoint") -> None:
    """Write via a temp file of ours in the target's folder + os.replace
    (kfac_compiler.atomic.write_file): the old file survives any failure. An unwritable path
    or a full disk is a one-line `error` naming `what`."""
    path = os.fspath(path)
    problem = file_target_problem(path)
    if problem:
        raise error(f"cannot write {what} {path!r}: it {problem}")
    with os_errors(error, what, path, writing=True):
        write_file(path, write)


# --------------------------------------------------------------------------- fingerprint
def plan_fingerprint(plan: Plan) -> dict[str, Any]:
    """What identifies a plan: schema version, source model sha256 (plan.source_sha256), graph
    structure, parameters with shapes, layers with their approximations, loss and output. Two
    plans with the same fingerprint have the same state slots with the same meaning."""

    model = plan.model
    dims = {t.name: [int(d) for d in t.dims] for t in model.graph.initializer}
    params = [[p, dims.get(p)] for p in plan.trainable]
    layers = [[layer.name, layer.kind, layer.approximation, list(layer.params)] for layer in plan.layers]
    loss = plan.loss.to_json()
    g = model.graph
    h = hashlib.sha256()
    for n in g.node:  # the graph structure (not the weights)
        h.update(f"{n.op_type}|{','.join(n.input)}|{','.join(n.output)};".encode())
    structure = h.hexdigest()
    # the source model's hash (file or serialized proto, weights included) when the plan has it
    source = plan.source_sha256
    ident = {
        "schema_version": plan.schema_version,
        "source": source,
        "structure": structure,
        "params": params,
        "layers": layers,
        "loss": loss,
        "output": plan.output,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()
    return {"fingerprint": digest, "schema_version": ident["schema_version"], "source": source,
            "layers": [l[0] for l in layers], "params": [p[0] for p in params]}


# --------------------------------------------------------------------------- save / load
def _flat_kind(trainer: Trainer, slot: str) -> str | None:
    """The kind of a flat slot (`adam_m/*`: "adam_m"), None for any other slot (a parameter
    named so included)."""
    return None if slot in trainer.params else flat_kind(slot)


def _scratch(trainer: Trainer, slot: str) -> bool:
    """A slot no checkpoint stores: gradient accumulation's running sum (grad_accum/<p>)."""
    return slot not in trainer.params and parse_slot(slot).kind == GRAD_ACCUM


def _param_shapes(trainer: Trainer) -> dict[str, tuple[int, ...]]:
    """The shapes of the parameters a flat slot concatenates (the optimizer's flat_params: K-FAC's
    leave out its parameter groups', which keep per-parameter slots)."""
    return trainer.policy.flat_shapes()


def stored_state(trainer: Trainer) -> dict[str, np.ndarray]:
    """The trainer's state slots as a checkpoint stores them: each flat slot as the
    per-parameter slots it concatenates; gradient accumulation's running sums left out (a
    checkpoint is taken between cycles, where they mean nothing)."""
    out: dict[str, np.ndarray] = {}
    for s in trainer.store.slots():
        if _scratch(trainer, s):
            continue
        kind = _flat_kind(trainer, s)
        if kind is None:
            out[s] = trainer.store.to_numpy(s)
        else:
            out.update({f"{kind}/{p}": v for p, v in split_flat(trainer.store.to_numpy(s), _param_shapes(trainer)).items()})
    return out


def _join_flat_slots(trainer: Trainer, values: dict[str, np.ndarray], path: str) -> dict[str, np.ndarray]:
    """`values` (per-parameter slots) with those of each flat slot the trainer has joined into it."""
    shapes = _param_shapes(trainer)
    for s in trainer.store.slots():
        kind = _flat_kind(trainer, s)
        names = {p: f"{kind}/{p}" for p in shapes}
        if kind is None or s in values or not all(n in values for n in names.values()):
            continue  # a missing per-parameter slot: reported as the flat slot missing
        parts = {p: values[n] for p, n in names.items()}
        try:
            values[s] = join_flat(parts, shapes).astype(next(iter(parts.values())).dtype)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path!r}: slot {kind}/{e}") from None
        for n in names.values():
            del values[n]
    return values


def save_checkpoint(trainer: Trainer, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    state = stored_state(trainer)
    slots = list(state)
    arrays: dict[str, Any] = {f"slot_{i:05d}": state[s] for i, s in enumerate(slots)}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "plan": plan_fingerprint(trainer.plan),
        "optimizer": trainer.optimizer,
        "knobs": trainer.config.to_dict(),
        "seed": trainer.seed,
        "host": trainer.host_state(),
        "rng": trainer.rng.bit_generator.state,
        "slots": slots,
        # the slots are the plan's state, its parameters in the plan's own names and shapes
        # (Plan.trainable; Trainer.parameters() gives the user's after a restore)
        "layout": "plan",
        "device": trainer.device.name,
        "ranks": trainer.ranks,  # a data-parallel run's; its factors are the ranks' mean
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if trainer.threads:
        meta["knobs"]["threads"] = trainer.threads
    if trainer.data_fingerprint is not None:
        meta["data"] = trainer.data_fingerprint
    best = trainer.best_model
    if best is not None and best.values is not None:  # keep_best's model, beside the last state
        names = list(best.values)
        arrays.update({f"best_{i:05d}": best.values[n] for i, n in enumerate(names)})
        meta["best"] = {"step": best.step, "loss": best.loss, "metrics": best.metrics, "values": names}
    arrays["__meta__"] = np.frombuffer(json.dumps(meta, default=_json_default).encode("utf-8"), dtype=np.uint8)
    _atomic(path, lambda f: np.savez(f, **arrays))
    return path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o).__name__)


# what reading a damaged .npz raises: a flipped byte fails the member's CRC (BadZipFile), a
# truncated file has no central directory, a damaged .npy header is a ValueError, or a
# SyntaxError / TokenError from the header's literal_eval (a flip inside its dict)
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, ValueError, EOFError, OSError, SyntaxError, tokenize.TokenError)


def _open(path: str | os.PathLike):
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a directory; give the checkpoint file")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} is not a regular file (a device, pipe or socket)")
    try:
        with os_errors(CheckpointError, "checkpoint", path, writing=False):
            return np.load(path, allow_pickle=False)
    except _READ_ERRORS as e:
        raise CheckpointError(f"checkpoint {path!r} is not readable ({npz_reason(e)}); use an earlier copy") from None


def _read(z, key: str, path: str) -> np.ndarray:
    """Entry `key` of the open checkpoint (its CRC checked by zipfile as it is read)."""
    try:
        return read_entry(z, key)
    except _READ_ERRORS as e:
        reason = str(e) if isinstance(e, CorruptEntry) else f"entry {key!r} ({npz_reason(e)})"
        raise CheckpointError(f"checkpoint {path!r} is corrupt: {reason}; use an earlier copy") from None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    with _open(path) as z:
        return _meta(z, os.fspath(path))


def _meta(z, path: str) -> dict[str, Any]:
    if "__meta__" not in z.files:
        raise CheckpointError(f"{path!r} is not a kfac_compiler checkpoint (no __meta__ entry)")
    try:
        meta = nesting_checked(lambda: json.loads(bytes(_read(z, "__meta__", path)).decode("utf-8")))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path!r} has corrupt metadata ({one_line(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a kfac_compiler checkpoint")
    version = meta.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format version {version}; this kfac_compiler reads <= {VERSION}")
    check_meta(meta, path)
    return meta


# the metadata's layout (docs/runtime.md, "Checkpoints"): key -> (what it must be, check)
def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_META = {
    "version": ("an integer >= 1", lambda v: _count(v) and v >= 1),
    "plan": ("an object with a 'fingerprint'", lambda v: isinstance(v, dict) and isinstance(v.get("fingerprint"), str)),
    "optimizer": ("an optimizer name", lambda v: isinstance(v, str)),
    "knobs": ("an object of optimizer options", lambda v: isinstance(v, dict)),
    "seed": ("an integer >= 0", _count),
    "host": ("an object", lambda v: isinstance(v, dict)),
    "rng": ("an object (a numpy bit generator's state)", lambda v: isinstance(v, dict)),
    "slots": ("a list of distinct slot names",
              lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v) and len(set(v)) == len(v)),
}
_HOST = {"step_count": "an integer >= 0", "applied_steps": "an integer >= 0"}


def check_meta(meta: dict[str, Any], path: str) -> None:
    """The metadata has the layout save_checkpoint writes (hand-edited or damaged metadata is
    a one-line CheckpointError naming the entry, not a KeyError or a wrong resumed run)."""
    from kfac_compiler.optimizers import OPTIMIZERS

    for key, (what, ok) in _META.items():
        if key not in meta:
            raise CheckpointError(f"checkpoint {path!r}: metadata entry {key!r} is missing; use an earlier copy")
        if not ok(meta[key]):
            raise CheckpointError(f"checkpoint {path!r}: metadata entry {key!r} must be {what}, got {meta[key]!r}"[:300])
    if meta["optimizer"] not in OPTIMIZERS:
        raise CheckpointError(f"checkpoint {path!r} was written by optimizer {meta['optimizer']!r}, which is not "
                              f"registered here (optimizers: {', '.join(OPTIMIZERS)})")
    layout = meta.get("layout", "plan")  # optional: checkpoints before it held the plan's layout too
    if layout != "plan":
        raise CheckpointError(f"checkpoint {path!r}: metadata entry 'layout' is {layout!r}; this kfac_compiler "
                              "writes and restores the plan's layout ('plan') only")
    data = meta.get("data")  # optional: the data fingerprint `train` records
    if data is not None and not (isinstance(data, dict) and _count(data.get("examples"))
                                 and isinstance(data.get("sha256"), str)):
        raise CheckpointError(f"checkpoint {path!r}: metadata entry 'data' must be an object with 'examples' and "
                              f"'sha256', got {data!r}"[:300])
    best = meta.get("best")  # optional: the kept model of a keep_best run
    if best is not None and not (isinstance(best, dict) and _count(best.get("step"))
                                 and isinstance(best.get("loss"), (int, float)) and not isinstance(best.get("loss"), bool)
                                 and math.isfinite(best["loss"]) and isinstance(best.get("metrics"), dict)
                                 and isinstance(best.get("values"), list)
                                 and all(isinstance(n, str) for n in best["values"])
                                 and len(set(best["values"])) == len(best["values"])):
        raise CheckpointError(f"checkpoint {path!r}: metadata entry 'best' must be an object with 'step', a finite "
                              f"'loss', 'metrics' and the distinct names of its 'values', got {best!r}"[:300])
    host = meta["host"]
    for key, what in _HOST.items():
        if not _count(host.get(key)):
            raise CheckpointError(f"checkpoint {path!r}: metadata entry 'host.{key}' must be {what}, got {host.get(key)!r}")
    if host["applied_steps"] > host["step_count"]:
        raise CheckpointError(f"checkpoint {path!r}: host.applied_steps {host['applied_steps']} exceeds host.step_count "
                              f"{host['step_count']}")


def _check_host(trainer: Trainer, host: dict[str, Any], path: str) -> None:
    """Each host entry has the type of the trainer's own (an int stays an int, a float a
    finite number, a bool a bool): the optimizer's set_host_state then converts and checks."""
    for key, mine in trainer.host_state().items():
        if key not in host:
            continue
        v = host[key]
        if isinstance(mine, bool):
            ok, what = isinstance(v, bool), "true or false"
        elif isinstance(mine, int):
            ok, what = _count(v), "an integer >= 0"
        elif isinstance(mine, float):
            ok, what = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a finite number"
        else:
            ok, what = True, ""
        if not ok:
            raise CheckpointError(f"checkpoint {path!r}: metadata entry 'host.{key}' must be {what}, got {v!r}")


def _read_best(trainer: Trainer, z, meta: dict[str, Any], path: str) -> BestModel | None:
    """The kept model the metadata's 'best' names (None without one), each value checked
    against the trainer's own trained value: name, shape, dtype, finite."""
    best = meta.get("best")
    if best is None:
        return None
    mine = {n: trainer.store.spec(n) for n in trainer.trained_names()}
    values = {}
    for i, name in enumerate(best["values"]):
        key = f"best_{i:05d}"
        if name not in mine:
            raise CheckpointError(f"checkpoint {path!r}: the kept best model holds {name!r}, which this trainer does not "
                                  "train; load it with the plan it was saved from")
        if key not in z.files:
            raise CheckpointError(f"checkpoint {path!r} is missing the kept best model's {name!r}; use an earlier copy")
        v = _read(z, key, path)
        shape, dtype = mine[name]
        if tuple(v.shape) != tuple(shape) or v.dtype != dtype:
            raise CheckpointError(f"checkpoint {path!r}: the kept best model's {name!r} is {v.dtype} {list(v.shape)}, "
                                  f"expected {dtype} {list(shape)}")
        if v.dtype.kind == "f" and not np.all(np.isfinite(v)):
            raise CheckpointError(f"checkpoint {path!r}: the kept best model's {name!r} holds NaN or infinite values; "
                                  "use an earlier copy")
        values[name] = v
    return BestModel(best["step"], float(best["loss"]), best["metrics"], values)


def restore_checkpoint(trainer: Trainer, path: str | os.PathLike) -> None:
    """Load every state slot, the host counters, the damping and the RNG state into `trainer`.
    Everything is checked before anything is changed: a bad checkpoint leaves `trainer` as it was.
    The one slot kind it may lack is K-FAC's grad_velocity/* (momentum_type="adam" resumed from
    another type's checkpoint): those start at zero, with a warning."""
    path = os.fspath(path)
    with _open(path) as z:
        meta = _meta(z, path)
        mine = plan_fingerprint(trainer.plan)
        theirs = meta["plan"]
        if theirs.get("fingerprint") != mine["fingerprint"]:
            diff = ""
            if theirs.get("params") != mine["params"]:
                diff = " (different parameters)"
            elif theirs.get("layers") != mine["layers"]:
                diff = " (different layers)"
            elif theirs.get("schema_version") != mine["schema_version"]:
                diff = f" (plan schema {theirs.get('schema_version')} vs {mine['schema_version']})"
            elif theirs.get("source") != mine["source"]:
                diff = " (compiled from a different source model)"
            raise CheckpointError(f"checkpoint {path!r} belongs to another plan{diff}; load it with the plan it was saved from")
        if meta["optimizer"] != trainer.optimizer:
            raise CheckpointError(
                f"checkpoint {path!r} was written by optimizer {meta['optimizer']!r}, this trainer uses {trainer.optimizer!r}"
            )
        values = {}
        for i, s in enumerate(meta["slots"]):
            key = f"slot_{i:05d}"
            if key not in z.files:
                raise CheckpointError(f"checkpoint {path!r} is missing state slot {s!r}")
            values[s] = _read(z, key, path)
        best = _read_best(trainer, z, meta, path)
    values = _join_flat_slots(trainer, values, path)
    missing = [s for s in trainer.store.slots() if s not in values and not _scratch(trainer, s)]
    fresh = [s for s in missing if parse_slot(s).kind == GRAD_VELOCITY]
    if len(fresh) < len(missing):
        raise CheckpointError(f"checkpoint {path!r} lacks state slot {next(s for s in missing if s not in fresh)!r} "
                              "that this trainer uses")
    for s, v in values.items():
        if v.dtype.kind != "f" and v.dtype.kind not in "iub":
            raise CheckpointError(f"checkpoint {path!r}: slot {s!r} has dtype {v.dtype}; expected numbers")
        if s in trainer.store:
            shape, dtype = trainer.store.spec(s)
            if tuple(v.shape) != tuple(shape) or v.dtype != dtype:
                raise CheckpointError(f"checkpoint {path!r}: slot {s!r} is {v.dtype} {list(v.shape)}, expected "
                                      f"{dtype} {list(shape)}")
        if v.dtype.kind == "f" and not np.all(np.isfinite(v)):
            raise CheckpointError(f"checkpoint {path!r}: slot {s!r} holds NaN or infinite values; use an earlier copy")
    rng = np.random.default_rng()
    try:
        rng.bit_generator.state = meta["rng"]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r}: unusable RNG state ({one_line(e)})") from None
    _check_host(trainer, meta["host"], path)
    before = trainer.host_state()
    try:
        trainer.set_host_state(meta["host"])
    except KeyError as e:
        trainer.set_host_state(before)
        raise CheckpointError(f"checkpoint {path!r}: metadata entry 'host.{e.args[0]}' is missing") from None
    except (TypeError, ValueError) as e:
        trainer.set_host_state(before)
        raise CheckpointError(f"checkpoint {path!r}: unusable host state ({one_line(e)})") from None
    for s, v in values.items():
        if s in trainer.store:
            trainer.store.set(s, v)
        else:
            trainer.store.add(s, v)
    trainer.rng = rng
    trainer.best_model = best
    trainer.data_fingerprint = meta.get("data")  # None: written without one (the API, older checkpoints)
    if fresh:  # K-FAC resumed with momentum_type="adam" from another type: the sums start empty
        warnings.warn(f"checkpoint {path!r} has no momentum sums ({fresh[0]!r}, ...; written with another "
                      "momentum_type): they start at zero", stacklevel=2)
