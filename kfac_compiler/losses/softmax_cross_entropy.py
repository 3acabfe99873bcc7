"""Softmax cross-entropy: a categorical distribution over the LAST axis of the output."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from onnx import TensorProto

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import DataError
from kfac_compiler.losses.base import Loss, LossOption, is_static, optional_int, reduce_rows, register_loss


def integer(text: str) -> int:
    """The command line's --ignore-index value (argparse names this function in its error)."""
    return int(text.strip())


# From this many classes the sampled targets are drawn by inverse CDF from one uniform per row;
# below, by Gumbel-max from one per class (SoftmaxCrossEntropy.noise_shape says why)
PER_ROW_NOISE_CLASSES = 1024


def per_row_noise(output_shape: Sequence[Any]) -> bool:
    """Whether targets for an output of this shape are sampled from one uniform per row (inverse
    CDF): from PER_ROW_NOISE_CLASSES classes on, or when the class count is unknown."""
    classes = output_shape[-1] if output_shape else None
    return not (is_static(classes) and int(classes) < PER_ROW_NOISE_CLASSES)


@register_loss
class SoftmaxCrossEntropy(Loss):
    """Categorical distribution over the last axis of z; targets are int64 class indices.

    ignore_index (torch's): a target equal to it counts for nothing, in the loss, the
    gradients, the curvature and the accuracy, and the loss is the mean over the targets
    that count (torch's reduction="mean"): the runtime turns the targets into a 0/1 mask m
    and weights w = m N / sum(m) over the batch it is given (mask_targets; the graphs never
    see the ignored value), so L = 1/N sum w l = sum_kept l / #kept."""

    kind = "softmax_cross_entropy"
    description = "categorical over the output's last axis, targets are class indices"
    options = (LossOption("ignore_index", None, "targets equal to it count for nothing and the loss is the mean "
                          "over the others (torch's cross_entropy ignore_index, e.g. -100)", optional_int,
                          parse=integer),)
    lower_bound = 0.0  # -log p >= 0
    link_op = "Softmax"  # applied to the scores it is given
    metrics = ("accuracy",)
    ignore_index: int | None

    def summary(self) -> str:
        return self.kind if self.ignore_index is None else f"{self.kind} (ignore_index {self.ignore_index})"

    # -- targets
    def target_type(self) -> int:
        return TensorProto.INT64

    def target_shape(self, output_shape: tuple) -> tuple:
        return tuple(output_shape[:-1])

    def target_dtype(self, output_dtype: str) -> str:
        return "int64"

    def weight_shape(self, target_shape: tuple) -> tuple:
        return tuple(target_shape)  # a weight per target (token, pixel, example)

    def output_problem(self, output_shape: Sequence[Any]) -> str | None:
        return f"{self.kind} needs [N, ..., classes]" if len(output_shape) < 2 else None

    def check_targets(self, y: np.ndarray, output_dims: list[Any] | None, source: str) -> np.ndarray:
        if y.dtype.kind == "f" and not np.all(y == np.round(y)):
            raise DataError(f"{source}: 'targets' must be integer class indices for {self.kind}")
        classes = output_dims[-1] if output_dims and is_static(output_dims[-1]) else None
        if output_dims is not None and y.ndim != len(output_dims) - 1:
            raise DataError(f"{source}: 'targets' has shape {list(y.shape)}; {self.kind} expects class "
                            f"indices shaped like the output {output_dims} without its last axis")
        labels = y if self.ignore_index is None else y[y != self.ignore_index]
        if not labels.size:
            return y.astype(np.int64)
        lo, hi = int(labels.min()), int(labels.max())  # the methods, not np.min's wrapper: every step checks
        if lo < 0 or (classes is not None and hi >= classes):
            ignored = "" if self.ignore_index is None else f" besides ignore_index {self.ignore_index}"
            raise DataError(f"{source}: 'targets' has labels in [{lo}, {hi}]{ignored}; the model has {classes} "
                            f"classes (0..{(classes or 1) - 1})")
        return y.astype(np.int64)

    @property
    def masks_targets(self) -> bool:
        return self.ignore_index is not None

    def mask_targets(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Ignored targets become class 0 (any class: their weight is 0) under a 0/1 mask."""
        if self.ignore_index is None:
            return y, None
        keep = y != self.ignore_index
        return np.where(keep, y, 0).astype(y.dtype), keep.astype(np.float32)

    def digits_targets(self, pixels: np.ndarray, labels: np.ndarray, output_dims: list[Any] | None) -> np.ndarray:
        return labels

    # -- evaluation
    def metric_totals(self, outputs: np.ndarray, targets: np.ndarray,
                      weights: np.ndarray | None = None) -> dict[str, tuple[float, float]]:
        """accuracy: the fraction of targets (examples, or positions of sequence outputs)
        whose class has the largest score; weighted: sum w [correct] / sum w (a 0/1 mask:
        over the targets that count)."""
        correct = np.argmax(outputs, axis=-1) == targets
        if weights is None:
            return {"accuracy": (int(np.sum(correct)), int(targets.size))}
        w = np.broadcast_to(np.asarray(weights, np.float64), correct.shape)
        return {"accuracy": (float(np.sum(w * correct)), float(np.sum(w)))}

    # -- ONNX emitters
    def _picked(self, b: GraphBuilder, x: str, y: str) -> str:
        """x's entry at each row's target class, [..., 1]: a gather, where multiplying by the
        one-hot targets and summing made two output-sized tensors more."""
        return b.op("GatherElements", [x, b.unsqueeze(y, [-1])], axis=-1)

    def emit_per_example_loss_sum(self, b, z, y):
        return b.neg(b.reduce_sum(self._picked(b, b.op("LogSoftmax", [z], axis=-1), y), None))

    def emit_per_example(self, b, z, y):
        return b.neg(reduce_rows(b, self._picked(b, b.op("LogSoftmax", [z], axis=-1), y)))

    def emit_per_position(self, b, z, y):
        picked = self._picked(b, b.op("LogSoftmax", [z], axis=-1), y)
        return b.neg(b.op("Squeeze", [picked, b.ints([-1])]))

    def noise_shape(self, output_shape: tuple) -> tuple:
        """From PER_ROW_NOISE_CLASSES classes (or an unknown count) one uniform per row,
        sampled by inverse CDF: at a vocabulary's size one uniform per class is a logits-sized
        array (51 MB for 8 x 32 x 50,257) held through the step, with its Gumbel chain beside
        it. Below, one uniform per class for Gumbel-max: the class it picks moves ~4x less
        often than the inverse CDF's when rounding moves the logits (1e-5 relative: 7e-6
        against 3e-5 of the draws, 10 classes), so data-parallel runs, whose logits differ
        from one process's in the last bits, draw what one process draws."""
        return (*output_shape[:-1], 1) if per_row_noise(output_shape) else tuple(output_shape)

    @staticmethod
    def _minus_onehot(b: GraphBuilder, p: str, at: str) -> str:
        """p - onehot(at) for class indices at [..., 1]: p - 1 written at them (p - 0 = p
        elsewhere, bit for bit), one output-sized tensor besides p."""
        picked = b.op("GatherElements", [p, at], axis=-1)
        return b.op("ScatterElements", [p, at, b.sub(picked, b.const(1.0))], axis=-1)

    def emit_grad(self, b, z, y):
        return self._minus_onehot(b, b.op("Softmax", [z], axis=-1), b.unsqueeze(y, [-1]))

    def emit_sampled_grad(self, b, z, noise, z_shape):
        """p - onehot(y) for y sampled from p: by inverse CDF from one uniform per row, or by
        Gumbel-max from one per class, as noise_shape chose for z's shape."""
        if not per_row_noise(z_shape):  # Gumbel-max: y = argmax(z + g), g = -log(-log u)
            g = b.neg(b.op("Log", [b.neg(b.op("Log", [noise]))]))
            top = b.op("ArgMax", [b.add(z, g)], axis=-1, keepdims=1)
            return self._minus_onehot(b, b.op("Softmax", [z], axis=-1), top)
        return self._inverse_cdf_grad(b, z, noise)

    def _inverse_cdf_grad(self, b: GraphBuilder, z: str, noise: str) -> str:
        """Inverse CDF: y = the first class whose cumulative probability c_y reaches u c_V
        (u: one uniform per row in (0, 1); c_V, the row's total, so that float rounding of the
        sum never leaves a row without a class: u c_V <= c_V). Class y is drawn when
        c_{y-1} < u c_V <= c_y, with probability p_y; a class of p_y = 0 never. The first
        reached class is an ArgMax over the 0/1 comparison in the float type (ONNX Runtime's
        CUDA ArgMax takes float types only: a uint8 mask would put the node and a copy of
        the mask on the host), the only output-sized tensors besides p being c and that mask."""
        p = b.op("Softmax", [z], axis=-1)
        cdf = b.op("CumSum", [p, b.const(np.int64(-1))])
        total = b.op("Slice", [cdf, b.ints([-1]), b.ints([np.iinfo(np.int64).max]), b.ints([-1])])
        reached = b.cast(b.op("GreaterOrEqual", [cdf, b.mul(noise, total)]), b.float_type)
        return self._minus_onehot(b, p, b.op("ArgMax", [reached], axis=-1, keepdims=1))

    def emit_fisher_sqrt_times(self, b, z, v):
        p = b.op("Softmax", [z], axis=-1)
        sp = b.op("Sqrt", [p])
        inner = b.reduce_sum(b.mul(sp, v), [-1], keepdims=True)
        return b.sub(b.mul(sp, v), b.mul(p, inner))

    def emit_fisher_times(self, b, z, v):
        # p (v - p.v): v centred under p, then weighted; at most two v-sized tensors beside p
        # (p v - p (p.v) held p v, p (p.v) and their difference at once)
        p = b.op("Softmax", [z], axis=-1)
        return b.mul(p, b.sub(v, b.reduce_sum(b.mul(p, v), [-1], keepdims=True)))

    def emit_fisher_dots(self, b, z, tangents, weight=None):
        """t_i^T F t_j = sum p d_i d_j with d = t - p.t (each tangent centered under p, so the
        form stays a variance, without the cancellation of sum p t_i t_j - (p.t_i)(p.t_j)).
        Each tangent leaves one logits-sized tensor, d, for the later ones: the base form's
        F t_j (and the sum it is made of) outlived its tangent until the other tangent's JVP
        came, and the velocity's JVP comes long before P's (a 50,257-vocabulary GPT's step)."""
        p = b.op("Softmax", [z], axis=-1)
        centered: list[str] = []
        dots = {}
        for j, t in enumerate(tangents):
            d = b.sub(t, b.reduce_sum(b.mul(p, t), [-1], keepdims=True))
            pd = b.mul(p, d)
            if weight is not None:
                pd = b.mul(pd, weight)
            for i in range(j):  # p d_j d_i: the earlier tangents' d meet this one's p d
                dots[(i, j)] = b.reduce_sum(b.mul(pd, centered[i]), None)
            dots[(j, j)] = b.reduce_sum(b.mul(pd, d), None)
            centered.append(d)
        return dots

    # -- numpy twins
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
