"""What the back end needs from a plan, independent of the plan's storage format."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx

from kfac_compiler.blocks import FisherBlock, plan_blocks
from kfac_compiler.ir import Layer
from kfac_compiler.losses import Loss

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan


@dataclass
class PlanParts:
    """What the back end needs from a plan, independent of the plan's storage format."""

    model: onnx.ModelProto
    output: str
    loss: Loss
    params: list[str]
    layers: list[Layer]
    mode: str = "gradients"
    num_samples: int = 1
    inverse_method: str = "auto"
    blocks: dict[str, FisherBlock] | None = None
    weighted: bool = False  # an "example_weights" data input ([N], or per position) weights the loss
    damping_split: str = "pi"  # how the blocks split damping between Kronecker factors
    conv_gather: bool = True  # the plan's compile option (requests.Settings)


def plan_parts(plan: Plan | PlanParts) -> PlanParts:
    """Extract PlanParts from a kfac_compiler.plan.Plan (a PlanParts is returned as is)."""
    if isinstance(plan, PlanParts):
        return plan
    return PlanParts(
        model=plan.model,
        output=plan.output,
        loss=plan.loss.build(),
        params=list(plan.trainable),
        layers=list(plan.layers),
        mode=plan.estimator.mode,
        num_samples=int(plan.estimator.num_samples),
        inverse_method=plan.inverse.method,
        blocks=plan_blocks(plan),
        damping_split=plan.inverse.damping_split,
        conv_gather=bool((plan.config or {}).get("conv_gather", True)),
    )
