"""Transposed convolutions (ConvTranspose 1-d/2-d/3-d; weight [C_in, C_out/group, *kernel],
bias [C_out]).

The weight gradient of Y = ConvTranspose(X, W) is a correlation of the output cotangent
with the input, indexed by INPUT positions i:

    dW[c, o, m] = sum_{n, i} X[n, c, i] dY[n, o, s i + d m - pad_begin]

so, per group j, the layer is a dense map at every input position i from x_i = X[n, group j
channels, i] ([C_in/group]) to the output-cotangent patch D_i[(o, m)] = dY[n, o, s i + d m -
pad_begin] ([C_out/group * prod(kernel)], zero outside the output). D is the im2col of dY
for the adjoint Conv (same kernel, strides, dilations; pads (pad_begin, max(0, pad_end -
output_padding))), which has exactly one output position per input position: the conv
block's patch extraction applied to dY.

  kron (per group j, block diagonal over groups):
      A_j = 1/(N T) sum_{n,i} x_i x_i^T        [C_in/group, C_in/group], T = input positions
      G_j = 1/N sum_{n,i} D_i D_i^T            [C_out/group * K, C_out/group * K]
      (summed over seeds and uses; A x G acts on the weight as the matrix
      M[j, (o, m), c] = W[j C_in/group + c, o, m]); with one input position and N = 1 it is
      the exact per-example Fisher of W.
      The bias is added to every OUTPUT position (overlapping windows cover positions
      unevenly), so it has no homogeneous coordinate in A: it gets its own exact block
      B = 1/N sum_n gb_n gb_n^T [C_out, C_out], gb_n = dY[n] summed over space
      (F ~ (A (x) G) (+) B; damping: the pi split on A, G, plain on B).
  diagonal: per-example gradients, diag = 1/N sum_n g_n^2 over [W, b] flattened.
"""
from __future__ import annotations

import numpy as np

from kfac_compiler import linalg
from kfac_compiler.blocks._parts import Part
from kfac_compiler.blocks.conv import ConvMixin, read_kernel_geometry
from kfac_compiler.blocks.flat import FlatBlock
from kfac_compiler.blocks.kron import KronBlock
from kfac_compiler.blocks.ops import (
    emit_add_all,
    emit_concat,
    emit_dim,
    emit_examples,
    emit_gram,
    emit_live,
    emit_live_count,
    np_live,
    prod,
)
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.errors import ConfigError


class _AdjointConv(ConvMixin):
    """The Conv whose im2col of dY gives the cotangent patches D (one position per input
    position of the ConvTranspose)."""

    def __init__(self, ct: ConvTMixin) -> None:
        self.layer, self.options = ct.layer, ct.options
        self.input_shapes = None
        self.kernel, self.nd = ct.kernel, ct.nd
        self.strides, self.dilations, self.group = ct.strides, ct.dilations, ct.group
        nd = ct.nd
        self.pads = tuple(ct.pads[:nd]) + tuple(max(0, ct.pads[nd + i] - ct.output_padding[i]) for i in range(nd))
        self.auto_pad = "NOTSET"
        self.Cg = ct.Co_g  # dY channels per group
        self.K = ct.Co_g * prod(ct.kernel)
        self.has_bias = False


class ConvTMixin:
    def _convt_setup(self) -> None:
        layer = self.layer
        a = layer.attrs
        wshape = read_kernel_geometry(self, "ConvTranspose")
        nd = self.nd
        self.output_padding = tuple(int(p) for p in (a.get("output_padding") or [0] * nd))
        self.C_in, self.Co_g = wshape[0], wshape[1]
        if self.C_in % self.group:
            raise ConfigError(f"layer {layer.name!r}: C_in={self.C_in} not divisible by group={self.group}")
        for i in range(nd):
            if self.output_padding[i] - self.pads[nd + i] >= self.strides[i]:
                raise ConfigError(f"layer {layer.name!r}: output_padding {self.output_padding} >= stride "
                                  f"{self.strides} beyond the end pads is not supported")
        self.Cg = self.C_in // self.group
        self.C_out = self.Co_g * self.group
        self.Kt = self.Co_g * prod(self.kernel)  # G side: (o, m)
        self.adj = _AdjointConv(self)

    def _positions(self) -> int:
        shapes = self.input_shapes or [self.layer.attrs.get("input_shape")] * len(self.layer.uses)
        total = 0
        for shp in shapes:
            sp = list(shp or [])[2:]
            total += prod(sp) if sp and all(isinstance(d, int) for d in sp) else 1
        return max(total, 1)

    def positions_per_example(self) -> int:
        return self._positions()

    # ---- ONNX
    def _emit_x(self, b, x):
        """[N, C_in, *in] -> [N, group, C_in/group, T]."""
        return b.reshape(x, [0, self.group, self.Cg, -1])

    def _emit_dpatches(self, b, d):
        """dY [N, C_out, *out] -> D [N, group, C_out/group * K, T]."""
        return self.adj._emit_patches(b, d)

    def _emit_bias_grad(self, b, d):
        """dY -> per-example bias gradients [N, C_out]."""
        return b.reduce_sum(b.reshape(d, [0, self.C_out, -1]), [2])

    # ---- numpy
    def _np_x(self, x):
        x = np.asarray(x, np.float64)
        return x.reshape(x.shape[0], self.group, self.Cg, -1)

    def _np_dpatches(self, d):
        return self.adj.np_patches(np.asarray(d, np.float64))

    def _np_bias_grad(self, d):
        d = np.asarray(d, np.float64)
        return d.reshape(d.shape[0], self.C_out, -1).sum(-1)


class _ConvTView:
    """W [C_in, C_out/g, *k] (+ bias) <-> M [*batch, C_out/g * K, C_in/g] (the bias is not in
    the matrix: `split`/`join` carry it alongside)."""

    def __init__(self, blk) -> None:
        self.blk = blk
        self.w, self.bias = blk.layer.weight, blk.bias_name
        g, Cg, Kt = blk.group, blk.Cg, blk.Kt
        self.batch = (g,) if g > 1 else ()
        self.pre = (g, Cg, Kt) if g > 1 else (Cg, Kt)
        self.perm = [0, 2, 1] if g > 1 else [1, 0]

    stored_transposed = False

    def emit_to(self, b, tensors):
        return b.transpose(b.reshape(tensors[self.w], list(self.pre)), self.perm)

    def emit_from(self, b, M):
        return {self.w: b.reshape(b.transpose(M, self.perm), list(self.blk.wshape))}

    def np_to(self, arrays):
        return np.asarray(arrays[self.w]).reshape(self.pre).transpose(self.perm)

    def np_from(self, M):
        return {self.w: np.asarray(M).transpose(self.perm).reshape(self.blk.wshape)}


@register_block
class ConvTransposeKron(ConvTMixin, KronBlock):
    """KFC for ConvTranspose: A from the input, G from output-cotangent patches (one per input
    position), per group; the bias its own exact [C_out, C_out] block."""

    name = "kron"
    layer_kinds = ("conv_transpose",)
    masks_rows = True
    divides_by_examples = True
    example_rows = "leading"  # the bias block B squares per-example gradients
    uses = "any"
    menu_rank = 0

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        if self.damping_mode != "pi":
            raise ConfigError(f"layer {layer.name!r}: conv_transpose kron supports damping_mode 'pi' only")
        self._convt_setup()
        self.batch = (self.group,) if self.group > 1 else ()
        self.nA, self.nG = self.Cg, self.Kt
        self.view = _ConvTView(self)

    def parts(self):
        ps = super().parts()
        if self.has_bias:
            ps.append(Part("B", (self.C_out, self.C_out), "full"))
        return ps

    def np_scale(self, factors):
        """(A (x) G) (+) B, a direct sum: the larger of the two blocks' scales (as over groups)."""
        kron = float(np.max(linalg.np_trace_mean(factors["A"]) * linalg.np_trace_mean(factors["G"])))
        return max(kron, float(linalg.np_trace_mean(factors["B"]))) if self.has_bias else kron

    def stats_flops(self, batch: int) -> int:
        cols = batch * self._positions()
        return 2 * cols * self.group * (self.nA**2 + self.nG**2) + 2 * batch * self.C_out**2

    def emit_statistics(self, b, inputs, cotangents, masked=False, examples=None):
        X = emit_concat(b, [self._emit_x(b, x) for x in inputs], axis=3)  # [N, g, Cg, sum T]
        count = None
        if masked:  # the input locations whose output patches some seed's cotangent depends on
            live = emit_concat(b, [emit_live(b, [self._emit_dpatches(b, d) for d in ds], [2]) for ds in cotangents],
                               axis=3)  # [N, g, 1, sum T]
            X = b.mul(X, live)
            count = b.reshape(emit_live_count(b, live, masked, [0, 2, 3]), [-1, 1, 1])
        X = b.reshape(b.transpose(X, [1, 2, 0, 3]), [0, 0, -1])  # [g, Cg, N sum T]
        A = b.div(emit_gram(b, X, 3), count or emit_dim(b, X, 2))
        D = emit_concat(
            b,
            [b.reshape(b.transpose(self._emit_dpatches(b, d), [1, 2, 0, 3]), [0, 0, -1]) for ds in cotangents for d in ds],
            axis=2,
        )
        n = emit_examples(b, examples, cotangents)
        G = b.div(emit_gram(b, D, 3), n)
        if self.group == 1:
            A, G = b.reshape(A, [self.nA, self.nA]), b.reshape(G, [self.nG, self.nG])
        out = {"A": A, "G": G}
        if self.has_bias:
            gbs = [emit_add_all(b, [self._emit_bias_grad(b, cotangents[u][s]) for u in range(len(inputs))])
                   for s in range(len(cotangents[0]))]
            # per-example bias gradients: grouped by the leading axis, as the diagonal blocks
            out["B"] = b.div(emit_add_all(b, [emit_gram(b, g) for g in gbs]), emit_dim(b, cotangents[0][0], 0))
        return out

    def numpy_statistics(self, inputs, cotangents, masked=False):
        X = np.concatenate([self._np_x(x) for x in inputs], axis=3)
        count = None
        if masked:
            live = np.concatenate([np_live([self._np_dpatches(d) for d in ds], [2]) for ds in cotangents], axis=3)
            X = X * live
            count = np.maximum(live.sum(axis=(0, 2, 3)), 1.0).reshape(-1, 1, 1)
        X = X.transpose(1, 2, 0, 3).reshape(self.group, self.nA, -1)
        A = X @ X.transpose(0, 2, 1) / (count if count is not None else X.shape[2])
        D = np.concatenate(
            [self._np_dpatches(d).transpose(1, 2, 0, 3).reshape(self.group, self.nG, -1) for ds in cotangents for d in ds],
            axis=2,
        )
        n = np.shape(cotangents[0][0])[0]
        G = D @ D.transpose(0, 2, 1) / n
        if self.group == 1:
            A, G = A[0], G[0]
        out = {"A": A, "G": G}
        if self.has_bias:
            gbs = [sum(self._np_bias_grad(cotangents[u][s]) for u in range(len(inputs))) for s in range(len(cotangents[0]))]
            out["B"] = sum(g.T @ g for g in gbs) / n
        return out

    # ---- damping: the pi split on A, G; plain on B
    def _emit_damped(self, b, factors, damping):
        out = super()._emit_damped(b, factors, damping)
        if self.has_bias:
            out["B"] = linalg.emit_add_diagonal(b, factors["B"], self.C_out, damping)
        return out

    def _np_damped(self, factors, damping):
        out = super()._np_damped(factors, damping)
        if self.has_bias:
            out["B"] = linalg.np_add_diagonal(np.asarray(factors["B"]), float(damping))
        return out

    def _emit_apply(self, b, vectors, mats):
        out = super()._emit_apply(b, {self.layer.weight: vectors[self.layer.weight]}, mats)
        if self.has_bias:
            out[self.bias_name] = b.reshape(b.matmul(mats["B"], b.reshape(vectors[self.bias_name], [-1, 1])),
                                            list(self.param_shapes[self.bias_name]))
        return out

    def _np_apply(self, vectors, mats):
        out = super()._np_apply({self.layer.weight: vectors[self.layer.weight]}, mats)
        if self.has_bias:
            vb = np.asarray(vectors[self.bias_name], np.float64).reshape(-1)
            out[self.bias_name] = (mats["B"] @ vb).reshape(self.param_shapes[self.bias_name])
        return out


@register_block
class ConvTransposeDiagonal(ConvTMixin, FlatBlock):
    """Diagonal Fisher of a ConvTranspose from per-example gradients over [W, b]."""

    name = "diagonal"
    layer_kinds = ("conv_transpose",)
    uses = "any"
    menu_rank = 10
    full = False

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._convt_setup()
        self._flat_setup([layer.weight] + ([self.bias_name] if self.has_bias else []))

    def _grad_flops(self, batch: int) -> int:
        return 2 * batch * self._positions() * self.C_in * self.Kt

    def _emit_per_example(self, b, inputs, cotangents):
        out = []
        for s in range(len(cotangents[0])):
            ws, bs = [], []
            for u, x in enumerate(inputs):
                d = cotangents[u][s]
                D = self._emit_dpatches(b, d)  # [N, g, Kt, T]
                gw = b.matmul(self._emit_x(b, x), b.transpose(D, [0, 1, 3, 2]))  # [N, g, Cg, Kt]
                ws.append(b.reshape(gw, [0, -1]))
                if self.has_bias:
                    bs.append(self._emit_bias_grad(b, d))
            cols = [emit_add_all(b, ws)] + ([emit_add_all(b, bs)] if self.has_bias else [])
            out.append(cols[0] if len(cols) == 1 else b.op("Concat", cols, axis=1))
        return out

    def _np_per_example(self, inputs, cotangents):
        out = []
        for s in range(len(cotangents[0])):
            total = 0.0
            for u, x in enumerate(inputs):
                d = cotangents[u][s]
                gw = np.einsum("njct,njkt->njck", self._np_x(x), self._np_dpatches(d))
                cols = [gw.reshape(gw.shape[0], -1)]
                if self.has_bias:
                    cols.append(self._np_bias_grad(d))
                total = total + np.concatenate(cols, axis=1)
            out.append(total)
        return out
