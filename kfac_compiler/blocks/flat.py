"""Blocks over the flat parameter vector built from per-example gradients:
scale_and_shift (normalization affine / Mul+Add) and generic parameters; AxisSum, the
per-example sums of a cotangent down to a broadcast tensor's entries (also blocks/broadcast.py).

For M per-example gradient vectors g_m (the layer's parameters flattened and concatenated
in layer.params order), summed over seeds s:
  "full":      F = sum_s 1/M sum_m g_{s,m} g_{s,m}^T     [P, P]
  "diagonal":  d = sum_s 1/M sum_m g_{s,m}^2             [P]

scale_and_shift (params scale, shift optional): x_hat per attrs["normalization"]
  None                          x_hat = use.input (the tensor the Mul scales)
  {"op": "LayerNormalization", "axis", "epsilon"}   x_hat = LayerNorm(x) without affine
  {"op": "RMSNormalization", "axis", "epsilon"}     x_hat = x / sqrt(mean(x^2) + eps) (axes from axis on)
  {"op": "BatchNormalization", "mean", "var", "epsilon"}  x_hat = (x - mean)/sqrt(var + eps)
                                 (mean/var: graph tensors [C], channel axis 1)
  {"op": "BatchNormalization", "training": True, "epsilon"}  training mode: x_hat normalized
                                 with the batch statistics of x (over N and space, per channel),
                                 the statistics the forward pass used (on a sub-batch pass, the
                                 sub-batch's)
  {"op": "InstanceNormalization", "epsilon"}  x_hat normalized per example and channel
  {"op": "GroupNormalization", "num_groups", "epsilon", "per_group"}  x_hat normalized per
                                 example and group of channels; per_group (opset 18-20): the
                                 scale/shift are [num_groups] and the gradients are summed per
                                 group, else per channel
  g_scale[n] = sum over the non-batch axes outside attrs["scale_axes"] of x_hat * delta,
  g_shift[n] = the same sum of delta; M = N; several uses add their gradients.

generic: cotangents[p][s] is the per-example gradient [M, *shape_p] of layer.params[p]
  (M = N, or M = 1 for the sqrt(N) * batch-gradient fallback); with a single parameter and
  several entries, the entries are per-use contributions and are summed.
"""
from __future__ import annotations

import numpy as np

from kfac_compiler.blocks._parts import Part, PartsBlock
from kfac_compiler.blocks.gram import GramStatistic
from kfac_compiler.blocks.ops import emit_add_all, emit_concat, emit_dim, prod
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.blocks.views import FlatView
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import Layer

BATCH_STAT_NORMS = ("BatchNormalization", "InstanceNormalization", "GroupNormalization")
"""Normalizations whose x_hat the block computes in the [N, K, L] layout (K the scale's size)."""


class FlatBlock(PartsBlock):
    """Full or diagonal curvature over the flat parameter vector."""

    full: bool = True

    def _flat_setup(self, names) -> None:
        self.view = FlatView(names, [self.param_shapes[n] for n in names])
        self.P = self.view.size

    def parts(self):
        return [Part("full", (self.P, self.P), "full")] if self.full else [Part("diag", (self.P,), "diag")]

    def stats_flops(self, batch: int) -> int:
        return 2 * batch * self.P * (self.P if self.full else 1) + self._grad_flops(batch)

    def _grad_flops(self, batch: int) -> int:
        return 0

    # per-example gradients: list over seeds of [M, P]
    def _emit_per_example(self, b, inputs, cotangents) -> list[str]:
        raise NotImplementedError

    def _np_per_example(self, inputs, cotangents) -> list[np.ndarray]:
        raise NotImplementedError

    def emit_statistics(self, b, inputs, cotangents):
        gs = self._emit_per_example(b, inputs, cotangents)
        m = emit_dim(b, gs[0], 0)
        if self.full:  # the seeds' Grams summed: one Gram of their rows stacked
            return {"full": GramStatistic(emit_concat(b, gs, 0), m)}
        return {"diag": b.div(emit_add_all(b, [b.reduce_sum(b.mul(g, g), [0]) for g in gs]), m)}

    def numpy_statistics(self, inputs, cotangents):
        gs = self._np_per_example(inputs, cotangents)
        m = gs[0].shape[0]
        if self.full:
            return {"full": sum(g.T @ g for g in gs) / m}
        return {"diag": sum((g * g).sum(0) for g in gs) / m}

    def _emit_apply(self, b, vectors, mats):
        v = self.view.emit_to(b, vectors)
        v = b.matmul(mats["full"], v) if self.full else b.mul(v, mats["diag"])
        return self.view.emit_from(b, v)

    def _np_apply(self, vectors, mats):
        v = self.view.np_to(vectors).astype(np.float64)
        return self.view.np_from(mats["full"] @ v if self.full else v * mats["diag"])


# =====================================================================================
class AxisSum:
    """Per-example sums of a [N, *out] cotangent (or x_hat * cotangent) down to the S entries
    of the tensor broadcast over it (scale_and_shift's scale, broadcast's shift): the sum over
    the non-batch axes outside `scale_axes`, as [N, prod(S)]. Subclasses set layer, S and
    scale_axes."""

    layer: Layer
    S: tuple[int, ...]
    scale_axes: tuple[int, ...]

    def _reduce_plan(self, rank: int | None):
        """(pre-reduce axes, layout) so that sum(pre) then reshape gives [N, P_scale]."""
        axes = self.scale_axes
        if rank is not None:
            axes = tuple(sorted(a % rank for a in axes))
            others = [i for i in range(1, rank) if i not in axes]
            return others, "done"
        if all(a < 0 for a in axes):
            lo = min(axes)
            return [a for a in range(lo, 0) if a not in axes], "trailing"
        if all(a > 0 for a in axes):
            hi = max(axes)
            return [a for a in range(1, hi + 1) if a not in axes], "leading"
        raise ConfigError(
            f"layer {self.layer.name!r}: scale_axes {axes} mix signs; give the input rank "
            "(input_shapes or attrs['input_shape'])"
        )

    def _emit_reduce(self, b, z, rank):
        pre, layout = self._reduce_plan(rank)
        if pre:
            z = b.reduce_sum(z, pre, keepdims=False)
        n_s = prod(self.S)
        if layout == "trailing":
            return b.reduce_sum(b.reshape(z, [0, -1, n_s]), [1])
        if layout == "leading":
            return b.reduce_sum(b.reshape(z, [0, n_s, -1]), [2])
        return b.reshape(z, [0, n_s])

    def _np_reduce(self, z):
        rank = z.ndim
        axes = tuple(sorted(a % rank for a in self.scale_axes))
        others = tuple(i for i in range(1, rank) if i not in axes)
        return z.sum(axis=others).reshape(z.shape[0], -1)


class ScaleShiftBlock(AxisSum, FlatBlock):
    layer_kinds = ("scale_and_shift",)

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self.scale = layer.params[0]
        self.shift = layer.params[1] if len(layer.params) > 1 else None
        self.S = tuple(int(d) for d in param_shapes[self.scale])
        if self.shift is not None and prod(param_shapes[self.shift]) != prod(self.S):
            raise ConfigError(f"layer {layer.name!r}: shift {self.shift!r} and scale {self.scale!r} differ in size")
        self._flat_setup(list(layer.params[:2]))
        norm = layer.attrs.get("normalization") or None
        self.norm = dict(norm) if norm else None
        self.norm_op = self.norm.get("op") if self.norm else None
        if self.norm_op not in (None, "LayerNormalization", "RMSNormalization", *BATCH_STAT_NORMS):
            raise ConfigError(f"layer {layer.name!r}: normalization {self.norm_op!r} is not supported")
        axes = layer.attrs.get("scale_axes", layer.attrs.get("axes"))
        if axes is None:
            if self.norm_op in BATCH_STAT_NORMS:
                axes = (1,)
            else:  # numpy broadcasting: the scale's non-1 dims align with the trailing axes
                axes = tuple(i - len(self.S) for i, d in enumerate(self.S) if d != 1) or (-1,)
        self.scale_axes = tuple(int(a) for a in axes)
        shapes = input_shapes or [layer.attrs.get("input_shape")] * len(layer.uses)
        ranks = {len(s) for s in shapes if s is not None}
        self.rank = ranks.pop() if len(ranks) == 1 else layer.attrs.get("input_rank")
        self.norm_values: dict = {}
        self._example_axis_setup()

    def _example_axis_setup(self) -> None:
        """Time-major or merged rows (layer.attrs["example_axes"], passes/batch_axis): the
        block is "movable" (the back end moves the example axis to the front, which adds axes
        when it splits a merged one) when every use has the example axis before the scale's
        and the normalized axes; they are then counted from the end (rank None). BatchNorm-like
        statistics read [N, C, ...] themselves: left "leading"."""
        axes = self.layer.attrs.get("example_axes")
        if not axes or self.rank is None or self.norm_op in ("BatchNormalization", *BATCH_STAT_NORMS):
            return
        r = int(self.rank)
        first = [a % r for a in self.scale_axes]
        if self.norm_op is not None:
            first.append(int(self.norm.get("axis", -1)) % r)
        if any(i is None or o is None or tuple(i) != tuple(o) or i[0] >= min(first) for i, o in axes):
            return
        self.scale_axes = tuple(a % r - r for a in self.scale_axes)
        if self.norm is not None:
            self.norm["axis"] = int(self.norm.get("axis", -1)) % r - r
        self.rank = None
        self.example_rows = "movable"

    def _grad_flops(self, batch: int) -> int:
        shapes = self.input_shapes or [self.layer.attrs.get("input_shape")] * len(self.layer.uses)
        total = 0
        for s in shapes:
            n = prod(d if isinstance(d, int) and d > 0 else 1 for d in list(s or [1])[1:])
            total += 6 * batch * max(n, self.P // 2)
        return total

    # ---- x_hat
    def _emit_xhat(self, b, x, rank):
        """-> (x_hat, rank of x_hat, reshaped delta function)."""
        if self.norm_op is None:
            return x, rank, None
        eps = float(self.norm.get("epsilon", 1e-5))
        if self.norm_op in BATCH_STAT_NORMS and self._batch_stats():
            return self._emit_batch_xhat(b, x, eps)
        if self.norm_op == "BatchNormalization":
            x3 = b.reshape(x, [0, 0, -1])
            mean = b.reshape(self.norm["mean"], [-1, 1])
            var = b.reshape(self.norm["var"], [-1, 1])
            inv = b.op("Reciprocal", [b.op("Sqrt", [b.add(var, b.const(eps))])])
            return b.mul(b.sub(x3, mean), inv), 3, lambda d: b.reshape(d, [0, 0, -1])
        axis = int(self.norm.get("axis", -1))
        if self.norm_op == "RMSNormalization":  # opset >= 23: the model has the op
            return b.op("RMSNormalization", [x, b.const(np.ones(self.S))], axis=axis, epsilon=eps), rank, None
        if b.opset >= 17:
            ones = b.const(np.ones(self.S))
            zeros = b.const(np.zeros(self.S))
            xh = b.op("LayerNormalization", [x, ones, zeros], axis=axis, epsilon=eps)
            return xh, rank, None
        if axis >= 0 and rank is None:
            raise ConfigError(f"layer {self.layer.name!r}: LayerNormalization axis {axis} needs the input rank")
        axes = list(range(axis, 0)) if axis < 0 else list(range(axis, rank))
        mu = b.reduce_mean(x, axes, keepdims=True)
        xc = b.sub(x, mu)
        var = b.reduce_mean(b.mul(xc, xc), axes, keepdims=True)
        return b.div(xc, b.op("Sqrt", [b.add(var, b.const(eps))])), rank, None

    def _np_xhat(self, x):
        x = np.asarray(x, np.float64)
        if self.norm_op is None:
            return x, None
        eps = float(self.norm.get("epsilon", 1e-5))
        if self.norm_op in BATCH_STAT_NORMS and self._batch_stats():
            return self._np_batch_xhat(x, eps)
        if self.norm_op == "BatchNormalization":
            mean = np.asarray(self.norm_values["mean"], np.float64).reshape(-1, 1)
            var = np.asarray(self.norm_values["var"], np.float64).reshape(-1, 1)
            x3 = x.reshape(x.shape[0], x.shape[1], -1)
            return (x3 - mean) / np.sqrt(var + eps), lambda d: np.asarray(d, np.float64).reshape(x3.shape)
        axis = int(self.norm.get("axis", -1)) % x.ndim
        axes = tuple(range(axis, x.ndim))
        if self.norm_op == "RMSNormalization":
            return x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps), None
        mu = x.mean(axis=axes, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
        return (x - mu) / np.sqrt(var + eps), None

    # ---- x_hat from the statistics of the data itself (training-mode BatchNormalization,
    # InstanceNormalization, GroupNormalization): [N, K, L] with K the scale's size
    def _batch_stats(self) -> bool:
        return self.norm_op != "BatchNormalization" or bool(self.norm.get("training"))

    def _grouping(self):
        """(K of the grouped [N, K', L'] layout the statistics are taken in, stats axes, and
        whether x_hat stays grouped: GroupNormalization with per-group scale/shift)."""
        if self.norm_op == "BatchNormalization":
            return 0, [0, 2], False
        if self.norm_op == "InstanceNormalization":
            return 0, [2], False
        return int(self.norm["num_groups"]), [2], bool(self.norm.get("per_group"))

    def _emit_batch_xhat(self, b, x, eps):
        groups, axes, keep = self._grouping()
        xg = b.reshape(x, [0, groups, -1])
        mu = b.reduce_mean(xg, axes, keepdims=True)
        xc = b.sub(xg, mu)
        var = b.reduce_mean(b.mul(xc, xc), axes, keepdims=True)
        xh = b.mul(xc, b.op("Reciprocal", [b.op("Sqrt", [b.add(var, b.const(eps))])]))
        if groups and not keep:
            xh = b.reshape(xh, [0, prod(self.S), -1])
        k = groups if keep else 0
        return xh, 3, lambda d: b.reshape(d, [0, k, -1])

    def _np_batch_xhat(self, x, eps):
        groups, axes, keep = self._grouping()
        n = x.shape[0]
        xg = x.reshape(n, groups or x.shape[1], -1)
        mu = xg.mean(axis=tuple(axes), keepdims=True)
        var = ((xg - mu) ** 2).mean(axis=tuple(axes), keepdims=True)
        xh = (xg - mu) / np.sqrt(var + eps)
        if groups and not keep:
            xh = xh.reshape(n, prod(self.S), -1)
        return xh, lambda d: np.asarray(d, np.float64).reshape(xh.shape)

    def set_norm_values(self, **values) -> None:
        """Values of the BatchNormalization mean/var tensors, for the numpy twins."""
        self.norm_values = dict(values)

    def _emit_per_example(self, b, inputs, cotangents):
        out = []
        for s in range(len(cotangents[0])):
            per_use = []
            for u, x in enumerate(inputs):
                xh, rank, dfun = self._emit_xhat(b, x, self.rank)
                d = cotangents[u][s]
                if dfun is not None:
                    d = dfun(d)
                gs = self._emit_reduce(b, b.mul(xh, d), rank)
                if self.shift is not None:
                    gs = b.op("Concat", [gs, self._emit_reduce(b, d, rank)], axis=1)
                per_use.append(gs)
            out.append(emit_add_all(b, per_use))
        return out

    def _np_per_example(self, inputs, cotangents):
        out = []
        for s in range(len(cotangents[0])):
            total = 0.0
            for u, x in enumerate(inputs):
                xh, dfun = self._np_xhat(x)
                d = np.asarray(cotangents[u][s], np.float64)
                if dfun is not None:
                    d = dfun(d)
                g = self._np_reduce(xh * d)
                if self.shift is not None:
                    g = np.concatenate([g, self._np_reduce(d)], axis=1)
                total = total + g
            out.append(total)
        return out


@register_block
class ScaleShiftFull(ScaleShiftBlock):
    """Full Fisher over [scale, shift] from per-example gradients."""

    name = "full"
    full = True
    menu_rank = 0


@register_block
class ScaleShiftDiagonal(ScaleShiftBlock):
    """Diagonal Fisher over [scale, shift] (squared per-example gradients)."""

    name = "diagonal"
    full = False
    menu_rank = 10


# =====================================================================================
class GenericBlock(FlatBlock):
    layer_kinds = ("generic",)
    example_rows = "pooled"  # one pseudo-example (or the parameters' own per-example rows)

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._flat_setup(list(layer.params))

    def _groups(self, cotangents):
        n = len(self.layer.params)
        if len(cotangents) == n:
            return [[c] for c in cotangents]
        if n == 1:
            return [list(cotangents)]
        raise ConfigError(
            f"layer {self.layer.name!r}: generic block expects one cotangent list per parameter "
            f"({n}), got {len(cotangents)}"
        )

    def _emit_per_example(self, b, inputs, cotangents):
        groups = self._groups(cotangents)
        out = []
        for s in range(len(cotangents[0])):
            cols = [b.reshape(emit_add_all(b, [c[s] for c in grp]), [0, -1]) for grp in groups]
            out.append(cols[0] if len(cols) == 1 else b.op("Concat", cols, axis=1))
        return out

    def _np_per_example(self, inputs, cotangents):
        groups = self._groups(cotangents)
        out = []
        for s in range(len(cotangents[0])):
            cols = []
            for grp in groups:
                g = sum(np.asarray(c[s], np.float64) for c in grp)
                cols.append(g.reshape(g.shape[0], -1))
            out.append(np.concatenate(cols, axis=1))
        return out


@register_block
class GenericDiagonal(GenericBlock):
    """diag = mean over axis 0 of squared per-example gradients."""

    name = "diagonal"
    full = False
    menu_rank = 0


@register_block
class GenericFull(GenericBlock):
    """full = mean over axis 0 of outer products of the flattened per-example gradients."""

    name = "full"
    full = True
    menu_rank = 10
