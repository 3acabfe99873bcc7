"""Conv and ConvTranspose, with the spatial geometry they share with pooling (`Geom`: pads
resolved, auto_pad included) and the ConvTranspose adjoint of a strided correlation
(`conv_t_to`, also AveragePool's vjp).

Lowerings (see docs/autodiff.md):
- Conv input grad: for stride 1 a Conv of the cotangent with the flipped, channel-transposed
  kernel; otherwise ConvTranspose of the cotangent with the same weight, with explicit pads
  and output_padding chosen so the result has the input's spatial size (dynamic sizes:
  ConvTranspose without pads, then Pad/Slice).
- Conv weight grad: im2col by strided slices of the padded input, then one Gemm (a batched
  MatMul over groups); without a static kernel/weight shape, a Conv whose batch and channel
  axes are swapped (the input X becomes [C_in/G, G*N, *S], the cotangent [C_out, N, *S_out]
  acts as the weight, strides and dilations trade places; the result is cropped to the
  kernel and transposed).
- ConvTranspose: the mirror image (input grad a Conv, weight grad the swapped Conv).
"""
from __future__ import annotations

from itertools import product

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    INT64_MAX,
    add_n,
    attr,
    dim_parts,
    dims_slice,
    inp,
    make_shape,
    need,
    reapply,
    shape_tensor,
    static_shape,
    unsupported,
)


# ======================================================================== conv geometry
class Geom:
    """Spatial geometry of a conv/pool node with pads resolved (auto_pad included)."""

    def __init__(self, view, node, x: str, w: str | None, transposed: bool = False):
        self.node = node
        xs = view.shape(x)
        ws = view.shape(w) if w else None
        k = attr(node, "kernel_shape")
        if k is None and ws is not None and all(isinstance(d, int) for d in ws[2:]):
            k = list(ws[2:])
        self.k = None if k is None else [int(v) for v in k]
        if self.k is not None:
            nd = len(self.k)
        elif xs is not None or ws is not None:
            nd = len(xs if xs is not None else ws) - 2
        else:
            raise unsupported(node, view, "needs kernel_shape or the input rank")
        self.nd = nd
        self.s = [int(v) for v in attr(node, "strides", [1] * nd)]
        self.d = [int(v) for v in attr(node, "dilations", [1] * nd)]
        self.eff = None if self.k is None else [(k_ - 1) * d_ + 1 for k_, d_ in zip(self.k, self.d)]
        self.S = None if xs is None else list(xs[2:])
        self.S_static = self.S is not None and all(isinstance(v, int) for v in self.S)
        pads = [int(v) for v in attr(node, "pads", [0] * (2 * nd))]
        auto = attr(node, "auto_pad", "NOTSET")
        self.ceil = int(attr(node, "ceil_mode", 0))
        if auto == "VALID":
            pads = [0] * (2 * nd)
        elif auto in ("SAME_UPPER", "SAME_LOWER") and not transposed:
            if not self.S_static or self.k is None:
                raise unsupported(node, view, f"auto_pad={auto} needs static spatial input dims")
            pads = [0] * (2 * nd)
            for i in range(nd):
                o = -(-self.S[i] // self.s[i])
                tot = max(0, (o - 1) * self.s[i] + self.eff[i] - self.S[i])
                small, big = tot // 2, tot - tot // 2
                pads[i], pads[nd + i] = (small, big) if auto == "SAME_UPPER" else (big, small)
        self.pb, self.pe = pads[:nd], pads[nd:]

    def out_size(self) -> list[int] | None:
        if not self.S_static or self.k is None:
            return None
        res = []
        for i in range(self.nd):
            num = self.S[i] + self.pb[i] + self.pe[i] - self.eff[i]
            o = (-(-num // self.s[i]) if self.ceil else num // self.s[i]) + 1
            if self.ceil and (o - 1) * self.s[i] >= self.S[i] + self.pb[i]:
                o -= 1
            res.append(o)
        return res


def spatial_axes(nd: int) -> list[int]:
    return list(range(2, 2 + nd))


def conv_t_to(b, view, g: str, w: str, geo: Geom, x_like: str, so: list | None, group: int = 1) -> str:
    """ConvTranspose(g, w) with geo's strides/dilations, cropped/padded so that its spatial
    size equals that of `x_like` (the adjoint of the strided correlation)."""
    nd = geo.nd
    kw = dict(strides=geo.s, dilations=geo.d, group=group if group != 1 else None)
    if geo.S_static and geo.k is not None and so is not None and all(isinstance(v, int) for v in so):
        pe, opad = [], []
        for i in range(nd):
            total = geo.s[i] * (so[i] - 1) + geo.eff[i] - geo.pb[i] - geo.pe[i]
            if total <= geo.S[i]:
                pe.append(geo.pe[i])
                opad.append(geo.S[i] - total)
            else:
                pe.append(geo.pe[i] + total - geo.S[i])
                opad.append(0)
        return b.op("ConvTranspose", [g, w], pads=geo.pb + pe,
                    output_padding=opad if any(opad) else None, **kw)
    # dynamic spatial dims: full-size transpose, then pad the end and crop [pb, pb + S)
    full = b.op("ConvTranspose", [g, w], **kw)
    sizes = dims_slice(b, x_like, 2)
    pb = b.ints(geo.pb)
    need_end = b.op("Max", [b.sub(b.add(sizes, pb), dims_slice(b, full, 2)), b.ints([0] * nd)])
    pads = b.op("Concat", [b.ints([0] * (2 + nd + 2)), need_end], axis=0)
    padded = b.op("Pad", [full, pads])
    return b.op("Slice", [padded, pb, b.add(sizes, pb), b.ints(spatial_axes(nd))])


def _conv_input_grad(b, view, g: str, W: str, geo: Geom, X: str, so, group: int) -> str:
    """Input cotangent of a Conv. Stride 1: a Conv of the cotangent with the flipped,
    channel-transposed kernel (fast in ORT); otherwise ConvTranspose (conv_t_to)."""
    ws = static_shape(view, W)
    pads_t = None
    if geo.k is not None and ws is not None and all(v == 1 for v in geo.s):
        pads_t = [geo.eff[i] - 1 - geo.pb[i] for i in range(geo.nd)] + [
            geo.eff[i] - 1 - geo.pe[i] for i in range(geo.nd)]
    if pads_t is None or min(pads_t) < 0:
        return conv_t_to(b, view, g, W, geo, X, so, group)
    nd = geo.nd
    M, cg = ws[0], ws[1]
    if group == 1:
        wt = b.transpose(W, [1, 0] + spatial_axes(nd))
    else:
        wt = b.reshape(W, [group, M // group, cg] + geo.k)
        wt = b.transpose(wt, [0, 2, 1] + list(range(3, 3 + nd)))
        wt = b.reshape(wt, [group * cg, M // group] + geo.k)
    if any(k > 1 for k in geo.k):
        wt = b.op("Slice", [wt, b.ints([-1] * nd), b.ints([-INT64_MAX] * nd), b.ints(spatial_axes(nd)),
                            b.ints([-1] * nd)])
    return b.op("Conv", [g, wt], dilations=geo.d, pads=pads_t, group=group if group != 1 else None)


def _conv_weight_grad(b, view, X: str, g: str, W: str, Y: str, geo: Geom, group: int, so, kstat) -> str:
    """Weight cotangent of a Conv: im2col by strided slices of the padded, batch/channel-
    transposed input ([C, K, N, *So] -> [G, Cg*K, N*P]), then one GEMM per group against the
    transposed cotangent ([G, Mg, N*P]). Falls back to the batch/channel-swapped Conv when
    the kernel or weight shape is not static."""
    ws = static_shape(view, W)
    if geo.k is None or ws is None:
        return _swapped_conv(b, view, X, X, _group_cg(b, view, W), g, group, geo, geo.pe, W, kstat)
    nd = geo.nd
    M, cg = ws[0], ws[1]
    mg = M // group
    K = int(np.prod(geo.k))
    sp = spatial_axes(nd)
    xp = b.transpose(X, [1, 0] + sp)
    if any(geo.pb) or any(geo.pe):
        xp = b.op("Pad", [xp, b.ints([0, 0] + geo.pb + [0, 0] + geo.pe)])
    static_so = so is not None and all(isinstance(v, int) for v in so)
    if not static_so:
        span = b.add(b.mul(b.sub(dims_slice(b, Y, 2), b.ints([1] * nd)), b.ints(geo.s)), b.ints([1] * nd))
    steps = [b.ints(geo.s)] if any(v != 1 for v in geo.s) else []
    cols = []
    for off in product(*[range(k) for k in geo.k]):
        if K == 1 and not steps and not (any(geo.pb) or any(geo.pe)):
            cols.append(xp)
            break
        starts = [off[i] * geo.d[i] for i in range(nd)]
        if static_so:
            ends = b.ints([starts[i] + (so[i] - 1) * geo.s[i] + 1 for i in range(nd)])
        else:
            ends = b.add(span, b.ints(starts))
        cols.append(b.op("Slice", [xp, b.ints(starts), ends, b.ints(sp)] + steps))
    patches = cols[0] if K == 1 else b.op("Concat", [b.unsqueeze(col, [1]) for col in cols], axis=1)
    gT = b.transpose(g, [1, 0] + sp)  # [M, N, *So]
    if group == 1:
        dw = b.op("Gemm", [b.reshape(gT, [M, -1]), b.reshape(patches, [cg * K, -1])], transB=1)
    else:
        patches = b.reshape(patches, [group, cg * K, -1])
        dw = b.matmul(b.reshape(gT, [group, mg, -1]), b.transpose(patches, [0, 2, 1]))
    return b.reshape(dw, [M, cg] + geo.k)


def _swapped_conv(b, view, a: str, a_like: str, a_cg, bt: str, group: int, geo: Geom,
                  pe: list[int], w: str, kdim_static: list | None) -> str:
    """out[m, c, kk] = sum_{n,p} a_pad[n, grp(m)*a_cg + c, kk*dil + p*stride] * bt[n, m, p]
    as a Conv with batch and channel axes swapped; returns [M, a_cg, *k_crop]."""
    nd = geo.nd
    if group == 1:
        aT = b.transpose(a, [1, 0] + spatial_axes(nd))
    else:
        sp = dim_parts(b, view, a_like, 2)
        a5 = b.reshape(a, make_shape(b, dim_parts(b, view, a_like, 0, 1) + [group, a_cg] + sp))
        aT = b.transpose(a5, [2, 1, 0] + list(range(3, 3 + nd)))
        aT = b.reshape(aT, make_shape(b, [a_cg, -1] + sp))
    bT = b.transpose(bt, [1, 0] + spatial_axes(nd))
    r = b.op("Conv", [aT, bT], strides=geo.d, dilations=geo.s, pads=geo.pb + pe,
             group=group if group != 1 else None)
    if geo.k is None or kdim_static is None or list(kdim_static) != list(geo.k):
        ends = b.ints(geo.k) if geo.k is not None else dims_slice(b, w, 2)
        r = b.op("Slice", [r, b.ints([0] * nd), ends, b.ints(spatial_axes(nd))])
    return b.transpose(r, [1, 0] + spatial_axes(nd))


def _channel_sum(b, view, g: str, nd: int) -> str:
    return b.reduce_sum(g, [0] + spatial_axes(nd), keepdims=False)


def _group_cg(b, view, w: str):
    """Channels per group of the conv input (Conv) / output (ConvTranspose): weight dim 1."""
    ws = view.shape(w)
    if ws is not None and len(ws) > 1 and isinstance(ws[1], int):
        return ws[1]
    return dims_slice(b, w, 1, 2)


# ================================================================================ Conv
@register("Conv")
def _conv_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    n_in = len(node.input)
    if g is None:
        return [None] * n_in
    X, W = node.input[0], node.input[1]
    Y = node.output[0]
    geo = Geom(view, node, X, W)
    group = int(attr(node, "group", 1))
    res: list[str | None] = [None] * n_in
    so = static_shape(view, Y)
    so = list(so[2:]) if so is not None else geo.out_size()
    if need(needs, 0):
        res[0] = _conv_input_grad(b, view, g, W, geo, X, so, group)
    if need(needs, 1):
        kstat = None
        if geo.S_static and so is not None:
            kstat = [(geo.S[i] + geo.pb[i] + geo.pe[i] - ((so[i] - 1) * geo.s[i] + 1)) // geo.d[i] + 1
                     for i in range(geo.nd)]
        res[1] = _conv_weight_grad(b, view, X, g, W, Y, geo, group, so, kstat)
    if n_in > 2 and inp(node, 2) and need(needs, 2):
        res[2] = _channel_sum(b, view, g, geo.nd)
    return res


@_conv_vjp.defcheck
def _conv_check(view, node):
    Geom(view, node, node.input[0], node.input[1])


def _bias_b(b, t: str, nd: int) -> str:
    return b.reshape(t, [-1] + [1] * nd)


@_conv_vjp.defjvp
def _conv_jvp(b, view, node, ts):
    X = node.input[0]
    Y = node.output[0]
    tX, tW = ts[0], ts[1]
    tB = ts[2] if len(ts) > 2 else None
    terms = []
    if tX is not None:
        terms.append(reapply(b, node, {0: tX, 2: None})[0])
    if tW is not None:
        terms.append(reapply(b, node, {1: tW, 2: tB})[0])
    elif tB is not None:
        nd = len(view.shape(X)) - 2 if view.shape(X) is not None else len(attr(node, "kernel_shape"))
        terms.append(b.op("Expand", [_bias_b(b, tB, nd), shape_tensor(b, view, Y)]))
    return [add_n(b, terms)]


# ======================================================================= ConvTranspose
def _convt_geom(view, node):
    X, W = node.input[0], node.input[1]
    geo = Geom(view, node, X, W, transposed=True)
    nd = geo.nd
    opad = [int(v) for v in attr(node, "output_padding", [0] * nd)]
    oshape = attr(node, "output_shape")
    auto = attr(node, "auto_pad", "NOTSET")
    if oshape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        if geo.k is None:
            raise unsupported(node, view, "with output_shape/auto_pad needs kernel_shape or a static weight")
        if oshape is not None:
            if not geo.S_static:
                raise unsupported(node, view, "output_shape needs static spatial input dims")
            oshape = list(oshape)[-nd:]
        else:
            oshape = None
        for i in range(nd):
            if oshape is not None:
                tot = geo.s[i] * (geo.S[i] - 1) + opad[i] + geo.eff[i] - oshape[i]
            else:
                tot = opad[i] + geo.eff[i] - geo.s[i]
            half = tot // 2
            if auto == "SAME_UPPER":
                geo.pb[i], geo.pe[i] = half, tot - half
            else:
                geo.pb[i], geo.pe[i] = tot - half, half
    # end padding of the adjoint correlation (the output_padding rows are never read)
    ys = static_shape(view, node.output[0])
    if geo.S_static and ys is not None and geo.k is not None:
        pe2 = [max(0, geo.s[i] * (geo.S[i] - 1) + geo.eff[i] - ys[2 + i] - geo.pb[i]) for i in range(nd)]
    else:
        pe2 = [max(0, geo.pe[i] - opad[i]) for i in range(nd)]
    return geo, pe2


@register("ConvTranspose")
def _convt_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    n_in = len(node.input)
    if g is None:
        return [None] * n_in
    X, W = node.input[0], node.input[1]
    Y = node.output[0]
    geo, pe2 = _convt_geom(view, node)
    group = int(attr(node, "group", 1))
    res: list[str | None] = [None] * n_in
    if need(needs, 0):
        dx = b.op("Conv", [g, W], strides=geo.s, dilations=geo.d, pads=geo.pb + pe2,
                  group=group if group != 1 else None)
        ys = static_shape(view, Y)
        if geo.S_static and ys is not None and geo.k is not None:
            full = [(ys[2 + i] + geo.pb[i] + pe2[i] - geo.eff[i]) // geo.s[i] + 1 for i in range(geo.nd)]
            if full != geo.S:
                dx = b.op("Slice", [dx, b.ints([0] * geo.nd), b.ints(geo.S), b.ints(spatial_axes(geo.nd))])
        res[0] = dx
    if need(needs, 1):
        cg_out = _group_cg(b, view, W)
        res[1] = _swapped_conv(b, view, g, Y, cg_out, X, group, geo, pe2, W, None)
    if n_in > 2 and inp(node, 2) and need(needs, 2):
        res[2] = _channel_sum(b, view, g, geo.nd)
    return res


@_convt_vjp.defcheck
def _convt_check(view, node):
    _convt_geom(view, node)


_convt_vjp.defjvp(_conv_jvp)
