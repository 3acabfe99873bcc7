"""Seeded mutations of checkpoints, plans and data files, and what each must end in.

A mutated file must either load with a correct result or fail with a KfacError whose message is
one line, never another exception:

* checkpoint byte flips and truncations: restored bit-identical to the original, or refused;
* checkpoint metadata and slot edits: Trainer.load_checkpoint then one step runs with a finite
  loss, or a KfacError comes (at load or at the step);
* plan.json edits, plan.json and model.onnx flips and truncations: load_plan, `inspect`'s
  renderings and (unless `quick`) one training step run, or a KfacError comes;
* fuzzed .npz data files: `train --data` exits 2 with one line naming the file, or (for
  mutations that are valid data) trains.

Every mutation is a pure function of (kind, index, seed): the same list on every run.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from faults.harness import ASSETS, Judge, Verdict, call, run_cli

KINDS = ("checkpoint byte flips", "checkpoint truncations", "checkpoint metadata edits", "checkpoint slot edits",
         "plan.json edits", "plan.json flips and truncations", "plan model.onnx flips and truncations",
         "data files")


@dataclass(frozen=True)
class Mutation:
    kind: str
    label: str
    make: Callable[[str], str]   # writes the mutated file(s) into a folder, returns the path to load
    expect: str = "either"       # data files: "error" (must be refused) or "either"


# --------------------------------------------------------------------------- bases
_BASE: dict[str, Any] = {}


def base_checkpoint() -> str:
    """A K-FAC checkpoint of the asset plan after 2 steps (API, batch 32, seed 0)."""
    if "ckpt" not in _BASE:
        t = new_trainer()
        x, y = batch()
        for _ in range(2):
            t.step({"input": x}, y)
        path = os.path.join(ASSETS._root(), "fuzz-base.ckpt")
        t.save_checkpoint(path)
        _BASE["ckpt"] = path
        _BASE["state"] = {"trainer": t, "original": (t.host_state(), t.state())}
    return _BASE["ckpt"]


def plan() -> Any:
    if "plan" not in _BASE:
        from kfac_compiler.plan import load_plan

        _BASE["plan"] = load_plan(ASSETS.plan())
    return _BASE["plan"]


def new_trainer(p: Any = None) -> Any:
    from kfac_compiler.runtime import Trainer

    return Trainer(p if p is not None else plan(), batch_size=32, seed=0, threads=1)


def batch(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    with np.load(ASSETS.data()) as z:
        return z["input"][:n].copy(), z["targets"][:n].copy()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _flip(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    pos = int(rng.integers(len(data)))
    bit = int(rng.integers(8))
    out = bytearray(data)
    out[pos] ^= 1 << bit
    return bytes(out), f"flip bit {bit} of byte {pos}"


# --------------------------------------------------------------------------- checkpoint mutations
def checkpoint_mutations(kind: str, n: int, seed: int = 0) -> list[Mutation]:
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    out: list[Mutation] = []
    if kind == "checkpoint byte flips":
        for _ in range(n):
            data, label = _flip(_read(base_checkpoint()), rng)
            out.append(Mutation(kind, label, lambda d, data=data: _write(os.path.join(d, "m.ckpt"), data)))
    elif kind == "checkpoint truncations":
        size = os.path.getsize(base_checkpoint())
        for length in sorted({int(v) for v in rng.integers(size, size=n)}):
            out.append(Mutation(kind, f"truncate to {length} of {size} bytes",
                                lambda d, k=length: _write(os.path.join(d, "m.ckpt"), _read(base_checkpoint())[:k])))
    elif kind == "checkpoint metadata edits":
        edits = [(path, op) for path in META_PATHS for op in OPS]
        for i in _pick(rng, len(edits), n):
            path, op = edits[i]
            out.append(Mutation(kind, f"{op} at {path}", lambda d, path=path, op=op: _edit_meta(d, path, op)))
    elif kind == "checkpoint slot edits":
        for label in SLOT_EDITS[: n or None]:
            out.append(Mutation(kind, label, lambda d, label=label: _edit_slots(d, label)))
    return out


def _pick(rng: np.random.Generator, total: int, n: int) -> list[int]:
    """n distinct indices out of range(total) (all of them when n >= total), in order."""
    return list(range(total)) if n >= total else sorted(int(i) for i in rng.choice(total, size=n, replace=False))


META_PATHS = ("format", "version", "plan", "plan.fingerprint", "optimizer", "knobs", "knobs.damping",
              "knobs.inv_update_period", "knobs.adapt_damping", "knobs.learning_rate", "seed", "host",
              "host.step_count", "host.applied_steps", "host.damping", "host.ema_weight", "host.burn_in_count",
              "host.inverses_ready", "rng", "rng.state", "rng.bit_generator", "slots", "slots.0", "device")
OPS = ("delete", "null", "string", "negative", "huge", "nan", "list", "dict", "true")
_VALUES = {"null": None, "string": "x", "negative": -1, "huge": 1e308, "nan": float("nan"), "list": [], "dict": {},
           "true": True}


def _set(doc: Any, path: str, op: str) -> None:
    """Apply `op` at the dotted `path` of a JSON document (list items by index)."""
    keys = path.split(".")
    node = doc
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last: Any = int(keys[-1]) if isinstance(node, list) else keys[-1]
    if isinstance(node, dict) and last not in node:
        return
    if op == "delete":
        del node[last]
    else:
        node[last] = _VALUES[op]


def _edit_meta(d: str, path: str, op: str) -> str:
    from faults.cases import edit_checkpoint_meta

    return edit_checkpoint_meta(base_checkpoint(), os.path.join(d, "m.ckpt"), lambda m: _set(m, path, op))


SLOT_EDITS = ("a parameter of the wrong shape", "a parameter as float64", "a parameter as int32",
              "a NaN in a parameter", "an inf in a factor", "a parameter missing", "an extra entry",
              "a 0-d parameter", "a pickled object array", "no __meta__ entry", "__meta__ not UTF-8")


def _edit_slots(d: str, label: str) -> str:
    with np.load(base_checkpoint(), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(bytes(arrays["__meta__"]).decode("utf-8"))
    slots = meta["slots"]
    p0 = f"slot_{slots.index(plan().trainable[0]):05d}"
    factor = next(f"slot_{i:05d}" for i, s in enumerate(slots) if s.startswith("factor/"))
    if label == "a parameter of the wrong shape":
        arrays[p0] = arrays[p0][:, :-1]
    elif label == "a parameter as float64":
        arrays[p0] = arrays[p0].astype(np.float64)
    elif label == "a parameter as int32":
        arrays[p0] = arrays[p0].astype(np.int32)
    elif label == "a NaN in a parameter":
        arrays[p0] = arrays[p0].copy()
        arrays[p0].flat[3] = np.nan
    elif label == "an inf in a factor":
        arrays[factor] = arrays[factor].copy()
        arrays[factor].flat[0] = np.inf
    elif label == "a parameter missing":
        del arrays[p0]
    elif label == "an extra entry":
        arrays["slot_99999"] = np.zeros(3, np.float32)
    elif label == "a 0-d parameter":
        arrays[p0] = np.float32(1.0)
    elif label == "a pickled object array":
        arrays[p0] = np.array([{"a": 1}], dtype=object)
    elif label == "no __meta__ entry":
        del arrays["__meta__"]
    elif label == "__meta__ not UTF-8":
        arrays["__meta__"] = np.frombuffer(b"\xff\xfe" + bytes(arrays["__meta__"]), dtype=np.uint8)
    path = os.path.join(d, "m.ckpt")
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def judge_checkpoint(m: Mutation, d: str, state: dict[str, Any]) -> Verdict:
    """Flips and truncations: restore() into `state["trainer"]` and compare with the original;
    edits: Trainer.load_checkpoint then a step."""
    from kfac_compiler.runtime import Trainer

    j = Judge()
    path = m.make(d)
    if m.kind in ("checkpoint byte flips", "checkpoint truncations"):
        t = state["trainer"]
        _, exc = call(lambda: t.restore(path))
        if exc is not None:
            j.api_error(exc)
        else:
            want_host, want_slots = state["original"]
            if t.host_state() != want_host:
                j.problem("silent", "loaded with another host state")
            bad = [s for s, v in t.state().items() if not np.array_equal(v, want_slots[s])]
            if bad:
                j.problem("silent", f"loaded with slot {bad[0]!r} changed")
        return j.verdict()
    t, exc = call(lambda: Trainer.load_checkpoint(path, plan(), batch_size=32, threads=1))
    if exc is None:
        x, y = batch()
        metrics, exc = call(lambda: t.step({"input": x}, y))
        if exc is None:
            j.check(bool(np.isfinite(metrics["loss"])), "silent", f"loaded, then a step gave loss {metrics['loss']}")
            return j.verdict()
    j.api_error(exc)
    return j.verdict()


def checkpoint_state() -> dict[str, Any]:
    """The trainer that wrote the base checkpoint, and its state then (host, slots) as the truth
    (a successful restore() brings every slot, the host state and the generator back)."""
    base_checkpoint()
    return _BASE["state"]


# --------------------------------------------------------------------------- plan mutations
def _paths(doc: Any, prefix: str = "") -> Iterator[str]:
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        p = f"{prefix}.{k}" if prefix else str(k)
        yield p
        yield from _paths(v, p)


def plan_mutations(kind: str, n: int, seed: int = 0) -> list[Mutation]:
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    out: list[Mutation] = []
    if kind == "plan.json edits":
        with open(os.path.join(ASSETS.plan(), "plan.json"), encoding="utf-8") as f:
            doc = json.load(f)
        groups: dict[str, list[str]] = {}
        for p in _paths(doc):
            groups.setdefault(p.split(".")[0], []).append(p)
        tops = sorted(groups)
        for _ in range(n):
            top = tops[int(rng.integers(len(tops)))]
            path = groups[top][int(rng.integers(len(groups[top])))]
            op = OPS[int(rng.integers(len(OPS)))]
            out.append(Mutation(kind, f"{op} at {path}", lambda d, path=path, op=op: _edit_plan(d, path, op)))
    else:
        name = "plan.json" if kind == "plan.json flips and truncations" else "model.onnx"
        data = _read(os.path.join(ASSETS.plan(), name))
        for i in range(n):
            if i % 4 == 3:
                k = int(rng.integers(len(data)))
                new, label = data[:k], f"truncate {name} to {k} of {len(data)} bytes"
            else:
                new, label = _flip(data, rng)
                label = f"{name}: {label}"
            out.append(Mutation(kind, label, lambda d, name=name, new=new: _plan_with(d, name, new)))
    return out


def _plan_copy(d: str) -> str:
    dest = os.path.join(d, "myplan")
    shutil.copytree(ASSETS.plan(), dest)
    return dest


def _edit_plan(d: str, path: str, op: str) -> str:
    dest = _plan_copy(d)
    pj = os.path.join(dest, "plan.json")
    with open(pj, encoding="utf-8") as f:
        doc = json.load(f)
    _set(doc, path, op)
    with open(pj, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return dest


def _plan_with(d: str, name: str, data: bytes) -> str:
    dest = _plan_copy(d)
    _write(os.path.join(dest, name), data)
    return dest


def judge_plan(m: Mutation, d: str, quick: bool) -> Verdict:
    """load_plan, both renderings of `inspect` and (unless quick) a training step."""
    from kfac_compiler.plan import load_plan
    from kfac_compiler.report import render

    j = Judge()
    path = m.make(d)
    p, exc = call(lambda: load_plan(path))
    steps: list[Callable[[], Any]] = [lambda: render(p, "table"), lambda: render(p, "json")]
    if not quick:
        x, y = batch()
        steps.append(lambda: new_trainer(p).step({"input": x}, y))
    for step in steps if exc is None else []:
        _, exc = call(step)
        if exc is not None:
            break
    if exc is not None:
        j.api_error(exc)
    return j.verdict()


# --------------------------------------------------------------------------- data files
def data_mutations() -> list[Mutation]:
    """Fuzzed .npz files for `train --data` (the zoo's mlp_classifier: input [N,64] float,
    targets int labels 0..9)."""
    def base() -> tuple[np.ndarray, np.ndarray]:
        with np.load(ASSETS.data()) as z:
            return z["input"].copy(), z["targets"].copy()

    def npz(**arrays: Any) -> Callable[[str], str]:
        def make(d: str) -> str:
            path = os.path.join(d, "fuzzed.npz")
            np.savez(path, **arrays)
            return path
        return make

    def raw(data: bytes) -> Callable[[str], str]:
        return lambda d: _write(os.path.join(d, "fuzzed.npz"), data)

    x, y = base()
    n = len(y)
    out: list[tuple[str, Callable[[str], str], str]] = []

    def with_x(label: str, xx: Any, expect: str) -> None:
        out.append((label, npz(input=xx, targets=y), expect))

    def with_y(label: str, yy: Any, expect: str) -> None:
        out.append((label, npz(input=x, targets=yy), expect))

    with_x("input float16", x.astype(np.float16), "either")
    with_x("input float64", x.astype(np.float64), "either")
    with_x("input int8", x.astype(np.int8), "either")
    with_x("input bool", x > 8, "either")
    with_x("input Fortran order", np.asfortranarray(x), "either")
    with_x("input complex64", x.astype(np.complex64), "error")
    with_x("input strings", x.astype(str), "error")
    with_x("input datetime64", x.astype("datetime64[s]"), "error")
    with_x("input [N,63]", x[:, :63], "error")
    with_x("input [N,64,1]", x[:, :, None], "error")
    with_x("input [N]", x[:, 0], "error")
    with_x("input flattened", x.reshape(-1), "error")
    with_x("input 0-d", np.float32(1), "error")
    for label, value in (("a NaN", np.nan), ("an inf", np.inf), ("-inf", -np.inf)):
        xx = x.copy()
        xx[n // 2, 7] = value
        with_x(f"input with {label}", xx, "error")
    for label, value in (("1e39", 1e39), ("-1e39", -1e39), ("1e300", 1e300)):
        xx = x.astype(np.float64)
        xx[n // 3, 1] = value
        with_x(f"float64 input with {label}", xx, "error")
    xx = x.copy()
    xx[3, :] = 3e38
    with_x("input row of 3e38 (finite float32)", xx, "either")
    for label, yy in (("-1", -1), ("10", 10), ("2**40", 2 ** 40)):
        bad = y.copy()
        bad[n // 4] = yy
        with_y(f"a label {label}", bad, "error")
    with_y("labels float 1.5", np.where(np.arange(n) == 5, 1.5, y.astype(np.float64)), "error")
    with_y("labels float64 whole", y.astype(np.float64), "either")
    with_y("labels NaN", np.where(np.arange(n) == 5, np.nan, y.astype(np.float64)), "error")
    with_y("labels uint8", y.astype(np.uint8), "either")
    with_y("labels [N,1]", y[:, None], "either")
    with_y("labels strings", y.astype(str), "error")
    with_y("labels one row short", y[:-1], "error")
    with_y("labels 0-d", np.int64(3), "error")
    out.append(("no rows", npz(input=x[:0], targets=y[:0]), "error"))
    out.append(("no targets", npz(input=x), "error"))
    out.append(("no input", npz(targets=y), "error"))
    out.append(("an extra array", npz(input=x, targets=y, extra=y), "error"))
    out.append(("garbage bytes", raw(bytes(np.random.default_rng(7).integers(0, 256, 5000, dtype=np.uint8))),
                "error"))
    out.append(("an empty file", raw(b""), "error"))

    def truncated(d: str) -> str:
        path = npz(input=x, targets=y)(d)
        size = os.path.getsize(path)
        os.truncate(path, size // 2)
        return path

    def npy(d: str) -> str:
        path = os.path.join(d, "fuzzed.npz")
        with open(path, "wb") as f:
            np.save(f, x)
        return path

    def bad_member(d: str) -> str:
        path = os.path.join(d, "fuzzed.npz")
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("input.npy", b"\x93NUMPY garbage")
            z.writestr("targets.npy", b"not an array")
        return path

    def directory(d: str) -> str:
        path = os.path.join(d, "fuzzed.npz")
        os.makedirs(path)
        return path

    out += [("truncated in half", truncated, "error"), ("a .npy file named .npz", npy, "error"),
            ("a zip of garbage members", bad_member, "error"), ("a folder named .npz", directory, "error")]
    return [Mutation("data files", label, make, expect) for label, make, expect in out]


def judge_data(m: Mutation, d: str) -> Verdict:
    j = Judge()
    path = m.make(d)
    r = run_cli(["train", "--data", path, "--steps", "1", "-q"])
    if m.expect == "error" or (r.code != 0 and not r.crashed and r.code != 1):
        j.error_line(r, ["fuzzed.npz"])
    elif r.code == 1 and not r.crashed:   # a diverged run: one line, exit 1
        j.error_line(r, ["loss"], code=1)
    else:
        j.success(r)
    return j.verdict()


# --------------------------------------------------------------------------- running
def mutations(kind: str, n: int, seed: int = 0) -> list[Mutation]:
    if kind.startswith("checkpoint"):
        return checkpoint_mutations(kind, n, seed)
    if kind.startswith("plan"):
        return plan_mutations(kind, n, seed)
    every = data_mutations()
    return [every[i] for i in _pick(np.random.default_rng([seed, KINDS.index(kind)]), len(every), n)]


def fuzz(kind: str, n: int, seed: int = 0, quick: bool = False) -> list[tuple[Mutation, Verdict]]:
    """Every mutation of `kind` (n of them, from `seed`) with its verdict, each in a fresh folder."""
    state = checkpoint_state() if kind in ("checkpoint byte flips", "checkpoint truncations") else {}
    out = []
    for m in mutations(kind, n, seed):
        d = tempfile.mkdtemp(prefix="kfac-fuzz-")
        try:
            if kind.startswith("checkpoint"):
                v = judge_checkpoint(m, d, state)
            elif kind.startswith("plan"):
                v = judge_plan(m, d, quick)
            else:
                v = judge_data(m, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        out.append((m, v))
    return out


def fuzz_census(n: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """(kind, mutations, clean) rows for the census."""
    rows = []
    for kind in KINDS:
        results = fuzz(kind, n, seed)
        rows.append((kind, len(results), sum(v.clean for _, v in results)))
    return rows
