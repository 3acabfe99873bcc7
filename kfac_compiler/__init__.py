"""kfac_compiler: compile an exported ONNX model into an inspectable K-FAC curvature plan.

    import kfac_compiler as kc
    plan = kc.compile("model.onnx", loss="softmax_cross_entropy", output="logits")
    plan.save("plan_dir"); plan = kc.load_plan("plan_dir")
    loss, grads = kc.gradients(plan, inputs={"input": x}, targets=y)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kfac_compiler.errors import KfacError

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping

    import numpy as np
    import onnx

    from kfac_compiler.config import CompileConfig
    from kfac_compiler.plan import Plan

__version__ = "0.1.0"

def compile(model: str | os.PathLike | onnx.ModelProto, loss: str | None = None, output: str | None = None,
            config: CompileConfig | dict | str | os.PathLike | None = None, emit: bool = True,
            **overrides: Any) -> Plan:
    """Compile an ONNX model (path or ModelProto) into a Plan. `emit`: store the subgraphs a
    default K-FAC run at the plan's batch size (its budget's) requests, resolved for the CPU
    (and so for CUDA, where they resolve alike), so that such a run emits nothing."""
    from kfac_compiler.frontend import compile_frontend
    from kfac_compiler.progress import stage

    with stage("front end (load, layers, factors)"):
        plan = compile_frontend(model, loss=loss, output=output, config=config, **overrides)
    if emit:
        store_default_subgraphs(plan)
    return plan


def store_default_subgraphs(plan: Plan, optimizer: str = "kfac", batch_size: int | None = None) -> None:
    """Store in `plan` every subgraph a Trainer with `optimizer`'s defaults at `batch_size`
    (default: the batch the plan's budget assumed) builds on the CPU: the Trainer's own
    requests (made without building a session), so the stored set is exactly what such a run
    asks for. Where such a run refuses the plan's own settings (a compile damping below K-FAC's
    default min_damping), nothing is stored and a plan note says why: a run with settings that
    fit emits its graphs when it starts."""
    from kfac_compiler.errors import ConfigError
    from kfac_compiler.optimizers import make_config
    from kfac_compiler.passes.budget import REFERENCE_BATCH
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.subgraphs import subgraph

    batch = int(batch_size or (plan.costs or {}).get("batch_size") or REFERENCE_BATCH)
    try:  # the default settings are checked first: any later error (an op without a rule) is the plan's
        make_config(optimizer, plan)
    except ConfigError as e:
        plan.notes.append(f"no training subgraphs stored: a default {optimizer} run refuses this plan ({e}); "
                          "a run with settings that fit emits them when it starts")
        return
    trainer = Trainer(plan, optimizer=optimizer, device="cpu", batch_size=batch, comm=None, sessions=False)
    for req in trainer.requests():
        graph, info, _ = subgraph(plan, req)
        plan.store_subgraph(req, graph, info)


def load_plan(path: str | os.PathLike, check_source: bool = True) -> Plan:
    from kfac_compiler.plan import load_plan as _load

    return _load(path, check_source=check_source)


def gradients(plan: Plan, inputs: Mapping[str, Any], targets: Any, weights: Any = None,
              **options: Any) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients of the mean loss, keyed by initializer name (no framework needed).
    `weights`: optional per-example loss weights or a 0/1 mask; options: params=, device=."""
    from kfac_compiler.runtime import gradients as _gradients

    return _gradients(plan, inputs, targets, weights=weights, **options)


def __getattr__(name: str) -> Any:
    if name == "Plan":
        from kfac_compiler.plan import Plan

        return Plan
    if name == "Head":  # one loss head: compile(model, heads=[Head(output, loss, coefficient, targets), ...])
        from kfac_compiler.losses.heads import Head

        return Head
    raise AttributeError(name)


__all__ = ["Head", "KfacError", "Plan", "compile", "gradients", "load_plan", "store_default_subgraphs", "__version__"]
