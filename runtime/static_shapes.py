"""Static input shapes: a subgraph's symbolic dims ("N", a sequence length) fixed to one
batch's values before its session is made.

The emitted graphs take any batch size, so the shape arithmetic over the batch (Shape,
Gather, Concat, ... feeding Reshape, Expand, a mean's divisor) runs on every step; on CUDA
those nodes and their consumers' shape inputs sit on the CPU provider, with copies. With every
input's shape fixed, ONNX Runtime's shape inference knows every tensor's shape and its
constant folding replaces that arithmetic by initializers when the session is made. The
runtime asks for this per batch shape (KfacConfig.static_steps); a batch of another shape (an
epoch's last, partial one) gets a session of its own.

    shapes = batch_shapes(data)                   # (("input", (32, 784)), ("targets", (32,)))
    model = with_static_dims(model, dict(shapes))  # a copy; "N" -> 32 wherever it appears
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain

import numpy as np
import onnx

from kfac_compiler.builder import subgraphs

Shapes = tuple[tuple[str, tuple[int, ...]], ...]


def batch_shapes(data: Mapping[str, np.ndarray]) -> Shapes:
    """The shapes of a batch's arrays, sorted by name: a hashable key for its session."""
    return tuple(sorted((name, tuple(int(d) for d in np.shape(arr))) for name, arr in data.items()))


def _tensor_infos(graph: onnx.GraphProto) -> Iterable[onnx.ValueInfoProto]:
    return (vi for vi in chain(graph.input, graph.output, graph.value_info) if vi.type.HasField("tensor_type"))


def bind_dims(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """{symbolic dim: value} read off the graph inputs named in `shapes`; ValueError (one
    line, naming the input) where a rank or a static dim disagrees, or one symbol would take
    two values."""
    binding: dict[str, int] = {}
    for vi in model.graph.input:
        shape = shapes.get(vi.name)
        if shape is None or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise ValueError(f"input {vi.name!r} has rank {len(dims)} in graph {model.graph.name!r}, "
                             f"but the batch's array is shaped {list(shape)}")
        for d, n in zip(dims, shape):
            if d.HasField("dim_value") and d.dim_value != n:
                raise ValueError(f"input {vi.name!r} of graph {model.graph.name!r} takes dim {d.dim_value}, "
                                 f"but the batch's array is shaped {list(shape)}")
            if d.HasField("dim_param") and binding.setdefault(d.dim_param, int(n)) != n:
                raise ValueError(f"dim {d.dim_param!r} of graph {model.graph.name!r} is {binding[d.dim_param]} "
                                 f"elsewhere but {n} in input {vi.name!r}")
    return binding


def with_static_dims(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """A copy of `model` whose symbolic dims bound by `shapes` (bind_dims) are those values
    in every graph input, output and value_info (the noise inputs' "N" included), and whose
    inputs named in `shapes` are exactly those shapes; a value_info declaring a symbol the
    binding does not fix (backend/shapes.py's sub-batch rows) is dropped."""
    binding = bind_dims(model, shapes)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in _tensor_infos(out.graph):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in binding:
                d.dim_value = binding[d.dim_param]  # a oneof: clears dim_param
    _drop_unbound(out.graph, binding)
    for vi in out.graph.input:
        shape = shapes.get(vi.name)
        if shape is not None and vi.type.HasField("tensor_type"):
            for d, n in zip(vi.type.tensor_type.shape.dim, shape):
                d.dim_value = int(n)
    return fold_sizes(out)


def _drop_unbound(graph: onnx.GraphProto, binding: Mapping[str, int]) -> None:
    """`graph`'s value_info (and its nested bodies') with the symbols of `binding` bound, less
    each declaring a symbol `binding` lacks (a sub-batch's rows, "8*N": backend/shapes.py):
    ONNX Runtime infers every shape of a graph whose inputs are static, and a symbol beside the
    static dims it infers would only disagree with them."""
    keep = []
    for vi in graph.value_info:
        dims = vi.type.tensor_type.shape.dim
        if all(not d.HasField("dim_param") or d.dim_param in binding for d in dims):
            for d in dims:
                if d.HasField("dim_param"):
                    d.dim_value = binding[d.dim_param]
            keep.append(vi)
    del graph.value_info[:]
    graph.value_info.extend(keep)
    for node in graph.node:
        for body in subgraphs(node):
            _drop_unbound(body, binding)


def fold_sizes(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (changed in place) with every top-level Size node of a tensor whose shape ONNX
    shape inference finds static replaced by a Constant of its value. ONNX Runtime folds a
    Shape of a static tensor when it makes the session but not a Size (the emitted graphs'
    element counts: a mean's divisor), which would run on every step, on the CUDA provider
    with its output on the host."""
    sizes = [n for n in model.graph.node if n.op_type == "Size"]
    if not sizes:
        return model
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type for vi in chain(inferred.graph.value_info, inferred.graph.input)}
    for node in sizes:
        t = types.get(node.input[0])
        if t is None or not t.tensor_type.HasField("shape"):
            continue
        dims = t.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            continue
        value = onnx.numpy_helper.from_array(np.asarray(int(np.prod([d.dim_value for d in dims])), np.int64))
        node.op_type = "Constant"
        del node.input[:]
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", value))
    return model
