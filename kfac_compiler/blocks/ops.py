"""Small ONNX helpers the blocks share (shapes, the homogeneous coordinate, sums).

Kept apart from base.py and _parts.py so that every block module, and the statistic type in
statistics.py, can import them without importing either.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

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
    """Append one slice filled with `value` at the end of `axis` (the homogeneous coordinate)."""
    shape = emit_shape_with(b, x, rank, axis, 1)
    filled = b.op("Expand", [b.const(np.full([1] * rank, value)), shape])
    return b.op("Concat", [x, filled], axis=axis)


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
