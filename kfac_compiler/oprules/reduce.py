"""Reductions: ReduceSum/Mean/SumSquare/L1/L2/LogSum/LogSumExp/Max/Min/Prod (axes as
attribute or input, keepdims, noop_with_empty_axes)."""
from __future__ import annotations

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import attr, c, cval, inp, reapply, recip0, shape_tensor, static_shape


def _axes(view, node):
    """('noop'|'all'|'static'|'dynamic', axes list or tensor name, keepdims)."""
    keep = int(attr(node, "keepdims", 1))
    noop = int(attr(node, "noop_with_empty_axes", 0))
    axes = attr(node, "axes")
    if axes is None and inp(node, 1):
        v = cval(view, node.input[1])
        if v is None:
            return "dynamic", node.input[1], keep, noop
        axes = [int(a) for a in np.asarray(v).reshape(-1)]
    if axes is None or len(axes) == 0:
        return ("noop" if noop else "all"), None, keep, noop
    return "static", list(axes), keep, noop


def _bcast_back(b, view, node, v: str) -> str:
    """`v` (shaped like the reduction's output) reshaped to broadcast against its input."""
    kind, axes, keep, noop = _axes(view, node)
    if kind == "noop" or keep or kind == "all":
        return v
    if kind == "static":
        return b.unsqueeze(v, axes)
    kept = b.op("ReduceSum", [node.input[0], axes], keepdims=1, noop_with_empty_axes=noop)
    return b.reshape(v, b.op("Shape", [kept]))


def _reduce_like(b, view, node, x: str, op_type: str = "ReduceSum") -> str:
    """`op_type` over the same axes / keepdims as `node`, applied to x."""
    kind, axes, keep, noop = _axes(view, node)
    if kind == "noop":
        return x
    if kind == "dynamic":
        return b.op(op_type, [x, axes], keepdims=keep, noop_with_empty_axes=noop)
    return b.reduce(op_type, x, None if kind == "all" else axes, keepdims=bool(keep))


def _count(b, view, node) -> str:
    """Number of input elements per output element (float scalar)."""
    xs, ys = static_shape(view, node.input[0]), static_shape(view, node.output[0])
    if xs is not None and ys is not None:
        return c(b, float(np.prod(xs)) / float(max(np.prod(ys), 1)))
    sx = b.cast(b.op("Size", [node.input[0]]), b.float_type)
    sy = b.cast(b.op("Size", [node.output[0]]), b.float_type)
    return b.div(sx, sy)


def _full(b, view, node, v: str) -> str:
    return b.op("Expand", [_bcast_back(b, view, node, v), shape_tensor(b, view, node.input[0])])


@register("ReduceSum", inputs=(0,))
def _sum_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else _full(b, view, node, g)]


@register("ReduceMean", inputs=(0,))
def _mean_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else _full(b, view, node, b.div(g, _count(b, view, node)))]


def _lin_jvp(b, view, node, ts):
    return [None] if ts[0] is None else reapply(b, node, {0: ts[0]})


_sum_vjp.defjvp(_lin_jvp)
_mean_vjp.defjvp(_lin_jvp)


def _local(b, view, node):
    """d y / d x as a tensor broadcasting against x, for the nonlinear reductions, and the
    per-output divisor (ties of Max/Min), or None."""
    x, y = node.input[0], node.output[0]
    op = node.op_type
    if op == "ReduceSumSquare":
        return b.mul(x, c(b, 2.0)), None
    if op == "ReduceL1":
        return b.op("Sign", [x]), None
    if op == "ReduceL2":  # x / y, 0 for an all-zero group (y = 0)
        return b.mul(x, recip0(b, _bcast_back(b, view, node, y))), None
    if op == "ReduceLogSumExp":
        return b.op("Exp", [b.sub(x, _bcast_back(b, view, node, y))]), None
    if op == "ReduceLogSum":  # 1 / sum(x) = exp(-y), the same for the whole group
        return _full(b, view, node, b.op("Exp", [b.neg(y)])), None
    if op == "ReduceProd":
        return _prod_others(b, view, node), None
    # ReduceMax / ReduceMin: the arg-extremum (ties share)
    mask = b.cast(b.op("Equal", [x, _bcast_back(b, view, node, y)]), b.float_type)
    return mask, _reduce_like(b, view, node, mask)


def _prod_others(b, view, node) -> str:
    """The product of the other elements of each x's reduction group, without dividing by
    a zero: p1 = the product with zeros read as ones; an element's partner product is
    p1 / x (p1 at a zero) when no *other* element of its group is zero, else 0 (torch's
    prod gradient at zeros)."""
    x = node.input[0]
    z = b.op("Equal", [x, c(b, 0.0)])
    zf = b.cast(z, b.float_type)
    x1 = b.op("Where", [z, c(b, 1.0), x])
    p1 = _bcast_back(b, view, node, _reduce_like(b, view, node, x1, "ReduceProd"))
    nz = _bcast_back(b, view, node, _reduce_like(b, view, node, zf))
    alone = b.cast(b.op("Equal", [nz, zf]), b.float_type)  # no other zero in the group
    return b.mul(b.op("Where", [z, p1, b.div(p1, x1)]), alone)


@register(("ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
           "ReduceMin", "ReduceProd"), inputs=(0,))
def _nl_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    d, cnt = _local(b, view, node)
    if cnt is not None:
        g = b.div(g, cnt)
    return [b.mul(d, _bcast_back(b, view, node, g))]


@_nl_vjp.defjvp
def _nl_jvp(b, view, node, ts):
    t = ts[0]
    if t is None:
        return [None]
    d, cnt = _local(b, view, node)
    r = _reduce_like(b, view, node, b.mul(d, t))
    return [r if cnt is None else b.div(r, cnt)]
