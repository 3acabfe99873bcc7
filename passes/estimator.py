"""Curvature estimators: which cotangent seeds of the model output feed the factors.

Mirrors TensorFlow K-FAC's FisherEstimator modes. Every mode yields a list of per-example
cotangents of the model output z (shape of z), pre-scaled so that the factor estimate is the
SUM over seeds (the 1/num_samples weight is folded in as a sqrt on each seed):
- empirical: the gradient of the loss at the data targets (one seed);
- gradients (default, true Fisher): targets sampled from the model's predictive distribution;
- curvature_prop / curvature_prop_GGN: B v with random +-1 vectors v, F_z = B B^T;
- exact / exact_GGN: B e_k for every output coordinate k (exact Fisher/GGN factor; only for
  small outputs).
Every registered loss has its Hessian w.r.t. z equal to the Fisher F_z (a canonical link:
the loss contract, kfac_compiler.losses.base), so each *_GGN mode computes the same seeds as
its Fisher twin.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.contract import ESTIMATION_MODES as MODES
from kfac_compiler.errors import ConfigError
from kfac_compiler.losses import Loss

MAX_EXACT_COORDINATES = 512


@dataclass(frozen=True)
class NoiseSpec:
    """Host noise a mode needs: `count` tensors (of noise_shape's shape)."""

    count: int
    distribution: str  # "uniform" | "normal"


def check_mode(mode: str, num_samples: int) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown estimation mode {mode!r}; choose one of {', '.join(MODES)}")
    if int(num_samples) < 1:
        raise ConfigError(f"num_samples must be >= 1, got {num_samples}")


def noise_spec(mode: str, num_samples: int, loss: Loss) -> NoiseSpec:
    check_mode(mode, num_samples)
    if mode == "gradients":
        return NoiseSpec(num_samples, loss.noise)
    if mode.startswith("curvature_prop"):
        return NoiseSpec(num_samples, "uniform")
    return NoiseSpec(0, "uniform")


def noise_shape(mode: str, loss: Loss, z_shape: tuple) -> tuple:
    """Each noise tensor's shape: the loss's own for sampled targets (softmax cross-entropy:
    one uniform per row), one uniform per output coordinate for curvature_prop's Rademacher
    signs (B v needs v shaped like z)."""
    return tuple(loss.noise_shape(z_shape)) if mode == "gradients" else tuple(z_shape)


def emit_seeds(
    b: GraphBuilder,
    loss: Loss,
    z: str,
    z_shape: tuple,
    mode: str,
    num_samples: int,
    data_grad: str,
    noise: list[str],
) -> list[str]:
    """Per-example cotangent seeds of z for `mode` (see module docstring)."""
    check_mode(mode, num_samples)
    if mode == "empirical":
        return [data_grad]
    weight = 1.0 / np.sqrt(num_samples)
    if mode == "gradients":
        return [b.scale(loss.emit_sampled_grad(b, z, u, z_shape), weight) for u in noise]
    if mode.startswith("curvature_prop"):
        seeds = []
        for u in noise:
            rademacher = b.op("Sign", [b.sub(u, b.const(0.5))])
            seeds.append(b.scale(loss.emit_fisher_sqrt_times(b, z, rademacher), weight))
        return seeds
    # exact / exact_GGN: one seed per output coordinate of an example
    dims = tuple(z_shape[1:])
    if any(not isinstance(d, int) for d in dims):
        raise ConfigError(f"exact estimation needs a static output shape, got {list(z_shape)} for {z!r}")
    count = int(np.prod(dims)) if dims else 1
    if count > MAX_EXACT_COORDINATES:
        raise ConfigError(
            f"exact estimation needs one backward pass per output coordinate ({count} > "
            f"{MAX_EXACT_COORDINATES}); use mode 'gradients' or 'curvature_prop'"
        )
    seeds = []
    z_dims = b.shape(z)
    for k in range(count):
        e_k = np.zeros((1,) + dims)
        e_k.reshape(-1)[k] = 1.0
        # e_k on every example's row: a loss whose F^1/2 does not read z (squared error:
        # e_k / sqrt(variance)) gave one [1, ...] row, and the blocks' G 1/N of its value
        unit = b.op("Expand", [b.const(e_k, hint="unit"), z_dims])
        seeds.append(loss.emit_fisher_sqrt_times(b, z, unit))
    return seeds
