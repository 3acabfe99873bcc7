"""A new optimizer from one file: normalized gradient descent, theta <- theta - lr g / |g|.

Registering it makes `Trainer(plan, optimizer="normalized_gd")` (and `kfac-compiler train
--optimizer normalized_gd` once imported) train with it: its settings, the graph it emits and
its host-side step all live here (docs/extending.md, "An optimizer").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler.optimizers import Gram, Optimizer, OptimizerConfig, register_optimizer
from kfac_compiler.optimizers.settings import check_positive
from kfac_compiler.requests import SubgraphKind, SubgraphOptions


@dataclass
class NormalizedGdConfig(OptimizerConfig):
    name: ClassVar[str] = "normalized_gd"
    schedulable: ClassVar[tuple[str, ...]] = ("learning_rate",)  # its step reads config.at("learning_rate", k)
    eps: float = 1e-12

    def resolve(self, plan) -> None:
        if self.learning_rate is None:
            self.learning_rate = 0.1

    def validate(self) -> None:
        super().validate()
        check_positive("eps", self.eps)


@dataclass(frozen=True)
class NormalizedGdOptions(SubgraphOptions):  # the step's options: part of its graph's key
    eps: float = 1e-12


def emit_normalized_gd_step(em, o: NormalizedGdOptions) -> None:
    """One step: the gradient, its norm over all parameters, the update as state outputs."""
    b = em.b
    loss, _, grads, _ = em.loss_and_grads()
    norm = b.op("Sqrt", [b.add(Gram(em, {"g": grads})("g", "g"), b.const(o.eps))])
    scale = b.div(em.hp("learning_rate"), norm)
    for p in em.parts.params:
        em.state_output(p, b.sub(p, b.mul(scale, grads[p])))
    em.metric("loss", loss)
    em.metric("grad_norm", norm)
    em.metric("finite", b.cast(em.finite([loss, norm]), TensorProto.FLOAT))


@register_optimizer
class NormalizedGd(Optimizer):
    name = "normalized_gd"
    Config = NormalizedGdConfig
    # every_step: its session keeps spinning workers and the CPU arena, as the built-in steps'
    subgraphs = (SubgraphKind("normalized_gd_step", NormalizedGdOptions, every_step=True, emit=emit_normalized_gd_step),)

    def _program(self):
        return self.trainer.program("normalized_gd_step", eps=self.config.eps, weighted=self.trainer.weighted)

    def build(self) -> None:
        self._program()

    def step(self, data: dict[str, Any]) -> dict[str, float]:
        tr = self.trainer
        lr = self.config.at("learning_rate", tr.step_count)  # a schedule's value at this step
        out = self._program().run(tr.store, data, hp={C.hp("learning_rate"): lr})
        ok = out[C.FINITE] > 0.5
        tr.step_count += 1
        tr.applied_steps += int(ok)
        return {"step": float(tr.step_count - 1), "loss": out[C.LOSS], "grad_norm": out[C.metric("grad_norm")],
                "rejected": 0.0 if ok else 1.0}
