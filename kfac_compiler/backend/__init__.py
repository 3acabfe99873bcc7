"""The back end: emits the plan's subgraphs (training steps, statistics, inverses, ...)
following docs/runtime_contract.md, which is what the runtime relies on.

    model, info = emit(plan, request("kfac_step", stats_batch=64).resolve(Settings.of(plan)))
    model, info = emit_subgraph(plan, "kfac_step", stats_batch=64)   # the same, keywords

Modules: plan_parts.py (what the back end reads from a plan), emission.py (a subgraph under
construction and its inputs and outputs), forward.py (loss, gradients, forward clones),
shapes.py (the tensor shapes a finished subgraph declares, for ONNX Runtime's buffer reuse),
factors.py (factor statistics, moving averages, preconditioning), registry.py (the
emitters by subgraph kind, emit), subgraphs.py (the back end's own subgraphs; the
optimizers' steps come from kfac_compiler.optimizers), service.py (the runtime's entry:
emission cached per plan and request).
"""
from kfac_compiler.backend import subgraphs as _subgraphs  # noqa: F401  (registers the emitters)
from kfac_compiler.backend.emission import Emission
from kfac_compiler.backend.forward import ForwardPass
from kfac_compiler.backend.plan_parts import PlanParts, plan_parts
from kfac_compiler.backend.registry import SUBGRAPHS, emit, emit_subgraph, emitter, settings_of, subgraph

__all__ = ["SUBGRAPHS", "Emission", "ForwardPass", "PlanParts", "emit", "emit_subgraph", "emitter", "plan_parts",
           "settings_of", "subgraph"]
