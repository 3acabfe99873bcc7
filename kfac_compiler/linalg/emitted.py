"""Damped inverses and matrix powers emitted as ONNX nodes (they run where the session
runs: the GPU for a CUDA session)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from onnx import numpy_helper

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError
from kfac_compiler.linalg.methods import (
    DEFAULT_METHOD,
    EMITTED_METHODS,
    NS_ITERATIONS,
    NS_PROBE_STEPS,
    NS_WARM_RADIUS,
    PI_EPS,
    RESIDUAL_TOL,
    SCHUR_LEAF,
    SCHUR_TOL,
    SIZE_CLASS_RATIO,
    SQRT_ITERATIONS,
    SQRT_TOL,
    concrete_method,
    probe_vector,
)


def emit_eye(b: GraphBuilder, n: int) -> str:
    """I [n, n] built at run time (EyeLike of ConstantOfShape): an n x n initializer would be
    stored in the plan's files (85 MB for n = 4609). ONNX Runtime folds the two nodes and
    merges every use of the same n into one constant of the session."""
    zeros = b.op("ConstantOfShape", [b.ints([n, n])], value=numpy_helper.from_array(np.zeros(1, b.np_float)),
                 hint=f"zeros{n}")
    return b.op("EyeLike", [zeros], hint=f"eye{n}")


def _emit_flat_diagonal(b: GraphBuilder, M: str, n: int) -> tuple[str, str, str]:
    """(M as [B, n n], its diagonal [B, n] (every (n+1)-th entry: a strided Slice), the
    diagonal's flat positions [n]). No n x n identity is made: ONNX Runtime folds a
    constant-only eye into a constant of every session that uses it (85 MB for n = 4609)."""
    flat = b.reshape(M, [-1, n * n])
    d = b.op("Slice", [flat, b.ints([0]), b.ints([n * n]), b.ints([1]), b.ints([n + 1])], hint="diagonal")
    at = b.op("Range", [b.const(0, np.int64), b.const(n * n, np.int64), b.const(n + 1, np.int64)], hint="diagonal_at")
    return flat, d, at


def emit_diagonal(b: GraphBuilder, M: str, n: int) -> str:
    """diag(M) [..., n] of M [..., n, n]."""
    _, d, _ = _emit_flat_diagonal(b, M, n)
    return b.reshape(d, b.shape(M, 0, -1))


def emit_shift_diagonal(b: GraphBuilder, M: str, n: int, v: str) -> str:
    """M + v I for M [..., n, n] and v broadcastable to the diagonal [..., n] (e.g. a scalar,
    or [..., 1]): the diagonal is gathered, shifted and scattered back into a copy of M."""
    flat, d, at = _emit_flat_diagonal(b, M, n)
    shifted = b.reshape(b.add(b.reshape(d, b.shape(M, 0, -1)), v), [-1, n])
    at = b.op("Expand", [b.unsqueeze(at, [0]), b.op("Shape", [d])])
    out = b.op("ScatterElements", [flat, at, shifted], axis=1, hint="diagonal_shifted")
    return b.reshape(out, b.shape(M))


def emit_trace_mean(b: GraphBuilder, M: str, n: int, diag: bool = False) -> str:
    """tr(M)/n over the last axis/axes: a tensor of M's batch shape (scalar for one matrix)."""
    return b.reduce_mean(M if diag else emit_diagonal(b, M, n), [-1])


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
    return emit_shift_diagonal(b, M, n, b.unsqueeze(d, [-1]) if batched else d)


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
    R = emit_shift_diagonal(b, b.matmul(M, X), n, b.const(-1.0))
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
    on the last step's residual, which the iteration computes anyway: ||I - M X_{K-1}||_F^2
    <= tol sqrt(n), so that ||I - M X_K||_F / sqrt(n) <= ||I - M X_{K-1}||_F^2 / sqrt(n) <= tol
    (submultiplicativity; the bound had been tol n, which let unconverged inverses with
    residuals 0.14-0.21 and 51-69% error through at n = 33..257).
    """
    eye = emit_eye(b, n)
    two_eye = b.scale(eye, 2.0)
    fro = b.op("Sqrt", [b.reduce("ReduceSumSquare", M, [-2, -1], keepdims=True)])
    fro = b.op("Max", [fro, b.const(np.finfo(np.float32).tiny)])
    X = b.div(eye, fro)
    if previous is not None:
        R0 = b.sub(eye, b.matmul(M, previous))
        v = b.const(probe_vector(n), hint="probe")
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
    ok = b.op("LessOrEqual", [r, b.const(RESIDUAL_TOL * math.sqrt(n))])
    ok = b.op("And", [ok, emit_finite(b, X, [-2, -1])])
    return X, ok


def emit_probe_residual_ok(b: GraphBuilder, M: str, X: str, n: int, tol: float = RESIDUAL_TOL) -> str:
    """||M X v - v|| / ||v|| <= tol per matrix for the fixed random unit probe v: the
    residual test at the cost of two matrix-vector products instead of a MatMul (for R = M X
    - I and a random direction v, ||R v||^2 estimates ||R||_F^2 / n, the quantity
    emit_residual_ok bounds). False for NaN/Inf anywhere in X."""
    v = b.const(probe_vector(n), hint="probe")
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
    b: GraphBuilder, requests: Sequence[InverseRequest], method: str = DEFAULT_METHOD,
    sizes: Sequence[int] = (), **kw
) -> list[tuple[str, str]]:
    """Invert many matrices: those of a size class (size_classes: equal sizes, and sizes a
    few percent apart) are stacked ([sum batch, m, m]) so one Inverse / one Schur tree / one
    Newton-Schulz chain serves all of them. Returns (X, ok) per request, ok of the
    request's batch shape.

    A smaller matrix M [n, n] joins its class as blockdiag(M, I) [m, m], whose inverse is
    blockdiag(M^-1, I) (its previous inverse likewise): the zero blocks stay exactly zero
    through every product and LU pivot, so M^-1 comes out as it would alone, up to the
    different splits of the Schur recursion; its top-left n x n block is sliced out. The
    probe and residual checks see the identity block exactly inverted.

    `sizes`: more sizes that decide the classes (a program that inverts a subset of the
    plan's blocks passes every block's, so that each matrix is padded to the stack size it
    would have among all of them: the same inverse, to the bit, whichever refresh group or
    data-parallel rank computes it)."""
    out: list = [None] * len(requests)
    classes = size_classes([r.n for r in requests] + list(sizes))
    by_size: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_size.setdefault(classes[r.n], []).append(i)
    for m, idx in by_size.items():
        if len(idx) == 1 and requests[idx[0]].n == m:
            r = requests[idx[0]]
            out[idx[0]] = emit_inverse(b, r.matrix, m, method, r.previous, **kw)
            continue
        counts = [int(np.prod(requests[i].batch)) if requests[i].batch else 1 for i in idx]
        stacked = _emit_stack(b, [_emit_padded(b, b.reshape(requests[i].matrix, [-1, requests[i].n, requests[i].n]),
                                               requests[i].n, m) for i in idx])
        prev = None
        if method == "newton_schulz" and any(requests[i].previous for i in idx):
            eye = b.unsqueeze(emit_eye(b, m), [0])
            prev = _emit_stack(b, [
                _emit_padded(b, b.reshape(requests[i].previous, [-1, requests[i].n, requests[i].n]), requests[i].n, m)
                if requests[i].previous else b.op("Tile", [eye, b.ints([c, 1, 1])])
                for i, c in zip(idx, counts)
            ])
        X, ok = emit_inverse(b, stacked, m, method, prev, **kw)
        Xs = b.split(X, counts, axis=0) if len(idx) > 1 else [X]
        oks = b.split(ok, counts, axis=0) if len(idx) > 1 else [ok]
        for i, x, o in zip(idx, Xs, oks):
            r = requests[i]
            if r.n < m:
                x = b.op("Slice", [x, b.ints([0, 0]), b.ints([r.n, r.n]), b.ints([1, 2])], hint="unpadded")
            out[i] = (b.reshape(x, [*r.batch, r.n, r.n]), b.reshape(o, list(r.batch)))
    return out


def size_classes(sizes: Sequence[int], ratio: float = SIZE_CLASS_RATIO, small: int = SCHUR_LEAF) -> dict[int, int]:
    """{size n: the size m of the stack it is inverted in}: from the largest size down, a
    size joins the current class while n >= ratio * m (at most (1/ratio)^3 times its own
    work), or while m <= small (a leaf-sized inverse, where the nodes cost more than the
    flops)."""
    out: dict[int, int] = {}
    top = None
    for n in sorted(set(sizes), reverse=True):
        if top is None or not (n >= ratio * top or top <= small):
            top = n
        out[n] = top
    return out


def _emit_padded(b: GraphBuilder, M: str, n: int, m: int) -> str:
    """[B, n, n] -> blockdiag(M, I) [B, m, m] (M itself when n = m)."""
    if n == m:
        return M
    eye = b.op("Pad", [b.const(np.eye(m - n)[None]), b.ints([0, n, n, 0, 0, 0])], hint="pad_eye")
    return b.add(b.op("Pad", [M, b.ints([0, 0, 0, 0, m - n, m - n])]), eye)


def _emit_stack(b: GraphBuilder, xs: Sequence[str]) -> str:
    """Concat on axis 0, or the one tensor."""
    return xs[0] if len(xs) == 1 else b.op("Concat", list(xs), axis=0)


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


def is_half_integer(exp: float) -> bool:
    """True for the powers the emitted graphs take: integers and k/2."""
    return float(2 * exp).is_integer()


def emit_sqrt_pair(b: GraphBuilder, M: str, n: int, iterations: int = SQRT_ITERATIONS) -> tuple[str, str, str]:
    """(M^1/2, M^-1/2, ok per matrix) of SPD M [..., n, n] by the coupled Newton-Schulz
    iteration (Higham, Functions of Matrices, 6.3): with c = ||M||_F (so the spectrum of
    Y_0 = M / c lies in (0, 1]) and Z_0 = I, T = (3I - Z Y)/2, Y <- Y T, Z <- T Z; Y -> (M/c)^1/2
    and Z -> (M/c)^-1/2, all MatMuls (the GPU's strength) and stable in float32. ok: every
    value finite and the probe residual ||Z M Z v - v|| <= SQRT_TOL (a block that fails is
    recomputed on the host by eigh, like a failed inverse)."""
    eye = emit_eye(b, n)
    three_halves = b.scale(eye, 1.5)
    c = b.op("Sqrt", [b.reduce("ReduceSumSquare", M, [-2, -1], keepdims=True)])
    c = b.op("Max", [c, b.const(np.finfo(np.float32).tiny)])
    Y, Z = b.div(M, c), None
    for _ in range(iterations):
        T = b.sub(three_halves, b.scale(Y if Z is None else b.matmul(Z, Y), 0.5))
        Y, Z = b.matmul(Y, T), (T if Z is None else b.matmul(T, Z))
    root = b.op("Sqrt", [c])
    Y, Z = b.mul(Y, root), b.div(Z, root)
    v = b.const(probe_vector(n), hint="probe")
    r = b.sub(b.matmul(Z, b.matmul(M, b.matmul(Z, v))), v)
    ok = b.op("LessOrEqual", [b.reduce("ReduceSumSquare", r, [-2, -1], keepdims=False), b.const(SQRT_TOL ** 2)])
    ok = b.op("And", [ok, b.op("And", [emit_finite(b, Y, [-2, -1]), emit_finite(b, Z, [-2, -1])])])
    return Y, Z, ok


def emit_matpower(b: GraphBuilder, M: str, n: int, exp: float, method: str = DEFAULT_METHOD) -> tuple[str, str]:
    """M^exp of SPD M [..., n, n] for an integer or half-integer exp in ONNX; returns (P, ok).
    Integers: emit_matpower_int; k/2 with k odd: (M^(+-1/2))^|k| from emit_sqrt_pair (no
    inverse needed for negative powers). Other exps need an eigendecomposition: ConfigError
    naming the host way."""
    if not is_half_integer(exp):
        raise ConfigError(
            f"matrix power {exp:g} is neither an integer nor a half-integer: compute it on the host "
            "(numpy_matpower, Curvature.multiply_matpower)"
        )
    if float(exp).is_integer():
        return emit_matpower_int(b, M, n, int(exp), method)
    k = int(round(2 * exp))
    Y, Z, ok = emit_sqrt_pair(b, M, n)
    base = Y if k > 0 else Z
    P = base
    for _ in range(abs(k) - 1):
        P = b.matmul(P, base)
    return P, b.op("And", [ok, emit_finite(b, P, [-2, -1])])
