"""Optimizer updates over every parameter at once (multi-tensor) or parameter by parameter.

An update rule (Adam's, SGD's) is a few elementwise nodes. Emitted once per parameter, a
ResNet-18 step runs some 800 of them, each a kernel launch on a GPU and a scheduling round on
the CPU (issue 40). `Layout` lets an emitter write its rule once over *chunks*: one chunk per
parameter (the per-parameter layout), or one chunk holding every parameter's values, each
flattened and concatenated (the multi-tensor layout: a Reshape per parameter, which ONNX
Runtime runs as an alias of its input, and one Concat per vector). The rule's results are
split back into the parameters' shapes with a Split per group of parameters of the same
trailing shape (Layout's docstring).

    lay = Layout(em, multi_tensor=o.multi_tensor)
    g, theta = lay.pack(grads), lay.pack({p: p for p in lay.params})
    new = lay.map(lambda g, p: {"p": b.sub(p, b.mul(lr, g))}, g=g, p=theta)
    for p, t in lay.unpack(new["p"]).items():
        em.state_output(p, t)

The optimizer's own state (`Layout.state` / `write_state`: SGD's velocity, Adam's moments) is
one slot per parameter in the per-parameter layout and one flat slot per kind in the
multi-tensor layout (`velocity/*`, `adam_m/*`, `adam_v/*`: no Concat, Split or Reshape for
them). Checkpoints store the flat slots as the per-parameter ones (`split_flat`, `join_flat`),
so a checkpoint of either layout resumes in the other. Every trainable parameter has the
subgraph's float type (its state slots are float32), so there is one concatenation per vector
(one per dtype).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from onnx import numpy_helper

from kfac_compiler import contract as C

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.runtime.state import StateStore

Chunks = list[str]  # a parameter-shaped vector in a Layout: one tensor per chunk

# The stacked Gram's rows in pieces of GRAM_PIECE floats once a row holds two pieces or more
# (Layout.gram_of): ONNX Runtime's Gemm of a [k, N] stack with itself, k = 3, runs on one thread
# (its tiles are over the 3 x 3 result) and, on two threads, sums an entry with a float32 error
# of 8.7e-4 of |x_i| |x_j| on ResNet-18's 11.2M parameters (1.3e-4 on a 3.2M GPT); as a
# batched MatMul over the pieces it runs on every thread and errs by 3.5e-7
# (benchmarks/results/2026-11-30-chunked-gram.md).
GRAM_PIECE = 16384


def concat_groups(shapes: Mapping[str, Sequence[int]]) -> list[list[str]]:
    """The parameters (in `shapes`' order) grouped by their shape less its first dimension,
    each group where its first member is; a scalar parameter is a group of its own. Their
    concatenation holds the groups in this order."""
    groups: dict[tuple, list[str]] = {}
    for p, shape in shapes.items():
        shape = tuple(int(d) for d in shape)
        groups.setdefault(("trailing", shape[1:]) if shape else ("scalar", p), []).append(p)
    return list(groups.values())


def split_flat(flat: np.ndarray, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    """{param: its part of `flat`, in its shape}: a flat slot's per-parameter values."""
    out, start = {}, 0
    for p in [p for group in concat_groups(shapes) for p in group]:
        size = int(np.prod(shapes[p], dtype=np.int64))
        out[p] = flat[start:start + size].reshape(tuple(shapes[p]))
        start += size
    if start != flat.size:
        raise ValueError(f"a flat slot of {flat.size} values for parameters of {start}")
    return {p: out[p] for p in shapes}


def join_flat(values: Mapping[str, np.ndarray], shapes: Mapping[str, Sequence[int]]) -> np.ndarray:
    """The flat slot of per-parameter `values` (split_flat's inverse); ValueError naming a
    value whose shape is not its parameter's."""
    for p, shape in shapes.items():
        if tuple(np.shape(values[p])) != tuple(shape):
            raise ValueError(f"{p!r} is {list(np.shape(values[p]))}, its parameter {list(shape)}")
    order = [p for group in concat_groups(shapes) for p in group]
    return np.concatenate([np.asarray(values[p]).reshape(-1) for p in order]) if order else np.zeros(0)


def state_values(store: StateStore, kind: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray] | None:
    """{param: its <kind>/<param> value} for the parameters `shapes`, whichever layout the
    store holds them in: the flat slot <kind>/* split (split_flat), else the per-parameter
    slots; None where it holds neither (an optimizer state this run does not keep). The host
    side's one way to read a kind's values (K-FAC's roll back)."""
    if C.flat(kind) in store:
        return split_flat(store.to_numpy(C.flat(kind)), shapes)
    names = {p: f"{kind}/{p}" for p in shapes}
    if not all(n in store for n in names.values()):
        return None
    return {p: store.to_numpy(n) for p, n in names.items()}


def set_state_values(store: StateStore, kind: str, values: Mapping[str, np.ndarray],
                     shapes: Mapping[str, Sequence[int]]) -> None:
    """Write {param: value} into the <kind> slots state_values read (joined into the flat slot
    where the store holds one)."""
    if C.flat(kind) in store:
        store.set(C.flat(kind), join_flat(values, shapes).astype(store.spec(C.flat(kind))[1]))
        return
    for p in shapes:
        store.set(f"{kind}/{p}", values[p])


class Layout:
    """How an update addresses the parameters (em.parts.params, or `params`): `multi_tensor`
    False, one chunk per parameter (in their order); True, one chunk, the concatenation of every parameter's
    flattened values, the parameters grouped by their shape less its first dimension.

    The concatenation reads each parameter through a Reshape to 1-D (none for a 1-D one): ONNX
    Runtime runs a Reshape of a tensor as an alias of it, no kernel and no copy, so the
    Concat is the one kernel. Splitting back, the parameters of a group (same trailing
    shape, consecutive in the concatenation) come out of one Split along their first axis
    already in their shapes, straight into the state outputs: one Split into groups and one
    per group (a Reshape per group to [-1, *trailing], an alias), instead of a Reshape per
    parameter, which copies into its output (as the one parameter of a group of its own of
    rank >= 2 still does)."""

    def __init__(self, em: Emission, multi_tensor: bool, params: Sequence[str] | None = None) -> None:
        self.b = em.b
        self.params = list(em.parts.params if params is None else params)  # a parameter group's: `params`
        self.shapes = {p: tuple(int(d) for d in em.view.static_shape(p)) for p in self.params}
        self.multi_tensor = bool(multi_tensor) and len(self.params) > 0
        self.groups = concat_groups(self.shapes)
        self.order = [p for group in self.groups for p in group]  # the concatenation's order
        self._packed: dict[tuple[str, ...], dict[str, str]] = {}  # pack's chunks -> what it packed

    def __len__(self) -> int:
        return 1 if self.multi_tensor else len(self.params)

    def size(self, p: str) -> int:
        return int(np.prod(self.shapes[p], dtype=np.int64))

    def total(self) -> int:
        """The number of values of a parameter-shaped vector."""
        return sum(self.size(p) for p in self.params)

    def _gram_pad(self) -> int | None:
        """The zero padding of a stack's rows to whole GRAM_PIECEs, or None where the rows stay
        whole (less than two pieces)."""
        n = self.total()
        return -n % GRAM_PIECE if n >= 2 * GRAM_PIECE else None

    def pack(self, per_param: Mapping[str, str]) -> Chunks:
        """The chunks of the vector {param: tensor}."""
        if not self.multi_tensor:
            return [per_param[p] for p in self.params]
        b = self.b
        flat = [per_param[p] if len(self.shapes[p]) == 1 else b.reshape(per_param[p], [-1]) for p in self.order]
        chunks = [flat[0] if len(flat) == 1 else b.op("Concat", flat, axis=0, hint="multi_tensor")]
        self._packed[tuple(chunks)] = {p: per_param[p] for p in self.params}
        return chunks

    def unpack(self, chunks: Chunks) -> dict[str, str]:
        """{param: tensor} of a vector's chunks; a vector `pack` made unpacks to the tensors it
        packed (no Split: an emitter need not track which of its vectors it changed)."""
        if not self.multi_tensor:
            return dict(zip(self.params, chunks))
        if tuple(chunks) in self._packed:
            return dict(self._packed[tuple(chunks)])
        return self.split_flat(chunks[0])

    def split_flat(self, flat: str, tail: int = 0) -> dict[str, str]:
        """{param: tensor} of a 1-D tensor holding every parameter's values in the
        concatenation's order (`order`), then `tail` values left out: a Split into the groups,
        and one per group of more than one parameter."""
        b = self.b
        sizes = [sum(self.size(p) for p in group) for group in self.groups] + ([tail] if tail else [])
        pieces = b.split(flat, sizes, axis=0) if len(sizes) > 1 else [flat]  # the tail's piece unread
        out: dict[str, str] = {}
        for group, piece in zip(self.groups, pieces):
            shape = self.shapes[group[0]]
            if len(group) == 1:
                out[group[0]] = piece if len(shape) == 1 else b.reshape(piece, list(shape))
                continue
            rows = piece if len(shape) == 1 else b.reshape(piece, [-1, *shape[1:]])
            out.update(zip(group, b.split(rows, [self.shapes[p][0] for p in group], axis=0)))
        return {p: out[p] for p in self.params}

    def state(self, em: Emission, kind: str, init: str = "zeros") -> Chunks:
        """The optimizer state slots of `kind` (C.VELOCITY, C.ADAM_M, ...) as a vector:
        <kind>/<p> per parameter, or the one flat slot <kind>/* (C.flat)."""
        if not self.multi_tensor:
            return [em.state_input(f"{kind}/{p}", self.shapes[p], init) for p in self.params]
        return [em.state_input(C.flat(kind), (self.total(),), init)]

    def write_state(self, em: Emission, kind: str, chunks: Chunks) -> None:
        """The new value of the `kind` slots that `state` read."""
        if not self.multi_tensor:
            for p, t in zip(self.params, chunks):
                em.state_output(f"{kind}/{p}", t)
        else:
            em.state_output(C.flat(kind), chunks[0])

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

    def dot(self, x: Chunks, y: Chunks) -> str:
        """The scalar x.y of two vectors: per parameter a Mul and a ReduceSum, then a Sum; over
        the concatenation one MatMul of the two 1-D vectors (a dot product: one node, reading
        each vector once). Many products of the same few vectors: `stack` and `gram_of`."""
        b = self.b
        if self.multi_tensor:
            return b.matmul(x[0], y[0])
        return b.sum([b.reduce_sum(b.mul(u, v), None) for u, v in zip(x, y)])

    def stack(self, vectors: Sequence[Chunks]) -> str:
        """The k vectors as the rows of one [k, N] stack, each row in the concatenation's order
        (`order`): one Concat of their flattened chunks (a Reshape per chunk of rank other
        than 1, an alias). Rows of two GRAM_PIECEs or more are zero-padded to whole pieces (a
        ConstantOfShape chunk in the same Concat) for gram_of."""
        b, k = self.b, len(vectors)
        flat = self._flat_chunks(vectors)
        pad = self._gram_pad()
        if pad:
            # a node, not a stored constant of up to a piece (plans keep no width-sized constant)
            zeros = b.op("ConstantOfShape", [b.ints([pad])], value=numpy_helper.from_array(np.zeros(1, b.np_float)),
                         hint="gram_pad")
            per = len(flat) // k
            flat = [t for i in range(k) for t in flat[i * per:(i + 1) * per] + [zeros]]
        return b.reshape(b.op("Concat", flat, axis=0, hint="gram_stack"), [k, -1])

    def gram_of(self, stack: str, k: int) -> list[list[str]]:
        """Every dot product of the k rows of `stack` (Layout.stack), as scalars [i][j]: one
        Gemm S S^T [k, k], or on rows in pieces the pieces' products [R, k, k] (the stack
        viewed as [k, R, GRAM_PIECE], a batched MatMul whose transposes ONNX Runtime fuses into
        it: no copy) summed over the pieces; then one Split into the entries. With the stack
        three kernels instead of a Mul and a ReduceSum (or a ReduceSumSquare) per product and
        parameter and a Sum per product: the per-parameter K-FAC step's Gram of g, P and v was
        377 of ResNet-18's executed nodes per step (issue 40). The Concat copies the k vectors
        once, which the per-parameter products' Muls did per product. Float32 sums: along the
        whole row in the Gemm, piece by piece in the pieces' form."""
        b = self.b
        if self._gram_pad() is not None:
            rows = b.reshape(stack, [k, -1, GRAM_PIECE])
            per_piece = b.matmul(b.transpose(rows, [1, 0, 2]), b.transpose(rows, [1, 2, 0]))
            gram = b.reshape(b.reduce_sum(per_piece, [0]), [k * k])
        else:
            gram = b.reshape(b.op("Gemm", [stack, stack], transB=1, hint="gram"), [k * k])
        entries = b.split(gram, [1] * (k * k), axis=0)
        scalars = {(i, j): b.reshape(entries[i * k + j], []) for i in range(k) for j in range(i, k)}
        return [[scalars[min(i, j), max(i, j)] for j in range(k)] for i in range(k)]

    def combine(self, stack: str, coefficients: Sequence[str | None]) -> Chunks:
        """sum_i c_i row_i of `stack` (Layout.stack; None: a row left out, coefficient 0) as a
        vector of this layout: one MatMul of the coefficients with the stack, split into the
        parameters (split_flat) in the per-parameter layout, the rows' zero padding left out. A
        linear combination of vectors the step stacked already (the Gram's copy) costs a few
        nodes in all instead of a Mul and an Add per term and parameter; the sum runs in the
        MatMul's order (float32 rounding, and 0 times a row adds an exact 0 where the row is
        finite)."""
        b = self.b
        zero = b.const(np.zeros(1))
        row = b.op("Concat", [zero if c is None else b.unsqueeze(c, [0]) for c in coefficients], axis=0)
        flat = b.matmul(row, stack)
        pad = self._gram_pad() or 0
        if self.multi_tensor:
            if pad:
                flat = b.op("Slice", [flat, b.ints([0]), b.ints([self.total()])])
            return [flat]
        per = self.split_flat(flat, tail=pad)
        return [per[p] for p in self.params]

    def _flat_chunks(self, vectors: Sequence[Chunks]) -> list[str]:
        """The chunks of `vectors`, one after the other, each 1-D."""
        if self.multi_tensor:
            return [c for chunks in vectors for c in chunks]
        index = {p: i for i, p in enumerate(self.params)}
        return [chunks[index[p]] if len(self.shapes[p]) == 1 else self.b.reshape(chunks[index[p]], [-1])
                for chunks in vectors for p in self.order]
