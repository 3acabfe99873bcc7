"""SGD with heavy-ball momentum: settings, the `sgd_step` graph, the host step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kfac_compiler import contract as C
from kfac_compiler.optimizers.base import FirstOrderStepOptions, mean_loss_and_grads, register_optimizer
from kfac_compiler.optimizers.first_order import (
    FirstOrderConfig,
    FirstOrderOptimizer,
    clipped,
    decayed,
    emit_baseline_metrics,
    regularized_chunks,
)
from kfac_compiler.optimizers.multi_tensor import Layout
from kfac_compiler.optimizers.settings import check_unit
from kfac_compiler.requests import SubgraphKind

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.plan import Plan


@dataclass
class SgdConfig(FirstOrderConfig):
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
    """Heavy-ball SGD: v = momentum v - lr g; theta += v (per parameter or once over every
    parameter: o.multi_tensor)."""
    b = em.b
    loss, raw, _ = mean_loss_and_grads(em, accumulate=o.accumulate)
    lay = Layout(em, bool(o.multi_tensor))
    lr, mom = em.hp(C.LEARNING_RATE), em.hp(C.MOMENTUM)
    theta, g_raw = lay.pack({p: p for p in lay.params}), lay.pack(raw)
    g = regularized_chunks(em, lay, clipped(em, lay, g_raw, o.clip), theta, o.l2)

    def rule(g: str, vel: str, p: str) -> dict[str, str]:
        step = b.sub(b.mul(mom, vel), b.mul(lr, g))
        return {"step": step, "p": b.add(p, step)}

    new = lay.map(rule, g=g, vel=lay.state(em, C.VELOCITY), p=decayed(em, lay, theta, o.decay))
    for p, t in lay.unpack(new["p"]).items():
        em.state_output(p, t)
    lay.write_state(em, C.VELOCITY, new["step"])
    emit_baseline_metrics(em, loss, lay, new["step"], g_raw)


SGD_STEP = SubgraphKind("sgd_step", FirstOrderStepOptions, every_step=True, emit=emit_sgd_step)


@register_optimizer
class Sgd(FirstOrderOptimizer):
    name = "sgd"
    Config = SgdConfig
    subgraphs = (SGD_STEP,)
    step_subgraph = SGD_STEP.name

    def hyper_parameters(self, k: int) -> dict[str, float]:
        return {C.LEARNING_RATE: self.config.at("learning_rate", k), C.MOMENTUM: self.config.at("momentum", k)}
