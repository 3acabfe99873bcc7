"""Adam: settings, the `adam_step` graph, the host step (bias correction on the host)."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers.base import FirstOrderStepOptions, register_optimizer
from kfac_compiler.optimizers.first_order import (
    DECAY,
    FirstOrderConfig,
    FirstOrderOptimizer,
    HpNames,
    emit_first_order_step,
)
from kfac_compiler.optimizers.multi_tensor import Chunks, Layout
from kfac_compiler.optimizers.settings import check_positive, check_unit
from kfac_compiler.requests import SubgraphKind

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.plan import Plan

BETA1, BETA2, EPSILON = C.hp("beta1"), C.hp("beta2"), C.hp("epsilon")  # adam_step's own hyper-parameters
# 1 - beta1 and 1 - beta2, from the host: two nodes fewer in every step
ONE_MINUS_BETA1, ONE_MINUS_BETA2 = C.hp("one_minus_beta1"), C.hp("one_minus_beta2")


@dataclass
class AdamConfig(FirstOrderConfig):
    """Adam (Kingma & Ba); the host passes the bias-corrected learning rate each step.
    learning_rate and beta1 (alias momentum) take schedules; the bias correction uses the
    step's beta1 (1 - beta1_k^t)."""

    name: ClassVar[str] = "adam"
    schedulable: ClassVar[tuple[str, ...]] = ("learning_rate", "momentum", "beta1")
    beta1: float | None = None  # 0.9 unless given (or given as its alias momentum)
    beta2: float = 0.999
    epsilon: float = 1e-8
    momentum: float | None = None  # accepted for a uniform API: an alias of beta1 when given

    @classmethod
    def resumed_knobs(cls, stored: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint stores beta1 and its alias momentum both (resolved): an override of
        either replaces the pair, or the stored alias would win over a given beta1."""
        if any(given.get(k) is not None for k in ("beta1", "momentum")):
            stored = {k: v for k, v in stored.items() if k not in ("beta1", "momentum")}
        return super().resumed_knobs(stored, given)

    def resolve(self, plan: Plan | None) -> None:
        if self.learning_rate is None:
            self.learning_rate = 1e-3
        if self.momentum is not None and self.beta1 is not None and self.momentum != self.beta1:
            raise ConfigError(f"adam: beta1 {self.beta1!r} and its alias momentum {self.momentum!r} are both given; "
                              "give one")
        self.beta1 = next((v for v in (self.momentum, self.beta1) if v is not None), 0.9)
        self.momentum = self.beta1

    def validate(self) -> None:
        super().validate()
        check_unit("beta1", self.initial("beta1"))
        check_unit("beta2", self.beta2)
        check_positive("epsilon", self.epsilon)

    def lr_at(self, t: int, k: int = 0) -> float:
        """Bias-corrected learning rate for the t-th applied step (t >= 1), step count k (the
        schedules' clock)."""
        return self.at("learning_rate", k) * math.sqrt(1.0 - self.beta2**t) / (1.0 - self.at("beta1", k)**t)


def adam_rule(em: Emission, lay: Layout, hp: HpNames) -> Callable[[Chunks, Chunks], dict[str, Any]]:
    """Adam's update (first_order.emit_rule's rule): m, v moving averages of g and g^2 in
    adam_m/<p>, adam_v/<p>; theta - lr m / (sqrt v + eps) with the bias-corrected lr of the host."""
    b = em.b
    lr, b1, b2, eps = hp(C.LEARNING_RATE), hp(BETA1), hp(BETA2), hp(EPSILON)
    c1, c2 = hp(ONE_MINUS_BETA1), hp(ONE_MINUS_BETA2)

    def rule(g: str, m: str, v: str, p: str) -> dict[str, str]:
        m_new = b.add(b.mul(b1, m), b.mul(c1, g))
        v_new = b.add(b.mul(b2, v), b.mul(c2, b.mul(g, g)))
        size = b.mul(lr, b.div(m_new, b.add(b.op("Sqrt", [v_new]), eps)))  # the step is -size
        return {"m": m_new, "v": v_new, "size": size, "p": b.sub(p, size)}

    def update(g: Chunks, theta: Chunks) -> dict[str, Any]:
        new = lay.map(rule, g=g, m=lay.state(em, C.ADAM_M), v=lay.state(em, C.ADAM_V), p=theta)
        return {"p": new["p"], "step": new["size"], "state": {C.ADAM_M: new["m"], C.ADAM_V: new["v"]}}

    return update


def emit_adam_step(em: Emission, o: FirstOrderStepOptions) -> None:
    """Adam; the host passes the bias-corrected learning rate lr sqrt(1-b2^t)/(1-b1^t). The
    rule is emitted per parameter or once over every parameter (o.multi_tensor)."""
    emit_first_order_step(em, o, adam_rule)


ADAM_STEP = SubgraphKind("adam_step", FirstOrderStepOptions, every_step=True, emit=emit_adam_step)


@register_optimizer
class Adam(FirstOrderOptimizer):
    name = "adam"
    Config = AdamConfig
    subgraphs = (ADAM_STEP,)
    step_subgraph = ADAM_STEP.name
    rule = staticmethod(adam_rule)
    state_kinds = (C.ADAM_M, C.ADAM_V)

    @classmethod
    def rule_hyper_parameters(cls, cfg: AdamConfig, t: int, k: int) -> dict[str, float]:
        beta1 = cfg.at("beta1", k)
        return {C.LEARNING_RATE: cfg.lr_at(t, k), BETA1: beta1, BETA2: cfg.beta2, EPSILON: cfg.epsilon,
                ONE_MINUS_BETA1: 1.0 - beta1, ONE_MINUS_BETA2: 1.0 - cfg.beta2}

    @classmethod
    def previous_parameters(cls, theta: np.ndarray, state: Mapping[str, np.ndarray],
                            hp: Mapping[str, float]) -> np.ndarray:
        """theta_new = (1 - decay) theta - lr m / (sqrt v + eps), solved for theta."""
        m, v = (np.asarray(state[k], np.float64) for k in (C.ADAM_M, C.ADAM_V))
        size = hp[C.LEARNING_RATE] * m / (np.sqrt(v) + hp[EPSILON])
        return (np.asarray(theta, np.float64) + size) / (1.0 - hp.get(DECAY, 0.0))
