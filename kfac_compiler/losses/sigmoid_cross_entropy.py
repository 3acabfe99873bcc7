"""Sigmoid cross-entropy: an independent Bernoulli per output coordinate."""
from __future__ import annotations

import numpy as np

from kfac_compiler.errors import DataError
from kfac_compiler.losses.base import ElementwiseLoss, register_loss


@register_loss
class SigmoidCrossEntropy(ElementwiseLoss):
    """Independent Bernoulli per output coordinate; targets are probabilities in [0, 1]."""

    kind = "sigmoid_cross_entropy"
    description = "Bernoulli per output coordinate, targets are probabilities in [0, 1]"
    lower_bound = 0.0  # softplus(z) - y z >= H(y) >= 0 for y in [0, 1]
    link_op = "Sigmoid"  # applied to the scores it is given

    def check_target_values(self, y: np.ndarray, source: str) -> None:
        if np.min(y) < 0 or np.max(y) > 1:
            raise DataError(f"{source}: 'targets' must lie in [0, 1] for {self.kind}, got [{np.min(y)}, {np.max(y)}]")

    def emit_terms(self, b, z, y):
        # l = softplus(z) - y z, computed stably as max(z,0) - y z + log(1 + exp(-|z|))
        relu = b.op("Relu", [z])
        soft = b.op("Log", [b.add(b.const(1.0), b.op("Exp", [b.neg(b.op("Abs", [z]))]))])
        return b.add(b.sub(relu, b.mul(y, z)), soft)

    def emit_grad(self, b, z, y):
        return b.sub(b.op("Sigmoid", [z]), y)

    def emit_sampled_grad(self, b, z, noise, z_shape):
        p = b.op("Sigmoid", [z])
        sample = b.cast(b.op("Less", [noise, p]), b.float_type)
        return b.sub(p, sample)

    def _variance(self, b, z):
        p = b.op("Sigmoid", [z])
        return b.mul(p, b.sub(b.const(1.0), p))

    def emit_fisher_sqrt_times(self, b, z, v):
        return b.mul(b.op("Sqrt", [self._variance(b, z)]), v)

    def emit_fisher_times(self, b, z, v):
        return b.mul(self._variance(b, z), v)

    def np_terms(self, z, y):
        return np.maximum(z, 0) - y * z + np.log1p(np.exp(-np.abs(z)))

    def np_grad(self, z, y):
        return 1.0 / (1.0 + np.exp(-z)) - y

    def np_fisher(self, z_n):
        p = 1.0 / (1.0 + np.exp(-z_n.ravel()))
        return np.diag(p * (1 - p))
