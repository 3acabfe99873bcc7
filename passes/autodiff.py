"""Autodiff pass: reverse-mode (vjp) and forward-mode (jvp) graphs in standard ONNX ops.

    backward(b, view, seeds, wrt) -> {wrt tensor: cotangent name or None}
    jvp(b, view, tangents, outputs) -> {output: tangent name or None}
    gradient_model(model, output, params, extra_wrt=()) -> ModelProto   (tests, benchmarks)
    jvp_model(model, output, params) -> ModelProto

The forward graph indexed by `view` is assumed present in the graph being built (its tensors
are referenced by name); only nodes on a path from a `wrt`/tangent tensor to a seed/output
are differentiated, and every such node is checked for a rule before anything is emitted.
The per-op rules live in kfac_compiler.oprules. See docs/autodiff.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.builder import IR_VERSION, GraphBuilder, value_info
from kfac_compiler.errors import ModelError, UnsupportedOpError
from kfac_compiler.graph import FLOAT_TYPES, GraphView
from kfac_compiler.oprules import describe, find, lookup, remedy
from kfac_compiler.oprules._util import filled, zeros_like

__all__ = ["backward", "jvp", "gradient_model", "jvp_model", "path_nodes"]


def _is_float(view: GraphView, name: str) -> bool:
    t = view.dtypes.get(name)
    return t is None or t == 0 or t in FLOAT_TYPES


def _varied(view: GraphView, sources) -> tuple[set[str], list[onnx.NodeProto]]:
    """Tensors depending differentiably on `sources`, and the nodes producing them."""
    varied = set(sources)
    nodes = []
    for node in view.nodes:
        rule = find(node, view.opset)
        if rule is not None and rule.nondiff:
            continue
        if not any(x and x in varied and (rule is None or rule.diff_slot(i)) for i, x in enumerate(node.input)):
            continue
        nodes.append(node)
        for o in node.output:
            if o and _is_float(view, o):
                varied.add(o)
    return varied, nodes


def path_nodes(view: GraphView, sources: Sequence[str], sinks: Sequence[str]):
    """(nodes on a differentiable path from `sources` to `sinks` in topological order,
    tensors on those paths)."""
    varied, vnodes = _varied(view, sources)
    useful = {s for s in sinks if s in varied}
    path = []
    for node in reversed(vnodes):
        if not any(o in useful for o in node.output if o):
            continue
        path.append(node)
        rule = find(node, view.opset)
        for i, x in enumerate(node.input):
            if x and x in varied and (rule is None or rule.diff_slot(i)):
                useful.add(x)
    path.reverse()
    return path, useful


def params_behind(view: GraphView, node: onnx.NodeProto, sources: Sequence[str]) -> list[str]:
    """The initializers among `sources` from which `node` is reachable (for error messages)."""
    want = {s for s in sources if s in view.initializers}
    found, seen, stack = set(), set(), [x for x in node.input if x]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in want:
            found.add(t)
        prod = view.producer.get(t)
        if prod is not None:
            stack.extend(x for x in prod.input if x)
    return [s for s in sources if s in found]


def _gemm_key(node: onnx.NodeProto) -> tuple | None:
    """The flags of a Gemm without an addend (its product is a sum over the contracted axis),
    or None for any other node."""
    if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len([x for x in node.input if x]) != 2:
        return None
    a = {at.name: helper.get_attribute_value(at) for at in node.attribute}
    return int(a.get("transA", 0)), int(a.get("transB", 0)), float(a.get("alpha", 1.0))


def _gemm_part(producer: Mapping[str, onnx.NodeProto], t: str) -> tuple[tuple, onnx.NodeProto, onnx.NodeProto | None] | None:
    """(fusion key, the Gemm, the Squeeze/Reshape wrapping it or None) when cotangent part `t`
    is a Gemm without an addend, possibly reshaped (a bias gradient: the column sum
    ones[1, N] @ g squeezed to [n]); else None."""
    node = producer.get(t)
    if node is None:
        return None
    wrap = None
    if node.op_type in ("Squeeze", "Reshape") and node.input[0] in producer:
        wrap, node = node, producer[node.input[0]]
    key = _gemm_key(node)
    if key is None:
        return None
    if wrap is not None:
        attrs = tuple((a.name, str(helper.get_attribute_value(a))) for a in wrap.attribute)
        key = key + (wrap.op_type, tuple(wrap.input[1:]), attrs)
    return key, node, wrap


def _ones_row(producer: Mapping[str, onnx.NodeProto], t: str) -> bool:
    """`t` is a ConstantOfShape of ones (`oprules._util.sum_rows`'s row at a symbolic batch)."""
    node = producer.get(t)
    if node is None or node.op_type != "ConstantOfShape":
        return False
    value = [helper.get_attribute_value(a) for a in node.attribute if a.name == "value"]
    return bool(value) and numpy_helper.to_array(value[0]).ravel().tolist() == [1.0]


def _fuse_gemms(b: GraphBuilder, parts: list[str]) -> list[str]:
    """Cotangent parts that are Gemms with the same flags and no addend (a multi-use weight's
    per-use gradients, e.g. an unrolled RNN's: dW = sum_t g_t^T h_t, and its bias's column
    sums), each possibly under the same Squeeze/Reshape, as ONE Gemm of their operands
    concatenated along the contracted axis. One wide GEMM instead of one thin GEMM per use
    plus a Sum of weight-sized partials (an unrolled LSTM's recurrent weight: 64 partials of
    1 MB); the per-use Gemms are left dead (dropped by `builder.live`). The operands are
    concatenated in the forward order of the uses (`parts` arrive in reverse: the consumers'
    VJPs run last use first), the order in which a Split's gradient concatenates the same
    cotangents: ONNX Runtime's common-subexpression pass then keeps one copy (the LSTM's
    gate cotangents, 8 MB, were concatenated twice, once in each order)."""
    producer = {o: n for n in b.nodes for o in n.output}
    found = {t: _gemm_part(producer, t) for t in parts}
    groups: dict[tuple, list[tuple[onnx.NodeProto, onnx.NodeProto | None]]] = {}
    for t in parts:
        f = found[t]
        if f is not None:
            groups.setdefault(f[0], []).append(f[1:])
    out = [t for t in parts if found[t] is None or len(groups[found[t][0]]) < 2]  # type: ignore[index]
    for key, members in groups.items():
        if len(members) < 2:
            continue
        members.reverse()
        ta, tb, alpha = key[:3]
        c = b.op("Concat", [gm.input[1] for gm, _ in members], axis=1 if tb else 0)
        if not ta and not tb and all(_ones_row(producer, gm.input[0]) for gm, _ in members):
            # column sums at a symbolic batch: one ones row as long as the concatenated rows
            a = filled(b, b.op("Concat", [b.ints([1]), b.shape(c, 0, 1)], axis=0), 1.0, hint="ones")
        else:
            a = b.op("Concat", [gm.input[0] for gm, _ in members], axis=0 if ta else 1)
        fused = b.op("Gemm", [a, c], transA=ta or None, transB=tb or None, alpha=None if alpha == 1.0 else alpha)
        wrap = members[0][1]
        if wrap is not None:
            fused = b.op(wrap.op_type, [fused] + list(wrap.input[1:]),
                         **{at.name: helper.get_attribute_value(at) for at in wrap.attribute})
        out.append(fused)
    return out


def _total(b: GraphBuilder, acc: dict[str, list[str]], name: str) -> str | None:
    parts = acc.get(name)
    if not parts:
        return None
    if len(parts) > 2:
        parts = acc[name] = _fuse_gemms(b, parts)
    if len(parts) > 1:
        s = b.add(parts[0], parts[1]) if len(parts) == 2 else b.op("Sum", list(parts), hint="grad_sum")
        acc[name] = [s]
    b.same_shape(parts + acc[name], name)  # every part has its primal's shape (docs/autodiff.md)
    return acc[name][0]


def backward(
    b: GraphBuilder,
    view: GraphView,
    seeds: Mapping[str, str],
    wrt: Sequence[str],
) -> dict[str, str | None]:
    """Reverse mode: emit the cotangents of `wrt` given cotangent `seeds` (forward tensor ->
    cotangent tensor of the same shape). Returns {wrt tensor: cotangent name, or None when no
    differentiable path reaches a seed}. Raises UnsupportedOpError (before emitting
    anything) when a node on a path has no rule."""
    wrt = list(wrt)
    path, useful = path_nodes(view, wrt, list(seeds))
    rules = {}
    for node in path:
        rule = find(node, view.opset) or lookup(node, view.opset, params_behind(view, node, wrt))
        try:
            rule.check(view, node)
        except UnsupportedOpError as e:  # a form the rule refuses: the same advice, one line
            raise UnsupportedOpError(f"{e}; {remedy(params_behind(view, node, wrt), 'extend its rule')}") from None
        rules[id(node)] = rule
    acc: dict[str, list[str]] = {}
    for s, ct in seeds.items():
        if s in useful:
            acc.setdefault(s, []).append(ct)
    for node in reversed(path):
        rule = rules[id(node)]
        gys = [_total(b, acc, o) if o else None for o in node.output]
        if all(g is None for g in gys):
            continue
        needs = [bool(x) and x in useful and rule.diff_slot(i) for i, x in enumerate(node.input)]
        res = rule.vjp(b, view, node, gys, needs)
        for i, (x, ct) in enumerate(zip(node.input, res)):
            if ct is not None and needs[i]:
                acc.setdefault(x, []).append(ct)
    return {w: _total(b, acc, w) for w in wrt}


def jvp(
    b: GraphBuilder,
    view: GraphView,
    tangents: Mapping[str, str],
    outputs: Sequence[str],
) -> dict[str, str | None]:
    """Forward mode: emit the tangents of `outputs` given `tangents` of some forward tensors
    (e.g. parameters). Returns {output: tangent name, or None when it does not depend on
    the tangents}. Raises UnsupportedOpError (before emitting) when a node on a path has
    no forward-mode rule."""
    path, _ = path_nodes(view, list(tangents), list(outputs))
    rules = {}
    for node in path:
        behind = None
        rule = find(node, view.opset)
        if rule is None or not rule.has_jvp:
            behind = params_behind(view, node, list(tangents))
        if rule is None:
            rule = lookup(node, view.opset, behind)
        if not rule.has_jvp:
            raise UnsupportedOpError(f"{describe(node, view.opset)} has no forward-mode (jvp) rule; "
                                     f"{remedy(behind, 'add a jvp to its rule')}")
        rules[id(node)] = rule
    tan = dict(tangents)
    for node in path:
        rule = rules[id(node)]
        ts = [tan.get(x) if x and rule.diff_slot(i) else None for i, x in enumerate(node.input)]
        if all(t is None for t in ts):
            continue
        res = rule.jvp(b, view, node, ts)
        for o, t in zip(node.output, res):
            if o and t is not None and _is_float(view, o):
                tan[o] = t
                b.same_shape([t], o)
    return {o: tan.get(o) for o in outputs}


# ------------------------------------------------------------------ model helpers
def _prepare(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    try:
        m = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # noqa: BLE001 - shapes are an optimization; rules fall back to dynamic
        pass
    return m


def _ir_version(model: onnx.ModelProto, opset: int) -> int:
    """The IR version to stamp: at least the builder's and what `opset` needs."""
    need = IR_VERSION
    for _, ir, op, *_ in helper.VERSION_TABLE:
        if op >= opset:
            need = ir
            break
    return max(IR_VERSION, need, model.ir_version)


def _vi_like(view: GraphView, name: str, new_name: str) -> onnx.ValueInfoProto:
    return value_info(new_name, view.dtypes.get(name, TensorProto.FLOAT) or TensorProto.FLOAT, view.shape(name))


def _setup(model: onnx.ModelProto, output: str, names: Sequence[str], extra_taken: Sequence[str]):
    model = _prepare(model)
    view = GraphView(model)
    if output not in view.producer and output not in view.graph_inputs:
        raise ModelError(f"output {output!r} is not a tensor of model graph {model.graph.name!r}")
    for n in names:
        if n not in view.initializers and n not in view.producer and n not in view.graph_inputs:
            raise ModelError(f"{n!r} is not a tensor of model graph {model.graph.name!r}")
    ftype = view.dtypes.get(output) or TensorProto.FLOAT
    taken = view.all_names() | {vi.name for vi in model.graph.value_info} | set(extra_taken)
    b = GraphBuilder(view.opset, prefix="autodiff", taken=taken, float_type=ftype)
    return model, view, b


def _finish(model, view, b, name, inputs, outputs) -> onnx.ModelProto:
    g = model.graph
    m = b.make_model(
        name,
        inputs=[i for i in g.input if i.name not in view.initializers] + list(inputs),
        outputs=outputs,
        base_nodes=g.node,
        base_initializers=g.initializer,
        extra_opsets=model.opset_import,
    )
    m.graph.value_info.extend(g.value_info)
    m.functions.extend(model.functions)
    m.ir_version = _ir_version(model, view.opset)
    return m


def gradient_model(
    model: onnx.ModelProto,
    output: str,
    params: Sequence[str],
    extra_wrt: Sequence[str] = (),
) -> onnx.ModelProto:
    """The forward model plus a graph input "<output>_grad" (cotangent seed, shaped like
    `output`) and graph outputs "<output>" and "grad/<t>" for each t in params + extra_wrt
    (zeros when `output` does not depend on t). Params stay initializers."""
    wrt = list(params) + [t for t in extra_wrt if t not in params]
    seed = f"{output}_grad"
    out_names = [f"grad/{t}" for t in wrt]
    model, view, b = _setup(model, output, wrt, [seed] + out_names)
    res = backward(b, view, {output: seed}, wrt)
    outs = [_vi_like(view, output, output)]
    for t, name in zip(wrt, out_names):
        ct = res[t] if res[t] is not None else zeros_like(b, view, t)
        b.identity(ct, name)
        outs.append(_vi_like(view, t, name))
    return _finish(model, view, b, f"{model.graph.name}_grad", [_vi_like(view, output, seed)], outs)


def jvp_model(model: onnx.ModelProto, output: str, params: Sequence[str]) -> onnx.ModelProto:
    """The forward model plus graph inputs "tangent/<p>" (shaped like each param) and graph
    outputs "<output>" and "jvp/<output>" (the directional derivative J v)."""
    params = list(params)
    tnames = [f"tangent/{p}" for p in params]
    oname = f"jvp/{output}"
    model, view, b = _setup(model, output, params, tnames + [oname])
    res = jvp(b, view, dict(zip(params, tnames)), [output])
    t = res[output] if res[output] is not None else zeros_like(b, view, output)
    b.identity(t, oname)
    ins = [_vi_like(view, p, tn) for p, tn in zip(params, tnames)]
    outs = [_vi_like(view, output, output), _vi_like(view, output, oname)]
    return _finish(model, view, b, f"{model.graph.name}_jvp", ins, outs)
