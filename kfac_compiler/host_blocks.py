"""The Fisher blocks' numpy twins for host-side work at run time: inverses of blocks that do
not emit theirs (host methods, exact damping, the RNN series blocks) or whose emitted inverse
failed its check, matrix powers, the lower-level API's per-layer products. This is the one
place the runtime and the optimizer policies reach kfac_compiler.blocks, on first use; a
default run whose blocks all emit their inverses never does (docs/architecture.md)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan


def host_blocks(plan: Plan, layers: Sequence[str] | None = None) -> dict[str, Any]:
    """{layer: FisherBlock} of the plan's layers (all, or `layers`); PlanError for a layer
    the plan does not have."""
    from kfac_compiler.blocks import plan_blocks

    return plan_blocks(plan, layers)


def refresh_costs(plan: Plan, layers: Sequence[str], method: str) -> dict[str, float]:
    """FLOPs of one inverse refresh by `method` (a concrete method) per layer: the plan's
    recorded costs (passes/budget.py) when they were computed for that method and the plan's
    damping split, else the blocks' own count."""
    costs: Mapping[str, Any] = plan.costs or {}
    recorded = costs.get("layers") or {}
    same = costs.get("inverse_method") == method and costs.get("damping_split") == plan.inverse.damping_split
    if same and all("inverse" in (recorded.get(layer) or {}) for layer in layers):
        return {layer: float(recorded[layer]["inverse"]) for layer in layers}
    blocks = host_blocks(plan, layers)
    return {layer: float(blocks[layer].inverse_flops(method)) for layer in layers}
