"""What a block's emit_statistics returns per factor: a tensor name, or a GramStatistic.

Its own module so that base.py (the contract names the type) and the back end can import it
without importing the block implementations.
"""
from __future__ import annotations

from dataclasses import dataclass

from kfac_compiler.blocks.ops import emit_gram
from kfac_compiler.builder import GraphBuilder


@dataclass(frozen=True)
class GramStatistic:
    """A factor statistic X^T X / count for rows X [m, k], left as its operands: the moving
    average folds the product, the division and its decay into one Gemm
    (backend.factors.factor_updates), instead of four more passes over the k x k factor.
    `emit` materializes it for every other consumer.

    `cols`: `rows` holds X^T [k, m] (a layer whose layout puts the factor's axis first, as a
    conv's patches and cotangents do), so that no transpose is needed either way.
    `count` is the statistic's own row count, read from its rows' shape: a per-graph batch size
    would be wrong wherever a layer's leading axis is not the batch (an attention projection
    on [T*N, D] rows, a [T, N, D] input; ViT's TorchScript export).
    `diag`: only the diagonal of X^T X, a diagonal factor [k] (one ReduceSumSquare)."""

    rows: str
    count: str  # scalar tensor
    cols: bool = False
    diag: bool = False

    def emit_square_sums(self, b: GraphBuilder) -> str:
        """The diagonal of X^T X [k] (for `diag`)."""
        return b.reduce("ReduceSumSquare", self.rows, [1 if self.cols else 0])

    def emit(self, b: GraphBuilder) -> str:
        if self.diag:
            return b.div(self.emit_square_sums(b), self.count)
        if self.cols:
            return b.div(b.matmul(self.rows, b.transpose(self.rows, [1, 0])), self.count)
        return b.div(emit_gram(b, self.rows), self.count)


def emit_statistic(b: GraphBuilder, stat: str | GramStatistic) -> str:
    """The tensor of an emit_statistics value (a tensor name or a GramStatistic)."""
    return stat.emit(b) if isinstance(stat, GramStatistic) else stat


__all__ = ["GramStatistic", "emit_statistic"]
