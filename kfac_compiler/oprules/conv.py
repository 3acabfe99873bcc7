"""Conv and ConvTranspose, with the spatial geometry they share with pooling (`Geom`: pads
resolved, auto_pad included), the ConvTranspose adjoint of a strided correlation
(`conv_t_to`, also AveragePool's vjp), and the Gather forms of a group-1 Conv with static
spatial sizes (`gather_table`, `GatherConv`, `lower_forward`).

Lowerings (see docs/autodiff.md):
- Conv, group 1, static sizes (the batch may be dynamic): the cotangent made channels-last
  once ([N, P_out, M]); weight grad: im2col patches as ONE Gather of the input's
  channels-last rows (a zero row for padding) and one Gemm; input grad at stride 1: the
  cotangent's rows gathered by the adjoint table and one MatMul with the weight. Kernel
  offsets that only ever meet padding are left out (zero weight gradient there).
- Otherwise: input grad for stride 1 a Conv of the cotangent with the flipped,
  channel-transposed kernel, else ConvTranspose of the cotangent with the same weight, with
  explicit pads and output_padding chosen so the result has the input's spatial size
  (dynamic sizes: ConvTranspose without pads, then Pad/Slice). Weight grad: im2col by strided
  slices of the padded input, then one Gemm (a batched MatMul over groups), or without a
  static kernel/weight shape a Conv whose batch and channel axes are swapped (the input X
  becomes [C_in/G, G*N, *S], the cotangent [C_out, N, *S_out] acts as the weight, strides and
  dilations trade places; the result is cropped to the kernel and transposed).
- Forward (training subgraphs, backend/emission.py): a Conv whose weight is a parameter
  and whose output is small runs as the weight gradient's Gather patches times the weight.
- ConvTranspose: the mirror image (input grad a Conv, weight grad the swapped Conv).
- Col2Im (F.fold): linear; its adjoint is im2col, a Conv of the cotangent [N*C, 1, *S] with
  one one-hot kernel per block offset.
"""
from __future__ import annotations

from itertools import product

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    INT64_MAX,
    add_n,
    attr,
    cval,
    dim_parts,
    dims_slice,
    inp,
    linear_jvp,
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


# Gather im2col: a conv's patches as one Gather of channels-last rows. ORT's Conv with a
# weight that is not an initializer runs its generic NCHW kernel (an im2col and a GEMM per
# image, as wide as the image), and strided Slices of NCHW tensors copy runs of a few floats;
# a Gather of [N, P+1, C] rows copies C contiguous floats per index. The tables map (position,
# kernel offset) to a row, row P holding zeros (padding, or no contribution). Measurements:
# docs/autodiff.md.
GATHER_TABLE_MAX = 1 << 22  # entries of a gather table (int64): above it, the Slice/Conv forms


def _axis_taps(n_pos: int, n_src: int, k: int, s: int, d: int, pb: int, adjoint: bool) -> np.ndarray:
    """[n_pos, k] source index along one axis, -1 where there is none. Forward (im2col of the
    input): source = pos*s + kk*d - pb. Adjoint (input positions of the transposed conv):
    source = (pos + pb - kk*d) / s where that is an integer."""
    pos = np.arange(n_pos)[:, None]
    kk = np.arange(k)[None, :]
    if adjoint:
        num = pos + pb - kk * d
        src = np.where(num % s == 0, num // s, -1)
    else:
        src = pos * s + kk * d - pb
    return np.where((src >= 0) & (src < n_src), src, -1)


def gather_table(n_pos: list[int], n_src: list[int], geo: Geom, adjoint: bool,
                 full: bool = False) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """([prod(n_pos), L] int64: for each position and kernel offset the row of the flattened
    source, or prod(n_src) (the zero row) where there is none; the box of kernel offsets
    [lo, hi) per axis that meet the source at all, L its size: the others contribute nothing.
    `full`: every offset (the box is the whole kernel)."""
    taps = [_axis_taps(n_pos[i], n_src[i], geo.k[i], geo.s[i], geo.d[i], geo.pb[i], adjoint) for i in range(geo.nd)]
    box = []
    for t in taps:
        live = np.flatnonzero((t >= 0).any(axis=0))
        box.append((0, t.shape[1]) if full else (int(live[0]), int(live[-1]) + 1) if live.size else (0, 1))
    taps = [t[:, lo:hi] for t, (lo, hi) in zip(taps, box)]
    nd = geo.nd
    idx = np.zeros([1] * (2 * nd), np.int64)
    valid = np.ones([1] * (2 * nd), bool)
    for i, t in enumerate(taps):  # axes: positions (nd), then offsets (nd)
        shp = [1] * (2 * nd)
        shp[i], shp[nd + i] = t.shape
        t = t.reshape(shp)
        idx = idx * n_src[i] + np.maximum(t, 0)
        valid = valid & (t >= 0)
    zero_row = int(np.prod(n_src))
    return np.where(valid, idx, zero_row).reshape(int(np.prod(n_pos)), -1), box


def _channels_last(b, t: str, ch: int, n: int) -> str:
    """[N, ch, *S] (prod(S) = n) -> [N, n, ch]. Every Transpose of these forms moves one axis
    or is 2-D, ORT's block-copy paths; its general permutation copies element by element."""
    return b.transpose(b.reshape(t, [0, ch, n]), [0, 2, 1])


def _zero_row(b, rows: str) -> str:
    """[N, n, ch] -> [N, n + 1, ch], row n zero (where the tables point for padding)."""
    return b.op("Pad", [rows, b.ints([0, 0, 0, 0, 1, 0])])


def _gather_ok(b, geo: Geom, so, ws, group: int) -> bool:
    """The gather forms apply: allowed by the builder (b.conv_gather, an emission option; False:
    the Slice/Conv/ConvTranspose forms only), group 1 and every size static (the batch may be
    dynamic)."""
    return (b.conv_gather and group == 1 and geo.k is not None and geo.S_static and ws is not None and so is not None
            and all(isinstance(v, int) for v in so)
            and int(np.prod(so)) * int(np.prod(geo.k)) <= GATHER_TABLE_MAX
            and int(np.prod(geo.S)) * int(np.prod(geo.k)) <= GATHER_TABLE_MAX)


def _rows_pay(ch: int, geo: Geom, so: list[int]) -> bool:
    """Gathering rows of `ch` floats beats strided Slices of NCHW rows (runs of the output
    width at stride 1) once the rows are as long, or 8 floats: Gather copies one row per
    index, so a 1-channel input (the first conv of a grey-scale net) stays on Slices."""
    run = so[-1] if geo.s[-1] == 1 and geo.d[-1] == 1 else 1
    return ch >= min(8, run)


NOMINAL_BATCH = 32  # the batch at which GatherConv weighs activation- against weight-sized copies


class GatherConv:
    """A group-1 Conv with static sizes in the Gather forms: patches [N, P, L, C] of the
    input's channels-last rows, and the cotangent's rows gathered by the adjoint table.

    Two layouts, by which copies are smaller. Weight-major (most convs: many positions per
    image): the patches stay offset-major and the weight is rearranged to match ([M, L, C]
    for the forward, [L*M, C] for the input cotangent; dW comes out [M, L, C]); offsets that
    only meet padding are left out (a Slice of W, a Pad of dW). Patch-major (few positions,
    many output channels, NOMINAL_BATCH * P_out < M: ResNet's last stages): the patches and
    the gathered cotangent are transposed to channel-major instead, over the whole kernel, so
    that the weight is used and produced in its own layout (only the input cotangent needs
    a one-axis transpose of W): a weight-sized Slice/Pad/Transpose costs more there than
    the zero rows' extra GEMM work."""

    def __init__(self, b, geo: Geom, so: list[int], ws):
        self.b, self.geo, self.so = b, geo, list(so)
        self.M, self.C = int(ws[0]), int(ws[1])
        self.P, self.P_in = int(np.prod(so)), int(np.prod(geo.S))
        self.K = int(np.prod(geo.k))
        self.patch_major = NOMINAL_BATCH * self.P < self.M
        self._g_last = None

    def _span(self, box) -> list[int]:
        return [hi - lo for lo, hi in box]

    def patches(self, X: str) -> tuple[str, list]:
        """[N*P, L*C] (weight-major) or [N*P, C*K] (patch-major) and the offsets' box; the
        same nodes and constants each time (ONNX Runtime's CSE merges the copies)."""
        b, C = self.b, self.C
        table, box = gather_table(self.so, self.geo.S, self.geo, adjoint=False, full=self.patch_major)
        pt = b.op("Gather", [_zero_row(b, _channels_last(b, X, C, self.P_in)), b.const(table, hint="im2col")],
                  axis=1)  # [N, P, L, C]
        if self.patch_major:
            pt = b.transpose(pt, [0, 1, 3, 2])
        return b.reshape(pt, [-1, table.shape[1] * C]), box

    def _weight_rows(self, W: str, box) -> str:
        """W as the right operand of patches @ W^T: [M, L*C] or [M, C*K] (W itself)."""
        b, M, C = self.b, self.M, self.C
        if self.patch_major:
            return b.reshape(W, [M, C * self.K])
        L = int(np.prod(self._span(box)))
        return b.reshape(b.transpose(b.reshape(_box_weight(b, W, self.geo, box), [M, C, L]), [0, 2, 1]), [M, L * C])

    def rows(self, X: str, W: str, C: str | None = None) -> str:
        """patches(X) @ W^T (+ C, Gemm's addend: a bias [M] or earlier rows): [N*P, M]."""
        pt, box = self.patches(X)
        return self.b.op("Gemm", [pt, self._weight_rows(W, box)] + ([C] if C else []), transB=1)

    def to_output(self, rows: str, Y: str | None = None) -> str:
        """[N*P, M] rows -> [N, M, *S_out] (written to Y when given)."""
        b, M = self.b, self.M
        y = b.transpose(b.reshape(rows, [-1, self.P, M]), [0, 2, 1])
        return b.op("Reshape", [y, b.ints([-1, M] + self.so)], outputs=[Y] if Y else None)

    def forward(self, X: str, W: str, B: str | None, Y: str) -> None:
        """Y = patches @ W^T (+ B as Gemm's C), back to [N, M, *S_out]."""
        self.to_output(self.rows(X, W, B), Y)

    def g_last(self, g: str) -> str:
        if self._g_last is None:
            self._g_last = _channels_last(self.b, g, self.M, self.P)
        return self._g_last

    def weight(self, X: str, g: str) -> str:
        """dW[m, c, kk] = sum over (n, p) of g[n, m, p] x_pad[n, c, p*s + kk*d]: one Gemm of the
        cotangent rows [N*P, M] with the patches."""
        b, geo, M, C = self.b, self.geo, self.M, self.C
        pt, box = self.patches(X)
        dw = b.op("Gemm", [b.reshape(self.g_last(g), [-1, M]), pt], transA=1)  # [M, L*C] or [M, C*K]
        if self.patch_major:
            return b.reshape(dw, [M, C] + list(geo.k))
        span = self._span(box)
        dw = b.reshape(b.transpose(b.reshape(dw, [M, int(np.prod(span)), C]), [0, 2, 1]), [M, C] + span)
        if span != geo.k:  # offsets that only ever meet padding: zero gradient
            pads = [0, 0] + [lo for lo, _ in box] + [0, 0] + [k - hi for k, (_, hi) in zip(geo.k, box)]
            dw = b.op("Pad", [dw, b.ints(pads)])
        return dw

    def input(self, W: str, g: str) -> str:
        """dx[n, c, i] = sum over (kk, m) of g[n, m, o(i, kk)] W[m, c, kk], o(i, kk) the output
        position whose window puts offset kk on i (if any), as col2im: the columns
        Z[n, o, kk, c] = sum_m g[n, m, o] W[m, c, kk] in one GEMM, gathered per input position
        and summed over the offsets. For strided or patch-major convs only (`col2im_pays`)."""
        b, geo, M, C = self.b, self.geo, self.M, self.C
        table, box = gather_table(geo.S, self.so, geo, adjoint=True, full=self.patch_major)
        span = self._span(box)
        L = int(np.prod(span))
        # columns [N, P_out * L, C]: weight-major through the forward's W rows ([M, L*C]),
        # patch-major through W itself ([M, C*K]) and a transpose of the (smaller) columns
        z = b.matmul(b.reshape(self.g_last(g), [-1, M]), self._weight_rows(W, box))
        if self.patch_major:
            z = b.transpose(b.reshape(z, [-1, self.P, C, L]), [0, 1, 3, 2])
        z = _zero_row(b, b.reshape(z, [-1, self.P * L, C]))
        # table: (input position, offset) -> column row o * L + offset, or the zero row
        col = np.arange(L)[None, :]
        rows = np.where(table < self.P, table * L + col, self.P * L)
        cols = b.op("Gather", [z, b.const(rows, hint="col2im")], axis=1)  # [N, P_in, L, C]
        return self._to_nchw(b.reduce_sum(cols, [2]))

    def col2im_pays(self) -> bool:
        """col2im beats ORT's ConvTranspose for strided convs and the patch-major layout
        (ResNet-18's downsampling and last stages); at stride 1 in the weight-major layout
        ConvTranspose (a GEMM and a col2im per image, in cache) is 2-10x faster than any
        whole-batch gather of the cotangent (docs/autodiff.md)."""
        return self.patch_major or any(v != 1 for v in self.geo.s)

    def _to_nchw(self, dx: str) -> str:
        """[N*P_in, C] or [N, P_in, C] -> [N, C, *S]."""
        b, C = self.b, self.C
        dx = b.transpose(b.reshape(dx, [-1, self.P_in, C]), [0, 2, 1])
        return b.reshape(dx, [-1, C] + list(self.geo.S))


def _forward_pays(geo: Geom, so: list[int], C: int) -> bool:
    """Lower a forward Conv to Gather + Gemm where ORT's own kernel (runtime weight: a GEMM per
    image, as wide as the image) is slow: small outputs (<= 64 positions), rows of >= 8
    channels, kernels larger than 1 (a 1x1 Conv is already one GEMM per image)."""
    return C >= 8 and int(np.prod(so)) <= 64 and int(np.prod(geo.k)) > 1


def lower_forward(b, view, node) -> bool:
    """Emit `node` (a Conv whose weight is a runtime input) in the Gather form (GatherConv),
    writing node's output; False (and nothing emitted) where the form does not apply or does
    not pay. Its patches are the weight gradient's (ONNX Runtime's CSE keeps one copy)."""
    X, W = node.input[0], node.input[1]
    geo = Geom(view, node, X, W)
    ws = static_shape(view, W)
    so = geo.out_size()
    if not _gather_ok(b, geo, so, ws, int(attr(node, "group", 1))) or not _forward_pays(geo, so, ws[1]):
        return False
    GatherConv(b, geo, so, ws).forward(X, W, inp(node, 2), node.output[0])
    return True


def _box_weight(b, W: str, geo: Geom, box) -> str:
    """W restricted to the kernel offsets in `box` (those that meet the input at all)."""
    if all(hi - lo == k for k, (lo, hi) in zip(geo.k, box)):
        return W
    return b.op("Slice", [W, b.ints([lo for lo, _ in box]), b.ints([hi for _, hi in box]),
                          b.ints(spatial_axes(geo.nd))])


def _conv_input_grad(b, view, g: str, W: str, geo: Geom, X: str, so, group: int) -> str:
    """Input cotangent of a Conv. At stride 1 a Conv of the cotangent with the flipped,
    channel-transposed kernel (pads k-1-pads) where ORT runs it faster than ConvTranspose:
    grouped (2-5x), and at group 1 when it pads no more than the forward ("same" convs: 1.2-2.5x
    on ResNet's 3x3 maps). Otherwise ConvTranspose (conv_t_to): at group 1 with the full
    padding of a "valid" conv (LeNet's 5x5) it is 2x faster
    (benchmarks/results/2026-11-29-conv-input-forms.py)."""
    ws = static_shape(view, W)
    pads_t = None
    if geo.k is not None and ws is not None and all(v == 1 for v in geo.s):
        pads_t = [geo.eff[i] - 1 - geo.pb[i] for i in range(geo.nd)] + [
            geo.eff[i] - 1 - geo.pe[i] for i in range(geo.nd)]
    if pads_t is None or min(pads_t) < 0 or (group == 1 and any(t > p for t, p in zip(pads_t, geo.pb + geo.pe))):
        return conv_t_to(b, view, g, W, geo, X, so, group)
    nd = geo.nd
    M, cg = ws[0], ws[1]
    wt = b.reshape(W, [group, M // group, cg] + geo.k)
    wt = b.transpose(wt, [0, 2, 1] + list(range(3, 3 + nd)))
    wt = b.reshape(wt, [group * cg, M // group] + geo.k)
    if any(k > 1 for k in geo.k):
        wt = b.op("Slice", [wt, b.ints([-1] * nd), b.ints([-INT64_MAX] * nd), b.ints(spatial_axes(nd)),
                            b.ints([-1] * nd)])
    return b.op("Conv", [g, wt], dilations=geo.d, pads=pads_t, group=group)


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
    ws = static_shape(view, W)
    gat = GatherConv(b, geo, so, ws) if _gather_ok(b, geo, so, ws, group) else None
    if need(needs, 0):
        if gat is not None and gat.col2im_pays():
            res[0] = gat.input(W, g)
        else:
            res[0] = _conv_input_grad(b, view, g, W, geo, X, so, group)
    if need(needs, 1) and gat is not None and _rows_pay(ws[1], geo, so):
        res[1] = gat.weight(X, g)
    elif need(needs, 1):
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


def _jvp_gather(b, view, node) -> GatherConv | None:
    """The Gather form for a Conv's tangent where the backward uses it: group 1, static
    sizes, rows that pay. Tangent weights are runtime tensors, and ORT's Conv with a runtime
    weight is its slow per-image kernel (the quadratic model's JVPs were 44% of ResNet-18's
    K-FAC step)."""
    if node.op_type != "Conv":
        return None
    X, W = node.input[0], node.input[1]
    geo = Geom(view, node, X, W)
    ws = static_shape(view, W)
    so = static_shape(view, node.output[0])
    so = list(so[2:]) if so is not None else geo.out_size()
    if not _gather_ok(b, geo, so, ws, int(attr(node, "group", 1))) or not _rows_pay(ws[1], geo, so):
        return None
    return GatherConv(b, geo, so, ws)


@_conv_vjp.defjvp
def _conv_jvp(b, view, node, ts):
    X = node.input[0]
    Y = node.output[0]
    tX, tW = ts[0], ts[1]
    tB = ts[2] if len(ts) > 2 else None
    gat = _jvp_gather(b, view, node) if (tX is not None or tW is not None) else None
    if gat is not None:
        # dY = patches(X) tW^T + tB + patches(tX) W^T, chained through Gemm's addend;
        # patches(X) are the backward's (one copy after ORT's CSE)
        rows = gat.rows(X, tW, tB) if tW is not None else tB
        if tX is not None:
            rows = gat.rows(tX, node.input[1], rows)
        return [gat.to_output(rows)]
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


# ============================================================================== Col2Im
def _col2im_block(view, node) -> list[int]:
    bs = cval(view, inp(node, 2))
    if bs is None or cval(view, inp(node, 1)) is None:
        raise unsupported(node, view, "needs constant image_shape and block_shape")
    return [int(v) for v in np.asarray(bs).reshape(-1)]


def onehot_kernels(b, k: list[int]) -> str:
    """The K = prod(k) one-hot kernels [K, 1, *k], one per block offset: a Conv with them
    cuts [N, 1, *S] into blocks (im2col, channels = offsets), a ConvTranspose adds blocks
    back (col2im, overlap-add)."""
    onehot = np.zeros([int(np.prod(k)), 1] + list(k), dtype=b.np_float)
    for i, pos in enumerate(np.ndindex(*k)):
        onehot[(i, 0) + pos] = 1.0
    return b.const(onehot, hint="onehot_kernels")


@register("Col2Im", inputs=(0,))
def _col2im_vjp(b, view, node, gys):
    """dx = im2col(g): g [N, C, *S] as [N*C, 1, *S], a Conv with the K = prod(block) one-hot
    kernels (same strides, dilations, pads), reshaped to x's [N, C*K, L]."""
    g = gys[0]
    if g is None:
        return [None]
    k = _col2im_block(view, node)
    nd = len(k)
    g1 = b.reshape(g, make_shape(b, [-1, 1] + dim_parts(b, view, g, 2)))
    cols = b.op("Conv", [g1, onehot_kernels(b, k)],
                strides=attr(node, "strides", [1] * nd), dilations=attr(node, "dilations", [1] * nd),
                pads=attr(node, "pads", [0] * (2 * nd)))
    return [b.reshape(cols, shape_tensor(b, view, node.input[0]))]


@_col2im_vjp.defcheck
def _col2im_check(view, node):
    _col2im_block(view, node)


_col2im_vjp.defjvp(linear_jvp(0))
