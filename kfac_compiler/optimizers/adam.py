"""Adam: settings, the `adam_step` graph, the host step (bias correction on the host)."""
from __future__ import annotations

import math
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
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    momentum: float | None = None  # accepted for a uniform API: an alias of beta1 when given

    def resolve(self, plan: Plan | None) -> None:
        if self.learning_rate is None:
            self.learning_rate = 1e-3
        if self.momentum is not None:
            self.beta1 = self.momentum
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


def emit_adam_step(em: Emission, o: FirstOrderStepOptions) -> None:
    """Adam; the host passes the bias-corrected learning rate lr sqrt(1-b2^t)/(1-b1^t). The
    rule is emitted per parameter or once over every parameter (o.multi_tensor)."""
    b = em.b
    loss, raw, _ = mean_loss_and_grads(em, accumulate=o.accumulate)
    lay = Layout(em, bool(o.multi_tensor))
    lr, b1, b2, eps = em.hp(C.LEARNING_RATE), em.hp(BETA1), em.hp(BETA2), em.hp(EPSILON)
    c1, c2 = em.hp(ONE_MINUS_BETA1), em.hp(ONE_MINUS_BETA2)
    theta, g_raw = lay.pack({p: p for p in lay.params}), lay.pack(raw)
    g = regularized_chunks(em, lay, clipped(em, lay, g_raw, o.clip), theta, o.l2)

    def rule(g: str, m: str, v: str, p: str) -> dict[str, str]:
        m_new = b.add(b.mul(b1, m), b.mul(c1, g))
        v_new = b.add(b.mul(b2, v), b.mul(c2, b.mul(g, g)))
        size = b.mul(lr, b.div(m_new, b.add(b.op("Sqrt", [v_new]), eps)))  # the step is -size
        return {"m": m_new, "v": v_new, "size": size, "p": b.sub(p, size)}

    new = lay.map(rule, g=g, m=lay.state(em, C.ADAM_M), v=lay.state(em, C.ADAM_V), p=decayed(em, lay, theta, o.decay))
    for p, t in lay.unpack(new["p"]).items():
        em.state_output(p, t)
    lay.write_state(em, C.ADAM_M, new["m"])
    lay.write_state(em, C.ADAM_V, new["v"])
    emit_baseline_metrics(em, loss, lay, new["size"], g_raw)


ADAM_STEP = SubgraphKind("adam_step", FirstOrderStepOptions, every_step=True, emit=emit_adam_step)


@register_optimizer
class Adam(FirstOrderOptimizer):
    name = "adam"
    Config = AdamConfig
    subgraphs = (ADAM_STEP,)
    step_subgraph = ADAM_STEP.name

    def hyper_parameters(self, k: int) -> dict[str, float]:
        cfg = self.config
        beta1 = cfg.at("beta1", k)
        return {C.LEARNING_RATE: cfg.lr_at(self.trainer.applied_steps + 1, k), BETA1: beta1, BETA2: cfg.beta2,
                EPSILON: cfg.epsilon, ONE_MINUS_BETA1: 1.0 - beta1, ONE_MINUS_BETA2: 1.0 - cfg.beta2}
