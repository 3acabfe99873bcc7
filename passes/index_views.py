"""Pass: a float initializer read through constant-index lookups and re-layouts, rewritten as
one Gather of its flattened elements.

torch.export without its optimizer writes Swin's `table[relative_position_index]` as
GatherND(table, constant indices) + Reshape + Transpose + Unsqueeze before the Add to the
attention scores; the `broadcast` pattern knows a table looked up by a `Gather` on axis 0 and
added (patterns/builtin.py, broadcast_gather_add). `index_views(model)` returns a NEW model
where such a chain from an initializer P to its end T (every op in INDEX_OPS or
fold_params.RELAYOUT_OPS, reading the previous tensor as its data input and constants
otherwise, the only reader of each tensor on the way, at least one lookup) becomes

    T = Gather(Reshape(P, [-1]), K)        K: int64 of T's shape, constant

when evaluating the chain on P's element indices, and again on random values, shows every
element of T to be a copy of one element of P (K says which; elements may repeat). The
Reshape is then folded into P by canonicalize's re-layout fold (passes/fold_params.py), so
the broadcast block sees a flat table P and its K indices. A lone Gather on axis 0 (what the
pattern already knows, rows of a position table) is left alone, and so is a view whose
one-hot (table elements x looked-up elements, MAX_ONE_HOT) the broadcast block could not
afford: a full-size Swin-T's last two stages (12 and 24 heads: 169 x 12 table elements
times 12 x 49 x 49 lookups is 58M).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kfac_compiler.graph import FLOAT_TYPES, GraphView, attrs_of, fresh_name
from kfac_compiler.passes.fold_params import RELAYOUT_OPS, evaluate_nodes

INDEX_OPS = frozenset({"Gather", "GatherND", "GatherElements"})
_DEFAULT_DOMAINS = ("", "ai.onnx")
MAX_ELEMENTS = 1 << 22  # a larger table or lookup is left alone (evaluated twice in float64)
# the broadcast block adds the per-example gradients of the K looked-up elements into the flat
# table through a [P, K] one-hot: views whose P * K is larger are left alone (generic)
MAX_ONE_HOT = 1 << 24


def index_views(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with each constant-index view of an initializer rewritten as one
    Gather (the model itself when there is none)."""
    view = GraphView(model)
    rewrites: list[tuple[str, list[onnx.NodeProto], np.ndarray]] = []
    for name, t in view.initializers.items():
        if t.data_type in FLOAT_TYPES:
            chain = _chain(view, name)
            k = _indices(view, name, chain) if chain else None
            if k is not None:
                rewrites.append((name, chain, k))
    if not rewrites:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    taken = view.all_names()
    replace: dict[str, list[onnx.NodeProto]] = {}  # last chain node's name -> the new nodes
    drop: set[str] = set()
    for p, chain, k in rewrites:
        end = chain[-1].output[0]
        flat, flat_shape, idx = (fresh_name(f"{p}/flat{s}", taken) for s in ("", "/shape", "/indices"))
        replace[chain[-1].name] = [
            helper.make_node("Constant", [], [flat_shape], name=flat_shape,
                             value=numpy_helper.from_array(np.array([-1], np.int64))),
            helper.make_node("Reshape", [p, flat_shape], [flat], name=flat),
            helper.make_node("Constant", [], [idx], name=idx, value=numpy_helper.from_array(k)),
            helper.make_node("Gather", [flat, idx], [end], name=fresh_name(f"{end}/Gather", taken), axis=0),
        ]
        drop |= {n.name for n in chain}
    nodes = []
    for node in g.node:
        nodes.extend(replace.get(node.name, [] if node.name in drop else [node]))
    del g.node[:]
    g.node.extend(nodes)
    gone = {o for _, chain, _ in rewrites for n in chain[:-1] for o in n.output}
    keep = [vi for vi in g.value_info if vi.name not in gone]
    del g.value_info[:]
    g.value_info.extend(keep)
    return m


def _chain(view: GraphView, source: str) -> list[onnx.NodeProto] | None:
    """The single-reader chain of lookups and re-layouts from `source`, or None when it has no
    lookup or is a lone Gather on axis 0."""
    chain: list[onnx.NodeProto] = []
    t, outputs = source, set(view.graph_outputs)
    while t not in outputs:
        readers = view.consumers.get(t, [])
        if len(readers) != 1:
            break
        node = readers[0]
        if (node.domain not in _DEFAULT_DOMAINS or node.op_type not in INDEX_OPS | RELAYOUT_OPS
                or not node.input or node.input[0] != t or list(node.input).count(t) != 1
                or any(view.constant_value(i) is None for i in node.input[1:] if i)):
            break
        chain.append(node)
        t = node.output[0]
    if not any(n.op_type in INDEX_OPS for n in chain):
        return None
    if len(chain) == 1 and chain[0].op_type == "Gather" and attrs_of(chain[0]).get("axis", 0) == 0:
        return None
    return chain


def _indices(view: GraphView, source: str, chain: list[onnx.NodeProto]) -> np.ndarray | None:
    """K with chain(P) == P.ravel()[K], checked on P's element indices and on random values."""
    shape = tuple(view.initializers[source].dims)
    size = int(np.prod(shape))
    if size > MAX_ELEMENTS:
        return None
    consts = [view.producer[i] for n in chain for i in n.input[1:] if i in view.producer]
    nodes = {id(n): n for n in consts + chain}
    end = chain[-1].output[0]
    probe = np.random.default_rng(0).standard_normal(size)
    got = [evaluate_nodes(view, nodes, {}, {source: v.reshape(shape)}, [end])
           for v in (np.arange(size, dtype=np.float64), probe)]
    if got[0] is None or got[1] is None:
        return None
    a, b = np.asarray(got[0][0]), np.asarray(got[1][0])
    if a.dtype != np.float64 or a.shape != b.shape or a.size > MAX_ELEMENTS or a.size * size > MAX_ONE_HOT:
        return None
    if not np.all((a >= 0) & (a < size) & (a == np.floor(a))):
        return None
    k = a.astype(np.int64)
    return k if np.array_equal(probe[k], b) else None




__all__ = ["INDEX_OPS", "MAX_ELEMENTS", "MAX_ONE_HOT", "index_views"]
