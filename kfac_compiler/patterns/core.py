"""Pattern machinery: a Pattern is a small graph of PNodes (an ONNX op with an optional
attribute predicate, or PARAM: a trainable parameter initializer) and PEdges; a Binding is a
candidate match; the registry holds the built-in patterns and the user's.

See the package docstring (kfac_compiler/patterns/__init__.py) and docs/frontend.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx

from kfac_compiler.graph import GraphView, attrs_of
from kfac_compiler.ir import LAYER_KINDS

PARAM = "Param"  # op_type of a pattern node standing for a trainable parameter initializer


class NoMatch(Exception):
    """Raised by a pattern's `attrs`/`where` to reject a match (the reason becomes a warning)."""


@dataclass(frozen=True)
class PNode:
    """A pattern vertex: an ONNX op (op_type, domain) or PARAM (a trainable initializer).

    `where(node, view)` is an extra predicate: for an op, `node` is the onnx.NodeProto; for a
    PARAM, the initializer name.
    """

    key: str
    op_type: str
    domain: str = ""
    where: Callable[[Any, GraphView], bool] | None = None


@dataclass(frozen=True)
class PEdge:
    """The (first) output of `src` (or the PARAM tensor) feeds input slot `slots` of `dst`."""

    src: str
    dst: str
    slots: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Binding:
    """A candidate match: pattern keys bound to graph vertices (node names / tensor names)."""

    pattern: Pattern
    view: GraphView
    mapping: dict[str, str]

    def node(self, key: str) -> onnx.NodeProto:
        return self.view.node_by_name[self.mapping[key]]

    def tensor(self, key: str) -> str:
        """The tensor a pattern vertex stands for (PARAM: its name; op: its first output)."""
        pn = self.pattern.node_by_key[key]
        return self.mapping[key] if pn.op_type == PARAM else self.node(key).output[0]

    def attr(self, key: str, name: str, default: Any = None) -> Any:
        return attrs_of(self.node(key)).get(name, default)

    def shape(self, tensor: str):
        return self.view.shape(tensor)

    @property
    def weight(self) -> str:
        return self.mapping[self.pattern.weight]

    @property
    def bias(self) -> str | None:
        return self.mapping[self.pattern.bias] if self.pattern.bias else None

    def input(self) -> str:
        key, slot = self.pattern.input
        node = self.node(key)
        if slot is not None:
            return node.input[slot] if slot < len(node.input) else ""
        covered = {self.tensor(k) for k in self.mapping}
        rest = [i for i in node.input if i and i not in covered]
        if len(rest) != 1:
            raise NoMatch(f"node {node.name!r}: cannot tell the layer input among {list(node.input)}")
        return rest[0]

    def output(self) -> str:
        return self.node(self.pattern.output).output[0]

    def op_nodes(self) -> tuple[str, ...]:
        return tuple(self.mapping[p.key] for p in self.pattern.nodes if p.op_type != PARAM)


@dataclass(frozen=True)
class Pattern:
    name: str
    kind: str
    nodes: tuple[PNode, ...]
    edges: tuple[PEdge, ...]
    weight: str
    output: str
    input: tuple[str, int | None]
    bias: str | None = None
    where: Callable[[Binding], bool] | None = None
    attrs: Callable[[Binding], dict] | None = None
    priority: int = 0
    node_by_key: dict[str, PNode] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_by_key", {n.key: n for n in self.nodes})

    @property
    def size(self) -> int:
        """Vertices (ops and parameters): the larger pattern wins an overlap."""
        return len(self.nodes)

    def op_types(self) -> set[str]:
        return {n.op_type for n in self.nodes}

    def validate(self) -> None:
        keys = self.node_by_key
        if len(keys) != len(self.nodes):
            raise ValueError(f"pattern {self.name!r}: duplicate node keys")
        if self.kind not in LAYER_KINDS or self.kind == "generic":
            raise ValueError(f"pattern {self.name!r}: kind must be one of {LAYER_KINDS[:-1]}, not {self.kind!r}")
        for role, key in (("weight", self.weight), ("bias", self.bias)):
            if key is not None and (key not in keys or keys[key].op_type != PARAM):
                raise ValueError(f"pattern {self.name!r}: {role} {key!r} must be a PARAM node")
        for role, key in (("output", self.output), ("input", self.input[0])):
            if key not in keys or keys[key].op_type == PARAM:
                raise ValueError(f"pattern {self.name!r}: {role} {key!r} must be an op node")
        for e in self.edges:
            if e.src not in keys or e.dst not in keys or keys[e.dst].op_type == PARAM:
                raise ValueError(f"pattern {self.name!r}: bad edge {e}")
            if not e.slots:
                raise ValueError(f"pattern {self.name!r}: edge {e} has no slots")


# ---------------------------------------------------------------------- registry
_BUILTIN: list[Pattern] = []
_USER: list[Pattern] = []


def register_pattern(p: Pattern, replace: bool = False) -> Pattern:
    """Add a user pattern (checked). A name already registered needs replace=True."""
    p.validate()
    existing = [q for q in _BUILTIN + _USER if q.name == p.name]
    if existing and not replace:
        raise ValueError(f"a pattern named {p.name!r} is already registered (pass replace=True)")
    unregister_pattern(p.name)
    _USER.append(p)
    return p


def unregister_pattern(name: str) -> None:
    """Remove a pattern (user or built-in) by name."""
    for reg in (_USER, _BUILTIN):
        reg[:] = [q for q in reg if q.name != name]


def patterns() -> list[Pattern]:
    """All active patterns: built-ins first, then user patterns (registration order)."""
    return list(_BUILTIN) + list(_USER)


def register_builtin(p: Pattern) -> Pattern:
    """Add a built-in pattern (builtin.py), checked."""
    p.validate()
    _BUILTIN.append(p)
    return p


# ------------------------------------------------------------------ predicates
def attr_eq(name: str, value: Any, default: Any = None) -> Callable[[onnx.NodeProto, GraphView], bool]:
    """Node predicate: attribute `name` (or `default` when absent) equals `value`."""

    def pred(node: onnx.NodeProto, view: GraphView) -> bool:
        v = attrs_of(node).get(name, default)
        if isinstance(v, bytes):
            v = v.decode()
        return v == value

    return pred


def all_of(*preds: Callable) -> Callable:
    def pred(x, view):
        return all(p(x, view) for p in preds)

    return pred


def param_rank(*ranks: int) -> Callable[[str, GraphView], bool]:
    """PARAM predicate: the initializer has one of `ranks`."""

    def pred(name: str, view: GraphView) -> bool:
        return view.rank(name) in ranks

    return pred


def num_inputs(n: int) -> Callable[[onnx.NodeProto, GraphView], bool]:
    """Node predicate: exactly n non-empty inputs."""

    def pred(node, view):
        return sum(1 for i in node.input if i) == n

    return pred


def nice_float(x) -> float:
    """A float attribute (stored as float32) as the shortest float that round-trips (1e-5, not 9.99e-6)."""
    return float(f"{float(x):.7g}")


def static_size(shape) -> int | None:
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return math.prod(shape)
