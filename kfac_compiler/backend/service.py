"""The emission service: the one place the runtime reaches the back end through
(runtime/subgraphs.py), for a resolved request the plan does not store. It emits the graph
once per plan and request and keeps it while the plan lives; `emitted(plan)` lists what it
made (kfac_compiler.compile stores those a default run requested)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import onnx

from kfac_compiler.backend.registry import emit
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.progress import stage
from kfac_compiler.requests import Request

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan

Graph = tuple[onnx.ModelProto, SubgraphInfo]
_CACHE: dict[int, tuple[weakref.ref, dict[Request, Graph]]] = {}


def _cache(plan: Plan) -> dict[Request, Graph]:
    entry = _CACHE.get(id(plan))
    if entry is None or entry[0]() is not plan:
        entry = (weakref.ref(plan), {})
        _CACHE[id(plan)] = entry
        weakref.finalize(plan, _CACHE.pop, id(plan), None)
    return entry[1]


def emit_for(plan: Plan, req: Request) -> Graph:
    """The graph of resolved request `req` for `plan`, emitted on first use."""
    cache = _cache(plan)
    if req not in cache:
        with stage(f"emitted {req.name}"):
            cache[req] = emit(plan, req)
    return cache[req]


def emitted(plan: Plan) -> dict[Request, Graph]:
    """The graphs emitted for `plan` so far, by request."""
    return dict(_cache(plan))
