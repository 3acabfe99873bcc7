"""Spectral ops: DFT (opset 17: axis attribute; opset 20: axis input) and STFT.

The DFT is linear, so its jvp is the node applied to the tangent. Its adjoint (in the real
[re, im] representation) is the conjugate transform: n times ONNX's inverse DFT for a
forward node, 1/n times the forward DFT for an inverse one. The pieces around it:
- a onesided output (real input, the first n//2+1 bins): the selection's adjoint pads the
  cotangent with zeros to n bins, which the adjoint DFT does itself through its dft_length;
- a real input [..., 1]: the embedding x -> x + 0i has the real part as its adjoint;
- dft_length != the input's length m along the axis (the forward zero-pads or truncates):
  the adjoint truncates or zero-pads back to m.

STFT is linear in the signal and in the window: each frame is cut out (a one-hot-kernel
Conv, as Col2Im's adjoint), weighted by the window and DFT'd. The signal's cotangent is the
per-frame adjoint DFT times the window, added back where the frames overlap (a
ConvTranspose with the same one-hot kernels); the window's is the adjoint DFT times the
frames, summed over batch and frames.
"""
from __future__ import annotations

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    add_n,
    attr,
    axis_len,
    c,
    cval,
    dim_parts,
    dims_slice,
    inp,
    linear_jvp,
    make_shape,
    need,
    reapply,
    static_shape,
    unsupported,
)
from kfac_compiler.oprules.conv import onehot_kernels


def dft(b, x: str, axis: int, length: str | None, inverse: bool) -> str:
    """A DFT of x along `axis` (>= 0) with the optional dft_length tensor, in the form the
    builder's opset takes (axis as attribute before 20, as input from 20)."""
    ins = [x, length or ""]
    if b.opset >= 20:
        return b.op("DFT", ins + [b.const(np.asarray(axis, dtype=np.int64))], inverse=int(inverse))
    return b.op("DFT", ins if length else [x], axis=axis, inverse=int(inverse))


def _axis(view, node) -> int:
    """The transform axis of a DFT node, counted from the front (the [re, im] axis included)."""
    r = view.rank(node.input[0])
    if r is None:
        raise unsupported(node, view, "needs the input rank")
    if view.opset >= 20:
        a = -2 if not inp(node, 2) else cval(view, node.input[2])
        if a is None:
            raise unsupported(node, view, "needs a constant axis input")
    else:
        a = attr(node, "axis", 1)
    return int(np.asarray(a)) % r


def _static_len(view, name: str | None) -> int | None:
    v = cval(view, name)
    return None if v is None else int(np.asarray(v).reshape(-1)[0])


def fit_axis(b, view, z: str, like: str, axis: int, n: int | None, n_t: str) -> str:
    """z, of length n (tensor n_t, 1 element) along `axis`, truncated or zero-padded to the
    length of `like` there: the adjoint of the forward's padding or truncation to n."""
    s = view.shape(like)
    m = s[axis] if s is not None and isinstance(s[axis], int) else None
    r = len(s) if s is not None else view.rank(like)
    if m is not None and n is not None:
        if m < n:
            return b.op("Slice", [z, b.ints([0]), b.ints([m]), b.ints([axis])])
        if m > n:
            return b.op("Pad", [z, b.ints([0] * (r + axis) + [m - n] + [0] * (r - axis - 1))])
        return z
    m_t = axis_len(b, view, like, axis)
    z = b.op("Slice", [z, b.ints([0]), m_t, b.ints([axis])])
    more = b.op("Max", [b.sub(m_t, b.reshape(n_t, [1])), b.ints([0])])
    pads = b.op("Concat", [b.ints([0] * (r + axis)), more, b.ints([0] * (r - axis - 1))], axis=0)
    return b.op("Pad", [z, pads])


def real_like(b, view, z: str, x: str) -> str:
    """z [..., 2] cut to x's last dim: its real part [..., 1] for a real x, else all of it."""
    s = view.shape(x)
    last = s[-1] if s is not None else None
    if last == 2:
        return z
    end = b.ints([1]) if last == 1 else dims_slice(b, x, -1)
    return b.op("Slice", [z, b.ints([0]), end, b.ints([-1])])


@register("DFT", since=17, inputs=(0,))
def _dft_vjp(b, view, node, gys):
    """dx = the conjugate transform of g (n IDFT or DFT/n), fitted back to x's length and,
    for a real x, its real part."""
    g = gys[0]
    if g is None:
        return [None]
    x = node.input[0]
    axis = _axis(view, node)
    inverse = bool(attr(node, "inverse", 0))
    dl = inp(node, 1)
    m_s = view.shape(x)
    m = m_s[axis] if m_s is not None and isinstance(m_s[axis], int) else None
    n = _static_len(view, dl) if dl else m
    if dl:
        n_t = b.reshape(dl, [1])
    else:
        n_t = axis_len(b, view, x, axis)
    onesided = bool(attr(node, "onesided", 0))
    length = b.reshape(n_t, []) if (onesided or dl) else None
    z = dft(b, g, axis, length, inverse=not inverse)
    nf = c(b, float(n)) if n is not None else b.cast(n_t, b.float_type)
    z = b.div(z, nf) if inverse else b.mul(z, nf)
    if dl:
        z = fit_axis(b, view, z, x, axis, n, n_t)
    return [real_like(b, view, z, x)]


_dft_vjp.defjvp(linear_jvp(0))


@_dft_vjp.defcheck
def _dft_check(view, node):
    _axis(view, node)
    if attr(node, "inverse", 0) and attr(node, "onesided", 0):
        raise unsupported(node, view, "with inverse=1 and onesided=1 (a one-sided inverse, which the spec leaves "
                                      "undefined and runtimes read differently)")


def _stft_geometry(view, node) -> tuple[int, int]:
    """(frame_step, frame length) as ints: the frame length from frame_length, else the
    window's length, else the signal's (as onnx.reference)."""
    step = _static_len(view, inp(node, 1))
    fl = _static_len(view, inp(node, 3))
    src = inp(node, 2) or node.input[0]
    ss = view.shape(src)
    if fl is None and ss is not None:
        d = ss[0] if inp(node, 2) else ss[1]
        fl = d if isinstance(d, int) else None
    if step is None or fl is None:
        raise unsupported(node, view, "needs a constant frame_step and a constant frame_length (or a window of "
                                      "static length)")
    return step, fl


@register("STFT", since=17, inputs=(0, 2))
def _stft_vjp(b, view, node, gys, needs=None):
    """z = fl IDFT_fl(g) per frame ([B, F, fl, c], c = the signal's last dim) as [B*c, fl, F]:
    dsignal = overlap-add of z * window, dwindow = sum of z * frames. A real signal may come
    as [B, L] (torch's TorchScript exporter emits that; ORT takes it, the spec says [B, L, 1])."""
    g = gys[0]
    if g is None:
        return [None] * len(node.input)
    x, w = node.input[0], inp(node, 2)
    flat = view.rank(x) == 2
    step, fl = _stft_geometry(view, node)
    z = b.mul(dft(b, g, 2, b.const(np.asarray(fl, dtype=np.int64)), inverse=True), c(b, float(fl)))
    z = b.op("Slice", [z, b.ints([0]), b.ints([1]), b.ints([-1])]) if flat else real_like(b, view, z, x)
    z = b.reshape(b.transpose(z, [0, 3, 2, 1]), make_shape(b, [-1, fl] + dim_parts(b, view, g, 1, 2)))
    kernels = onehot_kernels(b, [fl])
    gx = gw = None
    if need(needs, 0):
        u = z if w is None else b.mul(z, b.reshape(w, [fl, 1]))
        o = b.op("ConvTranspose", [u, kernels], strides=[step])  # [B*c, 1, (F-1) step + fl]
        gs = static_shape(view, g)
        n = None if gs is None else (gs[1] - 1) * step + fl
        if flat:  # [B, (F-1) step + fl]
            o = b.reshape(o, make_shape(b, dim_parts(b, view, x, 0, 1) + [-1]))
            gx = fit_axis(b, view, o, x, 1, n, b.shape(o, 1, 2))
        else:
            o = b.reshape(o, make_shape(b, dim_parts(b, view, x, 0, 1) + dim_parts(b, view, x, 2, 3) + [-1]))
            gx = fit_axis(b, view, b.transpose(o, [0, 2, 1]), x, 1, n, b.shape(o, 2, 3))
    if w is not None and need(needs, 2):
        xt = b.op("Unsqueeze", [x, b.ints([1])]) if flat else b.transpose(x, [0, 2, 1])
        xt = b.reshape(xt, make_shape(b, [-1, 1] + dim_parts(b, view, x, 1, 2)))
        frames = b.op("Conv", [xt, kernels], strides=[step])  # [B*c, fl, F]
        gw = b.reduce_sum(b.mul(frames, z), [0, 2])
    return [gx, None, gw, None][:len(node.input)]


@_stft_vjp.defjvp
def _stft_jvp(b, view, node, ts):
    """Bilinear in (signal, window): the node on each tangent, with the other input as is."""
    return [add_n(b, [reapply(b, node, {i: ts[i]})[0] for i in (0, 2) if i < len(ts) and ts[i] is not None])]


@_stft_vjp.defcheck
def _stft_check(view, node):
    _stft_geometry(view, node)
