"""Blocks of a parameter broadcast over the batch (layer kind "broadcast"): a position table
added to [N, T, D] activations, a class token expanded to [N, 1, D], a bias added alone, or a
table looked up with batch-less indices (constant, or computed from the sequence length) and
then added.

The parameter reaches use.output (the Add's or the Expand's output, [N, *out]) only by
broadcasting, so its per-example gradient is exact: the output's cotangent at example n summed
over the axes outside attrs["scale_axes"] (where the broadcast tensor has size 1 or is
missing: AxisSum, as for the shift of a scale_and_shift), and with attrs["indexed"] (a Gather;
use.input holds its K indices) added into the table's rows:
  g[n] = onehot(indices)[P_rows, K] @ reduce(delta[n]).reshape(K, R)    (rows never read: 0)
Several uses add their gradients; M = N. "diagonal" (the default: a position table can have
T*D = 150k entries) and "full" are FlatBlock's statistics of those gradients.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from kfac_compiler.blocks.flat import AxisSum, FlatBlock
from kfac_compiler.blocks.ops import emit_add_all, prod
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.errors import ConfigError


class BroadcastBlock(AxisSum, FlatBlock):
    """Full or diagonal Fisher of one broadcast parameter from its exact per-example gradients."""

    layer_kinds = ("broadcast",)

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        param = layer.params[0]
        shape = tuple(int(d) for d in param_shapes[param])
        self._flat_setup([param])
        self.indexed = bool(layer.attrs.get("indexed"))
        self.rows, self.rest = (shape[0], prod(shape[1:])) if self.indexed else (1, self.P)
        self.S = (-1,) if self.indexed else shape  # indexed: K * rest entries, K known at run time
        self.rank = layer.attrs.get("output_rank")
        axes = layer.attrs.get("scale_axes")
        if axes is None and not self.indexed:  # numpy broadcasting: the non-1 dims align with the trailing axes
            axes = tuple(i - len(shape) for i, d in enumerate(shape) if d != 1)
        if axes is None or (self.rank is None and (self.indexed or not axes)):
            raise ConfigError(f"layer {layer.name!r}: a broadcast layer needs attrs 'scale_axes' and 'output_rank'")
        self.scale_axes = tuple(int(a) for a in axes)
        self._example_axis_setup()

    moves_inputs = False  # only the output's cotangent is read (the input: indices, or unused)

    def _example_axis_setup(self) -> None:
        """Time-major or merged output rows (layer.attrs["example_axes"], passes/batch_axis):
        "movable" when every use's output has the same example axis k before the scale axes;
        the back end then moves it to the front (ops.emit_batch_major: two more axes when it
        splits a merged one), and the scale axes and rank follow."""
        axes = self.layer.attrs.get("example_axes")
        if not axes or self.rank is None:
            return
        r = int(self.rank)
        outs = {tuple(o) if o is not None else None for _, o in axes}
        if len(outs) != 1 or None in outs:
            return
        k, outer, inner = next(iter(outs))  # type: ignore[misc]
        pos = [a % r for a in self.scale_axes]
        if k >= min(pos):
            return
        extra = 2 if (outer, inner) != (1, 1) else 0
        self.scale_axes = tuple(a + extra for a in pos)
        self.rank = r + extra
        self.example_rows = "movable"

    def _grad_flops(self, batch: int) -> int:
        scatter = 2 * self.rows * self.P if self.indexed else 0
        return batch * (2 * self.P + scatter) * len(self.layer.uses)

    def _emit_rows(self, b, idx: str) -> str:
        """[P_rows, K] one-hot of the K indices (negative ones count from the end)."""
        flat = b.op("Cast", [b.reshape(idx, [-1])], to=TensorProto.INT64)
        flat = b.op("Mod", [flat, b.const(np.array(self.rows, np.int64))])
        rows = b.const(np.arange(self.rows, dtype=np.int64).reshape(-1, 1))
        return b.op("Cast", [b.op("Equal", [rows, b.unsqueeze(flat, [0])])], to=b.float_type)

    def _emit_per_example(self, b, inputs, cotangents):
        onehots = [self._emit_rows(b, x) for x in inputs] if self.indexed else []
        out = []
        for s in range(len(cotangents[0])):
            per_use = []
            for u, cots in enumerate(cotangents):
                g = self._emit_reduce(b, cots[s], self.rank)
                if self.indexed:  # [N, K*R] -> [N, P_rows, R] -> [N, P]
                    g = b.reshape(b.matmul(onehots[u], b.reshape(g, [0, -1, self.rest])), [0, self.P])
                per_use.append(g)
            out.append(emit_add_all(b, per_use))
        return out

    def _np_per_example(self, inputs, cotangents):
        out = []
        for s in range(len(cotangents[0])):
            total = 0.0
            for u, cots in enumerate(cotangents):
                g = self._np_reduce(np.asarray(cots[s], np.float64))
                if self.indexed:
                    idx = np.asarray(inputs[u]).reshape(-1) % self.rows
                    onehot = (np.arange(self.rows)[:, None] == idx[None, :]).astype(np.float64)
                    g = np.matmul(onehot, g.reshape(g.shape[0], -1, self.rest)).reshape(g.shape[0], self.P)
                total = total + g
            out.append(total)
        return out


@register_block
class BroadcastDiagonal(BroadcastBlock):
    """Diagonal Fisher of a broadcast parameter (squared exact per-example gradients)."""

    name = "diagonal"
    full = False
    menu_rank = 0


@register_block
class BroadcastFull(BroadcastBlock):
    """Full Fisher of a broadcast parameter (outer products of exact per-example gradients)."""

    name = "full"
    full = True
    menu_rank = 10
