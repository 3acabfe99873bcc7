"""Pass: where each tensor keeps the batch (example) axis, propagated from the graph inputs.

A layer's rows are examples x positions, but the examples need not be the leading axis:
torch's nn.MultiheadAttention runs its in-projection on time-major [T, N, D] rows and its
out-projection on [T*N, D] (ViT's and wav2vec2's TorchScript exports). Statistics summed over
all rows (Kronecker factors) only need the number of examples; per-example statistics
(diagonal blocks, EKFAC's S, scale_and_shift) must know which rows form one example.

`example_layouts(view)` maps every tensor it can place to an ExampleAxis(axis, outer, inner):
axis `axis` holds outer * N * inner entries, entry (o * N + n) * inner + i belonging to example
n. The graph inputs (not initializers) have (0, 1, 1), the convention's batch axis. Each op
type has one rule in RULES that maps its inputs' layouts (and the static shapes of shape
inference) to its outputs' (an Expand or ConstantOfShape of no placed input, a recurrent zero
state [1, N, H] or a class token expanded to [N, 1, D], goes where its inferred shape holds the
inputs' batch symbol); an op without a rule, or a rule that cannot tell (the example axis
contracted, reduced, sliced, or a Reshape whose static dims do not pin the split), leaves its
outputs unplaced, and so does anything computed only from them. Blocks then fall back as
FisherBlock.example_rows says (docs/conventions.md "The example axis").

Shape arithmetic done at run time (TorchScript's Swin computes its window counts from
`x.size()`) leaves ONNX's inferred dims anonymous (`unk__6`), which pin nothing. When a use of
a structured layer is left unplaced, the rules run again on the shapes of ONNX Runtime's
symbolic shape inference (`symbolic_view`: `4*N` windows), as torch.export writes them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from kfac_compiler.graph import Dim, GraphView


@dataclass(frozen=True)
class ExampleAxis:
    """Axis `axis` = outer x N x inner (outer and inner static): see the module docstring."""

    axis: int
    outer: int = 1
    inner: int = 1

    @property
    def batch_major(self) -> bool:
        """The leading axis starts with the examples, each one's rows contiguous ([N, ...] or
        [N*T, ...]): what a block grouping rows by the leading axis assumes."""
        return self.axis == 0 and self.outer == 1 and self.inner == 1

    def describe(self) -> str:
        merged = [f"{self.outer}" if self.outer != 1 else "", "N", f"{self.inner}" if self.inner != 1 else ""]
        return f"axis {self.axis} = {'*'.join(p for p in merged if p)}"


Layouts = dict[str, ExampleAxis]
Rule = Callable[[GraphView, onnx.NodeProto, list["ExampleAxis | None"]], "list[ExampleAxis | None] | None"]
RULES: dict[str, Rule] = {}

# ops that keep their inputs' axes (numpy broadcasting aligns them at the end)
ELEMENTWISE = (
    "Abs", "Acos", "Add", "And", "Asin", "Atan", "BitShift", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Cos",
    "Cosh", "Div", "Dropout", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater", "GreaterOrEqual",
    "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log", "Max",
    "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "PRelu", "Pow", "Reciprocal", "Relu", "Round",
    "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh",
    "ThresholdedRelu", "Where", "Xor",
)
# ops that mix entries along attribute `axis` (and, for the normalizations, every later axis)
ALONG_AXIS = ("Softmax", "LogSoftmax", "Hardmax", "CumSum", "LayerNormalization", "RMSNormalization",
              "SimplifiedLayerNormalization", "SkipLayerNormalization")
# ops on [N, C, *spatial] that keep axis 0 (the examples there, merged or not)
CHANNEL_FIRST = ("Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool",
                 "GlobalMaxPool", "GlobalLpPool", "BatchNormalization", "InstanceNormalization",
                 "GroupNormalization", "LRN", "Resize", "Upsample", "DepthToSpace", "SpaceToDepth")


def rule(*ops: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn
    return deco


def _rank(view: GraphView, name: str) -> int | None:
    return view.rank(name) if name else None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _agree(cands: list[ExampleAxis | None]) -> ExampleAxis | None:
    """The one layout every placed candidate gives (None when they differ or none is placed)."""
    placed = {c for c in cands if c is not None}
    return placed.pop() if len(placed) == 1 else None


def _aligned(view: GraphView, node: onnx.NodeProto, ins: list[ExampleAxis | None], out_rank: int | None):
    """Each placed input's layout in the output's axes (numpy broadcasting: aligned at the end)."""
    if out_rank is None:
        return []
    out = []
    for name, lay in zip(node.input, ins):
        r = _rank(view, name)
        if lay is not None and r is not None:
            out.append(ExampleAxis(lay.axis + out_rank - r, lay.outer, lay.inner))
    return out


@rule(*ELEMENTWISE)
def _elementwise(view, node, ins):
    return [_agree(_aligned(view, node, ins, _rank(view, node.output[0])))] * len(node.output)


@rule(*ALONG_AXIS)
def _along_axis(view, node, ins):
    lay, r = ins[0], _rank(view, node.input[0])
    if lay is None or r is None:
        return None
    axis = int(_attr(node, "axis", -1)) % r
    return [lay if lay.axis != axis and (node.op_type in ("Softmax", "LogSoftmax", "Hardmax", "CumSum")
                                         or lay.axis < axis) else None] * len(node.output)


@rule(*CHANNEL_FIRST)
def _channel_first(view, node, ins):
    lay = ins[0]
    return [lay if lay is not None and lay.axis == 0 else None] + [None] * (len(node.output) - 1)


@rule("Transpose")
def _transpose(view, node, ins):
    lay, r = ins[0], _rank(view, node.input[0])
    if lay is None or r is None:
        return None
    perm = list(_attr(node, "perm", list(range(r))[::-1]))
    return [ExampleAxis(perm.index(lay.axis), lay.outer, lay.inner)]


@rule("MatMul", "FusedMatMul")
def _matmul(view, node, ins):
    r = _rank(view, node.output[0])
    ra, rb = _rank(view, node.input[0]), _rank(view, node.input[1])
    if r is None or ra is None or rb is None:
        return None
    cands: list[ExampleAxis | None] = []
    a, bl = ins[0], ins[1]
    if a is not None:  # rows (axis ra - 2) and batch dims pass through; the contracted axis does not
        cands.append(None if a.axis == ra - 1 else ExampleAxis(a.axis + r - ra, a.outer, a.inner))
    if bl is not None:
        if rb < 2 or bl.axis == rb - 2:
            cands.append(None)
        else:
            cands.append(ExampleAxis(bl.axis + r - rb, bl.outer, bl.inner))
    return [None if None in cands else _agree(cands)]


@rule("Gemm")
def _gemm(view, node, ins):
    a = ins[0]
    if a is None or ins[1] is not None:
        return None
    rows = 1 if _attr(node, "transA", 0) else 0
    return [ExampleAxis(0, a.outer, a.inner) if a.axis == rows else None]


@rule("Attention")
def _attention(view, node, ins):
    """Attention (opset 23) works per row of its batch axis 0 (Q, K, V and the past key and
    value [B, ...]; the mask broadcast to [B, H, S, L]): every output keeps the examples
    there when each placed input has them on axis 0 alike."""
    cands = [lay for j, lay in enumerate(ins) if j != 3 and lay is not None]
    mask = ins[3] if len(ins) > 3 else None
    if mask is not None:
        r = _rank(view, node.input[3])
        if r is None:
            return None
        cands.append(ExampleAxis(mask.axis + 4 - r, mask.outer, mask.inner))
    lay = _agree(cands)
    return [lay] * len(node.output) if lay is not None and lay.axis == 0 else None


@rule("Gather")
def _gather(view, node, ins):
    data, idx = ins[0], ins[1]
    r, q = _rank(view, node.input[0]), _rank(view, node.input[1])
    if r is None or q is None:
        return None
    axis = int(_attr(node, "axis", 0)) % r
    if data is not None and idx is None:
        if data.axis == axis:
            return None
        return [data if data.axis < axis else ExampleAxis(data.axis + q - 1, data.outer, data.inner)]
    if idx is not None and data is None:  # a lookup: the indices' axes replace `axis`
        return [ExampleAxis(axis + idx.axis, idx.outer, idx.inner)]
    return None


@rule("Concat")
def _concat(view, node, ins):
    r = _rank(view, node.output[0])
    lay = _agree(list(ins))
    if lay is None or r is None:
        return None
    if lay.axis != int(_attr(node, "axis", 0)) % r:
        return [lay]
    # k pieces along their example axis, each outer x N x inner: the blocks' rows stacked
    # (an unrolled recurrence's steps), outer grows k-fold. Every piece must be placed.
    if any(x is None for x in ins):
        return None
    return [ExampleAxis(lay.axis, lay.outer * len(ins), lay.inner)]


def _axes_of(view: GraphView, node: onnx.NodeProto, input_index: int) -> list[int] | None:
    """Axes given by attribute `axes` or (newer opsets) by a constant input."""
    attr = _attr(node, "axes")
    if attr is not None:
        return [int(a) for a in attr]
    if len(node.input) > input_index and node.input[input_index]:
        value = view.constant_value(node.input[input_index])
        return None if value is None else [int(a) for a in np.asarray(value).reshape(-1)]
    return None


@rule("Slice")
def _slice(view, node, ins):
    lay, r = ins[0], _rank(view, node.input[0])
    if lay is None or r is None:
        return None
    axes = _axes_of(view, node, 3)
    if axes is None:  # computed axes: the example axis is kept if shape inference says so
        s_in, s_out = view.shape(node.input[0]), view.shape(node.output[0])
        kept = s_in is not None and s_out is not None and isinstance(s_in[lay.axis], str) \
            and len(s_out) == r and s_out[lay.axis] == s_in[lay.axis]
        return [lay] if kept else None
    hits = [j for j, a in enumerate(axes) if a % r == lay.axis]
    return [lay] if all(_whole(view, node, j) for j in hits) else None


def _whole(view: GraphView, node: onnx.NodeProto, j: int) -> bool:
    """Slice entry j takes its axis whole (start 0, end past any size, step 1: an exporter's
    `x[:]`)."""
    vals = []
    for k, default in ((1, None), (2, None), (4, 1)):
        v = view.constant_value(node.input[k]) if len(node.input) > k and node.input[k] else None
        if v is None and default is None:
            return False
        vals.append(default if v is None else int(np.asarray(v).reshape(-1)[j]))
    start, end, step = vals
    return start == 0 and end >= 2**31 - 1 and step == 1


@rule("Split")
def _split(view, node, ins):
    lay, r = ins[0], _rank(view, node.input[0])
    if lay is None or r is None:
        return None
    if lay.axis != int(_attr(node, "axis", 0)) % r:
        return [lay] * len(node.output)
    # k equal parts along the example axis (no sizes given) of outer x N x inner, k dividing
    # outer: each part is outer/k x N x inner (the unrolled recurrence's time steps)
    k = len(node.output)
    equal = len(node.input) < 2 or not node.input[1]
    if not equal or lay.outer % k:
        return None
    return [ExampleAxis(lay.axis, lay.outer // k, lay.inner)] * k


@rule("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
      "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
def _reduce(view, node, ins):
    lay, r = ins[0], _rank(view, node.input[0])
    if lay is None or r is None:
        return None
    axes = _axes_of(view, node, 1)
    if axes is None:
        return None  # all axes (or noop_with_empty_axes): not worth telling apart
    axes = [a % r for a in axes]
    if lay.axis in axes:
        return None
    keep = bool(_attr(node, "keepdims", 1))
    return [lay if keep else ExampleAxis(lay.axis - sum(a < lay.axis for a in axes), lay.outer, lay.inner)]


@rule("Expand", "Pad")
def _expand(view, node, ins):
    return [_agree(_aligned(view, node, ins[:1], _rank(view, node.output[0])))]


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(view, node, ins):
    lay = ins[0]
    s_in, s_out = view.shape(node.input[0]), view.shape(node.output[0])
    if lay is None or s_in is None or s_out is None:
        return None
    return [reshaped(s_in, lay, s_out)]


def _prod(dims) -> int | None:
    out = 1
    for d in dims:
        if not isinstance(d, int) or d < 0:
            return None
        out *= d
    return out


def reshaped(s_in: tuple[Dim, ...], lay: ExampleAxis, s_out: tuple[Dim, ...]) -> ExampleAxis | None:
    """The example axis after a row-major reshape from s_in to s_out, when the dims pin it:
    s_out starting with s_in's dims up to the example axis (static, or the same symbol), or
    else the entries before the examples (pre) and after them (post) are counted from
    s_in, and exactly one output axis j must have static dims on both sides that divide them
    and a dim that is dynamic (as the batch) or, with a static batch, pre/before * N *
    post/after."""
    head = tuple(s_in[:lay.axis + 1])
    if None not in head and tuple(s_out[:lay.axis + 1]) == head:
        return lay  # the axes up to the examples' kept (shape inference's symbols): only later ones change
    pre, post = _prod(s_in[:lay.axis]), _prod(s_in[lay.axis + 1:])
    if pre is None or post is None:
        return None
    pre, post = pre * lay.outer, post * lay.inner
    d_in = s_in[lay.axis]
    n = d_in // (lay.outer * lay.inner) if isinstance(d_in, int) and d_in > 0 else None  # a static batch
    found = []
    for j, d in enumerate(s_out):
        before, after = _prod(s_out[:j]), _prod(s_out[j + 1:])
        if before is None or after is None or pre % before or post % after:
            continue
        outer, inner = pre // before, post // after
        if isinstance(d, int) and (n is None or d != outer * n * inner):
            continue
        found.append(ExampleAxis(j, outer, inner))
    return found[0] if len(found) == 1 else None


def example_layouts(view: GraphView) -> Layouts:
    """{tensor: ExampleAxis} for every tensor whose example axis the rules can place."""
    layouts: Layouts = {name: ExampleAxis(0) for name in view.graph_inputs}
    batch = {d for d in (_leading_dim(view, name) for name in view.graph_inputs) if isinstance(d, str)}
    for node in view.nodes:
        ins = [layouts.get(i) if i else None for i in node.input]
        if all(lay is None for lay in ins):
            made = _made_with_the_batch(view, node, batch)
            if made is not None:
                layouts[node.output[0]] = made
            continue
        fn = RULES.get(node.op_type)
        outs = fn(view, node, ins) if fn is not None else None
        for name, lay in zip(node.output, outs or []):
            if name and lay is not None:
                layouts[name] = lay
    return layouts




def _leading_dim(view: GraphView, name: str) -> Dim | None:
    shape = view.shape(name)
    return shape[0] if shape else None


# ops that make a tensor of a computed shape from no data: a recurrent module's zero state
# (torch.export: Expand of zeros to [1, N, H]), which carries the batch as a dim of its shape
_SHAPED_FROM_NOTHING = ("Expand", "ConstantOfShape")


def _made_with_the_batch(view: GraphView, node: onnx.NodeProto, batch: set) -> ExampleAxis | None:
    """The layout of a tensor made of a computed shape, placed where its inferred shape
    holds the graph inputs' batch symbol (on one axis only); None otherwise."""
    if node.op_type not in _SHAPED_FROM_NOTHING or not batch:
        return None
    axes = [k for k, d in enumerate(view.shape(node.output[0]) or []) if d in batch]
    return ExampleAxis(axes[0]) if len(axes) == 1 else None


# a Constant's attribute other than `value` -> the dtype of the tensor it stands for
_CONSTANT_DTYPES = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}


def tensor_valued_constants(model: onnx.ModelProto) -> None:
    """Rewrite in place the main graph's Constant nodes given by `value_int(s)` /
    `value_float(s)` (torch.export writes them) as `value` tensors: ONNX Runtime's symbolic
    shape inference reads only `value` (it fails on vit-dynamo_noopt's class-token Reshape
    otherwise)."""
    for node in model.graph.node:
        if node.op_type != "Constant" or len(node.attribute) != 1 or node.attribute[0].name not in _CONSTANT_DTYPES:
            continue
        attr = node.attribute[0]
        arr = np.asarray(onnx.helper.get_attribute_value(attr), dtype=_CONSTANT_DTYPES[attr.name])
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(arr)))


def symbolic_view(view: GraphView) -> GraphView | None:
    """The graph with shapes from ONNX Runtime's symbolic shape inference (sympy expressions
    through shape arithmetic: Swin's windows as `4*N`, where ONNX's data propagation stops at
    a Where or a division of run-time dims), on a copy without the large weights' values (the
    canonical model's shape arithmetic is already folded to a fixed point:
    canonicalize.fold_to_fixed_point); None when it fails."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from kfac_compiler.passes.load import light_copy  # the weight-free copy inference reads

    model = light_copy(view.model)
    del model.graph.value_info[:]
    tensor_valued_constants(model)
    try:
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    except Exception:  # noqa: BLE001  (an op it does not know, ...: the ONNX placement stands)
        return None
    return GraphView(inferred) if inferred is not None else None


def _triple(lay: ExampleAxis | None) -> tuple[int, int, int] | None:
    return None if lay is None else (lay.axis, lay.outer, lay.inner)


def traced_layouts(layers: list, view: GraphView) -> tuple[Layouts, GraphView | None]:
    """example_layouts(view), completed from symbolic_view where a use of a structured layer
    is left unplaced; and that view (None when it was not needed or failed)."""
    layouts = example_layouts(view)
    if all(layer.kind == "generic" or all(layouts.get(u.output) is not None for u in layer.uses) for layer in layers):
        return layouts, None
    symbolic = symbolic_view(view)
    if symbolic is None:
        return layouts, None
    return {**example_layouts(symbolic), **layouts}, symbolic


def with_example_axes(layers: list, view: GraphView) -> list:
    """Each layer with attrs["example_axes"] (per use: (input, output) as (axis, outer, inner),
    None where unplaced) when some use's rows are not batch-major; other layers unchanged (the
    blocks' default: examples on the leading axis). A use output left unplaced whose leading
    dim is not the batch (the data inputs' leading dim) in ONNX's nor the symbolic shapes is
    marked in attrs["unplaced_uses"] for example_axis_notes."""
    layouts, symbolic = traced_layouts(layers, view)
    views = [v for v in (view, symbolic) if v is not None]

    def batch_led(name: str) -> bool:
        """The leading dim of `name` is the data inputs' (the batch) in ONNX's or the symbolic shapes."""
        for v in views:
            shape, batch = v.shape(name), {(v.shape(i) or (None,))[0] for i in view.graph_inputs} - {None}
            if shape and shape[0] in batch:
                return True
        return False

    out = []
    for layer in layers:
        per_use = tuple((layouts.get(u.input), layouts.get(u.output)) for u in layer.uses)
        if layer.kind == "generic" or all(i is not None and i.batch_major and o is not None and o.batch_major
                                          for i, o in per_use):
            out.append(layer)
            continue
        axes = tuple((_triple(i), _triple(o)) for i, o in per_use)
        attrs = {**layer.attrs, "example_axes": axes}
        unplaced = tuple(k for k, (_, o) in enumerate(per_use) if o is None and not batch_led(layer.uses[k].output))
        if unplaced:
            attrs["unplaced_uses"] = unplaced
        out.append(dataclasses.replace(layer, attrs=attrs))
    return out


def movable_uses(layer, ranks: list[tuple[int | None, int | None]],
                 paired: bool = True) -> list[tuple[ExampleAxis, int, int] | None]:
    """Per use: (layout, input rank, output rank) when a "movable" block gets that use's
    tensors with the example axis moved to the front (ops.emit_batch_major): the output
    placed, not batch-major, the example axis not its last (feature) axis, and with `paired`
    (the block pairs input rows with output rows: FisherBlock.moves_inputs) the input placed
    alike. None: the use is batch-major, or cannot be moved (example_axis_notes said so)."""
    axes = layer.attrs.get("example_axes")
    out: list[tuple[ExampleAxis, int, int] | None] = []
    for u, (r_in, r_out) in enumerate(ranks):
        if not axes:
            out.append(None)
            continue
        i, o = axes[u]
        if o is None or r_out is None or o[0] >= r_out - 1 or (
                paired and (i is None or tuple(i) != tuple(o) or r_in is None)):
            out.append(None)
            continue
        lay = ExampleAxis(*o)
        out.append(None if lay.batch_major else (lay, r_in if r_in is not None else -1, r_out))
    return out


def example_axis_notes(layers: list, view: GraphView, block_of: Callable[[object], object]) -> list[str]:
    """One note per layer whose block (block_of(layer), None: none) groups rows into examples
    (FisherBlock.example_rows) where a use's example axis is placed off the leading axis and
    the block cannot move it, or could not be placed at all (attrs["unplaced_uses"]: not
    even at a concrete batch, and the leading dim is not the batch there): its per-example
    statistics then take each leading-axis slice for an example. An unplaced tensor whose
    leading dim is the batch is assumed batch-major (the convention), unnoted."""
    notes = []
    for layer in layers:
        axes = layer.attrs.get("example_axes")
        block = block_of(layer) if axes else None
        kind = getattr(block, "example_rows", "pooled")
        if kind == "pooled":
            continue
        unplaced = layer.attrs.get("unplaced_uses", ())
        if unplaced:
            u = unplaced[0]
            params = ", ".join(repr(p) for p in layer.params)
            notes.append(f"layer {layer.name!r} ({params}): the example axis of use {u}'s output "
                         f"{layer.uses[u].output!r} could not be traced and its leading dim is not the batch "
                         f"size: {layer.approximation} takes each leading-axis row for an example, so its "
                         "per-example statistics may square sums over windows or positions instead of examples; "
                         "export with static shapes, or choose a Kronecker block for the layer")
            continue
        paired = bool(getattr(block, "moves_inputs", True))
        ranks = [(view.rank(u.input), view.rank(u.output)) for u in layer.uses]
        moved = movable_uses(layer, ranks, paired) if kind == "movable" else [None] * len(axes)
        bad = [u for u, (i, o) in enumerate(axes) if moved[u] is None
               and any(lay is not None and not ExampleAxis(*lay).batch_major for lay in ((i, o) if paired else (o,)))]
        if not bad:
            continue
        i, o = axes[bad[0]]
        where = ", ".join(f"{t} {ExampleAxis(*lay).describe() if lay else 'not placed'}"
                          for t, lay in (("input", i), ("output", o)))
        notes.append(f"layer {layer.name!r}: {layer.approximation} groups rows into examples by the leading axis, "
                     f"but use {bad[0]}'s example axis is elsewhere ({where}): its per-example statistics are "
                     f"biased; a kron block is layout-independent")
    return notes


__all__ = ["ExampleAxis", "RULES", "example_axis_notes", "example_layouts", "movable_uses", "reshaped",
           "symbolic_view", "traced_layouts", "with_example_axes"]
