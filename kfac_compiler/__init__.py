"""kfac_compiler: compile an exported ONNX model into an inspectable K-FAC curvature plan.

    import kfac_compiler as kc
    plan = kc.compile("model.onnx", loss="softmax_cross_entropy", output="logits")
    plan.save("plan_dir"); plan = kc.load_plan("plan_dir")
    loss, grads = kc.gradients(plan, inputs={"input": x}, targets=y)
"""
from __future__ import annotations

from typing import Any

from kfac_compiler.errors import KfacError

__version__ = "0.1.0"

# Subgraphs emitted at compile time (the rest are emitted on demand by the runtime).
DEFAULT_SUBGRAPHS = (
    ("kfac_step", {"with_stats": True, "loss_after": True}),  # the Trainer's default step
    ("update_statistics", {}),
    ("inverse_update", {}),
)


def compile(model: Any, loss: str | None = None, output: str | None = None, config: Any = None,
            emit: bool = True, **overrides: Any):
    """Compile an ONNX model (path or ModelProto) into a Plan; `emit` adds the training subgraphs."""
    from kfac_compiler.frontend import compile_frontend

    plan = compile_frontend(model, loss=loss, output=output, config=config, **overrides)
    if emit:
        from kfac_compiler.backend import emit_subgraph

        for name, options in DEFAULT_SUBGRAPHS:
            graph, info = emit_subgraph(plan, name, **options)
            plan.subgraphs[name] = graph
            plan.subgraph_info[name] = info  # info.options: the resolved options
    return plan


def load_plan(path: str):
    from kfac_compiler.plan import load_plan as _load

    return _load(path)


def gradients(plan: Any, inputs: dict, targets: Any, weights: Any = None, **options: Any):
    """Loss and gradients of the mean loss, keyed by initializer name (no framework needed).
    `weights`: optional per-example loss weights or a 0/1 mask; options: params=, device=."""
    from kfac_compiler.runtime import gradients as _gradients

    return _gradients(plan, inputs, targets, weights=weights, **options)


def __getattr__(name: str):
    if name == "Plan":
        from kfac_compiler.plan import Plan

        return Plan
    if name == "Head":  # one loss head: compile(model, heads=[Head(output, loss, coefficient, targets), ...])
        from kfac_compiler.losses.heads import Head

        return Head
    raise AttributeError(name)


__all__ = ["Head", "KfacError", "Plan", "compile", "gradients", "load_plan", "__version__"]
