"""Where the runtime's subgraphs come from: the plan's stored graph of a resolved request, or
else the emission service (kfac_compiler.backend.service), which is the runtime's one arrow
into the back end and is imported only then. A saved plan run with the settings it was
compiled for has every graph stored, so training it imports no compiler internals
(docs/architecture.md, "When the runtime emits")."""
from __future__ import annotations

from typing import Any

import onnx

from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.plan import Plan
from kfac_compiler.requests import Request, Settings, request


def resolved_request(plan: Plan, device: str, name: str, **options: Any) -> Request:
    """The request for subgraph `name` with keyword `options`, resolved for `plan` on `device`."""
    return request(name, **options).resolve(Settings.of(plan, device))


def subgraph(plan: Plan, req: Request) -> tuple[onnx.ModelProto, SubgraphInfo, bool]:
    """(graph, info, stored) of the resolved request `req`: the plan's stored copy (stored
    True), else one the back end emits for it (cached per plan and request)."""
    found = plan.stored_subgraph(req)
    if found is not None:
        return found[0], found[1], True
    from kfac_compiler.backend.service import emit_for

    model, info = emit_for(plan, req)
    return model, info, False
