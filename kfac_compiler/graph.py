"""Read-only index over an ONNX model: producers, consumers, initializers, static shapes.

Passes take a ModelProto and build a GraphView when they need to look things up; they
never mutate the model they were given (they copy it first).
"""
from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

import networkx as nx
import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from kfac_compiler.contract import FOLDED_PARAMS_KEY, RECURRENT_PIECES_KEY
from kfac_compiler.onnx_files import tensor_array

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)

Dim = int | str | None


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 0


def _shape_of(vi: onnx.ValueInfoProto) -> tuple[Dim, ...] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims: list[Dim] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tuple(dims)


@dataclass
class GraphView:
    """Lookup tables over `model.graph` (built once; the model must not change afterwards)."""

    model: onnx.ModelProto
    nodes: list[onnx.NodeProto] = field(init=False)
    producer: dict[str, onnx.NodeProto] = field(init=False)
    consumers: dict[str, list[onnx.NodeProto]] = field(init=False)
    initializers: dict[str, onnx.TensorProto] = field(init=False)
    shapes: dict[str, tuple[Dim, ...] | None] = field(init=False)
    dtypes: dict[str, int] = field(init=False)
    opset: int = field(init=False)

    def __post_init__(self) -> None:
        g = self.model.graph
        self.nodes = list(g.node)
        self.opset = default_opset(self.model)
        self.producer = {}
        self.consumers = {}
        for node in self.nodes:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers.setdefault(inp, []).append(node)
        self.initializers = {t.name: t for t in g.initializer}
        self.shapes = {}
        self.dtypes = {}
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            self.shapes[vi.name] = _shape_of(vi)
            self.dtypes[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            self.shapes[t.name] = tuple(int(d) for d in t.dims)
            self.dtypes[t.name] = t.data_type

    @cached_property
    def node_by_name(self) -> dict[str, onnx.NodeProto]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def graph_inputs(self) -> list[str]:
        return [i.name for i in self.model.graph.input if i.name not in self.initializers]

    @cached_property
    def graph_outputs(self) -> list[str]:
        return [o.name for o in self.model.graph.output]

    def array(self, name: str) -> np.ndarray:
        """The value of an initializer as a numpy array (read from disk if it was left there)."""
        return tensor_array(self.initializers[name])

    def constant_value(self, name: str) -> np.ndarray | None:
        """Value of an initializer or a Constant node's output, else None."""
        if name in self.initializers:
            return self.array(name)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
                if attr.name in ("value_float", "value_int"):
                    return np.asarray(onnx.helper.get_attribute_value(attr))
                if attr.name in ("value_floats", "value_ints"):
                    return np.asarray(onnx.helper.get_attribute_value(attr))
        return None

    @cached_property
    def from_inputs(self) -> frozenset[str]:
        """Tensors computed from a graph input (the data): a parameter broadcast against one of
        them is broadcast over the batch. Nodes are in topological order."""
        seen = set(self.graph_inputs)
        for node in self.nodes:
            if any(i in seen for i in node.input if i):
                seen.update(o for o in node.output if o)
        return frozenset(seen)

    def shape(self, name: str) -> tuple[Dim, ...] | None:
        return self.shapes.get(name)

    def static_shape(self, name: str) -> tuple[int, ...]:
        """shapes[name] of an initializer (a parameter, a model slot): its dims, all ints."""
        return cast("tuple[int, ...]", self.shapes[name])

    def rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return None if s is None else len(s)

    def is_float(self, name: str) -> bool:
        return self.dtypes.get(name) in FLOAT_TYPES

    def float_initializers(self) -> list[str]:
        return [n for n, t in self.initializers.items() if t.data_type in FLOAT_TYPES]

    def all_names(self) -> set[str]:
        names = set(self.initializers) | set(self.producer) | {n.name for n in self.nodes}
        names |= {i.name for i in self.model.graph.input}
        return names

    def to_networkx(self) -> nx.MultiDiGraph:
        """Op-level graph: one vertex per node (keyed by node name), plus one per graph input
        and initializer (op_type "Input" / "Initializer"); edges carry the consumer's input
        index as `slot` and the tensor name as `tensor`."""
        g = nx.MultiDiGraph()
        for name in self.initializers:
            g.add_node(name, op_type="Initializer", tensor=name)
        for name in self.graph_inputs:
            g.add_node(name, op_type="Input", tensor=name)
        for node in self.nodes:
            g.add_node(node.name, op_type=node.op_type, domain=node.domain, proto=node)
        for node in self.nodes:
            for slot, inp in enumerate(node.input):
                if not inp:
                    continue
                src = self.producer[inp].name if inp in self.producer else inp
                if src in g:
                    g.add_edge(src, node.name, slot=slot, tensor=inp)
        return g


def attrs_of(node: onnx.NodeProto) -> dict:
    """A node's attributes as a plain dict of python values."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


# ------------------------------------------------------------------------- float types
SOURCE_FLOAT_KEY = "kfac_compiler.source_float_type"  # metadata: the float type a model came in


def with_float_type(model: onnx.ModelProto, to: int, sources: Collection[int]) -> onnx.ModelProto:
    """A copy of `model` with every tensor of a type in `sources` (initializers, inputs,
    outputs, value_info, Constant/ConstantOfShape values, Cast-like `to`/`dtype` attributes)
    turned into `to`: the whole graph, so that no node sees two float types."""
    sources = set(sources) - {to}
    target = onnx.helper.tensor_dtype_to_np_dtype(to)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph

    def convert(t: onnx.TensorProto) -> None:
        if t.data_type in sources:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(target), t.name))

    for t in g.initializer:
        convert(t)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        tt = vi.type.tensor_type
        if tt.elem_type in sources:
            tt.elem_type = to
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                convert(a.t)
            elif a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i in sources:
                a.i = to
    return m


def float_types(model: onnx.ModelProto) -> set[int]:
    """The float types of the model's initializers, graph inputs and outputs, Cast targets and
    Constant values: a float32 model computing a part in float64 or float16 (Cast there and
    back: an upcast for stability, an autocast island) mixes types too (its gradient graphs had
    met the builder's float32 constants there, an ONNX Runtime type error when training began)."""
    g = model.graph
    types = {t.data_type for t in g.initializer} | {vi.type.tensor_type.elem_type for vi in [*g.input, *g.output]}
    for node in g.node:
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            types |= {a.i for a in node.attribute if a.name == "to"}
        elif node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            types |= {a.t.data_type for a in node.attribute if a.name == "value"}
    return types & set(FLOAT_TYPES)


def _records(model: onnx.ModelProto) -> tuple[dict[str, list], dict[str, dict]]:
    """(recurrent pieces, folded assemblies): the two records a compiled model's metadata
    keeps of initializers that replaced the source's (passes/recurrent.py, passes/fold_params.py)."""
    props = {p.key: p.value for p in model.metadata_props}
    return json.loads(props.get(RECURRENT_PIECES_KEY, "{}")), json.loads(props.get(FOLDED_PARAMS_KEY, "{}"))


def fold_recurrent_params(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The source model's recurrent initializers assembled from the values of the compiled
    model's (e.g. a trained model's or gradients keyed by piece name); `model` is the lowered
    (canonical) model, whose metadata records the pieces: a fused op's W, R, B, P from their
    per-direction pieces (passes/recurrent.py), and the initializers an exporter assembled them
    from at run time (passes/fold_params.py) from those. The result holds both levels.
    Directions or pieces of a fused op's weight absent from `values` are left at 0; a source of
    an assembly is left out unless every element's holder has a value."""
    record, folded = _records(model)
    out = {}
    for orig, pieces in record.items():
        present = [np.asarray(values[p]) for p, _, _, _ in pieces if p in values]
        if not present:
            continue
        D = 1 + max(d for _, d, _, _ in pieces)
        width = max(e for _, _, _, e in pieces)
        arr = np.zeros((D, width) + present[0].shape[1:], dtype=present[0].dtype)
        for p, d, s, e in pieces:
            if p in values:
                arr[d, s:e] = values[p]
        out[orig] = arr
    have = {**values, **out}
    assembled: dict[str, np.ndarray] = {}
    filled: dict[str, int] = {}
    for target, rec in folded.items():
        if target not in have:
            continue
        flat = np.asarray(have[target]).reshape(-1)
        for src, dst, at, n in rec["runs"]:
            if src not in assembled:
                assembled[src] = np.zeros(math.prod(rec["sources"][src]), dtype=flat.dtype)
                filled[src] = 0
            assembled[src][at:at + n] = flat[dst:dst + n]
            filled[src] += n
    shapes = {s: dims for rec in folded.values() for s, dims in rec["sources"].items()}
    for src, arr in assembled.items():
        if filled[src] == arr.size:
            out[src] = arr.reshape(shapes[src])
    return out


def split_source_params(model: onnx.ModelProto, values: dict[str, np.ndarray],
                        base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of fold_recurrent_params: {compiled model initializer: value} for the
    holders of the source initializers in `values` (each element copied to where the
    compiled model keeps it: an exporter's assembly folded into its target, a fused op's
    weight into its lowered pieces), starting from `base` (the holders' current values,
    keyed by the compiled model's initializers) where `values` gives only some of the
    sources. Keys of `values` that no record names are returned unchanged."""
    record, folded = _records(model)
    sources = {s for rec in folded.values() for s in rec["sources"]} | set(record)
    out = {k: v for k, v in values.items() if k not in sources}
    whole = {**fold_recurrent_params(model, base), **base}  # every level, from the current values
    targets: dict[str, np.ndarray] = {}
    for target, rec in folded.items():
        runs = [r for r in rec["runs"] if r[0] in values]
        if not runs or target not in whole:
            continue
        flat = np.array(whole[target], copy=True).reshape(-1)
        for src, dst, at, n in runs:
            flat[dst:dst + n] = np.asarray(values[src]).reshape(-1)[at:at + n]
        targets[target] = flat.reshape(rec["shape"])
    given = {**values, **targets}
    for orig, pieces in record.items():
        if orig in given:
            arr = np.asarray(given[orig])
            out.update({p: np.ascontiguousarray(arr[d, s:e]) for p, d, s, e in pieces})
    out.update({t: v for t, v in targets.items() if t not in record})
    return out


def source_holders(model: onnx.ModelProto) -> dict[str, list[str]]:
    """{source model initializer: the compiled model's initializers holding its elements} for
    the initializers the compiled `model` replaced: a fused recurrent op's weight by its
    lowered pieces, an exporter's run-time assembly's sources by the folded initializer (or
    the lowered pieces of it that hold their elements)."""
    record, folded = _records(model)
    out: dict[str, list[str]] = {orig: [p[0] for p in pieces] for orig, pieces in record.items()}
    for target, rec in folded.items():
        inner = math.prod(rec["shape"][2:])
        rows = rec["shape"][1] if len(rec["shape"]) > 1 else 1
        for src, dst, _, n in rec["runs"]:
            holders = out.setdefault(src, [])
            pieces = record.get(target)
            if pieces is None:  # not lowered: the folded initializer itself
                found = [target]
            else:  # pieces [d, s:e] of a [D, rows, *inner] weight: flat [(d rows + s) inner, (d rows + e) inner)
                found = [p for p, d, s, e in pieces if (d * rows + s) * inner < dst + n and dst < (d * rows + e) * inner]
            holders.extend(h for h in found if h not in holders)
    return out


def held_elsewhere(model: onnx.ModelProto) -> dict[str, dict]:
    """{user's initializer: {"shape": its shape in the source model, "holders": {compiled
    model initializer: its shape}}} for the source initializers the compiled `model` holds in
    another layout or under other names (source_holders: a fused recurrent op's weights, an
    exporter's run-time assembly, a parameter view re-laid out under its own name), so that a
    report can give the user's shapes. Folded targets that were no source initializer (an
    assembly's `val_42`, then lowered) are not listed: their sources are."""
    record, folded = _records(model)
    dims = {t.name: tuple(int(d) for d in t.dims) for t in model.graph.initializer}
    shapes: dict[str, tuple[int, ...]] = {s: tuple(d) for rec in folded.values() for s, d in rec["sources"].items()}
    for orig, pieces in record.items():
        if orig not in folded and pieces and pieces[0][0] in dims:
            shapes[orig] = (1 + max(p[1] for p in pieces), max(p[3] for p in pieces), *dims[pieces[0][0]][1:])
    return {src: {"shape": shapes[src], "holders": {h: dims.get(h, ()) for h in holders}}
            for src, holders in source_holders(model).items() if src in shapes}


def fresh_name(name: str, taken: set[str]) -> str:
    """`name`, or the first of name_1, name_2, ... not in `taken`; added to `taken`."""
    cand, k = name, 0
    while cand in taken:
        k += 1
        cand = f"{name}_{k}"
    taken.add(cand)
    return cand
