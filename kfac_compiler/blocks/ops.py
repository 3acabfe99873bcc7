"""Small ONNX helpers the blocks share (shapes, the homogeneous coordinate, sums).

Kept apart from base.py and _parts.py so that every block module, and the statistic type in
statistics.py, can import them without importing either.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
from onnx import TensorProto

from kfac_compiler.builder import GraphBuilder


def prod(xs: Iterable) -> int:
    """Product of sizes as a Python int (1 for none)."""
    p = 1
    for x in xs:
        p *= int(x)
    return p


def emit_dim(b: GraphBuilder, x: str, axis: int) -> str:
    """x.shape[axis] as a float scalar (works for every opset >= 13)."""
    d = b.op("Gather", [b.op("Shape", [x]), b.const(np.asarray(axis, np.int64))], axis=0)
    return b.cast(d, b.float_type)


def emit_examples(b: GraphBuilder, examples: str | None, cotangents: list[list[str]]) -> str:
    """N, the divisor of a statistic summed over the rows of every example (G): `examples`
    when the back end passes it, else the cotangents' leading dim (N for batch-major rows;
    FisherBlock.divides_by_examples says why that is not enough)."""
    return examples if examples is not None else emit_dim(b, cotangents[0][0], 0)


def emit_batch_major(b: GraphBuilder, x: str, rank: int, axis: int, outer: int = 1, inner: int = 1) -> str:
    """x (rank `rank`) whose axis `axis` holds outer x N x inner entries (passes/batch_axis
    ExampleAxis), as [N, *the other axes] with the examples leading: a Transpose, after a
    Reshape splitting the merged axis into (outer, N, inner) when it is merged. Positions keep
    one order for every tensor of one layout, so a layer's input and output rows still pair."""
    if outer != 1 or inner != 1:
        shape = b.op("Shape", [x])
        parts = [b.op("Slice", [shape, b.ints([0]), b.ints([axis])]), b.ints([outer, -1, inner]),
                 b.op("Slice", [shape, b.ints([axis + 1]), b.ints([rank])])]
        x = b.reshape(x, b.op("Concat", parts, axis=0))
        rank, axis = rank + 2, axis + 1
    if axis == 0:
        return x
    return b.transpose(x, [axis] + [i for i in range(rank) if i != axis])


def emit_shape_with(b: GraphBuilder, x: str, rank: int, axis: int, size: int = 1) -> str:
    """Shape of x (rank `rank`) with dimension `axis` replaced by `size`."""
    axis = axis % rank
    shp = b.op("Shape", [x])
    pieces = []
    if axis > 0:
        pieces.append(b.op("Slice", [shp, b.ints([0]), b.ints([axis])]))
    pieces.append(b.ints([size]))
    if axis < rank - 1:
        pieces.append(b.op("Slice", [shp, b.ints([axis + 1]), b.ints([rank])]))
    return pieces[0] if len(pieces) == 1 else b.op("Concat", pieces, axis=0)


def emit_append_const(b: GraphBuilder, x: str, rank: int, axis: int, value: float) -> str:
    """Append one slice filled with `value` at the end of `axis` (the homogeneous coordinate):
    one Pad with that constant, where Shape, Slice, Concat and Expand arithmetic took six
    nodes per layer (Pad's pads and value are inputs from opset 11 on)."""
    axis = axis % rank
    if b.opset < 11:
        shape = emit_shape_with(b, x, rank, axis, 1)
        filled = b.op("Expand", [b.const(np.full([1] * rank, value)), shape])
        return b.op("Concat", [x, filled], axis=axis)
    pads = [0] * (2 * rank)
    pads[rank + axis] = 1
    return b.op("Pad", [x, b.ints(pads), b.const(np.asarray(value))], mode="constant")


def emit_concat(b: GraphBuilder, xs: Sequence[str], axis: int) -> str:
    """Concat, or the tensor itself when there is only one."""
    xs = list(xs)
    return xs[0] if len(xs) == 1 else b.op("Concat", xs, axis=axis)


def emit_gram(b: GraphBuilder, X: str, rank: int = 2) -> str:
    """X^T X for X [rows, k] (rank 2) or X X^T per batch for X [g, k, cols] (rank 3)."""
    if rank == 2:
        return b.matmul(b.transpose(X, [1, 0]), X)
    return b.matmul(X, b.transpose(X, [0, 2, 1]))


def emit_add_all(b: GraphBuilder, xs: Sequence[str]) -> str:
    """Sum of the tensors, added left to right."""
    xs = list(xs)
    out = xs[0]
    for x in xs[1:]:
        out = b.add(out, x)
    return out


__all__ = ["emit_add_all", "emit_append_const", "emit_concat", "emit_dim", "emit_gram", "emit_shape_with", "prod"]


def emit_live(b: GraphBuilder, deltas: Sequence[str], axes: Sequence[int]) -> str:
    """1.0 where some seed's cotangent is nonzero along `axes` (kept as size 1), else 0.0: the
    rows (positions) a weighted loss depends on. A row whose cotangent is 0 in every seed (a
    masked position, an example of weight 0) contributes nothing to the Fisher, so the blocks
    leave it out of their activation statistics (`masked=True`; kfac-jax masks repeated dense
    layers the same way)."""
    peaks = [b.reduce("ReduceMax", b.op("Abs", [d]), list(axes), keepdims=True) for d in deltas]
    peak = peaks[0] if len(peaks) == 1 else b.op("Max", peaks)
    return b.cast(b.op("Greater", [peak, b.const(0.0)]), b.float_type)


LiveCount = Callable[[str], str]
"""`masked` as a block with masks_rows may receive it: True, or a callable the number of live
rows passes through before it divides an activation statistic: a data-parallel step's
reduction point (backend/factors.py), which makes it the ranks' mean number, so that the
ranks' mean of (sum over their live rows) / (that number) is the global batch's mean over its
live rows, where ranks hold different numbers of them."""

SHARED_COUNT_FLOOR = 1e-9
"""The divisor's floor after a LiveCount: the ranks' mean number of live rows is 1/P at least
when any rank has one (a floor of 1 would then be wrong); when none has, every sum over live
rows is 0 and so is the statistic."""


def emit_live_count(b: GraphBuilder, live: str, masked: bool | LiveCount = True,
                    axes: Sequence[int] | None = None) -> str:
    """The number of live rows (summed over `axes`, None: all), at least 1 (a batch whose rows
    are all masked gives 0 / 1); with a LiveCount `masked`, that number passed through it."""
    total = b.reduce_sum(live, axes)
    if callable(masked):
        return b.op("Max", [masked(total), b.const(SHARED_COUNT_FLOOR)])
    return b.op("Max", [total, b.const(1.0)])


def np_live(deltas: Sequence, axes: Sequence[int]) -> np.ndarray:
    """numpy twin of emit_live (float64)."""
    peak = np.max([np.max(np.abs(np.asarray(d, np.float64)), axis=tuple(axes), keepdims=True) for d in deltas], axis=0)
    return (peak > 0).astype(np.float64)


def emit_token_counts(b: GraphBuilder, idx: str, vocab: int, live: str | None = None,
                      masked: bool | LiveCount = True) -> tuple[str, str]:
    """(counts [vocab] of the ids `idx` [rows], their total): how often each row of an
    embedding table is looked up, the diagonal of its one-hot input's second moment. `live`
    [rows] (0/1): count only those rows (a weighted loss's masked positions left out), their
    total by emit_live_count(live, masked). The OneHot of opsets < 16 takes the ids as int64:
    ONNX Runtime has no OneHot kernel for int32 ids (a Keras Embedding's) with an int64 depth."""
    ones = b.op("Expand", [b.const(np.ones(1)), b.op("Shape", [idx])]) if live is None else live
    if b.opset >= 16:
        counts = b.op("ScatterElements", [b.const(np.zeros(vocab)), idx, ones], axis=0, reduction="add", hint="counts")
    else:
        ids = b.cast(idx, TensorProto.INT64)
        onehot = b.op("OneHot", [ids, b.const(np.asarray([vocab], np.int64)), b.const(np.asarray([0.0, 1.0]))], axis=-1)
        counts = b.reduce_sum(onehot if live is None else b.mul(onehot, b.unsqueeze(live, [1])), [0])
    return counts, (emit_dim(b, idx, 0) if live is None else emit_live_count(b, live, masked))


def np_token_counts(idx: np.ndarray, vocab: int, live: np.ndarray | None = None) -> np.ndarray:
    """numpy twin of emit_token_counts: counts / total (float64)."""
    if live is None:
        return np.bincount(idx, minlength=vocab).astype(np.float64) / len(idx)
    live = np.reshape(live, -1)
    return np.bincount(idx, weights=live, minlength=vocab) / max(float(live.sum()), 1.0)
