"""Common subexpressions of an emitted model merged: a node computing what an earlier node in
its graph or an enclosing one already computes (same op, attributes and inputs) is dropped
and its readers read the earlier output.

The emitters build each piece on its own (a second backward pass for the factor statistics,
the quadratic model's forward clones, the refresh's per-block chains) and repeat the nodes
that depend only on what they share: ReLU masks, weight transposes, im2col Gathers, Shape
arithmetic, the export's Constant nodes. ONNX Runtime merges such copies itself within one
graph, but not across an If's boundary, and every emitted node costs its session setup
(which grows faster than linearly in the nodes). The result computes bit for bit the same.

An op whose leading outputs do not depend on which optional outputs a node asks for
(EXTENSIBLE: MaxPool, whose gradient asks for the Indices the forward's node leaves out) runs
once per graph: a later node that asks for more of them extends the first node's outputs.
"""
from __future__ import annotations

from collections.abc import Iterable

import onnx

from kfac_compiler.builder import subgraphs

# Ops whose two runs differ (random draws) or that have no output to share.
NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                              "Multinomial", "Bernoulli", "Dropout"})
# Identity is left alone: a reduction point is one Identity per point (backend.emission).
KEPT = NONDETERMINISTIC | {"Identity"}
# Ops whose leading outputs are the same whatever optional outputs the node also produces
# (ONNX's MaxPool: Y with or without Indices). Not across an If's boundary: a forward node
# extended for a gradient taken only inside a branch would pay for the Indices on every run.
EXTENSIBLE = frozenset({"MaxPool"})

Key = tuple[str, str, tuple[str, ...], tuple[bytes, ...], int]


def merge_duplicates(graph: onnx.GraphProto, pinned: Iterable[str] = ()) -> dict[str, str]:
    """Merge duplicate nodes of `graph` and its subgraphs in place; the tensors in `pinned`
    (and every graph output) keep their producers. Returns {dropped output: kept output}."""
    rename: dict[str, str] = {}
    _merge(graph, {}, rename, set(pinned))
    return rename


def _key(node: onnx.NodeProto) -> Key | None:
    if node.op_type in KEPT or node.domain not in ("", "ai.onnx") or subgraphs(node):
        return None
    outputs = 0 if node.op_type in EXTENSIBLE else len(node.output)  # EXTENSIBLE: any outputs
    return (node.domain, node.op_type, tuple(node.input),
            tuple(a.SerializeToString() for a in node.attribute), outputs)


def _merge(graph: onnx.GraphProto, outer: dict[Key, list[str]], rename: dict[str, str], pinned: set[str]) -> None:
    """One graph, seeing the nodes of the enclosing graphs that come before it (`outer`)."""
    seen = dict(outer)
    local: dict[Key, onnx.NodeProto] = {}  # this graph's first node of each key
    local_pinned = pinned | {o.name for o in graph.output}
    keep: list[onnx.NodeProto] = []
    for node in graph.node:
        for i, t in enumerate(node.input):
            if t in rename:
                node.input[i] = rename[t]
        for g in subgraphs(node):
            _merge(g, seen, rename, pinned)
        key = _key(node)
        if key is not None and not local_pinned & set(node.output):
            if node.op_type in EXTENSIBLE and key in local and _wants_more(node, local[key]):
                _extend(local[key], node)
                seen[key] = list(local[key].output)
            earlier = seen.get(key)
            if (earlier is not None and len(earlier) >= len(node.output)
                    and all(s or not o for o, s in zip(node.output, earlier))):
                rename.update({o: s for o, s in zip(node.output, earlier) if o and o != s})
                continue
            seen[key], local[key] = list(node.output), node
        keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    kept_info = [vi for vi in graph.value_info if vi.name not in rename]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)


def _wants_more(node: onnx.NodeProto, first: onnx.NodeProto) -> bool:
    """Whether `node` asks for an output `first` (an EXTENSIBLE op's node) does not produce."""
    return any(o and (i >= len(first.output) or not first.output[i]) for i, o in enumerate(node.output))


def _extend(first: onnx.NodeProto, node: onnx.NodeProto) -> None:
    """`first` also produces the outputs only `node` asks for, under `node`'s names."""
    while len(first.output) < len(node.output):
        first.output.append("")
    for i, o in enumerate(node.output):
        if o and not first.output[i]:
            first.output[i] = o
