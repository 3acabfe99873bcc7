"""The parts block: shared machinery of the Kronecker, diagonal and full Fisher blocks.

A `PartsBlock` keeps its curvature as a few *parts*: SPD matrices ("full", possibly with a
leading batch axis, e.g. one factor per conv group) and elementwise diagonals ("diag").
A Kronecker block has parts A and G; a diagonal block one part "diag"; a full block one
part "full". Damped inverses, multiplies and matrix powers then follow one pattern:

    damped parts  = the parts with damping added (Kronecker: the pi split)
    inverse state = {part + "_inv": damped part ^ -1}, guarded by one "ok" flag per block
    the power hook (emit_power / numpy_power) = `_emit_apply` (block specific) of a state's
        parts, of the damped parts, or of their integer powers

The ONNX helpers, the statistic type and the parameter views that used to live here are in
ops.py, statistics.py and views.py; they are re-exported for existing imports.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kfac_compiler import linalg
from kfac_compiler.blocks.base import FisherBlock, InverseState
from kfac_compiler.blocks.gram import GramStatistic, emit_statistic  # noqa: F401  (re-exported)
from kfac_compiler.blocks.ops import (  # noqa: F401  (re-exported)
    emit_add_all,
    emit_append_const,
    emit_concat,
    emit_dim,
    emit_gram,
    emit_shape_with,
    prod,
)
from kfac_compiler.blocks.views import FlatView, MatrixView  # noqa: F401  (re-exported)
from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec


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


class PartsBlock(FisherBlock):
    """A block whose curvature is a set of parts (see module docstring).

    Options (constructor keywords): `inverse_options` (dict passed to linalg, e.g.
    {"iterations": 12} for Newton-Schulz, {"check": "finite"}).
    """

    host_matpowers = True  # numpy_matpower: any real power of the damped parts (eigh)

    def parts(self) -> list[Part]:
        raise NotImplementedError

    # ---- the curvature's scale (Curvature.block_scales: the damping floor's reference)
    def np_scale(self, factors: dict[str, np.ndarray]) -> float:
        """The mean eigenvalue of the undamped approximation, the largest over conv groups:
        one part, the mean of its diagonal (a diagonal block's every entry); several, a
        Kronecker product's, the product of the parts' trace means per group. Blocks of
        another structure (a direct sum, combined factors) override it."""
        parts = self.parts()
        if len(parts) == 1 and parts[0].kind == "diag":
            return float(np.mean(factors[parts[0].name], dtype=np.float64))
        scale: float | np.ndarray = 1.0
        for part in parts:
            scale = scale * linalg.np_trace_mean(factors[part.name], diag=part.kind == "diag")
        return float(np.max(scale))

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

    def apply_flops(self) -> int:
        total = 0
        for p in self.parts():
            total += 2 * p.n * p.n * prod(p.batch) if p.kind == "full" else prod(p.shape)
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
        if p.kind == "diag":  # built at run time: nothing width-sized stored in the graph
            return b.op("Expand", [b.const(np.ones(1)), b.ints(list(p.shape))], hint="ones")
        return b.op("Expand", [linalg.emit_eye(b, p.n), b.ints(list(p.shape))], hint="eye")

    def _inverse_requests(self, b, factors, damping, previous):
        damped = self._emit_damped(b, factors, damping)
        reqs = []
        for p in self.parts():
            if p.kind == "full":
                prev = (previous or {}).get(p.name + "_inv")
                reqs.append((p.name, linalg.InverseRequest(damped[p.name], p.n, p.batch, prev)))
        return damped, reqs

    def _inverse_finish(self, b, damped, results: dict, previous, exp: float = -1) -> dict[str, str]:
        new, oks = {}, []
        for p in self.parts():
            if p.kind == "full":
                X, ok = results[p.name]
            else:
                X = b.op("Reciprocal", [damped[p.name]]) if exp == -1 else b.op("Pow", [damped[p.name], b.const(float(exp))])
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

    def stacked_sizes(self) -> list[int]:
        """The sizes of the matrices emit_inverses stacks for this block (its full parts)."""
        return [p.n for p in self.parts() if p.kind == "full"]

    def emits_stacked_inverse(self, method: str) -> bool:
        """True when emit_inverse is the parts inverse with the default inverse options, so
        that emit_inverses may stack this block's matrices with other blocks'."""
        return not self.inverse_is_host(method) and self._np_batchable() and not self.inverse_kw

    def emits_power(self, exp, method):
        return not self.inverse_is_host(method) and linalg.is_half_integer(exp)

    def emit_power_state(self, b, factors, damping, exp, method, previous=None):
        """Integer and half-integer powers of the damped parts in ONNX (linalg.emit_matpower),
        guarded like the inverse: a failed block keeps `previous`."""
        if exp == -1 or not self.emits_power(exp, method):
            return super().emit_power_state(b, factors, damping, exp, method, previous)
        damped = self._emit_damped(b, factors, damping)
        results = {p.name: linalg.emit_matpower(b, damped[p.name], p.n, exp, linalg.concrete_method(method))
                   for p in self.parts() if p.kind == "full"}
        return self._inverse_finish(b, damped, results, previous, exp)

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
        """True when numpy_inverse is the parts inverse (so numpy_inverses may stack it): not
        for a host-only block, whose numpy_inverse is its own."""
        return not self.host_inverse_only

    def _np_kw(self) -> dict:
        return {k: v for k, v in self.inverse_kw.items() if k in ("iterations", "tol")}

    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        linalg.check_method(method)
        damped, reqs = self._np_inverse_requests(factors, damping, previous)
        res = linalg.np_inverse_batch([m for _, m, _ in reqs], method, [pr for _, _, pr in reqs], **self._np_kw())
        return self._np_inverse_finish(factors, damped, {name: r for (name, _, _), r in zip(reqs, res)}, previous)

    # ---- the power hook: the parts (from a state, or damped and raised) applied to v
    def _state_key(self, p: Part, state) -> str:
        """A state's key for part p: p + "_inv" (inverse state) or p + "_pow" (numpy_matpower)."""
        return p.name + "_inv" if p.name + "_inv" in state else p.name + "_pow"

    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None):
        if state is not None:
            return self._emit_apply(b, vectors, {p.name: state[self._state_key(p, state)] for p in self.parts()})
        if not linalg.is_half_integer(exp):
            raise ConfigError(
                f"layer {self.layer.name!r}: matrix power {exp:g} needs eigendecompositions: use "
                "numpy_matpower (host) and emit_multiply_state (Curvature.multiply_matpower)"
            )
        damped = self._emit_damped(b, factors, damping)
        if exp == 1:
            return self._emit_apply(b, vectors, damped)
        mats = {}
        for p in self.parts():  # integer powers by MatMuls (the Inverse op for negative ones)
            if p.kind == "diag":
                mats[p.name] = b.op("Pow", [damped[p.name], b.const(float(exp))])
                continue
            P, ok = linalg.emit_matpower(b, damped[p.name], p.n, exp)
            # half-integer: a square root that fails its check gives NaN, never a wrong product
            # ok is per matrix ([g] for a grouped conv's factors): on the matrices' trailing axes
            mats[p.name] = P if float(exp).is_integer() else b.op("Where", [b.unsqueeze(ok, [-2, -1]), P,
                                                                             b.const(np.nan)])
        return self._emit_apply(b, vectors, mats)

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None):
        if state is not None:
            mats = {p.name: np.asarray(state[self._state_key(p, state)], np.float64) for p in self.parts()}
            return self._np_apply(vectors, mats)
        if exp != 1:
            return self.numpy_multiply_matpower(vectors, factors, damping, exp)
        return self._np_apply(vectors, self._np_damped(factors, damping))

    # ---- Cholesky factors (TF K-FAC's compute_cholesky / multiply_cholesky): F + damping
    # ~ the product of the damped parts, so L is the product of the parts' Cholesky factors
    # (a diagonal part's sqrt). _np_apply multiplies the parts named here from the right
    # (X @ M = (M^T (x) I) vec X), so they are passed transposed.
    cholesky_right_parts: tuple[str, ...] = ()

    def np_cholesky_parts(self, factors: dict, damping: float, inverse: bool = False) -> dict:
        """{part: L (or L^-1)} of the damped parts, float64 (numpy Cholesky)."""
        out = {}
        for p, M in self._np_damped(factors, damping).items():
            part = next(q for q in self.parts() if q.name == p)
            M = np.asarray(M, np.float64)
            if part.kind == "diag":
                out[p] = M ** (-0.5 if inverse else 0.5)
            else:
                try:
                    out[p] = linalg.np_cholesky_inverse(M) if inverse else linalg.np_cholesky(M)
                except np.linalg.LinAlgError:
                    raise ConfigError(f"layer {self.layer.name!r}: factor {p} + damping is not positive definite; "
                                      "raise the damping") from None
        return out

    def np_multiply_cholesky(self, vectors: dict, parts: dict, transpose: bool = False) -> dict:
        """L v (L^T v) with L the product of `parts` (np_cholesky_parts)."""
        mats = {}
        for p, M in parts.items():
            flip = transpose != (p in self.cholesky_right_parts)
            full = next(q for q in self.parts() if q.name == p).kind == "full"  # [..., n, n]; diag: elementwise
            mats[p] = np.swapaxes(M, -1, -2) if flip and full else M
        return self._np_apply(vectors, mats)

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


# ------------------------------------------------------------------ across blocks
def emit_inverses(
    b: GraphBuilder,
    items: Sequence[tuple[PartsBlock, dict, str, dict | None]],
    method: str = linalg.DEFAULT_METHOD,
    sizes: Sequence[int] = (),
    **kw,
) -> list[dict[str, str]]:
    """Inverse state of many blocks at once: (block, factors, damping, previous) per item.
    Factors of equal size across all blocks are stacked so that one Inverse op (or one
    Newton-Schulz chain) serves them all. Same result as calling each emit_inverse.
    `sizes`: more sizes that decide the stacks' sizes (linalg.emit_inverse_batch)."""
    if linalg.is_host_method(method):
        raise ConfigError(f"inverse method {method!r} is host-side: use numpy_inverses")
    staged, flat = [], []
    for blk, factors, damping, previous in items:
        damped, reqs = blk._inverse_requests(b, factors, damping, previous)
        staged.append((damped, reqs))
        flat.extend(r for _, r in reqs)
    res = linalg.emit_inverse_batch(b, flat, method, sizes=sizes, **kw)
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
    "GramStatistic",
    "MatrixView",
    "Part",
    "PartsBlock",
    "emit_inverses",
    "emit_statistic",
    "numpy_inverses",
    "prod",
]
