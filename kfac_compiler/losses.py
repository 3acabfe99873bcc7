"""Losses as predictive distributions: one class per loss kind, registered by name.

A loss is L = 1/N sum_n w_n l_n(z_n, y_n) over the batch (mean reduction; optional per-example
weights or masks w_n), with l_n summed over every non-batch coordinate of the output z (for
softmax cross-entropy the class axis is the LAST axis of z; targets hold class indices).
Each class emits, in ONNX ops through a GraphBuilder:
- the loss and the per-example gradient dl_n/dz_n for given targets (the data seed);
- a target sampled from the model's predictive distribution (noise comes from the host,
  so that runs are reproducible and checkpointable) and its per-example gradient;
- products with B where F_z = B B^T is the Fisher of the predictive distribution w.r.t. z,
  and with F_z itself. For these three losses (canonical links) the loss Hessian w.r.t. z
  equals F_z, so Fisher and GGN estimators coincide.
Numpy twins (`np_*`) are the independent truth for tests.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
from onnx import TensorProto

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError

LOSSES: dict[str, type["Loss"]] = {}


def register_loss(cls: type["Loss"]) -> type["Loss"]:
    LOSSES[cls.kind] = cls
    return cls


def make_loss(kind: str, **options) -> "Loss":
    cls = LOSSES.get(kind)
    if cls is None:
        raise ConfigError(f"unknown loss {kind!r}; choose one of {', '.join(sorted(LOSSES))}")
    return cls(**options)


class Loss:
    kind: ClassVar[str] = ""
    noise: ClassVar[str] = "uniform"  # distribution of the host noise used for sampling
    # A value no l_n goes below (None: unknown). The K-FAC step scales down an update whose
    # quadratic model predicts a decrease beyond it (optimizers.KfacConfig).
    lower_bound: ClassVar[float | None] = None

    def __init__(self, **options) -> None:
        if options:
            raise ConfigError(f"loss {self.kind!r} takes no option {', '.join(options)}")

    # -- shapes and types
    def target_type(self) -> int:
        return TensorProto.FLOAT

    def target_shape(self, output_shape: tuple) -> tuple:
        return tuple(output_shape)

    def noise_shape(self, output_shape: tuple) -> tuple:
        return tuple(output_shape)

    # -- ONNX emitters (z: model output, y: targets)
    def emit_per_example_loss_sum(self, b: GraphBuilder, z: str, y: str) -> str:
        """sum_n l_n as a scalar."""
        raise NotImplementedError

    def emit_grad(self, b: GraphBuilder, z: str, y: str) -> str:
        """dl_n/dz_n, same shape as z."""
        raise NotImplementedError

    def emit_sampled_grad(self, b: GraphBuilder, z: str, noise: str) -> str:
        """dl_n/dz_n for a target drawn from p(y|z) using host noise of noise_shape."""
        raise NotImplementedError

    def emit_fisher_sqrt_times(self, b: GraphBuilder, z: str, v: str) -> str:
        """B v with F_z = B B^T (per example, v has the shape of z)."""
        raise NotImplementedError

    def emit_fisher_times(self, b: GraphBuilder, z: str, v: str) -> str:
        """F_z v (per example)."""
        raise NotImplementedError

    def emit_loss(self, b: GraphBuilder, z: str, y: str, weights: str | None = None) -> str:
        """Mean loss over the batch (weights: optional per-example weights/mask [N])."""
        if weights is None:
            total = self.emit_per_example_loss_sum(b, z, y)
            return b.div(total, b.batch_size(z))
        per = self.emit_per_example(b, z, y)
        return b.div(b.reduce_sum(b.mul(per, weights), None), b.batch_size(z))

    def emit_per_example(self, b: GraphBuilder, z: str, y: str) -> str:
        """l_n as a [N] tensor."""
        raise NotImplementedError

    # -- numpy twins (float64)
    def np_per_example(self, z: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def np_grad(self, z: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def np_fisher(self, z_n: np.ndarray) -> np.ndarray:
        """F_z for ONE example as a matrix over its flattened output coordinates."""
        raise NotImplementedError


def _sum_all_but_batch(b: GraphBuilder, x: str, rank: int) -> str:
    return b.reduce_sum(x, list(range(1, rank)), keepdims=False) if rank > 1 else x


@register_loss
class SoftmaxCrossEntropy(Loss):
    """Categorical distribution over the last axis of z; targets are int64 class indices."""

    kind = "softmax_cross_entropy"
    lower_bound = 0.0  # -log p >= 0

    def target_type(self) -> int:
        return TensorProto.INT64

    def target_shape(self, output_shape: tuple) -> tuple:
        return tuple(output_shape[:-1])

    def _onehot(self, b: GraphBuilder, z: str, y: str) -> str:
        depth = b.op("Shape", [z], start=-1)
        values = b.const(np.array([0.0, 1.0]))
        return b.op("OneHot", [y, depth, values], axis=-1)

    def emit_per_example_loss_sum(self, b, z, y):
        logp = b.op("LogSoftmax", [z], axis=-1)
        return b.neg(b.reduce_sum(b.mul(logp, self._onehot(b, z, y)), None))

    def emit_per_example(self, b, z, y):
        logp = b.op("LogSoftmax", [z], axis=-1)
        picked = b.mul(logp, self._onehot(b, z, y))
        return b.neg(_reduce_rows(b, picked))

    def emit_grad(self, b, z, y):
        return b.sub(b.op("Softmax", [z], axis=-1), self._onehot(b, z, y))

    def emit_sampled_grad(self, b, z, noise):
        # Gumbel-max: y = argmax(z + g), g = -log(-log u); one-hot via equality with the max.
        g = b.neg(b.op("Log", [b.neg(b.op("Log", [noise]))]))
        perturbed = b.add(z, g)
        top = b.reduce("ReduceMax", perturbed, [-1], keepdims=True)
        onehot = b.cast(b.op("Equal", [perturbed, top]), b.float_type)
        return b.sub(b.op("Softmax", [z], axis=-1), onehot)

    def emit_fisher_sqrt_times(self, b, z, v):
        p = b.op("Softmax", [z], axis=-1)
        sp = b.op("Sqrt", [p])
        inner = b.reduce_sum(b.mul(sp, v), [-1], keepdims=True)
        return b.sub(b.mul(sp, v), b.mul(p, inner))

    def emit_fisher_times(self, b, z, v):
        p = b.op("Softmax", [z], axis=-1)
        pv = b.mul(p, v)
        return b.sub(pv, b.mul(p, b.reduce_sum(pv, [-1], keepdims=True)))

    @staticmethod
    def _np_softmax(z):
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def np_per_example(self, z, y):
        logp = np.log(self._np_softmax(z))
        picked = np.take_along_axis(logp, y[..., None].astype(np.int64), axis=-1)[..., 0]
        return -picked.reshape(len(z), -1).sum(axis=1)

    def np_grad(self, z, y):
        onehot = np.eye(z.shape[-1])[y]
        return self._np_softmax(z) - onehot

    def np_fisher(self, z_n):
        p = self._np_softmax(z_n).reshape(-1, z_n.shape[-1])
        blocks = [np.diag(row) - np.outer(row, row) for row in p]
        out = np.zeros((p.size, p.size))
        k = z_n.shape[-1]
        for i, blk in enumerate(blocks):
            out[i * k:(i + 1) * k, i * k:(i + 1) * k] = blk
        return out


def _reduce_rows(b: GraphBuilder, x: str) -> str:
    """Sum every axis but the first: [N, ...] -> [N]."""
    flat = b.op("Flatten", [x], axis=1)
    return b.reduce_sum(flat, [1], keepdims=False)


@register_loss
class SigmoidCrossEntropy(Loss):
    """Independent Bernoulli per output coordinate; targets are probabilities in [0, 1]."""

    kind = "sigmoid_cross_entropy"
    lower_bound = 0.0  # softplus(z) - y z >= H(y) >= 0 for y in [0, 1]

    def _terms(self, b, z, y):
        # l = softplus(z) - y z, computed stably as max(z,0) - y z + log(1 + exp(-|z|))
        relu = b.op("Relu", [z])
        soft = b.op("Log", [b.add(b.const(1.0), b.op("Exp", [b.neg(b.op("Abs", [z]))]))])
        return b.add(b.sub(relu, b.mul(y, z)), soft)

    def emit_per_example_loss_sum(self, b, z, y):
        return b.reduce_sum(self._terms(b, z, y), None)

    def emit_per_example(self, b, z, y):
        return _reduce_rows(b, self._terms(b, z, y))

    def emit_grad(self, b, z, y):
        return b.sub(b.op("Sigmoid", [z]), y)

    def emit_sampled_grad(self, b, z, noise):
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

    def np_per_example(self, z, y):
        terms = np.maximum(z, 0) - y * z + np.log1p(np.exp(-np.abs(z)))
        return terms.reshape(len(z), -1).sum(axis=1)

    def np_grad(self, z, y):
        return 1.0 / (1.0 + np.exp(-z)) - y

    def np_fisher(self, z_n):
        p = 1.0 / (1.0 + np.exp(-z_n.ravel()))
        return np.diag(p * (1 - p))


@register_loss
class SquaredError(Loss):
    """Normal distribution with fixed variance: l = sum (z - y)^2 / (2 variance)."""

    kind = "squared_error"
    lower_bound = 0.0  # a square
    noise = "normal"

    def __init__(self, variance: float = 1.0) -> None:
        if not variance > 0:
            raise ConfigError(f"squared_error variance must be > 0, got {variance}")
        self.variance = float(variance)

    def _terms(self, b, z, y):
        d = b.sub(z, y)
        return b.scale(b.mul(d, d), 0.5 / self.variance)

    def emit_per_example_loss_sum(self, b, z, y):
        return b.reduce_sum(self._terms(b, z, y), None)

    def emit_per_example(self, b, z, y):
        return _reduce_rows(b, self._terms(b, z, y))

    def emit_grad(self, b, z, y):
        return b.scale(b.sub(z, y), 1.0 / self.variance)

    def emit_sampled_grad(self, b, z, noise):
        # y = z + sigma * eps  =>  dl/dz = (z - y) / variance = -eps / sigma
        return b.scale(noise, -1.0 / np.sqrt(self.variance))

    def emit_fisher_sqrt_times(self, b, z, v):
        return b.scale(v, 1.0 / np.sqrt(self.variance))

    def emit_fisher_times(self, b, z, v):
        return b.scale(v, 1.0 / self.variance)

    def np_per_example(self, z, y):
        return (0.5 / self.variance * (z - y) ** 2).reshape(len(z), -1).sum(axis=1)

    def np_grad(self, z, y):
        return (z - y) / self.variance

    def np_fisher(self, z_n):
        return np.eye(z_n.size) / self.variance
