"""A loss added from outside the package: Poisson regression with the log link.

The worked example of docs/extending_losses.md. Importing this module registers the loss;
then `kfac_compiler.compile(model, loss="poisson", output="logits")` trains a model whose
output z is the log rate of independent Poisson counts, one per output coordinate:

    l(z, y) = sum exp(z) - y z + y log y - y    (half the Poisson deviance: -log p(y | z)
                                                 minus its minimum over z, so l >= 0)
    dl/dz   = exp(z) - y
    F_z     = diag(exp(z))                      (= the Hessian: the log link is canonical)
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import DataError
from kfac_compiler.losses import ElementwiseLoss, LossOption, positive_int, register_loss
from kfac_compiler.models.data import MAX_PIXEL

_TINY = 1e-30  # floor of y inside log y, so that 0 log 0 = 0


@register_loss
class PoissonLoss(ElementwiseLoss):
    """Independent Poisson counts with rate exp(z); targets are counts (any y >= 0 is accepted)."""

    kind = "poisson"
    description = "Poisson per output coordinate with log rate z (half the deviance), targets are counts >= 0"
    options = (LossOption("max_count", 64, "largest count the sampler draws (larger draws are clipped to it)",
                          positive_int),)
    lower_bound = 0.0  # the deviance is 0 where exp(z) = y
    metrics = ("mean_absolute_error",)
    max_count: int

    # -- targets
    def check_target_values(self, y: np.ndarray, source: str) -> None:
        if np.min(y) < 0:
            raise DataError(f"{source}: 'targets' must be counts >= 0 for {self.kind}, got a minimum of {np.min(y)}")

    def digits_targets(self, pixels: np.ndarray, labels: np.ndarray, output_dims: list[Any] | None) -> np.ndarray:
        """The pixel intensities as counts 0..16 (the digits data set's raw values)."""
        return np.round(super().digits_targets(pixels, labels, output_dims) * MAX_PIXEL)

    # -- evaluation
    def metric_totals(self, outputs: np.ndarray, targets: np.ndarray,
                      weights: np.ndarray | None = None) -> dict[str, tuple[float, float]]:
        """mean_absolute_error: |predicted mean exp(z) - y| over every output coordinate
        (weighted: sum w |.| / sum w)."""
        err = np.abs(np.exp(outputs) - targets)
        if weights is None:
            return {"mean_absolute_error": (float(np.sum(err)), int(targets.size))}
        w = np.broadcast_to(np.asarray(weights, np.float64), err.shape)  # weight_shape: the targets'
        return {"mean_absolute_error": (float(np.sum(w * err)), float(np.sum(w)))}

    # -- ONNX emitters
    def emit_terms(self, b: GraphBuilder, z: str, y: str) -> str:
        # exp(z) - y + y (log y - z), with 0 log 0 = 0 (y is floored inside the log only)
        log_y = b.op("Log", [b.op("Max", [y, b.const(_TINY)])])
        return b.add(b.sub(b.op("Exp", [z]), y), b.mul(y, b.sub(log_y, z)))

    def emit_grad(self, b, z, y):
        return b.sub(b.op("Exp", [z]), y)

    def emit_sampled_grad(self, b, z, noise, z_shape):
        """Inverse-CDF sampling with one uniform u per coordinate: the draw is the number of
        counts k < max_count whose CDF lies below u, from log p_k = k z - exp(z) - log k!."""
        counts = np.arange(self.max_count, dtype=np.float64)
        zk = b.unsqueeze(z, [-1])
        log_p = b.sub(b.sub(b.mul(zk, b.const(counts, hint="counts")), b.op("Exp", [zk])),
                      b.const([math.lgamma(k + 1.0) for k in counts], hint="log_factorial"))
        cdf = b.op("CumSum", [b.op("Exp", [log_p]), b.const(np.array(-1, np.int64))])
        below = b.cast(b.op("Less", [cdf, b.unsqueeze(noise, [-1])]), b.float_type)
        return b.sub(b.op("Exp", [z]), b.reduce_sum(below, [-1], keepdims=False))

    def emit_fisher_sqrt_times(self, b, z, v):
        return b.mul(b.op("Exp", [b.scale(z, 0.5)]), v)

    def emit_fisher_times(self, b, z, v):
        return b.mul(b.op("Exp", [z]), v)

    # -- numpy twins
    def np_terms(self, z, y):
        return np.exp(z) - y * z + y * np.log(np.maximum(y, _TINY)) - y

    def np_grad(self, z, y):
        return np.exp(z) - y

    def np_fisher(self, z_n):
        return np.diag(np.exp(z_n.ravel()))
