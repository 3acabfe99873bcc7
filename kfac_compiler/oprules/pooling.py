"""Pooling: MaxPool, AveragePool, LpPool, GlobalAveragePool, GlobalMaxPool, GlobalLpPool, MaxUnpool. The windowed pools use
conv's geometry (`Geom`) and, for AveragePool, its ConvTranspose adjoint (`conv_t_to`).

Lowerings (see docs/autodiff.md):
- MaxPool, non-overlapping windows and no Indices output: a mask of the input positions equal
  to their window's maximum (the forward's output upsampled by Resize), the cotangent shared
  by each window's ties, and the jvp its transpose (the window sums of mask * tangent over
  the ties); no second MaxPool.
- Otherwise MaxPool: the Indices output (re-emitted when the node has none) and
  ScatterElements(reduction="add") on the flattened input.
- AveragePool: nearest-neighbour Resize for non-overlapping windows, else ConvTranspose of
  cotangent/divisor with a ones kernel on [N*C, 1, *S].
- LpPool: the same window-sum adjoint of g y^(1-p), times sign(x) |x|^(p-1); its jvp sums
  the windows with the node itself at p=1 (on the positive and negative parts).
- GlobalLpPool: LpPool's slope and outer factor, the window being all of the spatial dims.
"""
from __future__ import annotations

from itertools import product

import numpy as np
from onnx import helper

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    INT64_MAX,
    add_n,
    attr,
    c,
    dim_parts,
    dims_slice,
    linear_jvp,
    make_shape,
    out,
    reapply,
    recip0,
    shape_tensor,
    static_shape,
    unsupported,
    zeros,
)
from kfac_compiler.oprules.conv import Geom, conv_t_to, spatial_axes


def _pool_indices(b, view, node) -> str:
    idx = out(node, 1)
    if idx is not None and int(attr(node, "storage_order", 0)) == 0:
        return idx
    return reapply(b, node, {}, n_out=2, drop=("storage_order",))[1]


def _tiled(geo: Geom) -> bool:
    """Windows that tile the input (kernel == strides, dilation 1, no pads, floor mode): each
    input position lies in at most one window."""
    return (geo.k is not None and geo.k == geo.s and all(v == 1 for v in geo.d) and not any(geo.pb)
            and not any(geo.pe) and not geo.ceil)


def _tiled_maxima(b, view, node, geo: Geom) -> tuple[str, str]:
    """(mask, share): the input positions equal to their window's maximum (X == up(Y), Y the
    forward's own output) and, per window, the number of its ties / prod(k) (AveragePool of
    the mask, MLAS's kernel). The vjp and the quadratic model's jvps emit the same nodes,
    which the emission's dedupe (backend/dedupe.py) merges."""
    X, Y = node.input[0], node.output[0]
    mask = b.cast(b.op("Equal", [X, _upsample(b, view, Y, Y, X, geo.k)]), b.float_type)
    return mask, b.op("AveragePool", [mask], kernel_shape=geo.k, strides=geo.k)


def _maxpool_tiled_vjp(b, view, node, g: str, geo: Geom) -> str:
    """dX = mask * up(g / ties): the cotangent shared among each window's tied maxima. A
    subgradient like the first maximum that the Indices pick; the two differ only on tied
    windows, which after a Relu are all-zero ones whose cotangent the Relu drops. ONNX
    Runtime's MaxPool with Indices is 6-20x slower than without (LeNet-5's pools), so this
    is 4-6x faster than the Indices form."""
    mask, share = _tiled_maxima(b, view, node, geo)
    gq = b.div(b.mul(g, c(b, 1.0 / float(np.prod(geo.k)))), share)
    return b.mul(mask, _upsample(b, view, gq, node.output[0], node.input[0], geo.k))


def _maxpool_tiled_jvp(b, view, node, t: str, geo: Geom) -> str:
    """tY = (window sum of mask * t) / ties, the vjp's transpose (both window means: the
    prod(k) cancels); no MaxPool with Indices beside the forward's."""
    mask, share = _tiled_maxima(b, view, node, geo)
    return b.div(b.op("AveragePool", [b.mul(mask, t)], kernel_shape=geo.k, strides=geo.k), share)


@register("MaxPool", inputs=(0,))
def _maxpool_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X = node.input[0]
    geo = Geom(view, node, X, None)
    if out(node, 1) is None and _tiled(geo):
        return [_maxpool_tiled_vjp(b, view, node, g, geo)]
    idx = _pool_indices(b, view, node)
    numel = b.reshape(b.op("Size", [X]), [1])
    if b.opset >= 16:
        flat = b.op("ScatterElements", [zeros(b, numel), b.reshape(idx, [-1]), b.reshape(g, [-1])],
                    axis=0, reduction="add")
    else:
        # no scatter-add before opset 16: split the output positions into classes whose
        # windows do not overlap (unique argmax positions) and scatter each class
        k = attr(node, "kernel_shape")
        nd = len(k)
        s = attr(node, "strides", [1] * nd)
        d = attr(node, "dilations", [1] * nd)
        m = [-(-((k[i] - 1) * d[i] + 1) // s[i]) for i in range(nd)]
        parts = []
        for off in product(*[range(mi) for mi in m]):
            if all(mi == 1 for mi in m):
                gs, ids = g, idx
            else:
                sl = [b.ints(list(off)), b.ints([INT64_MAX] * nd), b.ints(spatial_axes(nd)), b.ints(m)]
                gs = b.op("Slice", [g] + sl)
                ids = b.op("Slice", [idx] + sl)
            parts.append(b.op("ScatterElements", [zeros(b, numel), b.reshape(ids, [-1]), b.reshape(gs, [-1])],
                              axis=0))
        flat = add_n(b, parts)
    return [b.reshape(flat, b.op("Shape", [X]))]


@_maxpool_vjp.defcheck
def _maxpool_check(view, node):
    _inferred_shape_check(view, node)


@_maxpool_vjp.defjvp
def _maxpool_jvp(b, view, node, ts):
    t = ts[0]
    if t is None:
        return [None] * len(node.output)
    geo = Geom(view, node, node.input[0], None)
    if out(node, 1) is None and _tiled(geo):
        return [_maxpool_tiled_jvp(b, view, node, t, geo)]
    idx = _pool_indices(b, view, node)
    return [b.op("Gather", [b.reshape(t, [-1]), idx], axis=0)] + [None] * (len(node.output) - 1)


def _avg_divisor(b, view, node, geo: Geom, so):
    """Per-output-position divisor of AveragePool: a float (constant) or a const tensor."""
    include = int(attr(node, "count_include_pad", 0))
    no_pad = not any(geo.pb) and not any(geo.pe)
    if not geo.ceil and (include or no_pad):
        return float(np.prod(geo.k))
    if not geo.S_static or so is None:
        raise unsupported(node, view, "with padding/ceil_mode needs static spatial dims")
    per = []
    for i in range(geo.nd):
        lo, hi = (-geo.pb[i], geo.S[i] + geo.pe[i]) if include else (0, geo.S[i])
        cnt = []
        for o in range(so[i]):
            pos = o * geo.s[i] - geo.pb[i] + np.arange(geo.k[i]) * geo.d[i]
            cnt.append(int(((pos >= lo) & (pos < hi)).sum()))
        per.append(np.asarray(cnt, dtype=np.float64))
    div = per[0]
    for p in per[1:]:
        div = np.multiply.outer(div, p)
    return div


def _upsample(b, view, v: str, Y: str, X: str, k: list[int]) -> str:
    """Nearest-neighbour upsampling of v (shaped like Y [N, C, *So]) by the integer factors
    k (Resize, asymmetric/floor: exact), zero-padded at the end to X's spatial size: the
    adjoint of non-overlapping window sums."""
    nd = len(k)
    # Resize's scales are float32 whatever the model's float type (a float64 model's
    # gradient graph was rejected by ORT: const() casts to the builder's float type)
    scales = b.const(np.asarray([1.0, 1.0] + [float(f) for f in k]), dtype=np.float32, hint="scales")
    r = b.op("Resize", [v, "", scales], mode="nearest", coordinate_transformation_mode="asymmetric",
             nearest_mode="floor")
    ys, xs = static_shape(view, Y), static_shape(view, X)
    if ys is not None and xs is not None:
        rem = [xs[2 + i] - ys[2 + i] * k[i] for i in range(nd)]
        if any(rem):
            r = b.op("Pad", [r, b.ints([0] * (2 + nd) + [0, 0] + rem)])
        return r
    rem = b.sub(dims_slice(b, X, 2), b.mul(dims_slice(b, Y, 2), b.ints(k)))
    return b.op("Pad", [r, b.op("Concat", [b.ints([0] * (2 + nd + 2)), rem], axis=0)])


def _window_geometry(view, node) -> tuple[Geom, list | None]:
    """A windowed pool's geometry and its output's spatial size, which AveragePool and LpPool
    adjoints share: the geometry's (ORT's) where the input's spatial dims are static, else the
    inferred shape's (onnx's shape inference keeps a ceil_mode window that starts in the right
    padding before opset 22, which ORT and the spec drop)."""
    geo = Geom(view, node, node.input[0], None)
    so = geo.out_size()
    if so is None:
        ys = static_shape(view, node.output[0])
        so = list(ys[2:]) if ys is not None else None
    return geo, so


def _inferred_shape_check(view, node) -> None:
    """Refuse a pool whose fully static inferred output shape differs from what ORT computes
    (ceil_mode with a last window starting in the right padding, opsets < 22): every static
    shape after it was inferred from the wrong one, so the rules downstream would build
    cotangents of the wrong shape (a raw ORT error at run time, or a wrong gradient)."""
    ys = static_shape(view, node.output[0])
    so = Geom(view, node, node.input[0], None).out_size()
    if ys is not None and so is not None and list(ys[2:]) != so:
        raise unsupported(node, view, f"has ceil_mode=1 with a last window starting in the right padding: onnx's "
                                      f"shape inference (before opset 22) gives its output {list(ys)} where ONNX "
                                      f"Runtime computes {list(ys[:2]) + so}, and the shapes after it follow; "
                                      "re-export with opset >= 22, or with ceil_mode=0 (the same windows here)")


@register("AveragePool", inputs=(0,))
def _avgpool_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X, Y = node.input[0], node.output[0]
    geo, so = _window_geometry(view, node)
    div = _avg_divisor(b, view, node, geo, so)
    gd = b.mul(g, c(b, 1.0 / div)) if isinstance(div, float) else b.div(g, b.const(div.astype(b.np_float)))
    return [_window_sum_t(b, view, gd, X, Y, geo, so)]


def _window_sum_t(b, view, v: str, X: str, Y: str, geo: Geom, so) -> str:
    """The adjoint of the pool's window sums applied to v (shaped like Y), shaped like X:
    Resize upsampling for non-overlapping windows, else a ones-kernel ConvTranspose."""
    if (geo.k == geo.s and all(d == 1 for d in geo.d) and not any(geo.pb) and not any(geo.pe)
            and not geo.ceil):
        return _upsample(b, view, v, Y, X, geo.k)
    spatial = so if so is not None else dim_parts(b, view, Y, 2)
    g2 = b.reshape(v, make_shape(b, [-1, 1] + spatial))
    ones = b.const(np.ones([1, 1] + geo.k, dtype=b.np_float), hint="pool_ones")
    dx = conv_t_to(b, view, g2, ones, geo, X, so if not geo.ceil else None)
    return b.reshape(dx, b.op("Shape", [X]))


@_avgpool_vjp.defcheck
def _avgpool_check(view, node):
    _inferred_shape_check(view, node)
    _avg_divisor(None, view, node, *_window_geometry(view, node))


_avgpool_vjp.defjvp(lambda b, view, node, ts: [None] if ts[0] is None else reapply(b, node, {0: ts[0]}))


def _spatial_count(b, view, X: str, Y: str) -> str:
    xs = static_shape(view, X)
    if xs is not None:
        return c(b, float(np.prod(xs[2:])))
    return b.div(b.cast(b.op("Size", [X]), b.float_type), b.cast(b.op("Size", [Y]), b.float_type))


@register("GlobalAveragePool", inputs=(0,))
def _gap_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X, Y = node.input[0], node.output[0]
    gd = b.div(g, _spatial_count(b, view, X, Y))
    return [b.op("Expand", [gd, shape_tensor(b, view, X)])]


_gap_vjp.defjvp(lambda b, view, node, ts: [None] if ts[0] is None else reapply(b, node, {0: ts[0]}))


def _gmp_mask(b, view, node):
    X, Y = node.input[0], node.output[0]
    mask = b.cast(b.op("Equal", [X, Y]), b.float_type)
    r = view.rank(X)
    if r is None:
        raise unsupported(node, view, "needs the input rank")
    cnt = b.reduce_sum(mask, list(range(2, r)), keepdims=True)
    return mask, cnt, r


@register("GlobalMaxPool", inputs=(0,))
def _gmp_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    mask, cnt, _ = _gmp_mask(b, view, node)
    return [b.mul(mask, b.div(g, cnt))]


@_gmp_vjp.defjvp
def _gmp_jvp(b, view, node, ts):
    t = ts[0]
    if t is None:
        return [None]
    mask, cnt, r = _gmp_mask(b, view, node)
    return [b.div(b.reduce_sum(b.mul(mask, t), list(range(2, r)), keepdims=True), cnt)]


# ---------------------------------------------------------------------------- MaxUnpool
@register("MaxUnpool", inputs=(0,))
def _maxunpool_vjp(b, view, node, gys):
    """y scatters x to the flat positions I (over the whole output tensor, as MaxPool's
    Indices): dx gathers g there."""
    g = gys[0]
    return [None if g is None else b.op("Gather", [b.reshape(g, [-1]), node.input[1]], axis=0)]


_maxunpool_vjp.defjvp(linear_jvp(0))


# ------------------------------------------------------------------------------- LpPool
def _lp_slope(b, node, x: str) -> str:
    """d|x|^p/dx / p = sign(x) |x|^(p-1)."""
    p = float(attr(node, "p", 2))
    if p == 2:
        return x
    if p == 1:
        return b.op("Sign", [x])
    return b.mul(b.op("Sign", [x]), b.op("Pow", [b.op("Abs", [x]), c(b, p - 1)]))


def _lp_outer(b, node, y: str) -> str:
    """d(s^(1/p))/ds * p = y^(1-p) at s = y^p; 0 for an all-zero window (y = 0, where
    y^(1-p) is inf and the slope |x|^(p-1) is 0: torch's 0 instead of NaN)."""
    p = float(attr(node, "p", 2))
    if p == 1:
        return c(b, 1.0)
    if p == 2:
        return recip0(b, y)
    return b.op("Where", [b.op("Equal", [y, c(b, 0.0)]), c(b, 0.0), b.op("Pow", [y, c(b, 1.0 - p)])])


@register("LpPool", inputs=(0,))
def _lppool_vjp(b, view, node, gys):
    """y = (window sum |x|^p)^(1/p): dx = sign(x)|x|^(p-1) W^T(g y^(1-p))."""
    g = gys[0]
    if g is None:
        return [None]
    X, Y = node.input[0], node.output[0]
    geo, so = _window_geometry(view, node)
    back = _window_sum_t(b, view, b.mul(g, _lp_outer(b, node, Y)), X, Y, geo, so)
    return [b.mul(_lp_slope(b, node, X), back)]


@_lppool_vjp.defcheck
def _lppool_check(view, node):
    _inferred_shape_check(view, node)


@_lppool_vjp.defjvp
def _lppool_jvp(b, view, node, ts):
    """ty = y^(1-p) W(sign(x)|x|^(p-1) t), W(v) = LpPool_{p=1}(relu(v)) - LpPool_{p=1}(relu(-v))."""
    t = ts[0]
    if t is None:
        return [None]
    v = b.mul(_lp_slope(b, node, node.input[0]), t)
    parts = []
    for u in (v, b.neg(v)):
        (s,) = reapply(b, node, {0: b.op("Relu", [u])}, drop=("p",))
        b.nodes[-1].attribute.extend([helper.make_attribute("p", 1)])
        parts.append(s)
    return [b.mul(_lp_outer(b, node, node.output[0]), b.sub(parts[0], parts[1]))]


@register("GlobalLpPool", inputs=(0,))
def _glppool_vjp(b, view, node, gys):
    """LpPool's adjoint with one window over all spatial dims: dx = sign(x)|x|^(p-1) g y^(1-p)."""
    g = gys[0]
    if g is None:
        return [None]
    return [b.mul(_lp_slope(b, node, node.input[0]), b.mul(g, _lp_outer(b, node, node.output[0])))]


@_glppool_vjp.defjvp
def _glppool_jvp(b, view, node, ts):
    """ty = y^(1-p) sum over the spatial dims of sign(x)|x|^(p-1) t."""
    t = ts[0]
    if t is None:
        return [None]
    x, y = node.input[0], node.output[0]
    r = view.rank(x)
    v = b.mul(_lp_slope(b, node, x), t)
    if r is None:  # the spatial dims flattened into one, summed, then y's shape [N, C, 1, ...]
        s = b.reshape(b.reduce_sum(b.reshape(v, [0, 0, -1]), [2], keepdims=True), b.op("Shape", [y]))
    else:
        s = b.reduce_sum(v, list(range(2, r)), keepdims=True)
    return [b.mul(_lp_outer(b, node, y), s)]
