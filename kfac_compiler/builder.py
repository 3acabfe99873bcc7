"""GraphBuilder: append ONNX nodes with fresh names, opset-aware.

Every pass that emits ONNX (autodiff, losses, curvature factors, inverses, optimizer update)
goes through one builder so that names never collide and ops are emitted in the form their
opset expects (e.g. ReduceMean takes `axes` as an input from opset 18 on, Squeeze from 13).
Emitted graphs use the default-domain opset of the source model; supported opsets are
MIN_OPSET..MAX_OPSET.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, overload

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MIN_OPSET = 13
MAX_OPSET = 26
# ONNX Runtime 1.31 accepts IR <= 13; emitted models pin this IR version.
IR_VERSION = 8

# Reductions whose `axes` moved from attribute to input in opset 18 (ReduceSum moved in 13).
_AXES_INPUT_SINCE = {
    "ReduceSum": 13,
    "ReduceMean": 18,
    "ReduceMax": 18,
    "ReduceMin": 18,
    "ReduceProd": 18,
    "ReduceSumSquare": 18,
    "ReduceL1": 18,
    "ReduceL2": 18,
    "ReduceLogSumExp": 18,
}

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.bool_): TensorProto.BOOL,
}


class GraphBuilder:
    """Collects nodes and constant initializers to be appended to a graph.

    `taken` is the set of names already used in the graph (tensor and node names); fresh
    names never collide with it. `float_type` is the ONNX element type of the floating-point
    constants emitted by default (float32 normally, float64 for precision tests).
    """

    def __init__(
        self,
        opset: int,
        prefix: str = "kfac",
        taken: Iterable[str] = (),
        float_type: int = TensorProto.FLOAT,
    ) -> None:
        self.opset = opset
        self.prefix = prefix
        self.taken: set[str] = set(taken)
        self.float_type = float_type
        # Conv and its gradients may use the Gather im2col forms (oprules/conv.py); an emission
        # request's conv_gather option sets it, so that the choice is part of the graph's key
        self.conv_gather = True
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.domains: dict[str, int] = {}
        self._counter = itertools.count()
        self._const_cache: dict[tuple, str] = {}
        # emitted tensor -> tensors it has the shape of (autodiff's cotangents and tangents:
        # their primals'), for the shapes an emitted graph declares (backend/shapes.py)
        self.shaped_like: dict[str, set[str]] = {}

    # ----------------------------------------------------------------- names
    def fresh(self, hint: str) -> str:
        """A new tensor/node name `prefix/hint_k` not used anywhere in the graph."""
        hint = hint.replace(":", "_")
        while True:
            name = f"{self.prefix}/{hint}_{next(self._counter)}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def same_shape(self, tensors: Iterable[str], like: str) -> None:
        """Record that each of `tensors` has the shape of tensor `like`."""
        for t in tensors:
            self.shaped_like.setdefault(t, set()).add(like)

    @property
    def np_float(self) -> np.dtype:
        return np.dtype(np.float64 if self.float_type == TensorProto.DOUBLE else np.float32)

    # ----------------------------------------------------------------- nodes
    @overload
    def op(self, op_type: str, inputs: Sequence[str], n_out: Literal[1] = 1, domain: str = "",
           hint: str | None = None, outputs: None = None, **attrs: Any) -> str: ...

    @overload
    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, domain: str = "",
           hint: str | None = None, outputs: Sequence[str] | None = None, **attrs: Any) -> str | list[str]: ...

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        n_out: int = 1,
        domain: str = "",
        hint: str | None = None,
        outputs: Sequence[str] | None = None,
        **attrs,
    ) -> str | list[str]:
        """Append one node; return its output name (or list of names when n_out > 1)."""
        hint = hint or op_type
        if outputs is None:
            outputs = [self.fresh(hint) for _ in range(n_out)]
        else:
            self.taken.update(outputs)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = helper.make_node(
            op_type, list(inputs), list(outputs), name=self.fresh(hint + "/node"), domain=domain, **attrs
        )
        if domain and domain not in ("", "ai.onnx"):
            self.domains.setdefault(domain, 1)
        self.nodes.append(node)
        return list(outputs) if len(outputs) != 1 or n_out != 1 else outputs[0]

    def const(self, value, dtype=None, hint: str = "const") -> str:
        """A constant initializer (deduplicated by value); floats default to `float_type`."""
        arr = np.asarray(value)
        if dtype is None:
            dtype = self.np_float if arr.dtype.kind == "f" else arr.dtype
        arr = arr.astype(dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key in self._const_cache:
            return self._const_cache[key]
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(arr, name))
        self._const_cache[key] = name
        return name

    def ints(self, values: Sequence[int], hint: str = "ints") -> str:
        return self.const(np.asarray(list(values), dtype=np.int64), hint=hint)

    # -------------------------------------------------- opset-aware helpers
    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: bool = False) -> str:
        """Reduce over `axes` (None = all axes), in the form the opset expects."""
        since = _AXES_INPUT_SINCE[op_type]
        if axes is None:
            return self.op(op_type, [x], keepdims=int(keepdims))
        if self.opset >= since:
            return self.op(op_type, [x, self.ints(axes)], keepdims=int(keepdims))
        return self.op(op_type, [x], axes=list(axes), keepdims=int(keepdims))

    def reduce_sum(self, x: str, axes: Sequence[int] | None, keepdims: bool = False) -> str:
        return self.reduce("ReduceSum", x, axes, keepdims)

    def reduce_mean(self, x: str, axes: Sequence[int] | None, keepdims: bool = False) -> str:
        return self.reduce("ReduceMean", x, axes, keepdims)

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Squeeze", [x, self.ints(axes)])

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", [x, self.ints(axes)])

    def split(self, x: str, sizes: Sequence[int], axis: int) -> list[str]:
        outs = self.op("Split", [x, self.ints(sizes)], n_out=len(sizes), axis=axis)
        return outs if isinstance(outs, list) else [outs]

    def reshape(self, x: str, shape: Sequence[int] | str) -> str:
        shape_name = shape if isinstance(shape, str) else self.ints(shape)
        return self.op("Reshape", [x, shape_name])

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    def matmul(self, a: str, b: str) -> str:
        return self.op("MatMul", [a, b])

    def add(self, a: str, b: str) -> str:
        return self.op("Add", [a, b])

    def sub(self, a: str, b: str) -> str:
        return self.op("Sub", [a, b])

    def mul(self, a: str, b: str) -> str:
        return self.op("Mul", [a, b])

    def div(self, a: str, b: str) -> str:
        return self.op("Div", [a, b])

    def neg(self, a: str) -> str:
        return self.op("Neg", [a])

    def sum(self, terms: Sequence[str]) -> str:
        """One tensor summing `terms` (their own name for one, a Sum node for more, 0.0 for none)."""
        if not terms:
            return self.const(0.0)
        return terms[0] if len(terms) == 1 else self.op("Sum", list(terms))

    def scale(self, x: str, factor: float) -> str:
        return x if factor == 1.0 else self.mul(x, self.const(factor))

    def shape(self, x: str, start: int | None = None, end: int | None = None) -> str:
        if self.opset >= 15 or (start is None and end is None):
            return self.op("Shape", [x], start=start, end=end)
        # Shape's start/end attributes came in opset 15
        ends = [end if end is not None else np.iinfo(np.int64).max]
        return self.op("Slice", [self.op("Shape", [x]), self.ints([start or 0]), self.ints(ends)])

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def batch_size(self, x: str) -> str:
        """Float scalar N = x.shape[0] (dynamic)."""
        n = self.shape(x, 0, 1)
        n = self.cast(n, self.float_type)
        return self.op("Squeeze", [n, self.ints([0])])

    def identity(self, x: str, output: str) -> str:
        return self.op("Identity", [x], outputs=[output])

    def conditional(self, cond: str, then: Callable[[], Sequence[str]],
                    otherwise: Sequence[str] | Callable[[], Sequence[str]],
                    shapes: Sequence[Sequence[int | str | None]] | Callable[[], Sequence[Sequence[int | str | None]]],
                    hint: str = "branch") -> list[str]:
        """If(cond): the nodes `then()` appends run only when the bool scalar `cond` is true
        (its results are returned); otherwise the `otherwise` tensors pass through. Lets one
        session skip work on most steps (e.g. a forward pass needed every k-th step) without
        a second session. Results are float tensors of `float_type` with `shapes` (a branch
        output must declare one; None or a name for an unknown dimension). `otherwise` and
        `shapes` may be functions, called after `then()`: for results whose alternatives
        `then()` discovers (the state slots it reads)."""
        start = len(self.nodes)
        results = list(then())
        body, self.nodes[start:] = self.nodes[start:], []
        body, _ = live(body, results)  # as make_model does for the outer graph: a branch runs every node it holds
        otherwise = otherwise() if callable(otherwise) else otherwise
        shapes = shapes() if callable(shapes) else shapes
        if not len(results) == len(otherwise) == len(shapes):
            raise ValueError(f"conditional {hint!r}: {len(results)} results, {len(otherwise)} alternatives, "
                             f"{len(shapes)} shapes")

        def branch(name: str, nodes: list, outs: Sequence[str]) -> onnx.GraphProto:
            infos = [value_info(t, self.float_type, list(shape)) for t, shape in zip(outs, shapes)]
            return helper.make_graph(nodes, name, [], infos)

        passed = [self.fresh(hint + "/else") for _ in otherwise]
        passthrough = [helper.make_node("Identity", [src], [dst], name=self.fresh(hint + "/else/node"))
                       for src, dst in zip(otherwise, passed)]
        outs = self.op("If", [cond], n_out=len(results), hint=hint,
                       then_branch=branch(self.fresh(hint + "/then"), body, results),
                       else_branch=branch(self.fresh(hint + "/else"), passthrough, passed))
        return outs if isinstance(outs, list) else [outs]

    def loop(self, trips: str, carried: Sequence[str], body: Callable[[str, list[str]], Sequence[str]],
             shapes: Sequence[Sequence[int | str | None]], hint: str = "loop") -> list[str]:
        """Loop(trips): `body(i, state)` appends the nodes of iteration i (an int64 scalar) and
        returns the next state; the state starts as `carried` and the final one is returned.
        Bounds the memory of a computation over a batch by one slice's (the body's tensors
        live one iteration). State tensors are float tensors of `float_type` with `shapes`."""
        i, cond = self.fresh(hint + "/i"), self.fresh(hint + "/cond")
        state = [self.fresh(hint + "/state") for _ in carried]
        start = len(self.nodes)
        results = list(body(i, state))
        nodes, self.nodes[start:] = self.nodes[start:], []
        if len(results) != len(carried) or len(shapes) != len(carried):
            raise ValueError(f"loop {hint!r}: {len(results)} results for {len(carried)} state tensors")
        cond_out = self.fresh(hint + "/cond_out")
        nodes.append(helper.make_node("Identity", [cond], [cond_out], name=self.fresh(hint + "/cond/node")))
        infos = [value_info(t, self.float_type, list(s)) for t, s in zip(state, shapes)]
        outs_info = [value_info(t, self.float_type, list(s)) for t, s in zip(results, shapes)]
        graph = helper.make_graph(
            nodes, self.fresh(hint + "/body"),
            [value_info(i, TensorProto.INT64, []), value_info(cond, TensorProto.BOOL, []), *infos],
            [value_info(cond_out, TensorProto.BOOL, []), *outs_info])
        outs = self.op("Loop", [trips, "", *carried], n_out=len(carried), hint=hint, body=graph)
        return outs if isinstance(outs, list) else [outs]

    # ------------------------------------------------------------ assembly
    def opset_imports(self) -> list[onnx.OperatorSetIdProto]:
        ids = [helper.make_opsetid("", self.opset)]
        ids += [helper.make_opsetid(d, v) for d, v in sorted(self.domains.items())]
        return ids

    def make_model(
        self,
        name: str,
        inputs: Sequence[onnx.ValueInfoProto],
        outputs: Sequence[onnx.ValueInfoProto],
        base_nodes: Sequence[onnx.NodeProto] = (),
        base_initializers: Sequence[onnx.TensorProto] = (),
        extra_opsets: Sequence[onnx.OperatorSetIdProto] = (),
    ) -> onnx.ModelProto:
        """A model holding `base_nodes` followed by the emitted nodes, less the nodes and
        initializers no output depends on."""
        nodes, read = live(list(base_nodes) + self.nodes, [o.name for o in outputs])
        graph = helper.make_graph(
            nodes,
            name,
            list(inputs),
            list(outputs),
            initializer=[t for t in list(base_initializers) + self.initializers if t.name in read],
        )
        opsets = {o.domain: o.version for o in extra_opsets}
        opsets.update({o.domain: o.version for o in self.opset_imports()})
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
            producer_name="kfac_compiler",
        )
        model.ir_version = IR_VERSION
        return model


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The bodies in `node`'s attributes (If branches, Loop/Scan bodies)."""
    out: list[onnx.GraphProto] = []
    for attr in node.attribute:
        out += [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
    return out


def node_reads(node: onnx.NodeProto) -> set[str]:
    """The tensors `node` reads: its inputs and, inside If/Loop/Scan bodies, whatever those
    bodies' nodes read (outer-scope names included; over-approximating keeps more alive)."""
    out = {t for t in node.input if t}
    for g in subgraphs(node):
        for inner in g.node:
            out |= node_reads(inner)
    return out


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    """The names a subgraph reads from its enclosing scopes: read by its nodes (and by their
    own subgraphs) and defined by none of its inputs, initializers or nodes."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer} | {o for n in graph.node for o in n.output}
    reads = {t for n in graph.node for t in n.input if t}
    for n in graph.node:
        for g in subgraphs(n):
            reads |= outer_reads(g)
    return reads - defined


def live(nodes: Sequence[onnx.NodeProto], outputs: Iterable[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes (in their given order) that the tensors `outputs` depend on, and every tensor
    name on the way (`outputs` included). Used to drop dead nodes from emitted models: ONNX
    Runtime keeps and runs them (e.g. the full-batch backward pass that update_statistics
    emits with the loss but does not need with a statistics sub-batch)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    needed: set[str] = set()
    kept: set[int] = set()
    stack = list(outputs)
    while stack:
        t = stack.pop()
        if t in needed:
            continue
        needed.add(t)
        i = producer.get(t)
        if i is not None and i not in kept:
            kept.add(i)
            stack.extend(node_reads(nodes[i]))
    return [n for i, n in enumerate(nodes) if i in kept], needed


def value_info(name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    """A ValueInfo; None dims and a None shape mean unknown."""
    return helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape))
