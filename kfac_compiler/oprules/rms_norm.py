"""RMSNormalization (opset 23): y = xhat * scale, xhat = x r, r = 1 / sqrt(mean(x^2) + eps)
over the axes from `axis` on. The Jacobian of x -> xhat is symmetric,
v -> r (v - xhat mean(v xhat)), so it serves as both the vjp and the jvp; the scale's
cotangent is g * xhat summed to the scale's shape. Statistics are recomputed from X in X's
precision (whatever stash_type)."""
from __future__ import annotations

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import add_n, attr, c, need, unbroadcast
from kfac_compiler.oprules.normalization import trailing_axes


def _stats(b, view, node):
    x = node.input[0]
    axes = trailing_axes(view, node)
    eps = float(attr(node, "epsilon", 1e-5))
    ms = b.reduce_mean(b.mul(x, x), axes, keepdims=True)
    inv = b.div(c(b, 1.0), b.op("Sqrt", [b.add(ms, c(b, eps))]))
    return axes, inv, b.mul(x, inv)


def _proj(b, v: str, xhat: str, inv: str, axes) -> str:
    return b.mul(inv, b.sub(v, b.mul(xhat, b.reduce_mean(b.mul(v, xhat), axes, keepdims=True))))


@register("RMSNormalization", since=23)
def _rms_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    res: list[str | None] = [None] * len(node.input)
    if g is None:
        return res
    axes, inv, xhat = _stats(b, view, node)
    scale = node.input[1]
    if need(needs, 0):
        res[0] = _proj(b, b.mul(g, scale), xhat, inv, axes)
    if len(node.input) > 1 and need(needs, 1):
        res[1] = unbroadcast(b, view, b.mul(g, xhat), scale, node.output[0])
    return res


@_rms_vjp.defjvp
def _rms_jvp(b, view, node, ts):
    tx = ts[0] if ts else None
    ts_ = ts[1] if len(ts) > 1 else None
    if tx is None and ts_ is None:
        return [None]
    axes, inv, xhat = _stats(b, view, node)
    terms = []
    if tx is not None:
        terms.append(b.mul(_proj(b, tx, xhat, inv, axes), node.input[1]))
    if ts_ is not None:
        terms.append(b.mul(xhat, ts_))
    return [add_n(b, terms)]
