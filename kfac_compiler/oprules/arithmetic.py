"""Broadcasting arithmetic: the binary ops Add, Sub, Mul, Div, Pow, float Mod and the
variadic Sum and Mean. Each input's cotangent is summed back to its own shape (`unbroadcast`); tangents of
smaller operands are expanded to the output."""
from __future__ import annotations

import numpy as np

from kfac_compiler.graph import FLOAT_TYPES
from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    add_n,
    c,
    cval,
    expand_like,
    expand_to,
    ftype,
    gt0,
    need,
    same_shape,
    unbroadcast,
    where0,
)


# ---------------------------------------------------------------- binary broadcasting ops
def _bsum(b, view, y, terms):
    """Sum of (tensor, source-name) tangent terms, broadcast to the shape of y."""
    terms = [(t, s) for t, s in terms if t is not None]
    if not terms:
        return None
    if len(terms) == 1:
        t, s = terms[0]
        return expand_to(b, view, t, s, y) if s is not None else t
    return add_n(b, [t for t, _ in terms])


@register("Add")
def _add_vjp(b, view, node, gys, needs=None):
    g, (a, c2), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None, None]
    return [unbroadcast(b, view, g, a, y) if need(needs, 0) else None,
            unbroadcast(b, view, g, c2, y) if need(needs, 1) else None]


@_add_vjp.defjvp
def _add_jvp(b, view, node, ts):
    return [_bsum(b, view, node.output[0], [(ts[0], node.input[0]), (ts[1], node.input[1])])]


@register("Sub")
def _sub_vjp(b, view, node, gys, needs=None):
    g, (a, c2), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None, None]
    return [unbroadcast(b, view, g, a, y) if need(needs, 0) else None,
            b.neg(unbroadcast(b, view, g, c2, y)) if need(needs, 1) else None]


@_sub_vjp.defjvp
def _sub_jvp(b, view, node, ts):
    ta, tb = ts
    if ta is not None and tb is not None:
        return [b.sub(ta, tb)]
    return [_bsum(b, view, node.output[0], [(ta, node.input[0]),
                                             (None if tb is None else b.neg(tb), node.input[1])])]


@register("Mul")
def _mul_vjp(b, view, node, gys, needs=None):
    g, (a, c2), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None, None]
    if a == c2:  # x * x
        d = b.mul(b.mul(g, a), c(b, 2.0))
        return [d, None]
    return [unbroadcast(b, view, b.mul(g, c2), a, y) if need(needs, 0) else None,
            unbroadcast(b, view, b.mul(g, a), c2, y) if need(needs, 1) else None]


@_mul_vjp.defjvp
def _mul_jvp(b, view, node, ts):
    a, c2 = node.input
    if a == c2:
        return [None if ts[0] is None else b.mul(b.mul(ts[0], a), c(b, 2.0))]
    terms = []
    if ts[0] is not None:
        terms.append(b.mul(ts[0], c2))
    if ts[1] is not None:
        terms.append(b.mul(a, ts[1]))
    return [add_n(b, terms)]


@register("Div")
def _div_vjp(b, view, node, gys, needs=None):
    g, (a, c2), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None, None]
    ga = b.div(g, c2)
    return [unbroadcast(b, view, ga, a, y) if need(needs, 0) else None,
            b.neg(unbroadcast(b, view, b.mul(ga, y), c2, y)) if need(needs, 1) else None]


@_div_vjp.defjvp
def _div_jvp(b, view, node, ts):
    c2, y = node.input[1], node.output[0]
    num = []
    if ts[0] is not None:
        num.append(ts[0])
    if ts[1] is not None:
        num.append(b.neg(b.mul(ts[1], y)))
    if not num:
        return [None]
    n = num[0] if len(num) == 1 else b.add(num[0], num[1])
    return [b.div(n, c2)]


def _mod_quotient(b, node) -> str:
    """Mod's integer quotient q with y = a - b q (truncated for fmod=1, floored for fmod=0),
    recovered as (a - y) / b: ONNX has no Trunc, and q is piecewise constant."""
    a, d = node.input[0], node.input[1]
    return b.div(b.sub(a, node.output[0]), d)


@register("Mod")
def _mod_vjp(b, view, node, gys, needs=None):
    """y = a - b q: dy/da = 1, dy/db = -q (integer Mod carries no gradient: float inputs only)."""
    g, (a, d), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None, None]
    return [unbroadcast(b, view, g, a, y) if need(needs, 0) else None,
            b.neg(unbroadcast(b, view, b.mul(g, _mod_quotient(b, node)), d, y)) if need(needs, 1) else None]


@_mod_vjp.defjvp
def _mod_jvp(b, view, node, ts):
    y = node.output[0]
    terms = [(ts[0], node.input[0])]
    if ts[1] is not None:
        terms.append((b.neg(b.mul(ts[1], _mod_quotient(b, node))), y))
    return [_bsum(b, view, y, terms)]


def _pow_dx(b, view, x, e, y):
    """d(x^e)/dx = e x^(e-1)."""
    ev = cval(view, e)
    if ev is not None and ev.size == 1:
        k = float(np.asarray(ev).reshape(-1)[0])
        if k == 1.0:
            return None  # derivative 1
        if k == 2.0:
            return b.mul(x, c(b, 2.0))
        if k == 0.5:
            return b.div(c(b, 0.5), y)
        return b.mul(b.op("Pow", [x, c(b, k - 1.0)]), c(b, k))
    ef = b.op("CastLike", [e, x]) if b.opset >= 15 else b.cast(e, ftype(b, view, x))
    return b.mul(b.op("Pow", [x, b.sub(ef, c(b, 1.0))]), ef)


def _pow_de(b, x, y):
    """d(x^e)/de = y log x (0 where x <= 0)."""
    pos = gt0(b, x)
    safe = b.op("Where", [pos, x, c(b, 1.0)])
    return where0(b, pos, b.mul(y, b.op("Log", [safe])))


@register("Pow")
def _pow_vjp(b, view, node, gys, needs=None):
    g, (x, e), y = gys[0], node.input, node.output[0]
    if g is None:
        return [None, None]
    gx = ge = None
    if need(needs, 0):
        d = _pow_dx(b, view, x, e, y)
        gx = unbroadcast(b, view, g if d is None else b.mul(g, d), x, y)
    if need(needs, 1) and view.dtypes.get(e) in (None, *FLOAT_TYPES):
        ge = unbroadcast(b, view, b.mul(g, _pow_de(b, x, y)), e, y)
    return [gx, ge]


@_pow_vjp.defjvp
def _pow_jvp(b, view, node, ts):
    (x, e), y = node.input, node.output[0]
    terms = []
    if ts[0] is not None:
        d = _pow_dx(b, view, x, e, y)
        terms.append((ts[0] if d is None else b.mul(ts[0], d), x if d is None else None))
    if ts[1] is not None:
        terms.append((b.mul(ts[1], _pow_de(b, x, y)), None))
    return [_bsum(b, view, y, terms)]


# ------------------------------------------------------------------------ variadic ops
@register(("Sum", "Mean"))
def _sum_vjp(b, view, node, gys, needs=None):
    g, y = gys[0], node.output[0]
    if g is None:
        return [None] * len(node.input)
    if node.op_type == "Mean":
        g = b.mul(g, c(b, 1.0 / len(node.input)))
    res = []
    for i, x in enumerate(node.input):
        res.append(unbroadcast(b, view, g, x, y) if need(needs, i) else None)
    return res


@_sum_vjp.defjvp
def _sum_jvp(b, view, node, ts):
    y = node.output[0]
    present = [(t, x) for t, x in zip(ts, node.input) if t is not None]
    if not present:
        return [None]
    if len(present) == 1:
        r = expand_to(b, view, present[0][0], present[0][1], y)
    else:
        r = add_n(b, [t for t, _ in present])
        if not all(same_shape(view, x, y) for x in node.input):
            r = expand_like(b, view, r, y)
    if node.op_type == "Mean":
        r = b.mul(r, c(b, 1.0 / len(node.input)))
    return [r]
