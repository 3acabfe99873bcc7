"""Neural-network ops: Softmax/LogSoftmax, the cross-entropy losses, Conv/ConvTranspose,
pooling, and the normalizations (BatchNormalization, LayerNormalization,
InstanceNormalization).

Lowerings (see docs/autodiff.md):
- Conv input grad: ConvTranspose of the cotangent with the same weight, with explicit pads
  and output_padding chosen so the result has the input's spatial size (dynamic sizes:
  ConvTranspose without pads, then Pad/Slice).
- Conv weight grad: a Conv whose batch and channel axes are swapped: the input X becomes
  [C_in/G, G*N, *S], the cotangent [C_out, N, *S_out] acts as the weight, strides and
  dilations trade places; the result [C_in/G, C_out, *k'] is cropped to the kernel and
  transposed.
- MaxPool: the Indices output (re-emitted when the node has none) and
  ScatterElements(reduction="add") on the flattened input.
- AveragePool: ConvTranspose of cotangent/divisor with a ones kernel on [N*C, 1, *S].
"""
from __future__ import annotations

from itertools import product

import numpy as np
from onnx import TensorProto

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    INT64_MAX,
    add_n,
    attr,
    c,
    dim_parts,
    dims_slice,
    inp,
    make_shape,
    need,
    out,
    reapply,
    shape_tensor,
    static_shape,
    unbroadcast,
    unsupported,
    zeros,
)

# ============================================================ Softmax / LogSoftmax
def _softmax_apply(b, view, node, v, mode):
    """mode 'vjp' or 'jvp'; handles opset>=13 (single axis) and <13 (flatten to 2-D)."""
    y = node.output[0]
    old = view.opset < 13
    axis = int(attr(node, "axis", 1 if old else -1))
    if old:
        v2 = b.op("Flatten", [v], axis=axis)
        y2 = b.op("Flatten", [y], axis=axis)
        ax = 1
    else:
        v2, y2, ax = v, y, axis
    if node.op_type == "Softmax":
        r = b.mul(y2, b.sub(v2, b.reduce_sum(b.mul(v2, y2), [ax], keepdims=True)))
    else:  # LogSoftmax: J = I - 1 p^T ; J^T = I - p 1^T
        p = b.op("Exp", [y2])
        if mode == "vjp":
            r = b.sub(v2, b.mul(p, b.reduce_sum(v2, [ax], keepdims=True)))
        else:
            r = b.sub(v2, b.reduce_sum(b.mul(p, v2), [ax], keepdims=True))
    if old:
        r = b.reshape(r, b.op("Shape", [node.input[0]]))
    return r


@register(("Softmax", "LogSoftmax"), inputs=(0,))
def _softmax_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else _softmax_apply(b, view, node, g, "vjp")]


@_softmax_vjp.defjvp
def _softmax_jvp(b, view, node, ts):
    t = ts[0]
    return [None if t is None else _softmax_apply(b, view, node, t, "jvp")]


# ================================================================ cross-entropy losses
class _CE:
    """Pieces shared by SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss rules.

    Per element i (over N and the extra dims): w_i = weights[y_i] (1 without weights) times
    the ignore mask; loss_i = -w_i lp[i, y_i]; reduction none: loss_i, sum: sum_i, mean:
    sum_i / sum_i w_i."""

    def __init__(self, b, view, node, scores_like: str):
        self.b, self.node = b, node
        labels = node.input[1]
        if view.dtypes.get(labels) != TensorProto.INT64:
            labels = b.cast(labels, TensorProto.INT64)
        self.weights = inp(node, 2)
        ii = attr(node, "ignore_index")
        self.keep = None
        self.safe = labels
        if ii is not None:
            keep = b.op("Not", [b.op("Equal", [labels, b.const(np.asarray(ii, np.int64))])])
            self.safe = b.op("Where", [keep, labels, b.const(np.asarray(0, np.int64))])
            self.keep = b.cast(keep, b.float_type)
        self.wm = self.keep
        if self.weights is not None:
            w = b.op("Gather", [self.weights, self.safe], axis=0)
            self.wm = w if self.keep is None else b.mul(w, self.keep)
        st = static_shape(view, scores_like)
        depth = (b.const(np.asarray(st[1], np.int64)) if st is not None
                 else b.reshape(dims_slice(b, scores_like, 1, 2), []))
        values = b.const(np.asarray([0.0, 1.0], dtype=b.np_float))
        self.onehot = b.op("OneHot", [self.safe, depth, values], axis=1)
        self.red = attr(node, "reduction", "mean")
        self.denom = None
        if self.red == "mean":
            if self.wm is not None:
                self.denom = b.reduce_sum(self.wm, None, keepdims=False)
            else:
                ls = static_shape(view, node.input[1])
                self.denom = (c(b, float(np.prod(ls))) if ls is not None
                              else b.cast(b.op("Size", [labels]), b.float_type))
        self.rank = view.rank(scores_like)

    def coef(self, g: str) -> str:
        """Per-element coefficient of -onehot in d loss / d lp (broadcasts over axis 1)."""
        b = self.b
        coef = b.div(g, self.denom) if self.red == "mean" else g
        if self.wm is not None:
            coef = b.mul(coef, self.wm)
        if self.red == "none" or self.wm is not None:
            coef = b.unsqueeze(coef, [1])
        return coef

    def reduce(self, per: str) -> str:
        """Apply the reduction to per-element values that already include w_i."""
        b = self.b
        if self.red == "none":
            return per
        tot = b.reduce_sum(per, None, keepdims=False)
        return tot if self.red == "sum" else b.div(tot, self.denom)

    def lp_at_label(self, lp: str) -> str:
        return self.b.reduce_sum(self.b.mul(self.onehot, lp), [1], keepdims=False)

    def weight_vjp(self, view, g: str, lp: str) -> str:
        """d loss / d weights[c] = sum_{i: y_i = c} e_i."""
        b = self.b
        e = b.neg(self.lp_at_label(lp))
        if self.red == "mean":
            e = b.div(b.sub(e, self.node.output[0]), self.denom)
        e = b.mul(e, g)
        if self.keep is not None:
            e = b.mul(e, self.keep)
        if self.rank is None:
            raise unsupported(self.node, view, "weights gradient needs the input rank")
        axes = [0] + list(range(2, self.rank))
        return b.reduce_sum(b.mul(self.onehot, b.unsqueeze(e, [1])), axes, keepdims=False)

    def weight_jvp(self, tw: str, lp: str) -> str:
        b = self.b
        twy = b.op("Gather", [tw, self.safe], axis=0)
        if self.keep is not None:
            twy = b.mul(twy, self.keep)
        per = b.neg(b.mul(twy, self.lp_at_label(lp)))
        if self.red == "none":
            return per
        tot = b.reduce_sum(per, None, keepdims=False)
        if self.red == "sum":
            return tot
        return b.div(b.sub(tot, b.mul(self.node.output[0], b.reduce_sum(twy, None, keepdims=False))), self.denom)


def _ce_logp(b, node) -> str:
    """Log-probabilities: NLL's input, or SoftmaxCrossEntropyLoss's log_prob output
    (recomputed when the node does not expose it)."""
    if node.op_type == "NegativeLogLikelihoodLoss":
        return node.input[0]
    return out(node, 1) or b.op("LogSoftmax", [node.input[0]], axis=1)


@register(("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"), since=13, inputs=(0, 2))
def _ce_vjp(b, view, node, gys, needs=None):
    g_loss = gys[0]
    g_lp = gys[1] if len(gys) > 1 else None
    res: list[str | None] = [None] * len(node.input)
    ce = _CE(b, view, node, node.input[0])
    lp = _ce_logp(b, node)
    if need(needs, 0):
        terms = []
        if g_loss is not None:
            terms.append(b.neg(b.mul(ce.onehot, ce.coef(g_loss))))
        if g_lp is not None:
            terms.append(g_lp)
        glp = add_n(b, terms)
        if glp is not None and node.op_type == "SoftmaxCrossEntropyLoss":
            p = b.op("Exp", [lp])
            glp = b.sub(glp, b.mul(p, b.reduce_sum(glp, [1], keepdims=True)))
        res[0] = glp
    if len(node.input) > 2 and inp(node, 2) and need(needs, 2) and g_loss is not None:
        res[2] = ce.weight_vjp(view, g_loss, lp)
    return res


@_ce_vjp.defjvp
def _ce_jvp(b, view, node, ts):
    t = ts[0]
    tw = ts[2] if len(ts) > 2 else None
    ce = _CE(b, view, node, node.input[0])
    lp = _ce_logp(b, node)
    dlp = None
    if t is not None:
        if node.op_type == "SoftmaxCrossEntropyLoss":
            dlp = b.sub(t, b.reduce_sum(b.mul(b.op("Exp", [lp]), t), [1], keepdims=True))
        else:
            dlp = t
    terms = []
    if dlp is not None:
        per = b.neg(ce.lp_at_label(dlp))
        if ce.wm is not None:
            per = b.mul(per, ce.wm)
        terms.append(ce.reduce(per))
    if tw is not None:
        terms.append(ce.weight_jvp(tw, lp))
    res = [add_n(b, terms)]
    if len(node.output) > 1:
        res.append(dlp if node.output[1] else None)
    return res


# ======================================================================== conv geometry
class _Geom:
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


def _spatial_axes(nd: int) -> list[int]:
    return list(range(2, 2 + nd))


def _conv_t_to(b, view, g: str, w: str, geo: _Geom, x_like: str, so: list | None, group: int = 1) -> str:
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
    return b.op("Slice", [padded, pb, b.add(sizes, pb), b.ints(_spatial_axes(nd))])


def _conv_input_grad(b, view, g: str, W: str, geo: _Geom, X: str, so, group: int) -> str:
    """Input cotangent of a Conv. Stride 1: a Conv of the cotangent with the flipped,
    channel-transposed kernel (fast in ORT); otherwise ConvTranspose (_conv_t_to)."""
    ws = static_shape(view, W)
    pads_t = None
    if geo.k is not None and ws is not None and all(v == 1 for v in geo.s):
        pads_t = [geo.eff[i] - 1 - geo.pb[i] for i in range(geo.nd)] + [
            geo.eff[i] - 1 - geo.pe[i] for i in range(geo.nd)]
    if pads_t is None or min(pads_t) < 0:
        return _conv_t_to(b, view, g, W, geo, X, so, group)
    nd = geo.nd
    M, cg = ws[0], ws[1]
    if group == 1:
        wt = b.transpose(W, [1, 0] + _spatial_axes(nd))
    else:
        wt = b.reshape(W, [group, M // group, cg] + geo.k)
        wt = b.transpose(wt, [0, 2, 1] + list(range(3, 3 + nd)))
        wt = b.reshape(wt, [group * cg, M // group] + geo.k)
    if any(k > 1 for k in geo.k):
        wt = b.op("Slice", [wt, b.ints([-1] * nd), b.ints([-INT64_MAX] * nd), b.ints(_spatial_axes(nd)),
                            b.ints([-1] * nd)])
    return b.op("Conv", [g, wt], dilations=geo.d, pads=pads_t, group=group if group != 1 else None)


def _conv_weight_grad(b, view, X: str, g: str, W: str, Y: str, geo: _Geom, group: int, so, kstat) -> str:
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
    sp = _spatial_axes(nd)
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


def _swapped_conv(b, view, a: str, a_like: str, a_cg, bt: str, group: int, geo: _Geom,
                  pe: list[int], w: str, kdim_static: list | None) -> str:
    """out[m, c, kk] = sum_{n,p} a_pad[n, grp(m)*a_cg + c, kk*dil + p*stride] * bt[n, m, p]
    as a Conv with batch and channel axes swapped; returns [M, a_cg, *k_crop]."""
    nd = geo.nd
    if group == 1:
        aT = b.transpose(a, [1, 0] + _spatial_axes(nd))
    else:
        sp = dim_parts(b, view, a_like, 2)
        a5 = b.reshape(a, make_shape(b, dim_parts(b, view, a_like, 0, 1) + [group, a_cg] + sp))
        aT = b.transpose(a5, [2, 1, 0] + list(range(3, 3 + nd)))
        aT = b.reshape(aT, make_shape(b, [a_cg, -1] + sp))
    bT = b.transpose(bt, [1, 0] + _spatial_axes(nd))
    r = b.op("Conv", [aT, bT], strides=geo.d, dilations=geo.s, pads=geo.pb + pe,
             group=group if group != 1 else None)
    if geo.k is None or kdim_static is None or list(kdim_static) != list(geo.k):
        ends = b.ints(geo.k) if geo.k is not None else dims_slice(b, w, 2)
        r = b.op("Slice", [r, b.ints([0] * nd), ends, b.ints(_spatial_axes(nd))])
    return b.transpose(r, [1, 0] + _spatial_axes(nd))


def _channel_sum(b, view, g: str, nd: int) -> str:
    return b.reduce_sum(g, [0] + _spatial_axes(nd), keepdims=False)


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
    geo = _Geom(view, node, X, W)
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
    _Geom(view, node, node.input[0], node.input[1])


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
    geo = _Geom(view, node, X, W, transposed=True)
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
                dx = b.op("Slice", [dx, b.ints([0] * geo.nd), b.ints(geo.S), b.ints(_spatial_axes(geo.nd))])
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


# ============================================================================= pooling
def _pool_indices(b, view, node) -> str:
    idx = out(node, 1)
    if idx is not None and int(attr(node, "storage_order", 0)) == 0:
        return idx
    return reapply(b, node, {}, n_out=2, drop=("storage_order",))[1]


@register("MaxPool", inputs=(0,))
def _maxpool_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X = node.input[0]
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
                sl = [b.ints(list(off)), b.ints([INT64_MAX] * nd), b.ints(_spatial_axes(nd)), b.ints(m)]
                gs = b.op("Slice", [g] + sl)
                ids = b.op("Slice", [idx] + sl)
            parts.append(b.op("ScatterElements", [zeros(b, numel), b.reshape(ids, [-1]), b.reshape(gs, [-1])],
                              axis=0))
        flat = add_n(b, parts)
    return [b.reshape(flat, b.op("Shape", [X]))]


@_maxpool_vjp.defjvp
def _maxpool_jvp(b, view, node, ts):
    t = ts[0]
    if t is None:
        return [None] * len(node.output)
    idx = _pool_indices(b, view, node)
    return [b.op("Gather", [b.reshape(t, [-1]), idx], axis=0)] + [None] * (len(node.output) - 1)


def _avg_divisor(b, view, node, geo: _Geom, so):
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
    scales = b.const(np.asarray([1.0, 1.0] + [float(f) for f in k], dtype=np.float32), hint="scales")
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


@register("AveragePool", inputs=(0,))
def _avgpool_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X, Y = node.input[0], node.output[0]
    geo = _Geom(view, node, X, None)
    ys = static_shape(view, Y)
    so = list(ys[2:]) if ys is not None else geo.out_size()
    div = _avg_divisor(b, view, node, geo, so)
    gd = b.mul(g, c(b, 1.0 / div)) if isinstance(div, float) else b.div(g, b.const(div.astype(b.np_float)))
    if (geo.k == geo.s and all(v == 1 for v in geo.d) and not any(geo.pb) and not any(geo.pe)
            and not geo.ceil):
        return [_upsample(b, view, gd, Y, X, geo.k)]
    g2 = b.reshape(gd, make_shape(b, [-1, 1] + dim_parts(b, view, Y, 2)))
    ones = b.const(np.ones([1, 1] + geo.k, dtype=b.np_float), hint="pool_ones")
    dx = _conv_t_to(b, view, g2, ones, geo, X, so if not geo.ceil else None)
    return [b.reshape(dx, b.op("Shape", [X]))]


@_avgpool_vjp.defcheck
def _avgpool_check(view, node):
    geo = _Geom(view, node, node.input[0], None)
    ys = static_shape(view, node.output[0])
    _avg_divisor(None, view, node, geo, list(ys[2:]) if ys is not None else geo.out_size())


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


# ====================================================================== normalizations
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


def _ln_axes(view, node):
    axis = int(attr(node, "axis", -1))
    r = view.rank(node.input[0])
    if axis < 0:
        return list(range(axis, 0)) if r is None else list(range(axis + r, r))
    if r is None:
        raise unsupported(node, view, "with a non-negative axis needs the input rank")
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
    axes = _ln_axes(view, node)
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
    axes = _ln_axes(view, node)
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


@_bn_vjp.defjvp
def _bn_jvp(b, view, node, ts):
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

