"""Elementwise ops: unary activations, broadcasting binary/variadic arithmetic, Where, Clip,
Cast, Identity/Dropout, and the ops with no gradient."""
from __future__ import annotations

import math

import numpy as np

from kfac_compiler.graph import FLOAT_TYPES
from kfac_compiler.oprules import register, register_nondiff
from kfac_compiler.oprules._util import (
    add_n,
    attr,
    c,
    cval,
    expand_to,
    ftype,
    inp,
    need,
    out,
    same_shape,
    shape_tensor,
    unbroadcast,
    unsupported,
    where0,
)

# --------------------------------------------------------------------------- no gradient
register_nondiff(
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "EyeLike", "OneHot",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "ArgMax", "ArgMin", "NonZero", "Floor", "Ceil", "Round", "Sign",
    "Hardmax", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
    "Multinomial", "Bernoulli", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
    "BitwiseNot", "NonMaxSuppression", "StringNormalizer", "RegexFullMatch",
)


# ------------------------------------------------------------------------ unary helpers
def unary(op_type: str, since: int = 1, until: int | None = None):
    """Register an elementwise unary op from `fn(b, node, x, y, v) -> v * f'(x)`; the same
    expression serves as vjp (v = output cotangent) and jvp (v = input tangent)."""

    def deco(fn):
        @register(op_type, since=since, until=until, inputs=(0,))
        def vjp(b, view, node, gys):
            g = gys[0]
            return [None if g is None else fn(b, node, node.input[0], node.output[0], g)]

        @vjp.defjvp
        def jvp(b, view, node, ts):
            t = ts[0]
            return [None if t is None else fn(b, node, node.input[0], node.output[0], t)] + [
                None
            ] * (len(node.output) - 1)

        return vjp

    return deco


def _gt0(b, x):
    return b.op("Greater", [x, c(b, 0.0)])


@unary("Identity")
def _identity(b, node, x, y, v):
    return v


@unary("Neg")
def _neg(b, node, x, y, v):
    return b.neg(v)


@unary("Sqrt")
def _sqrt(b, node, x, y, v):  # 0.5 / y
    return b.div(b.mul(v, c(b, 0.5)), y)


@unary("Reciprocal")
def _reciprocal(b, node, x, y, v):  # -y^2
    return b.neg(b.mul(v, b.mul(y, y)))


@unary("Abs")
def _abs(b, node, x, y, v):
    return b.mul(v, b.op("Sign", [x]))


@unary("Exp")
def _exp(b, node, x, y, v):
    return b.mul(v, y)


@unary("Log")
def _log(b, node, x, y, v):
    return b.div(v, x)


@unary("Relu")
def _relu(b, node, x, y, v):  # v * (x > 0): Cast+Mul is faster than Where in ORT
    return b.mul(v, b.cast(_gt0(b, x), b.float_type))


@unary("LeakyRelu")
def _leaky_relu(b, node, x, y, v):
    alpha = attr(node, "alpha", 0.01)
    return b.op("Where", [_gt0(b, x), v, b.mul(v, c(b, alpha))])


@unary("Elu")
def _elu(b, node, x, y, v):  # x<=0: alpha*e^x = y + alpha
    alpha = attr(node, "alpha", 1.0)
    return b.op("Where", [_gt0(b, x), v, b.mul(v, b.add(y, c(b, alpha)))])


@unary("Selu")
def _selu(b, node, x, y, v):  # x<=0: gamma*alpha*e^x = y + gamma*alpha
    alpha = attr(node, "alpha", 1.67326319217681884765625)
    gamma = attr(node, "gamma", 1.05070102214813232421875)
    return b.op(
        "Where", [_gt0(b, x), b.mul(v, c(b, gamma)), b.mul(v, b.add(y, c(b, gamma * alpha)))]
    )


@unary("Celu")
def _celu(b, node, x, y, v):  # x<=0: e^(x/alpha) = y/alpha + 1
    alpha = attr(node, "alpha", 1.0)
    d = b.add(b.mul(y, c(b, 1.0 / alpha)), c(b, 1.0))
    return b.op("Where", [_gt0(b, x), v, b.mul(v, d)])


@unary("ThresholdedRelu")
def _thresholded_relu(b, node, x, y, v):
    alpha = attr(node, "alpha", 1.0)
    return where0(b, b.op("Greater", [x, c(b, alpha)]), v)


@unary("Tanh")
def _tanh(b, node, x, y, v):  # 1 - y^2
    return b.mul(v, b.sub(c(b, 1.0), b.mul(y, y)))


@unary("Sigmoid")
def _sigmoid(b, node, x, y, v):  # y (1 - y)
    return b.mul(v, b.mul(y, b.sub(c(b, 1.0), y)))


@unary("HardSigmoid")
def _hard_sigmoid(b, node, x, y, v):
    alpha = attr(node, "alpha", 0.2)
    beta = attr(node, "beta", 0.5)
    z = b.add(b.mul(x, c(b, alpha)), c(b, beta))
    inside = b.op("And", [b.op("Greater", [z, c(b, 0.0)]), b.op("Less", [z, c(b, 1.0)])])
    return where0(b, inside, b.mul(v, c(b, alpha)))


@unary("HardSwish")
def _hard_swish(b, node, x, y, v):  # x/3 + 1/2 on (-3, 3), 0 below, 1 above
    mid = b.add(b.mul(x, c(b, 1.0 / 3.0)), c(b, 0.5))
    d = b.op("Where", [b.op("Greater", [x, c(b, 3.0)]), c(b, 1.0), mid])
    d = b.op("Where", [b.op("Less", [x, c(b, -3.0)]), c(b, 0.0), d])
    return b.mul(v, d)


@unary("Softplus")
def _softplus(b, node, x, y, v):
    return b.mul(v, b.op("Sigmoid", [x]))


@unary("Softsign")
def _softsign(b, node, x, y, v):  # 1 / (1 + |x|)^2
    den = b.add(c(b, 1.0), b.op("Abs", [x]))
    return b.div(v, b.mul(den, den))


@unary("Erf")
def _erf(b, node, x, y, v):  # 2/sqrt(pi) exp(-x^2)
    e = b.op("Exp", [b.neg(b.mul(x, x))])
    return b.mul(v, b.mul(e, c(b, 2.0 / math.sqrt(math.pi))))


@unary("Gelu", since=20)
def _gelu(b, node, x, y, v):
    if attr(node, "approximate", "none") == "tanh":
        # y = 0.5 x (1 + tanh(u)), u = k (x + 0.044715 x^3)
        k = math.sqrt(2.0 / math.pi)
        x2 = b.mul(x, x)
        u = b.mul(b.mul(x, b.add(c(b, 1.0), b.mul(x2, c(b, 0.044715)))), c(b, k))
        th = b.op("Tanh", [u])
        du = b.mul(b.add(c(b, 1.0), b.mul(x2, c(b, 3 * 0.044715))), c(b, k))
        sech2 = b.sub(c(b, 1.0), b.mul(th, th))
        d = b.mul(c(b, 0.5), b.add(b.add(c(b, 1.0), th), b.mul(b.mul(x, sech2), du)))
    else:
        # Phi(x) + x phi(x)
        cdf = b.mul(c(b, 0.5), b.add(c(b, 1.0), b.op("Erf", [b.mul(x, c(b, 1.0 / math.sqrt(2.0)))])))
        pdf = b.mul(b.op("Exp", [b.mul(b.mul(x, x), c(b, -0.5))]), c(b, 1.0 / math.sqrt(2 * math.pi)))
        d = b.add(cdf, b.mul(x, pdf))
    return b.mul(v, d)


@unary("Sin")
def _sin(b, node, x, y, v):
    return b.mul(v, b.op("Cos", [x]))


@unary("Cos")
def _cos(b, node, x, y, v):
    return b.neg(b.mul(v, b.op("Sin", [x])))


@unary("Tan")
def _tan(b, node, x, y, v):
    return b.mul(v, b.add(c(b, 1.0), b.mul(y, y)))


@unary("Atan")
def _atan(b, node, x, y, v):
    return b.div(v, b.add(c(b, 1.0), b.mul(x, x)))


@unary("Sinh")
def _sinh(b, node, x, y, v):
    return b.mul(v, b.op("Cosh", [x]))


@unary("Cosh")
def _cosh(b, node, x, y, v):
    return b.mul(v, b.op("Sinh", [x]))


# ----------------------------------------------------------------------- Cast & friends
@register("Cast", inputs=(0,))
def _cast_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    return [b.cast(g, ftype(b, view, node.input[0]))]


@_cast_vjp.defjvp
def _cast_jvp(b, view, node, ts):
    return [None if ts[0] is None else b.cast(ts[0], attr(node, "to"))]


@register("CastLike", since=15, inputs=(0,))
def _castlike_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else b.op("CastLike", [g, node.input[0]]), None]


@_castlike_vjp.defjvp
def _castlike_jvp(b, view, node, ts):
    return [None if ts[0] is None else b.op("CastLike", [ts[0], node.input[1]])]


def _dropout_scale(b, view, node):
    """None when the Dropout is an identity (inference); else (mask, 1/(1-ratio)) pieces."""
    tm = inp(node, 2)
    if tm is None:
        return None
    v = cval(view, tm)
    if v is not None and not bool(np.asarray(v).reshape(-1)[0]):
        return None
    mask = out(node, 1)
    if mask is None:
        raise unsupported(node, view, "in training mode needs its mask output for a gradient")
    ratio = inp(node, 1)
    rv = cval(view, ratio) if ratio else np.asarray(0.5)
    if rv is not None:
        scale = c(b, 1.0 / (1.0 - float(np.asarray(rv).reshape(-1)[0])))
    else:
        scale = b.div(c(b, 1.0), b.sub(c(b, 1.0), b.op("CastLike", [ratio, node.input[0]])))
    return b.mul(b.cast(mask, b.float_type), scale)


@register("Dropout", inputs=(0,))
def _dropout_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    m = _dropout_scale(b, view, node)
    return [g if m is None else b.mul(g, m)]


@_dropout_vjp.defjvp
def _dropout_jvp(b, view, node, ts):
    t = ts[0]
    if t is None:
        return [None]
    m = _dropout_scale(b, view, node)
    return [t if m is None else b.mul(t, m)]


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
    pos = _gt0(b, x)
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
    return [None if r is None else _expand_if(b, view, r, y)]


def _expand_if(b, view, t, y):
    """Expand a tangent of unknown (possibly smaller) shape to the shape of y."""
    return b.op("Expand", [t, shape_tensor(b, view, y)])


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
            r = _expand_if(b, view, r, y)
    if node.op_type == "Mean":
        r = b.mul(r, c(b, 1.0 / len(node.input)))
    return [r]


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
    return [None if r is None else _expand_if(b, view, r, y)]


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
        r = _expand_if(b, view, r, y)
    return [r]


# -------------------------------------------------------------------------------- Clip
def _clip_masks(b, node):
    x = node.input[0]
    lo, hi = inp(node, 1), inp(node, 2)
    conds = []
    below = above = None
    if lo is not None:
        conds.append(b.op("GreaterOrEqual", [x, lo]))
        below = b.op("Less", [x, lo])
    if hi is not None:
        conds.append(b.op("LessOrEqual", [x, hi]))
        above = b.op("Greater", [x, hi])
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
        r = _expand_if(b, view, r, y)
    return [r]
