"""Convolutions (Conv 1-d/2-d/3-d; weight [C_out, C_in/group, *kernel]).

Patches: a depthwise Conv (group = C_in) with a one-hot kernel E [C_in kk, 1, *kernel]
(E[c kk + m, 0, m] = 1, kk = prod(kernel), tiled at run time from a [kk, 1, *kernel]
constant) and the layer's own strides, pads, dilations turns the input [N, C_in, *spatial]
into the patch tensor [N, C_in kk, *out]; with K = C_in/group * kk its channel j*K + c kk + m
is input channel j*C_in/group + c at kernel offset m: per group the receptive field ordered
like the flattened weight (C_in/group, *kernel). Zero padding shows up as zeros in the
patches; the bias coordinate (1) is appended last. Float64 graphs (ORT's CPU Conv has no
double kernel) or option patches="slices" use Pad + one strided Slice per kernel offset
instead (same tensor, exact in any dtype). Nothing stored grows with the width (a dense
identity kernel [group K, C_in/group, *kernel] was 85 MB for a 512-channel 3x3 conv and
C_in times the FLOPs; benchmarks/bench_step.py patches, docs/conventions.md).

  kron / kron_indep (KFC, Grosse & Martens 2016), per group j (block diagonal over groups):
      A_j = 1/(N T) sum_{n,t} a~ a~^T   [K+1, K+1],  T = output locations (summed over uses)
      G_j = 1/N sum_{n,t} delta delta^T  [C_out/group, C_out/group]
      stored [K+1, K+1] / [C_out, C_out] when group == 1, else [group, ...]
  kron_in_diag / kron_out_diag / kron_both_diag: the same with diag(A), diag(G) or both kept
      (for inputs or outputs too wide for a full factor; chosen by passes/budget.py).
  kron (depthwise_conv): the same per group = per input channel c: A_c [kk+1, kk+1],
      G_c [mult, mult] (TF K-FAC's DepthwiseConvKFCBasicFB embeds the filter in a dense conv
      and keeps A over all channels, [C_in kk, C_in kk]; not offered: (C_in kk)^3 a refresh).
  diagonal (conv and depthwise_conv): per-example gradients g_n = delta_n patches_n^T
      ([N, C_out, T] x [N, T, K+1]), diag = 1/N sum_n g_n^2, stored [C_out, K+1].
  channel_full (depthwise_conv, its default): the same g_n; per output channel c the full
      F_c = 1/N sum_n g_nc g_nc^T [K+1, K+1], stored [C_out, K+1, K+1].
"""
from __future__ import annotations

import itertools

import numpy as np
from onnx import TensorProto

from kfac_compiler.blocks._parts import Part, PartsBlock
from kfac_compiler.blocks.gram import GramStatistic
from kfac_compiler.blocks.kron import KronBlock
from kfac_compiler.blocks.ops import (
    emit_add_all,
    emit_append_const,
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
from kfac_compiler.blocks.views import MatrixView
from kfac_compiler.errors import ConfigError


def read_kernel_geometry(block, op: str) -> tuple[int, ...]:
    """Set the weight shape, kernel, nd, strides, pads, dilations, group and bias of a Conv or
    ConvTranspose layer's block from its attrs (ONNX defaults where absent); returns the
    weight shape."""
    layer = block.layer
    w = layer.weight
    wshape = tuple(int(d) for d in block.param_shapes[w])
    if len(wshape) < 3:
        raise ConfigError(f"layer {layer.name!r}: {op} weight {w!r} has shape {wshape}")
    a = layer.attrs
    block.kernel = tuple(int(k) for k in (a.get("kernel_shape") or wshape[2:]))
    nd = block.nd = len(block.kernel)
    block.strides = tuple(int(s) for s in (a.get("strides") or [1] * nd))
    block.pads = tuple(int(p) for p in (a.get("pads") or [0] * (2 * nd)))
    block.dilations = tuple(int(d) for d in (a.get("dilations") or [1] * nd))
    block.group = int(a.get("group") or 1)
    block.wshape = wshape
    block.bias_name = layer.bias
    block.has_bias = block.bias_name is not None
    return wshape


class ConvMixin:
    """Conv attributes, patch extraction (ONNX) and a numpy im2col."""

    def _conv_setup(self) -> None:
        layer = self.layer
        a = layer.attrs
        wshape = read_kernel_geometry(self, "conv")
        self.auto_pad = a.get("auto_pad") or "NOTSET"
        if isinstance(self.auto_pad, bytes):
            self.auto_pad = self.auto_pad.decode()
        self.C_out, self.Cg = wshape[0], wshape[1]
        if self.C_out % self.group:
            raise ConfigError(f"layer {layer.name!r}: C_out={self.C_out} not divisible by group={self.group}")
        self.C_in = self.Cg * self.group
        self.Co_g = self.C_out // self.group
        self.K = self.Cg * prod(self.kernel)
        self.nK = self.K + int(self.has_bias)

    def _bias_shape(self):
        return tuple(self.param_shapes[self.bias_name]) if self.has_bias else None

    def _out_positions(self) -> int:
        shapes = self.input_shapes or [self.layer.attrs.get("input_shape")] * len(self.layer.uses)
        total = 0
        for shp in shapes:
            if shp is None or any(not isinstance(d, int) for d in list(shp)[2:]):
                total += 1
                continue
            total += prod(self._out_sizes(list(shp)[2:]))
        return max(total, 1)

    def positions_per_example(self) -> int:
        return self._out_positions()

    def _out_sizes(self, spatial):
        pads = self._np_pads(spatial)
        return [
            (s + pads[i] + pads[i + self.nd] - self.dilations[i] * (self.kernel[i] - 1) - 1) // self.strides[i] + 1
            for i, s in enumerate(spatial)
        ]

    def _np_pads(self, spatial):
        if self.auto_pad in ("NOTSET", ""):
            return list(self.pads)
        if self.auto_pad == "VALID":
            return [0] * (2 * self.nd)
        begins, ends = [], []
        for i, s in enumerate(spatial):
            out = -(-s // self.strides[i])
            total = max((out - 1) * self.strides[i] + self.dilations[i] * (self.kernel[i] - 1) + 1 - s, 0)
            small, big = total // 2, total - total // 2
            begins.append(small if self.auto_pad == "SAME_UPPER" else big)
            ends.append(big if self.auto_pad == "SAME_UPPER" else small)
        return begins + ends

    # ---- ONNX
    def _emit_patches(self, b, x):
        """[N, C_in, *spatial] -> a~ [N, group, K(+1), T]."""
        how = self.options.get("patches")
        if b.float_type == TensorProto.DOUBLE or how == "slices":
            p = self._emit_patches_slices(b, x)  # ORT's CPU Conv has no float64 kernel
        else:
            p = self._emit_patches_depthwise(b, x)
        p = b.reshape(p, [0, self.group, self.K, -1])
        return emit_append_const(b, p, 4, 2, 1.0) if self.has_bias else p

    def _emit_patches_slices(self, b, x):
        """Pad + one strided Slice per kernel offset: [N, C_in, prod(kernel), *out]."""
        if self.auto_pad in ("NOTSET", ""):
            pads = list(self.pads)
        else:
            shapes = self.input_shapes or [self.layer.attrs.get("input_shape")]
            spatial = list(shapes[0] or [])[2:]
            if len(spatial) != self.nd or not all(isinstance(d, int) for d in spatial):
                raise ConfigError(f"layer {self.layer.name!r}: auto_pad needs static spatial input dims here")
            pads = self._np_pads(spatial)
        if any(pads):
            full = [0, 0] + pads[: self.nd] + [0, 0] + pads[self.nd :]
            x = b.op("Pad", [x, b.ints(full)], mode="constant")
        axes = list(range(2, 2 + self.nd))
        cols = []
        for off in itertools.product(*[range(k) for k in self.kernel]):
            starts = [off[i] * self.dilations[i] for i in range(self.nd)]
            ends = [
                -self.dilations[i] * (self.kernel[i] - 1 - off[i]) if self.kernel[i] - 1 - off[i] else np.iinfo(np.int64).max
                for i in range(self.nd)
            ]
            sl = b.op("Slice", [x, b.ints(starts), b.ints(ends), b.ints(axes), b.ints(list(self.strides))])
            cols.append(b.unsqueeze(sl, [2]))
        return cols[0] if len(cols) == 1 else b.op("Concat", cols, axis=2)

    def _emit_patches_depthwise(self, b, x):
        """Depthwise Conv (group = C_in) with a one-hot kernel [C_in kk, 1, *kernel] tiled at
        run time from [kk, 1, *kernel]: [N, C_in kk, *out], channel c kk + m = input channel c
        at kernel offset m (c = j C_in/group + c', so the order is j K + c' kk + m)."""
        kk, C_in = prod(self.kernel), self.Cg * self.group
        one_hot = b.const(np.eye(kk).reshape(kk, 1, *self.kernel), hint="one_hot_kernel")
        E = b.op("Tile", [one_hot, b.ints([C_in] + [1] * (self.nd + 1))], hint="patch_kernel")
        kw = dict(kernel_shape=list(self.kernel), strides=list(self.strides), dilations=list(self.dilations), group=C_in)
        if self.auto_pad in ("NOTSET", ""):
            kw["pads"] = list(self.pads)
        else:
            kw["auto_pad"] = self.auto_pad
        return b.op("Conv", [x, E], hint="patches", **kw)

    def _emit_delta(self, b, d):
        """[N, C_out, *out] -> [N, group, C_out/group, T]."""
        return b.reshape(d, [0, self.group, self.Co_g, -1])

    def _emit_per_example_gradients(self, b, inputs, cotangents, A_Q=None, G_Q=None) -> list[str]:
        """Per seed s the per-example gradients g_ns = delta patches^T [N, g, C_out/g, K+1]
        (summed over positions and uses), in the bases A_Q, G_Q ([K+1]^2 / [C_out/g]^2, or
        [g, ...] per group; None: the identity): what the diagonal, channel_full and ekfac
        statistics are moments of."""
        P = emit_concat(b, [self._emit_patches(b, x) for x in inputs], axis=3)  # [N, g, nK, T]
        last = [0, 2, 1] if self.group > 1 else [1, 0]
        if A_Q is not None:
            P = b.matmul(b.transpose(A_Q, last), P)  # a' = A_Q^T a~ per group
        Pt = b.transpose(P, [0, 1, 3, 2])
        out = []
        for s in range(len(cotangents[0])):
            D = emit_concat(b, [self._emit_delta(b, cotangents[u][s]) for u in range(len(inputs))], axis=3)
            if G_Q is not None:
                D = b.matmul(b.transpose(G_Q, last), D)  # d' = G_Q^T delta per group
            out.append(b.matmul(D, Pt))  # [N, g, Co_g, nK]
        return out

    def _emit_gradient_moments(self, b, inputs, cotangents, shape, A_Q=None, G_Q=None):
        """1/N sum_{n,s} (G_Q^T g_ns A_Q)^2 elementwise per group (_emit_per_example_gradients),
        reshaped to `shape`: the diagonal block's statistic, and ekfac's S in its eigenbases."""
        gs = self._emit_per_example_gradients(b, inputs, cotangents, A_Q, G_Q)
        total = emit_add_all(b, [b.reduce_sum(b.mul(g, g), [0]) for g in gs])
        return b.div(b.reshape(total, list(shape)), emit_dim(b, gs[0], 0))

    # ---- numpy
    def np_patches(self, x) -> np.ndarray:
        """numpy im2col: [N, C_in, *spatial] -> [N, group, K(+1), T]."""
        x = np.asarray(x, np.float64)
        N, spatial = x.shape[0], list(x.shape[2:])
        pads = self._np_pads(spatial)
        xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + self.nd]) for i in range(self.nd)])
        outs = self._out_sizes(spatial)
        cols = []
        for off in itertools.product(*[range(k) for k in self.kernel]):
            sl = tuple(
                slice(off[i] * self.dilations[i], off[i] * self.dilations[i] + self.strides[i] * (outs[i] - 1) + 1, self.strides[i])
                for i in range(self.nd)
            )
            cols.append(xp[(slice(None), slice(None)) + sl])
        P = np.stack(cols, axis=2).reshape(N, self.group, self.K, -1)
        if self.has_bias:
            P = np.concatenate([P, np.ones((N, self.group, 1, P.shape[-1]))], axis=2)
        return P

    def _np_delta(self, d):
        d = np.asarray(d, np.float64)
        return d.reshape(d.shape[0], self.group, self.Co_g, -1)

    def _np_per_example_gradients(self, inputs, cotangents) -> list[np.ndarray]:
        """numpy twin of _emit_per_example_gradients (identity bases): per seed [N, g, C_out/g, K+1]."""
        P = np.concatenate([self.np_patches(x) for x in inputs], axis=3)
        return [np.einsum("ngot,ngkt->ngok", np.concatenate([self._np_delta(cotangents[u][s]) for u in range(len(inputs))],
                                                           axis=3), P)
                for s in range(len(cotangents[0]))]


class ConvKronBase(ConvMixin, KronBlock):
    layer_kinds = ("conv",)
    masks_rows = True
    divides_by_examples = True

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._conv_setup()
        self.batch = (self.group,) if self.group > 1 else ()
        self.nA, self.nG = self.nK, self.Co_g
        w_mat = (self.group, self.Co_g, self.K) if self.group > 1 else (self.C_out, self.K)
        self.view = MatrixView(self.layer.weight, self.wshape, w_mat, False, self.bias_name, self._bias_shape())
        self._setup_exact_check()

    def stats_flops(self, batch: int) -> int:
        cols = batch * self._out_positions()
        fa = self.nA * (1 if self.a_diag else self.nA)
        fg = self.nG * (1 if self.g_diag else self.nG)
        # + the patches: a depthwise conv with prod(kernel) one-hot taps per output channel
        return 2 * cols * self.group * (fa + fg) + 2 * cols * self.group * self.K * prod(self.kernel)

    def emit_statistics(self, b, inputs, cotangents, masked=False, examples=None):
        P = emit_concat(b, [self._emit_patches(b, x) for x in inputs], axis=3)  # [N, g, nA, sum T]
        if self.group == 1:
            return self._emit_gram_statistics(b, P, cotangents, masked, examples)
        count = None
        if masked:  # the output locations some seed's cotangent (of the group's channels) depends on
            live = emit_concat(b, [emit_live(b, [self._emit_delta(b, d) for d in ds], [2]) for ds in cotangents],
                               axis=3)  # [N, g, 1, sum T]
            P = b.mul(P, live)
            per_group = emit_live_count(b, live, masked, [0, 2, 3])  # [g]
            count = b.reshape(per_group, [-1, 1] if self.a_diag else [-1, 1, 1])
        P = b.reshape(b.transpose(P, [1, 2, 0, 3]), [0, 0, -1])  # [g, nA, N sum T]
        A = b.reduce_sum(b.mul(P, P), [2]) if self.a_diag else emit_gram(b, P, 3)
        A = b.div(A, count or emit_dim(b, P, 2))
        D = emit_concat(
            b,
            [b.reshape(b.transpose(self._emit_delta(b, d), [1, 2, 0, 3]), [0, 0, -1]) for ds in cotangents for d in ds],
            axis=2,
        )
        G = b.reduce_sum(b.mul(D, D), [2]) if self.g_diag else emit_gram(b, D, 3)
        G = b.div(G, emit_examples(b, examples, cotangents))
        if self.group == 1:
            A = b.reshape(A, [self.nA] if self.a_diag else [self.nA, self.nA])
            G = b.reshape(G, [self.nG] if self.g_diag else [self.nG, self.nG])
        return {"A": A, "G": G}

    def _emit_gram_statistics(self, b, P, cotangents, masked, examples=None):
        """emit_statistics of a group-1 conv: A and G as GramStatistic columns [nA, N sum T]
        and [C_out, S R N sum T] (cols), their counts N sum T and N (diag for a diagonal
        factor): the moving average then takes each in one Gemm, or a diagonal in one
        ReduceSumSquare (no product, division or reshape of their own)."""
        count = None
        if masked:
            live = emit_concat(b, [emit_live(b, [self._emit_delta(b, d) for d in ds], [2]) for ds in cotangents],
                               axis=3)  # [N, 1, 1, sum T]
            P = b.mul(P, live)
            count = emit_live_count(b, live, masked)
        cols = b.reshape(b.transpose(P, [1, 2, 0, 3]), [self.nA, -1])  # [nA, N sum T]
        A = GramStatistic(cols, count or emit_dim(b, cols, 1), cols=True, diag=self.a_diag)
        D = emit_concat(b, [b.reshape(b.transpose(self._emit_delta(b, d), [1, 2, 0, 3]), [self.nG, -1])
                            for ds in cotangents for d in ds], axis=1)  # [C_out, S R N sum T]
        G = GramStatistic(D, emit_examples(b, examples, cotangents), cols=True, diag=self.g_diag)
        return {"A": A, "G": G}

    def numpy_statistics(self, inputs, cotangents, masked=False):
        P = np.concatenate([self.np_patches(x) for x in inputs], axis=3)
        count = None
        if masked:
            live = np.concatenate([np_live([self._np_delta(d) for d in ds], [2]) for ds in cotangents], axis=3)
            P = P * live
            count = np.maximum(live.sum(axis=(0, 2, 3)), 1.0).reshape((-1, 1) if self.a_diag else (-1, 1, 1))
        P = P.transpose(1, 2, 0, 3).reshape(self.group, self.nA, -1)
        A = (P * P).sum(2) if self.a_diag else P @ P.transpose(0, 2, 1)
        A = A / (count if count is not None else P.shape[2])
        D = np.concatenate(
            [self._np_delta(d).transpose(1, 2, 0, 3).reshape(self.group, self.nG, -1) for ds in cotangents for d in ds],
            axis=2,
        )
        G = (D * D).sum(2) if self.g_diag else D @ D.transpose(0, 2, 1)
        G = G / np.shape(cotangents[0][0])[0]
        if self.group == 1:
            A, G = A[0], G[0]
        return {"A": A, "G": G}


@register_block
class ConvKron(ConvKronBase):
    """KFC (Grosse & Martens 2016); per-group factors when group > 1; uses pooled."""

    name = "kron"
    uses = "single"
    menu_rank = 0


@register_block
class ConvKronIndep(ConvKronBase):
    """Multi-use conv: uses pooled as independent (same factors as "kron")."""

    name = "kron_indep"
    uses = "multi"
    menu_rank = 0


@register_block
class ConvKronInDiag(ConvKronBase):
    """KFC with the input factor A kept as its diagonal: for inputs so wide (C_in k^2 in the
    thousands) that a full A costs more to multiply by every step than the layer's own forward
    and backward (passes/budget.py chooses it then). Any use count."""

    name = "kron_in_diag"
    uses = "any"
    menu_rank = 11
    a_diag = True


@register_block
class ConvKronOutDiag(ConvKronBase):
    name = "kron_out_diag"
    uses = "any"
    menu_rank = 12
    g_diag = True


@register_block
class ConvKronBothDiag(ConvKronBase):
    """Both factors diagonal: diag(A) (x) diag(G), a rank-one fit of the Fisher's diagonal
    that costs no per-example gradients (the "diagonal" block materializes [N, C_out, K+1])."""

    name = "kron_both_diag"
    uses = "any"
    menu_rank = 13
    a_diag = True
    g_diag = True


# kron_indep with diagonal factors under TF K-FAC's multi-use names (see fully_connected.py)
@register_block
class ConvKronIndepInDiag(ConvKronInDiag):
    name = "kron_indep_in_diag"
    uses = "multi"
    menu_rank = 3


@register_block
class ConvKronIndepOutDiag(ConvKronOutDiag):
    name = "kron_indep_out_diag"
    uses = "multi"
    menu_rank = 4


@register_block
class ConvKronIndepBothDiag(ConvKronBothDiag):
    name = "kron_indep_both_diag"
    uses = "multi"
    menu_rank = 5


@register_block
class DepthwiseConvKron(ConvKronBase):
    """KFC per input channel of a depthwise conv (group = C_in, C_out = multiplier C_in):
    A_c [kk+1, kk+1] over channel c's patches, G_c [mult, mult] over its outputs, stored
    [C_in, ...]: the grouped conv's "kron", exact for one example at one position. Listed
    after "channel_full" (the default) and "diagonal" (TF K-FAC's register_depthwise_conv2d)."""

    name = "kron"
    layer_kinds = ("depthwise_conv",)
    uses = "any"  # depthwise_conv has no multi-use menu: uses are pooled (as kron_indep)
    menu_rank = 11


@register_block
class ConvDiagonal(ConvMixin, PartsBlock):
    """Diagonal Fisher of a conv (also depthwise) from per-example gradients, [C_out, K+1]."""

    name = "diagonal"
    layer_kinds = ("conv", "depthwise_conv")
    uses = "any"  # depthwise_conv has no multi-use menu: its layers of any use count pick here
    menu_rank = 10

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._conv_setup()
        self.view = MatrixView(self.layer.weight, self.wshape, (self.C_out, self.K), False, self.bias_name, self._bias_shape())

    def parts(self):
        return [Part("diag", (self.C_out, self.nK), "diag")]

    def stats_flops(self, batch: int) -> int:
        return 2 * batch * self._out_positions() * self.C_out * self.nK + 2 * batch * self.C_out * self.nK

    def emit_statistics(self, b, inputs, cotangents):
        return {"diag": self._emit_gradient_moments(b, inputs, cotangents, (self.C_out, self.nK))}

    def numpy_statistics(self, inputs, cotangents):
        gs = self._np_per_example_gradients(inputs, cotangents)
        return {"diag": sum((g * g).sum(0) for g in gs).reshape(self.C_out, self.nK) / gs[0].shape[0]}

    def _emit_apply(self, b, vectors, mats):
        return self.view.emit_from(b, b.mul(self.view.emit_to(b, vectors), mats["diag"]))

    def _np_apply(self, vectors, mats):
        return self.view.np_from(self.view.np_to(vectors) * mats["diag"])


@register_block
class DepthwiseConvChannelFull(ConvMixin, PartsBlock):
    """The exact Fisher of each output channel's own parameters [w_c | b_c] (K+1 of them:
    kk taps and the bias), F_c = 1/N sum_{n,s} g_nc g_nc^T from the diagonal block's
    per-example gradients, stored [C_out, K+1, K+1] and preconditioned by a batched solve.
    Keeps what the diagonal drops (the taps of one filter are strongly correlated: they see
    overlapping pixels) at (K+1) times its memory, 100 floats per 3x3 channel. Grouped per
    output channel, not per input channel: with a channel multiplier m the blocks stay
    [K+1]^2 (not [m (K+1)]^2), laid out as the diagonal's [C_out, K+1]. A mean of per-example
    outer products, so exact under data parallelism and accumulation. The depthwise default
    (ranked before the diagonal): fewer steps to tuned Adam's 500-step loss on every seed of the
    zoo's depthwise CNN (139 against 201 on average, seeds 0-3), a lower 30-step held-out loss
    on 12 of 18 depthwise real exports x seeds (results/2026-11-29-autoencoder-depthwise-steps.md)."""

    name = "channel_full"
    layer_kinds = ("depthwise_conv",)
    uses = "any"  # depthwise_conv has no multi-use menu: per-example gradients sum the uses
    menu_rank = 9

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._conv_setup()
        self.view = MatrixView(self.layer.weight, self.wshape, (self.C_out, self.K), False, self.bias_name, self._bias_shape())

    def parts(self):
        return [Part("full", (self.C_out, self.nK, self.nK), "full")]

    def stats_flops(self, batch: int) -> int:
        return 2 * batch * self._out_positions() * self.C_out * self.nK + 2 * batch * self.C_out * self.nK * self.nK

    def emit_statistics(self, b, inputs, cotangents):
        gs = self._emit_per_example_gradients(b, inputs, cotangents)  # per seed [N, g, Co_g, nK]
        rows = emit_concat(b, [b.transpose(b.reshape(g, [0, self.C_out, self.nK]), [1, 2, 0]) for g in gs], axis=2)
        return {"full": b.div(emit_gram(b, rows, 3), emit_dim(b, gs[0], 0))}  # [C_out, nK, N S] -> per-channel Gram

    def numpy_statistics(self, inputs, cotangents):
        gs = [g.reshape(g.shape[0], self.C_out, self.nK) for g in self._np_per_example_gradients(inputs, cotangents)]
        return {"full": sum(np.einsum("nck,ncl->ckl", g, g) for g in gs) / gs[0].shape[0]}

    def _emit_apply(self, b, vectors, mats):
        v = b.unsqueeze(self.view.emit_to(b, vectors), [2])  # [C_out, nK, 1]
        return self.view.emit_from(b, b.reshape(b.matmul(mats["full"], v), [self.C_out, self.nK]))

    def _np_apply(self, vectors, mats):
        v = self.view.np_to(vectors).astype(np.float64)
        return self.view.np_from(np.einsum("ckl,cl->ck", mats["full"], v))
