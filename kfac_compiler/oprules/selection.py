"""Selection: ops whose output picks, per element, one input or one branch, so that the
derivative is a mask routing the (co)tangent: PRelu (the slope input below zero), Max/Min
(tied inputs share it), Where, Clip (the bounds get what falls outside them)."""
from __future__ import annotations

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    add_n,
    c,
    expand_like,
    inp,
    need,
    same_shape,
    unbroadcast,
    where0,
)


# ------------------------------------------------------------------------------- PRelu
@register("PRelu")
def _prelu_vjp(b, view, node, gys, needs=None):
    g, (x, s), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None, None]
    neg = b.op("Less", [x, c(b, 0.0)])
    gx = unbroadcast(b, view, b.op("Where", [neg, b.mul(g, s), g]), x, y) if need(needs, 0) else None
    gs = unbroadcast(b, view, where0(b, neg, b.mul(g, x)), s, y) if need(needs, 1) else None
    return [gx, gs]


@_prelu_vjp.defjvp
def _prelu_jvp(b, view, node, ts):
    (x, s), y = node.input, node.output[0]
    neg = b.op("Less", [x, c(b, 0.0)])
    terms = []
    if ts[0] is not None:
        terms.append((b.op("Where", [neg, b.mul(ts[0], s), ts[0]]), None))
    if ts[1] is not None:
        terms.append((where0(b, neg, b.mul(ts[1], x)), None))
    r = add_n(b, [t for t, _ in terms])
    return [None if r is None else expand_like(b, view, r, y)]


# ----------------------------------------------------------------------------- Max / Min
def _minmax_masks(b, node):
    """Per-input float masks (x_i == y) / number of ties, broadcast to y."""
    y = node.output[0]
    masks = [b.cast(b.op("Equal", [x, y]), b.float_type) for x in node.input]
    if len(masks) == 1:
        return masks
    cnt = add_n(b, masks)
    return [b.div(m, cnt) for m in masks]


@register(("Max", "Min"))
def _minmax_vjp(b, view, node, gys, needs=None):
    g, y = gys[0], node.output[0]
    if g is None:
        return [None] * len(node.input)
    masks = _minmax_masks(b, node)
    return [unbroadcast(b, view, b.mul(g, m), x, y) if need(needs, i) else None
            for i, (x, m) in enumerate(zip(node.input, masks))]


@_minmax_vjp.defjvp
def _minmax_jvp(b, view, node, ts):
    y = node.output[0]
    masks = _minmax_masks(b, node)
    terms = [b.mul(t, m) for t, m in zip(ts, masks) if t is not None]
    r = add_n(b, terms)
    return [None if r is None else expand_like(b, view, r, y)]


# ------------------------------------------------------------------------------- Where
@register("Where", inputs=(1, 2))
def _where_vjp(b, view, node, gys, needs=None):
    g, (cond, a, c2), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None] * 3
    z = c(b, 0.0)
    ga = unbroadcast(b, view, b.op("Where", [cond, g, z]), a, y) if need(needs, 1) else None
    gb = unbroadcast(b, view, b.op("Where", [cond, z, g]), c2, y) if need(needs, 2) else None
    return [None, ga, gb]


@_where_vjp.defjvp
def _where_jvp(b, view, node, ts):
    cond, a, c2 = node.input
    y = node.output[0]
    ta, tb = ts[1], ts[2]
    if ta is None and tb is None:
        return [None]
    z = c(b, 0.0)
    r = b.op("Where", [cond, ta or z, tb or z])
    if not (ta and tb and all(same_shape(view, x, y) for x in node.input)):
        r = expand_like(b, view, r, y)
    return [r]


# -------------------------------------------------------------------------------- Clip
def _clip_masks(b, node):
    """(inside, below, above): where y = min(max(x, lo), hi) (the spec's order) is x, lo, hi.
    With min > max (valid ONNX) y is max everywhere: above is max(x, lo) > hi, below only
    where lo <= hi."""
    x = node.input[0]
    lo, hi = inp(node, 1), inp(node, 2)
    conds = []
    below = above = None
    if lo is not None:
        conds.append(b.op("GreaterOrEqual", [x, lo]))
        below = b.op("Less", [x, lo])
    if hi is not None:
        conds.append(b.op("LessOrEqual", [x, hi]))
        above = b.op("Greater", [x if lo is None else b.op("Max", [x, lo]), hi])
        if below is not None:
            below = b.op("And", [below, b.op("LessOrEqual", [lo, hi])])
    inside = None
    if conds:
        inside = conds[0] if len(conds) == 1 else b.op("And", conds)
    return inside, below, above


@register("Clip", since=11)
def _clip_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    if g is None:
        return [None] * len(node.input)
    inside, below, above = _clip_masks(b, node)
    gx = g if inside is None else where0(b, inside, g)
    res = [gx if need(needs, 0) else None, None, None]
    if below is not None and need(needs, 1):
        res[1] = b.reduce_sum(where0(b, below, g), None, keepdims=False)
    if above is not None and need(needs, 2):
        res[2] = b.reduce_sum(where0(b, above, g), None, keepdims=False)
    return res[: len(node.input)]


@_clip_vjp.defjvp
def _clip_jvp(b, view, node, ts):
    y = node.output[0]
    inside, below, above = _clip_masks(b, node)
    terms = []
    if ts[0] is not None:
        terms.append(ts[0] if inside is None else where0(b, inside, ts[0]))
    if len(ts) > 1 and ts[1] is not None:
        terms.append(where0(b, below, ts[1]))
    if len(ts) > 2 and ts[2] is not None:
        terms.append(where0(b, above, ts[2]))
    r = add_n(b, terms)
    if r is not None and ts[0] is None:
        r = expand_like(b, view, r, y)
    return [r]
