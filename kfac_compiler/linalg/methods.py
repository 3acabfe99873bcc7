"""The inverse methods, their constants, the choice of "auto" per device and FLOP counts (a
leaf module: host.py and emitted.py import from here)."""
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

# blocks up to this size are inverted by the Inverse op (see emit_schur_inverse). The Schur
# tree has about n / SCHUR_LEAF leaves and ~22 nodes per leaf: at 48, ResNet-18's 1153-wide
# factor took 688 nodes (32 Inverse leaves), at 96 336, with the same accuracy against
# numpy.linalg.inv (float32, cond 1e4: 1.2e-3 and 1.1e-3); ORT's Inverse (Eigen's LU) on a
# 96-row block takes ~0.2 ms against ~0.05 ms at 48 rows, about what the ~20 nodes a leaf
# of 48 adds cost to schedule (benchmarks/results/2026-11-29-step-nodes-lean.md)
SCHUR_LEAF = 96
# emit_inverse_batch stacks a matrix with larger ones (padded by an identity block) down to
# this fraction of their size: one Schur tree instead of two for the n and n + 1 (bias) of a
# layer's A and the next layer's G, at most (1/0.95)^3 = 1.17x the smaller one's work
SIZE_CLASS_RATIO = 0.95
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
# The emitted matrix square root (emitted.emit_sqrt_pair): coupled Newton-Schulz iterations
# on M / ||M||_F; 30 reach float32 accuracy up to cond(M) ~ 1e6 (relative error of M^-1/2:
# 3e-6 at cond 1e2, 5e-4 at 1e5, 3e-3 at 1e6, n = 200); ok <=> the probe residual
# ||Z M Z v - v|| (Z ~ M^-1/2) is at most SQRT_TOL, else the host (eigh) redoes the block.
SQRT_ITERATIONS = 30
SQRT_TOL = 1e-2


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ConfigError(f"unknown inverse method {method!r}; expected one of {', '.join(METHODS)}")
    return method


def concrete_method(method: str, device: str | None = None) -> str:
    """The method "auto" stands for where the inverses run: the emitted "schur" on a device
    (its accuracy bound SCHUR_TOL sends ill-conditioned blocks to host Cholesky,
    runtime/inverses.py), "inverse_op" when emitting a plan without one. On the CPU its
    MatMuls beat LAPACK's Cholesky on the host at every factor size measured (256..4609
    rows: 1.8-2.3x, so "auto" does not depend on the size; docs/conventions.md, "Large
    factors"); on CUDA, ORT's Inverse kernel is cuBLAS's batched LU, made for many small
    matrices, and crawls on factors of thousands of rows (docs/conventions.md, "Which
    method")."""
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
        return 7 * n**3 // 3  # potrf n^3/3 + potrs against the identity (two triangular solves, 2 n^3)
    if method == "schur":
        return 4 * n**3 // 3 + 4 * n**2  # MatMuls n^3 + 2 (n/2)^3 + ..., the probe
    return 4 * n**3  # LU inverse (2 n^3) + residual MatMul (2 n^3)
