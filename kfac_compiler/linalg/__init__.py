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
                     and on CUDA (docs/conventions.md, "Which method"), but its error grows
                     like cond^2 eps, so it is ok only while its probe residual is at most
                     SCHUR_TOL = 1e-2 (cond <~ 1e5); the rest go to the fallback.
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

Modules: this one (the methods, their constants and FLOP counts), host.py (the numpy twins
and host inverses, np_*), emitted.py (the ONNX emitters, emit_*); both are re-exported here.
"""
from __future__ import annotations

import numpy as np

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
    runtime/inverses.py), "inverse_op" when emitting a plan without one. On the CPU its
    MatMuls beat LAPACK's Cholesky on the host; on CUDA, ORT's Inverse kernel is cuBLAS's
    batched LU, made for many small matrices, and crawls on factors of thousands of rows
    (measurements: docs/conventions.md, "Which method")."""
    if check_method(method) != AUTO_METHOD:
        return method
    return "schur" if device in ("cpu", "cuda") else DEFAULT_METHOD


def is_host_method(method: str) -> bool:
    """True for methods computed on the host with numpy (the block's numpy_inverse); "auto"
    is emitted (inverse_op) unless resolved for a CPU device first (concrete_method)."""
    return check_method(method) in HOST_METHODS


def probe_vector(n: int) -> np.ndarray:
    """Fixed unit start vector [n, 1] of the power iteration that vets a warm start."""
    v = np.random.default_rng(12345).standard_normal((n, 1))
    return v / np.linalg.norm(v)


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


from kfac_compiler.linalg.emitted import *  # noqa: E402,F401,F403
from kfac_compiler.linalg.emitted import _emit_schur  # noqa: E402,F401
from kfac_compiler.linalg.host import *  # noqa: E402,F401,F403
