"""Rule 6 of the constants rule: what a float initializer computes before it meets the data.

Exporters build some constants at run time from other constants: torchvision's Swin writes its
shifted-window attention mask by scattering constant blocks into a zero image and then
replaces every element with -100 or 0 (`masked_fill` twice); Llama's rotary embeddings compute
cos and sin tables from the `inv_freq` buffer (or torch.export's optimizer folds the tables
into initializers). Each path is differentiable, so rule 2 keeps them as parameters, yet none
is a torch parameter. A tensor is *input-free* when it is computed without the graph inputs'
values (from initializers, constants and `Shape`s whose asked-for dims are static); the
*frontier* of an initializer is the input-free tensors computed from it that the data-dependent
part of the graph (or the output) reads. The initializer is a constant when

  a. no element of it reaches the frontier: element masks propagated back from the frontier
     through what lies between, exactly through `Where` (its condition, evaluated with
     onnx.reference, picks the branch) and conservatively elsewhere (an output element needed:
     every element of each differentiable input), select none of its elements (the Swin
     mask's scattered blocks: `masked_fill` twice overwrites every element);
  b. every frontier tensor is a rotation table: it has a partner of its shape, in its frontier
     or an initializer, with cos^2 + sin^2 = 1 in every element (rotary position embeddings'
     tables, or the inverse frequencies they are computed from through `Cos` and `Sin`).

A learnt weight meets the data at once or through a reshape, and no random values satisfy
cos^2 + sin^2 = 1, so neither test freezes one.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from kfac_compiler.builder import subgraphs
from kfac_compiler.graph import GraphView
from kfac_compiler.passes.fold_params import MAX_NODES, evaluate_nodes, static_shape

_DEFAULT_DOMAINS = ("", "ai.onnx")
# input slots read for their element type or shape, not their values
_TYPE_ONLY = {"CastLike": (1,), "Shape": (0,), "Size": (0,)}
_RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
_MAX_ELEMENTS = 1 << 20  # evaluated with onnx.reference: larger initializers are left to the other rules


class InputFree:
    """The input-free tensors of a graph, and the values given to its evaluation (`shapes`: the
    static Shapes among them, empty tensors for inputs read only for their type)."""

    def __init__(self, view: GraphView, learnable_slot: Callable[[onnx.NodeProto, int], bool]) -> None:
        self.view, self.learnable_slot = view, learnable_slot
        self.tensors: set[str] = set(view.initializers)
        self.shapes: dict[str, np.ndarray] = {}
        self.nodes: set[int] = set()
        self._tables: dict[tuple[int, ...], dict[str, np.ndarray]] | None = None
        for node in view.nodes:
            if node.domain not in _DEFAULT_DOMAINS or subgraphs(node) or node.op_type in _RANDOM:
                continue
            if node.op_type == "Shape" and node.input[0] not in self.tensors:
                value = static_shape(view, node)
                if value is not None:
                    self.shapes[node.output[0]] = value
                    self.tensors.add(node.output[0])
                continue
            typed = _TYPE_ONLY["CastLike"] if node.op_type == "CastLike" else ()  # Shape: above
            if all(i in self.tensors for k, i in enumerate(node.input) if i and k not in typed):
                for k in typed:  # read for its element type only: an empty tensor of it will do
                    like = node.input[k] if k < len(node.input) else ""
                    if like and like not in self.tensors and view.dtypes.get(like):
                        dtype = onnx.helper.tensor_dtype_to_np_dtype(view.dtypes[like])
                        self.shapes[like] = np.zeros(0, dtype)
                    elif like and like not in self.tensors:
                        break
                else:
                    self.nodes.add(id(node))
                    self.tensors.update(o for o in node.output if o)

    def cone(self, name: str) -> tuple[dict[int, onnx.NodeProto], list[str]] | None:
        """(the input-free nodes computing from `name`, its frontier) or None when too large."""
        view, reached, nodes, stack = self.view, {name}, {}, [name]
        while stack:
            for node in view.consumers.get(stack.pop(), []):
                if id(node) in self.nodes and id(node) not in nodes:
                    nodes[id(node)] = node
                    new = [o for o in node.output if o and o not in reached]
                    reached.update(new)
                    stack.extend(new)
                    if len(nodes) > MAX_NODES:
                        return None
        outputs = set(view.graph_outputs)
        frontier = [t for t in reached if t in outputs or any(
            id(r) not in self.nodes and not all(k in _TYPE_ONLY.get(r.op_type, ()) for k, i in enumerate(r.input) if i == t)
            for r in view.consumers.get(t, []))]
        return nodes, sorted(frontier)

    def tables(self, shape: tuple[int, ...], but: str) -> dict[str, np.ndarray]:
        """Float initializers of `shape` read only by Mul nodes, with values in [-1, 1]: the
        candidate partners of a folded rotation table (`but` left out)."""
        if self._tables is None:
            self._tables = {}
            for n, t in self.view.initializers.items():
                if t.data_type == onnx.TensorProto.FLOAT and _only_mul(self.view, n) and self.view.consumers.get(n):
                    a = self.view.array(n)
                    if 1 < a.size <= _MAX_ELEMENTS and np.abs(a).max() <= 1 + 1e-5:
                        self._tables.setdefault(a.shape, {})[n] = a
        return {n: a for n, a in self._tables.get(shape, {}).items() if n != but}

    def evaluate(self, nodes: dict[int, onnx.NodeProto], targets: list[str]) -> list[np.ndarray] | None:
        """The targets' values (onnx.reference) from the cone's nodes and the input-free nodes
        computing what else they read; None when it cannot run."""
        needed = dict(nodes)
        stack = [i for n in nodes.values() for i in n.input if i]
        while stack:  # input-free tensors the cone reads from outside it
            t = stack.pop()
            node = self.view.producer.get(t)
            if node is None or id(node) in needed or t in self.shapes:
                continue
            needed[id(node)] = node
            stack.extend(i for i in node.input if i)
            if len(needed) > MAX_NODES:
                return None
        return evaluate_nodes(self.view, needed, self.shapes, {}, targets)


def _reduce_to(mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`mask` of a broadcast result summed (any) back to an operand of `shape`."""
    lead = mask.ndim - len(shape)
    mask = mask.any(axis=tuple(range(lead))) if lead > 0 else mask
    axes = tuple(k for k, d in enumerate(shape) if d == 1 and mask.shape[k] != 1)
    return (mask.any(axis=axes, keepdims=True) if axes else mask).reshape(shape)


def _selected(free: InputFree, nodes: dict[int, onnx.NodeProto], values: dict[str, np.ndarray], name: str,
              frontier: list[str]) -> bool:
    """Whether any element of `name` reaches the frontier: element masks propagated back through
    the cone, exactly through Where (its condition's value picks the branch), conservatively
    (an element of the output needed: every element of each differentiable input) elsewhere."""
    need = {t: np.ones(values[t].shape, bool) for t in frontier}

    def add(t: str, mask: np.ndarray) -> None:
        need[t] = need[t] | mask if t in need else mask

    for node in reversed([n for n in free.view.nodes if id(n) in nodes]):
        if not any(o in need and need[o].any() for o in node.output if o):
            continue
        if node.op_type == "Where" and node.output[0] in need:
            out, cond = need[node.output[0]], values[node.input[0]].astype(bool)
            for slot, sel in ((1, out & cond), (2, out & ~cond)):
                if node.input[slot] in values:  # (not a static Shape's value)
                    add(node.input[slot], _reduce_to(sel, values[node.input[slot]].shape))
            continue
        for slot, t in enumerate(node.input):
            if t and t in values and free.learnable_slot(node, slot):
                add(t, np.ones(values[t].shape, bool))
    return bool(name in need and need[name].any())


def _only_mul(view: GraphView, name: str) -> bool:
    return all(n.op_type == "Mul" for n in view.consumers.get(name, []))


def _rotation_partners(tables: dict[str, np.ndarray], others: dict[str, np.ndarray]) -> bool:
    """Every table has a partner (another table or one of `others`) of its shape with
    cos^2 + sin^2 = 1 elementwise."""
    pool = {**others, **tables}
    for t, a in tables.items():
        if a.size < 2 or not np.issubdtype(a.dtype, np.floating) or np.abs(a).max() > 1 + 1e-5:
            return False
        if not any(o != t and b.shape == a.shape and np.allclose(a * a + b * b, 1.0, atol=1e-5)
                   for o, b in pool.items()):
            return False
    return True


def input_free_reason(free: InputFree, name: str) -> str | None:
    """Rule 6's reason for the float initializer `name` (module docstring), or None."""
    view = free.view
    value = view.array(name)
    if value.size > _MAX_ELEMENTS:
        return None
    cone = free.cone(name)
    if cone is None:
        return None
    nodes, frontier = cone
    if frontier == [name]:  # read by the data directly: a folded rotation table or a weight
        if _only_mul(view, name) and _rotation_partners({name: value}, free.tables(value.shape, name)):
            return "constant: a rotation table (cos^2 + sin^2 = 1 with an initializer of its shape: rotary embeddings)"
        return None
    if name in frontier or not frontier:
        return None
    ops = {n.op_type for n in nodes.values()}
    if not ops & {"Where", "Cos", "Sin"}:
        return None
    inner = sorted({o for n in nodes.values() for o in n.output if o} | {i for n in nodes.values() for i in n.input
                                                                           if i and i not in free.shapes})
    got = free.evaluate(nodes, inner)
    if got is None:
        return None
    values = dict(zip(inner, map(np.asarray, got)))
    if {"Cos", "Sin"} <= ops and _rotation_partners({t: values[t] for t in frontier}, {}):
        return ("constant: computes rotation tables (Cos and Sin with cos^2 + sin^2 = 1: rotary embeddings' "
                "inverse frequencies)")
    if "Where" in ops and not _selected(free, nodes, values, name, frontier):
        return (f"constant: has no influence on the output (the Where nodes between it and the data "
                f"({', '.join(frontier[:2])}) select none of its elements: a mask overwritten)")
    return None


__all__ = ["InputFree", "input_free_reason"]
