"""Gemm, MatMul and Det (the matrix-level linear algebra)."""
from __future__ import annotations

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    add_n,
    attr,
    c,
    dim_parts,
    expand_to,
    inp,
    make_shape,
    need,
    unbroadcast,
    unsupported,
)


# ------------------------------------------------------------------------------- Gemm
@register("Gemm")
def _gemm_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    A, B = node.input[0], node.input[1]
    C = inp(node, 2)
    Y = node.output[0]
    n_in = len(node.input)
    if g is None:
        return [None] * n_in
    alpha = float(attr(node, "alpha", 1.0))
    beta = float(attr(node, "beta", 1.0))
    ta, tb = int(attr(node, "transA", 0)), int(attr(node, "transB", 0))
    al = None if alpha == 1.0 else alpha
    res: list[str | None] = [None] * n_in
    if need(needs, 0):
        # A' = op(A): dA' = alpha g B'^T ; dA = dA' or dA'^T
        if not ta:
            res[0] = b.op("Gemm", [g, B], alpha=al, transB=None if tb else 1)
        else:
            res[0] = b.op("Gemm", [B, g], alpha=al, transA=1 if tb else None, transB=1)
    if need(needs, 1):
        # dB' = alpha A'^T g ; dB = dB' or dB'^T
        if not tb:
            res[1] = b.op("Gemm", [A, g], alpha=al, transA=None if ta else 1)
        else:
            res[1] = b.op("Gemm", [g, A], alpha=al, transA=1, transB=1 if ta else None)
    if C is not None and n_in > 2 and need(needs, 2):
        gc = unbroadcast(b, view, g, C, Y)
        res[2] = gc if beta == 1.0 else b.mul(gc, c(b, beta))
    return res


@_gemm_vjp.defjvp
def _gemm_jvp(b, view, node, ts):
    A, B = node.input[0], node.input[1]
    C = inp(node, 2)
    Y = node.output[0]
    alpha = float(attr(node, "alpha", 1.0))
    beta = float(attr(node, "beta", 1.0))
    kw = dict(alpha=None if alpha == 1.0 else alpha, transA=attr(node, "transA"), transB=attr(node, "transB"))
    tA, tB = ts[0], ts[1]
    tC = ts[2] if len(ts) > 2 and C is not None else None
    terms = []
    cb = None if beta == 1.0 else beta
    if tA is not None:
        terms.append(b.op("Gemm", [tA, B] + ([tC] if tC else []), beta=cb if tC else None, **kw))
        tC = None
    if tB is not None:
        terms.append(b.op("Gemm", [A, tB] + ([tC] if tC else []), beta=cb if tC else None, **kw))
        tC = None
    if tC is not None:
        t = expand_to(b, view, tC, C, Y)
        terms.append(t if beta == 1.0 else b.mul(t, c(b, beta)))
    return [add_n(b, terms)]


# ----------------------------------------------------------------------------- MatMul
def _swap_last(b, x: str, r: int) -> str:
    return b.transpose(x, list(range(r - 2)) + [r - 1, r - 2])


@register("MatMul")
def _matmul_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    A, B = node.input
    Y = node.output[0]
    if g is None:
        return [None, None]
    ra, rb = view.rank(A), view.rank(B)
    if ra is None or rb is None:
        raise unsupported(node, view, "needs the ranks of its inputs (run shape inference)")
    if ra == 1 and rb == 1:  # dot product
        return [b.mul(g, B) if need(needs, 0) else None, b.mul(g, A) if need(needs, 1) else None]
    sa, sb, sy = view.shape(A), view.shape(B), view.shape(Y)
    batch = None if sy is None else tuple(sy[: len(sy) - (ra > 1) - (rb > 1)])
    ry = max(ra, rb) - (ra == 1) - (rb == 1)
    # promote 1-D operands to matrices, as MatMul does
    g2 = g
    if ra == 1:
        g2 = b.unsqueeze(g2, [ry - 1])
    if rb == 1:
        g2 = b.unsqueeze(g2, [ry])
    A2 = A if ra > 1 else b.unsqueeze(A, [0])
    B2 = B if rb > 1 else b.unsqueeze(B, [1])
    ra2, rb2 = max(ra, 2), max(rb, 2)
    r2 = max(ra2, rb2)
    gA = gB = None
    if need(needs, 0):
        if ra2 == 2 and rb2 == 2:
            d = b.op("Gemm", [g2, B2], transB=1)
        else:
            d = b.matmul(g2, _swap_last(b, B2, rb2))
        if ra == 1:
            d = b.squeeze(d, [r2 - 2])
            rs = None if batch is None else batch + tuple(sa)
        else:
            rs = None if batch is None or sa is None else batch + tuple(sa[-2:])
        gA = d if rb2 == 2 and ra > 1 else unbroadcast(b, view, d, A, rshape=rs)
    if need(needs, 1):
        if ra2 == 2 and rb2 == 2:
            d = b.op("Gemm", [A2, g2], transA=1)
        elif rb2 == 2:
            # A batched, B a matrix: fold the batch into the rows (no batched product)
            k = dim_parts(b, view, B, 0, 1)
            n = [1] if rb == 1 else dim_parts(b, view, B, 1, 2)
            a_rows = b.reshape(A2, make_shape(b, [-1] + k))
            g_rows = b.reshape(g2, make_shape(b, [-1] + n))
            d = b.op("Gemm", [a_rows, g_rows], transA=1)
        else:
            d = b.matmul(_swap_last(b, A2, ra2), g2)
        if rb == 1:
            d = b.squeeze(d, [1])  # d is [K, 1] here
            rs = None if batch is None else batch + tuple(sb)
        else:
            rs = None if batch is None or sb is None else batch + tuple(sb[-2:])
        gB = d if rb2 == 2 or ra2 == 2 else unbroadcast(b, view, d, B, rshape=rs)
    return [gA, gB]


@_matmul_vjp.defjvp
def _matmul_jvp(b, view, node, ts):
    A, B = node.input
    ra, rb = view.rank(A), view.rank(B)
    if ts[0] is not None and ts[1] is not None and rb == 2 and ra is not None and ra >= 2:
        # A linear layer (B a matrix) with both tangents: tA B + A tB as one Gemm that adds
        # A tB into tA B (the batch folded into the rows), the same sums bit for bit, and one
        # output-sized tensor fewer than two products and their Add (a vocabulary's logits)
        k = dim_parts(b, view, B, 0, 1)
        rows = dim_parts(b, view, A, 0, -1) + dim_parts(b, view, B, 1, 2)
        first = b.op("Gemm", [b.reshape(ts[0], make_shape(b, [-1] + k)), B])
        both = b.op("Gemm", [b.reshape(A, make_shape(b, [-1] + k)), ts[1], first])
        return [b.reshape(both, make_shape(b, rows))]
    terms = []
    if ts[0] is not None:
        terms.append(b.matmul(ts[0], B))
    if ts[1] is not None:
        terms.append(b.matmul(A, ts[1]))
    return [add_n(b, terms)]


# -------------------------------------------------------------------------------- Det
def _cofactors(b, view, node) -> tuple[str, int]:
    """The cofactor matrix C of A [..., M, M] (d det(A) = sum(C * dA)), from the
    determinants of its M^2 minors (Gather rows, Gather columns, Det): no inverse, so it
    holds for singular A too. Needs a static M and rank; returns (C, the batch rank)."""
    a = node.input[0]
    s = view.shape(a)
    if s is None or not isinstance(s[-1], int):
        raise unsupported(node, view, "needs its input's rank and a static matrix size")
    nb, m = len(s) - 2, int(s[-1])
    if m == 1:
        return c(b, np.ones([1] * (nb + 2))), nb
    others = b.ints(np.asarray([[k for k in range(m) if k != i] for i in range(m)]).reshape(-1))
    others = b.reshape(others, [m, m - 1])
    rows = b.op("Gather", [a, others], axis=nb)                 # [..., i, a, M]
    minors = b.op("Gather", [rows, others], axis=nb + 2)        # [..., i, a, j, b]
    minors = b.transpose(minors, list(range(nb)) + [nb, nb + 2, nb + 1, nb + 3])
    sign = (-1.0) ** np.add.outer(np.arange(m), np.arange(m))
    return b.mul(b.op("Det", [minors]), c(b, sign)), nb


@register("Det", inputs=(0,))
def _det_vjp(b, view, node, gys):
    """dA = g * cofactors(A) (= g det(A) A^-T where A is invertible)."""
    g = gys[0]
    if g is None:
        return [None]
    cof, nb = _cofactors(b, view, node)
    return [b.mul(b.unsqueeze(g, [nb, nb + 1]), cof)]


@_det_vjp.defcheck
def _det_check(view, node):
    s = view.shape(node.input[0])
    if s is None or not isinstance(s[-1], int):
        raise unsupported(node, view, "needs its input's rank and a static matrix size")


@_det_vjp.defjvp
def _det_jvp(b, view, node, ts):
    t = ts[0]
    if t is None:
        return [None]
    cof, nb = _cofactors(b, view, node)
    return [b.reduce_sum(b.mul(cof, t), [nb, nb + 1])]
