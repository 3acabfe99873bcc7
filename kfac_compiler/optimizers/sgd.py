"""SGD with heavy-ball momentum: settings, the `sgd_step` graph, the host step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kfac_compiler import contract as C
from kfac_compiler.optimizers.base import FirstOrderStepOptions, mean_loss_and_grads, register_optimizer, regularized
from kfac_compiler.optimizers.first_order import FirstOrderOptimizer, emit_baseline_metrics
from kfac_compiler.optimizers.settings import OptimizerConfig, check_unit
from kfac_compiler.requests import SubgraphKind

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.plan import Plan


@dataclass
class SgdConfig(OptimizerConfig):
    """SGD with heavy-ball momentum: v <- mu v - lr (g + l2 w); w <- w + v."""

    name: ClassVar[str] = "sgd"
    schedulable: ClassVar[tuple[str, ...]] = ("learning_rate", "momentum")
    momentum: float | None = None

    def resolve(self, plan: Plan | None) -> None:
        if self.learning_rate is None:
            self.learning_rate = 0.1
        if self.momentum is None:
            self.momentum = 0.9

    def validate(self) -> None:
        super().validate()
        check_unit("momentum", self.initial("momentum"))


def emit_sgd_step(em: Emission, o: FirstOrderStepOptions) -> None:
    """Heavy-ball SGD: v = momentum v - lr g; theta += v."""
    b = em.b
    loss, raw, _ = mean_loss_and_grads(em)
    grads = regularized(em, raw, o.l2)
    lr, mom = em.hp(C.LEARNING_RATE), em.hp(C.MOMENTUM)
    steps = {}
    for p in em.parts.params:
        vel = em.state_input(C.velocity(p), tuple(em.view.shapes[p]), "zeros")
        steps[p] = b.sub(b.mul(mom, vel), b.mul(lr, grads[p]))
        em.state_output(p, b.add(p, steps[p]))
        em.state_output(C.velocity(p), steps[p])
    emit_baseline_metrics(em, loss, steps, raw)


SGD_STEP = SubgraphKind("sgd_step", FirstOrderStepOptions, every_step=True, emit=emit_sgd_step)


@register_optimizer
class Sgd(FirstOrderOptimizer):
    name = "sgd"
    Config = SgdConfig
    subgraphs = (SGD_STEP,)
    step_subgraph = SGD_STEP.name

    def hyper_parameters(self, k: int) -> dict[str, float]:
        return {C.LEARNING_RATE: self.config.at("learning_rate", k), C.MOMENTUM: self.config.at("momentum", k)}
