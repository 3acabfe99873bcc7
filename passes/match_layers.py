"""Pass 2: find layers with the pattern library.

`match_layers(model, trainable)` runs every pattern of kfac_compiler.patterns against the
canonical model and returns the chosen matches in graph order. Overlaps are resolved
greedily: the larger pattern (more vertices) wins (MatMul+Add over MatMul), then the higher
`priority`, then the earlier registered pattern; an op node belongs to at most one match.
Parameters may appear in several matches (weight sharing): link_params groups them.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable

import networkx as nx
import onnx
from networkx.algorithms.isomorphism import MultiDiGraphMatcher

from kfac_compiler.graph import GraphView
from kfac_compiler.ir import LayerMatch, LayerUse
from kfac_compiler.patterns import PARAM, Binding, NoMatch, Pattern, patterns


def match_layers(
    model: onnx.ModelProto,
    trainable: Iterable[str],
    pattern_list: list[Pattern] | None = None,
    view: GraphView | None = None,
) -> list[LayerMatch]:
    """Non-overlapping pattern matches over the trainable parameters, in graph order."""
    view = view if view is not None else GraphView(model)
    trainable = set(trainable)
    pats = list(pattern_list) if pattern_list is not None else patterns()
    graph = view.to_networkx()
    order = {n.name: i for i, n in enumerate(view.nodes)}
    # drop initializer vertices that are not trainable parameters
    graph.remove_nodes_from([v for v, d in graph.nodes(data=True) if d["op_type"] == "Initializer" and v not in trainable])
    by_type: dict[str, list[str]] = {}
    for v, d in graph.nodes(data=True):
        by_type.setdefault("Initializer" if d["op_type"] == "Initializer" else d["op_type"], []).append(v)

    candidates: list[tuple[tuple, Binding]] = []
    for p_index, pat in enumerate(pats):
        for binding in _pattern_matches(pat, graph, view, by_type):
            key = (-pat.size, -pat.priority, p_index, min(order[n] for n in binding.op_nodes()))
            candidates.append((key, binding))
    candidates.sort(key=lambda kb: kb[0])

    claimed: set[str] = set()
    chosen: list[tuple[int, LayerMatch]] = []
    reasons: dict[tuple[str, ...], str] = {}
    for _, b in candidates:
        nodes = b.op_nodes()
        if claimed.intersection(nodes):
            continue
        try:
            if b.pattern.where is not None and not b.pattern.where(b):
                continue
            attrs = dict(b.pattern.attrs(b)) if b.pattern.attrs is not None else {}
            use = LayerUse(nodes=tuple(sorted(nodes, key=order.__getitem__)), input=b.input(), output=b.output())
        except NoMatch as e:
            reasons.setdefault(nodes, str(e))
            continue
        claimed.update(nodes)
        m = LayerMatch(kind=b.pattern.kind, pattern=b.pattern.name, weight=b.weight, bias=b.bias, use=use, attrs=attrs)
        chosen.append((min(order[n] for n in nodes), m))
    for nodes, reason in reasons.items():
        if not claimed.intersection(nodes):
            warnings.warn(reason, stacklevel=2)
    chosen.sort(key=lambda im: im[0])
    return [m for _, m in chosen]


def _domain(d: str) -> str:
    return "" if d in ("", "ai.onnx") else d


def _pattern_graph(pat: Pattern) -> nx.MultiDiGraph:
    pg = nx.MultiDiGraph()
    for pn in pat.nodes:
        pg.add_node(pn.key, pnode=pn)
    for e in pat.edges:
        pg.add_edge(e.src, e.dst, slots=tuple(e.slots))
    return pg


def _pattern_matches(pat: Pattern, graph: nx.MultiDiGraph, view: GraphView, by_type: dict[str, list[str]]):
    types = {"Initializer" if t == PARAM else t for t in pat.op_types()}
    if any(t not in by_type for t in types):
        return
    sub = graph.subgraph([v for t in types for v in by_type[t]])

    def node_match(g_attrs: dict, p_attrs: dict) -> bool:
        pn = p_attrs["pnode"]
        if pn.op_type == PARAM:
            if g_attrs["op_type"] != "Initializer":
                return False
            return pn.where is None or bool(pn.where(g_attrs["tensor"], view))
        if g_attrs["op_type"] != pn.op_type or _domain(g_attrs.get("domain", "")) != _domain(pn.domain):
            return False
        return pn.where is None or bool(pn.where(g_attrs["proto"], view))

    def edge_match(g_edges: dict, p_edges: dict) -> bool:
        available = [d["slot"] for d in g_edges.values()]
        for pe in p_edges.values():
            for i, slot in enumerate(available):
                if slot in pe["slots"]:
                    del available[i]
                    break
            else:
                return False
        return True

    matcher = MultiDiGraphMatcher(sub, _pattern_graph(pat), node_match=node_match, edge_match=edge_match)
    seen: set[frozenset] = set()
    for mapping in matcher.subgraph_monomorphisms_iter():
        inv = {p: g for g, p in mapping.items()}
        key = frozenset(inv.items())
        if key in seen:
            continue
        seen.add(key)
        b = Binding(pat, view, inv)
        if _closed(b, view):
            yield b


def _closed(b: Binding, view: GraphView) -> bool:
    """Intermediate tensors of the match feed only nodes of the match (and are not outputs)."""
    inner = set(b.op_nodes())
    out_node = b.mapping[b.pattern.output]
    for name in inner:
        if name == out_node:
            continue
        for t in view.node_by_name[name].output:
            if not t:
                continue
            if t in view.graph_outputs:
                return False
            if any(c.name not in inner for c in view.consumers.get(t, [])):
                return False
    return True
