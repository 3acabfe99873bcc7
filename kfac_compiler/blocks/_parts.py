"""Shared machinery for the Fisher blocks.

A `PartsBlock` keeps its curvature as a few *parts*: SPD matrices ("full", possibly with a
leading batch axis, e.g. one factor per conv group) and elementwise diagonals ("diag").
A Kronecker block has parts A and G; a diagonal block one part "diag"; a full block one
part "full". Damped inverses, multiplies and matrix powers then follow one pattern:

    damped parts  = the parts with damping added (Kronecker: the pi split)
    inverse state = {part + "_inv": damped part ^ -1}, guarded by one "ok" flag per block
    multiply by a state / the damped parts / their powers = `_emit_apply` (block specific)

`MatrixView` maps parameter tensors (in their stored shapes) to the K-FAC matrix [W | b]
(rows outputs, columns inputs then bias) and back, in ONNX and in numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kfac_compiler import linalg
from kfac_compiler.blocks.base import FisherBlock, InverseState
from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec


def prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


@dataclass(frozen=True)
class Part:
    """One stored factor: an SPD matrix batch [..., n, n] ("full") or a diagonal ("diag")."""

    name: str
    shape: tuple[int, ...]
    kind: str = "full"

    @property
    def n(self) -> int:
        return int(self.shape[-1])

    @property
    def batch(self) -> tuple[int, ...]:
        return tuple(self.shape[:-2]) if self.kind == "full" else ()


# ------------------------------------------------------------------ ONNX helpers
def emit_dim(b: GraphBuilder, x: str, axis: int) -> str:
    """x.shape[axis] as a float scalar (works for every opset >= 13)."""
    d = b.op("Gather", [b.op("Shape", [x]), b.const(np.asarray(axis, np.int64))], axis=0)
    return b.cast(d, b.float_type)


def emit_shape_with(b: GraphBuilder, x: str, rank: int, axis: int, size: int = 1) -> str:
    """Shape of x (rank `rank`) with dimension `axis` replaced by `size`."""
    axis = axis % rank
    shp = b.op("Shape", [x])
    pieces = []
    if axis > 0:
        pieces.append(b.op("Slice", [shp, b.ints([0]), b.ints([axis])]))
    pieces.append(b.ints([size]))
    if axis < rank - 1:
        pieces.append(b.op("Slice", [shp, b.ints([axis + 1]), b.ints([rank])]))
    return pieces[0] if len(pieces) == 1 else b.op("Concat", pieces, axis=0)


def emit_append_const(b: GraphBuilder, x: str, rank: int, axis: int, value: float) -> str:
    """Append one slice filled with `value` at the end of `axis` (the homogeneous coordinate)."""
    shape = emit_shape_with(b, x, rank, axis, 1)
    filled = b.op("Expand", [b.const(np.full([1] * rank, value)), shape])
    return b.op("Concat", [x, filled], axis=axis)


def emit_concat(b: GraphBuilder, xs: Sequence[str], axis: int) -> str:
    xs = list(xs)
    return xs[0] if len(xs) == 1 else b.op("Concat", xs, axis=axis)


def emit_gram(b: GraphBuilder, X: str, rank: int = 2) -> str:
    """X^T X for X [rows, k] (rank 2) or X X^T per batch for X [g, k, cols] (rank 3)."""
    if rank == 2:
        return b.matmul(b.transpose(X, [1, 0]), X)
    return b.matmul(X, b.transpose(X, [0, 2, 1]))


@dataclass(frozen=True)
class GramStatistic:
    """A factor statistic X^T X / count for rows X [m, k], left as its operands: the moving
    average folds the product, the division and its decay into one Gemm
    (backend._factor_updates), instead of four more passes over the k x k factor (0.08 ms of
    a 2.3 ms digits-autoencoder step). `emit` materializes it for every other consumer."""

    rows: str
    count: str  # scalar tensor

    def emit(self, b: GraphBuilder) -> str:
        return b.div(emit_gram(b, self.rows), self.count)


def emit_statistic(b: GraphBuilder, stat: "str | GramStatistic") -> str:
    """The tensor of an emit_statistics value (a tensor name or a GramStatistic)."""
    return stat.emit(b) if isinstance(stat, GramStatistic) else stat


def emit_add_all(b: GraphBuilder, xs: Sequence[str]) -> str:
    xs = list(xs)
    out = xs[0]
    for x in xs[1:]:
        out = b.add(out, x)
    return out


# ------------------------------------------------------------------ parameter <-> matrix
class MatrixView:
    """Parameters in their stored shapes <-> the K-FAC matrix [W | b] of shape
    [*batch, out, in (+1 with a bias)].

    weight -> (transpose, for 2-d weights stored [in, out]) -> reshape to `w_mat_shape`;
    bias -> reshape to [*batch, out, 1]; the two are concatenated on the last axis.
    """

    def __init__(
        self,
        weight: str,
        w_shape: Sequence[int],
        w_mat_shape: Sequence[int],
        transpose: bool = False,
        bias: str | None = None,
        b_shape: Sequence[int] | None = None,
    ) -> None:
        self.weight, self.w_shape, self.transpose = weight, tuple(w_shape), transpose
        self.w_mat_shape = tuple(w_mat_shape)
        self.bias, self.b_shape = bias, (tuple(b_shape) if b_shape is not None else None)
        if prod(self.w_shape) != prod(self.w_mat_shape):
            raise ConfigError(f"parameter {weight!r}: shape {self.w_shape} does not fit the matrix {self.w_mat_shape}")
        if bias is not None and prod(self.b_shape) != prod(self.w_mat_shape[:-1]):
            raise ConfigError(f"parameter {bias!r}: shape {self.b_shape} does not fit {self.w_mat_shape[:-1]}")

    @property
    def mat_shape(self) -> tuple[int, ...]:
        *lead, k = self.w_mat_shape
        return (*lead, k + (1 if self.bias else 0))

    @property
    def _pre_shape(self) -> tuple[int, ...]:
        return (self.w_shape[1], self.w_shape[0]) if self.transpose else self.w_shape

    # ONNX
    def emit_to(self, b: GraphBuilder, tensors: dict[str, str]) -> str:
        w = tensors[self.weight]
        if self.transpose:
            w = b.transpose(w, [1, 0])
        if self._pre_shape != self.w_mat_shape:
            w = b.reshape(w, self.w_mat_shape)
        if not self.bias:
            return w
        bb = b.reshape(tensors[self.bias], [*self.w_mat_shape[:-1], 1])
        return b.op("Concat", [w, bb], axis=-1)

    def emit_from(self, b: GraphBuilder, M: str) -> dict[str, str]:
        out = {}
        w = M
        if self.bias:
            w, bb = b.split(M, [self.w_mat_shape[-1], 1], axis=-1)
            out[self.bias] = b.reshape(bb, self.b_shape)
        if self._pre_shape != self.w_mat_shape:
            w = b.reshape(w, self._pre_shape)
        if self.transpose:
            w = b.transpose(w, [1, 0])
        out[self.weight] = w
        return out

    @property
    def stored_transposed(self) -> bool:
        """A 2-d weight stored [in, out] (as ONNX MatMul and Gemm(transB=0) read it): blocks
        can work on M^T = [W; b^T] as stored, without a transpose on the way in and out."""
        return self.transpose and len(self.w_mat_shape) == 2

    def emit_to_transposed(self, b: GraphBuilder, tensors: dict[str, str]) -> str:
        """M^T [in (+1), out] of a stored_transposed view."""
        w = tensors[self.weight]
        if not self.bias:
            return w
        return b.op("Concat", [w, b.reshape(tensors[self.bias], [1, self.w_mat_shape[0]])], axis=0)

    def emit_from_transposed(self, b: GraphBuilder, MT: str) -> dict[str, str]:
        if not self.bias:
            return {self.weight: MT}
        w, bb = b.split(MT, [self.w_mat_shape[1], 1], axis=0)
        return {self.weight: w, self.bias: b.reshape(bb, self.b_shape)}

    # numpy
    def np_to(self, arrays: dict) -> np.ndarray:
        w = np.asarray(arrays[self.weight])
        if self.transpose:
            w = w.T
        w = w.reshape(self.w_mat_shape)
        if not self.bias:
            return w
        return np.concatenate([w, np.asarray(arrays[self.bias]).reshape(*self.w_mat_shape[:-1], 1)], axis=-1)

    def np_from(self, M: np.ndarray) -> dict:
        out = {}
        k = self.w_mat_shape[-1]
        w = M[..., :k]
        if self.bias:
            out[self.bias] = M[..., k].reshape(self.b_shape)
        w = w.reshape(self._pre_shape)
        out[self.weight] = w.T if self.transpose else w
        return out


class FlatView:
    """Parameters <-> one flat vector (concatenation of the flattened parameters, in order)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [prod(s) for s in self.shapes]
        self.size = sum(self.sizes)

    def emit_to(self, b: GraphBuilder, tensors: dict[str, str]) -> str:
        return emit_concat(b, [b.reshape(tensors[n], [-1]) for n in self.names], axis=0)

    def emit_from(self, b: GraphBuilder, v: str) -> dict[str, str]:
        parts = b.split(v, self.sizes, axis=0) if len(self.names) > 1 else [v]
        return {n: b.reshape(p, list(s)) for n, p, s in zip(self.names, parts, self.shapes)}

    def np_to(self, arrays: dict) -> np.ndarray:
        return np.concatenate([np.asarray(arrays[n]).reshape(-1) for n in self.names])

    def np_from(self, v: np.ndarray) -> dict:
        out, start = {}, 0
        for n, s, k in zip(self.names, self.shapes, self.sizes):
            out[n] = v[start : start + k].reshape(s)
            start += k
        return out


# ------------------------------------------------------------------ the parts block
class PartsBlock(FisherBlock):
    """A block whose curvature is a set of parts (see module docstring).

    Options (constructor keywords): `inverse_options` (dict passed to linalg, e.g.
    {"iterations": 12} for Newton-Schulz, {"check": "finite"}).
    """

    def parts(self) -> list[Part]:
        raise NotImplementedError

    # ---- plan records
    def factor_specs(self) -> list[FactorSpec]:
        return [FactorSpec(p.name, tuple(p.shape), role=p.name) for p in self.parts()]

    def inverse_specs(self) -> list[FactorSpec]:
        return [FactorSpec(p.name + "_inv", tuple(p.shape), role=p.name + "_inv") for p in self.parts()]

    def inverse_flops(self, method: str = linalg.DEFAULT_METHOD) -> int:
        total = 0
        for p in self.parts():
            if p.kind == "full":
                total += linalg.flops_inverse(p.n, method) * prod(p.batch)
            else:
                total += 4 * prod(p.shape)
        return total

    @property
    def inverse_kw(self) -> dict:
        return dict(self.options.get("inverse_options") or {})

    # ---- damping (Kronecker blocks override with the pi split)
    def _emit_damped(self, b: GraphBuilder, factors: dict[str, str], damping: str) -> dict[str, str]:
        out = {}
        for p in self.parts():
            out[p.name] = linalg.emit_add_diagonal(b, factors[p.name], p.n, damping, diag=p.kind == "diag")
        return out

    def _np_damped(self, factors: dict, damping: float) -> dict:
        return {
            p.name: linalg.np_add_diagonal(factors[p.name], float(damping), diag=p.kind == "diag")
            for p in self.parts()
        }

    # ---- multiply the parameters by a set of part matrices (block specific)
    def _emit_apply(self, b: GraphBuilder, vectors: dict[str, str], mats: dict[str, str]) -> dict[str, str]:
        raise NotImplementedError

    def _np_apply(self, vectors: dict, mats: dict) -> dict:
        raise NotImplementedError

    # ---- inverse
    def _fallback(self, b: GraphBuilder, p: Part) -> str:
        if p.kind == "diag":
            return b.const(np.ones(p.shape), hint="ones")
        return b.const(np.broadcast_to(np.eye(p.n), p.shape), hint="eye")

    def _inverse_requests(self, b, factors, damping, previous):
        damped = self._emit_damped(b, factors, damping)
        reqs = []
        for p in self.parts():
            if p.kind == "full":
                prev = (previous or {}).get(p.name + "_inv")
                reqs.append((p.name, linalg.InverseRequest(damped[p.name], p.n, p.batch, prev)))
        return damped, reqs

    def _inverse_finish(self, b, damped, results: dict, previous) -> dict[str, str]:
        new, oks = {}, []
        for p in self.parts():
            if p.kind == "full":
                X, ok = results[p.name]
            else:
                X = b.op("Reciprocal", [damped[p.name]])
                ok = b.op("And", [linalg.emit_finite(b, X), b.op("Greater", [b.reduce("ReduceMin", damped[p.name], None), b.const(0.0)])])
            new[p.name] = X
            oks.append(ok)
        ok = linalg.emit_all(b, oks)
        state = InverseState()
        for p in self.parts():
            key = p.name + "_inv"
            old = previous[key] if previous and key in previous else self._fallback(b, p)
            state[key] = linalg.emit_select(b, ok, new[p.name], old)
        state.ok = ok
        return state

    def emit_inverse(self, b, factors, damping, method=linalg.DEFAULT_METHOD, previous=None):
        if linalg.is_host_method(method):
            raise ConfigError(
                f"layer {self.layer.name!r}: inverse method {method!r} is host-side; use numpy_inverse "
                f"(or one of {', '.join(linalg.EMITTED_METHODS)})"
            )
        damped, reqs = self._inverse_requests(b, factors, damping, previous)
        res = linalg.emit_inverse_batch(b, [r for _, r in reqs], method, **self.inverse_kw)
        return self._inverse_finish(b, damped, {name: x for (name, _), x in zip(reqs, res)}, previous)

    def _np_inverse_requests(self, factors, damping, previous):
        damped = self._np_damped(factors, damping)
        full = [p for p in self.parts() if p.kind == "full"]
        reqs = [(p.name, damped[p.name], (previous or {}).get(p.name + "_inv")) for p in full]
        return damped, reqs

    def _np_inverse_finish(self, factors, damped, results: dict, previous):
        dtype = np.result_type(*[np.asarray(factors[p.name]).dtype for p in self.parts()])
        ok = all(bool(np.all(o)) for _, o in results.values())
        new = {name: X for name, (X, _) in results.items()}
        for p in self.parts():
            if p.kind == "diag":
                d = damped[p.name]
                with np.errstate(all="ignore"):
                    new[p.name] = 1.0 / d
                ok = ok and bool(np.all(np.isfinite(new[p.name])) and np.all(d > 0))
        state = {}
        for p in self.parts():
            key = p.name + "_inv"
            if ok:
                val = new[p.name]
            elif previous is not None and key in previous:
                val = previous[key]
            else:
                val = np.ones(p.shape) if p.kind == "diag" else np.broadcast_to(np.eye(p.n), p.shape)
            state[key] = np.asarray(val, dtype=dtype)
        return state, ok

    def _np_batchable(self) -> bool:
        """True when numpy_inverse is the parts inverse (so numpy_inverses may stack it)."""
        return True

    def _np_kw(self) -> dict:
        return {k: v for k, v in self.inverse_kw.items() if k in ("iterations", "tol")}

    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        linalg.check_method(method)
        damped, reqs = self._np_inverse_requests(factors, damping, previous)
        res = linalg.np_inverse_batch([m for _, m, _ in reqs], method, [pr for _, _, pr in reqs], **self._np_kw())
        return self._np_inverse_finish(factors, damped, {name: r for (name, _, _), r in zip(reqs, res)}, previous)

    # ---- multiplies
    def emit_multiply_inverse(self, b, grads, inverses):
        return self.emit_multiply_state(b, grads, inverses)

    def emit_multiply_state(self, b, vectors, state):
        """Multiply by a state of part matrices: keys part+"_inv" (inverse) or part+"_pow"."""
        mats = {}
        for p in self.parts():
            key = p.name + "_inv" if p.name + "_inv" in state else p.name + "_pow"
            mats[p.name] = state[key]
        return self._emit_apply(b, vectors, mats)

    def emit_multiply(self, b, vectors, factors, damping):
        return self._emit_apply(b, vectors, self._emit_damped(b, factors, damping))

    def emit_multiply_matpower(self, b, vectors, factors, damping, exp):
        """(damped parts)^exp applied to v; integer exp in ONNX (inverse_op for negative)."""
        if exp != int(exp):
            raise ConfigError(
                f"layer {self.layer.name!r}: matrix power {exp} needs eigendecompositions: use "
                "numpy_matpower (host) and emit_multiply_state"
            )
        damped = self._emit_damped(b, factors, damping)
        mats = {}
        for p in self.parts():
            if p.kind == "diag":
                mats[p.name] = b.op("Pow", [damped[p.name], b.const(float(exp))])
            else:
                mats[p.name] = linalg.emit_matpower_int(b, damped[p.name], p.n, int(exp))[0]
        return self._emit_apply(b, vectors, mats)

    def numpy_multiply_inverse(self, grads, state):
        return self.numpy_multiply_state(grads, state)

    def numpy_multiply_state(self, vectors, state):
        mats = {}
        for p in self.parts():
            key = p.name + "_inv" if p.name + "_inv" in state else p.name + "_pow"
            mats[p.name] = np.asarray(state[key], np.float64)
        return self._np_apply(vectors, mats)

    def numpy_multiply(self, vectors, factors, damping):
        return self._np_apply(vectors, self._np_damped(factors, damping))

    def numpy_matpower(self, factors, damping, exp):
        damped = self._np_damped(factors, damping)
        state, ok = {}, True
        for p in self.parts():
            if p.kind == "diag":
                d = damped[p.name]
                with np.errstate(all="ignore"):
                    P = np.where(d > 0, d, 1.0) ** exp if exp < 0 else np.maximum(d, 0) ** exp
                ok = ok and bool(np.all(np.isfinite(d)) and (exp >= 0 or np.all(d > 0)))
            else:
                P, o = linalg.np_matpower(damped[p.name], exp)
                ok = ok and bool(np.all(o))
            state[p.name + "_pow"] = P
        return state, ok

    def numpy_multiply_matpower(self, vectors, factors, damping, exp):
        state, _ = self.numpy_matpower(factors, damping, exp)
        return self.numpy_multiply_state(vectors, state)


# ------------------------------------------------------------------ across blocks
def emit_inverses(
    b: GraphBuilder,
    items: Sequence[tuple[PartsBlock, dict, str, dict | None]],
    method: str = linalg.DEFAULT_METHOD,
    **kw,
) -> list[dict[str, str]]:
    """Inverse state of many blocks at once: (block, factors, damping, previous) per item.
    Factors of equal size across all blocks are stacked so that one Inverse op (or one
    Newton-Schulz chain) serves them all. Same result as calling each emit_inverse."""
    if linalg.is_host_method(method):
        raise ConfigError(f"inverse method {method!r} is host-side: use numpy_inverses")
    staged, flat = [], []
    for blk, factors, damping, previous in items:
        damped, reqs = blk._inverse_requests(b, factors, damping, previous)
        staged.append((damped, reqs))
        flat.extend(r for _, r in reqs)
    res = linalg.emit_inverse_batch(b, flat, method, **kw)
    out, k = [], 0
    for (blk, _, _, previous), (damped, reqs) in zip(items, staged):
        results = {name: res[k + i] for i, (name, _) in enumerate(reqs)}
        k += len(reqs)
        out.append(blk._inverse_finish(b, damped, results, previous))
    return out


def numpy_inverses(items, method: str = "eigh", **kw) -> list[tuple[dict, bool]]:
    """Host-side inverse state of many blocks: (block, factors, damping, previous) per item.
    The damped factors of all PartsBlocks are stacked per size so that one numpy call
    (eigh / cholesky) serves each size; other blocks (exact damping, RNN series) invert
    their own. Same result as calling each numpy_inverse."""
    linalg.check_method(method)
    out: list = [None] * len(items)
    staged, flat = [], []
    for i, (blk, factors, damping, previous) in enumerate(items):
        if not (isinstance(blk, PartsBlock) and blk._np_batchable()):
            out[i] = blk.numpy_inverse(factors, damping, method, previous)
            continue
        damped, reqs = blk._np_inverse_requests(factors, damping, previous)
        staged.append((i, damped, reqs))
        flat.extend(reqs)
    res = linalg.np_inverse_batch([m for _, m, _ in flat], method, [pr for _, _, pr in flat], **kw)
    k = 0
    for i, damped, reqs in staged:
        blk, factors, _, previous = items[i]
        results = {name: res[k + j] for j, (name, _, _) in enumerate(reqs)}
        k += len(reqs)
        out[i] = blk._np_inverse_finish(factors, damped, results, previous)
    return out


__all__ = [
    "FlatView",
    "MatrixView",
    "Part",
    "PartsBlock",
    "emit_inverses",
    "numpy_inverses",
    "prod",
]
