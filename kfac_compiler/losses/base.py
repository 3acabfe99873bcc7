"""The loss contract (`Loss`, `LossOption`) and the loss registry.

A loss is L = 1/N sum_n sum_t w_nt l_nt(z_n, y_n) over the batch (mean reduction over the N
examples), with l_n = sum_t l_nt summed over every non-batch coordinate of the model output z
and optional weights or a 0/1 mask w at the loss's weight positions t (`weight_shape`: per
example by default; softmax cross-entropy's targets, an elementwise loss's coordinates).
A loss class owns everything the compiler and the runtime know about its kind, so that no
other module compares loss names:

- identity: `kind` (its registry name, the plan's loss.kind) and `description` (CLI help);
- options: `options`, each a LossOption (default, help, check); the instance holds the
  checked values as attributes and `option_values()` is what the plan records;
- targets: their ONNX type and shape in the graphs, their dtype in the plan, the output
  shapes the loss accepts, the host-side check and conversion of target arrays, the
  positions its weights may address and the targets that count (`mask_targets`: softmax
  cross-entropy's ignore_index), and the targets it derives from the demo digits data
  (`kfac-compiler train --data digits`);
- ONNX emitters (through a GraphBuilder): the loss, the per-example gradient dl_n/dz_n for
  given targets, the gradient for a target sampled from the predictive distribution with
  host noise (`noise` names its distribution, so that runs are reproducible and
  checkpointable), and products with B and with F_z, where F_z = B B^T is the Fisher of the
  predictive distribution w.r.t. z. The *_GGN estimation modes reuse the Fisher products, so
  a loss must have F_z equal to its Hessian w.r.t. z (a canonical link);
- `lower_bound` (the K-FAC step's quadratic model check), `link_op` (the op it applies to the
  scores itself) and evaluation `metrics`;
- numpy twins (`np_*`, float64): the independent truth for tests.
"""
from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import TensorProto

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError, DataError


# ------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class LossOption:
    """One option a loss takes. `check` returns the value normalised, or raises ValueError
    with the reason (worded to follow the option's name: "must be > 0"). `config_alias`: a
    top-level config key that also sets it (an old spelling kept for existing configs)."""

    name: str
    default: Any
    help: str
    check: Callable[[Any], Any]
    config_alias: str | None = None
    # the command line's text -> value for an option with a flag of its own on `compile` and
    # `train` (--ignore-index for ignore_index); None: set in the config's loss_options only
    parse: Callable[[str], Any] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SCALE_RANGE = (1e-30, 1e30)  # a loss scale option's values: it and its inverse normal float32 numbers


def positive_number(value: Any) -> float:
    """Check for options that scale a loss (a variance, a rate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError("must be a number")
    if not value > 0:
        raise ValueError("must be > 0")
    if not SCALE_RANGE[0] <= value <= SCALE_RANGE[1]:  # inf gave a loss of 0 for any output, 1e-45 inf
        raise ValueError(f"must be in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}] (the float32 graphs scale by it "
                         "and by its inverse)")
    return float(value)


def optional_int(value: Any) -> int | None:
    """Check for options that name an integer value or none (softmax cross-entropy's
    ignore_index)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError("must be an integer or none")
    return int(value)


def positive_int(value: Any) -> int:
    """Check for options that count (sizes, truncation points)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    if value < 1:
        raise ValueError("must be >= 1")
    return int(value)


# ------------------------------------------------------------------------------ the contract
class Loss:
    """Base of the loss classes; an instance is a loss kind with its option values."""

    kind: ClassVar[str] = ""
    description: ClassVar[str] = ""  # one line: the predictive distribution and the targets
    options: ClassVar[tuple[LossOption, ...]] = ()
    noise: ClassVar[str] = "uniform"  # distribution of the host noise used for sampling
    # A value no l_n goes below (None: unknown). The K-FAC step scales down an update whose
    # quadratic model predicts a decrease beyond it (optimizers.KfacConfig).
    lower_bound: ClassVar[float | None] = None
    # The op (ONNX op type) the loss applies to the scores itself (its link): an output that
    # op computes would get it twice (a Keras Dense(k, activation="softmax") head), which the
    # front end warns of, naming the op's input to train instead. None: no such op.
    link_op: ClassVar[str | None] = None
    # Evaluation metrics besides the loss (Trainer.evaluate), computed by metric_totals.
    metrics: ClassVar[tuple[str, ...]] = ()
    # False for a kind the compiler assembles from other input (multi_head, from the heads):
    # not offered where a user names a loss (--loss's choices, the "pass a loss kind" hint)
    user_named: ClassVar[bool] = True

    def __init__(self, **options: Any) -> None:
        self._options = self.resolve_options(options)
        for name, value in self._options.items():
            setattr(self, name, value)

    # -- options
    @classmethod
    def resolve_options(cls, given: Mapping[str, Any], where: str = "") -> dict[str, Any]:
        """Every option of this loss: the given values checked, defaults for the rest.
        `where` prefixes error messages (e.g. the config file and key)."""
        known = {o.name: o for o in cls.options}
        unknown = [k for k in given if k not in known]
        if unknown:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            raise ConfigError(f"{where}loss {cls.kind!r} takes no option {', '.join(map(repr, unknown))} ({takes})")
        values = {}
        for name, opt in known.items():
            value = given.get(name, opt.default)
            try:
                values[name] = opt.check(value)
            except ValueError as e:
                raise ConfigError(f"{where}{cls.kind} {name} {e}, got {value!r}") from None
        return values

    @classmethod
    def takes_option(cls, name: str) -> bool:
        return any(o.name == name for o in cls.options)

    def option_values(self) -> dict[str, Any]:
        """The resolved options (the plan's loss.options)."""
        return dict(self._options)

    @classmethod
    def help_line(cls) -> str:
        """`kind: description [options: name=default, ...]` for --help and the docs."""
        opts = ", ".join(f"{o.name}={o.default}" for o in cls.options)
        return f"{cls.kind}: {cls.description}" + (f" [options: {opts}]" if opts else "")

    def summary(self) -> str:
        """The loss as `inspect` shows it (a loss with several heads lists them)."""
        return self.kind

    # -- targets: graph type and shape, plan dtype, accepted outputs
    def target_type(self) -> int:
        """ONNX element type of the targets input of the emitted graphs."""
        return TensorProto.FLOAT

    def target_shape(self, output_shape: tuple) -> tuple:
        return tuple(output_shape)

    def target_dtype(self, output_dtype: str) -> str:
        """The plan's targets dtype (plan.json "targets") given the output's dtype."""
        return output_dtype

    def noise_shape(self, output_shape: tuple) -> tuple:
        """The shape of the host noise emit_sampled_grad takes, batch first: one value per
        output entry by default; a loss that needs less (one uniform per categorical row)
        says so, and the host draws no more than that."""
        return tuple(output_shape)

    def weight_shape(self, target_shape: tuple) -> tuple:
        """The positions a weight (or a mask) can address, from the targets' shape: one weight
        per example by default; a loss whose l_n is a sum of per-position terms over its
        targets' axes (emit_per_position) returns more of the targets' shape. Weights given
        with fewer axes (a prefix of it, [N] at least) are broadcast to it on the host."""
        return tuple(target_shape[:1])

    def output_problem(self, output_shape: Sequence[Any]) -> str | None:
        """Why an output of this shape (rank >= 1) cannot carry this loss; None if it can."""
        return None

    # -- targets: host-side data
    def target_arrays(self) -> dict[str, str] | None:
        """{array name: head output} where a data file holds one target array per loss head;
        None: one array named "targets"."""
        return None

    def pack_targets(self, targets: Any, source: str) -> Any:
        """The targets as the graphs take them, from what the runtime API was given (a loss
        with several heads packs its dict of arrays into one; others take them as they are)."""
        return targets

    def check_targets(self, y: np.ndarray, output_dims: list[Any] | None, source: str) -> np.ndarray:
        """Targets (finite numbers, one row per example) checked against the model output's
        dims (None: unknown) and converted to the graph's dtype; DataError names `source`."""
        if output_dims is not None and (y.ndim != len(output_dims) or any(
                is_static(d) and y.shape[i] != d for i, d in enumerate(output_dims) if i)):
            raise DataError(f"{source}: 'targets' has shape {list(y.shape)}; {self.kind} expects the output's "
                            f"shape {output_dims}")
        self.check_target_values(y, source)
        return y.astype(onnx.helper.tensor_dtype_to_np_dtype(self.target_type()))

    def check_target_values(self, y: np.ndarray, source: str) -> None:
        """The loss's own range check of target values (DataError)."""

    @property
    def masks_targets(self) -> bool:
        """Whether mask_targets may return a mask (an option such as ignore_index is set)."""
        return False

    def mask_targets(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(the targets the graphs take, the 0/1 mask [weight_shape] of the positions that count,
        or None when all count) from checked targets. With a mask the runtime also divides
        the loss by the number of positions that count instead of N (softmax cross-entropy's
        ignore_index: torch's mean over the targets that are not ignored)."""
        return y, None

    def digits_targets(self, pixels: np.ndarray, labels: np.ndarray, output_dims: list[Any] | None) -> np.ndarray:
        """Targets for the demo digits data (pixels in [0, 1], [n, 64]; labels 0..9): by
        default the pixels, for a model that reconstructs them (64 values per example)."""
        rest = output_dims[1:] if output_dims is not None else None
        if rest is None or not all(is_static(d) for d in rest) or int(np.prod(rest or [1])) != 64:
            raise DataError(f"--data digits: a {self.kind} model must output 64 values per example to reconstruct "
                            f"the pixels (output {output_dims}); pass --data FILE.npz")
        return pixels.reshape([-1, *rest]).copy()

    # -- evaluation
    def output_names(self, output: str) -> list[str]:
        """The model tensors an exported model answers with (a loss with several heads: the
        heads' outputs, ahead of the plan's output)."""
        return [output]

    def prediction(self, outputs: np.ndarray) -> Any:
        """What Trainer.predict returns for the plan's output (a loss with several heads
        splits it per head)."""
        return outputs

    def metric_totals(self, outputs: np.ndarray, targets: np.ndarray,
                      weights: np.ndarray | None = None) -> dict[str, tuple[float, float]]:
        """{metric: (sum, count)} over a chunk of examples (outputs: the model output z;
        targets as mask_targets returns them; weights: None, or the weights [weight_shape]
        of a weighted evaluation, 0 where a position does not count); the evaluation reports
        sum / count over all chunks, so chunking does not change it."""
        return {}

    def metrics_take_weights(self) -> bool:
        """Whether metric_totals takes `weights` (a loss written before weighted evaluation
        existed may override it with (outputs, targets) only)."""
        import inspect

        params = inspect.signature(self.metric_totals).parameters.values()
        return len(params) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)

    # -- ONNX emitters (z: model output, y: targets)
    @abstractmethod
    def emit_per_example_loss_sum(self, b: GraphBuilder, z: str, y: str) -> str:
        """sum_n l_n as a scalar."""
        raise NotImplementedError

    def emit_metrics(self, b: GraphBuilder, z: str, y: str, weights: str | None = None) -> dict[str, str]:
        """Scalar metrics a training step reports besides the loss ({short name: tensor})."""
        return {}

    @abstractmethod
    def emit_grad(self, b: GraphBuilder, z: str, y: str) -> str:
        """dl_n/dz_n, same shape as z."""
        raise NotImplementedError

    @abstractmethod
    def emit_sampled_grad(self, b: GraphBuilder, z: str, noise: str, z_shape: tuple) -> str:
        """dl_n/dz_n for a target drawn from p(y|z) using host noise of noise_shape(z_shape);
        z_shape (batch first, dims may be symbolic) lets a loss whose sampling form depends on
        the output's size choose it as noise_shape did."""
        raise NotImplementedError

    @abstractmethod
    def emit_fisher_sqrt_times(self, b: GraphBuilder, z: str, v: str) -> str:
        """B v with F_z = B B^T (per example, v has the shape of z)."""
        raise NotImplementedError

    @abstractmethod
    def emit_fisher_times(self, b: GraphBuilder, z: str, v: str) -> str:
        """F_z v (per example)."""
        raise NotImplementedError

    def emit_fisher_dots(self, b: GraphBuilder, z: str, tangents: Sequence[str],
                         weight: str | None = None) -> dict[tuple[int, int], str]:
        """{(i, j): sum_n w_n t_i,n^T F_z t_j,n} for i <= j, scalars summed over the batch (the
        quadratic model's curvature terms before the mean); `weight` broadcasts against z.
        This form makes F_z t_j in full (emit_fisher_times); a loss whose outputs are large
        (a vocabulary's logits) may give one that keeps fewer output-sized tensors alive."""
        dots = {}
        for j, t in enumerate(tangents):  # each product's dot products before the next product
            fisher = self.emit_fisher_times(b, z, t)
            if weight is not None:
                fisher = b.mul(fisher, weight)
            for i in range(j + 1):
                dots[(i, j)] = b.reduce_sum(b.mul(tangents[i], fisher), None)
        return dots

    def emit_loss(self, b: GraphBuilder, z: str, y: str, weights: str | None = None) -> str:
        """Mean loss over the batch (weights: optional weights/mask shaped like
        weight_shape(targets), or fewer axes ready to broadcast against emit_per_position's)."""
        if weights is None:
            total = self.emit_per_example_loss_sum(b, z, y)
            return b.div(total, b.batch_size(z))
        per = self.emit_per_position(b, z, y)
        return b.div(b.reduce_sum(b.mul(per, weights), None), b.batch_size(z))

    @abstractmethod
    def emit_per_example(self, b: GraphBuilder, z: str, y: str) -> str:
        """l_n as a [N] tensor."""
        raise NotImplementedError

    def emit_per_position(self, b: GraphBuilder, z: str, y: str) -> str:
        """l_nt shaped like weight_shape(targets) (sum over t: l_n); per example by default."""
        return self.emit_per_example(b, z, y)

    # -- numpy twins (float64)
    @abstractmethod
    def np_per_example(self, z: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @abstractmethod
    def np_grad(self, z: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @abstractmethod
    def np_fisher(self, z_n: np.ndarray) -> np.ndarray:
        """F_z for ONE example as a matrix over its flattened output coordinates."""
        raise NotImplementedError


class ElementwiseLoss(Loss):
    """A loss whose l_n is a sum of per-coordinate terms t(z, y) (the independent-coordinate
    distributions): subclasses give the terms, in ONNX and in numpy."""

    @abstractmethod
    def emit_terms(self, b: GraphBuilder, z: str, y: str) -> str:
        """t(z, y), the shape of z."""
        raise NotImplementedError

    @abstractmethod
    def np_terms(self, z: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def emit_per_example_loss_sum(self, b: GraphBuilder, z: str, y: str) -> str:
        return b.reduce_sum(self.emit_terms(b, z, y), None)

    def emit_per_example(self, b: GraphBuilder, z: str, y: str) -> str:
        return reduce_rows(b, self.emit_terms(b, z, y))

    def weight_shape(self, target_shape: tuple) -> tuple:
        """A weight per output coordinate (kfac-jax's mask on a Bernoulli's logits), or per
        leading axes of them."""
        return tuple(target_shape)

    def emit_per_position(self, b: GraphBuilder, z: str, y: str) -> str:
        return self.emit_terms(b, z, y)

    def np_per_example(self, z: np.ndarray, y: np.ndarray) -> np.ndarray:
        return self.np_terms(z, y).reshape(len(z), -1).sum(axis=1)


def reduce_rows(b: GraphBuilder, x: str) -> str:
    """Sum every axis but the first: [N, ...] -> [N]."""
    flat = b.op("Flatten", [x], axis=1)
    return b.reduce_sum(flat, [1], keepdims=False)


def is_static(d: Any) -> bool:
    """A known (positive integer) dimension."""
    return isinstance(d, int) and d > 0


# ------------------------------------------------------------------------------ registry
LOSSES: dict[str, type[Loss]] = {}


def register_loss(cls: type[Loss]) -> type[Loss]:
    """Class decorator: make `cls` available as loss `cls.kind` (compile(loss=...), --loss,
    plans naming it). Importing the module that defines it is what registers it."""
    if not cls.kind:
        raise TypeError(f"{cls.__name__} has no kind")
    missing = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "__isabstractmethod__", False))
    if missing:  # else an empty NotImplementedError when a graph is first emitted
        raise TypeError(f"loss class {cls.__name__}: implement {', '.join(missing)} before registering it "
                        "(docs/extending_losses.md)")
    LOSSES[cls.kind] = cls
    return cls


def loss_kinds() -> tuple[str, ...]:
    """The registered loss kinds a user names, in registration order (read at call time:
    plugins count)."""
    return tuple(kind for kind, cls in LOSSES.items() if cls.user_named)


def loss_class(kind: str) -> type[Loss]:
    cls = LOSSES.get(kind)
    if cls is None:
        raise ConfigError(f"unknown loss {kind!r}; choose one of {', '.join(LOSSES)}")
    return cls


def make_loss(kind: str, **options: Any) -> Loss:
    return loss_class(kind)(**options)


def losses_help() -> str:
    """The help lines of the kinds a user names, joined for an argparse help text."""
    return " | ".join(cls.help_line() for cls in LOSSES.values() if cls.user_named)
