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
from kfac_compiler.optimizers.accumulate import ACCUMULATE, AccumulateOptions, Accumulation, accumulated
from kfac_compiler.optimizers.multi_tensor import Chunks, Layout
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
    # whether its step graphs take the option accumulate=True (reading the cycle's gradient
    # sum, optimizers/accumulate.py): the knob `accumulate` > 1 is refused otherwise
    accumulates: ClassVar[bool] = False
    burn_in_count: int = 0  # statistics-only steps taken (see burn_in)

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.config = trainer.config
        self.cycle = Accumulation(self.config.accumulate)  # where a gradient-accumulation cycle stands
        if self.cycle.count > 1 and not self.accumulates:
            raise ConfigError(f"optimizer {self.name!r} does not support gradient accumulation (accumulate="
                              f"{self.cycle.count}): its step graph does not read the accumulated gradient; use "
                              "accumulate=1")
        self._micro_programs: dict[AccumulateOptions, Any] = {}  # micro_program's memo

    def build(self) -> None:
        """Create every session the steps use, so that all state exists up front
        (checkpoints, parameters()) and the first step is not slowed by session creation."""

    def step(self, data: dict[str, Any]) -> dict[str, float]:
        """One step on a checked batch (already `trainer.weighted` / `trainer.batch_size`);
        returns host-float metrics and advances trainer.step_count / applied_steps."""
        raise NotImplementedError

    def burn_in(self, data: dict[str, Any]) -> dict[str, float]:
        raise ConfigError(f"burn-in only applies to K-FAC, not {self.name!r}")

    # ---------------------------------------------------------------- gradient accumulation
    def accumulate_options(self) -> AccumulateOptions:
        """The `accumulate` subgraph a micro-batch runs (an optimizer that keeps factor
        statistics adds them)."""
        return AccumulateOptions(weighted=self.trainer.weighted)

    def micro_program(self):
        """The `accumulate` session for the current batch (memoized on its options)."""
        options = self.accumulate_options()
        if options not in self._micro_programs:
            self._micro_programs[options] = self.trainer.program(ACCUMULATE.name, options=options)
        return self._micro_programs[options]

    def micro_batch(self, data: dict[str, Any]) -> tuple[dict[str, float], bool]:
        """A micro-batch of an accumulation cycle other than its last: its gradient added to the
        cycle's sum (and its statistics folded, where kept). Returns (its metrics, whether its
        loss and statistics were finite)."""
        prog = self.micro_program()
        noise, hp = self.micro_inputs(prog, data)
        out = prog.run(self.trainer.store, {**data, **noise}, hp=hp)
        return ({"step": float(self.trainer.step_count), "loss": out[C.LOSS], **C.loss_metrics(out)},
                out.get(C.FINITE, 1.0) > 0.5)

    def micro_inputs(self, prog: Any, data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """A micro-batch's noise inputs and hyper-parameters besides hp/accum_keep (an optimizer
        that folds statistics: their weight)."""
        return self.trainer.draw_noise(prog, data), {}

    def flat_params(self) -> list[str]:
        """The parameters, in order, whose values a flat state slot of its step (<kind>/*,
        multi_tensor) concatenates: every trainable one (K-FAC: those its parameter groups
        leave it). Checkpoints and the host's roll back split the slot by them."""
        return list(self.trainer.params)

    def flat_shapes(self) -> dict[str, tuple[int, ...]]:
        """{param: shape} of flat_params, in order: how a flat slot splits (checkpoints, roll back)."""
        return {p: tuple(self.trainer.store.spec(p)[0]) for p in self.flat_params()}

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
    (decoupled, AdamW's), `accumulate` takes the mean gradient of an accumulation cycle;
    `multi_tensor` emits the update once over every parameter's concatenation instead of per
    parameter (optimizers/multi_tensor.py; None: the device's default, filled by resolve)."""

    resolved: ClassVar[tuple[str, ...]] = SubgraphOptions.resolved + ("multi_tensor",)

    l2: bool = False
    multi_tensor: bool | None = None
    clip: bool = False  # scale the gradient to a global norm of at most hp/clip_norm
    decay: bool = False  # decoupled weight decay: theta <- theta - hp/decay theta before the update
    accumulate: bool = False  # the gradient is the accumulation cycle's mean (optimizers/accumulate.py)


# --------------------------------------------------------------------------- emission helpers
# the reduction points every step has (Emission.reduce_mean): a data-parallel run averages the
# batch's loss and gradients over the ranks there
LOSS_POINT, GRADIENTS_POINT = "loss", "gradients"


def mean_loss_and_grads(em: Emission, extra_wrt: Sequence[str] = (),
                        accumulate: bool = False) -> tuple[str, dict[str, str], dict[str, str]]:
    """The batch's loss and gradients through their reduction points (means over every
    rank's examples in a data-parallel run), and the cotangents of `extra_wrt` (local). The
    gradients include those of the parameters `em` holds out of the curvature (Emission.hold);
    with `accumulate` they are the accumulation cycle's mean (reduced_loss_and_grads)."""
    loss, grads, cots = local_loss_and_grads(em, extra_wrt)
    return (*reduced_loss_and_grads(em, loss, grads, accumulate), cots)


def local_loss_and_grads(em: Emission, extra_wrt: Sequence[str] = ()) -> tuple[str, dict[str, str], dict[str, str]]:
    """This batch's loss and gradients before any reduction (the held parameters' included),
    and the cotangents of `extra_wrt`."""
    held = [p for p in em.held if p not in extra_wrt]
    loss, _, grads, cots = em.loss_and_grads([*extra_wrt, *held])
    return loss, {**grads, **{p: cots.pop(p) or em.zeros_like_param(p) for p in held}}, cots


def reduced_loss_and_grads(em: Emission, loss: str, grads: dict[str, str],
                           accumulate: bool = False) -> tuple[str, dict[str, str]]:
    """`loss` and `grads` (this batch's, local) through their reduction points; with
    `accumulate`, on an accumulation cycle's last micro-batch, the gradients are the cycle's
    mean (optimizers/accumulate.py) before they are reduced, and the loss stays this
    micro-batch's."""
    if accumulate:
        grads = accumulated(em, grads)
    return em.reduce_mean(LOSS_POINT, loss), em.reduce_mean(GRADIENTS_POINT, grads)


def regularized(em: Emission, grads: dict[str, str], l2: bool) -> dict[str, str]:
    """g + l2 * theta (only emitted when the optimizer uses weight decay)."""
    if not l2:
        return grads
    coeff = em.hp(C.L2)
    return {p: em.b.add(g, em.b.mul(coeff, p)) for p, g in grads.items()}


class Gram:
    """Dot products of parameter-shaped vectors, each emitted on first use (Layout.dot and
    Layout.sum_squares): `vectors` {name: {param: tensor}} over em.parts.params, per parameter
    a ReduceSumSquare (x.x) or Mul + ReduceSum (x.y), then one Sum; or, with `lay`, {name:
    Chunks of lay}, in the multi-tensor layout one ReduceSumSquare or MatMul of the flat
    vectors per product. `stacked`: names of vectors whose products are all wanted, emitted
    at once as one stacked Gram (Layout.stack and gram_of: a Concat, a Gemm and a Split in either layout);
    names holding the same chunks (the gradient before and after an l2 term of 0) share a
    row."""

    def __init__(self, em: Emission, vectors: Mapping[str, Any], lay: Layout | None = None,
                 stacked: Sequence[str] = ()) -> None:
        self.lay = lay or Layout(em, False)
        self.vectors: dict[str, Chunks] = {k: list(v) if lay is not None else self.lay.pack(v)
                                           for k, v in vectors.items()}
        self._dots: dict[tuple[str, str], str] = {}
        rows: dict[tuple[str, ...], int] = {}  # distinct chunks -> their row of the stack
        for name in stacked:
            rows.setdefault(tuple(self.vectors[name]), len(rows))
        self.stack: str | None = None  # the stacked rows [k, N] (Layout.stack), kept for `combine`
        self.rows = {name: rows[tuple(self.vectors[name])] for name in stacked}
        if len(rows) > 1:
            self.stack = self.lay.stack([list(chunks) for chunks in rows])
            gram = self.lay.gram_of(self.stack, len(rows))
            for x in stacked:
                for y in stacked:
                    self.known(x, y, gram[self.rows[x]][self.rows[y]])

    def combine(self, coefficients: Mapping[str, str]) -> Chunks | None:
        """sum_x c_x x over {vector name: scalar c_x} from the stacked rows (Layout.combine:
        one MatMul and a split), or None where a vector is not in the stack."""
        if self.stack is None or not all(x in self.rows for x in coefficients):
            return None
        by_row: list[str | None] = [None] * (max(self.rows.values()) + 1)
        for x, c in coefficients.items():
            if by_row[self.rows[x]] is not None:
                return None  # two names on one row: their coefficients would add
            by_row[self.rows[x]] = c
        return self.lay.combine(self.stack, by_row)

    def known(self, x: str, y: str, tensor: str) -> None:
        """x.y is `tensor`, computed already (K-FAC's clipping needs |g|^2 before the Gram)."""
        self._dots[(x, y) if x <= y else (y, x)] = tensor

    def __call__(self, x: str, y: str) -> str:
        key = (x, y) if x <= y else (y, x)
        if key not in self._dots:
            u, v = self.vectors[x], self.vectors[y]
            self._dots[key] = self.lay.sum_squares(u) if x == y else self.lay.dot(u, v)
        return self._dots[key]
