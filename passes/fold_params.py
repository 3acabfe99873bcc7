"""Pass: weights an exporter assembles at run time from initializers, folded into initializers.

torch.export without its optimizer writes an nn.LSTM / nn.GRU's W, R and B as Slice + Concat +
Unsqueeze of torch's own tensors (torch's gate order i,f,g,o becomes ONNX's i,o,f,c; the two
biases are concatenated). The recurrent lowering (passes/recurrent.py) gives structured blocks
only to weights that are initializers, so such a layer fell to generic blocks.

`fold_assembled(model, targets)` returns a NEW model where each tensor of `targets` that is a
rearrangement of float initializers is an initializer itself (named after the tensor, as
torch's optimizer names the initializer it folds). A group of targets is folded when

  * what computes them reads only float initializers (the sources), constants, and `Shape`s
    of tensors whose asked-for dims are static (no graph input, no subgraph, no other domain);
  * evaluating it on the sources' element indices, and again on random values, shows every
    element of the targets to be a copy of one source element, and every source element to
    be copied exactly once (a permutation: trained values and gradients map back exactly);
  * nothing else reads the sources or the tensors between them and the targets.

The sources and the nodes between them and the targets are removed. Where each element came
from is recorded in the model's metadata (`FOLDED_PARAMS_KEY`): {target: {"shape", "sources":
{source: dims}, "runs": [[source, target offset, source offset, length], ...]}} over flattened
elements; `kfac_compiler.graph.fold_recurrent_params` assembles the sources back from (trained)
values of the targets or their lowered pieces, and `graph.source_holders` says which
initializers of the compiled model hold a source's elements.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kfac_compiler.builder import subgraphs
from kfac_compiler.contract import FOLDED_PARAMS_KEY
from kfac_compiler.graph import FLOAT_TYPES, GraphView, attrs_of
from kfac_compiler.passes.recurrent import lowered_pieces

_DEFAULT_DOMAINS = ("", "ai.onnx")
MAX_NODES = 2000  # a construction larger than this is left alone (evaluated three times otherwise)


def fold_assembled(model: onnx.ModelProto, targets: Sequence[str], keep_source_name: bool = False) -> onnx.ModelProto:
    """A copy of `model` with the foldable `targets` turned into initializers (the model
    itself when none is). `keep_source_name`: a target that re-lays out one source alone takes
    the source's name (the tensor is renamed where it is read), so that a layer keeps the
    torch parameter's name."""
    view = GraphView(model)
    cones: dict[str, _Cone] = {}
    for t in dict.fromkeys(targets):
        cone = _cone(view, t) if t not in view.initializers and t in view.producer else None
        if cone is not None:
            cones[t] = cone
    folded: dict[str, np.ndarray] = {}
    record: dict[str, dict] = {}
    drop_nodes: set[int] = set()
    drop_sources: set[str] = set()
    for group in _groups(cones):
        result = _fold_group(view, [(t, cones[t]) for t in group])
        if result is None:
            continue
        values, runs, dead = result
        folded.update(values)
        record.update(runs)
        drop_nodes |= dead
        drop_sources |= {s for t in group for s in cones[t].sources}
    if not folded:
        return model
    outputs = set(view.graph_outputs)
    rename = {t: next(iter(rec["sources"])) for t, rec in record.items()
              if keep_source_name and len(rec["sources"]) == 1 and t not in outputs
              and sum(next(iter(rec["sources"])) in r["sources"] for r in record.values()) == 1}
    folded = {rename.get(t, t): v for t, v in folded.items()}
    record = {rename.get(t, t): r for t, r in record.items()}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    kept = [n for n, orig in zip(g.node, view.nodes) if id(orig) not in drop_nodes]
    del g.node[:]
    g.node.extend(kept)
    gone = drop_sources | {o for n in view.nodes if id(n) in drop_nodes for o in n.output}
    inits = [t for t in g.initializer if t.name not in drop_sources]
    inits += [numpy_helper.from_array(v, name) for name, v in folded.items()]
    del g.initializer[:]
    g.initializer.extend(inits)
    for field in (g.input, g.value_info):
        keep = [vi for vi in field if vi.name not in gone]
        del field[:]
        field.extend(keep)
    for vi in g.value_info:
        vi.name = rename.get(vi.name, vi.name)
    for node in g.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    old = {p.key: p.value for p in m.metadata_props}
    merged = {**json.loads(old.get(FOLDED_PARAMS_KEY, "{}")), **record}
    helper.set_model_props(m, {**old, FOLDED_PARAMS_KEY: json.dumps(merged, sort_keys=True)})
    return m


class _Cone:
    """What computes one target: its nodes (graph order), float initializers read (sources)
    and the static values of the Shape nodes it stops at."""

    def __init__(self) -> None:
        self.nodes: dict[int, onnx.NodeProto] = {}
        self.sources: set[str] = set()
        self.shapes: dict[str, np.ndarray] = {}


def _cone(view: GraphView, target: str) -> _Cone | None:
    cone, seen, stack = _Cone(), set(), [target]
    while stack:
        t = stack.pop()
        if t in seen or not t:
            continue
        seen.add(t)
        if t in view.initializers:
            if view.initializers[t].data_type in FLOAT_TYPES:
                cone.sources.add(t)
            continue
        node = view.producer.get(t)
        if node is None or node.domain not in _DEFAULT_DOMAINS or subgraphs(node):
            return None  # a graph input, another domain's op, control flow
        if node.op_type == "Shape":
            value = static_shape(view, node)
            if value is None:
                return None
            cone.shapes[t] = value
            continue
        cone.nodes[id(node)] = node
        if len(cone.nodes) > MAX_NODES:
            return None
        stack.extend(node.input)
    return cone if cone.sources else None


# ops whose first output is a re-layout of their first input (the others: constant settings);
# a Slice is one where it reverses an axis (flax's ConvTranspose flips its kernel with steps
# -1): fold_assembled folds only chains whose result is a permutation of the initializer
RELAYOUT_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Transpose", "Flatten", "Slice"})


def relayout_ends(model: onnx.ModelProto) -> list[str]:
    """The ends of chains of re-layout ops (RELAYOUT_OPS) that start at a float initializer
    read by nothing else: what patterns looking for an initializer in an op's slot cannot see
    through (torch.export writes a GroupNorm's affine as Unsqueeze of torch's [C] tensor).
    `fold_assembled` folds those that are a permutation of the initializer."""
    view = GraphView(model)
    pieces = lowered_pieces(model)
    outputs = set(view.graph_outputs)
    ends = []
    for name, t in view.initializers.items():
        if t.data_type not in FLOAT_TYPES or name in pieces:
            continue
        end, ops = name, []
        while end not in outputs:
            readers = view.consumers.get(end, [])
            if len(readers) != 1 or readers[0].op_type not in RELAYOUT_OPS or readers[0].domain not in _DEFAULT_DOMAINS \
                    or list(readers[0].input).count(end) != 1 or readers[0].input[0] != end:
                break
            ops.append(readers[0].op_type)
            end = readers[0].output[0]
        # Transpose(W) + one MatMul: the matmul_transposed pattern reads it as it is; read by
        # several, no pattern is closed over the shared Transpose, so it folds to W's transpose
        readers = view.consumers.get(end, [])
        known = ops == ["Transpose"] and len(readers) == 1 and readers[0].op_type == "MatMul"
        if ops and not known:
            ends.append(end)
    return ends


def shape_dims(view: GraphView, node: onnx.NodeProto) -> list | None:
    """The dims a Shape node asks for in the inferred shapes (ints where static), or None."""
    shape = view.shape(node.input[0])
    if shape is None:
        return None
    a = attrs_of(node)
    return list(shape[slice(a.get("start", 0), a.get("end"))])


def static_shape(view: GraphView, node: onnx.NodeProto) -> np.ndarray | None:
    """Shape(x)'s value when the dims it asks for are static in the inferred shapes."""
    dims = shape_dims(view, node)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return np.asarray(dims, np.int64)


def _groups(cones: dict[str, _Cone]) -> list[list[str]]:
    """Targets sharing a source fold together (one permutation of their sources)."""
    groups: list[tuple[set[str], list[str]]] = []
    for t, cone in cones.items():
        hit = [grp for grp in groups if grp[0] & cone.sources]
        sources, members = set(cone.sources), [t]
        for grp in hit:
            sources |= grp[0]
            members = grp[1] + members
            groups.remove(grp)
        groups.append((sources, members))
    return [members for _, members in groups]


def _fold_group(view: GraphView, group: list[tuple[str, _Cone]]):
    """(values, record, nodes to drop) when the group's targets are a permutation of their
    sources' elements and nothing else reads what lies between, else None."""
    nodes: dict[int, onnx.NodeProto] = {}
    shapes: dict[str, np.ndarray] = {}
    sources: set[str] = set()
    for _, cone in group:
        nodes.update(cone.nodes)
        shapes.update(cone.shapes)
        sources |= cone.sources
    targets = [t for t, _ in group]
    order = sorted(sources, key=list(view.initializers).index)
    # the data path: nodes reading a source, directly or through the data path
    data: set[str] = set(order)
    dead: set[int] = set()
    for node in view.nodes:
        if id(node) in nodes and any(i in data for i in node.input):
            dead.add(id(node))
            data.update(o for o in node.output if o)
    outputs = set(view.graph_outputs)
    for t in data - set(targets):
        readers = view.consumers.get(t, [])
        if t in outputs or any(id(r) not in nodes for r in readers):
            return None
    if not set(targets) <= data:
        return None
    arrays = {s: view.array(s) for s in order}
    sizes = [arrays[s].size for s in order]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(offsets[-1])
    index = {s: np.arange(offsets[i], offsets[i + 1], dtype=np.float64).reshape(arrays[s].shape)
             for i, s in enumerate(order)}
    rng = np.random.default_rng(0)
    probe = rng.standard_normal(total)
    noise = {s: probe[offsets[i]:offsets[i + 1]].reshape(arrays[s].shape) for i, s in enumerate(order)}
    got_index = evaluate_nodes(view, nodes, shapes, index, targets)
    got_noise = evaluate_nodes(view, nodes, shapes, noise, targets)
    if got_index is None or got_noise is None:
        return None
    idx = {}
    for t, a, b in zip(targets, got_index, got_noise):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != np.float64 or a.shape != b.shape or not np.all((a >= 0) & (a < total) & (a == np.floor(a))):
            return None
        k = a.astype(np.int64)
        if not np.array_equal(probe[k], b):
            return None  # not a copy of the source elements (arithmetic on the way)
        idx[t] = k
    flat_idx = np.concatenate([k.ravel() for k in idx.values()])
    if flat_idx.size != total or not np.array_equal(np.sort(flat_idx), np.arange(total)):
        return None  # an element dropped or copied twice: not a reparametrization
    flat = np.concatenate([arrays[s].ravel() for s in order])
    owner = np.repeat(np.arange(len(order)), sizes)
    values, record = {}, {}
    for t, k in idx.items():
        values[t] = flat[k].reshape(k.shape)
        record[t] = {"shape": list(k.shape), "sources": {s: list(arrays[s].shape) for s in order
                                                         if np.any(owner[k.ravel()] == order.index(s))},
                     "runs": _runs(k.ravel(), owner, offsets, order)}
    return values, record, dead


def evaluate_nodes(view: GraphView, nodes: dict[int, onnx.NodeProto], shapes: dict[str, np.ndarray],
              sources: dict[str, np.ndarray], targets: list[str]) -> list | None:
    """The targets computed by the cone's nodes from `sources` (onnx.reference), or None."""
    from onnx.reference import ReferenceEvaluator

    body = [n for n in view.nodes if id(n) in nodes]
    reads = {i for n in body for i in n.input if i}
    inits = [numpy_helper.from_array(v, s) for s, v in sources.items()]
    inits += [view.initializers[i] for i in sorted(reads) if i in view.initializers and i not in sources]
    inits += [numpy_helper.from_array(v, name) for name, v in shapes.items()]
    graph = helper.make_graph(body, "fold", [], [helper.make_empty_tensor_value_info(t) for t in targets],
                              initializer=inits)
    sub = helper.make_model(graph, opset_imports=list(view.model.opset_import))
    sub.ir_version = view.model.ir_version
    try:
        return list(ReferenceEvaluator(sub).run(None, {}))
    except Exception:  # noqa: BLE001 - an op the reference evaluator cannot run: not folded
        return None


def _runs(k: np.ndarray, owner: np.ndarray, offsets: np.ndarray, order: list[str]) -> list[list]:
    """[[source, target offset, source offset, length], ...]: maximal stretches of the
    flattened target copying consecutive elements of one source."""
    if k.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(k) != 1) | (np.diff(owner[k]) != 0)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [k.size]])
    out = []
    for s, e in zip(starts, ends):
        src = int(owner[k[s]])
        out.append([order[src], int(s), int(k[s] - offsets[src]), int(e - s)])
    return out


__all__ = ["MAX_NODES", "RELAYOUT_OPS", "fold_assembled", "relayout_ends", "shape_dims", "static_shape"]
