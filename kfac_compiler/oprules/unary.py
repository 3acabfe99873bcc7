"""Unary elementwise ops: the math and activation functions (Neg, Sqrt, Exp, Log, Relu,
Tanh, Sigmoid, Gelu, Sin, Asin, Mish, Shrink, ...), registered through one helper (`unary`) whose single
expression v * f'(x) is both the vjp and the jvp; and the single-input ops that pass the
(co)tangent through a type change or a mask (Cast, CastLike, Dropout)."""
from __future__ import annotations

import math

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    attr,
    c,
    cval,
    ftype,
    gt0,
    inp,
    out,
    unsupported,
    where0,
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
    return b.mul(v, b.cast(gt0(b, x), b.float_type))


@unary("LeakyRelu")
def _leaky_relu(b, node, x, y, v):
    alpha = attr(node, "alpha", 0.01)
    return b.op("Where", [gt0(b, x), v, b.mul(v, c(b, alpha))])


@unary("Elu")
def _elu(b, node, x, y, v):  # x<=0: alpha*e^x = y + alpha
    alpha = attr(node, "alpha", 1.0)
    return b.op("Where", [gt0(b, x), v, b.mul(v, b.add(y, c(b, alpha)))])


@unary("Selu")
def _selu(b, node, x, y, v):  # x<=0: gamma*alpha*e^x = y + gamma*alpha
    alpha = attr(node, "alpha", 1.67326319217681884765625)
    gamma = attr(node, "gamma", 1.05070102214813232421875)
    return b.op(
        "Where", [gt0(b, x), b.mul(v, c(b, gamma)), b.mul(v, b.add(y, c(b, gamma * alpha)))]
    )


@unary("Celu")
def _celu(b, node, x, y, v):  # x<=0: e^(x/alpha) = y/alpha + 1
    alpha = attr(node, "alpha", 1.0)
    d = b.add(b.mul(y, c(b, 1.0 / alpha)), c(b, 1.0))
    return b.op("Where", [gt0(b, x), v, b.mul(v, d)])


@unary("ThresholdedRelu")
def _thresholded_relu(b, node, x, y, v):
    alpha = attr(node, "alpha", 1.0)
    return where0(b, b.op("Greater", [x, c(b, alpha)]), v)


@unary("Shrink")
def _shrink(b, node, x, y, v):  # slope 1 outside [-lambd, lambd], 0 inside (torch's soft/hardshrink)
    lambd = attr(node, "lambd", 0.5)
    outside = b.op("Or", [b.op("Greater", [x, c(b, lambd)]), b.op("Less", [x, c(b, -lambd)])])
    return where0(b, outside, v)


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


@unary("Asin")
def _asin(b, node, x, y, v):  # 1 / sqrt(1 - x^2)
    return b.div(v, b.op("Sqrt", [b.sub(c(b, 1.0), b.mul(x, x))]))


@unary("Acos")
def _acos(b, node, x, y, v):  # -1 / sqrt(1 - x^2)
    return b.neg(b.div(v, b.op("Sqrt", [b.sub(c(b, 1.0), b.mul(x, x))])))


@unary("Asinh")
def _asinh(b, node, x, y, v):  # 1 / sqrt(x^2 + 1)
    return b.div(v, b.op("Sqrt", [b.add(b.mul(x, x), c(b, 1.0))]))


@unary("Acosh")
def _acosh(b, node, x, y, v):  # 1 / sqrt(x^2 - 1)
    return b.div(v, b.op("Sqrt", [b.sub(b.mul(x, x), c(b, 1.0))]))


@unary("Atanh")
def _atanh(b, node, x, y, v):  # 1 / (1 - x^2)
    return b.div(v, b.sub(c(b, 1.0), b.mul(x, x)))


@unary("Mish", since=18)
def _mish(b, node, x, y, v):  # y = x tanh(softplus(x)): tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)
    th = b.op("Tanh", [b.op("Softplus", [x])])
    sech2 = b.sub(c(b, 1.0), b.mul(th, th))
    return b.mul(v, b.add(th, b.mul(b.mul(x, b.op("Sigmoid", [x])), sech2)))


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
    """None when the Dropout is an identity (inference); else mask * 1/(1-ratio), the scale
    gated by a run-time training_mode."""
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
    if v is None:
        # training_mode known only at run time: false makes the op the identity (mask all
        # true, no 1/(1-ratio) scaling), so the scale is 1 then
        scale = b.op("Where", [tm, scale, c(b, 1.0)])
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


@unary("Swish", since=24)
def _swish(b, node, x, y, v):  # y = x s, s = sigmoid(alpha x): s + alpha x s (1 - s)
    alpha = float(attr(node, "alpha", 1.0))
    s = b.op("Sigmoid", [b.mul(x, c(b, alpha))]) if alpha != 1.0 else b.op("Sigmoid", [x])
    d = b.add(s, b.mul(b.mul(b.mul(x, c(b, alpha)), s), b.sub(c(b, 1.0), s)))
    return b.mul(v, d)
