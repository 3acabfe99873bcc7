"""Damped inverses and matrix powers of SPD curvature factors: ONNX emitters + numpy twins.

Inverse methods (docs/conventions.md, "Inverse methods"):

  "auto" (the default) resolves per device (concrete_method): "schur" on the CPU and on
  CUDA, "inverse_op" when emitting a plan without a device. On every device the runtime
  recomputes a block whose emitted inverse is not ok with host "cholesky" (FALLBACK_METHOD).

  emitted (run inside ONNX Runtime, on the GPU when the session does):
    "inverse_op"     com.microsoft Inverse (LU), batched over a leading axis.
    "newton_schulz"  X_{k+1} = X_k (2I - M X_k), a fixed number of MatMul iterations;
                     warm-started from the previous inverse when it is passed in and still
                     contracts (spectral radius of I - M X_prev estimated below 0.7), else
                     from X_0 = I / ||M||_F.
    "schur"          2x2 blocks on Schur complements, recursively down to blocks of at most
                     SCHUR_LEAF rows (Inverse op there): all MatMuls, the fastest on the CPU
                     (1.1-1.3 ms for the zoo's 14 factor sizes against LAPACK's 1.8-2.1),
                     but its error grows like cond^2 eps (float32, n = 257: 1.3e-5 at
                     cond 1e3, 2e-3 at 3e4), so it is ok only while its probe residual is
                     at most SCHUR_TOL = 1e-2 (cond <~ 1e5); the rest go to the fallback.
  host (numpy/scipy; the runtime uploads the results):
    "cholesky"       LAPACK potrf + potrs in the factor's precision (float32 in the
                     runtime), M^-1 = L^-T L^-1 (TF K-FAC register_cholesky /
                     register_cholesky_inverse).
    "eigh"           float64 M = U diag(s) U^T; any matrix power U diag(s^p) U^T (register_matpower),
                     exact (non-factored) damping, the RNN series blocks.

Every method returns, with the result, a boolean "ok" per matrix: False when the input or
the result is not finite, or the result is not an inverse (relative residual
||M X - I||_F / sqrt(n), or schur's probe estimate of it, above `tol`). A caller never uses
a result that is not ok: it keeps the previous (last good) value, or the identity when there
is none. So a NaN/Inf or singular factor never turns into a NaN update.

Shapes: a matrix argument is [n, n] or a batch [..., n, n]; ok has the batch shape.
Matrices of equal size from many factors/blocks can be stacked so that one Inverse (or one
numpy eigh) call serves all of them: `emit_inverse_batch`, `np_inverse_batch`.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from onnx import TensorProto

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError

EMITTED_METHODS = ("inverse_op", "newton_schulz", "schur")
HOST_METHODS = ("cholesky", "eigh")
WARM_STARTED_METHODS = ("newton_schulz",)  # use the previous inverse when it is given
AUTO_METHOD = "auto"
METHODS = (AUTO_METHOD,) + EMITTED_METHODS + HOST_METHODS
# The emitted default; the plan default is "auto" (concrete_method). See docs/conventions.md
# "Which inverse method" and benchmarks/bench_inverse.py.
DEFAULT_METHOD = "inverse_op"

SCHUR_LEAF = 48  # blocks up to this size are inverted by the Inverse op (see emit_schur_inverse)
NS_ITERATIONS = 20  # Newton-Schulz iterations (cold start converges for cond(M) <~ 1e5)
NS_PROBE_STEPS = 10  # power-iteration steps that vet a warm start
NS_WARM_RADIUS = 0.7  # warm start when the estimated spectral radius of I - M X_prev is below
RESIDUAL_TOL = 0.1  # ok <=> ||M X - I||_F / sqrt(n) <= RESIDUAL_TOL (and everything finite)
# schur's probe residual bound: its error grows like cond^2 eps, and a block above this bound
# (float32: cond >~ 1e5, where the relative error passes ~3e-3) is recomputed on the host by
# FALLBACK_METHOD (runtime/inverses.py); measured in tests/test_linalg.py
SCHUR_TOL = 1e-2
FALLBACK_METHOD = "cholesky"  # the host method that redoes a block whose emitted inverse failed
PI_EPS = 1e-20  # traces below this (or non-finite) give pi = 1


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ConfigError(f"unknown inverse method {method!r}; expected one of {', '.join(METHODS)}")
    return method


def concrete_method(method: str, device: str | None = None) -> str:
    """The method "auto" stands for where the inverses run: the emitted "schur" on a device
    (its accuracy bound SCHUR_TOL sends ill-conditioned blocks to host Cholesky,
    runtime/inverses.py), "inverse_op" when emitting a plan without one.
    CPU: MatMuls on one ORT thread, the autoencoder's 12 factors in ~2 ms where LAPACK's
    Cholesky on the host takes ~3. CUDA (H100, 2026-11-24): ORT's Inverse kernel is cuBLAS's
    batched LU, made for small matrices: ResNet-18's 42 factors (up to 4608 rows) took 98 s
    per refresh, schur 0.45 s (Newton-Schulz 0.7 s); GPT (768-1024 rows) 2.1 s vs 0.17 s."""
    if check_method(method) != AUTO_METHOD:
        return method
    return "schur" if device in ("cpu", "cuda") else DEFAULT_METHOD


def is_host_method(method: str) -> bool:
    """True for methods computed on the host with numpy (the block's numpy_inverse); "auto"
    is emitted (inverse_op) unless resolved for a CPU device first (concrete_method)."""
    return check_method(method) in HOST_METHODS


# =====================================================================================
# numpy references (float64 inside)
# =====================================================================================


def np_trace_mean(M: np.ndarray, diag: bool = False) -> np.ndarray:
    """tr(M)/dim(M) over the last axes (a diagonal factor is stored as its diagonal)."""
    M = np.asarray(M)
    if diag:
        return M.mean(axis=-1, dtype=np.float64)
    return np.trace(M, axis1=-2, axis2=-1, dtype=np.float64) / M.shape[-1]  # reads the diagonal only


def np_pi(A: np.ndarray, G: np.ndarray, a_diag: bool = False, g_diag: bool = False) -> np.ndarray:
    """pi = sqrt((tr A / dim A) / (tr G / dim G)); 1 where a trace is tiny or not finite."""
    ta, tg = np_trace_mean(A, a_diag), np_trace_mean(G, g_diag)
    with np.errstate(all="ignore"):
        good = np.isfinite(ta) & np.isfinite(tg) & (ta > PI_EPS) & (tg > PI_EPS)
        pi = np.sqrt(np.where(good, ta, 1.0) / np.where(good, tg, 1.0))
    return np.where(good, pi, 1.0)


def np_damping_split(A, G, damping: float, a_diag: bool = False, g_diag: bool = False):
    """(pi sqrt(lambda), sqrt(lambda) / pi): the damping added to A and to G."""
    pi = np_pi(A, G, a_diag, g_diag)
    s = np.sqrt(float(damping))
    return pi * s, s / pi


def np_add_diagonal(M: np.ndarray, d, diag: bool = False) -> np.ndarray:
    """M + d I (d scalar or of M's batch shape), a new array in M's float precision (at least
    float32); M given as its diagonal when `diag`."""
    M = np.asarray(M)
    dtype = np.result_type(M.dtype, np.float32)
    d = np.asarray(d, dtype=dtype)
    if diag:
        return (M + d[..., None]).astype(dtype, copy=False)
    out = np.array(M, dtype=dtype)
    idx = np.arange(M.shape[-1])
    out[..., idx, idx] += d[..., None]
    return out


def _np_residual_ok(M: np.ndarray, X: np.ndarray, tol: float) -> np.ndarray:
    n = M.shape[-1]
    with np.errstate(all="ignore"):
        R = M @ X - np.eye(n)
        r = np.sqrt((R * R).sum(axis=(-2, -1))) / np.sqrt(n)
        return np.isfinite(r) & (r <= tol) & np.isfinite(X).all(axis=(-2, -1))


def np_newton_schulz(
    M: np.ndarray, iterations: int = NS_ITERATIONS, X0: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Newton-Schulz inverse (same algorithm and start rule as the emitted one)."""
    M = np.asarray(M, dtype=np.float64)
    n = M.shape[-1]
    eye = np.eye(n)
    with np.errstate(all="ignore"):
        fro = np.sqrt((M * M).sum(axis=(-2, -1), keepdims=True))
        cold = eye / np.where(fro > 0, fro, 1.0)
        if X0 is not None:
            R0 = eye - M @ X0
            v = np.broadcast_to(_probe(n), (*M.shape[:-2], n, 1))
            for _ in range(NS_PROBE_STEPS):
                v = R0 @ v
            growth = np.sqrt((v * v).sum(axis=(-2, -1), keepdims=True)) ** (1.0 / NS_PROBE_STEPS)
            warm = growth < NS_WARM_RADIUS
            X = np.where(warm, X0, cold)
        else:
            X = cold
        for _ in range(iterations):
            X = X @ (2 * eye - M @ X)
    return X, _np_residual_ok(M, X, RESIDUAL_TOL)


def _probe(n: int) -> np.ndarray:
    """Fixed unit start vector [n, 1] of the power iteration that vets a warm start."""
    v = np.random.default_rng(12345).standard_normal((n, 1))
    return v / np.linalg.norm(v)


def np_cholesky(M: np.ndarray) -> np.ndarray:
    """Lower Cholesky factor L (M = L L^T); TF K-FAC register_cholesky."""
    return np.linalg.cholesky(np.asarray(M, dtype=np.float64))


def np_cholesky_inverse(M: np.ndarray) -> np.ndarray:
    """L^-1 for M = L L^T (so M^-1 = L^-T L^-1); TF K-FAC register_cholesky_inverse."""
    L = np_cholesky(M)
    n = L.shape[-1]
    return np.linalg.solve(L, np.broadcast_to(np.eye(n), L.shape))


def np_matpower(M: np.ndarray, exp: float) -> tuple[np.ndarray, np.ndarray]:
    """M^exp via eigh (symmetric part of M); eigenvalues clamped at 0 for exp > 0.

    Negative powers need positive eigenvalues: ok is False (and the result is garbage the
    caller must not use) where an eigenvalue is <= 0 or anything is not finite.
    """
    M = np.asarray(M, dtype=np.float64)
    ok = np.isfinite(M).all(axis=(-2, -1))
    safe = np.where(ok[..., None, None], M, np.eye(M.shape[-1]))
    s, U = np.linalg.eigh(np_symmetrized(safe))
    if exp < 0:
        ok = ok & (s > 0).all(axis=-1)
        s = np.where(s > 0, s, 1.0)
    else:
        s = np.maximum(s, 0.0)
    P = (U * s[..., None, :] ** exp) @ np.swapaxes(U, -1, -2)
    return P, ok & np.isfinite(P).all(axis=(-2, -1))


def np_inverse(
    M: np.ndarray,
    method: str = "eigh",
    previous: np.ndarray | None = None,
    iterations: int = NS_ITERATIONS,
    tol: float = RESIDUAL_TOL,
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of SPD M ([..., n, n]) by `method`, in float64, with its ok flag per matrix.

    Where not ok the result is `previous` (when given) or the identity. The emitted methods
    have numpy twins here too (used by tests): inverse_op = np.linalg.inv.
    """
    method = concrete_method(method)  # "auto" here is the emitted inverse_op's twin
    if method == "cholesky":
        return np_cholesky_inverse_batch(M, previous)
    M = np.asarray(M, dtype=np.float64)
    n = M.shape[-1]
    finite = np.isfinite(M).all(axis=(-2, -1))
    safe = np.where(finite[..., None, None], M, np.eye(n))
    with np.errstate(all="ignore"):
        if method == "newton_schulz":
            X, ok = np_newton_schulz(safe, iterations, None if previous is None else np.asarray(previous, np.float64))
        else:
            X = np.empty_like(safe)
            ok = np.ones(safe.shape[:-2], dtype=bool)
            flat_M = safe.reshape(-1, n, n)
            flat_X = X.reshape(-1, n, n)
            flat_ok = ok.reshape(-1)
            try:
                flat_X[...] = _np_inverse_stack(flat_M, method)
            except np.linalg.LinAlgError:  # one bad matrix: redo them one by one
                for i in range(flat_M.shape[0]):
                    try:
                        flat_X[i] = _np_inverse_stack(flat_M[i : i + 1], method)[0]
                    except np.linalg.LinAlgError:
                        flat_X[i] = np.eye(n)
                        flat_ok[i] = False
            ok = ok & _np_residual_ok(safe, X, tol)
    return _kept_where_failed(X, ok & finite, previous)


def _kept_where_failed(X: np.ndarray, ok: np.ndarray, previous: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(X where ok, else `previous` or the identity, in X's dtype; ok)."""
    if ok.all():
        return X, ok
    n = X.shape[-1]
    fallback = np.broadcast_to(np.eye(n, dtype=X.dtype), X.shape) if previous is None else np.asarray(previous, X.dtype)
    return np.where(ok[..., None, None], X, fallback), ok


def np_cholesky_inverse_batch(M: np.ndarray, previous: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of SPD M ([..., n, n]) by LAPACK potrf + potrs against the identity, in M's
    precision (float32 stays float32: potrf succeeding certifies the matrix positive definite
    and is backward stable, so no residual check is needed). potrs' two triangular solves
    with n right-hand sides (2n^3 flops) ran faster than potri's triangular inverse and
    product (n^3 flops at ~28 GFLOP/s single-threaded): 0.38 vs 0.41 ms at n = 257, 0.06 vs
    0.09 at 129. The solution is symmetric only to rounding, so it is symmetrized. ok = potrf
    succeeded and the result is finite; where not ok the result is `previous` or the identity."""
    from scipy.linalg import lapack

    M = np.asarray(M)
    if M.dtype not in (np.float32, np.float64):
        M = M.astype(np.float64)
    potrf, potrs = (lapack.spotrf, lapack.spotrs) if M.dtype == np.float32 else (lapack.dpotrf, lapack.dpotrs)
    n = M.shape[-1]
    flat = M.reshape(-1, n, n)
    X = np.empty_like(flat)
    ok = np.zeros(flat.shape[0], dtype=bool)
    half_identity = 0.5 * np.eye(n, dtype=M.dtype)
    with np.errstate(all="ignore"), one_blas_thread():
        for i, m in enumerate(flat):
            # m.T is m (symmetric) in Fortran order: LAPACK reads it without a transposing copy
            c, info = potrf(m.T, lower=1, clean=0)
            if info == 0:
                half, info = potrs(c, half_identity, lower=1)  # M^-1 / 2
                np.add(half, half.T, out=X[i])  # exactly symmetric: a descent direction stays one
            ok[i] = info == 0
        ok &= np.isfinite(X).all(axis=(-2, -1))  # NaN/Inf in M propagates to X
    return _kept_where_failed(X.reshape(M.shape), ok.reshape(M.shape[:-2]), previous)


@functools.cache
def _blas_controller():
    """threadpoolctl's controller (built once: it scans the loaded libraries), or None."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        return None
    return ThreadpoolController()


_blas_limit_depth = 0


def prepare_host_inverses() -> None:
    """Do the one-time work of the first host inverse up front: import scipy's LAPACK
    (~0.2 s) and scan the loaded BLAS libraries (threadpoolctl, ~5 ms)."""
    import scipy.linalg.lapack  # noqa: F401

    _blas_controller()


@contextlib.contextmanager
def one_blas_thread():
    """Run BLAS/LAPACK (OpenBLAS, MKL) on the calling thread only. Worker threads would
    busy-wait for ~0.1 s after each call and steal the cores ONNX Runtime's pool is spinning
    on (on 2 cores the K-FAC step took 2x longer). Re-entrant: an inverse refresh enters it
    once for all its blocks, and the nested entries cost nothing."""
    global _blas_limit_depth
    ctl = _blas_controller() if _blas_limit_depth == 0 else None
    limiter = ctl.limit(limits=1, user_api="blas") if ctl is not None else None
    _blas_limit_depth += 1
    try:
        yield
    finally:
        _blas_limit_depth -= 1
        if limiter is not None:
            limiter.restore_original_limits()


def np_symmetrized(X: np.ndarray) -> np.ndarray:
    """(X + X^T) / 2 over the last two axes (emit_symmetrized's twin)."""
    return 0.5 * (X + np.swapaxes(X, -1, -2))


def np_schur_inverse(M: np.ndarray, leaf: int = SCHUR_LEAF) -> np.ndarray:
    """The emitted "schur" method's twin: the same 2x2 block recursion (emit_schur_inverse)."""
    n = M.shape[-1]
    if n <= leaf:
        return np_symmetrized(np.linalg.inv(M))
    h = n // 2
    A_inv = np_schur_inverse(M[..., :h, :h], leaf)
    W = A_inv @ M[..., :h, h:]
    S_inv = np_schur_inverse(M[..., h:, h:] - M[..., h:, :h] @ W, leaf)
    V = W @ S_inv
    top = np.concatenate([np_symmetrized(A_inv + V @ np.swapaxes(W, -1, -2)), -V], axis=-1)
    bottom = np.concatenate([-np.swapaxes(V, -1, -2), S_inv], axis=-1)
    return np.concatenate([top, bottom], axis=-2)


def _np_inverse_stack(M: np.ndarray, method: str) -> np.ndarray:
    n = M.shape[-1]
    if method == "inverse_op":
        return np.linalg.inv(M)
    if method == "schur":
        return np_schur_inverse(M)
    if method == "cholesky":
        Linv = np.linalg.solve(np.linalg.cholesky(M), np.broadcast_to(np.eye(n), M.shape))
        return np.swapaxes(Linv, -1, -2) @ Linv
    if method == "eigh":
        s, U = np.linalg.eigh(M)
        if not (s > 0).all():
            raise np.linalg.LinAlgError("not positive definite")
        return (U / s[..., None, :]) @ np.swapaxes(U, -1, -2)
    raise ConfigError(f"np_inverse: method {method!r} has no numpy implementation")


def np_inverse_batch(
    mats: Sequence[np.ndarray], method: str, previous: Sequence[np.ndarray | None] | None = None, **kw
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Invert many matrices, stacking those of equal size into one call per size."""
    previous = list(previous) if previous is not None else [None] * len(mats)
    out: list = [None] * len(mats)
    by_size: dict[int, list[int]] = {}
    for i, m in enumerate(mats):
        by_size.setdefault(np.shape(m)[-1], []).append(i)
    for n, idx in by_size.items():
        # the matrices' own precision (np_inverse computes in float64 where a method needs it)
        dtype = np.result_type(np.float32, *[np.asarray(mats[i]).dtype for i in idx])
        flat = [np.asarray(mats[i], dtype).reshape(-1, n, n) for i in idx]
        counts = [f.shape[0] for f in flat]
        prev = None
        if any(previous[i] is not None for i in idx):
            prev = _stack(
                [
                    np.asarray(previous[i], dtype).reshape(-1, n, n)
                    if previous[i] is not None
                    else np.broadcast_to(np.eye(n, dtype=dtype), f.shape)
                    for i, f in zip(idx, flat)
                ]
            )
        X, ok = np_inverse(_stack(flat), method, prev, **kw)
        start = 0
        for i, c in zip(idx, counts):
            shape = np.shape(mats[i])
            out[i] = (X[start : start + c].reshape(shape), ok[start : start + c].reshape(shape[:-2]))
            start += c
    return out


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


# =====================================================================================
# ONNX emitters
# =====================================================================================


def emit_eye(b: GraphBuilder, n: int) -> str:
    return b.const(np.eye(n), hint=f"eye{n}")


def emit_trace_mean(b: GraphBuilder, M: str, n: int, diag: bool = False) -> str:
    """tr(M)/n over the last axis/axes: a tensor of M's batch shape (scalar for one matrix)."""
    if diag:
        return b.reduce_mean(M, [-1])
    return b.scale(b.reduce_sum(b.mul(M, emit_eye(b, n)), [-2, -1]), 1.0 / n)


def emit_pi(b: GraphBuilder, A: str, nA: int, G: str, nG: int, a_diag=False, g_diag=False) -> str:
    """pi = sqrt((tr A/dim A) / (tr G/dim G)), 1 where a trace is tiny, negative or NaN/Inf."""
    ta, tg = emit_trace_mean(b, A, nA, a_diag), emit_trace_mean(b, G, nG, g_diag)
    eps = b.const(PI_EPS)
    big = b.const(np.finfo(np.float32).max)
    good = b.op("And", [b.op("Greater", [ta, eps]), b.op("Greater", [tg, eps])])
    good = b.op("And", [good, b.op("And", [b.op("Less", [ta, big]), b.op("Less", [tg, big])])])
    one = b.const(1.0)
    ratio = b.div(b.op("Where", [good, ta, one]), b.op("Where", [good, tg, one]))
    return b.op("Where", [good, b.op("Sqrt", [ratio]), one], hint="pi")


def emit_damping_split(b, A, nA, G, nG, damping: str, a_diag=False, g_diag=False) -> tuple[str, str]:
    """(pi sqrt(lambda), sqrt(lambda)/pi) as tensors of the factors' batch shape."""
    pi = emit_pi(b, A, nA, G, nG, a_diag, g_diag)
    s = b.op("Sqrt", [damping])
    return b.mul(pi, s), b.div(s, pi)


def emit_add_diagonal(b: GraphBuilder, M: str, n: int, d: str, diag: bool = False, batched: bool = False) -> str:
    """M + d I; d a scalar, or (batched) a tensor of M's batch shape [g]."""
    if diag:
        return b.add(M, b.unsqueeze(d, [-1]) if batched else d)
    dd = b.unsqueeze(d, [-1, -2]) if batched else d
    return b.add(M, b.mul(dd, emit_eye(b, n)))


def emit_all(b: GraphBuilder, flags: Sequence[str]) -> str:
    """One boolean scalar: every element of every flag tensor is True."""
    parts = []
    for f in flags:
        x = b.cast(f, b.float_type)
        parts.append(b.reduce("ReduceMin", x, None, keepdims=False))
    m = parts[0] if len(parts) == 1 else b.op("Min", parts)
    return b.op("Greater", [m, b.const(0.5)], hint="ok")


def emit_finite(b: GraphBuilder, x: str, axes: Sequence[int] | None = None) -> str:
    """Boolean (over the reduced `axes`, None = all): every element finite."""
    s = b.reduce_sum(b.op("Abs", [x]), axes) if axes is not None else b.reduce_sum(b.op("Abs", [x]), None)
    return b.op("Less", [s, b.const(np.inf)])  # False for NaN and +Inf


def emit_residual_ok(b: GraphBuilder, M: str, X: str, n: int, tol: float = RESIDUAL_TOL) -> str:
    """||M X - I||_F / sqrt(n) <= tol per matrix (False for NaN/Inf anywhere)."""
    R = b.sub(b.matmul(M, X), emit_eye(b, n))
    r = b.reduce("ReduceSumSquare", R, [-2, -1], keepdims=False)
    return b.op("LessOrEqual", [r, b.const(tol * tol * n)])


def emit_select(b: GraphBuilder, ok: str, new: str, old: str) -> str:
    """new where ok else old (ok a boolean scalar, or broadcastable)."""
    return b.op("Where", [ok, new, old], hint="keep_good")


def emit_newton_schulz(
    b: GraphBuilder, M: str, n: int, previous: str | None = None, iterations: int = NS_ITERATIONS
) -> tuple[str, str]:
    """Newton-Schulz inverse of SPD M [..., n, n]; returns (X, residual_ok per matrix).

    The residual squares each step (I - M X_{k+1} = (I - M X_k)^2), so the iteration
    converges iff the spectral radius of R_0 = I - M X_0 is below 1. Start: the previous
    inverse where a power iteration on R_0 (NS_PROBE_STEPS matrix-vector products from a
    fixed vector; growth rate ||R_0^m v||^(1/m)) estimates that radius below NS_WARM_RADIUS,
    else I / ||M||_F (all eigenvalues of M X_0 in (0, 1]). (||R_0||_F < 1 would be a proof
    but rejects most useful warm starts: R_0 is far from normal.) The ok test is
    on the last step's residual, which the iteration computes anyway: ||I - M X_{K-1}||_F /
    sqrt(n) <= sqrt(tol), so the result's residual is about tol or less.
    """
    eye = emit_eye(b, n)
    two_eye = b.const(2.0 * np.eye(n), hint=f"two_eye{n}")
    fro = b.op("Sqrt", [b.reduce("ReduceSumSquare", M, [-2, -1], keepdims=True)])
    fro = b.op("Max", [fro, b.const(np.finfo(np.float32).tiny)])
    X = b.div(eye, fro)
    if previous is not None:
        R0 = b.sub(eye, b.matmul(M, previous))
        v = b.const(_probe(n), hint="probe")
        for _ in range(NS_PROBE_STEPS):
            v = b.matmul(R0, v)
        g = b.reduce("ReduceSumSquare", v, [-2, -1], keepdims=True)  # growth^(2m)
        warm = b.op("Less", [g, b.const(NS_WARM_RADIUS ** (2 * NS_PROBE_STEPS))])
        X = b.op("Where", [warm, previous, X], hint="ns_start")
    P = None
    for _ in range(iterations):
        P = b.matmul(M, X)
        X = b.matmul(X, b.sub(two_eye, P))
    if P is None:
        return X, emit_residual_ok(b, M, X, n)
    r = b.reduce("ReduceSumSquare", b.sub(eye, P), [-2, -1], keepdims=False)
    ok = b.op("LessOrEqual", [r, b.const(RESIDUAL_TOL * n)])
    ok = b.op("And", [ok, emit_finite(b, X, [-2, -1])])
    return X, ok


def emit_probe_residual_ok(b: GraphBuilder, M: str, X: str, n: int, tol: float = RESIDUAL_TOL) -> str:
    """||M X v - v|| / ||v|| <= tol per matrix for the fixed random unit probe v: the
    residual test at the cost of two matrix-vector products instead of a MatMul (for R = M X
    - I and a random direction v, ||R v||^2 estimates ||R||_F^2 / n, the quantity
    emit_residual_ok bounds). False for NaN/Inf anywhere in X."""
    v = b.const(_probe(n), hint="probe")
    r = b.sub(b.matmul(M, b.matmul(X, v)), v)
    return b.op("LessOrEqual", [b.reduce("ReduceSumSquare", r, [-2, -1], keepdims=False), b.const(tol * tol)])


def emit_schur_inverse(b: GraphBuilder, M: str, n: int, leaf: int = SCHUR_LEAF) -> str:
    """Inverse of SPD M [..., n, n] by 2x2 blocks, recursively: with M = [[A, B], [B^T, D]],
    W = A^-1 B and the Schur complement S = D - B^T W (SPD when M is),

        M^-1 = [[A^-1 + W S^-1 W^T, -W S^-1], [-(W S^-1)^T, S^-1]],

    down to blocks of at most `leaf` rows, inverted by the Inverse op (LU). This is block
    Gaussian elimination (no pivoting needed on SPD matrices) with all its work in MatMuls,
    4/3 n^3 flops in all: ONNX Runtime's GEMMs on one thread beat LAPACK's potrf + potrs on
    the host (docs/conventions.md, "Which method"). The price is accuracy: the blocks are
    multiplied by explicit inverses instead of triangular solves, so the error grows like
    cond^2 eps rather than cond eps (float32, n = 257: 1.5e-5 at cond 1e3, 9e-3 at 1e5, not
    ok at 1e6, where LAPACK's Cholesky is still at 3e-3). The formulas take A^-1, S^-1 and
    M as symmetric, so every block inverse is symmetrized before it is used: without that,
    the rounding asymmetries compounded level by level (the digits autoencoder's 257 x 257
    input factor at cond 1e3: relative error 7e-2 in float32, 5e-8 in float64; with it 1e-4
    and 2e-13). The result is exactly symmetric."""
    X = _emit_schur(b, b.reshape(M, [-1, n, n]), n, leaf)
    return b.reshape(X, b.shape(M))


def _emit_schur(b: GraphBuilder, M: str, n: int, leaf: int) -> str:
    """emit_schur_inverse on a stack [g, n, n]."""
    if n <= leaf:
        return emit_symmetrized(b, b.op("Inverse", [M], domain="com.microsoft", hint="inverse"), rank=3)
    h = n // 2

    def block(r0: int, r1: int, c0: int, c1: int) -> str:
        return b.op("Slice", [M, b.ints([r0, c0]), b.ints([r1, c1]), b.ints([1, 2])], hint="block")

    A_inv = _emit_schur(b, block(0, h, 0, h), h, leaf)
    W = b.matmul(A_inv, block(0, h, h, n))
    S_inv = _emit_schur(b, b.sub(block(h, n, h, n), b.matmul(block(h, n, 0, h), W)), n - h, leaf)
    minus_V = b.neg(b.matmul(W, S_inv))
    top_left = emit_symmetrized(b, b.sub(A_inv, b.matmul(minus_V, b.transpose(W, [0, 2, 1]))), rank=3)
    top = b.op("Concat", [top_left, minus_V], axis=2)
    bottom = b.op("Concat", [b.transpose(minus_V, [0, 2, 1]), S_inv], axis=2)
    return b.op("Concat", [top, bottom], axis=1)


def emit_symmetrized(b: GraphBuilder, X: str, rank: int = 2) -> str:
    """(X + X^T) / 2 over the last two axes of a rank-`rank` tensor."""
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return b.scale(b.add(X, b.transpose(X, perm)), 0.5)


def emit_inverse(
    b: GraphBuilder,
    M: str,
    n: int,
    method: str = DEFAULT_METHOD,
    previous: str | None = None,
    iterations: int = NS_ITERATIONS,
    check: str | None = None,
    tol: float | None = None,
) -> tuple[str, str]:
    """Inverse of SPD M [..., n, n] in ONNX; returns (X, ok) with ok of M's batch shape.

    X is NOT yet guarded: callers select `Where(ok, X, previous)` (usually once per block,
    see FisherBlock.emit_inverse). `check`: "residual" (catches singular and non-finite
    inputs, one extra MatMul; inverse_op's default), "probe" (the same test with a random
    vector, two matrix-vector products; schur's default) or "finite" (only NaN/Inf in the
    result); `tol` its bound (default SCHUR_TOL for schur, else RESIDUAL_TOL).
    """
    method = concrete_method(method)
    if tol is None:
        tol = SCHUR_TOL if method == "schur" else RESIDUAL_TOL
    if method == "newton_schulz":
        return emit_newton_schulz(b, M, n, previous, iterations)
    if method == "inverse_op":
        X, check = b.op("Inverse", [M], domain="com.microsoft", hint="inverse"), check or "residual"
    elif method == "schur":
        X, check = emit_schur_inverse(b, M, n), check or "probe"
    else:
        raise ConfigError(
            f"inverse method {method!r} runs on the host (numpy): call the block's numpy_inverse, "
            f"or choose one of {', '.join(EMITTED_METHODS)} for an emitted inverse"
        )
    if check == "residual":
        return X, emit_residual_ok(b, M, X, n, tol)
    if check == "probe":
        return X, emit_probe_residual_ok(b, M, X, n, tol)
    return X, emit_finite(b, X, [-2, -1])


@dataclass
class InverseRequest:
    """One damped SPD matrix (or batch [g, n, n]) to invert; `previous` = last good inverse."""

    matrix: str
    n: int
    batch: tuple[int, ...] = ()
    previous: str | None = None


def emit_inverse_batch(
    b: GraphBuilder, requests: Sequence[InverseRequest], method: str = DEFAULT_METHOD, **kw
) -> list[tuple[str, str]]:
    """Invert many matrices: those of equal size are stacked ([sum batch, n, n]) so one
    Inverse / one Newton-Schulz chain serves all of them. Returns (X, ok) per request, ok
    of the request's batch shape."""
    out: list = [None] * len(requests)
    by_size: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_size.setdefault(r.n, []).append(i)
    for n, idx in by_size.items():
        if len(idx) == 1:
            r = requests[idx[0]]
            out[idx[0]] = emit_inverse(b, r.matrix, n, method, r.previous, **kw)
            continue
        counts = [int(np.prod(requests[i].batch)) if requests[i].batch else 1 for i in idx]
        stacked = b.op("Concat", [b.reshape(requests[i].matrix, [-1, n, n]) for i in idx], axis=0)
        prev = None
        if method == "newton_schulz" and any(requests[i].previous for i in idx):
            eye = b.const(np.eye(n)[None], hint=f"eye{n}_b")
            prev = b.op(
                "Concat",
                [
                    b.reshape(requests[i].previous, [-1, n, n])
                    if requests[i].previous
                    else b.op("Tile", [eye, b.ints([c, 1, 1])])
                    for i, c in zip(idx, counts)
                ],
                axis=0,
            )
        X, ok = emit_inverse(b, stacked, n, method, prev, **kw)
        Xs = b.split(X, counts, axis=0)
        oks = b.split(ok, counts, axis=0)
        for i, x, o in zip(idx, Xs, oks):
            batch = requests[i].batch
            out[i] = (b.reshape(x, [*batch, n, n]), b.reshape(o, list(batch)))
    return out


def emit_matpower_int(b: GraphBuilder, M: str, n: int, exp: int, method: str = DEFAULT_METHOD) -> tuple[str, str]:
    """M^exp for an integer exp in ONNX (negative: inverse first); returns (P, ok)."""
    if exp != int(exp):
        raise ConfigError(f"matrix power {exp} is not an integer: compute it on the host (method 'eigh')")
    exp = int(exp)
    if exp == 0:
        return b.op("Add", [b.mul(M, b.const(0.0)), emit_eye(b, n)]), emit_finite(b, M, [-2, -1])
    ok = None
    base = M
    if exp < 0:
        base, ok = emit_inverse(b, M, n, method)
        exp = -exp
    P = base
    for _ in range(exp - 1):
        P = b.matmul(P, base)
    fin = emit_finite(b, P, [-2, -1])
    return P, fin if ok is None else b.op("And", [ok, fin])


def flops_inverse(n: int, method: str = DEFAULT_METHOD, iterations: int = NS_ITERATIONS) -> int:
    """Rough FLOPs of one n x n inverse incl. the residual check."""
    if method == "newton_schulz":
        return 4 * n**3 * iterations + 2 * n**3
    if method == "eigh":
        return 10 * n**3
    if method == "cholesky":
        return n**3  # n^3/3 factor + triangular inverse + product
    if method == "schur":
        return 4 * n**3 // 3 + 4 * n**2  # MatMuls n^3 + 2 (n/2)^3 + ..., the probe
    return 4 * n**3  # LU inverse (2 n^3) + residual MatMul (2 n^3)
