"""Parameter views: the layer's parameters (in their stored shapes) <-> the matrix or flat
vector a block's curvature acts on, in ONNX and in numpy.

`MatrixView` maps to the K-FAC matrix [W | b] (rows outputs, columns inputs then bias);
`FlatView` to the concatenation of the flattened parameters.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kfac_compiler.blocks.ops import emit_concat, prod
from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError


class MatrixView:
    """Parameters in their stored shapes <-> the K-FAC matrix [W | b] of shape
    [*batch, out, in (+1 with a bias)].

    weight -> (transpose, for 2-d weights stored [in, out]) -> reshape to `w_mat_shape`;
    bias -> reshape to [*batch, out, 1]; the two are concatenated on the last axis.
    """

    def __init__(
        self,
        weight: str,
        w_shape: Sequence[int],
        w_mat_shape: Sequence[int],
        transpose: bool = False,
        bias: str | None = None,
        b_shape: Sequence[int] | None = None,
    ) -> None:
        self.weight, self.w_shape, self.transpose = weight, tuple(w_shape), transpose
        self.w_mat_shape = tuple(w_mat_shape)
        self.bias, self.b_shape = bias, (tuple(b_shape) if b_shape is not None else None)
        if prod(self.w_shape) != prod(self.w_mat_shape):
            raise ConfigError(f"parameter {weight!r}: shape {self.w_shape} does not fit the matrix {self.w_mat_shape}")
        if bias is not None and prod(self.b_shape) != prod(self.w_mat_shape[:-1]):
            raise ConfigError(f"parameter {bias!r}: shape {self.b_shape} does not fit {self.w_mat_shape[:-1]}")

    @property
    def mat_shape(self) -> tuple[int, ...]:
        *lead, k = self.w_mat_shape
        return (*lead, k + (1 if self.bias else 0))

    @property
    def _pre_shape(self) -> tuple[int, ...]:
        return (self.w_shape[1], self.w_shape[0]) if self.transpose else self.w_shape

    # ONNX
    def emit_to(self, b: GraphBuilder, tensors: dict[str, str]) -> str:
        w = tensors[self.weight]
        if self.transpose:
            w = b.transpose(w, [1, 0])
        if self._pre_shape != self.w_mat_shape:
            w = b.reshape(w, self.w_mat_shape)
        if not self.bias:
            return w
        bb = b.reshape(tensors[self.bias], [*self.w_mat_shape[:-1], 1])
        return b.op("Concat", [w, bb], axis=-1)

    def emit_from(self, b: GraphBuilder, M: str) -> dict[str, str]:
        out = {}
        w = M
        if self.bias:
            w, bb = b.split(M, [self.w_mat_shape[-1], 1], axis=-1)
            out[self.bias] = b.reshape(bb, self.b_shape)
        if self._pre_shape != self.w_mat_shape:
            w = b.reshape(w, self._pre_shape)
        if self.transpose:
            w = b.transpose(w, [1, 0])
        out[self.weight] = w
        return out

    @property
    def stored_transposed(self) -> bool:
        """A 2-d weight stored [in, out] (as ONNX MatMul and Gemm(transB=0) read it): blocks
        can work on M^T = [W; b^T] as stored, without a transpose on the way in and out."""
        return self.transpose and len(self.w_mat_shape) == 2

    def emit_to_transposed(self, b: GraphBuilder, tensors: dict[str, str]) -> str:
        """M^T [in (+1), out] of a stored_transposed view."""
        w = tensors[self.weight]
        if not self.bias:
            return w
        return b.op("Concat", [w, b.reshape(tensors[self.bias], [1, self.w_mat_shape[0]])], axis=0)

    def emit_from_transposed(self, b: GraphBuilder, MT: str) -> dict[str, str]:
        if not self.bias:
            return {self.weight: MT}
        w, bb = b.split(MT, [self.w_mat_shape[1], 1], axis=0)
        return {self.weight: w, self.bias: b.reshape(bb, self.b_shape)}

    # numpy
    def np_to(self, arrays: dict) -> np.ndarray:
        w = np.asarray(arrays[self.weight])
        if self.transpose:
            w = w.T
        w = w.reshape(self.w_mat_shape)
        if not self.bias:
            return w
        return np.concatenate([w, np.asarray(arrays[self.bias]).reshape(*self.w_mat_shape[:-1], 1)], axis=-1)

    def np_from(self, M: np.ndarray) -> dict:
        out = {}
        k = self.w_mat_shape[-1]
        w = M[..., :k]
        if self.bias:
            out[self.bias] = M[..., k].reshape(self.b_shape)
        w = w.reshape(self._pre_shape)
        out[self.weight] = w.T if self.transpose else w
        return out


class FlatView:
    """Parameters <-> one flat vector (concatenation of the flattened parameters, in order)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [prod(s) for s in self.shapes]
        self.size = sum(self.sizes)

    def emit_to(self, b: GraphBuilder, tensors: dict[str, str]) -> str:
        return emit_concat(b, [b.reshape(tensors[n], [-1]) for n in self.names], axis=0)

    def emit_from(self, b: GraphBuilder, v: str) -> dict[str, str]:
        parts = b.split(v, self.sizes, axis=0) if len(self.names) > 1 else [v]
        return {n: b.reshape(p, list(s)) for n, p, s in zip(self.names, parts, self.shapes)}

    def np_to(self, arrays: dict) -> np.ndarray:
        return np.concatenate([np.asarray(arrays[n]).reshape(-1) for n in self.names])

    def np_from(self, v: np.ndarray) -> dict:
        out, start = {}, 0
        for n, s, k in zip(self.names, self.shapes, self.sizes):
            out[n] = v[start : start + k].reshape(s)
            start += k
        return out


__all__ = ["FlatView", "MatrixView"]
