"""Gradient accumulation over micro-batches: one update per k calls of `Trainer.step`, equal to
one step on the k micro-batches' concatenation (docs/runtime.md, "Gradient accumulation").

    trainer = Trainer(plan, optimizer="adam", accumulate=4)
    for x, y in micro_batches:              # PyTorch: loss.backward() per micro-batch,
        m = trainer.step({"input": x}, y)   # optimizer.step() every 4th; m["accumulating"] is 1
                                            # until the 4th call, which updates

Graph side: every micro-batch of a cycle but the last runs the `accumulate` subgraph, which
adds its gradient into the running sum `grad_accum/<p>` (hp/accum_keep = 0 starts the sum on
a cycle's first micro-batch) and, for an optimizer that keeps factor statistics (K-FAC),
folds its statistics into the moving averages. The cycle's last micro-batch runs the
optimizer's own step graph emitted with `accumulate=True`: its gradient is (grad_accum + g) *
hp/accum_scale, the mean of the k micro-batch gradients (`accumulated`), before the gradient
reduction point, so a data-parallel run averages the accumulated gradients over its ranks.
Nothing holds a micro-batch's activations beyond its own run: the state is one
gradient-sized sum (double-buffered, like every slot).

Host side (`Accumulation`): where the trainer is in its cycle, the weight each micro-batch's
statistics get in the moving averages (`coefficient`), the metrics of the cycle, and the
refusal of a checkpoint in the middle of a cycle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler.errors import ConfigError
from kfac_compiler.requests import StatisticsOptions, SubgraphKind, register_kind

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission

ACCUM_KEEP = C.hp("accum_keep")    # > 0: add to the running sum; 0 (a cycle's first micro-batch): start it
ACCUM_SCALE = C.hp("accum_scale")  # 1/k on the cycle's last micro-batch; NaN after a non-finite micro-batch


@dataclass(frozen=True)
class AccumulateOptions(StatisticsOptions):
    """The options of `accumulate`: with_stats folds the micro-batch's factor statistics (on its
    stats_batch examples, spread evenly: backend/forward.sub_batch_pass) into the moving averages with
    hp/ema_coeff (Accumulation.coefficient), inside an If on hp/update_stats with stats_if."""

    with_stats: bool = False
    stats_if: bool = False


def emit_accumulate(em: Emission, o: AccumulateOptions) -> None:
    """A micro-batch that is not its cycle's last: grad_accum/<p> += g (= g with hp/accum_keep
    0), and with_stats the factors' moving averages. metric/finite covers the loss and the
    statistics: a run that fails it writes nothing (the host then rejects the cycle's update,
    Accumulation); a non-finite gradient with a finite loss reaches the sum and makes the
    step's own check reject the update."""
    from kfac_compiler.optimizers.base import local_loss_and_grads  # base imports this module

    b = em.b
    em.keep_layers(o.layers)  # K-FAC's parameter groups: their layers keep no statistics
    reuse = o.with_stats and o.mode == "empirical" and o.stats_batch is None  # as K-FAC's step
    loss, grads, cots = local_loss_and_grads(em, em.layer_cotangent_targets() if reuse else [])
    keep = b.op("Greater", [em.hp(ACCUM_KEEP), b.const(0.0)])
    for p in [*em.parts.params, *em.held]:
        total = em.state_input(C.grad_accum(p), tuple(em.view.shapes[p]), "zeros")
        em.state_output(C.grad_accum(p), b.op("Where", [keep, b.add(total, grads[p]), grads[p]]))
    ok = [loss]
    if o.with_stats:
        mode, samples = o.mode or em.parts.mode, o.num_samples or em.parts.num_samples
        em.factor_updates(em.sub_batch_pass(o.stats_batch), cots, mode, samples, ok, conditional=o.stats_if)
    em.metric(C.LOSS, loss)
    em.metric(C.FINITE, b.cast(em.finite(ok), TensorProto.FLOAT))


ACCUMULATE = register_kind(SubgraphKind("accumulate", AccumulateOptions, every_step=True, emit=emit_accumulate,
                                        owner="gradient accumulation (kfac_compiler/optimizers/accumulate.py)"))


def accumulated(em: Emission, grads: dict[str, str]) -> dict[str, str]:
    """In a step emitted with accumulate=True, on its cycle's last micro-batch: the mean of the
    cycle's micro-batch gradients, (grad_accum/<p> + g) * hp/accum_scale."""
    b, scale = em.b, em.hp(ACCUM_SCALE)
    return {p: b.mul(b.add(em.state_input(C.grad_accum(p), tuple(em.view.shapes[p]), "zeros"), g), scale)
            for p, g in grads.items()}


class Policy(Protocol):
    """What Accumulation drives: an optimizer plugin (kfac_compiler.optimizers.base.Optimizer)."""

    trainer: Any

    def step(self, data: dict[str, Any]) -> dict[str, float]: ...

    def micro_batch(self, data: dict[str, Any]) -> tuple[dict[str, float], bool]: ...


class Accumulation:
    """The host side of a cycle of `count` micro-batches (count 1: no accumulation).

    `taken` micro-batches of the current cycle have run. The update comes with the count-th
    call; its metrics are the step's, with the loss (and the loss's own metrics) the mean over
    the cycle's micro-batches. A micro-batch whose loss or statistics are not finite poisons
    the cycle: its run wrote nothing, and the step gets hp/accum_scale = NaN, so that its own
    check rejects the update as a whole batch with a non-finite example would be."""

    def __init__(self, count: int) -> None:
        self.count = int(count)
        self.reset()

    def reset(self) -> None:
        """Start a new cycle (the running sum is restarted by the next micro-batch)."""
        self.taken = 0
        self.poisoned = False
        self.sums: dict[str, float] = {}

    @property
    def last(self) -> bool:
        """Whether the next micro-batch ends the cycle (always without accumulation)."""
        return self.taken == self.count - 1

    def coefficient(self, c: float) -> float:
        """The moving-average weight of the next micro-batch's statistics (position i = taken + 1
        of k) such that the k folds f <- (1 - c_i) f + c_i S_i give (1 - c) f + c mean_i S_i,
        what one statistics step on the whole batch with weight c gives: c_i = c / (k - (k - i) c)
        (c = 1, the first batch: the running mean 1/i)."""
        k, i = self.count, self.taken + 1
        return c / (k - (k - i) * c)

    def mean_with(self, name: str, value: float) -> float:
        """The cycle's mean of metric `name` with `value` the last micro-batch's (before run adds
        it): what run reports for an averaged metric after the cycle's last step."""
        return (self.sums.get(name, 0.0) + value) / self.count

    def check_boundary(self, what: str) -> None:
        """ConfigError for `what` in the middle of a cycle."""
        if self.taken:
            raise ConfigError(f"{what}: the trainer is in the middle of an accumulation cycle ({self.taken} of "
                              f"{self.count} micro-batches taken); call it after the cycle's last micro-batch (the "
                              "step whose metrics have no 'accumulating')")

    def run(self, policy: Policy, data: dict[str, Any], averaged: tuple[str, ...]) -> dict[str, float]:
        """One call of Trainer.step: a micro-batch, or the step that ends the cycle. `averaged`:
        the metrics reported as means over the cycle (the loss and the loss's own metrics,
        which the trainer then averages over the ranks of a data-parallel run)."""
        if self.count == 1:
            return policy.step(data)
        store = policy.trainer.store
        if not self.last:
            store.set_hp(ACCUM_KEEP, 1.0 if self.taken else 0.0)
            metrics, ok = policy.micro_batch(data)
            # the step's loss is the ranks' mean (its reduction point); a micro-batch's is local
            metrics["loss"] = policy.trainer.mean_over_ranks(metrics["loss"])
            self._add(metrics, averaged)
            self.poisoned = self.poisoned or not ok or not math.isfinite(metrics["loss"])
            self.taken += 1
            return {**metrics, "micro_batch": float(self.taken - 1), "accumulating": 1.0}
        store.set_hp(ACCUM_SCALE, math.nan if self.poisoned else 1.0 / self.count)
        try:
            metrics = policy.step(data)
            metrics.update({k: self.mean_with(k, float(metrics[k])) for k in averaged if k in metrics})
            metrics["micro_batch"] = float(self.taken)
        finally:
            self.reset()
        return metrics

    def _add(self, metrics: dict[str, float], names: tuple[str, ...]) -> None:
        for k in names:
            if k in metrics:
                self.sums[k] = self.sums.get(k, 0.0) + float(metrics[k])
