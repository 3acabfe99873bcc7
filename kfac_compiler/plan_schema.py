"""The schema of plan.json, checked on load: a hand-edited or damaged plan is a one-line
PlanError naming the file and the entry, never a KeyError or TypeError deep in the runtime.

Two checks: `check_document` (the JSON's shape: required keys, their types, no unknown keys
where plan.json has a fixed layout) before anything is built from it, and `check_plan` (what
the entries must agree on with the model: parameters, layers, output, inputs, loss) once the
model is loaded. The layout is the one Plan.to_json writes (docs/frontend.md).
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from kfac_compiler.errors import KfacError, PlanError

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan

SUBGRAPH_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class _Opt:
    """`spec` or null."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


class _Map:
    """An object of string keys, each value a `spec`."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


class _Open(dict):
    """An object with these keys (a trailing '?': optional) and any others (a loss's options)."""


class _NonEmpty(list):
    """A non-empty list."""


NUMBER = "number"  # an int or a finite float (JSON allows NaN and Infinity; no entry means them)
ANY = "any"

_TENSOR = {"name": str, "shape": _Opt([ANY]), "dtype": _Opt(str), "from_input?": _Opt(str)}
_FACTOR = {"name": str, "shape": [int], "dtype?": str, "role?": str, "bytes?": int}
_LAYER = {
    "name": str, "kind": str, "pattern?": str, "params": _NonEmpty([str]),
    "uses": [{"nodes": [str], "input": str, "output": str}], "attrs?": _Map(ANY),
    "approximation?": _Opt(str), "factors?": _Opt([_FACTOR]), "notes?": [str],
}
_SUBGRAPH = {"file?": str, "inputs?": [_Map(ANY)], "outputs?": [_Map(ANY)], "reads?": [str], "writes?": [str],
             "info?": _Map(ANY)}
DOCUMENT = {
    "schema_version": int,
    "source": {"path": _Opt(str), "sha256?": str, "external?": _Map([int])},
    "model?": str,
    "output": str,
    "loss": _Open({"kind": str, "recognised_from?": _Opt(str), "recognised_node?": _Opt(str), "notes?": [str]}),
    "inputs": [_TENSOR],
    "targets": _TENSOR,
    "trainable": [str],
    "frozen": [str],
    "frozen_reasons?": _Map(str),
    "retied?": _Map(_Map(ANY)),
    "costs?": _Open({"batch_size?": int, "stats_batch_size?": int, "overhead_budget?": NUMBER, "min_dim?": int,
                     "forward_backward_flops?": NUMBER, "apply_flops?": NUMBER, "stats_flops_per_update?": NUMBER,
                     "sampled_backward_flops?": NUMBER, "qmodel_flops?": NUMBER, "inverse_flops_per_refresh?": NUMBER,
                     "inverse_method?": str, "damping_split?": str, "stats_period?": int, "inverse_period?": int, "curvature_flops_per_step?": NUMBER,
                     "overhead?": _Opt(NUMBER), "factor_bytes?": int, "layers?": _Map(_Map(NUMBER))}),
    "layers": _NonEmpty([_LAYER]),
    "estimator?": {"mode?": str, "num_samples?": int},
    "schedule?": {"ema_decay?": NUMBER, "damping?": NUMBER,
                  "inverse?": {"method?": str, "update_period?": _Opt(int), "damping_split?": str},
                  "stats?": {"update_period?": _Opt(int)}},
    "dtype?": str,
    "totals?": _Map(ANY),
    "config?": _Map(ANY),
    "notes?": [str],
    "subgraphs?": _Map(_SUBGRAPH),
}


def _describe(spec: Any) -> str:
    if spec is str:
        return "a string"
    if spec is int:
        return "an integer"
    if spec is NUMBER:
        return "a finite number"
    if isinstance(spec, _Opt):
        return _describe(spec.spec) + " or null"
    if isinstance(spec, _NonEmpty):
        return "a non-empty list"
    if isinstance(spec, list):
        return "a list"
    return "an object"


_SCALARS = {str: lambda v: isinstance(v, str),
            int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _check(value: Any, spec: Any, where: str, fail) -> None:
    if spec is ANY:
        return
    if isinstance(spec, _Opt):
        if value is not None:
            _check(value, spec.spec, where, fail)
        return
    if spec is str or spec is int or spec is NUMBER:
        if not _SCALARS[spec](value):
            fail(where, f"expected {_describe(spec)}, got {value!r}"[:200])
        return
    if isinstance(spec, list):
        if not isinstance(value, list) or (isinstance(spec, _NonEmpty) and not value):
            fail(where, f"expected {_describe(spec)}, got {value!r}"[:200])
        for i, item in enumerate(value):
            _check(item, spec[0], f"{where}[{i}]", fail)
        return
    if not isinstance(value, dict):
        fail(where, f"expected {_describe(spec)}, got {value!r}"[:200])
    if isinstance(spec, _Map):
        for key, item in value.items():
            _check(item, spec.spec, f"{where}.{key}", fail)
        return
    keys = {k.rstrip("?"): k.endswith("?") for k in spec}
    for key, optional in keys.items():
        sub = spec[key + "?" if optional else key]
        if key in value:
            _check(value[key], sub, f"{where}.{key}" if where else key, fail)
        elif not optional:
            fail(f"{where}.{key}" if where else key, "missing")
    if not isinstance(spec, _Open):
        unknown = [k for k in value if k not in keys]
        if unknown:
            fail(f"{where}.{unknown[0]}" if where else unknown[0], f"unknown entry (known: {', '.join(keys)})")


def check_document(doc: Any, plan_json: str) -> None:
    """The JSON document of plan.json has plan.json's layout (PlanError naming the entry)."""

    def fail(where: str, problem: str) -> None:
        raise PlanError(f"{plan_json!r}: {where or 'top level'}: {problem}; recompile the model")

    _check(doc, DOCUMENT, "", fail)
    for name in doc.get("subgraphs", {}):
        if not SUBGRAPH_NAME.match(name) or name in ("model", "plan"):
            fail(f"subgraphs.{name}", "not a subgraph name")


def check_plan(plan: Plan, plan_json: str) -> None:
    """The entries agree with each other and with the model (PlanError naming the entry):
    every trainable parameter is an initializer and in exactly one layer, the output and
    the inputs exist, the loss and the schedule are usable."""

    def fail(where: str, problem: str) -> None:
        raise PlanError(f"{plan_json!r}: {where}: {problem}; recompile the model")

    g = plan.model.graph
    inits = {t.name for t in g.initializer}
    for i, p in enumerate(plan.trainable):
        if p not in inits:
            fail(f"trainable[{i}]", f"{p!r} is not an initializer of the plan's model")
    owner: dict[str, str] = {}
    names = set()
    trainable = set(plan.trainable)
    tensors = {o.name for o in g.output} | {o for n in g.node for o in n.output if o}
    values = tensors | {i.name for i in g.input} | inits
    nodes = {n.name for n in g.node}
    for i, layer in enumerate(plan.layers):
        if layer.name in names:
            fail(f"layers[{i}].name", f"layer {layer.name!r} appears twice")
        names.add(layer.name)
        for j, use in enumerate(layer.uses):
            for key, tensor in (("input", use.input), ("output", use.output)):
                if tensor not in values:
                    fail(f"layers[{i}].uses[{j}].{key}", f"the model has no tensor named {tensor!r}")
            unknown = [n for n in use.nodes if n not in nodes]
            if unknown:
                fail(f"layers[{i}].uses[{j}].nodes", f"the model has no node named {unknown[0]!r}")
        for p in layer.params:
            if p not in trainable:
                fail(f"layers[{i}].params", f"{p!r} is not a trainable parameter of the plan")
            if p in owner:
                fail(f"layers[{i}].params", f"{p!r} is already a parameter of layer {owner[p]!r}")
            owner[p] = layer.name
    unowned = [p for p in plan.trainable if p not in owner]
    if unowned:
        fail("layers", f"trainable parameter {unowned[0]!r} is in no layer")
    if plan.output not in tensors:
        fail("output", f"the model has no tensor named {plan.output!r}")
    outputs = [o.name for o in g.output]
    if plan.output not in outputs:  # the canonical model ends at the trained output
        fail("output", f"{plan.output!r} is not the plan model's output {outputs}")
    _check_stored_factors(plan, fail)
    data_inputs = [vi.name for vi in plan.data_inputs]
    declared = [t.name for t in plan.inputs]
    if sorted(declared) != sorted(data_inputs):
        fail("inputs", f"{declared} are not the model's data inputs {data_inputs}")
    try:
        plan.loss.build()
    except KfacError as e:
        fail("loss", str(e))
    _check_schedule(plan, fail)


def _check_stored_factors(plan: Plan, fail) -> None:
    """The stored subgraphs' factor slots are the layers' factors as plan.json lists them
    (an edited factor list or shape had been shown by inspect while the graphs trained
    the compiled ones)."""
    from kfac_compiler import contract as C

    listed = {layer: {f.name: tuple(f.shape) for f in specs} for layer, specs in plan.factors.items() if specs}
    for name, info in plan.subgraph_info.items():
        for slot, spec in info.state_specs.items():
            parsed = C.parse_slot(slot)
            if parsed.kind != C.FACTOR or parsed.owner not in listed:
                continue
            want = listed[parsed.owner].get(parsed.item)
            if want is None or want != tuple(spec.shape):
                fail(f"layers[{parsed.owner!r}].factors", f"subgraph {name!r} keeps factor {parsed.item!r} of shape "
                     f"{list(spec.shape)}, which the layer lists as {list(want) if want else 'absent'}")


def _check_schedule(plan: Plan, fail) -> None:
    from kfac_compiler.config import DAMPING_SPLITS, DTYPES
    from kfac_compiler.contract import ESTIMATION_MODES
    from kfac_compiler.linalg import METHODS

    est, sched = plan.estimator, plan.schedule
    if est.mode not in ESTIMATION_MODES:
        fail("estimator.mode", f"{est.mode!r} is not one of {', '.join(ESTIMATION_MODES)}")
    if est.num_samples < 1:
        fail("estimator.num_samples", f"{est.num_samples} is not >= 1")
    if not 0 <= sched.ema_decay < 1:
        fail("schedule.ema_decay", f"{sched.ema_decay} is outside [0, 1)")
    if not sched.damping > 0:
        fail("schedule.damping", f"{sched.damping} is not > 0")
    if sched.inverse.method not in METHODS:
        fail("schedule.inverse.method", f"{sched.inverse.method!r} is not one of {', '.join(METHODS)}")
    if sched.inverse.damping_split not in DAMPING_SPLITS:
        fail("schedule.inverse.damping_split", f"{sched.inverse.damping_split!r} is not one of {', '.join(DAMPING_SPLITS)}")
    for key, period in (("schedule.inverse.update_period", sched.inverse.update_period),
                        ("schedule.stats.update_period", sched.stats.update_period)):
        if period is not None and period < 1:
            fail(key, f"{period} is not >= 1")
    if plan.dtype not in DTYPES:
        fail("dtype", f"{plan.dtype!r} is not one of {', '.join(DTYPES)}")
