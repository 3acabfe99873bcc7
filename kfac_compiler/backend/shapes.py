"""Declared tensor shapes (value_info) of an emitted subgraph, so that ONNX Runtime's
allocation planner can reuse buffers.

ORT's planner reuses a freed buffer only for a tensor of the same shape (symbolic dims equal
by name). A tensor whose batch dim ORT's own inference loses (after a Flatten, Reshape(-1) or
Concat of the symbolic batch, and everything elementwise downstream: an unrolled recurrence
and its whole backward) matches nothing; its buffer stays on the planner's free list and every
later allocation walks that list: the unrolled LSTM's Adam step took 10-27 s to set up with
reuse, 1-2 s without (benchmarks/results/2026-11-29-declared-shapes.md). The emission knows
more than ORT infers, and declares it:

* the whole batch's forward tensors: the canonical model's shapes (ONNX shape inference),
  the example axis's dim where it left it unknown or made up a symbol for it ("unk__3")
  named from the tensor's example axis (passes/batch_axis.py): outer x N x inner entries,
  "8*N" (the same name wherever the rows are the same);
* a forward clone on a sub-batch (forward.sub_batch_pass: min(m, N) rows) the same shapes
  under its own batch symbol ("kfac/sub16/N"), never the whole batch's; a clone at other
  parameters (the same rows) keeps the batch symbol. Shape inference's made-up symbols
  ("unk__3") are renamed per clone, the inputs' other symbols (a sequence length) kept;
* each cotangent and tangent: its primal's shape (autodiff's contract, docs/autodiff.md),
  recorded by the builder (GraphBuilder.shaped_like), where every primal it has agrees.

Only complete shapes are declared, and none where the data inputs do not share one symbolic
batch dim on their axis 0 (a static batch: ORT infers every shape itself). A wrong declared
shape would be worse than none (ORT reuses a buffer of the wrong size, or rejects the run), so
tests/test_declared_shapes.py checks every declaration against the run-time shapes.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import onnx

from kfac_compiler.builder import subgraphs
from kfac_compiler.graph import GraphView
from kfac_compiler.passes.batch_axis import example_layouts


@dataclass(frozen=True)
class Rows:
    """A dim of outer x B x inner entries, B the batch of the pass the tensor belongs to."""

    outer: int = 1
    inner: int = 1

    def name(self, batch: str) -> str:
        return "*".join([str(self.outer)] * (self.outer != 1) + [batch] + [str(self.inner)] * (self.inner != 1))


Dim = int | str | Rows
Declared = tuple[int, tuple[int | str, ...]]  # (element type, dims)


def batch_symbol(view: GraphView) -> str | None:
    """The data inputs' one symbolic batch dim (their axis 0), when it appears on no other
    input axis; else None."""
    dims = [view.shape(x) for x in view.graph_inputs]
    if not dims or any(not s for s in dims):
        return None
    heads = {s[0] for s in dims if s}
    batch = heads.pop() if len(heads) == 1 else None
    if not isinstance(batch, str) or any(batch in s[1:] for s in dims if s):
        return None
    return batch


@dataclass
class DeclaredShapes:
    """The forward passes of one emitted subgraph, whose shapes `declare` writes (module
    docstring)."""

    view: GraphView
    batch: str | None
    passes: list[tuple[Callable[[str], str], str, bool]] = field(default_factory=list)

    @classmethod
    def of(cls, view: GraphView) -> DeclaredShapes:
        """The canonical graph `view`'s shapes; its whole-batch pass (the graph itself) added."""
        out = cls(view, batch_symbol(view))
        out.add_pass(lambda t: t, "", own_batch=False)
        return out

    def add_pass(self, rename: Callable[[str], str], prefix: str, own_batch: bool) -> None:
        """A forward clone whose copy of canonical tensor t is rename(t) == prefix + t;
        `own_batch`: its rows are not the whole batch (its batch symbol is prefix + N)."""
        self.passes.append((rename, prefix, own_batch))

    def _input_symbols(self) -> set[str]:
        """The data inputs' symbols (the batch's and, say, a sequence length's)."""
        return {d for x in self.view.graph_inputs for d in self.view.shape(x) or () if isinstance(d, str)}

    def _forward(self) -> dict[str, tuple[int, tuple[Dim, ...]]]:
        """{canonical tensor: (type, dims)} for every complete shape, batch dims as Rows."""
        view, batch = self.view, self.batch
        layouts = example_layouts(view)
        inputs = self._input_symbols()
        out: dict[str, tuple[int, tuple[Dim, ...]]] = {}
        for node in view.nodes:
            for t in node.output:
                shape, dtype = view.shape(t), view.dtypes.get(t)
                if not t or shape is None or not dtype:
                    continue
                lay = layouts.get(t)
                # the example axis: unknown to shape inference, or a symbol it made up ("unk__3")
                dims: list[Dim | None] = [
                    Rows() if d == batch else Rows(lay.outer, lay.inner)
                    if lay and lay.axis == j and (d is None or isinstance(d, str) and d not in inputs) else d
                    for j, d in enumerate(shape)]
                if None not in dims:
                    out[t] = (dtype, tuple(d for d in dims if d is not None))
        return out

    def known(self, model: onnx.ModelProto) -> dict[str, Declared]:
        """{tensor of `model`: (type, dims)}: its inputs' and initializers' and every pass's
        forward tensors'."""
        inputs = self._input_symbols()
        known: dict[str, Declared] = {}
        for t, (dtype, dims) in self._forward().items():
            for rename, prefix, own in self.passes:
                name = rename(t)
                if name != prefix + t:  # a tensor the clone reads instead (substituted)
                    continue
                batch = prefix + str(self.batch) if own else str(self.batch)
                known[name] = (dtype, tuple(d.name(batch) if isinstance(d, Rows)
                                            else prefix + d if isinstance(d, str) and d not in inputs else d
                                            for d in dims))
        for vi in model.graph.input:
            t = vi.type.tensor_type
            if t.HasField("shape") and all(d.HasField("dim_value") or d.dim_param for d in t.shape.dim):
                known[vi.name] = (t.elem_type, tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                                                     for d in t.shape.dim))
        for init in model.graph.initializer:
            known[init.name] = (init.data_type, tuple(int(d) for d in init.dims))
        return known

    def declare(self, model: onnx.ModelProto, like: Mapping[str, set[str]]) -> int:
        """Append to `model`'s graph (and its If/Loop bodies) value_info for each tensor a
        node makes whose shape is known (forward tensors) or follows from `like` (tensor ->
        tensors of the same shape: every known one agreeing); the number declared. Nothing
        without a symbolic batch."""
        if self.batch is None:
            return 0
        known = self.known(model)
        count = 0
        for graph in _graphs(model.graph):
            skip = {vi.name for vi in list(graph.input) + list(graph.output) + list(graph.value_info)}
            skip |= {t.name for t in graph.initializer}
            for node in graph.node:
                for t in node.output:
                    if not t or t in skip:
                        continue
                    cands = {known[x] for x in like.get(t, ()) if x in known}
                    if t in known:
                        cands.add(known[t])
                    if len(cands) == 1:
                        dtype, dims = cands.pop()
                        graph.value_info.append(onnx.helper.make_tensor_value_info(t, dtype, list(dims)))
                        count += 1
        return count


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every body nested in its nodes (If branches, Loop bodies)."""
    yield graph
    for node in graph.node:
        for body in subgraphs(node):
            yield from _graphs(body)
