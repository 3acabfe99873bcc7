"""Several loss heads with coefficients (TF K-FAC's several registered predictive
distributions): the objective is sum_h c_h * (1/N sum_n l_h,n), its Fisher (and GGN) the
coefficient-weighted sum sum_h c_h J_h^T F_h J_h.

The front end (passes/heads.py) appends ONE tensor to the graph, the heads' outputs
flattened to [N, d_h] and concatenated on axis 1, so that every consumer of "the model
output" (gradients, estimator seeds, the quadratic model's products, noise, data-parallel
stages) works unchanged. `MultiHead` is the loss on that tensor: it slices it per head,
reshapes each slice to the head's output shape and applies the head's own loss, scaled by
c_h (its Fisher products by c_h, the square roots and sampled gradients by sqrt(c_h); the
Fisher is block diagonal over heads). The targets are packed the same way on the host: one
float32 [N, sum_h k_h] array (class labels are exact in float32 below 2^24); the runtime API
takes a dict {targets name: array}. Sampling draws each head's own uniform noise (its
loss's noise_shape: one value per output column, or per categorical row for softmax
cross-entropy from 1,024 classes), packed the same way; a head whose loss samples with normal noise gets E
extra columns at the end and turns the pair into a normal by Box-Muller in the graph.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError, DataError, range_problem
from kfac_compiler.losses.base import Loss, LossOption, loss_class, register_loss

MULTI_HEAD = "multi_head"
HEAD_KEYS = ("output", "loss", "coefficient", "targets", "options")
EXACT_LABELS = 2 ** 24  # integers float32 holds exactly


@dataclass(frozen=True)
class Head:
    """One loss head: the loss kind applied to `output`, weighted by `coefficient`, with its
    targets named `targets` (the data file's array and the runtime's dict key; default: the
    output's name) and the loss kind's own `options` (e.g. squared_error's variance)."""

    output: str
    loss: str
    coefficient: float = 1.0
    targets: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


def parse_heads(value: Any, where: str = "heads") -> list[dict[str, Any]]:
    """Heads given as Head objects, (output, loss[, coefficient[, targets]]) tuples or dicts,
    checked and normalised to JSON-able dicts (a "shape" entry, set by the front end, is kept)."""
    if isinstance(value, (str, bytes, Mapping, Head)) or not isinstance(value, Sequence):
        raise ConfigError(f"{where}: expected a list of heads (output, loss kind, coefficient, targets name), "
                          f"got {type(value).__name__}")
    if not value:
        raise ConfigError(f"{where}: no heads given; name at least one (output, loss kind, coefficient, targets name)")
    heads, seen = [], {}
    for i, item in enumerate(value):
        head = _one_head(item, f"{where}[{i}]")
        if head["targets"] in seen:
            raise ConfigError(f"{where}[{i}]: targets name {head['targets']!r} is already head "
                              f"{seen[head['targets']]}'s; give each head its own targets name")
        seen[head["targets"]] = i
        heads.append(head)
    return heads


def _one_head(item: Any, where: str) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if isinstance(item, Head):
        doc = {k: getattr(item, k) for k in HEAD_KEYS}
    elif isinstance(item, Mapping):
        unknown = [k for k in item if k not in HEAD_KEYS + ("shape",)]
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (a head has {', '.join(HEAD_KEYS)})")
        doc = dict(item)
        if "shape" in item:
            extra["shape"] = [int(d) for d in item["shape"]]
    elif isinstance(item, (tuple, list)) and 2 <= len(item) <= 4:
        doc = dict(zip(("output", "loss", "coefficient", "targets"), item))
    else:
        raise ConfigError(f"{where}: expected a Head, a dict or a tuple (output, loss kind[, coefficient[, targets "
                          f"name]]), got {item!r}"[:300])
    output, kind = doc.get("output"), doc.get("loss")
    if not isinstance(output, str) or not output:
        raise ConfigError(f"{where}: output must be a tensor name, got {output!r}")
    if not isinstance(kind, str):
        raise ConfigError(f"{where} ({output}): loss must be a loss kind name, got {kind!r}")
    if kind == MULTI_HEAD:
        raise ConfigError(f"{where} ({output}): a head's loss cannot be {MULTI_HEAD!r}; name the loss kind of the head")
    if kind not in _kinds():
        raise ConfigError(f"{where} ({output}): unknown loss {kind!r}; choose one of {', '.join(_kinds())}")
    cls = loss_class(kind)
    coeff = doc.get("coefficient", 1.0)
    coeff = 1.0 if coeff is None else coeff
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not math.isfinite(coeff) or coeff <= 0:
        raise ConfigError(f"{where} ({output}): coefficient must be a finite number > 0, got {coeff!r}")
    targets = doc.get("targets") or output
    if not isinstance(targets, str):
        raise ConfigError(f"{where} ({output}): targets must be a name, got {targets!r}")
    options = doc.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where} ({output}): options must be a table {{option = value}}, got {options!r}")
    options = cls.resolve_options(dict(options), where=f"{where} ({output}): ")
    return {"output": output, "loss": kind, "coefficient": float(coeff), "targets": targets,
            "options": options, **extra}


def _kinds() -> tuple[str, ...]:
    from kfac_compiler.losses.base import LOSSES

    return tuple(k for k in LOSSES if k != MULTI_HEAD)


def _checked_heads(value: Any) -> list[dict[str, Any]]:
    heads = parse_heads(value, "loss multi_head: heads")
    for h in heads:
        if "shape" not in h:
            raise ConfigError(f"loss multi_head: head {h['output']!r} has no shape; compile the model with heads=...")
    return heads


@register_loss
class MultiHead(Loss):
    """Several heads on one concatenated output (see the module docstring)."""

    kind = MULTI_HEAD
    description = "several heads with coefficients, from compile(heads=...), --head or the config's [[heads]]"
    options = (LossOption("heads", (), "the heads: output, loss, coefficient, targets, options, shape",
                          _checked_heads),)
    noise = "uniform"  # normal heads: Box-Muller in the graph
    user_named = False  # the heads name it (--head, [[heads]], compile(heads=...))
    heads: list[dict[str, Any]]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.parts = [loss_class(h["loss"])(**h["options"]) for h in self.heads]
        self.coefficients = [float(h["coefficient"]) for h in self.heads]
        self.shapes = [tuple(h["shape"]) for h in self.heads]
        self.widths = [int(np.prod(s)) for s in self.shapes]
        self.target_rests = [tuple(p.target_shape((1, *s)))[1:] for p, s in zip(self.parts, self.shapes)]
        self.target_widths = [int(np.prod(r)) for r in self.target_rests]
        self.offsets = np.concatenate([[0], np.cumsum(self.widths)]).astype(int).tolist()
        self.target_offsets = np.concatenate([[0], np.cumsum(self.target_widths)]).astype(int).tolist()
        self.width = self.offsets[-1]
        for h, p in zip(self.heads, self.parts):
            if p.masks_targets:
                raise ConfigError(f"head {h['output']!r}: {p.kind} cannot mask targets in a plan with several heads "
                                  f"(its weights are per example: {h['options']}); give the head per-example "
                                  "weights, or use the loss as the plan's only loss")
        # the packed noise's layout: each head's own noise (its noise_shape per example), then
        # a second uniform per output entry for each normal head (Box-Muller)
        self.noise_rests = []
        for h, p, shape in zip(self.heads, self.parts, self.shapes):
            if p.noise not in ("uniform", "normal"):
                raise ConfigError(f"head {h['output']!r}: loss {p.kind!r} samples with {p.noise!r} noise; a head can "
                                  "only use uniform or normal noise")
            own = tuple(p.noise_shape((1, *shape)))
            if p.noise == "normal" and own != (1, *shape):
                raise ConfigError(f"head {h['output']!r}: loss {p.kind!r} draws noise of shape {list(own[1:])} per "
                                  f"example for an output of shape {list(shape)}; a head's normal noise must have "
                                  "its output's shape (one value per output entry): use it as the plan's only loss")
            self.noise_rests.append(own[1:])
        widths = [int(np.prod(r)) for r in self.noise_rests]
        self.noise_offsets = np.concatenate([[0], np.cumsum(widths)]).astype(int).tolist()
        normal = [i for i, p in enumerate(self.parts) if p.noise == "normal"]
        self.normal_offsets = {}
        extra = self.noise_offsets[-1]
        for i in normal:
            self.normal_offsets[i] = extra
            extra += self.widths[i]
        self.noise_width = extra
        bounds = [p.lower_bound for p in self.parts]
        self.lower_bound = None if None in bounds else float(sum(c * lb for c, lb in zip(self.coefficients, bounds)))
        names = []
        for h, p in zip(self.heads, self.parts):
            names += [f"loss_{h['targets']}"] + [f"{m}_{h['targets']}" for m in p.metrics]
        self.metrics = tuple(names)

    def summary(self) -> str:
        return f"{self.kind} (" + "; ".join(
            f"{h['coefficient']:g} x {h['loss']} on {h['output']} {list(h['shape'])}, targets {h['targets']!r}"
            for h in self.heads) + ")"

    # -- the heads' names
    def target_names(self) -> list[str]:
        return [h["targets"] for h in self.heads]

    def target_arrays(self) -> dict[str, str]:
        return {h["targets"]: h["output"] for h in self.heads}

    # -- targets
    def target_type(self) -> int:
        return TensorProto.FLOAT

    def target_shape(self, output_shape: tuple) -> tuple:
        return (output_shape[0], self.target_offsets[-1])

    def target_dtype(self, output_dtype: str) -> str:
        return "float32"

    def noise_shape(self, output_shape: tuple) -> tuple:
        return (output_shape[0], self.noise_width)

    def pack_targets(self, targets: Any, source: str) -> Any:
        """{targets name: array} -> the float32 [N, sum_h k_h] array the graphs take, each
        head's array checked by its loss. An already packed array (the CLI's batches) is
        unpacked and checked per head the same way: it skips no head's NaN, shape or label
        check."""
        names = self.target_names()
        if isinstance(targets, np.ndarray) and targets.ndim == 2 and targets.dtype == np.float32 \
                and targets.shape[1] == self.target_offsets[-1]:
            targets = dict(zip(names, self._target_views(targets)))
        if not isinstance(targets, Mapping):
            raise DataError(f"{source}: targets must be a dict {{targets name: array}} with one array per head "
                            f"({', '.join(map(repr, names))}), got {type(targets).__name__}")
        unknown = [k for k in targets if k not in names]
        if unknown:
            raise DataError(f"{source}: {unknown[0]!r} is not a head's targets name ({', '.join(map(repr, names))})")
        cols, rows = [], None
        for h, part, shape in zip(self.heads, self.parts, self.shapes):
            name, what = h["targets"], f"{source}: array {h['targets']!r} (head {h['output']!r})"
            if name not in targets:
                raise DataError(f"{source}: no array {name!r} for head {h['output']!r} ({part.kind}); give one array "
                                f"per head: {', '.join(map(repr, names))}")
            y = np.asarray(targets[name])
            if y.dtype == object or y.dtype.kind not in "biuf":
                raise DataError(f"{what} has dtype {y.dtype}; expected numbers")
            if y.ndim == 0 or (rows is not None and y.shape[0] != rows):
                raise DataError(f"{what} has shape {list(y.shape)}; expected {rows} rows like the other heads")
            rows = y.shape[0]
            if y.dtype.kind == "f" and not np.all(np.isfinite(y)):
                raise DataError(f"{what} contains {int(np.sum(~np.isfinite(y)))} NaN/Inf value(s)")
            problem = range_problem(y, np.float32, what)  # packed as float32: a float64 beyond it would be inf
            if problem:
                raise DataError(problem)
            y = part.check_targets(y, ["N", *shape], what)
            if y.dtype.kind in "iu" and y.size and np.max(np.abs(y)) >= EXACT_LABELS:
                raise DataError(f"{what} holds {int(np.max(np.abs(y)))}; heads pack labels as float32, exact below 2^24")
            cols.append(y.reshape(rows, -1).astype(np.float32))
        return np.concatenate(cols, axis=1)

    def check_targets(self, y: np.ndarray, output_dims: list[Any] | None, source: str) -> np.ndarray:
        if y.ndim != 2 or y.shape[1] != self.target_offsets[-1]:
            raise DataError(f"{source}: targets have shape {list(y.shape)}; a {len(self.heads)}-head plan takes a dict "
                            f"{{targets name: array}} ({', '.join(map(repr, self.target_names()))})")
        return y.astype(np.float32)

    def digits_targets(self, pixels: np.ndarray, labels: np.ndarray, output_dims: list[Any] | None) -> np.ndarray:
        raise DataError(f"--data digits: a plan with several heads needs --data FILE.npz with one array per head "
                        f"({', '.join(map(repr, self.target_names()))})")

    # -- evaluation
    def _target_views(self, y: np.ndarray) -> list[np.ndarray]:
        """Per head: its slice of packed targets [N, *target rest], still float32 (unchecked)."""
        return [y[:, self.target_offsets[i]:self.target_offsets[i + 1]].reshape(len(y), *rest)
                for i, rest in enumerate(self.target_rests)]

    def split(self, z: np.ndarray, y: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per head: (its output [N, *shape], its targets in the head's dtype) from the packed arrays."""
        ys = self._target_views(y) if y is not None else [None] * len(self.parts)
        out = []
        for i, (part, shape, yh) in enumerate(zip(self.parts, self.shapes, ys)):
            zh = z[:, self.offsets[i]:self.offsets[i + 1]].reshape(len(z), *shape)
            if yh is not None:
                yh = yh.astype(onnx.helper.tensor_dtype_to_np_dtype(part.target_type()))
            out.append((zh, yh))
        return out

    def output_names(self, output: str) -> list[str]:
        return [h["output"] for h in self.heads]

    def prediction(self, outputs: np.ndarray) -> dict[str, np.ndarray]:
        """{head output: its array [N, *shape]}."""
        return {h["output"]: zh for h, (zh, _) in zip(self.heads, self.split(outputs))}

    def metric_totals(self, outputs: np.ndarray, targets: np.ndarray,
                      weights: np.ndarray | None = None) -> dict[str, tuple[float, float]]:
        """Each head's own mean loss (loss_<targets name>, without its coefficient) and metrics;
        `weights` [N] weight each example's loss (the mean stays over the N examples, like
        the loss) and each head's metrics."""
        totals: dict[str, tuple[float, float]] = {}
        for h, part, (zh, yh) in zip(self.heads, self.parts, self.split(outputs, targets)):
            per = part.np_per_example(zh.astype(np.float64), yh)
            if weights is not None:
                per = per * np.asarray(weights, np.float64)
            totals[f"loss_{h['targets']}"] = (float(np.sum(per)), len(zh))
            if weights is None:
                own = part.metric_totals(zh, yh)
            else:
                rank = len(part.weight_shape(yh.shape))
                own = part.metric_totals(zh, yh, np.asarray(weights).reshape(-1, *[1] * (rank - 1)))
            for name, value in own.items():
                totals[f"{name}_{h['targets']}"] = value
        return totals

    # -- ONNX emitters
    def _slice(self, b: GraphBuilder, x: str, start: int, end: int, rest: tuple) -> str:
        part = b.op("Slice", [x, b.ints([start]), b.ints([end]), b.ints([1])])
        return b.reshape(part, [-1, *rest]) if tuple(rest) != (end - start,) else part

    def _z(self, b: GraphBuilder, z: str, i: int) -> str:
        return self._slice(b, z, self.offsets[i], self.offsets[i + 1], self.shapes[i])

    def _y(self, b: GraphBuilder, y: str, i: int) -> str:
        yh = self._slice(b, y, self.target_offsets[i], self.target_offsets[i + 1], self.target_rests[i])
        t = self.parts[i].target_type()
        return b.cast(yh, b.float_type if t == TensorProto.FLOAT else t)

    def _concat(self, b: GraphBuilder, pieces: list[str]) -> str:
        flat = [b.op("Flatten", [p], axis=1) for p in pieces]
        return flat[0] if len(flat) == 1 else b.op("Concat", flat, axis=1)

    def emit_per_example_loss_sum(self, b, z, y):
        return b.sum([b.scale(p.emit_per_example_loss_sum(b, self._z(b, z, i), self._y(b, y, i)), c)
                      for i, (p, c) in enumerate(zip(self.parts, self.coefficients))])

    def emit_per_example(self, b, z, y):
        return b.sum([b.scale(p.emit_per_example(b, self._z(b, z, i), self._y(b, y, i)), c)
                      for i, (p, c) in enumerate(zip(self.parts, self.coefficients))])

    def emit_metrics(self, b: GraphBuilder, z: str, y: str, weights: str | None = None) -> dict[str, str]:
        """Each head's loss; the per-example weights [N] broadcast against each head's
        per-position terms (emit_per_position: its weight_shape)."""
        out = {}
        for i, (h, p) in enumerate(zip(self.heads, self.parts)):
            w = weights
            rank = len(p.weight_shape((1, *self.target_rests[i])))
            if w is not None and rank > 1:
                w = b.unsqueeze(w, list(range(1, rank)))
            out[f"loss_{h['targets']}"] = p.emit_loss(b, self._z(b, z, i), self._y(b, y, i), w)
        return out

    def emit_grad(self, b, z, y):
        return self._concat(b, [b.scale(p.emit_grad(b, self._z(b, z, i), self._y(b, y, i)), c)
                                for i, (p, c) in enumerate(zip(self.parts, self.coefficients))])

    def emit_sampled_grad(self, b, z, noise, z_shape):
        pieces = []
        for i, (p, c) in enumerate(zip(self.parts, self.coefficients)):
            u = self._slice(b, noise, self.noise_offsets[i], self.noise_offsets[i + 1], self.noise_rests[i])
            if i in self.normal_offsets:  # Box-Muller: sqrt(-2 log u1) cos(2 pi u2)
                start = self.normal_offsets[i]
                u2 = self._slice(b, noise, start, start + self.widths[i], self.shapes[i])
                radius = b.op("Sqrt", [b.scale(b.op("Log", [u]), -2.0)])
                u = b.mul(radius, b.op("Cos", [b.scale(u2, 2 * math.pi)]))
            pieces.append(b.scale(p.emit_sampled_grad(b, self._z(b, z, i), u, (z_shape[0], *self.shapes[i])),
                                  math.sqrt(c)))
        return self._concat(b, pieces)

    def _products(self, b: GraphBuilder, z: str, v: str, sqrt: bool) -> str:
        """Per head sqrt(c_h) B_h v_h or c_h F_h v_h, each expanded to its head's shape (an
        exact-mode seed v is one [1, ...] row that some heads' products keep as it is)."""
        pieces = []
        for i, (p, c) in enumerate(zip(self.parts, self.coefficients)):
            zh, vh = self._z(b, z, i), self._z(b, v, i)
            prod = p.emit_fisher_sqrt_times(b, zh, vh) if sqrt else p.emit_fisher_times(b, zh, vh)
            pieces.append(b.op("Expand", [b.scale(prod, math.sqrt(c) if sqrt else c), b.op("Shape", [zh])]))
        return self._concat(b, pieces)

    def emit_fisher_sqrt_times(self, b, z, v):
        return self._products(b, z, v, sqrt=True)

    def emit_fisher_times(self, b, z, v):
        return self._products(b, z, v, sqrt=False)

    # -- numpy twins
    def np_per_example(self, z, y):
        return sum(c * p.np_per_example(zh, yh) for c, p, (zh, yh) in zip(self.coefficients, self.parts, self.split(z, y)))

    def np_grad(self, z, y):
        return np.concatenate([c * p.np_grad(zh, yh).reshape(len(z), -1)
                               for c, p, (zh, yh) in zip(self.coefficients, self.parts, self.split(z, y))], axis=1)

    def np_fisher(self, z_n):
        z_n = np.asarray(z_n).reshape(1, -1)
        out = np.zeros((self.width, self.width))
        for i, (c, p, (zh, _)) in enumerate(zip(self.coefficients, self.parts, self.split(z_n))):
            s, e = self.offsets[i], self.offsets[i + 1]
            out[s:e, s:e] = c * p.np_fisher(zh[0])
        return out
