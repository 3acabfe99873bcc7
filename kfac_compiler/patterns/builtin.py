"""The built-in pattern library: every variant enumerated, one Pattern each (Gemm transB
0/1 with or without bias, MatMul / MatMul+Add / Transpose(W)+MatMul, Conv 1-d/2-d/3-d plain,
grouped and depthwise with or without bias, Gather embedding, LayerNormalization,
BatchNormalization in inference and training form, InstanceNormalization,
GroupNormalization, Mul+Add scale-and-shift; parameters broadcast over the batch by Add,
constant-index Gather + Add, or Expand; RMSNormalization scale and ConvTranspose
1-d/2-d/3-d with or without bias)."""
from __future__ import annotations

import numpy as np
import onnx

from kfac_compiler.graph import GraphView, attrs_of
from kfac_compiler.ir import LayerMatch, LayerUse
from kfac_compiler.patterns.core import (
    PARAM,
    Binding,
    NoMatch,
    Pattern,
    PEdge,
    PNode,
    all_of,
    attr_eq,
    nice_float,
    param_rank,
    patterns,
    register_builtin,
    static_size,
)


# ------------------------------------------------------------- fully connected
def _fc_out_features(b: Binding, layout: str) -> int:
    w = b.view.shape(b.weight)
    return w[1] if layout == "in_out" else w[0]


def _check_fc_input(b: Binding, min_rank: int = 2) -> bool:
    r = b.view.rank(b.input())
    return r is None or r >= min_rank


def _bias_ok(b: Binding, out: int, allow_row: bool = False) -> bool:
    shape = b.view.shape(b.bias)
    return tuple(shape) == (out,) or (allow_row and tuple(shape) == (1, out))


def _gemm_pattern(trans_b: int, with_bias: bool) -> Pattern:
    layout = "out_in" if trans_b else "in_out"
    nodes = [
        PNode("gemm", "Gemm", where=all_of(attr_eq("transA", 0, 0), attr_eq("transB", trans_b, 0))),
        PNode("W", PARAM, where=param_rank(2)),
    ]
    edges = [PEdge("W", "gemm", (1,))]
    if with_bias:
        nodes.append(PNode("C", PARAM, where=param_rank(1, 2)))
        edges.append(PEdge("C", "gemm", (2,)))

    def where(b: Binding) -> bool:
        if not _check_fc_input(b):
            return False
        if with_bias:
            return b.attr("gemm", "beta", 1.0) != 0.0 and _bias_ok(b, _fc_out_features(b, layout), allow_row=True)
        return True

    def attrs(b: Binding) -> dict:
        return {
            "weight_layout": layout,
            "alpha": nice_float(b.attr("gemm", "alpha", 1.0)),
            "beta": nice_float(b.attr("gemm", "beta", 1.0)) if with_bias else 1.0,
        }

    return Pattern(
        name=f"gemm_{layout}" + ("_bias" if with_bias else ""),
        kind="fully_connected",
        nodes=tuple(nodes),
        edges=tuple(edges),
        weight="W",
        bias="C" if with_bias else None,
        input=("gemm", 0),
        output="gemm",
        where=where,
        attrs=attrs,
    )


def _matmul_pattern(transposed: bool, with_bias: bool) -> Pattern:
    layout = "out_in" if transposed else "in_out"
    nodes = [PNode("matmul", "MatMul"), PNode("W", PARAM, where=param_rank(2))]
    if transposed:
        nodes.append(PNode("transpose", "Transpose", where=_perm_10))
        edges = [PEdge("W", "transpose", (0,)), PEdge("transpose", "matmul", (1,))]
    else:
        edges = [PEdge("W", "matmul", (1,))]
    if with_bias:
        nodes += [PNode("add", "Add"), PNode("b", PARAM, where=param_rank(1))]
        edges += [PEdge("matmul", "add", (0, 1)), PEdge("b", "add", (0, 1))]

    def where(b: Binding) -> bool:
        if not _check_fc_input(b):
            return False
        if with_bias:
            if not _bias_ok(b, _fc_out_features(b, layout)):
                return False
            # the Add must not broadcast the MatMul output up
            out_shape, s_shape = b.view.shape(b.output()), b.view.shape(b.tensor("matmul"))
            if out_shape is not None and s_shape is not None and len(out_shape) != len(s_shape):
                return False
        return True

    def attrs(b: Binding) -> dict:
        return {"weight_layout": layout, "alpha": 1.0, "beta": 1.0}

    name = "matmul" + ("_transposed" if transposed else "") + ("_add" if with_bias else "")
    return Pattern(
        name=name,
        kind="fully_connected",
        nodes=tuple(nodes),
        edges=tuple(edges),
        weight="W",
        bias="b" if with_bias else None,
        input=("matmul", 0),
        output="add" if with_bias else "matmul",
        where=where,
        attrs=attrs,
    )


def _perm_10(node: onnx.NodeProto, view: GraphView) -> bool:
    perm = attrs_of(node).get("perm")
    return perm is None or list(perm) == [1, 0]


# ------------------------------------------------------------------------ conv
def _conv_geometry(b: Binding) -> dict:
    w_shape = b.view.shape(b.weight)
    nd = len(w_shape) - 2
    a = attrs_of(b.node("conv"))
    kernel = tuple(int(k) for k in a.get("kernel_shape", w_shape[2:]))
    strides = tuple(int(s) for s in a.get("strides", [1] * nd))
    dilations = tuple(int(d) for d in a.get("dilations", [1] * nd))
    auto_pad = a.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("NOTSET", ""):
        pads = tuple(int(p) for p in a.get("pads", [0] * (2 * nd)))
    elif auto_pad == "VALID":
        pads = (0,) * (2 * nd)
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        x_shape = b.view.shape(b.node("conv").input[0])
        begin, end = [], []
        for i in range(nd):
            k_eff = (kernel[i] - 1) * dilations[i] + 1
            if strides[i] == 1:
                total = k_eff - 1
            else:
                size = x_shape[2 + i] if x_shape is not None and len(x_shape) == nd + 2 else None
                if not isinstance(size, int):
                    raise NoMatch(
                        f"Conv node {b.node('conv').name!r} has auto_pad={auto_pad} with stride "
                        f"{strides[i]} but the input's spatial size is unknown; export with explicit pads "
                        "or static spatial dimensions"
                    )
                out = -(-size // strides[i])
                total = max(0, (out - 1) * strides[i] + k_eff - size)
            small, large = total // 2, total - total // 2
            if auto_pad == "SAME_UPPER":
                begin.append(small)
                end.append(large)
            else:
                begin.append(large)
                end.append(small)
        pads = tuple(begin + end)
    else:
        raise NoMatch(f"Conv node {b.node('conv').name!r}: unknown auto_pad {auto_pad!r}")
    return {
        "kernel_shape": kernel,
        "strides": strides,
        "pads": pads,
        "dilations": dilations,
        "group": int(a.get("group", 1)),
    }


def _is_depthwise(node: onnx.NodeProto, view: GraphView) -> bool:
    group = int(attrs_of(node).get("group", 1))
    w = view.shape(node.input[1]) if len(node.input) > 1 else None
    if w is None or group <= 1:
        return False
    # C_in = group * w[1]; depthwise: each group sees one input channel, C_out = multiplier * C_in
    return w[1] == 1 and w[0] % group == 0


def _not_depthwise(node: onnx.NodeProto, view: GraphView) -> bool:
    return not _is_depthwise(node, view)


def _conv_pattern(nd: int, with_bias: bool, depthwise: bool) -> Pattern:
    nodes = [
        PNode("conv", "Conv", where=_is_depthwise if depthwise else _not_depthwise),
        PNode("W", PARAM, where=param_rank(nd + 2)),
    ]
    edges = [PEdge("W", "conv", (1,))]
    if with_bias:
        nodes.append(PNode("B", PARAM, where=param_rank(1)))
        edges.append(PEdge("B", "conv", (2,)))

    def where(b: Binding) -> bool:
        if with_bias and tuple(b.view.shape(b.bias)) != (b.view.shape(b.weight)[0],):
            return False
        r = b.view.rank(b.input())
        return r is None or r == nd + 2

    kind = "depthwise_conv" if depthwise else "conv"
    return Pattern(
        name=f"{kind}{nd}d" + ("_bias" if with_bias else ""),
        kind=kind,
        nodes=tuple(nodes),
        edges=tuple(edges),
        weight="W",
        bias="B" if with_bias else None,
        input=("conv", 0),
        output="conv",
        where=where,
        attrs=_conv_geometry,
    )


def _norm_axes(b: Binding) -> tuple[int, ...] | None:
    """The axes ReduceL2 "norm" reduces (attribute before opset 18, constant input since;
    none given: all), or None when they are not constant, the norm drops them or reduces
    nothing (noop_with_empty_axes)."""
    node = b.node("norm")
    rank = b.view.rank(b.weight)
    if rank is None or not int(b.attr("norm", "keepdims", 1)):
        return None
    if len(node.input) > 1 and node.input[1]:
        value = b.view.constant_value(node.input[1])
        if value is None:
            return None
        axes = [int(a) for a in np.asarray(value).reshape(-1)]
    else:
        axes = list(b.attr("norm", "axes", None) or [])
    if not axes:
        if int(b.attr("norm", "noop_with_empty_axes", 0)):
            return None
        axes = list(range(rank))
    return tuple(sorted({a % rank for a in axes}))


def _weight_norm_conv_pattern(gain_first: bool, with_bias: bool) -> Pattern:
    """Conv(x, w, b) with w = v * (g / ReduceL2(v)) (torch.export of torch's weight_norm
    parametrization: gain_first) or (v / ReduceL2(v)) * g (the TorchScript symbolic of
    _weight_norm); g has the norm's kept shape."""
    nodes = [PNode("conv", "Conv"), PNode("mul", "Mul"), PNode("div", "Div"), PNode("norm", "ReduceL2"),
             PNode("V", PARAM), PNode("G", PARAM)]
    edges = [PEdge("V", "norm", (0,)), PEdge("norm", "div", (1,)), PEdge("div", "mul", (0, 1)),
             PEdge("mul", "conv", (1,))]
    if gain_first:
        edges += [PEdge("G", "div", (0,)), PEdge("V", "mul", (0, 1))]
    else:
        edges += [PEdge("V", "div", (0,)), PEdge("G", "mul", (0, 1))]
    if with_bias:
        nodes.append(PNode("B", PARAM, where=param_rank(1)))
        edges.append(PEdge("B", "conv", (2,)))

    def where(b: Binding) -> bool:
        v_shape, g_shape = b.view.shape(b.weight), b.view.shape(b.mapping["G"])
        axes = _norm_axes(b)
        if axes is None or static_size(v_shape) is None or static_size(g_shape) is None or len(v_shape) < 3:
            return False
        if tuple(g_shape) != tuple(1 if i in axes else d for i, d in enumerate(v_shape)):
            return False  # g has the norm's kept shape: the Div and Mul broadcast nothing up
        if with_bias and tuple(b.view.shape(b.bias)) != (v_shape[0],):
            return False
        r = b.view.rank(b.input())
        return r is None or r == len(v_shape)

    def attrs(b: Binding) -> dict:
        g = b.mapping["G"]
        return {**_conv_geometry(b), "weight_norm": {"g": g, "axes": _norm_axes(b)}, "extra_params": (g,)}

    return Pattern(
        name="weight_norm_conv" + ("" if gain_first else "_div") + ("_bias" if with_bias else ""),
        kind="weight_norm_conv",
        nodes=tuple(nodes),
        edges=tuple(edges),
        weight="V",
        bias="B" if with_bias else None,
        input=("conv", 0),
        output="conv",
        where=where,
        attrs=attrs,
    )


# ------------------------------------------------------------------- embedding
def _embedding_pattern() -> Pattern:
    def where(b: Binding) -> bool:
        return not b.view.is_float(b.input()) if b.input() in b.view.dtypes else True

    def attrs(b: Binding) -> dict:
        vocab, dim = b.view.shape(b.weight)
        return {"vocab": int(vocab), "dim": int(dim)}

    return Pattern(
        name="embedding",
        kind="embedding",
        nodes=(PNode("gather", "Gather", where=attr_eq("axis", 0, 0)), PNode("W", PARAM, where=param_rank(2))),
        edges=(PEdge("W", "gather", (0,)),),
        weight="W",
        input=("gather", 1),
        output="gather",
        where=where,
        attrs=attrs,
    )


# ------------------------------------------------------------- scale and shift
def trailing_axes_attrs(b: Binding, key: str, op: str) -> dict:
    """scale_and_shift attrs of a normalization over the axes from `axis` on (LayerNormalization,
    RMSNormalization): the scale varies along those axes."""
    axis = int(b.attr(key, "axis", -1))
    rank = b.view.rank(b.input())
    if rank is not None:
        axis = axis % rank
        scale_axes = tuple(range(axis, rank))
    elif axis < 0:
        scale_axes = tuple(range(axis, 0))
    else:
        raise NoMatch(f"{op} {b.node(key).name!r}: input rank unknown")
    # the block's statistics read the scale as the normalized axes' shape: a scale that only
    # broadcasts to them ([4] or [1, 4] over axes of [3, 4]) is valid ONNX but another layer
    in_shape, scale_shape = b.view.shape(b.input()), b.view.shape(b.weight)
    if in_shape is not None and scale_shape is not None:
        want = tuple(in_shape[a] for a in scale_axes)
        if len(scale_shape) != len(want) or any(isinstance(w, int) and w != s for w, s in zip(want, scale_shape)):
            raise NoMatch(f"{op} {b.node(key).name!r}: scale of shape {list(scale_shape)} broadcasts over the "
                          f"normalized axes {list(want)}")
    return {
        "normalization": {"op": op, "axis": axis, "epsilon": nice_float(b.attr(key, "epsilon", 1e-5))},
        "scale_axes": scale_axes,
        "scale_input": b.input(),
    }


def _normalization_pattern(name: str, op: str, with_bias: bool, attrs, node_where=None,
                           scale_where=None, where=None) -> Pattern:
    """Pattern `name`: scale_and_shift over a normalization op `n` with its scale (input 1)
    and, with `with_bias`, a shift (input 2) of the scale's shape; `where` adds a whole-match
    check."""
    nodes = [PNode("n", op, where=node_where), PNode("scale", PARAM, where=scale_where)]
    edges = [PEdge("scale", "n", (1,))]
    if with_bias:
        nodes.append(PNode("B", PARAM, where=scale_where))
        edges.append(PEdge("B", "n", (2,)))

    def check(b: Binding) -> bool:
        if with_bias and tuple(b.view.shape(b.bias)) != tuple(b.view.shape(b.weight)):
            return False
        return where is None or where(b)

    return Pattern(
        name=name,
        kind="scale_and_shift",
        nodes=tuple(nodes),
        edges=tuple(edges),
        weight="scale",
        bias="B" if with_bias else None,
        input=("n", 0),
        output="n",
        where=check,
        attrs=attrs,
    )


def _scale_only(with_bias: bool) -> str:
    return "" if with_bias else "_scale"


def _ln_pattern(with_bias: bool) -> Pattern:
    return _normalization_pattern("layer_norm" + _scale_only(with_bias), "LayerNormalization", with_bias,
                                  lambda b: trailing_axes_attrs(b, "n", "LayerNormalization"))


def _bn_inference(node: onnx.NodeProto, view: GraphView) -> bool:
    if int(attrs_of(node).get("training_mode", 0)) != 0:
        return False
    return not running_outputs_used(node, view)


def _bn_pattern(with_bias: bool) -> Pattern:
    def where(b: Binding) -> bool:  # mean and var are initializers
        node = b.node("n")
        return len(node.input) >= 5 and all(node.input[i] in b.view.initializers for i in (3, 4))

    def attrs(b: Binding) -> dict:
        node = b.node("n")
        return {
            "normalization": {
                "op": "BatchNormalization",
                "mean": node.input[3],
                "var": node.input[4],
                "epsilon": nice_float(b.attr("n", "epsilon", 1e-5)),
            },
            "scale_axes": (1,),
            "scale_input": b.input(),
        }

    return _normalization_pattern("batch_norm" + _scale_only(with_bias), "BatchNormalization", with_bias, attrs,
                                  node_where=_bn_inference, scale_where=param_rank(1), where=where)


def running_outputs_used(node: onnx.NodeProto, view: GraphView) -> bool:
    """Whether a BatchNormalization's outputs after Y (running mean/var) feed anything."""
    extra = [o for o in list(node.output)[1:] if o]
    return any(o in view.consumers or o in view.graph_outputs for o in extra)


def _bn_training(node: onnx.NodeProto, view: GraphView) -> bool:
    return int(attrs_of(node).get("training_mode", 0)) != 0 and not running_outputs_used(node, view)


def _batch_stat_pattern(name: str, op: str, with_bias: bool, node_where=None, norm=None) -> Pattern:
    """scale_and_shift over an op that normalizes with statistics of its own input:
    BatchNormalization in training mode (batch statistics), InstanceNormalization,
    GroupNormalization. `norm(binding)` -> the attrs["normalization"] entries beyond op and
    epsilon."""

    def where(b: Binding) -> bool:
        rank = b.view.rank(b.input())
        return rank is None or rank >= 2

    def attrs(b: Binding) -> dict:
        spec = {"op": op, "epsilon": nice_float(b.attr("n", "epsilon", 1e-5))}
        spec.update(norm(b) if norm else {})
        return {"normalization": spec, "scale_axes": (1,), "scale_input": b.input()}

    return _normalization_pattern(name + _scale_only(with_bias), op, with_bias, attrs, node_where=node_where,
                                  scale_where=param_rank(1), where=where)


def _group_norm_spec(b: Binding) -> dict:
    groups = int(b.attr("n", "num_groups", 0))
    if groups < 1:
        raise NoMatch(f"GroupNormalization {b.node('n').name!r}: num_groups {groups}")
    channels = (b.view.shape(b.input()) or [None, None])[1]
    per_group = b.view.opset < 21
    size = static_size(b.view.shape(b.weight))
    if isinstance(channels, int) and (channels % groups or size != (groups if per_group else channels)):
        raise NoMatch(f"GroupNormalization {b.node('n').name!r}: {channels} channels, {groups} groups, "
                      f"scale of size {size}")
    return {"num_groups": groups, "per_group": per_group}


def broadcast_axes(param_shape, data_rank: int | None) -> tuple[int, ...]:
    """Axes of the data along which a broadcast parameter varies (size != 1)."""
    ps = tuple(param_shape)
    if data_rank is None:
        return tuple(i - len(ps) for i, d in enumerate(ps) if d != 1)
    off = data_rank - len(ps)
    return tuple(off + i for i, d in enumerate(ps) if d != 1)


def _mul_pattern(with_bias: bool) -> Pattern:
    """Mul by a parameter, then (with_bias) Add of one of its shape: a decomposed
    normalization's affine ("mul_add"); without the Add ("mul_scale"), a scale alone such as
    the weight of a decomposed RMSNorm (Hugging Face's LlamaRMSNorm), on data of the batch."""
    nodes = [PNode("mul", "Mul"), PNode("scale", PARAM)]
    edges = [PEdge("scale", "mul", (0, 1))]
    if with_bias:
        nodes += [PNode("add", "Add"), PNode("B", PARAM)]
        edges += [PEdge("mul", "add", (0, 1)), PEdge("B", "add", (0, 1))]

    def where(b: Binding) -> bool:
        s = b.view.shape(b.weight)
        if with_bias:
            bias = b.view.shape(b.bias)
            if static_size(s) != static_size(bias) or broadcast_axes(s, 8) != broadcast_axes(bias, 8):
                return False
        elif b.input() not in b.view.from_inputs:
            return False  # scales a parameter or a constant, not the data
        x_shape, y_shape = b.view.shape(b.input()), b.view.shape(b.output())
        if x_shape is not None and y_shape is not None:
            if len(x_shape) != len(y_shape):
                return False  # the parameters would broadcast the data up: not a scale-and-shift
            if any(isinstance(a, int) and isinstance(c, int) and a != c for a, c in zip(x_shape, y_shape)):
                return False
        if x_shape is not None:
            if len(s) > len(x_shape) or (not with_bias and len(s) == len(x_shape) and s[0] != 1):
                return False  # (a scale alone) varies along the batch axis: not per feature
            aligned = x_shape[len(x_shape) - len(s):]
            if any(isinstance(xd, int) and sd not in (1, xd) for sd, xd in zip(s, aligned)):
                return False
        elif not with_bias:
            return False
        return True

    def attrs(b: Binding) -> dict:
        return {
            "normalization": None,
            "scale_axes": broadcast_axes(b.view.shape(b.weight), b.view.rank(b.input())),
            "scale_input": b.input(),
        }

    return Pattern(
        name="mul_add" if with_bias else "mul_scale",
        kind="scale_and_shift",
        nodes=tuple(nodes),
        edges=tuple(edges),
        weight="scale",
        bias="B" if with_bias else None,
        input=("mul", None),
        output="add" if with_bias else "mul",
        where=where,
        attrs=attrs,
    )


# ------------------------------------------------------ broadcast over the batch
def _batch_free(shift_shape, out_rank: int | None) -> bool:
    """A tensor of `shift_shape` broadcast to rank `out_rank` does not vary along axis 0 (the
    batch): it is missing there or has size 1."""
    if out_rank is None or len(shift_shape) > out_rank:
        return False
    return len(shift_shape) < out_rank or shift_shape[0] == 1


def _broadcast_attrs(b: Binding, shift_shape) -> dict:
    rank = b.view.rank(b.output())
    return {"scale_axes": broadcast_axes(shift_shape, rank), "output_rank": rank}


def _adds_to_data(b: Binding, shift: str, shift_shape) -> bool:
    """The Add's other operand than `shift` is data of the output's rank and the shift has no
    batch axis."""
    others = [t for t in b.node("add").input if t != shift]
    if len(others) != 1:
        return False
    x, rank = others[0], b.view.rank(b.output())
    return (x in b.view.from_inputs and b.view.rank(x) in (None, rank) and b.view.is_float(x)
            and _batch_free(shift_shape, rank))


def _broadcast_add_pattern() -> Pattern:
    """Add(x[N, ...], P): a position table [1, T, D] / [T, D], a bias added alone."""
    return Pattern(
        name="broadcast_add",
        kind="broadcast",
        nodes=(PNode("add", "Add"), PNode("P", PARAM)),
        edges=(PEdge("P", "add", (0, 1)),),
        weight="P",
        input=("add", None),
        output="add",
        where=lambda b: _adds_to_data(b, b.weight, b.view.shape(b.weight)),
        attrs=lambda b: _broadcast_attrs(b, b.view.shape(b.weight)),
    )


def _gathered_shape(b: Binding) -> tuple | None:
    """Gather(P, indices) output shape: indices' shape + P's rows' shape (dims may be symbolic)."""
    idx = b.view.shape(b.node("gather").input[1])
    return None if idx is None else tuple(idx) + tuple(b.view.shape(b.weight)[1:])


def _gather_add_pattern() -> Pattern:
    """Add(x[N, ...], Gather(P, indices)) with indices that have no batch axis (constant, or
    computed from the sequence length): positions looked up the same for every example. The
    use's input is the indices."""

    def where(b: Binding) -> bool:
        idx = b.node("gather").input[1]
        shape = _gathered_shape(b)
        return shape is not None and not b.view.is_float(idx) and _adds_to_data(b, b.tensor("gather"), shape)

    return Pattern(
        name="broadcast_gather_add",
        kind="broadcast",
        nodes=(PNode("gather", "Gather", where=attr_eq("axis", 0, 0)), PNode("P", PARAM), PNode("add", "Add")),
        edges=(PEdge("P", "gather", (0,)), PEdge("gather", "add", (0, 1))),
        weight="P",
        input=("gather", 1),
        output="add",
        where=where,
        attrs=lambda b: {**_broadcast_attrs(b, _gathered_shape(b)), "indexed": True},
    )


def _expand_pattern() -> Pattern:
    """Expand(P, shape) with a shape computed from the data (the batch size): a class token
    [1, 1, D] made [N, 1, D] before a Concat. (Tile with such repeats has no gradient rule:
    oprules/tensor.py needs constant repeats.)"""

    def where(b: Binding) -> bool:
        shape_input = b.node("expand").input[1]
        return shape_input in b.view.from_inputs and _batch_free(b.view.shape(b.weight), b.view.rank(b.output()))

    return Pattern(
        name="broadcast_expand",
        kind="broadcast",
        nodes=(PNode("expand", "Expand"), PNode("P", PARAM)),
        edges=(PEdge("P", "expand", (0,)),),
        weight="P",
        input=("expand", 0),
        output="expand",
        where=where,
        attrs=lambda b: _broadcast_attrs(b, b.view.shape(b.weight)),
    )


def bias_broadcast_matches(view: GraphView, bias: str) -> list[LayerMatch] | None:
    """A bias released from its layers (a tied head's, an RNN's added alone at later steps) as
    broadcast matches, one per consumer: None unless every consumer is an Add that the
    broadcast_add pattern accepts (the bias Add a larger match gave up)."""
    pattern = _BROADCAST_ADD
    if not any(p is pattern for p in patterns()):  # unregistered by the user
        return None
    out = []
    for node in view.consumers.get(bias, []):
        b = Binding(pattern, view, {"add": node.name, "P": bias})
        try:
            if node.op_type != "Add" or pattern.where is None or not pattern.where(b):
                return None
            use = LayerUse(nodes=(node.name,), input=b.input(), output=b.output())
            attrs = dict(pattern.attrs(b)) if pattern.attrs is not None else {}
        except NoMatch:
            return None
        out.append(LayerMatch(kind=pattern.kind, pattern=pattern.name, weight=bias, bias=None, use=use, attrs=attrs))
    return out or None


# ------------------------------------------------------ normalization fallback notes
NORMALIZATION_OPS = ("BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization")


def _fallback_reason(node: onnx.NodeProto, view: GraphView, trainable: set[str]) -> str:
    """Why a normalization's scale/shift matched no scale_and_shift pattern (best guess)."""
    op = node.op_type
    training = op == "BatchNormalization" and int(attrs_of(node).get("training_mode", 0)) != 0
    label = f"{op} {node.name!r}" + (" in training mode" if training else "")
    if op == "BatchNormalization" and running_outputs_used(node, view):
        return f"{label} with its running-statistics outputs used elsewhere"
    if op == "BatchNormalization" and not training and (
            len(node.input) < 5 or any(node.input[i] not in view.initializers for i in (3, 4))):
        return f"{label} whose mean/var are not initializers"
    scale, bias = node.input[1], (node.input[2] if len(node.input) > 2 else "")
    if scale not in trainable:
        return f"{label} with a frozen or computed scale (only the shift is trained)"
    shapes = [view.shape(t) for t in (scale, bias) if t in trainable]
    if len(shapes) == 2 and tuple(shapes[0] or ()) != tuple(shapes[1] or ()):
        return f"{label} with scale and shift of different shapes"
    if op != "LayerNormalization" and view.rank(scale) != 1:
        return f"{label} with a scale of rank {view.rank(scale)}"
    if any(len(view.consumers.get(t, ())) > 1 for t in (scale, bias) if t in trainable):
        return f"{label} whose scale or shift is also used by other nodes"
    return f"{label} matched no scale_and_shift pattern"


def normalization_fallback_notes(view: GraphView, layers) -> list[str]:
    """One note per normalization node whose trainable scale/shift ended up in generic layers
    (not linked by the user): the op, the node, why, and the blocks the parameters got, e.g.
    "BatchNormalization 'bn1' in training mode with its running-statistics outputs used
    elsewhere: 'bn1.weight', 'bn1.bias' are generic layers (diagonal)"."""
    generic = {p: layer for layer in layers if layer.kind == "generic"
               and not layer.attrs.get("linked_by_user") and not layer.attrs.get("shared_kinds")
               for p in layer.params}
    trainable = {p for layer in layers for p in layer.params}
    notes = []
    for node in view.nodes:
        if node.op_type not in NORMALIZATION_OPS or node.domain not in ("", "ai.onnx"):
            continue
        params = [t for t in list(node.input)[1:3] if t and t in generic]
        if not params:
            continue
        approx = sorted({generic[p].approximation or "?" for p in params})
        names = ", ".join(repr(p) for p in params)
        notes.append(f"{_fallback_reason(node, view, trainable)}: {names} "
                     f"{'is a generic layer' if len(params) == 1 else 'are generic layers'} ({', '.join(approx)})")
    return notes


# ---------------------------------------------------- opset 23+ and ConvTranspose
def _rms_norm_pattern() -> Pattern:
    """RMSNormalization(x, scale) (opset 23; scale only): scale_and_shift without shift."""
    return _normalization_pattern("rms_norm", "RMSNormalization", False,
                                  lambda b: trailing_axes_attrs(b, "n", "RMSNormalization"))


def _conv_transpose_pattern(nd: int, with_bias: bool) -> Pattern:
    """ConvTranspose (weight [C_in, C_out/group, *k], bias [C_out]) with explicit pads;
    auto_pad or output_shape: NoMatch (generic fallback)."""
    nodes = [PNode("convt", "ConvTranspose"), PNode("W", PARAM, where=param_rank(nd + 2))]
    edges = [PEdge("W", "convt", (1,))]
    if with_bias:
        nodes.append(PNode("B", PARAM, where=param_rank(1)))
        edges.append(PEdge("B", "convt", (2,)))

    def where(b: Binding) -> bool:
        w = b.view.shape(b.weight)
        group = int(b.attr("convt", "group", 1))
        if with_bias and tuple(b.view.shape(b.bias)) != (w[1] * group,):
            return False
        r = b.view.rank(b.input())
        return r is None or r == nd + 2

    def attrs(b: Binding) -> dict:
        name = b.node("convt").name
        auto_pad = b.attr("convt", "auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if auto_pad not in ("NOTSET", ""):
            raise NoMatch(f"ConvTranspose node {name!r}: auto_pad={auto_pad} (export with explicit pads)")
        if b.attr("convt", "output_shape", None) is not None:
            raise NoMatch(f"ConvTranspose node {name!r}: output_shape (export with explicit pads/output_padding)")
        kernel = tuple(int(k) for k in (b.attr("convt", "kernel_shape", None) or b.view.shape(b.weight)[2:]))
        return {
            "kernel_shape": kernel,
            "strides": tuple(int(s) for s in b.attr("convt", "strides", [1] * nd)),
            "pads": tuple(int(p) for p in b.attr("convt", "pads", [0] * 2 * nd)),
            "dilations": tuple(int(d) for d in b.attr("convt", "dilations", [1] * nd)),
            "output_padding": tuple(int(p) for p in b.attr("convt", "output_padding", [0] * nd)),
            "group": int(b.attr("convt", "group", 1)),
        }

    return Pattern(
        name=f"conv_transpose{nd}d" + ("_bias" if with_bias else ""),
        kind="conv_transpose",
        nodes=tuple(nodes),
        edges=tuple(edges),
        weight="W",
        bias="B" if with_bias else None,
        input=("convt", 0),
        output="convt",
        where=where,
        attrs=attrs,
    )


# ------------------------------------------------------------ built-in library
for _tb in (0, 1):
    for _bias in (False, True):
        register_builtin(_gemm_pattern(_tb, _bias))
for _tr in (False, True):
    for _bias in (False, True):
        register_builtin(_matmul_pattern(_tr, _bias))
for _nd in (1, 2, 3):
    for _dw in (False, True):
        for _bias in (False, True):
            register_builtin(_conv_pattern(_nd, _bias, _dw))
for _gain_first in (True, False):
    for _bias in (False, True):
        register_builtin(_weight_norm_conv_pattern(_gain_first, _bias))
register_builtin(_embedding_pattern())
for _bias in (False, True):
    register_builtin(_ln_pattern(_bias))
    register_builtin(_bn_pattern(_bias))
    register_builtin(_batch_stat_pattern("batch_norm_train", "BatchNormalization", _bias, _bn_training,
                                         lambda b: {"training": True}))
    register_builtin(_batch_stat_pattern("instance_norm", "InstanceNormalization", _bias))
    register_builtin(_batch_stat_pattern("group_norm", "GroupNormalization", _bias, norm=_group_norm_spec))
register_builtin(_mul_pattern(True))
register_builtin(_mul_pattern(False))
_BROADCAST_ADD = register_builtin(_broadcast_add_pattern())
register_builtin(_gather_add_pattern())
register_builtin(_expand_pattern())
register_builtin(_rms_norm_pattern())
for _nd in (1, 2, 3):
    for _bias in (False, True):
        register_builtin(_conv_transpose_pattern(_nd, _bias))

BUILTIN_PATTERN_NAMES = tuple(p.name for p in patterns())
