"""The emitters of the back end's subgraph kinds, by name, and `emit`, which runs the
emitter of a resolved request on a fresh Emission (kfac_compiler/requests.py: the kinds and
their options; an optimizer's kind carries its own emitter)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import onnx

from kfac_compiler import requests as R
from kfac_compiler.backend.emission import Emission
from kfac_compiler.backend.plan_parts import PlanParts, plan_parts
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import ConfigError

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan

Emitter = Callable[[Emission, Any], None]

SUBGRAPHS: dict[str, Emitter] = {}  # the back end's own; the optimizers' come with their kinds


def subgraph(name: str) -> Callable[[Emitter], Emitter]:
    """Decorator: register `fn(em, options)` as the emitter of the back end's kind `name`."""
    def deco(fn: Emitter) -> Emitter:
        SUBGRAPHS[name] = fn
        return fn

    return deco


def emitter(name: str) -> Emitter:
    """The emitter of subgraph kind `name`: the kind's own (an optimizer's) or the back end's."""
    found = R.kind(name)
    fn = found.emit or SUBGRAPHS.get(name)
    if fn is None:
        raise ConfigError(f"subgraph {name!r} has no emitter")
    return fn


def settings_of(parts: PlanParts, device: str = "cpu") -> R.Settings:
    """The settings a request for `parts` is resolved against."""
    return R.Settings(parts.mode, parts.num_samples, parts.inverse_method, parts.damping_split, device,
                      parts.conv_gather)


def emit(plan: Plan | PlanParts, req: R.Request) -> tuple[onnx.ModelProto, SubgraphInfo]:
    """Emit the graph of `req` (resolved: see kfac_compiler.requests) for `plan`; its info
    records the kind and the resolved options."""
    parts = plan_parts(plan)
    opts = req.options
    if opts.unresolved():
        raise ValueError(f"emit: request {req.name!r} is not resolved ({', '.join(opts.unresolved())}); "
                         "resolve it with Request.resolve(Settings.of(plan, device)) first")
    if opts.weighted != parts.weighted:
        parts = dataclasses.replace(parts, weighted=opts.weighted)
    em = Emission.start(parts, conv_gather=opts.conv_gather is not False)
    emitter(req.name)(em, opts)
    model, info = em.finish(req.name)
    info.kind, info.options = req.name, opts.to_json()
    return model, info


def emit_subgraph(plan: Plan | PlanParts, name: str, device: str = "cpu",
                  **options: Any) -> tuple[onnx.ModelProto, SubgraphInfo]:
    """Emit subgraph `name` with keyword `options`, resolved for `plan` on `device` (a
    shorthand of emit for tests, benchmarks and the lower-level API)."""
    parts = plan_parts(plan)
    return emit(parts, R.request(name, **options).resolve(settings_of(parts, device)))
