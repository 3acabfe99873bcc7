"""Squared error: a normal distribution with fixed variance (the `variance` option)."""
from __future__ import annotations

import numpy as np

from kfac_compiler.losses.base import ElementwiseLoss, LossOption, positive_number, register_loss


@register_loss
class SquaredError(ElementwiseLoss):
    """Normal distribution with fixed variance: l = sum (z - y)^2 / (2 variance)."""

    kind = "squared_error"
    description = "normal with fixed variance, l = sum (z - y)^2 / (2 variance), targets shaped like the output"
    options = (LossOption("variance", 1.0, "variance of the normal predictive distribution", positive_number,
                          config_alias="loss_variance"),)
    lower_bound = 0.0  # a square
    noise = "normal"
    variance: float

    def emit_terms(self, b, z, y):
        d = b.sub(z, y)
        return b.scale(b.mul(d, d), 0.5 / self.variance)

    def emit_grad(self, b, z, y):
        return b.scale(b.sub(z, y), 1.0 / self.variance)

    def emit_sampled_grad(self, b, z, noise, z_shape):
        # y = z + sigma * eps  =>  dl/dz = (z - y) / variance = -eps / sigma
        return b.scale(noise, -1.0 / np.sqrt(self.variance))

    def emit_fisher_sqrt_times(self, b, z, v):
        return b.scale(v, 1.0 / np.sqrt(self.variance))

    def emit_fisher_times(self, b, z, v):
        return b.scale(v, 1.0 / self.variance)

    def np_terms(self, z, y):
        return 0.5 / self.variance * (z - y) ** 2

    def np_grad(self, z, y):
        return (z - y) / self.variance

    def np_fisher(self, z_n):
        return np.eye(z_n.size) / self.variance
