"""Optimizers as plugins: the contract every optimizer implements, and the registry.

An optimizer owns three things, in its own module:
  * its settings (`Config`, an OptimizerConfig: knobs, defaults, validation);
  * the graphs it emits (`subgraphs`: SubgraphKinds, kfac_compiler/requests.py: a name, a
    frozen options type, whether it runs every step, and the emitter `emit(em, options)`,
    which adds nodes to `em`, a kfac_compiler.backend Emission, and declares its inputs and
    outputs by contract name); registering the optimizer registers its kinds;
  * its host-side policy (the plugin instance, made per Trainer): which sessions a step
    runs with which hyper-parameters, schedules, rejection, and its host state for
    checkpoints.

    @register_optimizer
    class MyOptimizer(Optimizer):
        name = "mine"
        Config = MyConfig
        subgraphs = (SubgraphKind("mine_step", MineOptions, every_step=True, emit=emit_mine_step),)
        def build(self): self.trainer.program("mine_step")
        def step(self, data): ...

`kfac_compiler.runtime.Trainer(plan, optimizer="mine")` then trains with it. Nothing here
imports the back end: emitters receive their Emission, so the runtime can import the
optimizers without the compiler's internals.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kfac_compiler import contract as C
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers.settings import OptimizerConfig
from kfac_compiler.requests import SubgraphKind, SubgraphOptions, register_kind

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.plan import Plan
    from kfac_compiler.runtime.trainer import Trainer


class Optimizer:
    """Base of the optimizer plugins; one instance per Trainer holds the host-side state."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[OptimizerConfig]] = OptimizerConfig
    subgraphs: ClassVar[tuple[SubgraphKind, ...]] = ()
    burn_in_count: int = 0  # statistics-only steps taken (see burn_in)

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.config = trainer.config

    def build(self) -> None:
        """Create every session the steps use, so that all state exists up front
        (checkpoints, parameters()) and the first step is not slowed by session creation."""

    def step(self, data: dict[str, Any]) -> dict[str, float]:
        """One step on a checked batch (already `trainer.weighted` / `trainer.batch_size`);
        returns host-float metrics and advances trainer.step_count / applied_steps."""
        raise NotImplementedError

    def burn_in(self, data: dict[str, Any]) -> dict[str, float]:
        raise ConfigError(f"burn-in only applies to K-FAC, not {self.name!r}")

    def host_state(self) -> dict[str, Any]:
        """The optimizer's host-side state (checkpointed with the device state)."""
        return {}

    def summary_lines(self) -> list[str]:
        """What the train command says about this run's setup under its first line (K-FAC: its
        parameter groups)."""
        return []

    def set_host_state(self, state: Mapping[str, Any]) -> None:
        """Restore host_state() (keys another optimizer wrote are ignored)."""

    def resumed(self, knobs: Collection[str]) -> None:
        """After a checkpoint's host state was restored: honour the `knobs` (canonical names)
        given anew on resuming whose value the host state holds a copy of (K-FAC's damping), so
        that the new value applies from this step on instead of being shadowed."""


OPTIMIZERS: dict[str, type[Optimizer]] = {}


def register_optimizer(cls: type[Optimizer]) -> type[Optimizer]:
    """Class decorator: make `cls` selectable as optimizer `cls.name` (registering a name
    again replaces the earlier class, as for losses and blocks: a user may override a
    built-in). Its subgraph kinds are registered with it; a name the back end or another
    optimizer emits is a ConfigError."""
    if not cls.name:
        raise TypeError(f"optimizer class {cls.__name__} has no name")
    owner = f"optimizer {cls.name!r}"
    for kind in cls.subgraphs:
        if kind.emit is None:
            raise TypeError(f"optimizer {cls.name!r}: subgraph {kind.name!r} has no emitter")
        register_kind(dataclasses.replace(kind, owner=owner))
    OPTIMIZERS[cls.name] = cls
    return cls


def optimizer_class(name: str) -> type[Optimizer]:
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return cls


def make_config(optimizer: str, plan: Plan | None = None, **knobs: Any) -> OptimizerConfig:
    """The validated settings of `optimizer` from keyword knobs and the plan's defaults."""
    return optimizer_class(optimizer).Config.from_knobs(plan, **knobs)


@dataclass(frozen=True)
class FirstOrderStepOptions(SubgraphOptions):
    """The options of a first-order step (sgd_step, adam_step): `l2` adds weight decay to the
    gradient, `clip` clips the gradient by its global norm, `decay` decays the weights
    (decoupled, AdamW's);
    `multi_tensor` emits the update once over every parameter's concatenation instead of per
    parameter (optimizers/multi_tensor.py; None: the device's default, filled by resolve)."""

    resolved: ClassVar[tuple[str, ...]] = SubgraphOptions.resolved + ("multi_tensor",)

    l2: bool = False
    multi_tensor: bool | None = None
    clip: bool = False  # scale the gradient to a global norm of at most hp/clip_norm
    decay: bool = False  # decoupled weight decay: theta <- theta - hp/decay theta before the update


# --------------------------------------------------------------------------- emission helpers
# the reduction points every step has (Emission.reduce_mean): a data-parallel run averages the
# batch's loss and gradients over the ranks there
LOSS_POINT, GRADIENTS_POINT = "loss", "gradients"


def mean_loss_and_grads(em: Emission, extra_wrt: Sequence[str] = ()) -> tuple[str, dict[str, str], dict[str, str]]:
    """The batch's loss and gradients through their reduction points (means over every
    rank's examples in a data-parallel run), and the cotangents of `extra_wrt` (local). The
    gradients include those of the parameters `em` holds out of the curvature (Emission.hold)."""
    held = [p for p in em.held if p not in extra_wrt]
    loss, _, grads, cots = em.loss_and_grads([*extra_wrt, *held])
    grads = {**grads, **{p: cots.pop(p) or em.zeros_like_param(p) for p in held}}
    return em.reduce_mean(LOSS_POINT, loss), em.reduce_mean(GRADIENTS_POINT, grads), cots


def regularized(em: Emission, grads: dict[str, str], l2: bool) -> dict[str, str]:
    """g + l2 * theta (only emitted when the optimizer uses weight decay)."""
    if not l2:
        return grads
    coeff = em.hp(C.L2)
    return {p: em.b.add(g, em.b.mul(coeff, p)) for p, g in grads.items()}


class Gram:
    """Dot products of parameter-shaped vectors, each emitted on first use: per parameter a
    ReduceSumSquare (x.x) or Mul + ReduceSum (x.y), then one Sum. (One MatMul of the
    flattened vectors' concatenation needs fewer nodes, but the concatenation copies every
    vector and the k x k product over all parameters runs memory-bound.)"""

    def __init__(self, em: Emission, vectors: dict[str, dict[str, str]]) -> None:
        self.b, self.params, self.vectors = em.b, list(em.parts.params), vectors
        self._dots: dict[tuple[str, str], str] = {}

    def __call__(self, x: str, y: str) -> str:
        key = (x, y) if x <= y else (y, x)
        if key not in self._dots:
            b, u, v = self.b, self.vectors[x], self.vectors[y]
            terms = [b.reduce("ReduceSumSquare", u[p], None) if x == y else b.reduce_sum(b.mul(u[p], v[p]), None)
                     for p in self.params]
            self._dots[key] = b.sum(terms)
        return self._dots[key]
