"""GridSample (4-D input, static or symbolic dims; linear/bilinear and nearest modes; zeros
and border padding), AffineGrid (linear in theta: its cotangent is the cotangent times
the homogeneous base grid, the grid of the identity transform), DeformConv (2-D) and
RoiAlign (avg, sampling_ratio > 0: linear in X).

The sample at each output position is a weighted sum of at most four input pixels (the
corners around the unnormalized grid point). Rules gather those corners from the input
flattened to [N, C, H*W] (GatherElements), and the input's cotangent scatters back with one
ScatterElements(reduction="add"). Bilinear weights are products of per-axis weights, so the
grid's cotangent is, per axis, the difference of the corner values weighted by the other
axis's weights, times d(pixel coordinate)/d(grid coordinate).

DeformConv samples each input channel's offset group at the kernel taps moved by the
offsets (pixel coordinates, zero outside: GridSample's zeros/align_corners=1 corners), times
the mask, and contracts the samples ("columns" [N, group, C/group*K, P]) with the weight as
one batched MatMul. Its cotangents: the weight's and the bias's from the columns, the
columns' from the weight; then the samples' go back through the sampling like GridSample's
(input: one scatter-add; offsets: the per-axis corner differences; mask: the samples).

RoiAlign averages a fixed sr x sr grid of bilinear samples per bin (sampling_ratio sr > 0;
0 means a count that depends on each roi's size, which a static graph cannot hold). The
sample coordinates, clamped as ONNX does (into [0, size - 1], zero beyond [-1, size]), go
through the same corners; X's cotangent is their scatter, per roi, then over the batch
indices. The rois get no cotangent (as indices): they position the samples."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np
from onnx import TensorProto

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    add_n,
    attr,
    c,
    dims_slice,
    inp,
    linear_jvp,
    need,
    reapply,
    shape_tensor,
    static_shape,
    unsupported,
    zeros,
)

_LINEAR = ("linear", "bilinear")


@dataclass
class _Corners:
    """Flattened sampling terms: per corner, the gather indices [N, C, P] (P = Ho*Wo) and
    weight [N, 1, P]; per grid axis (x, y), the weights of dy/dcoordinate [N, 1, P] per corner
    and d(pixel coordinate)/d(grid coordinate) [N, 1, P]."""

    idx: list[str]
    w: list[str]
    dw: tuple[list[str], list[str]]
    scale: tuple[str, str]


def _dims(b, view, node) -> tuple[int | str, int | str]:
    """(H, W) of the input: ints where static, else float [1] tensors from its Shape."""
    X = node.input[0]
    s = view.shape(X) or [None] * 4
    return tuple(int(s[a]) if isinstance(s[a], int) else b.cast(dims_slice(b, X, a, a + 1), b.float_type)
                 for a in (2, 3))  # type: ignore[return-value]


def _lin(b, size: int | str, a: float, k: float) -> str:
    """a * size + k: a constant for a static size."""
    if isinstance(size, int):
        return c(b, a * size + k)
    return b.add(b.mul(size, c(b, a)), c(b, k))


def _check(view, node) -> None:
    mode = attr(node, "mode", "bilinear" if view.opset < 20 else "linear")
    pad = attr(node, "padding_mode", "zeros")
    r = view.rank(node.input[0])
    if r != 4:
        raise unsupported(node, view, f"has a rank-{r} input; the rule covers 4-D (2-D sampling) only")
    if mode not in _LINEAR + ("nearest",):
        raise unsupported(node, view, f"has mode '{mode}'; the rule covers linear and nearest only")
    if pad not in ("zeros", "border"):
        raise unsupported(node, view, f"has padding_mode '{pad}'; the rule covers zeros and border only")


def _axis_coords(b, gc: str, size: int | str, align: bool, border: bool) -> tuple[str, str]:
    """(pixel coordinate, d pixel / d grid coordinate) of one axis of the grid."""
    d = _lin(b, size, 0.5, -0.5) if align else _lin(b, size, 0.5, 0.0)
    pix = b.add(b.mul(b.add(gc, c(b, 1.0)), d), c(b, 0.0 if align else -0.5))
    if border:  # clipped into [0, size - 1]: no gradient outside
        hi = _lin(b, size, 1.0, -1.0)
        inside = b.op("And", [b.op("Greater", [pix, c(b, 0.0)]), b.op("Less", [pix, hi])])
        d = b.mul(d, b.cast(inside, b.float_type))
        pix = b.op("Max", [b.op("Min", [pix, hi]), c(b, 0.0)])
    return pix, d


def _corners(b, view, node) -> _Corners:
    """The corners of a GridSample node's grid points."""
    X, grid = node.input[0], node.input[1]
    H, W = _dims(b, view, node)
    align = bool(attr(node, "align_corners", 0))
    border = attr(node, "padding_mode", "zeros") == "border"
    mode = attr(node, "mode", "bilinear" if view.opset < 20 else "linear")
    g3 = b.transpose(b.reshape(grid, [0, -1, 2]), [0, 2, 1])  # [N, 2, P]
    gx, gy = b.split(g3, [1, 1], axis=1)
    ix, sx = _axis_coords(b, gx, W, align, border)
    iy, sy = _axis_coords(b, gy, H, align, border)
    target = b.op("Concat", [dims_slice(b, X, 0, 2), dims_slice(b, gx, 2, 3)], axis=0)
    return pixel_corners(b, ix, iy, H, W, target, mode, (sx, sy))


def pixel_corners(b, ix: str, iy: str, H: int | str, W: int | str, target: str, mode: str,
                  scale: tuple[str, str]) -> _Corners:
    """The corners around the pixel coordinates (ix, iy) [N, 1, P] of an [N, C, H, W] input
    (zero outside it), with gather indices expanded to `target` = [N, C, P]; `scale` is
    d(pixel coordinate)/d(the caller's coordinate) per axis."""
    hi_x, hi_y = _lin(b, W, 1.0, -1.0), _lin(b, H, 1.0, -1.0)
    sx, sy = scale

    def corner(xc: str, yc: str) -> tuple[str, str]:
        """(gather indices [N, C, P], validity [N, 1, P]) of the pixel (yc, xc)."""
        ok = [b.op("GreaterOrEqual", [xc, c(b, 0.0)]), b.op("LessOrEqual", [xc, hi_x]),
              b.op("GreaterOrEqual", [yc, c(b, 0.0)]), b.op("LessOrEqual", [yc, hi_y])]
        valid = b.cast(b.op("And", [b.op("And", ok[:2]), b.op("And", ok[2:])]), b.float_type)
        xi = b.op("Max", [b.op("Min", [xc, hi_x]), c(b, 0.0)])
        yi = b.op("Max", [b.op("Min", [yc, hi_y]), c(b, 0.0)])
        flat = b.cast(b.add(b.mul(yi, _lin(b, W, 1.0, 0.0)), xi), TensorProto.INT64)
        return b.op("Expand", [flat, target]), valid

    if mode == "nearest":  # Round is half-to-even, as ONNX's nearest
        idx, valid = corner(b.op("Round", [ix]), b.op("Round", [iy]))
        return _Corners([idx], [valid], ([], []), (sx, sy))
    x0, y0 = b.op("Floor", [ix]), b.op("Floor", [iy])
    wx1, wy1 = b.sub(ix, x0), b.sub(iy, y0)
    wx = [b.sub(c(b, 1.0), wx1), wx1]
    wy = [b.sub(c(b, 1.0), wy1), wy1]
    xs = [x0, b.add(x0, c(b, 1.0))]
    ys = [y0, b.add(y0, c(b, 1.0))]
    out = _Corners([], [], ([], []), (sx, sy))
    for j in (0, 1):
        for i in (0, 1):
            idx, valid = corner(xs[i], ys[j])
            out.idx.append(idx)
            out.w.append(b.mul(b.mul(wx[i], wy[j]), valid))
            sgn = -1.0 if i == 0 else 1.0
            out.dw[0].append(b.mul(b.mul(wy[j], valid), c(b, sgn)))     # d w / d ix
            sgn = -1.0 if j == 0 else 1.0
            out.dw[1].append(b.mul(b.mul(wx[i], valid), c(b, sgn)))     # d w / d iy
    return out


def _flat(b, t: str) -> str:
    return b.reshape(t, [0, 0, -1])


def coord_slopes(b, xf: str, k: _Corners) -> list[str]:
    """dy/d(coordinate x), dy/d(coordinate y) as [N, C, P] for the input flattened to
    [N, C, H*W]: sum over corners of dw * value * scale."""
    vals = [b.op("GatherElements", [xf, idx], axis=2) for idx in k.idx]
    return [b.mul(b.sum([b.mul(d, v) for d, v in zip(k.dw[a], vals)]), k.scale[a]) for a in (0, 1)]


def gather_samples(b, xf: str, k: _Corners) -> str:
    """The samples [N, C, P] of the input flattened to [N, C, H*W]: sum of corner weight x value."""
    return b.sum([b.mul(w, b.op("GatherElements", [xf, idx], axis=2)) for w, idx in zip(k.w, k.idx)])


def scatter_samples(b, xf: str, gf: str, k: _Corners) -> str:
    """The adjoint of `gather_samples`: the cotangent gf [N, C, P] of the samples added back
    to the input's [N, C, H*W] positions (xf gives the shape) with one ScatterElements."""
    idx = b.op("Concat", k.idx, axis=2)
    upd = b.op("Concat", [b.mul(gf, w) for w in k.w], axis=2)
    return b.op("ScatterElements", [zeros(b, b.op("Shape", [xf])), idx, upd], axis=2, reduction="add")


@register("GridSample", since=16, inputs=(0, 1))
def _gridsample_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    if g is None:
        return [None, None]
    X, grid = node.input[0], node.input[1]
    k = _corners(b, view, node)
    gf = _flat(b, g)
    dx = dgrid = None
    if needs is None or needs[0]:
        dx = b.reshape(scatter_samples(b, _flat(b, X), gf, k), shape_tensor(b, view, X))
    if (needs is None or (len(needs) > 1 and needs[1])) and k.dw[0]:
        parts = [b.reduce_sum(b.mul(gf, s), [1], keepdims=True) for s in coord_slopes(b, _flat(b, X), k)]
        dg = b.transpose(b.op("Concat", parts, axis=1), [0, 2, 1])  # [N, P, 2]
        dgrid = b.reshape(dg, shape_tensor(b, view, grid))
    return [dx, dgrid]


_gridsample_vjp.defcheck(_check)


@_gridsample_vjp.defjvp
def _gridsample_jvp(b, view, node, ts):
    tx, tg = (list(ts) + [None, None])[:2]
    if tx is None and tg is None:
        return [None]
    X = node.input[0]
    k = _corners(b, view, node)
    terms = []
    if tx is not None:
        terms.append(gather_samples(b, _flat(b, tx), k))
    if tg is not None and k.dw[0]:
        t3 = b.transpose(b.reshape(tg, [0, -1, 2]), [0, 2, 1])
        tgx, tgy = b.split(t3, [1, 1], axis=1)
        sx, sy = coord_slopes(b, _flat(b, X), k)
        terms += [b.mul(sx, tgx), b.mul(sy, tgy)]
    if not terms:
        return [None]
    return [b.reshape(b.sum(terms), shape_tensor(b, view, node.output[0]))]


def _affine_k(view, node) -> int:
    """The number of spatial dims k (theta is [N, k, k+1]), from the size input's length."""
    s = view.shape(node.input[1])
    if s is None or len(s) != 1 or not isinstance(s[0], int):
        raise unsupported(node, view, "needs a size input of static length")
    return int(s[0]) - 2


@register("AffineGrid", since=20, inputs=(0,))
def _affinegrid_vjp(b, view, node, gys):
    """grid[n, p] = theta[n] @ [base_p, 1]: dtheta[n] = sum_p g[n, p] [base_p, 1]^T, the base
    grid being AffineGrid of the identity (same size and align_corners)."""
    g = gys[0]
    if g is None:
        return [None]
    theta = node.input[0]
    k = _affine_k(view, node)
    eye = b.const(np.eye(k, k + 1, dtype=b.np_float)[None], hint="affine_eye")
    eye_n = b.op("Expand", [eye, b.op("Concat", [dims_slice(b, theta, 0, 1), b.ints([k, k + 1])], axis=0)])
    (base,) = reapply(b, node, {0: eye_n})
    base = b.reshape(base, [0, -1, k])
    base_h = b.op("Pad", [base, b.ints([0, 0, 0, 0, 0, 1]), c(b, 1.0)])  # [N, P, k+1]
    return [b.matmul(b.transpose(b.reshape(g, [0, -1, k]), [0, 2, 1]), base_h)]


_affinegrid_vjp.defjvp(linear_jvp(0))
_affinegrid_vjp.defcheck(_affine_k)


# --------------------------------------------------------------------------- DeformConv
@dataclass
class _Deform:
    """A DeformConv node's sampling: corners `k` of the taps in the input flattened to
    `xf` [N*G, C/G, H*W] (G = offset_group), the samples `v` [N*G, C/G, K*P], the mask
    [N*G, 1, K*P] or None, the columns [N, group, C/group*K, P] and the weight as
    [group, O/group, C/group*K]."""

    k: _Corners
    xf: str
    v: str
    mask: str | None
    cols: str
    wr: str
    cg: int  # C/G: channels per offset group
    hw: int  # H*W
    kp: int  # K*P: taps x output positions
    cols_shape: list[int]  # [-1, group, C/group*K, P]
    og: int  # O/group


def _deform_dims(view, node) -> tuple[list[int], list[int], list[int]]:
    """(X's [C, H, W], W's shape, the offset's [oH, oW]): all static, the batch aside."""
    xs, ws, os_ = view.shape(node.input[0]), static_shape(view, node.input[1]), view.shape(node.input[2])
    if (xs is None or len(xs) != 4 or not all(isinstance(d, int) for d in xs[1:]) or ws is None or os_ is None
            or not all(isinstance(d, int) for d in os_[2:])):
        raise unsupported(node, view, "needs a 4-D input, a static weight shape and static channel, spatial and "
                                      "output dims")
    return [int(d) for d in xs[1:]], list(ws), [int(d) for d in os_[2:]]


def _offset_yx(b, off: str, K: int, P: int) -> list[str]:
    """The y and x offsets [N*G, 1, K*P] of an offset tensor [N, G*K*2, oH, oW] (per group
    and tap: y, x)."""
    return [b.reshape(t, [-1, 1, K * P]) for t in b.split(b.reshape(off, [-1, K, 2, P]), [1, 1], axis=2)]


def _deform(b, view, node) -> _Deform:
    (C, H, Wd), ws, (oh, ow) = _deform_dims(view, node)
    O, Ci, kh, kw = ws
    grp, G = int(attr(node, "group", 1)), int(attr(node, "offset_group", 1))
    s = attr(node, "strides", [1, 1])
    d = attr(node, "dilations", [1, 1])
    pads = attr(node, "pads", [0, 0, 0, 0])
    K, P, Cg = kh * kw, oh * ow, C // G
    taps = list(product(range(kh), range(kw), range(oh), range(ow)))  # k-major, then p
    by = np.asarray([i * s[0] - pads[0] + a * d[0] for a, _, i, _ in taps], dtype=b.np_float)
    bx = np.asarray([j * s[1] - pads[1] + e * d[1] for _, e, _, j in taps], dtype=b.np_float)
    oy, ox = _offset_yx(b, node.input[2], K, P)
    iy, ix = b.add(oy, b.const(by.reshape(1, 1, -1))), b.add(ox, b.const(bx.reshape(1, 1, -1)))
    xf = b.reshape(node.input[0], [-1, Cg, H * Wd])
    target = b.op("Concat", [dims_slice(b, xf, 0, 1), b.ints([Cg, K * P])], axis=0)
    one = c(b, 1.0)
    k = pixel_corners(b, ix, iy, H, Wd, target, "linear", (one, one))
    v = gather_samples(b, xf, k)
    mask = b.reshape(node.input[4], [-1, 1, K * P]) if inp(node, 4) else None
    cols = b.reshape(v if mask is None else b.mul(v, mask), [-1, grp, Ci * K, P])  # [N, group, C/group*K, P]
    wr = b.reshape(node.input[1], [grp, O // grp, Ci * K])
    return _Deform(k, xf, v, mask, cols, wr, Cg, H * Wd, K * P, [-1, grp, Ci * K, P], O // grp)


@register("DeformConv", since=19, inputs=(0, 1, 2, 3, 4))
def _deform_vjp(b, view, node, gys, needs=None):
    """dW = sum_n g cols^T, dB = sum g, dcols = W^T g; the samples' cotangent dcols * mask
    goes back to X (scatter-add) and to the offsets (corner differences); dmask = sum_c dcols v."""
    g = gys[0]
    if g is None:
        return [None] * len(node.input)
    t = _deform(b, view, node)
    _, grp, _, P = t.cols_shape
    gy = b.reshape(g, [-1, grp, t.og, P])
    out: list[str | None] = [None] * len(node.input)
    if need(needs, 1):
        dw = b.reduce_sum(b.matmul(gy, b.transpose(t.cols, [0, 1, 3, 2])), [0])
        out[1] = b.reshape(dw, shape_tensor(b, view, node.input[1]))
    if inp(node, 3) and need(needs, 3):
        out[3] = b.reduce_sum(g, [0, 2, 3])
    if not any(need(needs, i) for i in (0, 2, 4)):
        return out
    dcols = b.reshape(b.matmul(b.transpose(t.wr, [0, 2, 1]), gy), [-1, t.cg, t.kp])  # [N*G, C/G, K*P]
    if t.mask is not None and need(needs, 4):
        out[4] = b.reshape(b.reduce_sum(b.mul(dcols, t.v), [1], keepdims=True), shape_tensor(b, view, node.input[4]))
    dv = dcols if t.mask is None else b.mul(dcols, t.mask)
    if need(needs, 0):
        out[0] = b.reshape(scatter_samples(b, t.xf, dv, t.k), shape_tensor(b, view, node.input[0]))
    if need(needs, 2):
        P = t.cols_shape[3]
        dyx = [b.reshape(b.reduce_sum(b.mul(dv, sl), [1], keepdims=True), [-1, t.kp // P, 1, P])
               for sl in reversed(coord_slopes(b, t.xf, t.k))]
        out[2] = b.reshape(b.op("Concat", dyx, axis=2), shape_tensor(b, view, node.input[2]))
    return out


@_deform_vjp.defjvp
def _deform_jvp(b, view, node, ts):
    """dy = W dcols + dW cols + dB, dcols = (samples of dX + slopes . doffset) * mask + v dmask."""
    ts = list(ts) + [None] * (5 - len(ts))
    if all(x is None for x in ts):
        return [None]
    t = _deform(b, view, node)
    terms = []
    if ts[0] is not None:
        terms.append(gather_samples(b, b.reshape(ts[0], [-1, t.cg, t.hw]), t.k))
    if ts[2] is not None:
        ty, tx = _offset_yx(b, ts[2], t.kp // t.cols_shape[3], t.cols_shape[3])
        sx, sy = coord_slopes(b, t.xf, t.k)
        terms += [b.mul(sx, tx), b.mul(sy, ty)]
    dcols = add_n(b, terms)
    if dcols is not None and t.mask is not None:
        dcols = b.mul(dcols, t.mask)
    if ts[4] is not None:
        dcols = add_n(b, [dcols, b.mul(t.v, b.reshape(ts[4], [-1, 1, t.kp]))])
    parts = []
    if dcols is not None:
        parts.append(b.matmul(t.wr, b.reshape(dcols, t.cols_shape)))
    if ts[1] is not None:
        parts.append(b.matmul(b.reshape(ts[1], b.op("Shape", [t.wr])), t.cols))
    y = node.output[0]
    res = b.reshape(add_n(b, parts), shape_tensor(b, view, y)) if parts else None
    if ts[3] is not None:
        tb = b.reshape(ts[3], [1, -1, 1, 1])
        res = b.add(res, tb) if res is not None else b.op("Expand", [tb, shape_tensor(b, view, y)])
    return [res]


@_deform_vjp.defcheck
def _deform_check(view, node):
    _deform_dims(view, node)


# --------------------------------------------------------------------------- RoiAlign
def _roi_form(view, node) -> tuple[int, int, int, bool]:
    """(output_height, output_width, sampling_ratio, half_pixel) of a RoiAlign node; refuses
    the forms the rule does not cover."""
    sr = int(attr(node, "sampling_ratio", 0))
    if sr <= 0:
        raise unsupported(node, view, "has sampling_ratio 0 (an adaptive, data-dependent sample count per bin); "
                                      "export it with sampling_ratio > 0")
    mode = attr(node, "mode", "avg")
    if mode != "avg":
        # ORT computes max mode in a way it calls incorrect and due to change; torch emits avg only
        raise unsupported(node, view, f"has mode '{mode}'; the rule covers avg only")
    r = view.rank(node.input[0])
    if r != 4:
        raise unsupported(node, view, f"has a rank-{r} input; the rule covers 4-D only")
    ctm = attr(node, "coordinate_transformation_mode", "half_pixel")
    return int(attr(node, "output_height", 1)), int(attr(node, "output_width", 1)), sr, ctm == "half_pixel"


def _roi_axis(b, lo: str, hi: str, n_out: int, sr: int, size: int | str, half: bool) -> tuple[str, str]:
    """One axis's sample coordinates [R, n_out*sr] (bin-major) of rois spanning [lo, hi] [R, 1],
    clamped into [0, size - 1], and whether each lies in [-1, size] (else it samples zero)."""
    extent = b.sub(hi, lo)
    if not half:  # output_half_pixel: a roi is at least one pixel (torchvision's aligned=False)
        extent = b.op("Max", [extent, c(b, 1.0)])
    at = np.asarray([[(p + (i + 0.5) / sr) / n_out for p in range(n_out) for i in range(sr)]], dtype=b.np_float)
    pos = b.add(lo, b.mul(extent, b.const(at)))
    ok = b.op("And", [b.op("GreaterOrEqual", [pos, c(b, -1.0)]), b.op("LessOrEqual", [pos, _lin(b, size, 1.0, 0.0)])])
    pos = b.op("Max", [b.op("Min", [pos, _lin(b, size, 1.0, -1.0)]), c(b, 0.0)])
    return pos, b.cast(ok, b.float_type)


def _roi_corners(b, view, node) -> tuple[_Corners, str, str, int, int, int]:
    """The corners of a RoiAlign node's samples in X gathered per roi (flattened to
    [R, C, H*W]); the samples' weight [R, 1, P] (1/sr^2 inside, 0 outside), P = oh*sr*ow*sr
    ordered (bin row, sample row, bin column, sample column); and (oh, ow, sr)."""
    X, rois, bi = node.input[0], node.input[1], node.input[2]
    oh, ow, sr, half = _roi_form(view, node)
    H, W = _dims(b, view, node)
    r = b.mul(rois, c(b, float(attr(node, "spatial_scale", 1.0))))
    if half:
        r = b.sub(r, c(b, 0.5))
    x1, y1, x2, y2 = b.split(r, [1, 1, 1, 1], axis=1)
    ys, my = _roi_axis(b, y1, y2, oh, sr, H, half)
    xs, mx = _roi_axis(b, x1, x2, ow, sr, W, half)
    nr = dims_slice(b, rois, 0, 1)
    grid = b.op("Concat", [nr, b.ints([oh * sr, ow * sr])], axis=0)

    def flat(t: str) -> str:
        return b.reshape(b.op("Expand", [t, grid]), [0, 1, -1])

    iy, ix = flat(b.op("Unsqueeze", [ys, b.ints([2])])), flat(b.op("Unsqueeze", [xs, b.ints([1])]))
    inside = flat(b.mul(b.op("Unsqueeze", [my, b.ints([2])]), b.op("Unsqueeze", [mx, b.ints([1])])))
    xr = _flat(b, b.op("Gather", [X, bi], axis=0))
    target = b.op("Concat", [nr, dims_slice(b, X, 1, 2), b.ints([oh * sr * ow * sr])], axis=0)
    one = c(b, 1.0)
    k = pixel_corners(b, ix, iy, H, W, target, "linear", (one, one))
    return k, xr, b.mul(inside, c(b, 1.0 / (sr * sr))), oh, ow, sr


@register("RoiAlign", since=16, inputs=(0,))
def _roialign_vjp(b, view, node, gys):
    """Linear in X (the rois and batch indices get no cotangent): each bin's cotangent /sr^2
    goes to its sr x sr samples, scattered to the corners of the roi's image, whose
    cotangents add up in X's batch rows (a second ScatterElements-add over batch_indices).
    From opset 16, as ScatterElements' reduction; RoiAlign-10 has no rule."""
    g = gys[0]
    if g is None:
        return [None] * len(node.input)
    X, bi = node.input[0], node.input[2]
    k, xr, weight, oh, ow, sr = _roi_corners(b, view, node)
    gs = b.op("Expand", [b.reshape(g, [0, 0, oh, 1, ow, 1]), b.ints([1, 1, 1, sr, 1, sr])])
    dxr = scatter_samples(b, xr, b.mul(_flat(b, gs), weight), k)  # [R, C, H*W]
    rows = b.op("Expand", [b.reshape(bi, [-1, 1, 1]), b.op("Shape", [dxr])])
    dx = b.op("ScatterElements", [zeros(b, b.op("Shape", [_flat(b, X)])), rows, dxr], axis=0, reduction="add")
    return [b.reshape(dx, shape_tensor(b, view, X)), None, None]


_roialign_vjp.defjvp(linear_jvp(0))
_roialign_vjp.defcheck(_roi_form)
