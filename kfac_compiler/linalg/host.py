"""Host-side (numpy, LAPACK) damped inverses and matrix powers: the twins of the emitted
methods, and the host methods "cholesky" and "eigh" (float64 inside)."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import numpy as np

from kfac_compiler.errors import ConfigError
from kfac_compiler.linalg.methods import (
    NS_ITERATIONS,
    NS_PROBE_STEPS,
    NS_WARM_RADIUS,
    PI_EPS,
    RESIDUAL_TOL,
    SCHUR_LEAF,
    concrete_method,
    probe_vector,
)


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
            v = np.broadcast_to(probe_vector(n), (*M.shape[:-2], n, 1))
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


def np_cholesky_inverse_batch(M: np.ndarray, previous: np.ndarray | None = None,
                               blas_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of SPD M ([..., n, n]) by LAPACK potrf + potrs against the identity, in M's
    precision (float32 stays float32: potrf succeeding certifies the matrix positive definite
    and is backward stable, so no residual check is needed). potrs' two triangular solves
    with n right-hand sides (2n^3 flops) run faster than potri's triangular inverse and
    product (n^3 flops, but a slower kernel) at the factor sizes here. The solution is
    symmetric only to rounding, so it is symmetrized. ok = potrf
    succeeded and the result is finite; where not ok the result is `previous` or the identity.
    `blas_threads`: LAPACK's threads (one_blas_thread explains why one is the default)."""
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
    with np.errstate(all="ignore"), one_blas_thread(blas_threads):
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
    and scan the loaded BLAS libraries (threadpoolctl), so that no step pays for them."""
    import scipy.linalg.lapack  # noqa: F401

    _blas_controller()


@contextlib.contextmanager
def one_blas_thread(threads: int = 1):
    """Run BLAS/LAPACK (OpenBLAS, MKL) on the calling thread only (or on `threads`). Worker
    threads would busy-wait for ~0.1 s after each call and steal the cores ONNX Runtime's
    pool is spinning on (on 2 cores the K-FAC step took 2x longer). Re-entrant: an inverse
    refresh enters it once for all its blocks, and the nested entries cost nothing (the
    outermost limit holds)."""
    global _blas_limit_depth
    ctl = _blas_controller() if _blas_limit_depth == 0 else None
    limiter = ctl.limit(limits=int(threads), user_api="blas") if ctl is not None else None
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
