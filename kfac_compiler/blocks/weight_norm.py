"""A weight-normed convolution: w = g v / ||v|| (torch's weight_norm, computed at run time).

The layer (kind "weight_norm_conv", patterns/builtin.py) is a Conv whose weight w is not an
initializer but computed from the trainable v (w's shape) and g (||v||'s shape: the norm
over `axes`, kept). Its K-FAC curvature is the conv's in w-space, F_w ~ A (x) G (the same
statistics as the conv `kron` block: patches of the conv input, cotangents of its output).
The parameters stay g and v (Adam and SGD train what the user wrote; the exported model keeps
them); the block maps between the two spaces by the Jacobian J = dw/d(g, v), per slice k (the
elements sharing one g_k; w^ = v / ||v||, c = g / ||v||):

    J (x_g, x_v)   = w^ x_g + c (x_v - w^ <w^, x_v>)
    J^T y          = (<w^, y>, c (y - w^ <w^, y>))
    J^+ y          = (<w^, y>, (y - w^ <w^, y>) / c)     (J has full row rank while g != 0)

The (g, v) Fisher of one example is J^T F_w J exactly (its gradient is J^T of w's), so the
block multiplies by J^T (F_w + damping) J and preconditions by its Moore-Penrose inverse
J^+ (F_w + damping)^-1 J^+T: the natural gradient in w-space, moved into (g, v) as the
minimum-norm change with J (dg, dv) = dw (v's direction along v and the scale change
along g stay out of each other's way). Both maps need the current g and v, so the block
reads the parameters (`reads_params`). Powers other than 1 and -1 are refused (the pseudo
power of J^T F J is not J^+ F^p J^+T).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from kfac_compiler.blocks.conv import ConvKron
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.errors import ConfigError

KIND = "weight_norm_conv"


@register_block
class WeightNormConvKron(ConvKron):
    """KFC of the conv in w-space, mapped to the weight norm's (g, v) by J^T / J^+."""

    name = "kron"
    layer_kinds = (KIND,)
    uses = "single"
    menu_rank = 0
    host_matpowers = False
    reads_params: ClassVar[bool] = True

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        spec = layer.attrs["weight_norm"]
        self.g_name, self.axes = str(spec["g"]), tuple(int(a) for a in spec["axes"])

    def _exps(self, exp) -> int:
        if exp not in (1, -1):
            raise ConfigError(f"layer {self.layer.name!r}: the weight-normed conv block multiplies by its "
                              f"curvature and its inverse only, not the matrix power {exp}; use precon_power=-1")
        return int(exp)

    # ---- ONNX
    def _emit_map(self, b, params):
        v, g = params[self.weight_name], params[self.g_name]
        norm = b.reduce("ReduceL2", v, self.axes, keepdims=True)
        what = b.div(v, norm)
        c = b.div(g, norm)
        zero = b.op("Equal", [g, b.const(0.0)])  # g = 0: J = [w^, 0], J^+ = [w^, 0]^T
        c_inv = b.op("Where", [zero, b.const(0.0), b.div(norm, b.op("Where", [zero, b.const(1.0), g]))])
        return what, c, c_inv

    def _emit_along(self, b, what, y):
        return b.reduce_sum(b.mul(what, y), self.axes, keepdims=True)

    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None, params=None):
        exp = self._exps(exp)
        what, c, c_inv = self._emit_map(b, params)
        scale = c if exp == 1 else c_inv  # J^T (.) J, or J^+ (.) J^+T
        xv = vectors[self.weight_name]
        across = b.sub(xv, b.mul(what, self._emit_along(b, what, xv)))
        w_vec = {self.weight_name: b.add(b.mul(what, vectors[self.g_name]), b.mul(scale, across))}
        if self.has_bias:
            w_vec[self.bias_name] = vectors[self.bias_name]
        out = dict(super().emit_power(b, w_vec, exp, factors=factors, damping=damping, state=state))
        y = out[self.weight_name]
        along = self._emit_along(b, what, y)
        out[self.g_name] = along
        out[self.weight_name] = b.mul(scale, b.sub(y, b.mul(what, along)))
        return out

    # ---- numpy (float64)
    def _np_map(self, params):
        v = np.asarray(params[self.weight_name], np.float64)
        g = np.asarray(params[self.g_name], np.float64)
        norm = np.sqrt((v * v).sum(axis=self.axes, keepdims=True))
        with np.errstate(divide="ignore", invalid="ignore"):
            c_inv = np.where(g == 0, 0.0, norm / np.where(g == 0, 1.0, g))
        return v / norm, g / norm, c_inv

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None, params=None):
        exp = self._exps(exp)
        what, c, c_inv = self._np_map(params)
        scale = c if exp == 1 else c_inv
        xv = np.asarray(vectors[self.weight_name], np.float64)
        along_x = (what * xv).sum(axis=self.axes, keepdims=True)
        w_vec = {self.weight_name: what * np.asarray(vectors[self.g_name], np.float64) + scale * (xv - what * along_x)}
        if self.has_bias:
            w_vec[self.bias_name] = vectors[self.bias_name]
        out = dict(super().numpy_power(w_vec, exp, factors=factors, damping=damping, state=state))
        y = np.asarray(out[self.weight_name], np.float64)
        along = (what * y).sum(axis=self.axes, keepdims=True)
        out[self.g_name] = along
        out[self.weight_name] = scale * (y - what * along)
        return out

    def np_cholesky_parts(self, factors, damping, inverse=False):
        raise ConfigError(f"layer {self.layer.name!r}: the weight-normed conv block has no Cholesky factor in "
                          "(g, v); use multiply / multiply_inverse")

    @property
    def weight_name(self) -> str:
        return self.layer.weight
