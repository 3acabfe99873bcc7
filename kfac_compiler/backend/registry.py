"""The subgraph registry: which emitter builds each subgraph of the contract, with which
options, and emit_subgraph, which runs one on a fresh Emission."""
from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Callable

import onnx

from kfac_compiler.backend.emission import Emission
from kfac_compiler.backend.plan_parts import PlanParts, plan_parts
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import emitters as optimizer_emitters

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan

Emitter = Callable[..., None]


SUBGRAPHS: dict[str, Emitter] = {}  # the back end's own; the optimizers' come from their plugins


def subgraph(name: str):
    """Decorator: register `fn(em, **options)` as the emitter of subgraph `name`."""
    def deco(fn: Emitter) -> Emitter:
        SUBGRAPHS[name] = fn
        return fn

    return deco


def emitter(name: str) -> Emitter:
    """The emitter of subgraph `name`: the back end's, or a registered optimizer's."""
    plugins = optimizer_emitters()
    clash = sorted(set(plugins) & set(SUBGRAPHS))
    if clash:
        raise ConfigError(f"an optimizer emits a subgraph named {clash[0]!r}, which the back end already emits")
    found = {**SUBGRAPHS, **plugins}
    if name not in found:
        raise ConfigError(f"unknown subgraph {name!r}; choose one of {', '.join(found)}")
    return found[name]


def resolved_options(plan: "Plan | PlanParts", name: str, **options) -> dict[str, Any]:
    """Every option subgraph `name` is emitted with, defaults and plan settings filled in
    (mode, num_samples, inverse method, damping split, weighted): equal resolved options mean
    an identical subgraph, so the runtime can key its caches on them."""
    params = list(inspect.signature(emitter(name)).parameters.values())[1:]
    out: dict[str, Any] = {p.name: p.default for p in params}
    unknown = [k for k in options if k not in out and k != "weighted"]
    if unknown:
        raise ConfigError(f"subgraph {name!r} has no option {unknown[0]!r}; its options are {sorted(out)}")
    out.update({k: v for k, v in options.items() if v is not None})
    parts = plan_parts(plan)
    plan_defaults = {"mode": parts.mode, "num_samples": parts.num_samples, "method": parts.inverse_method}
    for key, value in plan_defaults.items():
        if key in out and out[key] is None:
            out[key] = value
    out["weighted"] = bool(options.get("weighted", False))
    out["damping_split"] = parts.damping_split
    return out


def emit_subgraph(plan: "Plan | PlanParts", name: str, **options) -> tuple[onnx.ModelProto, SubgraphInfo]:
    """Emit subgraph `name` of the contract for `plan`; info.options records the resolved
    options (see resolved_options)."""
    parts = plan_parts(plan)
    resolved = resolved_options(parts, name, **options)
    weighted = bool(options.pop("weighted", False))
    if weighted != parts.weighted:
        parts = dataclasses.replace(parts, weighted=weighted)
    em = Emission.start(parts)
    emitter(name)(em, **options)
    model, info = em.finish(name)
    info.options = resolved
    return model, info
