"""What would stop CUDA graph capture of an emitted graph, checked on the CPU.

ONNX Runtime's CUDA graph capture (provider option enable_cuda_graph) replays one recorded
sequence of kernels on fixed buffers, so a captured graph must have

  * no control flow: an If/Loop/Scan picks its kernels at run time;
  * static shapes: every tensor's shape known when the session is made (ONNX shape
    inference over the graph with its inputs' shapes fixed, runtime/static_shapes.py);
  * no node whose input the CUDA provider reads from host memory unless that input is known
    when the session is made (ONNX Runtime folds it into an initializer, which lives on the
    host): Reshape's shape, Expand's shape, Slice's starts/ends/axes/steps, TopK's k, Tile's
    repeats, Range, ConstantOfShape, the axes of Squeeze/Unsqueeze/Reduce*, Pad, Resize,
    Split, OneHot's depth, CumSum's axis (HOST_INPUTS); a computed one is a device-to-host
    copy and a CPU-placed node on every run; a Shape of a tensor whose shape is not static
    runs on the CPU too, and so does every Size (ONNX Runtime does not fold it; the static
    path replaces those of static tensors by constants, static_shapes.fold_sizes);
  * no op whose output shape depends on the data (NonZero, Unique, Compress, ...).

    blockers = capture_blockers(model, shapes={"input": (32, 784), "targets": (32,)})
    # ["node 'kfac/If_3' (If): control flow", ...]; [] when capturable

Every entry names the node (its If/Loop body's path first) and why; the list is empty when
nothing found blocks capture. This is a static check of the graph: the capture itself needs
a GPU, and the runtime's double-buffered state alternates buffer addresses between steps
(docs/runtime.md, "Static step graphs").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from kfac_compiler.builder import subgraphs
from kfac_compiler.runtime.static_shapes import with_static_dims

CONTROL_FLOW = ("If", "Loop", "Scan")
# ops whose output shape depends on the values of their input
DATA_DEPENDENT = ("NonZero", "Unique", "Compress", "NonMaxSuppression", "StringSplit")
# ops whose value changes from run to run: never folded into a constant
RANDOM = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli")
_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
# op -> the input positions the CUDA provider takes in host memory (its kernels'
# OrtMemTypeCPUInput): a computed value there is a copy to the host on every run
HOST_INPUTS: Mapping[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "TopK": (1,), "Tile": (1,), "Range": (0, 1, 2),
    "ConstantOfShape": (0,), "Squeeze": (1,), "Unsqueeze": (1,), "Pad": (1, 2, 3), "Resize": (1, 2, 3),
    "Upsample": (1,), "Split": (1,), "OneHot": (1,), "CumSum": (1,), "Trilu": (1,),
    **{op: (1,) for op in _REDUCE},
}
SHAPE_OPS = ("Shape", "Size")  # their output lives on the host for the CUDA provider


def _static(t: onnx.TypeProto) -> bool:
    if not t.HasField("tensor_type"):
        return False
    tt = t.tensor_type
    return tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim)


def _shape_text(t: onnx.TypeProto) -> str:
    if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return "unknown"
    return "[" + ", ".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                           for d in t.tensor_type.shape.dim) + "]"


def _node_label(node: onnx.NodeProto, where: str) -> str:
    return f"{where}node {node.name or node.output[0]!r} ({node.op_type})"


def _check_graph(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto], known: set[str], where: str,
                 out: list[str]) -> None:
    """Append `graph`'s blockers to `out`; `known`: the values fixed at session creation in
    the enclosing scopes (extended here with this graph's)."""
    known = known | {t.name for t in graph.initializer} | {t.name for t in graph.sparse_initializer}
    for vi in list(graph.value_info) + list(graph.input) + list(graph.output):
        types.setdefault(vi.name, vi.type)
    for node in graph.node:
        label = _node_label(node, where)
        if node.op_type in CONTROL_FLOW:
            out.append(f"{label}: control flow (its branch or trip count is chosen at run time)")
        if node.op_type in DATA_DEPENDENT:
            out.append(f"{label}: its output shape depends on the data")
        for k in HOST_INPUTS.get(node.op_type, ()):
            if k < len(node.input) and node.input[k] and node.input[k] not in known:
                out.append(f"{label}: input {k} {node.input[k]!r} is read on the host but computed at run time")
        inputs = [i for i in node.input if i]
        if node.op_type == "Size":  # ONNX Runtime does not fold it (static_shapes.fold_sizes does)
            out.append(f"{label}: ONNX Runtime does not fold Size: it runs on the host on every run")
        elif node.op_type in SHAPE_OPS:
            t = types.get(node.input[0])
            if t is None or not _static(t):
                out.append(f"{label}: the shape of {node.input[0]!r} is not static "
                           f"({_shape_text(t) if t is not None else 'unknown'}): runs on the host")
            else:
                known |= set(node.output)
        elif node.op_type == "Constant" or (inputs and node.op_type not in RANDOM + CONTROL_FLOW
                                            and all(i in known for i in inputs)):
            known |= set(node.output)
        for g in subgraphs(node):
            _check_graph(g, types, known, f"{where}{node.op_type} {node.name!r}/{g.name}/", out)
        for o in node.output:
            if not o:
                continue
            t = types.get(o)
            if t is None or not _static(t):
                out.append(f"{label}: output {o!r} has no static shape "
                           f"({_shape_text(t) if t is not None else 'not inferred'})")


_FOLD_ROUNDS = 8  # Shape -> Concat -> Pad's pads -> ...: each round resolves at least one more level
_FOLD_LIMIT = 4096  # elements: the constants folded are shape arithmetic, not weights


def _constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """{output: value} of the graph's top-level Constant nodes (their `value` form)."""
    return {node.output[0]: numpy_helper.to_array(node.attribute[0].t) for node in graph.node
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"}


def _with_nodes(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto]) -> onnx.ModelProto:
    """A copy of `model` whose top-level graph runs `nodes` instead of its own."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _fold_constants(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of the inferred `model` whose top-level Shape nodes of static-shaped tensors,
    and nodes over small constants only, are Constants, as ONNX Runtime folds them when it
    makes the session (not Size, which it leaves). ONNX's inference propagates shape values
    into Reshape, not into every consumer (OneHot's depth, Pad's pads). None when there is
    nothing to fold."""
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    types = {vi.name: vi.type for vi in list(graph.value_info) + list(graph.input)}
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer
              if int(np.prod(t.dims)) <= _FOLD_LIMIT}
    values.update(_constant_values(graph))
    nodes, changed = [], False
    for node in graph.node:
        value: list[np.ndarray] | None = None
        inputs = [i for i in node.input if i]
        t = types.get(node.input[0]) if node.op_type == "Shape" else None
        if t is not None and _static(t):
            dims = [d.dim_value for d in t.tensor_type.shape.dim]
            attrs = {a.name: a.i for a in node.attribute}
            value = [np.asarray(dims[slice(attrs.get("start"), attrs.get("end"))], np.int64)]
        elif (node.op_type not in RANDOM + CONTROL_FLOW + SHAPE_OPS + ("Constant",) and inputs
              and all(i in values for i in inputs) and node.domain in ("", "ai.onnx")):
            one = helper.make_model(
                helper.make_graph([node], "fold", [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(
                    values[i].dtype), values[i].shape) for i in dict.fromkeys(inputs)],
                    [helper.make_empty_tensor_value_info(o) for o in node.output if o]),
                opset_imports=list(model.opset_import))
            try:
                value = [np.asarray(v) for v in ReferenceEvaluator(one).run(None, {i: values[i] for i in inputs})]
            except Exception:  # an op the reference lacks: left to ONNX's inference
                value = None
        if value is None or any(v.size > _FOLD_LIMIT for v in value):
            nodes.append(node)
            continue
        outs = [o for o in node.output if o]
        for o, v in zip(outs, value):
            values[o] = v
            nodes.append(helper.make_node("Constant", [], [o], name=f"{node.name}/{o}",
                                          value=numpy_helper.from_array(v)))
        changed = True
    return _with_nodes(model, nodes) if changed else None


def _inferred_and_folded(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` after ONNX shape inference and the folding ONNX Runtime does when it makes the
    session, repeated until nothing more folds (at most _FOLD_ROUNDS times)."""
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    for _ in range(_FOLD_ROUNDS):
        folded = _fold_constants(inferred)
        if folded is None:
            break
        inferred = shape_inference.infer_shapes(folded, data_prop=True)
    return inferred


# the most iterations a Loop is unrolled to (unroll_static_loops): the tied statistics loop
# runs one per chunk of the batch, a handful
UNROLL_LIMIT = 64
# ONNX Runtime's CUDA Concat takes at most this many inputs while a CUDA graph is captured
# (its kernel reads the input pointers from a fixed-size argument, not from a host buffer)
CAPTURED_CONCAT_INPUTS = 32


def split_wide_concats(model: onnx.ModelProto, limit: int = CAPTURED_CONCAT_INPUTS) -> onnx.ModelProto:
    """`model` with every top-level Concat of more than `limit` inputs a tree of Concats of at
    most `limit` each (the same value: concatenation is associative), so that a captured CUDA
    graph can run it; the model itself when it has none. The multi-tensor step's Concat of
    every parameter (ResNet-18: 62) is one."""
    if not any(n.op_type == "Concat" and len(n.input) > limit for n in model.graph.node):
        return model
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        inputs = list(node.input)
        if node.op_type != "Concat" or len(inputs) <= limit:
            nodes.append(node)
            continue
        axis = next(a.i for a in node.attribute if a.name == "axis")
        level = 0
        while len(inputs) > limit:
            parts = []
            for k in range(0, len(inputs), limit):
                part = inputs[k:k + limit]
                if len(part) == 1:
                    parts.append(part[0])
                    continue
                name = f"{node.output[0]}/part{level}_{k // limit}"
                nodes.append(helper.make_node("Concat", part, [name], name=f"{node.name}/part{level}_{k // limit}",
                                              axis=axis))
                parts.append(name)
            inputs, level = parts, level + 1
        nodes.append(helper.make_node("Concat", inputs, list(node.output), name=node.name, axis=axis))
    return _with_nodes(model, nodes)


def _folded_constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """{tensor: value} of every top-level tensor known when the session is made: the
    initializers and, after shape inference and the folding ONNX Runtime does (shapes of
    static tensors, arithmetic over small constants), the Constants."""
    inferred = _inferred_and_folded(model)
    return {**{t.name: numpy_helper.to_array(t) for t in inferred.graph.initializer},
            **_constant_values(inferred.graph)}


def _unrollable(node: onnx.NodeProto, values: Mapping[str, np.ndarray], limit: int) -> int | None:
    """The trip count of a top-level Loop that can be unrolled: known when the session is
    made, at most `limit`, no termination condition (none given, and the body passes its
    condition through), no scan outputs and no control flow inside; else None."""
    body = subgraphs(node)[0]
    trips = values.get(node.input[0]) if node.input and node.input[0] else None
    if trips is None or trips.size != 1 or not 0 <= int(trips) <= limit:
        return None
    if len(node.input) > 1 and node.input[1]:
        return None
    if len(body.output) != len(node.input) - 1 or any(subgraphs(n) for n in body.node):
        return None
    cond_in, cond_out = body.input[1].name, body.output[0].name
    if cond_out != cond_in and not any(n.op_type == "Identity" and list(n.input) == [cond_in] and
                                       list(n.output) == [cond_out] for n in body.node):
        return None
    return int(trips)


def unroll_static_loops(model: onnx.ModelProto, limit: int = UNROLL_LIMIT) -> onnx.ModelProto:
    """`model` with every top-level Loop whose trip count is known when the session is made
    (with static input shapes) replaced by that many copies of its body, iteration i reading
    a constant i: the same values in the same order, no control flow, so a CUDA graph can
    capture it (the tied embedding's diagonal statistics loop over chunks of the batch,
    blocks/tied.py). The model itself when there is none."""
    loops = [n for n in model.graph.node if n.op_type == "Loop"]
    if not loops:
        return model
    values = _folded_constants(model)
    trips = {id(n): _unrollable(n, values, limit) for n in loops}
    if all(t is None for t in trips.values()):
        return model
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        k = trips.get(id(node))
        if k is None:
            nodes.append(node)
            continue
        body = subgraphs(node)[0]
        state = list(node.input[2:])
        i_name, cond_name = body.input[0].name, body.input[1].name
        for t in range(k):
            tag = f"{node.name or node.output[0]}/unroll{t}"
            rename = {i_name: f"{tag}/i", cond_name: f"{tag}/cond"}
            rename.update({vi.name: s for vi, s in zip(body.input[2:], state)})
            nodes.append(helper.make_node("Constant", [], [rename[i_name]], name=f"{tag}/i",
                                          value=numpy_helper.from_array(np.asarray(t, np.int64))))
            nodes.append(helper.make_node("Constant", [], [rename[cond_name]], name=f"{tag}/cond",
                                          value=numpy_helper.from_array(np.asarray(True))))
            for j, b in enumerate(body.node):
                copy = onnx.NodeProto()
                copy.CopyFrom(b)
                copy.name = f"{tag}/body/{b.name or j}"
                for slot, name in enumerate(b.input):
                    copy.input[slot] = rename.get(name, name)  # an outer-scope name stays
                for slot, name in enumerate(b.output):
                    if name:
                        rename[name] = copy.output[slot] = f"{tag}/{name}"
                nodes.append(copy)
            state = [rename.get(vi.name, vi.name) for vi in body.output[1:]]
        for final, out in zip(state, node.output):
            nodes.append(helper.make_node("Identity", [final], [out], name=f"{node.name or out}/unrolled"))
    return _with_nodes(model, nodes)


def capture_blockers(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None = None) -> list[str]:
    """What stops CUDA graph capture of `model` (see the module docstring), one line each,
    naming the node or input; [] when nothing does. `shapes`: input shapes to fix first
    (static_shapes.with_static_dims), e.g. a batch's."""
    if shapes:
        model = with_static_dims(model, shapes)
    inferred = _inferred_and_folded(model)
    out: list[str] = []
    for vi in inferred.graph.input:
        if vi.type.HasField("tensor_type") and not _static(vi.type):
            out.append(f"input {vi.name!r}: shape {_shape_text(vi.type)} is not static")
    _check_graph(inferred.graph, {}, set(), "", out)
    return out
