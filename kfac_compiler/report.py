"""Render a Plan for people: a table, JSON (docs/frontend.md) or a graphviz dot graph.

    render(plan, "table" | "json" | "dot") -> str
"""
from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from typing import Any

from kfac_compiler.blocks import plan_blocks
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import ConfigError, human_bytes
from kfac_compiler.graph import held_elsewhere
from kfac_compiler.plan import Plan, factor_json

FORMATS = ("table", "json", "dot")

KIND_COLORS = {
    "fully_connected": "#9ecae1",
    "conv": "#a1d99b",
    "depthwise_conv": "#c7e9c0",
    "conv_transpose": "#74c476",
    "embedding": "#fdd0a2",
    "scale_and_shift": "#dadaeb",
    "broadcast": "#fcbba1",
    "generic": "#d9d9d9",
}


def render(plan: Plan, fmt: str = "table", ranks: int | None = None, wide: bool = False,
           param_groups: Any = None) -> str:
    """The plan in `fmt`; with `ranks`, also how a data-parallel run on that many ranks
    shares the inverse work (table and json); `wide`: the table's every column (render_table);
    `param_groups` (K-FAC's knob): each layer's optimizer in a run with those groups (table
    and json)."""
    if fmt == "table":
        return render_table(plan, wide, param_groups) + ("" if ranks is None else _rank_lines(plan, ranks))
    if fmt == "json":
        return render_json(plan, ranks, param_groups)
    if fmt == "dot":
        return render_dot(plan)
    raise ConfigError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


# --------------------------------------------------------------------------- json
def block_costs(plan: Plan) -> dict[str, dict[str, Any]]:
    """Per layer: inverse method (emitted or host), FLOPs of one statistics update per
    example and of one inverse update (by the method shown first: for "auto" the CPU's)."""
    from kfac_compiler.linalg import AUTO_METHOD, concrete_method

    method = plan.inverse.method
    costs: dict[str, dict[str, Any]] = {}

    def label(block, m: str) -> str:
        where = "host" if block.inverse_is_host(m) else "graph"
        return f"{'eigh' if where == 'host' and m not in ('eigh', 'cholesky') else m} ({where})"

    cpu_method = concrete_method(method, "cpu")  # what inverse_flops counts
    for name, block in plan_blocks(plan).items():
        if method == AUTO_METHOD:  # the runtime picks per device
            on_cpu, on_cuda = label(block, cpu_method), label(block, concrete_method(method, "cuda"))
            shown = (f"auto: {on_cpu} on CPU and CUDA" if on_cpu == on_cuda
                     else f"auto: {on_cpu} on CPU, {on_cuda} on CUDA")
        else:
            shown = label(block, method)
        costs[name] = {
            "inverse_method": shown,
            "stats_flops_per_example": int(block.stats_flops(1)),
            "inverse_flops": int(block.inverse_flops(cpu_method)),
            "apply_flops": int(block.apply_flops()),
        }
    return costs


def subgraph_summary(plan: Plan) -> list[dict[str, Any]]:
    """The stored subgraphs: kind, file, node count, resolved options, state slots read and
    written (a kind may be stored with several options: kfac_step with and without statistics)."""
    out = []
    for stem, model in plan.subgraphs.items():
        info = plan.subgraph_info.get(stem) or SubgraphInfo()
        out.append({
            "name": info.kind or stem,
            "file": f"{stem}.onnx",
            "nodes": len(model.graph.node),
            "options": dict(info.options),
            "reads": len(info.state_inputs),
            "writes": len(info.state_outputs),
            "metrics": list(info.metrics),
        })
    return out


def layer_optimizers(plan: Plan, param_groups: Any = None) -> tuple[dict[str, Any], list[Any]]:
    """({layer: its ParamGroup}, the groups) of a K-FAC run with `param_groups` (optimizers/groups.py:
    the selection the runtime makes; a layer in no group is K-FAC's)."""
    from kfac_compiler.optimizers.groups import select

    groups = select(plan, param_groups) if param_groups else []
    return {name: g for g in groups for name in g.layers}, groups


def summary(plan: Plan, param_groups: Any = None) -> dict[str, Any]:
    """{"layers": [{name, kind, params, uses, approximation, factors, optimizer, group, ...}],
    "totals", ..., "param_groups" (with param_groups)}."""
    layers = []
    costs = block_costs(plan)
    grouped, groups = layer_optimizers(plan, param_groups)
    for layer in plan.layers:
        specs = plan.factors.get(layer.name)
        layers.append(
            {
                "name": layer.name,
                "kind": layer.kind,
                "params": list(layer.params),
                "uses": [{"nodes": list(u.nodes), "input": u.input, "output": u.output} for u in layer.uses],
                "approximation": layer.approximation,
                "factors": None if specs is None else [
                    {k: v for k, v in factor_json(s).items() if k in ("name", "shape", "dtype", "bytes")} for s in specs
                ],
                "estimator": plan.estimator.mode,
                **costs[layer.name],
                "optimizer": grouped[layer.name].optimizer if layer.name in grouped else "kfac",
                "group": grouped[layer.name].name if layer.name in grouped else None,
            }
        )
    extra = {"param_groups": [{"name": g.name, "optimizer": g.optimizer, "options": dict(g.knobs),
                               "layers": list(g.layers), "params": list(g.params)} for g in groups]} if groups else {}
    return {
        "layers": layers,
        "totals": plan.totals(),
        "output": plan.output,
        "loss": plan.loss.to_json(),
        "estimator": dataclasses.asdict(plan.estimator),
        "schedule": plan.schedule.to_json(),
        "frozen": [{"name": n, "reason": plan.frozen_reason(n)} for n in plan.frozen],
        "held_elsewhere": [{"name": n, "shape": list(h["shape"]),
                            "holders": [{"name": k, "shape": list(v)} for k, v in h["holders"].items()]}
                           for n, h in held_elsewhere(plan.model).items()],
        "costs": {k: v for k, v in _kfac_costs(plan.costs, grouped).items() if k != "layers"},
        "subgraphs": subgraph_summary(plan),
        **extra,
    }


def rank_assignment(plan: Plan, ranks: int) -> list[dict[str, Any]]:
    """Per rank of a data-parallel run: the blocks whose inverses it computes and broadcasts,
    their refresh FLOPs and inverse bytes. The runtime's assignment (refresh.inverse_owners
    on the blocks' refresh costs, in the plan's layer order), by the CPU's method."""
    from kfac_compiler.optimizers.kfac.refresh import inverse_owners

    costs = block_costs(plan)
    blocks = plan_blocks(plan)
    layers = [layer.name for layer in plan.layers if blocks[layer.name].inverse_specs()]
    owners = inverse_owners({name: float(costs[name]["inverse_flops"]) for name in layers}, ranks)
    out = []
    for rank in range(ranks):
        mine = [name for name in layers if owners[name] == rank]
        out.append({"rank": rank, "blocks": mine,
                    "inverse_flops": sum(costs[name]["inverse_flops"] for name in mine),
                    "inverse_bytes": sum(sp.nbytes for name in mine for sp in blocks[name].inverse_specs())})
    return out


def _rank_lines(plan: Plan, ranks: int) -> str:
    rows = rank_assignment(plan, ranks)
    lines = ["", f"inverses on {ranks} ranks (each computed by one rank and broadcast to the others; "
                 "docs/distributed.md):"]
    for r in rows:
        lines.append(f"  rank {r['rank']}: {len(r['blocks'])} blocks, {r['inverse_flops'] / 1e9:.3g} GFLOP, "
                     f"broadcasts {human_bytes(r['inverse_bytes'])}: {', '.join(r['blocks']) or '-'}")
    generic = [layer.name for layer in plan.layers if layer.kind == "generic" and plan.factors.get(layer.name)]
    if generic and ranks > 1:
        lines.append(f"  note: the generic blocks ({', '.join(generic)}) all-reduce their pseudo-example (4 bytes "
                     "a parameter) on every statistics step before squaring it, so their factors are one "
                     "process's (docs/distributed.md)")
    return "\n".join(lines) + "\n"


def render_json(plan: Plan, ranks: int | None = None, param_groups: Any = None) -> str:
    doc = summary(plan, param_groups)
    if ranks is not None:
        doc["ranks"] = rank_assignment(plan, ranks)
    return json.dumps(doc, indent=1)


# -------------------------------------------------------------------------- table

def _factor_text(specs) -> str:
    if specs is None:
        return "?"
    if not specs:
        return "-"
    return ", ".join(f"{s.name} {'x'.join(str(d) for d in s.shape) or 'scalar'}" for s in specs)


TABLE_WIDTH = 100  # inspect's default table width (--wide: every column, names whole)
HEAD_WIDTH = TABLE_WIDTH  # the header's prose lines are wrapped to this many columns
MIN_NAME_WIDTH = 16


def _dims(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _cut(name: str, width: int) -> str:
    """`name` in at most `width` characters, its middle replaced by "~" when it is longer
    (the start says where in the model, the end which layer)."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "~" + name[len(name) - (width - 1 - head):]


def render_table(plan: Plan, wide: bool = False, param_groups: Any = None) -> str:
    """The plan as text. By default it fits TABLE_WIDTH columns: the per-layer FLOP columns
    are left to `wide` (and the json), long layer names are cut in the middle; the inverse
    method gets a column only when the layers differ in it. With `param_groups` (a K-FAC run's
    first-order groups) an optimizer column says which rule trains each layer, and a group's
    layers show no factors, bytes or FLOPs: the run keeps none for them."""
    shapes = plan.param_shapes
    header = ("layer", "kind", "params", "uses", "approximation", "factors", "bytes", "inverse", "stats FLOP/ex", "inverse FLOP",
              "precond FLOP", "optimizer")
    costs = block_costs(plan)
    grouped, groups = layer_optimizers(plan, param_groups)
    idle = {"stats_flops_per_example": 0, "inverse_flops": 0, "apply_flops": 0, "inverse_method": "-"}
    rows = []
    tot_params = tot_uses = 0
    tot_bytes: int | None = 0
    tot_flops = [0, 0, 0]
    for layer in plan.layers:
        n = int(sum(math.prod(shapes[p]) for p in layer.params))
        group = grouped.get(layer.name)
        specs = [] if group else plan.factors.get(layer.name)
        nbytes = None if specs is None else sum(s.nbytes for s in specs)
        tot_params += n
        tot_uses += layer.num_uses
        tot_bytes = None if tot_bytes is None or nbytes is None else tot_bytes + nbytes
        c = idle if group else costs[layer.name]
        tot_flops[0] += c["stats_flops_per_example"]
        tot_flops[1] += c["inverse_flops"]
        tot_flops[2] += c["apply_flops"]
        rows.append(
            (layer.name, layer.kind, f"{n:,}", str(layer.num_uses), layer.approximation or "?", _factor_text(specs),
             "-" if group else human_bytes(nbytes), c["inverse_method"], f"{c['stats_flops_per_example']:,}", f"{c['inverse_flops']:,}",
             f"{c['apply_flops']:,}", f"{group.optimizer} ({group.name})" if group else "kfac")
        )
    totals = (f"total ({len(plan.layers)} layers)", "", f"{tot_params:,}", str(tot_uses), "", "", human_bytes(tot_bytes),
              "", f"{tot_flops[0]:,}", f"{tot_flops[1]:,}", f"{tot_flops[2]:,}", "")
    methods = {r[7] for r in rows if r[7] != "-"} or {"-"}
    inverse_text = f"inverses:  {plan.schedule.inverse.method} (per layer below)"
    shown = list(range(len(header)))
    if len(methods) == 1:  # one method for every layer: said once in the header, not on every row
        inverse_text = f"inverses:  {methods.pop()},"
        shown.remove(7)
    if not wide:
        shown = [i for i in shown if i < 8 or (i == 11 and groups)]
    elif not groups:
        shown.remove(11)
    header, totals = tuple(header[i] for i in shown), tuple(totals[i] for i in shown)
    rows = [tuple(r[i] for i in shown) for r in rows]
    right = {k for k, i in enumerate(shown) if i in (2, 3, 6, 8, 9, 10)}
    widths = [max(len(r[i]) for r in [header, totals] + rows) for i in range(len(header))]
    if not wide:  # cut the layer names to what the other columns leave
        room = TABLE_WIDTH - sum(widths[1:]) - 2 * (len(widths) - 1)
        widths[0] = max(min(widths[0], room), MIN_NAME_WIDTH, len(totals[0]))
        rows = [(_cut(r[0], widths[0]), *r[1:]) for r in rows]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    src = plan.source_path or "<in-memory model>"
    loss = plan.loss.build().summary()
    if plan.loss.recognised_from:
        loss = f"{loss} (recognised from {plan.loss.recognised_from})"
    inv = plan.schedule.inverse
    prose = [
        f"estimator: {plan.estimator.mode} x{plan.estimator.num_samples}   "
        f"ema_decay {plan.schedule.ema_decay}   damping {plan.schedule.damping}   "
        f"statistics every {plan.schedule.stats.update_period} steps",
        f"{inverse_text} every {inv.update_period} steps",
        _coverage_line(plan),
        *_cost_lines(_kfac_costs(plan.costs, grouped)),
        *_group_lines(plan, groups),
    ]
    head = [
        f"model:     {src}",
        f"output:    {plan.output}   loss: {loss}",
        *(part for text in prose
          for part in textwrap.wrap(text, HEAD_WIDTH, subsequent_indent="  ", break_on_hyphens=False)),
        "",
    ]
    body = [line(header), sep] + [line(r) for r in rows] + [sep, line(totals)]
    if plan.frozen:
        body += ["", f"frozen ({len(plan.frozen)}, not trained):"]
        body += [f"  {name:<{max(map(len, plan.frozen))}}  {plan.frozen_reason(name)}" for name in plan.frozen]
    held = held_elsewhere(plan.model)
    if held:  # the user's parameters folded or lowered into the plan's own layout
        body += ["", f"your parameters in the plan's layout ({len(held)}; Trainer.parameters() and the trained model are in yours):"]
        body += [f"  {name} {_dims(h['shape'])}: " + ", ".join(f"{k} {_dims(v)}" for k, v in h["holders"].items())
                 for name, h in held.items()]
    subs = subgraph_summary(plan)
    if subs:
        body += ["", "subgraphs (open in Netron):"]
        body += [
            f"  {s['file']:<24} {s['nodes']:>5} nodes   reads {s['reads']:>3} state slots, writes {s['writes']:>3}"
            + (f"   {_variant(s, subs)}" if _variant(s, subs) else "")
            for s in subs
        ]
    return "\n".join(head + body) + "\n"


def _group_lines(plan: Plan, groups: list[Any]) -> list[str]:
    """One line per first-order group of a K-FAC run (render_table's param_groups)."""
    if not groups:
        return []
    shapes = plan.param_shapes
    lines = [f"group {g.name}: {g.describe()} trains {len(g.layers)} layer{'s' * (len(g.layers) != 1)}, "
             f"{sum(math.prod(shapes[p]) for p in g.params):,} values ({', '.join(g.layers)})" for g in groups]
    kfac = sum(1 for layer in plan.layers if not any(layer.name in g.layers for g in groups))
    return lines + [f"K-FAC preconditions the other {kfac} layer{'s' * (kfac != 1)}; the groups' layers have no "
                    "factors, statistics or inverses in the run"]


def _variant(sub: dict[str, Any], subs: list[dict[str, Any]]) -> str:
    """The options that tell a stored subgraph from the others of its kind ("with_stats=False",
    "layers: 4"), empty when it is the only one."""
    others = [o["options"] for o in subs if o["name"] == sub["name"] and o is not sub]
    mine = sub["options"]
    keys = sorted({k for o in others for k in mine if o.get(k) != mine[k]})
    return ", ".join(f"{k}: {len(mine[k])}" if isinstance(mine[k], (list, tuple)) else f"{k}={mine[k]}" for k in keys)


def _coverage_line(plan: Plan) -> str:
    """How much of the model the structured blocks cover: the share of parameter elements in
    layers of a kind other than generic (whose blocks know nothing of the layer's structure)."""
    t = plan.totals()
    total, structured = t["param_elements"], t["structured_elements"]
    generic = [layer.name for layer in plan.layers if layer.kind == "generic"]
    share = 100.0 * structured / total if total else 100.0
    rest = (f"; generic: {total - structured:,} in {len(generic)} layer{'s' if len(generic) != 1 else ''}"
            if generic else "")
    return f"coverage:  {share:.1f}% of the {total:,} parameter elements in structured blocks{rest}"


def _kfac_costs(costs: dict[str, Any], grouped: dict[str, Any]) -> dict[str, Any]:
    """plan.costs without the curvature work of the layers a first-order group trains (a K-FAC
    run with param_groups: they keep no factors, inverses or preconditioning), so the header's
    cost line and the JSON match the table; the totals as they are without groups."""
    per_layer = costs.get("layers") or {}
    gone = [per_layer[name] for name in grouped if name in per_layer]
    needed = ("apply_flops", "stats_flops_per_update", "inverse_flops_per_refresh", "stats_period", "inverse_period",
              "forward_backward_flops")
    if not gone or any(costs.get(k) is None for k in needed):
        return costs
    out = dict(costs)
    out["apply_flops"] = costs["apply_flops"] - sum(c.get("apply", 0) for c in gone)
    out["stats_flops_per_update"] = costs["stats_flops_per_update"] - sum(c.get("stats", 0) for c in gone)
    out["inverse_flops_per_refresh"] = costs["inverse_flops_per_refresh"] - sum(c.get("inverse", 0) for c in gone)
    out["factor_bytes"] = costs.get("factor_bytes", 0) - sum(c.get("factor_bytes", 0) for c in gone)
    out["curvature_flops_per_step"] = (out["apply_flops"] + out["stats_flops_per_update"] / costs["stats_period"]
                                       + out["inverse_flops_per_refresh"] / costs["inverse_period"])
    base = costs["forward_backward_flops"]
    out["overhead"] = out["curvature_flops_per_step"] / base if base else None
    out["without_groups"] = sorted(grouped)
    return out


def _cost_lines(costs: dict[str, Any]) -> list[str]:
    """The cost-aware choice's prediction (passes/budget.py), per step at its reference batch."""
    base = costs.get("forward_backward_flops")
    shown = ("stats_period", "inverse_period", "stats_flops_per_update", "inverse_flops_per_refresh", "apply_flops",
             "qmodel_flops", "curvature_flops_per_step", "batch_size", "stats_batch_size", "overhead_budget", "overhead")
    if not base or any(costs.get(k) is None for k in shown):  # an older or hand-edited plan's partial prediction
        return []
    s, r = costs["stats_period"], costs["inverse_period"]
    stats, inv, apply = costs["stats_flops_per_update"], costs["inverse_flops_per_refresh"], costs["apply_flops"]
    step = base + costs["qmodel_flops"] + costs["curvature_flops_per_step"]
    return [
        f"cost at batch {costs['batch_size']} (statistics on {costs['stats_batch_size']}; budget.overhead "
        f"{costs['overhead_budget']:g}), in the layers' forward+backward ({base / 1e9:.3g} GFLOP, 3x their forward: parameter-free MatMuls such as attention's left out): preconditioning "
        f"{apply / base:.2f}x, statistics {stats / base:.2f}x / {s} = {stats / s / base:.2f}x, inverses "
        f"{inv / base:.2f}x / {r} = {inv / r / base:.2f}x: curvature {costs['overhead']:.2f}x; with the quadratic "
        f"model a K-FAC step ~{step / base:.1f}x an SGD step in FLOPs"
        + (f" (the curvature of K-FAC's layers: without {', '.join(costs['without_groups'])})"
           if costs.get("without_groups") else ""),
    ]


# ---------------------------------------------------------------------------- dot
def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def layer_edges(plan: Plan) -> list[tuple[str, str]]:
    """Data-flow edges between layers (and graph inputs / the output), as (src, dst) names."""
    view = plan.view()
    tensor_layers: dict[str, list[str]] = {}
    for layer in plan.layers:
        for u in layer.uses:
            for n in u.nodes:
                node = view.node_by_name.get(n)
                if node is None:
                    continue
                for o in node.output:
                    if o:
                        tensor_layers.setdefault(o, []).append(layer.name)
    inputs = set(view.graph_inputs)

    def sources(starts: list[str], own: str | None) -> list[str]:
        found: list[str] = []
        seen: set[str] = set()
        stack = list(starts)
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            owners = [l for l in tensor_layers.get(t, []) if l != own]
            if owners:
                found.extend(owners)
                continue
            if t in inputs:
                found.append(f"input:{t}")
                continue
            node = view.producer.get(t)
            if node is not None:
                stack.extend(i for i in node.input if i)
        return list(dict.fromkeys(found))

    edges: list[tuple[str, str]] = []
    for layer in plan.layers:
        inner = set()
        starts = []
        for u in layer.uses:
            for n in u.nodes:
                node = view.node_by_name.get(n)
                if node is not None:
                    inner.update(node.output)
        for u in layer.uses:
            for n in u.nodes:
                node = view.node_by_name.get(n)
                if node is None:
                    continue
                starts.extend(i for i in node.input if i and i not in inner and i not in layer.params)
        for src in sources(starts, layer.name):
            edges.append((src, layer.name))
    for src in sources([plan.output], None):
        edges.append((src, f"output:{plan.output}"))
    return list(dict.fromkeys(edges))


def render_dot(plan: Plan) -> str:
    shapes = plan.param_shapes
    lines = [
        "digraph plan {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
    ]
    for t in plan.view().graph_inputs:
        lines.append(f"  {_q('input:' + t)} [label={_q(t)}, shape=ellipse, fillcolor=white];")
    lines.append(f"  {_q('output:' + plan.output)} [label={_q(plan.output + ' (' + plan.loss.kind + ')')}, shape=ellipse, fillcolor=white];")
    for layer in plan.layers:
        n = int(sum(math.prod(shapes[p]) for p in layer.params))
        uses = f", {layer.num_uses} uses" if layer.num_uses > 1 else ""
        label = f"{layer.name}\\n{layer.kind}: {layer.approximation}\\n{n:,} params{uses}\\n{_factor_text(plan.factors.get(layer.name))}"
        color = KIND_COLORS.get(layer.kind, "#ffffff")
        lines.append(f"  {_q(layer.name)} [label=\"{label.replace(chr(34), '')}\", fillcolor={_q(color)}];")
    for src, dst in layer_edges(plan):
        lines.append(f"  {_q(src)} -> {_q(dst)};")
    if plan.frozen:  # one note box; "\l" ends a left-aligned line in graphviz labels
        rows = "".join(f"{n}: {plan.frozen_reason(n)}".replace('"', "'") + "\\l" for n in plan.frozen)
        lines.append(f'  "frozen" [label="frozen (not trained)\\l{rows}", shape=note, fillcolor="#eeeeee"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
