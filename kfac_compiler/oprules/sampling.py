"""GridSample (4-D input, static or symbolic dims; linear/bilinear and nearest modes; zeros
and border padding) and AffineGrid (linear in theta: its cotangent is the cotangent times
the homogeneous base grid, the grid of the identity transform).

The sample at each output position is a weighted sum of at most four input pixels (the
corners around the unnormalized grid point). Rules gather those corners from the input
flattened to [N, C, H*W] (GatherElements), and the input's cotangent scatters back with one
ScatterElements(reduction="add"). Bilinear weights are products of per-axis weights, so the
grid's cotangent is, per axis, the difference of the corner values weighted by the other
axis's weights, times d(pixel coordinate)/d(grid coordinate)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    attr,
    c,
    dims_slice,
    linear_jvp,
    reapply,
    shape_tensor,
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
    X, grid = node.input[0], node.input[1]
    H, W = _dims(b, view, node)
    hi_x, hi_y = _lin(b, W, 1.0, -1.0), _lin(b, H, 1.0, -1.0)
    align = bool(attr(node, "align_corners", 0))
    border = attr(node, "padding_mode", "zeros") == "border"
    mode = attr(node, "mode", "bilinear" if view.opset < 20 else "linear")
    g3 = b.transpose(b.reshape(grid, [0, -1, 2]), [0, 2, 1])  # [N, 2, P]
    gx, gy = b.split(g3, [1, 1], axis=1)
    ix, sx = _axis_coords(b, gx, W, align, border)
    iy, sy = _axis_coords(b, gy, H, align, border)
    target = b.op("Concat", [dims_slice(b, X, 0, 2), dims_slice(b, gx, 2, 3)], axis=0)

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


def _coord_slopes(b, X: str, k: _Corners) -> list[str]:
    """dy/d(grid x), dy/d(grid y) as [N, C, P]: sum over corners of dw * value * scale."""
    xf = _flat(b, X)
    vals = [b.op("GatherElements", [xf, idx], axis=2) for idx in k.idx]
    return [b.mul(b.sum([b.mul(d, v) for d, v in zip(k.dw[a], vals)]), k.scale[a]) for a in (0, 1)]


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
        idx = b.op("Concat", k.idx, axis=2)
        upd = b.op("Concat", [b.mul(gf, w) for w in k.w], axis=2)
        dxf = b.op("ScatterElements", [zeros(b, b.op("Shape", [_flat(b, X)])), idx, upd], axis=2, reduction="add")
        dx = b.reshape(dxf, shape_tensor(b, view, X))
    if (needs is None or (len(needs) > 1 and needs[1])) and k.dw[0]:
        parts = [b.reduce_sum(b.mul(gf, s), [1], keepdims=True) for s in _coord_slopes(b, X, k)]
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
        tf = _flat(b, tx)
        terms += [b.mul(w, b.op("GatherElements", [tf, idx], axis=2)) for w, idx in zip(k.w, k.idx)]
    if tg is not None and k.dw[0]:
        t3 = b.transpose(b.reshape(tg, [0, -1, 2]), [0, 2, 1])
        tgx, tgy = b.split(t3, [1, 1], axis=1)
        sx, sy = _coord_slopes(b, X, k)
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
