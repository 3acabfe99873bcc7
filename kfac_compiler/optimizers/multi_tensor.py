"""Optimizer updates over every parameter at once (multi-tensor) or parameter by parameter.

An update rule (Adam's, SGD's) is a few elementwise nodes. Emitted once per parameter, a
ResNet-18 step runs some 800 of them, each a kernel launch on a GPU and a scheduling round on
the CPU (issue 40). `Layout` lets an emitter write its rule once over *chunks*: one chunk per
parameter (the per-parameter layout), or one chunk holding every parameter's values, each
flattened and concatenated (the multi-tensor layout: a Reshape per parameter, which ONNX
Runtime runs as an alias of its input, and one Concat per vector). The rule's results are
split back with one Split and a Reshape per parameter.

    lay = Layout(em, multi_tensor=o.multi_tensor)
    g, p = lay.pack(grads), lay.pack(em.parts.params_dict)
    new = lay.map(lambda g, p: {"p": b.sub(p, b.mul(lr, g))}, g=g, p=p)
    for q, t in lay.unpack(new["p"]).items():
        em.state_output(q, t)

The optimizer state stays one slot per parameter in both layouts (checkpoints, exports and
data-parallel runs see the same slots): the concatenation is inside the graph. Every
trainable parameter has the subgraph's float type (its state slots are float32), so there is
one concatenation per vector (one per dtype).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission

Chunks = list[str]  # a parameter-shaped vector in a Layout: one tensor per chunk


class Layout:
    """How an update addresses the parameters: `multi_tensor` False, one chunk per parameter
    (in em.parts.params' order); True, one chunk, the concatenation of every parameter's
    flattened values."""

    def __init__(self, em: Emission, multi_tensor: bool) -> None:
        self.b = em.b
        self.params = list(em.parts.params)
        self.shapes = {p: tuple(int(d) for d in em.view.static_shape(p)) for p in self.params}
        self.multi_tensor = bool(multi_tensor) and len(self.params) > 0
        self._flat_shape = self.b.ints([-1]) if self.multi_tensor else ""

    def __len__(self) -> int:
        return 1 if self.multi_tensor else len(self.params)

    def pack(self, per_param: Mapping[str, str]) -> Chunks:
        """The chunks of the vector {param: tensor}."""
        if not self.multi_tensor:
            return [per_param[p] for p in self.params]
        b = self.b
        flat = [b.reshape(per_param[p], self._flat_shape) for p in self.params]
        return [flat[0] if len(flat) == 1 else b.op("Concat", flat, axis=0, hint="multi_tensor")]

    def unpack(self, chunks: Chunks) -> dict[str, str]:
        """{param: tensor} of a vector's chunks."""
        if not self.multi_tensor:
            return dict(zip(self.params, chunks))
        b, (flat,) = self.b, chunks
        sizes = [int(np.prod(self.shapes[p], dtype=np.int64)) for p in self.params]
        parts = b.split(flat, sizes, axis=0) if len(sizes) > 1 else [flat]
        return {p: b.reshape(t, list(self.shapes[p])) for p, t in zip(self.params, parts)}

    def map(self, rule: Callable[..., dict[str, str]], **vectors: Chunks) -> dict[str, Chunks]:
        """`rule` (keyword tensors -> {name: tensor}) applied chunk by chunk to `vectors`
        (each a Chunks of this layout); its results by name, as Chunks."""
        out: dict[str, Chunks] = {}
        for i in range(len(self)):
            for name, t in rule(**{k: v[i] for k, v in vectors.items()}).items():
                out.setdefault(name, []).append(t)
        return out

    def sum_squares(self, chunks: Chunks) -> str:
        """The scalar sum of the squares of every element of a vector."""
        return self.b.sum([self.b.reduce("ReduceSumSquare", c, None) for c in chunks])

