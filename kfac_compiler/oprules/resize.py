"""Resize (nearest, linear, cubic; every coordinate_transformation_mode): for constant
scales/sizes (and roi) the op is linear in X and separable, Y = X x_d M_d over the resized
axes d, with M_d an [out_d, in_d] interpolation matrix. The matrices are computed at compile
time by running the op itself (ONNX Runtime CPU, the runtime that computes the forward) on an
identity along that axis, so every mode, rounding rule and antialias setting is covered by
construction, as ORT computes it; the vjp applies
M_d^T along each axis (one MatMul per axis: `g @ M` for the last axis, `M^T @ g` for the
one before it, else Transpose + MatMul + Transpose) and the jvp is the op on the tangent.

Needs: constant scales/sizes/roi, static sizes of the resized axes (the batch may be
symbolic), keep_aspect_ratio_policy "stretch". Otherwise UnsupportedOpError.
extrapolation_value (tf_crop_and_resize) is a constant offset: no gradient.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import attr, cval, inp, linear_jvp, unsupported

_PASS_ATTRS = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
               "nearest_mode", "antialias")


def _geometry(view, node):
    """Per axis (in_d, scale_d or None, size_d or None, roi_start, roi_end) for the axes
    that change; raises UnsupportedOpError when not static."""
    x = node.input[0]
    s = view.shape(x)
    if s is None:
        raise unsupported(node, view, "needs the input's rank (run shape inference)")
    r = len(s)
    if attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        raise unsupported(node, view, "is differentiable only with keep_aspect_ratio_policy='stretch'")
    axes = attr(node, "axes")
    axes = list(range(r)) if axes is None else [a + r if a < 0 else a for a in axes]
    if view.opset < 11:
        raise unsupported(node, view, "is differentiable from opset 11 on")
    roi_n, sc_n, sz_n = inp(node, 1), inp(node, 2), inp(node, 3)
    roi = cval(view, roi_n) if roi_n else None
    scales = cval(view, sc_n) if sc_n else None
    sizes = cval(view, sz_n) if sz_n else None
    if (roi_n and roi is None) or (sc_n and scales is None) or (sz_n and sizes is None):
        raise unsupported(node, view, "is differentiable only with constant roi/scales/sizes")
    if scales is not None and scales.size == 0:
        scales = None
    if sizes is not None and sizes.size == 0:
        sizes = None
    if scales is None and sizes is None:
        raise unsupported(node, view, "has neither scales nor sizes")
    if roi is not None and roi.size == 0:
        roi = None
    out = []
    for k, d in enumerate(axes):
        sc = None if scales is None else float(scales[k])
        sz = None if sizes is None else int(sizes[k])
        r0, r1 = (0.0, 1.0) if roi is None else (float(roi[k]), float(roi[len(axes) + k]))
        if sc == 1.0 and (roi is None or attr(node, "coordinate_transformation_mode") != "tf_crop_and_resize"):
            continue
        if sz is not None and isinstance(s[d], int) and sz == s[d] and roi is None:
            continue
        if not isinstance(s[d], int):
            if sz is not None:  # a full-rank sizes (the only form before opset 18) fixes every axis
                raise unsupported(node, view, f"sets axis {d} of size {s[d]!r} to the constant {sz}, which resamples "
                                              "any other size; export with scales (1 on that axis) or, from opset 18, "
                                              "sizes with `axes` naming the resized axes only")
            raise unsupported(node, view, f"needs a static size of resized axis {d} (got {s[d]!r})")
        out.append((d, s[d], sc, sz, r0, r1))
    return r, out


def _matrix(node, opset: int, n_in: int, sc, sz, r0, r1) -> np.ndarray:
    """[out, in] interpolation matrix of one axis: the op run on an identity by ONNX Runtime
    (CPU, float32: its only Resize kernel), so that the vjp is the exact transpose of the
    forward a session computes. onnx.reference differs from ORT (and torch): align_corners and
    tf_crop_and_resize with `scales` where in * scale is not an integer (it uses in * scale
    for the output length there), nearest-mode rounding ties (coordinates in float64, ORT's in
    float32)."""
    from kfac_compiler.oprules.check import run_ort

    attrs = {a: attr(node, a) for a in _PASS_ATTRS if attr(node, a) is not None}
    if opset < 18:
        attrs.pop("antialias", None)
    inits = [numpy_helper.from_array(np.asarray([0.0, r0, 1.0, r1], np.float32), "roi")]
    if sz is not None:
        inits.append(numpy_helper.from_array(np.asarray([n_in, sz], np.int64), "sizes"))
        ins = ["x", "roi", "", "sizes"]
    else:
        inits.append(numpy_helper.from_array(np.asarray([1.0, sc], np.float32), "scales"))
        ins = ["x", "roi", "scales"]
    n = helper.make_node("Resize", ins, ["y"], extrapolation_value=0.0, **attrs)
    g = helper.make_graph([n], "resize_axis", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n_in, n_in])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", max(opset, 13))])
    m.ir_version = 8
    y = run_ort(m, {"x": np.eye(n_in, dtype=np.float32)}, ["y"])["y"]
    return np.ascontiguousarray(y.T.astype(np.float64))


def _apply_axis(b, g: str, mat: np.ndarray, d: int, r: int) -> str:
    """sum_o g[..., o (axis d), ...] mat[o, i]."""
    if d == r - 1:
        return b.matmul(g, b.const(mat, hint="resize_adj"))
    if d == r - 2:
        return b.matmul(b.const(np.ascontiguousarray(mat.T), hint="resize_adj"), g)
    perm = list(range(r))
    perm[d], perm[r - 1] = r - 1, d
    t = b.transpose(g, perm)
    t = b.matmul(t, b.const(mat, hint="resize_adj"))
    return b.transpose(t, perm)


@register("Resize", since=11, inputs=(0,))
def _resize_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    r, axes = _geometry(view, node)
    for d, n_in, sc, sz, r0, r1 in sorted(axes, key=lambda a: -a[0]):
        g = _apply_axis(b, g, _matrix(node, view.opset, n_in, sc, sz, r0, r1).astype(b.np_float), d, r)
    if not axes:
        g = b.op("Identity", [g])
    return [g]


_resize_vjp.defjvp(linear_jvp(0))


@_resize_vjp.defcheck
def _resize_check(view, node):
    _geometry(view, node)
