"""SGD with heavy-ball momentum: settings, the `sgd_step` graph, the host step."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler.optimizers.base import FirstOrderStepOptions, register_optimizer
from kfac_compiler.optimizers.first_order import (
    DECAY,
    FirstOrderConfig,
    FirstOrderOptimizer,
    HpNames,
    emit_first_order_step,
)
from kfac_compiler.optimizers.multi_tensor import Chunks, Layout
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


def sgd_rule(em: Emission, lay: Layout, hp: HpNames) -> Callable[[Chunks, Chunks], dict[str, Any]]:
    """Heavy-ball SGD's update (first_order.emit_rule's rule): v = momentum v - lr g in
    velocity/<p>; theta + v."""
    b = em.b
    lr, mom = hp(C.LEARNING_RATE), hp(C.MOMENTUM)

    def rule(g: str, vel: str, p: str) -> dict[str, str]:
        step = b.sub(b.mul(mom, vel), b.mul(lr, g))
        return {"step": step, "p": b.add(p, step)}

    def update(g: Chunks, theta: Chunks) -> dict[str, Any]:
        new = lay.map(rule, g=g, vel=lay.state(em, C.VELOCITY), p=theta)
        return {"p": new["p"], "step": new["step"], "state": {C.VELOCITY: new["step"]}}

    return update


def emit_sgd_step(em: Emission, o: FirstOrderStepOptions) -> None:
    """Heavy-ball SGD: v = momentum v - lr g; theta += v (per parameter or once over every
    parameter: o.multi_tensor)."""
    emit_first_order_step(em, o, sgd_rule)


SGD_STEP = SubgraphKind("sgd_step", FirstOrderStepOptions, every_step=True, emit=emit_sgd_step)


@register_optimizer
class Sgd(FirstOrderOptimizer):
    name = "sgd"
    Config = SgdConfig
    subgraphs = (SGD_STEP,)
    step_subgraph = SGD_STEP.name
    rule = staticmethod(sgd_rule)
    state_kinds = (C.VELOCITY,)

    @classmethod
    def rule_hyper_parameters(cls, cfg: SgdConfig, t: int, k: int) -> dict[str, float]:
        return {C.LEARNING_RATE: cfg.at("learning_rate", k), C.MOMENTUM: cfg.at("momentum", k)}

    @classmethod
    def previous_parameters(cls, theta: np.ndarray, state: Mapping[str, np.ndarray],
                            hp: Mapping[str, float]) -> np.ndarray:
        """theta_new = (1 - decay) theta + v (the velocity is the step), solved for theta."""
        step = np.asarray(state[C.VELOCITY], np.float64)
        return (np.asarray(theta, np.float64) - step) / (1.0 - hp.get(DECAY, 0.0))
