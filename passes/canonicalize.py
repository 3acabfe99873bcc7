"""Pass 1: canonicalize a model so that the pattern library sees one form of each layer.

`canonicalize(model, output)` returns a NEW model (the input is never mutated) where
  1. every node has a unique name (no clash with other nodes, initializers or inputs);
  2. the graph is restricted to what feeds `output` (the only graph output), dead nodes,
     unused inputs and initializers are dropped; so is the file's value_info that ONNX's
     shape inference contradicts (jax2onnx's NHWC declarations of NCHW tensors);
  3. Identity, no-op Cast / CastLike (to the type it already has), identity Transpose and
     inference-form Dropout are collapsed (the output name is kept: the producer is renamed
     instead); a float initializer re-laid out at run time (Reshape, Unsqueeze, Squeeze,
     Transpose, Flatten: torch.export's unsqueezed GroupNorm affine) is folded into an
     initializer of the re-laid shape (passes/fold_params.py, `relayout_ends`), after a
     constant-index lookup of one (Swin's GatherND of its position bias table) is rewritten
     as a Gather of its flattened elements (passes/index_views.py);
  4. Gemm with transA=1 is rewritten as Transpose + Gemm(transA=0), so that every
     fully connected layer has its input activations as a tensor of shape [batch, in]; an
     Einsum that is a dense layer (x with a parameter or its Transpose) becomes a MatMul
     (passes/einsum.py);
     SplitToSequence read only by SequenceAt at constant positions becomes Split; a conv
     or pool with auto_pad SAME_* and dilations gets explicit pads (ONNX Runtime refuses it);
  5. constant subgraphs (nodes whose inputs are all Constant-node outputs or NON-float
     initializers, e.g. shape arithmetic) are evaluated with onnx.reference and replaced
     by Constant nodes; float initializers are never folded (they may be parameters);
     Gather(Shape(x), constant indices) of dims static in the inferred shapes is a constant;
     repeated with shape inference between rounds until nothing more folds (a folded Reshape
     target makes the next dims static: TorchScript's Swin folds 1,121 -> 768 nodes in a second
     round), at most FOLD_ROUNDS rounds;
  6. shape inference (strict off, data_prop on) fills value_info; ir_version is pinned to
     kfac_compiler.builder.IR_VERSION;
  7. fused LSTM/GRU/RNN nodes with a static sequence length are unrolled into primitive
     ops (passes/recurrent.py, after the first shape inference); weights the exporter
     assembles from initializers at run time (Slice/Concat, torch.export without its
     optimizer) are folded into initializers first (passes/fold_params.py).

`recognise_loss(model, output)` detects a loss op at the end of the graph (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss(LogSoftmax), a mean
squared difference) and returns the scores tensor, loss kind, labels input and the loss options the op
sets (its ignore_index).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, helper, numpy_helper

from kfac_compiler.builder import IR_VERSION, live, outer_reads, subgraphs
from kfac_compiler.errors import ModelError
from kfac_compiler.graph import FLOAT_TYPES, GraphView, attrs_of, fresh_name
from kfac_compiler.losses import SoftmaxCrossEntropy, SquaredError
from kfac_compiler.passes.einsum import einsum_to_matmul
from kfac_compiler.passes.fold_params import fold_assembled, relayout_ends, shape_dims
from kfac_compiler.passes.index_views import index_views
from kfac_compiler.passes.load import light_copy
from kfac_compiler.passes.recurrent import lower_recurrent, weight_inputs

# Ops never folded: random, or with side effects / sequences.
_NO_FOLD = {
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
    "Bernoulli", "If", "Loop", "Scan", "SequenceConstruct", "SequenceEmpty", "Dropout",
}


# ---------------------------------------------------------------------------- canonicalize
def canonicalize(model: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """The canonical copy of `model` restricted to `output` (see the module docstring)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    _name_nodes(m)
    _drop_contradicted_value_info(m)
    _restrict(m, output)
    _rewrite_gemm_trans_a(m)
    einsum_to_matmul(m)
    m = infer_shapes(m, keep_going=True)
    _explicit_same_pads(m)
    _split_sequences(m)
    m = fold_assembled(m, weight_inputs(m))
    m = lower_recurrent(m)
    _collapse_noops(m, output)
    m = fold_to_fixed_point(m, output)
    m = index_views(m)
    _restrict(m, output)  # a folded shape's dead Shape(P) would read P: relayout_ends wants P read once
    m = fold_assembled(m, relayout_ends(m), keep_source_name=True)
    _restrict(m, output)
    m.ir_version = IR_VERSION
    return infer_shapes(m, keep_going=True)


def _name_nodes(m: onnx.ModelProto) -> None:
    g = m.graph
    reserved = {t.name for t in g.initializer} | {i.name for i in g.input}
    used: set[str] = set()
    counters: dict[str, int] = {}
    for node in g.node:
        name = node.name
        if not name or name in used or name in reserved:
            base = name or node.op_type
            k = counters.get(base, 0)
            while True:
                cand = f"{base}_{k}"
                k += 1
                if cand not in used and cand not in reserved:
                    break
            counters[base] = k
            name = cand
            node.name = name
        used.add(name)


def _drop_contradicted_value_info(m: onnx.ModelProto) -> None:
    """Drop the file's intermediate value_info that ONNX's inference contradicts (another
    element type, rank or static dim). jax2onnx declares a Relu output NHWC that the graph
    computes NCHW; ONNX Runtime runs the file, but inference keeps a declared shape, so the
    stale one reached the emitted graphs, which ONNX Runtime then refused. Graph inputs and
    outputs are the load check's (passes/load.py)."""
    g = m.graph
    if not g.value_info:
        return
    bare = light_copy(m)
    del bare.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(bare, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - nothing to compare against: the declarations stay
        return
    found = {vi.name: vi for vi in inferred.graph.value_info}
    kept = [vi for vi in g.value_info if vi.name not in found or not _contradicts(vi, found[vi.name])]
    if len(kept) < len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(kept)


def _contradicts(declared: onnx.ValueInfoProto, inferred: onnx.ValueInfoProto) -> bool:
    """Whether two tensor declarations disagree on the element type, the rank or a static dim
    (symbolic dims agree with anything: exporters name them as they like)."""
    a, b = declared.type.tensor_type, inferred.type.tensor_type
    if a.elem_type and b.elem_type and a.elem_type != b.elem_type:
        return True
    if not (a.HasField("shape") and b.HasField("shape")):
        return False
    if len(a.shape.dim) != len(b.shape.dim):
        return True
    return any(x.HasField("dim_value") and y.HasField("dim_value") and x.dim_value != y.dim_value
               for x, y in zip(a.shape.dim, b.shape.dim))


def _restrict(m: onnx.ModelProto, output: str) -> None:
    """Keep only what feeds `output`; make it the single graph output."""
    g = m.graph
    nodes, needed = live(list(g.node), [output])
    out_vi = None
    for vi in list(g.output) + list(g.value_info):
        if vi.name == output:
            out_vi = onnx.ValueInfoProto()
            out_vi.CopyFrom(vi)
            break
    if out_vi is None:
        out_vi = helper.make_empty_tensor_value_info(output)
    inits = [t for t in g.initializer if t.name in needed]
    init_names = {t.name for t in inits}
    inputs = [i for i in g.input if i.name in needed and i.name not in init_names]
    vis = [v for v in g.value_info if v.name in needed and v.name != output]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.input[:]
    g.input.extend(inputs)
    del g.value_info[:]
    g.value_info.extend(vis)
    del g.output[:]
    g.output.append(out_vi)
    # sparse initializers are not parameters we support; keep those still used
    sparse = [s for s in g.sparse_initializer if s.values.name in needed]
    del g.sparse_initializer[:]
    g.sparse_initializer.extend(sparse)


_SAME_PADDED = ("Conv", "MaxPool", "AveragePool", "LpPool")


def _explicit_same_pads(m: onnx.ModelProto) -> None:
    """auto_pad SAME_UPPER/SAME_LOWER with dilations > 1 as explicit pads (spatial dims
    static): ONNX Runtime's CPU Conv refuses that combination at run time ('Dilation not
    supported for AutoPadType::SAME_UPPER'), which TorchScript writes for Conv1d(padding=
    "same", dilation=2). The pads are oprules.conv.Geom's, which every conv rule uses."""
    from kfac_compiler.oprules._util import attr
    from kfac_compiler.oprules.conv import Geom

    view = None
    for node in m.graph.node:
        if node.op_type not in _SAME_PADDED or node.domain not in ("", "ai.onnx"):
            continue
        if attr(node, "auto_pad", "NOTSET") not in ("SAME_UPPER", "SAME_LOWER") or all(
                d == 1 for d in attr(node, "dilations", [1])):
            continue
        view = view or GraphView(m)
        try:
            geom = Geom(view, node, node.input[0], node.input[1] if node.op_type == "Conv" else None)
        except Exception:  # noqa: BLE001 - dims not static: left as it is (the rules say why, in one line)
            continue
        keep = [x for x in node.attribute if x.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend([*keep, helper.make_attribute("pads", [*geom.pb, *geom.pe])])


def _rewrite_gemm_trans_a(m: onnx.ModelProto) -> None:
    g = m.graph
    taken = {n.name for n in g.node} | {o for n in g.node for o in n.output} | {t.name for t in g.initializer}
    taken |= {i.name for i in g.input}
    new_nodes = []
    for node in g.node:
        if node.op_type == "Gemm" and node.domain in ("", "ai.onnx") and attrs_of(node).get("transA", 0):
            t_out = fresh_name(f"{node.name}/transA:0", taken)
            t_name = fresh_name(f"{node.name}/transA", taken)
            new_nodes.append(helper.make_node("Transpose", [node.input[0]], [t_out], name=t_name, perm=[1, 0]))
            node.input[0] = t_out
            for a in node.attribute:
                if a.name == "transA":
                    a.i = 0
        new_nodes.append(node)
    del g.node[:]
    g.node.extend(new_nodes)


def _split_sequences(m: onnx.ModelProto) -> None:
    """SplitToSequence(x, sizes) read only by SequenceAt at constant positions becomes
    Split(x, sizes) (torch.split in torch.export graphs without the exporter's optimizer): no
    sequence types on the gradient path."""
    view = GraphView(m)  # lookups of what exists before the rewrite (constants, shapes, readers)

    def const_ints(name: str) -> np.ndarray | None:
        value = view.constant_value(name)
        return None if value is None else np.asarray(value).astype(np.int64)

    drop, new_nodes = set(), []
    for node in view.nodes:
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            new_nodes.append(node)
            continue
        a = attrs_of(node)
        axis = int(a.get("axis", 0))
        sizes = const_ints(node.input[1])
        if sizes is not None and sizes.ndim == 0:  # a scalar: chunks of that size
            shape = view.shape(node.input[0])
            dim = shape[axis] if shape is not None else None
            chunk = int(sizes)
            sizes = None if not isinstance(dim, int) else [min(chunk, dim - k) for k in range(0, dim, chunk)]
        users = view.consumers.get(node.output[0], [])
        positions = [const_ints(u.input[1]) if u.op_type == "SequenceAt" and len(u.input) > 1 else None
                     for u in users]
        if (sizes is None or len(sizes) < 2 or not a.get("keepdims", 1) or not users
                or any(p is None or p.size != 1 for p in positions)):
            new_nodes.append(node)
            continue
        sizes_name = f"{node.name}/sizes"
        m.graph.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), sizes_name))
        outs = [f"{node.output[0]}:{k}" for k in range(len(sizes))]
        copies = []  # a second reader of one chunk (positions 0 and 0, or 0 and -2 of 2) reads the first's
        claimed: set[int] = set()
        for u, pos in zip(users, positions):
            k = int(pos.reshape(-1)[0]) % len(sizes)
            if k in claimed:
                copies.append(helper.make_node("Identity", [outs[k]], [u.output[0]], name=f"{u.name or u.output[0]}/copy"))
            else:
                outs[k] = u.output[0]
                claimed.add(k)
            drop.add(id(u))
        new_nodes.append(helper.make_node("Split", [node.input[0], sizes_name], outs, name=node.name, axis=axis))
        new_nodes.extend(copies)
    del m.graph.node[:]
    m.graph.node.extend(n for n in new_nodes if id(n) not in drop)


def _elem_types(m: onnx.ModelProto) -> dict[str, int]:
    g = m.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    types[n.output[0]] = a.t.data_type
    return types


def _is_const_false(name: str, m: onnx.ModelProto) -> bool:
    view = GraphView(m)
    v = view.constant_value(name)
    return v is not None and v.size == 1 and not bool(v.reshape(-1)[0])


def _collapse_noops(m: onnx.ModelProto, output: str) -> None:
    g = m.graph
    types = _elem_types(m)
    graph_sources = {i.name for i in g.input} | {t.name for t in g.initializer}
    consumed = {i for n in g.node for i in n.input if i}
    # names an If/Loop/Scan body reads from this scope: renaming them here would leave the
    # body reading a tensor that no longer exists (the weight behind it vanished from the plan)
    body_reads = {t for n in g.node for body in subgraphs(n) for t in outer_reads(body)}
    remove: set[int] = set()
    rename: dict[str, str] = {}

    def resolve(t: str) -> str:
        while t in rename:
            t = rename[t]
        return t

    for idx, node in enumerate(g.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        op = node.op_type
        noop = False
        if op == "Identity" and len(node.input) == 1:
            noop = True
        elif op == "Cast" and len(node.input) == 1:
            src_type = types.get(node.input[0])
            noop = src_type is not None and src_type != 0 and src_type == attrs_of(node).get("to")
        elif op == "CastLike" and len(node.input) == 2:  # torch.export's cast of an affine to the data's type
            src_type = types.get(node.input[0])
            noop = src_type is not None and src_type != 0 and src_type == types.get(node.input[1])
        elif op == "Transpose" and len(node.input) == 1:  # torch.export's perm=[0, 1] before an index lookup
            perm = attrs_of(node).get("perm")
            noop = perm is not None and list(perm) == list(range(len(perm)))
        elif op == "Dropout":
            mask_used = len(node.output) > 1 and node.output[1] and (node.output[1] in consumed or node.output[1] == output)
            training = node.input[2] if len(node.input) > 2 else ""
            noop = not mask_used and (not training or _is_const_false(training, m))
        if not noop:
            continue
        src, dst = resolve(node.input[0]), node.output[0]
        if dst in body_reads or (dst == output and src in body_reads):
            continue
        if dst == output:
            # keep the output name: rename src's producer output to dst instead
            if src in graph_sources or src == output:
                continue
            prod = next((n for n in g.node if src in n.output), None)
            if prod is None:
                continue
            for n in g.node:
                for i, name in enumerate(n.input):
                    if name == src:
                        n.input[i] = dst
                for i, name in enumerate(n.output):
                    if name == src:
                        n.output[i] = dst
            for vi in g.value_info:
                if vi.name == src:
                    vi.name = dst
            rename[src] = dst
            remove.add(idx)
            continue
        rename[dst] = src
        remove.add(idx)
    if not remove:
        return
    nodes = []
    for idx, node in enumerate(g.node):
        if idx in remove:
            continue
        for i, name in enumerate(node.input):
            if name:
                node.input[i] = resolve(name)
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    vis = [v for v in g.value_info if v.name not in rename]
    del g.value_info[:]
    g.value_info.extend(vis)


FOLD_ROUNDS = 8  # fixed-point bound: each round is one shape inference over the whole graph


def fold_to_fixed_point(m: onnx.ModelProto, output: str, rounds: int = FOLD_ROUNDS) -> onnx.ModelProto:
    """`m` (changed in place, or the re-inferred copy) with fold_static_dims and fold_constants
    repeated, shape inference between rounds, until a round removes no node (at most `rounds`):
    one round's constants make dims static that only the next inference sees."""
    for k in range(rounds):
        before = len(m.graph.node)
        fold_static_dims(m)
        fold_constants(m, output)
        if len(m.graph.node) == before or k == rounds - 1:
            return m
        m = infer_shapes(m, keep_going=True)
    return m


def fold_static_dims(m: onnx.ModelProto) -> None:
    """Gather(Shape(x), constant indices) picking dims that are static in the inferred shapes
    becomes a Constant: TorchScript reads a sequence length as `x.size(1)` even where the
    model declares it, and a position lookup's indices are then constants (batch-less)."""
    view = GraphView(m)
    for idx, node in enumerate(m.graph.node):
        shape_node = view.producer.get(node.input[0]) if node.input else None
        if node.op_type != "Gather" or shape_node is None or shape_node.op_type != "Shape" \
                or attrs_of(node).get("axis", 0) != 0 or len(node.input) < 2:
            continue
        dims, picks = shape_dims(view, shape_node), view.constant_value(node.input[1])
        if dims is None or picks is None or picks.dtype.kind not in "iu":
            continue
        picked = [dims[int(i)] if -len(dims) <= int(i) < len(dims) else None for i in picks.reshape(-1)]
        if any(not isinstance(d, int) for d in picked):
            continue
        value = np.asarray(picked, np.int64).reshape(picks.shape)
        m.graph.node[idx].CopyFrom(helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                                    value=numpy_helper.from_array(value)))


# Ops whose onnx.reference semantics differ from ONNX Runtime's where no fix of
# oprules.check._reference_fixes covers them: Resize (align_corners / tf_crop_and_resize with
# scales where in * scale is not an integer, nearest rounding ties). Left to run in the plan.
_NO_FOLD_REFERENCE = {"Resize"}


def fold_constants(m: onnx.ModelProto, output: str) -> None:
    """Evaluate in place the nodes whose inputs are all constants other than float
    initializers (the weights): shape arithmetic, also over the dims fold_static_dims made
    constant; `output` stays computed. The batch-axis tracing runs it again on a weight-free copy."""
    g = m.graph
    const: set[str] = set()
    const_nodes: dict[str, onnx.NodeProto] = {}
    for t in g.initializer:
        if t.data_type not in FLOAT_TYPES:
            const.add(t.name)
    fold: list[onnx.NodeProto] = []
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            const.add(node.output[0])
            const_nodes[node.output[0]] = node
            continue
        ins = [i for i in node.input if i]
        if (
            ins
            and node.domain in ("", "ai.onnx")
            and node.op_type not in _NO_FOLD
            and node.op_type not in _NO_FOLD_REFERENCE
            and not any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute)
            and all(i in const for i in ins)
            and output not in node.output
        ):
            fold.append(node)
            const.update(o for o in node.output if o)
    if not fold:
        return
    folded_ids = {id(n) for n in fold}
    folded_outputs = {o for n in fold for o in n.output if o}
    frontier = []
    for node in g.node:
        if id(node) in folded_ids:
            continue
        for i in node.input:
            if i in folded_outputs and i not in frontier:
                frontier.append(i)
    if not frontier:
        return
    needed_inputs = {i for n in fold for i in n.input if i}
    sub_nodes = [const_nodes[t] for t in const_nodes if t in needed_inputs] + fold
    sub_inits = [t for t in g.initializer if t.name in needed_inputs]
    sub = helper.make_graph(
        sub_nodes, "fold", [], [helper.make_empty_tensor_value_info(t) for t in frontier], initializer=sub_inits
    )
    sub_model = helper.make_model(sub, opset_imports=list(m.opset_import))
    sub_model.ir_version = m.ir_version or IR_VERSION
    try:
        from onnx.reference import ReferenceEvaluator

        from kfac_compiler.oprules.check import _reference_fixes

        # onnx.reference with the rules' fixes (ConvTranspose groups, MaxPool's Indices, LRN,
        # LpNormalization p=1, ...): plain, it computed values ONNX Runtime does not
        values = ReferenceEvaluator(sub_model, new_ops=_reference_fixes()).run(None, {})
    except Exception as e:  # the reference evaluator may lack an op: keep the nodes
        warnings.warn(f"constant folding skipped ({type(e).__name__}: {' '.join(str(e).split())[:200]})", stacklevel=2)
        return
    taken = {n.name for n in g.node}
    new_consts = []
    for name, value in zip(frontier, values):
        arr = np.asarray(value)
        node_name = fresh_name(f"{name}/folded", taken)
        new_consts.append(
            helper.make_node("Constant", [], [name], name=node_name, value=numpy_helper.from_array(arr, name))
        )
    nodes = new_consts + [n for n in g.node if id(n) not in folded_ids]
    del g.node[:]
    g.node.extend(nodes)


def infer_shapes(m: onnx.ModelProto, keep_going: bool) -> onnx.ModelProto:
    """`m` with ONNX shape inference's value_info; `keep_going`: a warning, not an error, when it
    fails. A Reshape whose target is computed at run time gets the rank its target's length
    gives (onnx leaves it without a shape at opset 13, where a MatMul after it then had no
    rank: tf2onnx's Keras transformer), and inference runs again from there."""
    for _ in range(3):
        try:
            m = onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True)
        except Exception as e:  # shape inference errors are not fatal: patterns check shapes they need
            if not keep_going:
                raise ModelError(f"shape inference failed: {' '.join(str(e).split())[:300]}") from None
            warnings.warn(f"shape inference failed ({' '.join(str(e).split())[:200]}); continuing without shapes",
                          stacklevel=2)
            return m
        if not _reshape_ranks(m):
            break
    return m


def _reshape_ranks(m: onnx.ModelProto) -> int:
    """Declare the rank of each Reshape output inference left without a shape where the target
    shape's length is static; returns how many."""
    g = m.graph
    known = {vi.name: vi for vi in [*g.value_info, *g.input, *g.output]}
    lengths = {t.name: list(t.dims) for t in g.initializer}
    count = 0
    for node in g.node:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        out = known.get(node.output[0])
        if out is not None and out.type.tensor_type.HasField("shape"):
            continue
        target = known.get(node.input[1])
        dims = lengths.get(node.input[1])
        if dims is None and target is not None and target.type.tensor_type.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in target.type.tensor_type.shape.dim]
        elem = known.get(node.input[0])
        if dims is None or len(dims) != 1 or not dims[0] or elem is None:
            continue
        vi = helper.make_tensor_value_info(node.output[0], elem.type.tensor_type.elem_type, [None] * int(dims[0]))
        if out is not None:
            g.value_info.remove(out)
        g.value_info.append(vi)
        count += 1
    return count


# ---------------------------------------------------------------------- trainable params
# ------------------------------------------------------------------------- loss ops
@dataclass(frozen=True)
class RecognisedLoss:
    """A loss op found at the end of the graph (graph patterns are this pass's knowledge;
    the kind it names is a registered loss class's)."""

    kind: str
    scores: str  # the model output the compiler trains (the loss op's scores/prediction input)
    target_input: str | None  # the graph input holding the labels/targets
    op: str  # op type(s) recognised, e.g. "SoftmaxCrossEntropyLoss"
    node: str  # node name of the loss op
    notes: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()  # the loss options the op sets (its ignore_index)


def recognise_loss(model: onnx.ModelProto, output: str) -> RecognisedLoss | None:
    """Detect a loss op producing `output`; None if `output` is not a recognised loss."""
    view = GraphView(model)
    node = view.producer.get(output)
    while node is not None and node.op_type in ("Identity",) and node.input:
        node = view.producer.get(node.input[0])
    if node is None:
        return None
    attrs = attrs_of(node)

    def label_input(name: str) -> str:
        return _trace_to_input(view, name)

    notes: list[str] = []
    # the op's ignore_index is the loss's (targets equal to it count for nothing, the mean is
    # over the others: the op's reduction="mean")
    options = (("ignore_index", int(attrs["ignore_index"])),) if "ignore_index" in attrs else ()
    if node.op_type == "SoftmaxCrossEntropyLoss":
        notes.extend(_loss_notes(node, attrs))
        return RecognisedLoss(
            SoftmaxCrossEntropy.kind, node.input[0], label_input(node.input[1]), node.op_type, node.name, tuple(notes),
            options,
        )
    if node.op_type == "NegativeLogLikelihoodLoss":
        prev = view.producer.get(node.input[0])
        if prev is not None and prev.op_type == "LogSoftmax":
            notes.extend(_loss_notes(node, attrs))
            return RecognisedLoss(
                SoftmaxCrossEntropy.kind, prev.input[0], label_input(node.input[1]),
                "NegativeLogLikelihoodLoss(LogSoftmax)", node.name, tuple(notes), options,
            )
        return None
    if node.op_type in ("ReduceMean", "ReduceSum"):
        sq = view.producer.get(node.input[0])
        diff = None
        if sq is not None and sq.op_type == "Mul" and len(sq.input) == 2 and sq.input[0] == sq.input[1]:
            diff = sq.input[0]
        elif sq is not None and sq.op_type == "Pow":
            e = view.constant_value(sq.input[1])
            if e is not None and e.size == 1 and float(e.reshape(-1)[0]) == 2.0:
                diff = sq.input[0]
        sub = view.producer.get(diff) if diff else None
        if sub is None or sub.op_type != "Sub":
            return None
        a, b = sub.input[0], sub.input[1]
        inputs = set(view.graph_inputs)
        ta, tb = label_input(a), label_input(b)
        if tb in inputs and ta not in inputs:
            pred, target = a, tb
        elif ta in inputs and tb not in inputs:
            pred, target = b, ta
        else:
            return None
        if node.op_type == "ReduceSum":
            notes.append("the graph sums the squared error; kfac_compiler uses the mean over examples")
        else:
            notes.append("the graph averages over every element; kfac_compiler averages over examples only")
        return RecognisedLoss(SquaredError.kind, pred, target, f"{node.op_type}(({sq.op_type}) of Sub)", node.name,
                              tuple(notes))
    return None


def _loss_notes(node: onnx.NodeProto, attrs: dict) -> list[str]:
    notes = []
    red = attrs.get("reduction", b"mean")
    red = red.decode() if isinstance(red, bytes) else red
    if red != "mean":
        notes.append(f"loss op {node.name!r} uses reduction={red!r}; kfac_compiler uses the mean over examples")
    if len(node.input) > 2 and node.input[2]:
        notes.append(f"loss op {node.name!r} has class weights {node.input[2]!r}; they are ignored")
    if "ignore_index" in attrs:
        notes.append(f"loss op {node.name!r} has ignore_index={attrs['ignore_index']}: the loss's ignore_index option "
                     "(unless loss_options sets it)")
    return notes


def _trace_to_input(view: GraphView, name: str) -> str:
    """Follow single-data-input reshaping ops back to a graph input (else return `name`)."""
    seen = 0
    t = name
    while seen < 16:
        if t in view.graph_inputs:
            return t
        node = view.producer.get(t)
        if node is None or node.op_type not in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Flatten"):
            return name
        t = node.input[0]
        seen += 1
    return name
