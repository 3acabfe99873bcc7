"""Checkpoints: one .npz file holding everything a run needs to continue bit-for-bit.

Layout (numpy .npz, written atomically: a temporary file `.<name>.kfac-tmp-<pid>` in the same
directory, fsync, then os.replace, so a crash never leaves a truncated checkpoint under the
final name; the next run writing that name removes the temp file a dead writer left):

    __meta__      uint8 array: UTF-8 JSON (see below)
    slot_00000    the value of state slot meta["slots"][0] (parameters, velocity/<p>,
    slot_00001    adam_m/<p>, adam_v/<p>, factor/<layer>/<f>, inverse/<layer>/<i>), ...

meta = {"format": "kfac_compiler.checkpoint", "version": 1,
        "plan": {"schema_version", "fingerprint", "layers", "params"},
        "optimizer": "kfac", "knobs": {...resolved optimizer config...}, "seed": 0,
        "host": {"step_count", "applied_steps", "batch_size", + the optimizer's host state (K-FAC:
                 "burn_in_count", "ema_weight", "damping", "inverses_ready")},
        "rng": numpy bit_generator.state, "slots": [...], "device": "cpu", "created": ...}

Loading a checkpoint of another plan (different fingerprint) raises CheckpointError.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kfac_compiler.atomic import write_file
from kfac_compiler.errors import CheckpointError
from kfac_compiler.plan import Plan

if TYPE_CHECKING:
    from kfac_compiler.runtime.trainer import Trainer

FORMAT = "kfac_compiler.checkpoint"
VERSION = 1


# --------------------------------------------------------------------------- atomic files
def atomic_write_bytes(path: str, data: bytes) -> None:
    _atomic(path, lambda f: f.write(data))


def _atomic(path: str, write) -> None:
    """Write via a temp file of ours in the target's folder + os.replace
    (kfac_compiler.atomic.write_file): the old file survives any failure. An unwritable path
    is a one-line CheckpointError."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"cannot write {path!r}: it is a directory; give a file path")
    try:
        write_file(path, write)
    except OSError as e:
        raise CheckpointError(f"cannot write {path!r}: {e.strerror or e}") from None


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
def save_checkpoint(trainer: "Trainer", path: str | os.PathLike) -> str:
    path = os.fspath(path)
    slots = trainer.store.slots()
    arrays = {f"slot_{i:05d}": trainer.store.to_numpy(s) for i, s in enumerate(slots)}
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
        "device": trainer.device.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if trainer.threads:
        meta["knobs"]["threads"] = trainer.threads
    arrays["__meta__"] = np.frombuffer(json.dumps(meta, default=_json_default).encode("utf-8"), dtype=np.uint8)
    _atomic(path, lambda f: np.savez(f, **arrays))
    return path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o).__name__)


def _open(path: str | os.PathLike):
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path!r} is not readable ({type(e).__name__}: {e})") from None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    with _open(path) as z:
        return _meta(z, os.fspath(path))


def _meta(z, path: str) -> dict[str, Any]:
    if "__meta__" not in z.files:
        raise CheckpointError(f"{path!r} is not a kfac_compiler checkpoint (no __meta__ entry)")
    try:
        meta = json.loads(bytes(z["__meta__"]).decode("utf-8"))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path!r} has corrupt metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a kfac_compiler checkpoint")
    if int(meta.get("version", 0)) > VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format version {meta.get('version')}; this kfac_compiler reads <= {VERSION}")
    return meta


def restore_checkpoint(trainer: "Trainer", path: str | os.PathLike) -> None:
    """Load every state slot, the host counters, the damping and the RNG state into `trainer`."""
    path = os.fspath(path)
    with _open(path) as z:
        meta = _meta(z, path)
        mine = plan_fingerprint(trainer.plan)
        theirs = meta.get("plan", {})
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
        if meta.get("optimizer") != trainer.optimizer:
            raise CheckpointError(
                f"checkpoint {path!r} was written by optimizer {meta.get('optimizer')!r}, this trainer uses {trainer.optimizer!r}"
            )
        slots = meta["slots"]
        values = {}
        for i, s in enumerate(slots):
            key = f"slot_{i:05d}"
            if key not in z.files:
                raise CheckpointError(f"checkpoint {path!r} is missing state slot {s!r}")
            values[s] = z[key]
    missing = [s for s in trainer.store.slots() if s not in values]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} lacks state slot {missing[0]!r} that this trainer uses")
    for s, v in values.items():
        if s in trainer.store:
            shape, _ = trainer.store.spec(s)
            if tuple(v.shape) != tuple(shape):
                raise CheckpointError(f"checkpoint {path!r}: slot {s!r} has shape {list(v.shape)}, expected {list(shape)}")
            trainer.store.set(s, v)
        else:
            trainer.store.add(s, v)
    trainer.set_host_state(meta["host"])
    rng = np.random.default_rng()
    try:
        rng.bit_generator.state = meta["rng"]
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path!r}: unusable RNG state ({e})") from None
    trainer.rng = rng
