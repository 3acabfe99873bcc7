"""Normalizations: LayerNormalization, BatchNormalization (training and inference forms),
InstanceNormalization, GroupNormalization (opset 18: scale/bias per group [G]; opset 21:
per channel [C]); LpNormalization, LRN and MeanVarianceNormalization (no parameters). They share the recomputed statistics (`_stats`) and the symmetric
projection that is both the vjp and the jvp of x -> xhat (`_proj`)."""
from __future__ import annotations

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    add_n,
    attr,
    c,
    inp,
    need,
    recip0,
    shape_tensor,
    static_shape,
    unbroadcast,
    unsupported,
)


def _stats(b, x: str, axes, eps: float):
    mean = b.reduce_mean(x, axes, keepdims=True)
    xc = b.sub(x, mean)
    var = b.reduce_mean(b.mul(xc, xc), axes, keepdims=True)
    inv = b.div(c(b, 1.0), b.op("Sqrt", [b.add(var, c(b, eps))]))
    return mean, inv, b.mul(xc, inv)


def _proj(b, v: str, xhat: str, inv: str, axes) -> str:
    """Jacobian of x -> xhat applied to v (symmetric): inv (v - mean(v) - xhat mean(v xhat))."""
    m1 = b.reduce_mean(v, axes, keepdims=True)
    m2 = b.reduce_mean(b.mul(v, xhat), axes, keepdims=True)
    return b.mul(inv, b.sub(b.sub(v, m1), b.mul(xhat, m2)))


def _rank_or_fail(view, node, x):
    r = view.rank(x)
    if r is None:
        raise unsupported(node, view, "needs the input rank (run shape inference)")
    return r


def trailing_axes(view, node):
    """The axes from the node's `axis` attribute on (LayerNormalization, RMSNormalization)."""
    axis = int(attr(node, "axis", -1))
    r = view.rank(node.input[0])
    if axis < 0:
        return list(range(axis, 0)) if r is None else list(range(axis + r, r))
    if r is None:
        raise unsupported(node, view, "with a non-negative axis needs the input rank (run shape inference)")
    return list(range(axis, r))


@register("LayerNormalization", since=17)
def _ln_vjp(b, view, node, gys, needs=None):
    X, S = node.input[0], node.input[1]
    B = inp(node, 2)
    n_in = len(node.input)
    g, gm, gi = (list(gys) + [None, None, None])[:3]
    res: list[str | None] = [None] * n_in
    if g is None and gm is None and gi is None:
        return res
    axes = trailing_axes(view, node)
    eps = float(attr(node, "epsilon", 1e-5))
    mean, inv, xhat = _stats(b, X, axes, eps)
    if need(needs, 0):
        terms = []
        if g is not None:
            terms.append(_proj(b, b.mul(g, S), xhat, inv, axes))
        if gm is not None or gi is not None:
            xs = static_shape(view, X)
            if xs is not None:
                M = c(b, float(np.prod([xs[a] for a in axes])))
            else:
                M = b.div(b.cast(b.op("Size", [X]), b.float_type), b.cast(b.op("Size", [mean]), b.float_type))
            if gm is not None:
                terms.append(b.op("Expand", [b.div(gm, M), b.op("Shape", [X])]))
            if gi is not None:
                terms.append(b.neg(b.div(b.mul(b.mul(gi, b.mul(inv, inv)), xhat), M)))
        res[0] = add_n(b, terms)
    if g is not None and need(needs, 1):
        res[1] = unbroadcast(b, view, b.mul(g, xhat), S, X)
    if g is not None and B is not None and need(needs, 2):
        res[2] = unbroadcast(b, view, g, B, X)
    return res


@_ln_vjp.defjvp
def _ln_jvp(b, view, node, ts):
    X, S = node.input[0], node.input[1]
    B = inp(node, 2)
    tX, tS = ts[0], ts[1]
    tB = ts[2] if len(ts) > 2 and B else None
    axes = trailing_axes(view, node)
    mean, inv, xhat = _stats(b, X, axes, float(attr(node, "epsilon", 1e-5)))
    terms = []
    if tX is not None:
        terms.append(b.mul(_proj(b, tX, xhat, inv, axes), S))
    if tS is not None:
        terms.append(b.mul(xhat, tS))
    if tB is not None:
        terms.append(b.op("Expand", [tB, shape_tensor(b, view, X)]) if not terms else tB)
    ty = add_n(b, terms)
    res = [ty]
    if len(node.output) > 1:
        res.append(b.reduce_mean(tX, axes, keepdims=True) if tX is not None and node.output[1] else None)
    if len(node.output) > 2:
        res.append(
            b.neg(b.mul(b.mul(inv, inv), b.reduce_mean(b.mul(xhat, tX), axes, keepdims=True)))
            if tX is not None and node.output[2] else None
        )
    return res


def _chan(b, t: str, r: int) -> str:
    """A per-channel [C] vector reshaped to broadcast over [N, C, *spatial]."""
    return t if r == 2 else b.reshape(t, [-1] + [1] * (r - 2))


@register("BatchNormalization")
def _bn_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    n_in = len(node.input)
    res: list[str | None] = [None] * n_in
    if g is None:
        return res
    X, S, B, mean, var = node.input[:5]
    r = _rank_or_fail(view, node, X)
    eps = float(attr(node, "epsilon", 1e-5))
    axes = [0] + list(range(2, r))
    if int(attr(node, "training_mode", 0)):
        _, inv, xhat = _stats(b, X, axes, eps)
        if need(needs, 0):
            res[0] = _proj(b, b.mul(g, _chan(b, S, r)), xhat, inv, axes)
    else:
        inv = b.div(c(b, 1.0), b.op("Sqrt", [b.add(var, c(b, eps))]))
        xhat = b.mul(b.sub(X, _chan(b, mean, r)), _chan(b, inv, r))
        if need(needs, 0):
            res[0] = b.mul(g, _chan(b, b.mul(S, inv), r))
        if need(needs, 3) or need(needs, 4):
            gB = b.reduce_sum(g, axes, keepdims=False)
            gxh = b.reduce_sum(b.mul(g, xhat), axes, keepdims=False)
            si = b.mul(S, inv)
            if need(needs, 3):
                res[3] = b.neg(b.mul(gB, si))
            if need(needs, 4):
                res[4] = b.mul(b.mul(gxh, b.mul(si, inv)), c(b, -0.5))
    if need(needs, 1):
        res[1] = b.reduce_sum(b.mul(g, xhat), axes, keepdims=False)
    if need(needs, 2):
        res[2] = b.reduce_sum(g, axes, keepdims=False)
    return res


@_bn_vjp.defcheck
def _bn_check(view, node):
    # before opset 14 training is signalled by the output count (Y, mean, var, saved_mean,
    # saved_var), and ORT's forward for it differs between optimization levels (batch
    # statistics without optimizations, neither form with them): no exact gradient exists
    if view.opset < 14 and any(node.output[1:]):
        raise unsupported(node, view, "has its training-mode outputs (mean, var, saved_mean, saved_var: training "
                                      "signalled by the output count), whose forward ONNX Runtime does not compute "
                                      "consistently; re-export with opset >= 14 (training_mode) or in eval mode")


@_bn_vjp.defjvp
def _bn_jvp(b, view, node, ts):
    _bn_check(view, node)  # jvp() runs no rule checks
    X, S, B, mean, var = node.input[:5]
    Y = node.output[0]
    ts = list(ts) + [None] * (5 - len(ts))
    tX, tS, tB, tM, tV = ts[:5]
    r = _rank_or_fail(view, node, X)
    eps = float(attr(node, "epsilon", 1e-5))
    axes = [0] + list(range(2, r))
    terms = []
    chan = []  # per-channel vectors added after broadcasting
    if int(attr(node, "training_mode", 0)):
        _, inv, xhat = _stats(b, X, axes, eps)
        if tX is not None:
            terms.append(b.mul(_proj(b, tX, xhat, inv, axes), _chan(b, S, r)))
        if tS is not None:
            terms.append(b.mul(xhat, _chan(b, tS, r)))
    else:
        inv = b.div(c(b, 1.0), b.op("Sqrt", [b.add(var, c(b, eps))]))
        si = b.mul(S, inv)
        xhat = None
        if tX is not None:
            terms.append(b.mul(tX, _chan(b, si, r)))
        if tM is not None:
            chan.append(b.neg(b.mul(tM, si)))
        xcoef = []
        if tS is not None:
            xcoef.append(tS)
        if tV is not None:
            xcoef.append(b.mul(tV, b.mul(b.mul(si, inv), c(b, -0.5))))
        if xcoef:
            xhat = b.mul(b.sub(X, _chan(b, mean, r)), _chan(b, inv, r))
            terms.append(b.mul(xhat, _chan(b, add_n(b, xcoef), r)))
    if tB is not None:
        chan.append(tB)
    if chan:
        cv = _chan(b, add_n(b, chan), r)
        terms.append(b.op("Expand", [cv, shape_tensor(b, view, Y)]) if not terms else cv)
    return [add_n(b, terms)] + [None] * (len(node.output) - 1)


@register("InstanceNormalization")
def _in_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    if g is None:
        return [None] * 3
    X, S, B = node.input
    r = _rank_or_fail(view, node, X)
    axes = list(range(2, r))
    _, inv, xhat = _stats(b, X, axes, float(attr(node, "epsilon", 1e-5)))
    cax = [0] + axes
    return [
        _proj(b, b.mul(g, _chan(b, S, r)), xhat, inv, axes) if need(needs, 0) else None,
        b.reduce_sum(b.mul(g, xhat), cax, keepdims=False) if need(needs, 1) else None,
        b.reduce_sum(g, cax, keepdims=False) if need(needs, 2) else None,
    ]


@_in_vjp.defjvp
def _in_jvp(b, view, node, ts):
    X, S, B = node.input
    Y = node.output[0]
    r = _rank_or_fail(view, node, X)
    axes = list(range(2, r))
    _, inv, xhat = _stats(b, X, axes, float(attr(node, "epsilon", 1e-5)))
    terms = []
    if ts[0] is not None:
        terms.append(b.mul(_proj(b, ts[0], xhat, inv, axes), _chan(b, S, r)))
    if ts[1] is not None:
        terms.append(b.mul(xhat, _chan(b, ts[1], r)))
    if ts[2] is not None:
        cv = _chan(b, ts[2], r)
        terms.append(b.op("Expand", [cv, shape_tensor(b, view, Y)]) if not terms else cv)
    return [add_n(b, terms)]


# ---------------------------------------------------------------- GroupNormalization
def _gn_geometry(view, node):
    """(rank, num_groups, per_group): the scale/bias are per group ([G], opset 18-20) or per
    channel ([C], opset >= 21)."""
    X = node.input[0]
    r = _rank_or_fail(view, node, X)
    if r < 2:
        raise unsupported(node, view, "needs an input of rank >= 2")
    G = int(attr(node, "num_groups", 0))
    if G < 1:
        raise unsupported(node, view, "needs num_groups >= 1")
    return r, G, view.opset < 21


def _gn_grouped(b, x: str, G: int) -> str:
    """[N, C, *S] -> [N, G, C/G * prod(S)]."""
    return b.reshape(x, [0, G, -1])


def _gn_param(b, p: str, r: int, per_group: bool) -> str:
    """Scale/bias reshaped to broadcast: per group against [N, G, K], per channel against X."""
    return b.reshape(p, [-1, 1]) if per_group else _chan(b, p, r)


@register("GroupNormalization", since=18)
def _gn_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    if g is None:
        return [None] * len(node.input)
    X, S = node.input[0], node.input[1]
    B = inp(node, 2)
    r, G, per_group = _gn_geometry(view, node)
    _, inv, xhat = _stats(b, _gn_grouped(b, X, G), [2], float(attr(node, "epsilon", 1e-5)))
    xs = shape_tensor(b, view, X)
    res: list[str | None] = [None] * len(node.input)
    if per_group:
        gr = _gn_grouped(b, g, G)
        if need(needs, 0):
            res[0] = b.reshape(_proj(b, b.mul(gr, _gn_param(b, S, r, True)), xhat, inv, [2]), xs)
        if need(needs, 1):
            res[1] = b.reduce_sum(b.mul(gr, xhat), [0, 2], keepdims=False)
        if B is not None and need(needs, 2):
            res[2] = b.reduce_sum(gr, [0, 2], keepdims=False)
        return res
    cax = [0] + list(range(2, r))
    if need(needs, 0):
        gs = _gn_grouped(b, b.mul(g, _chan(b, S, r)), G)
        res[0] = b.reshape(_proj(b, gs, xhat, inv, [2]), xs)
    if need(needs, 1):
        res[1] = b.reduce_sum(b.mul(g, b.reshape(xhat, xs)), cax, keepdims=False)
    if B is not None and need(needs, 2):
        res[2] = b.reduce_sum(g, cax, keepdims=False)
    return res


@_gn_vjp.defjvp
def _gn_jvp(b, view, node, ts):
    X, S = node.input[0], node.input[1]
    B = inp(node, 2)
    ts = list(ts) + [None] * (3 - len(ts))
    tX, tS, tB = ts[0], ts[1], ts[2] if B else None
    r, G, per_group = _gn_geometry(view, node)
    _, inv, xhat = _stats(b, _gn_grouped(b, X, G), [2], float(attr(node, "epsilon", 1e-5)))
    xs = shape_tensor(b, view, X)
    terms = []  # in the grouped [N, G, K] layout when per_group, else shaped like X
    if tX is not None:
        p = _proj(b, _gn_grouped(b, tX, G), xhat, inv, [2])
        terms.append(b.mul(p, _gn_param(b, S, r, True)) if per_group else b.mul(b.reshape(p, xs), _chan(b, S, r)))
    if tS is not None:
        xh = xhat if per_group else b.reshape(xhat, xs)
        terms.append(b.mul(xh, _gn_param(b, tS, r, per_group)))
    if tB is not None:
        cv = _gn_param(b, tB, r, per_group)
        if not terms:
            cv = b.op("Expand", [cv, b.op("Shape", [xhat]) if per_group else xs])
        terms.append(cv)
    ty = add_n(b, terms)
    return [b.reshape(ty, xs) if per_group and ty is not None else ty]


# ------------------------------------------------ LpNormalization, LRN, MeanVarianceNormalization
@register("LpNormalization", inputs=(0,))
def _lpn_vjp(b, view, node, gys):
    """y = x / n, n = ||x||_p along `axis` (p 1 or 2): dx = (g - s sum(g y)) / n with
    s = dn/dx = y (p=2) or sign(x) (p=1)."""
    g = gys[0]
    return [None if g is None else _lpn_apply(b, node, g, adjoint=True)]


def _lpn_apply(b, node, v: str, adjoint: bool) -> str:
    """The Jacobian of x -> x / ||x||_p applied to v (adjoint: its transpose): the two
    differ in which of y and s = dn/dx meets v inside the sum. 0 for a zero vector (n = 0,
    where ORT's y is 0), not 0 / 0."""
    x, y = node.input[0], node.output[0]
    axis, p = int(attr(node, "axis", -1)), int(attr(node, "p", 2))
    n = b.reduce("ReduceL2" if p == 2 else "ReduceL1", x, [axis], keepdims=True)
    s = y if p == 2 else b.op("Sign", [x])
    inner, outer = (y, s) if adjoint else (s, y)
    dot = b.reduce_sum(b.mul(v, inner), [axis], keepdims=True)
    return b.mul(b.sub(v, b.mul(outer, dot)), recip0(b, n))


@_lpn_vjp.defcheck
def _lpn_check(view, node):
    if int(attr(node, "p", 2)) not in (1, 2):
        raise unsupported(node, view, f"has p={attr(node, 'p')}: ONNX defines only p=1 and p=2")


@_lpn_vjp.defjvp
def _lpn_jvp(b, view, node, ts):
    return [None if ts[0] is None else _lpn_apply(b, node, ts[0], adjoint=False)]


def _channel_window_sum(b, view, node, v: str, transpose: bool) -> str:
    """LRN's sum over the channel window [c - lo, c + hi] (lo = floor((size-1)/2),
    hi = ceil((size-1)/2)) of v [N, C, ...], as a ones-kernel Conv over the channel axis of
    v unsqueezed to [N, 1, C, ...]; `transpose`: the window [c - hi, c + lo] (its adjoint)."""
    r = view.rank(node.input[0])
    if r is None:
        raise unsupported(node, view, "needs its input's rank")
    size = int(attr(node, "size"))
    lo, hi = (size - 1) // 2, size // 2
    if transpose:
        lo, hi = hi, lo
    nsp = r - 1
    k = b.const(np.ones([1, 1, size] + [1] * (nsp - 1), dtype=b.np_float), hint="lrn_ones")
    conv = b.op("Conv", [b.unsqueeze(v, [1]), k], pads=[lo] + [0] * (nsp - 1) + [hi] + [0] * (nsp - 1))
    return b.squeeze(conv, [1])


def _lrn_terms(b, view, node):
    """(S^-beta, the factor -2 beta alpha/size x S^(-beta-1)) of y = x S^-beta with
    S = bias + alpha/size * window_sum(x^2)."""
    x = node.input[0]
    alpha, beta = float(attr(node, "alpha", 1e-4)), float(attr(node, "beta", 0.75))
    bias, size = float(attr(node, "bias", 1.0)), int(attr(node, "size"))
    S = b.add(c(b, bias), b.mul(c(b, alpha / size), _channel_window_sum(b, view, node, b.mul(x, x), False)))
    inv_pow = b.op("Pow", [S, c(b, -beta)])
    fac = b.mul(b.mul(x, c(b, -2.0 * beta * alpha / size)), b.div(inv_pow, S))
    return inv_pow, fac


@register("LRN", inputs=(0,))
def _lrn_vjp(b, view, node, gys):
    """dy_c/dx_i = [c == i] S_c^-beta + fac_c x_i for i in c's window, so
    dx = g S^-beta + x W^T(g fac), W the channel window sum."""
    g = gys[0]
    if g is None:
        return [None]
    x = node.input[0]
    inv_pow, fac = _lrn_terms(b, view, node)
    back = _channel_window_sum(b, view, node, b.mul(g, fac), True)
    return [b.add(b.mul(g, inv_pow), b.mul(x, back))]


@_lrn_vjp.defjvp
def _lrn_jvp(b, view, node, ts):
    t = ts[0]
    if t is None:
        return [None]
    x = node.input[0]
    inv_pow, fac = _lrn_terms(b, view, node)
    return [b.add(b.mul(t, inv_pow), b.mul(fac, _channel_window_sum(b, view, node, b.mul(x, t), False)))]


@register("MeanVarianceNormalization", inputs=(0,))
def _mvn_vjp(b, view, node, gys):
    """y = (x - mean) / (std + 1e-9) over `axes` (ONNX's definition); its Jacobian is
    symmetric, so one expression is the vjp and the jvp."""
    g = gys[0]
    return [None if g is None else _mvn_apply(b, node, g)]


def _mvn_apply(b, node, v: str) -> str:
    """(v - mean(v)) / s - y mean(xh v) / s, s = std + 1e-9, xh = (x - mean) / std."""
    x, y = node.input[0], node.output[0]
    axes = [int(a) for a in attr(node, "axes", [0, 2, 3])]
    xc = b.sub(x, b.reduce_mean(x, axes, keepdims=True))
    std = b.op("Sqrt", [b.reduce_mean(b.mul(xc, xc), axes, keepdims=True)])
    s = b.add(std, c(b, 1e-9))
    m1 = b.reduce_mean(v, axes, keepdims=True)
    m2 = b.reduce_mean(b.mul(v, b.div(xc, std)), axes, keepdims=True)
    return b.div(b.sub(b.sub(v, m1), b.mul(y, m2)), s)


_mvn_vjp.defjvp(lambda b, view, node, ts: [None if ts[0] is None else _mvn_apply(b, node, ts[0])])
