"""Data handling for the runtime: batch checks, host noise, datasets and batching for `train`.

* `prepare_batch` is the structural check (input names, ranks, static dims, batch sizes).
* `validate_dataset` is the thorough check (missing arrays, shapes, dtypes, NaN/Inf, and
  the loss's own target checks -> one-line DataError): the CLI runs it once on the whole
  dataset, `BatchChecker`
  (both checks, O(batch)) on every batch handed to the runtime API.
* `draw_noise` draws the `noise/<s>` inputs of the sampled estimators from the caller's
  numpy Generator, so that runs are reproducible and the generator state is checkpointable.
* `load_dataset` / `batch_indices` serve the `kfac-compiler train` command.
"""
from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import DataError, npz_reason, os_errors, range_problem
from kfac_compiler.losses import Loss
from kfac_compiler.npz_files import read_entry

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan

NOISE_EPS = np.float32(1e-7)

_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
_INT_TYPES = {TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
              TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}


def input_spec(vi: onnx.ValueInfoProto) -> tuple[list[Any], int]:
    """(dims, elem_type) of a graph input/output: dims are ints, dim_param strings or None."""
    t = vi.type.tensor_type
    dims: list[Any] = []
    for d in t.shape.dim:
        dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return dims, t.elem_type


def _static(d: Any) -> bool:
    return isinstance(d, int) and d > 0


def _fixed_batch_hint(shape: tuple, dims: list[Any]) -> str:
    """Where only a static batch dimension disagrees: the model was exported with a fixed batch
    (jax2onnx without a symbolic one, torch without dynamic axes), which is worth saying."""
    if len(shape) != len(dims) or not dims or not _static(dims[0]) or shape[0] == dims[0]:
        return ""
    if any(_static(d) and shape[i] != d for i, d in enumerate(dims) if i):
        return ""
    return (f" (its batch dimension is fixed at {dims[0]}, as it was exported: re-export it with a symbolic batch "
            "axis to train on other batch sizes and evaluate whole datasets)")


def prepare_batch(input_specs: Mapping[str, tuple[list[Any], int]], inputs: Any, targets: Any) -> dict[str, np.ndarray]:
    """{input name: array, ..., "targets": array} after structural checks (DataError)."""
    if not isinstance(inputs, Mapping):
        if len(input_specs) == 1:
            inputs = {next(iter(input_specs)): inputs}
        else:
            raise DataError(f"inputs must be a dict keyed by the model inputs {list(input_specs)}")
    data: dict[str, np.ndarray] = {}
    batch = None
    for name, (dims, _) in input_specs.items():
        if name not in inputs:
            raise DataError(f"input {name!r} is missing (the model's inputs: {list(input_specs)})")
        a = as_array(inputs[name], f"input {name!r}")
        if a.ndim != len(dims):
            raise DataError(f"input {name!r} has shape {list(a.shape)}; the model expects rank {len(dims)} ({dims})")
        for i, d in enumerate(dims):
            if _static(d) and a.shape[i] != d:
                raise DataError(f"input {name!r} has shape {list(a.shape)}; the model expects {dims}"
                                f"{_fixed_batch_hint(a.shape, dims)}")
        if a.ndim:
            if batch is None:
                batch = a.shape[0]
            elif a.shape[0] != batch:
                raise DataError(f"input {name!r} has batch size {a.shape[0]}, the other inputs {batch}")
        data[name] = a
    extra = [k for k in inputs if k not in input_specs]
    if extra:
        raise DataError(f"unknown input {extra[0]!r}; the model's inputs are {list(input_specs)}")
    y = as_array(targets, "targets")
    if y.ndim == 0 or (batch is not None and y.shape[0] != batch):
        raise DataError(f"targets have shape {list(y.shape)}; expected a batch of {batch} rows")
    if y.shape[0] == 0:
        raise DataError("empty batch")
    data[C.TARGETS] = y
    return data


class BatchChecker:
    """Checks every batch handed to the runtime API (structure, dtypes, label ranges, NaN,
    weights): a one-line DataError instead of an ONNX Runtime error deep inside a session.
    O(batch)."""

    def __init__(self, plan: Plan, loss: Loss | None = None) -> None:
        self.input_specs = {vi.name: input_spec(vi) for vi in plan.data_inputs}
        self.loss = loss if loss is not None else plan.loss.build()
        self.out_spec = output_spec(plan.model, plan.output)
        self.index_bounds = index_bounds(plan.model)

    def __call__(self, inputs: Any, targets: Any, weights: Any = None) -> dict[str, np.ndarray]:
        """The batch's arrays by graph input name; "example_weights" where the batch is
        weighted (weights given, or targets the loss masks: add_weights)."""
        data = prepare_batch(self.input_specs, inputs, self.loss.pack_targets(targets, "batch"))
        y = data.pop(C.TARGETS)
        conv, y = validate_dataset(self.input_specs, self.loss, data, y, self.out_spec, source="batch",
                                   index_bounds=self.index_bounds, packed=True)
        return add_weights({**conv, C.TARGETS: y}, weights, self.loss)


def check_weights(weights: Any, shape: tuple, what: str = "weights") -> np.ndarray:
    """Loss weights or a 0/1 mask as float32 of `shape` (a loss's weight_shape for the batch's
    targets): given with that shape or its leading axes ([N]: one per example), broadcast to
    it; numbers, finite, >= 0 (one-line DataError naming `what`)."""
    w = as_array(weights, what)
    if w.dtype == object or w.dtype.kind not in "biuf":
        raise DataError(f"{what}: got dtype {w.dtype}; expected numbers")
    if w.ndim == 0 or w.shape != tuple(shape[:w.ndim]):
        per = f"one weight per example ([{shape[0]}])"
        if len(shape) > 1:
            per += f" or per position ({list(shape)}, or its leading axes)"
        raise DataError(f"{what}: got shape {list(w.shape)}; expected {per}")
    if w.dtype.kind == "f" and not np.all(np.isfinite(w)):
        raise DataError(f"{what} must be finite and >= 0; got {int(np.sum(~np.isfinite(w)))} NaN/Inf value(s)")
    if w.size and np.min(w) < 0:
        raise DataError(f"{what} must be finite and >= 0; got a minimum of {np.min(w).item()}")
    check_range(w, np.float32, what)
    return np.broadcast_to(w.reshape(w.shape + (1,) * (len(shape) - w.ndim)), tuple(shape)).astype(np.float32)


def add_weights(data: dict[str, np.ndarray], weights: Any, loss: Loss) -> dict[str, np.ndarray]:
    """data plus "example_weights" [loss.weight_shape(targets)]: the given loss weights or 0/1
    mask (per example, or per position where the loss has positions), times the loss's own
    mask of the targets that count (Loss.mask_targets: ignore_index), which also makes the
    loss the mean over the positions that count: w m N / sum(m). Unweighted, unmasked: data
    as it was."""
    y, mask = loss.mask_targets(data[C.TARGETS])
    data[C.TARGETS] = y
    if weights is None and mask is None:
        return data
    shape = loss.weight_shape(tuple(y.shape))
    w = None if weights is None else check_weights(weights, shape)
    if mask is not None:
        kept = float(np.sum(mask))
        scaled = mask * np.float32(shape[0] / kept if kept else 0.0)  # all ignored: the batch weighs nothing
        w = scaled if w is None else w * scaled
    data[C.EXAMPLE_WEIGHTS] = np.ascontiguousarray(w, dtype=np.float32)
    return data


def draw_noise(rng: np.random.Generator, info: SubgraphInfo, data_inputs: list[str],
               targets: np.ndarray, name: str = "subgraph", shares: int = 1,
               into: Callable[[str, list[int]], np.ndarray | None] | None = None) -> dict[str, np.ndarray]:
    """The noise/<s> inputs of a subgraph (per info.noise), drawn from `rng`; with `shares`,
    the noise of that many such batches stacked along the batch axis (a data-parallel run's
    global batch, of which each rank keeps its share). `into(name, shape)`: a float32 array
    of that shape to draw into in place (the store's host buffer, no allocation or copy), or
    None to draw a new one; the values are the same either way.

    Uniform noise is clipped into [1e-7, 1 - 1e-7] (inverse-CDF sampling never sees 0 or 1);
    shapes as in noise_shape.
    """
    spec = info.noise
    names = sorted((n for n in data_inputs if C.is_noise(n)), key=C.noise_index)
    if not spec.count or not names:
        return {}
    shape = noise_shape(info, targets, name)
    shape[0] *= shares  # the batch (or sub-batch) axis
    out = {}
    for n in names:
        buf = into(n, shape) if into is not None else None
        if spec.distribution == "normal":
            out[n] = rng.standard_normal(dtype=np.float32, out=buf) if buf is not None else \
                rng.standard_normal(shape, dtype=np.float32)
        else:
            u = rng.random(dtype=np.float32, out=buf) if buf is not None else rng.random(shape, dtype=np.float32)
            # np.clip's bounds in place, as two ufuncs (np.clip's Python wrapper costs more than the
            # clipping on a step's noise: benchmarks/results/2026-11-29-host-overhead.md)
            np.maximum(u, NOISE_EPS, out=u)
            out[n] = np.minimum(u, np.float32(1) - NOISE_EPS, out=u)
    return out


def noise_shape(info: SubgraphInfo, targets: np.ndarray, name: str = "subgraph") -> list[int]:
    """The concrete shape of each noise/<s> input of a subgraph for a batch with `targets`:
    "N" (or the first dim) is the batch size; other symbolic dims are read off the targets."""
    shape = []
    for i, d in enumerate(info.noise.shape):
        if _static(d):
            shape.append(int(d))
        elif i == 0 or d == "N":
            shape.append(targets.shape[0])
        elif i < targets.ndim:
            shape.append(int(targets.shape[i]))
        else:
            raise DataError(f"subgraph {name!r}: cannot resolve noise dim {d!r} of {info.noise.shape}")
    return shape


# --------------------------------------------------------------------------- datasets
def output_spec(model: onnx.ModelProto, output: str) -> tuple[list[Any], int] | None:
    """The output's declared (dims, elem_type), or None where no declaration has a shape (a
    ValueInfo without one is of unknown rank, not a scalar: GroupNormalization's output, which
    onnx's shape inference leaves without one)."""
    for vi in list(model.graph.output) + list(model.graph.value_info):
        if vi.name == output and vi.type.tensor_type.HasField("shape"):
            return input_spec(vi)
    return None


def validate_dataset(input_specs: Mapping[str, tuple[list[Any], int]], loss: Loss,
                     inputs: Mapping[str, np.ndarray], targets: np.ndarray,
                     out_spec: tuple[list[Any], int] | None = None, source: str = "data",
                     index_bounds: Mapping[str, int] | None = None, packed: bool = False) -> tuple[dict, np.ndarray]:
    """Thorough checks before training; returns the arrays converted to the model's dtypes
    (the targets checked and converted by the loss). Values the conversion cannot hold (a
    float64 beyond float32's range) and token ids outside an embedding's rows
    (`index_bounds`, see index_bounds()) are DataErrors naming the array and the value.
    `targets` as the user gives them (Loss.pack_targets packs and checks several heads'),
    or with `packed` already through pack_targets (BatchChecker: not checked twice)."""
    missing = [n for n in input_specs if n not in inputs]
    if missing:
        raise DataError(f"{source}: no array named {missing[0]!r} (the model's inputs: {list(input_specs)}, "
                        f"plus {target_arrays_phrase(loss)})")
    conv: dict[str, np.ndarray] = {}
    n = None
    for name, (dims, et) in input_specs.items():
        a = convert_input(name, dims, et, inputs[name], source, (index_bounds or {}).get(name))
        if n is None:
            n = a.shape[0]
        elif a.shape[0] != n:
            raise DataError(f"{source}: array {name!r} has {a.shape[0]} rows, other inputs {n}")
        conv[name] = a
    if not n:
        raise DataError(f"{source}: the dataset is empty")
    y = np.asarray(targets if packed else loss.pack_targets(targets, source))
    if y.dtype == object or y.dtype.kind not in "biuf":
        raise DataError(f"{source}: 'targets' has dtype {y.dtype}; expected numbers")
    if y.ndim == 0 or y.shape[0] != n:
        raise DataError(f"{source}: 'targets' has shape {list(y.shape)}; expected {n} rows like the inputs")
    if y.dtype.kind == "f" and not np.all(np.isfinite(y)):
        raise DataError(f"{source}: 'targets' contains {int(np.sum(~np.isfinite(y)))} NaN/Inf value(s)")
    target_dtype = onnx.helper.tensor_dtype_to_np_dtype(loss.target_type())
    if y.dtype != target_dtype:
        check_range(y, target_dtype, f"{source}: 'targets'")
    return conv, loss.check_targets(y, out_spec[0] if out_spec else None, source)


def convert_input(name: str, dims: list[Any], et: int, value: Any, source: str, bound: int | None = None) -> np.ndarray:
    """`value` as model input `name` (dims, ONNX elem type `et`), checked: numbers, integers
    for an integer input, no NaN/Inf, the shape, values its dtype can hold, token ids in
    [0, bound) for an embedding's input; converted to the input's dtype."""
    a = as_array(value, f"{source}: array {name!r}")
    if a.dtype == object or a.dtype.kind not in "biuf":
        raise DataError(f"{source}: array {name!r} has dtype {a.dtype}; expected numbers")
    if et in _INT_TYPES and a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise DataError(f"{source}: array {name!r} must hold integers (the model input is integer-typed)")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        bad = int(np.sum(~np.isfinite(a)))
        raise DataError(f"{source}: array {name!r} contains {bad} NaN/Inf value(s)")
    if a.ndim != len(dims) or a.ndim == 0 or any(_static(d) and a.shape[i] != d for i, d in enumerate(dims)):
        raise DataError(f"{source}: array {name!r} has shape {list(a.shape)}; the model expects {dims}"
                        f"{_fixed_batch_hint(a.shape, dims)}")
    dtype = np.float32 if et in _FLOAT_TYPES else (np.int64 if et == TensorProto.INT64 else
                                                    onnx.helper.tensor_dtype_to_np_dtype(et))
    if a.dtype != dtype:  # already the input's dtype (every step's batch, mostly): nothing to lose
        check_range(a, dtype, f"{source}: array {name!r}")
    if bound is not None and a.size:
        ids = a[(a < 0) | (a >= bound)]
        if ids.size:
            raise DataError(f"{source}: array {name!r} holds token id {ids.flat[0].item()}; the embedding it indexes "
                            f"has {bound} rows (ids 0..{bound - 1})")
    return a.astype(dtype, copy=False)


def as_array(value: Any, what: str) -> np.ndarray:
    """np.asarray(value), one-line DataError where it is no rectangular array (ragged lists)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:
        raise DataError(f"{what} is not a rectangular array of numbers ({str(e).split('.')[0].strip()})") from None


def check_range(a: np.ndarray, dtype: Any, what: str) -> None:
    """DataError where converting `a` to `dtype` would not keep its values (errors.range_problem)."""
    problem = range_problem(a, dtype, what)
    if problem:
        raise DataError(problem)


def parameter_vectors(shapes: Mapping[str, Any], vectors: Any, what: str) -> dict[str, np.ndarray]:
    """float32 copies of one vector per parameter of `shapes` (a gradient, a direction),
    checked: exactly these parameters, numbers, each parameter's shape, within float32's range."""
    if not isinstance(vectors, Mapping):
        raise DataError(f"{what}: expected a dict {{parameter name: array}}, got {type(vectors).__name__}")
    unknown = [p for p in vectors if p not in shapes]
    if unknown:
        raise DataError(f"{what}: {unknown[0]!r} is not one of the parameters {list(shapes)}"[:300])
    missing = [p for p in shapes if p not in vectors]
    if missing:
        raise DataError(f"{what}: no vector for parameter {missing[0]!r}")
    out = {}
    for p, shape in shapes.items():
        a = as_array(vectors[p], f"{what}: the vector for {p!r}")
        if a.dtype.kind not in "biuf":
            raise DataError(f"{what}: the vector for {p!r} has dtype {a.dtype}; expected numbers")
        if tuple(a.shape) != tuple(shape):
            raise DataError(f"{what}: the vector for {p!r} has shape {list(a.shape)}; expected {list(shape)}")
        check_range(a, np.float32, f"{what}: the vector for {p!r}")
        out[p] = a.astype(np.float32)
    return out


# ops an embedding's token ids may pass on their way from the input to the Gather
_INDEX_PASSING = ("Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten")


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """{data input: rows} for the model's integer inputs that index an initializer with Gather
    (an embedding's token ids): ids must lie in [0, rows). The smallest table wins."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    data = {vi.name for vi in g.input if vi.name not in inits and vi.type.tensor_type.elem_type in _INT_TYPES}
    producer = {o: n for n in g.node for o in n.output if o}
    bounds: dict[str, int] = {}
    for node in g.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in inits:
            continue
        source = node.input[1]
        while source not in data and source in producer and producer[source].op_type in _INDEX_PASSING:
            source = producer[source].input[0]
        if source not in data:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        dims = inits[node.input[0]].dims
        if -len(dims) <= axis < len(dims):
            rows = int(dims[axis])
            bounds[source] = min(rows, bounds.get(source, rows))
    return bounds


def dataset_fingerprint(inputs: Mapping[str, np.ndarray], targets: np.ndarray) -> dict[str, Any]:
    """{"examples": rows, "sha256": digest of every array's name, dtype, shape and bytes}: what a
    checkpoint records of the data it was trained on, so that a resume on other data (whose
    batches would not be the ones an uninterrupted run draws) is caught."""
    import hashlib

    h = hashlib.sha256()
    for name, a in sorted({**inputs, C.TARGETS: targets}.items()):
        a = np.ascontiguousarray(a)
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    return {"examples": int(np.shape(targets)[0]), "sha256": h.hexdigest()}


def target_arrays_phrase(loss: Loss) -> str:
    """The data file's target arrays, for messages: 'targets', or one array per loss head."""
    arrays = loss.target_arrays()
    return "'targets'" if not arrays else ", ".join(map(repr, arrays))


def load_npz(path: str, targets: Mapping[str, str] | None = None) -> tuple[dict[str, np.ndarray], Any]:
    """(the input arrays, the targets) of an .npz file: the array "targets", or with several
    loss heads (`targets`: {array name: head}, Loss.target_arrays) a dict with one array per head."""
    if os.path.isdir(path):
        raise DataError(f"data file {path!r} is a directory; give an .npz file")
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist")
    try:
        with os_errors(DataError, "data file", path, writing=False):
            z = np.load(path, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise DataError(f"data file {path!r} is a single .npy array, not an .npz of named arrays")
            with z:
                arrays = {k: read_entry(z, k) for k in z.files}
    except (zipfile.BadZipFile, zlib.error, ValueError, EOFError) as e:  # not an npz, truncated, CRC, pickled
        raise DataError(f"data file {path!r} is not a readable .npz ({npz_reason(e)})") from None
    if targets is not None:
        missing = [t for t in targets if t not in arrays]
        if missing:
            raise DataError(f"data file {path!r} has no array named {missing[0]!r}, the targets of loss head "
                            f"{targets[missing[0]]!r} (it has {sorted(arrays)}; the heads' targets: {list(targets)})")
        return {k: v for k, v in arrays.items() if k not in targets}, {t: arrays[t] for t in targets}
    if "targets" not in arrays:  # the .npz file's key (docs/runtime.md, "kfac-compiler train")
        raise DataError(f"data file {path!r} has no array named 'targets' (it has {sorted(arrays)})")
    y = arrays.pop("targets")
    return arrays, y


def digits_for(input_specs: Mapping[str, tuple[list[Any], int]], loss: Loss,
               out_spec: tuple[list[Any], int] | None, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """scikit-learn's digits shaped for a user model with one float input of 64 values per
    example; the loss makes its targets from the pixels and labels (Loss.digits_targets)."""
    from kfac_compiler.models.data import digits

    if len(input_specs) != 1:
        raise DataError("--data digits needs a model with exactly one input; pass --data FILE.npz")
    name, (dims, et) = next(iter(input_specs.items()))
    rest = dims[1:]
    if et not in _FLOAT_TYPES or not all(_static(d) for d in rest) or int(np.prod(rest or [1])) != 64:
        raise DataError(f"--data digits gives 64 pixels per example; input {name!r} is {dims}; pass --data FILE.npz")
    x, labels = digits(None, seed)
    return {name: x.reshape([-1, *rest])}, loss.digits_targets(x, labels, out_spec[0] if out_spec else None)


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Example indices of batch `step`: epochs of a seeded permutation, last partial batch
    dropped (fixed shapes). A pure function of (n, batch_size, step, seed), so a resumed
    run sees exactly the batches an uninterrupted one would."""
    bs = min(int(batch_size), n)
    per_epoch = n // bs
    epoch, j = divmod(int(step), per_epoch)
    perm = np.random.default_rng([int(seed), epoch]).permutation(n)
    return perm[j * bs:(j + 1) * bs]
