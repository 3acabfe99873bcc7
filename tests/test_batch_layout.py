"""The curvature of a layer must not depend on where its activations keep the batch axis.

Each model computes the same function of x [N, T, D] (or ids [N, T]) with the layer under
test run in one of four layouts of its rows: batch-major [N, T, *] as given, time-major
[T, N, *] (Transpose before, Transpose back after: torch's nn.MultiheadAttention input),
time-major merged [T*N, *] (a Reshape of the time-major tensor: its out_proj) and
batch-major merged [N*T, *]. The statistics of one update are compared across the layouts and
against the definitions (docs/conventions.md) computed in float64 numpy from per-example
gradients written out by hand, with the example axis known:

    A = 1/(N T) sum_{n,t} a~ a~^T,  G = 1/N sum_{n,t} delta delta^T,
    diag = 1/N sum_n (sum_t delta_nt a~_nt^T)^2,

delta_nt = d l_n / d out_nt at the data targets (the empirical mode: deterministic). The
graphs are float32 (the front end runs float32): rtol 1e-4 is ~1e3 float32 ulps, far below
the errors a wrong count makes (factors T or N/T off).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.passes.batch_axis import ExampleAxis, reshaped

N, T, D, H, C, V = 3, 4, 5, 6, 3, 7
LAYOUTS = ("batch_major", "time_major", "merged_time_major", "merged_batch_major")
RTOL, ATOL = 1e-4, 1e-6
FIXTURES = Path(__file__).parent / "fixtures" / "real"


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(size=(D, H)), "b1": rng.normal(size=H) * 0.5,
        "w2": rng.normal(size=(H, C)),
        "table": rng.normal(size=(V, D)),
        "ln_scale": 1 + 0.3 * rng.normal(size=D), "ln_bias": 0.3 * rng.normal(size=D),
        "shift": rng.normal(size=D),
    }


def _in_layout(nodes: list, x: str, width: int, layout: str, tag: str) -> str:
    """Nodes that bring x [N, T, width] into `layout`; returns the tensor."""
    if layout == "batch_major":
        return x
    if layout == "merged_batch_major":
        nodes.append(helper.make_node("Reshape", [x, "shape_rows"], [f"{tag}_in"]))
        return f"{tag}_in"
    nodes.append(helper.make_node("Transpose", [x], [f"{tag}_tn"], perm=[1, 0, 2]))
    if layout == "time_major":
        return f"{tag}_tn"
    nodes.append(helper.make_node("Reshape", [f"{tag}_tn", "shape_rows"], [f"{tag}_in"]))
    return f"{tag}_in"


def _out_layout(nodes: list, y: str, layout: str, tag: str, out: str) -> None:
    """Nodes that bring the layer's output y (in `layout`) back to [N, T, *] as `out`."""
    if layout == "batch_major":
        nodes.append(helper.make_node("Identity", [y], [out]))
    elif layout == "merged_batch_major":
        nodes.append(helper.make_node("Reshape", [y, "shape_nt"], [out]))
    elif layout == "time_major":
        nodes.append(helper.make_node("Transpose", [y], [out], perm=[1, 0, 2]))
    else:
        nodes.append(helper.make_node("Reshape", [y, "shape_tn"], [f"{tag}_tn_out"]))
        nodes.append(helper.make_node("Transpose", [f"{tag}_tn_out"], [out], perm=[1, 0, 2]))


def _model(kind: str, layout: str, p: dict[str, np.ndarray]):
    """logits [N, T, C] = tanh(layer(x)) @ w2, the layer (`kind`) run in `layout`."""
    nodes: list = []
    width = {"fc": D, "embedding": None, "layernorm": D, "bias": D}[kind]
    if kind == "embedding":
        ids = "ids"
        if layout == "batch_major":
            src = ids
        elif layout == "merged_batch_major":
            nodes.append(helper.make_node("Reshape", [ids, "shape_flat"], ["ids_in"]))
            src = "ids_in"
        else:
            nodes.append(helper.make_node("Transpose", [ids], ["ids_tn"], perm=[1, 0]))
            src = "ids_tn"
            if layout == "merged_time_major":
                nodes.append(helper.make_node("Reshape", ["ids_tn", "shape_flat"], ["ids_in"]))
                src = "ids_in"
        nodes.append(helper.make_node("Gather", ["table", src], ["emb"]))
        _out_layout(nodes, "emb", layout, "emb", "h")
        feat = D
    else:
        src = _in_layout(nodes, "input", width, layout, "l")
        if kind == "fc":
            nodes.append(helper.make_node("MatMul", [src, "w1"], ["mm"]))
            nodes.append(helper.make_node("Add", ["mm", "b1"], ["lin"]))
            feat = H
        elif kind == "bias":  # a parameter broadcast over the examples and positions
            nodes.append(helper.make_node("Add", [src, "shift"], ["lin"]))
            feat = D
        else:
            nodes.append(helper.make_node("LayerNormalization", [src, "ln_scale", "ln_bias"], ["lin"], axis=-1,
                                          epsilon=1e-5))
            feat = D
        _out_layout(nodes, "lin", layout, "l", "h")
    nodes.append(helper.make_node("Tanh", ["h"], ["a"]))
    w2 = p["w2"][:feat]
    nodes.append(helper.make_node("MatMul", ["a", "w2"], ["logits"]))
    inits = {"w2": w2, "shape_nt": np.array([-1, T, feat]), "shape_tn": np.array([T, -1, feat]),
             "shape_rows": np.array([-1, D]), "shape_flat": np.array([-1])}
    if kind == "fc":
        inits.update(w1=p["w1"], b1=p["b1"])
    elif kind == "embedding":
        inits.update(table=p["table"])
    elif kind == "bias":
        inits.update(shift=p["shift"])
    else:
        inits.update(ln_scale=p["ln_scale"], ln_bias=p["ln_bias"])
    used = {i for nd in nodes for i in nd.input}
    tensors = [numpy_helper.from_array(v.astype(np.int64) if v.dtype.kind == "i" else v.astype(np.float32), k)
               for k, v in inits.items() if k in used]
    x_info = (helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", T]) if kind == "embedding"
              else helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", T, D]))
    graph = helper.make_graph(nodes, f"{kind}_{layout}", [x_info],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", T, C])], tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _layer_of(plan, param: str) -> str:
    return next(layer.name for layer in plan.layers if param in layer.params)


def _stats(kind: str, layout: str, p, x, y, approx: str | None = None, mode: str = "empirical") -> dict:
    """{factor: value} of the layer under test after one statistics update."""
    param = {"fc": "w1", "embedding": "table", "layernorm": "ln_scale", "bias": "shift"}[kind]
    model = _model(kind, layout, p)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    name = _layer_of(plan, param)
    if approx is not None:
        plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False, layers={name: approx})
    sub, _ = emit_subgraph(plan, "statistics", mode=mode)
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {("ids" if kind == "embedding" else "input"): x, "targets": y}
    feeds.update({t.name: numpy_helper.to_array(t) for t in plan.model.graph.initializer if t.name in plan.trainable})
    for i in sess.get_inputs():  # ekfac's inverse state: the identity bases it starts from
        if i.name not in feeds:
            assert i.name.startswith("inverse/"), i.name
            shape = [int(d) for d in i.shape]
            leaf = i.name.rsplit("/", 1)[1]
            value = np.eye(shape[0]) if leaf.endswith("_Q") else np.ones(shape) if leaf == "damping" else np.zeros(shape)
            feeds[i.name] = value.astype(np.float32)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    prefix = f"stat/{name}/"
    return {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)}


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _truth_rows(kind: str, p, x, y):
    """(layer input rows a~ [N, T, k], output cotangents delta [N, T, m]) in float64, with
    delta_nt = d l_n / d out_nt, l_n = sum_t CE(z_nt, y_nt) (l_n's own gradient: N times the
    mean loss's)."""
    w2 = p["w2"]
    if kind == "fc":
        out = x @ p["w1"] + p["b1"]
        a_rows = np.concatenate([x, np.ones((N, T, 1))], axis=2)
    elif kind == "embedding":
        out = p["table"][x]
        a_rows = np.eye(V)[x]
        w2 = w2[:D]
    elif kind == "bias":
        out = x + p["shift"]
        a_rows = np.ones((N, T, 1))
        w2 = w2[:D]
    else:
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        xhat = (x - mu) / np.sqrt(var + 1e-5)
        out = xhat * p["ln_scale"] + p["ln_bias"]
        a_rows = xhat
        w2 = w2[:D]
    a = np.tanh(out)
    dz = _softmax(a @ w2) - np.eye(C)[y]
    delta = (dz @ w2.T) * (1 - a * a)
    return a_rows, delta


def _data(kind: str, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, size=(N, T)) if kind == "embedding" else rng.normal(size=(N, T, D))
    return x, rng.integers(0, C, size=(N, T))


def _feed(kind, x):
    return x.astype(np.int64) if kind == "embedding" else x.astype(np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("approx", [None, "kron_both_diag"])
def test_fully_connected_kron_factors_are_the_definitions_in_every_layout(layout, approx):
    p = _params()
    x, y = _data("fc")
    stats = _stats("fc", layout, p, _feed("fc", x), y, approx)
    a, delta = _truth_rows("fc", p, x, y)
    A = np.einsum("nti,ntj->ij", a, a) / (N * T)
    G = np.einsum("nti,ntj->ij", delta, delta) / N
    if approx:
        A, G = np.diag(A), np.diag(G)
    np.testing.assert_allclose(stats["A"], A, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(stats["G"], G, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_embedding_factors_are_the_definitions_in_every_layout(layout):
    p = _params()
    x, y = _data("embedding")
    stats = _stats("embedding", layout, p, _feed("embedding", x), y)
    onehot, delta = _truth_rows("embedding", p, x, y)
    np.testing.assert_allclose(stats["A"], onehot.sum((0, 1)) / (N * T), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(stats["G"], np.einsum("nti,ntj->ij", delta, delta) / N, rtol=RTOL, atol=ATOL)


def test_fully_connected_kron_factors_agree_across_layouts_in_the_exact_mode():
    """The exact mode (one seed per output coordinate: deterministic) gives the same A and G
    whatever the layout."""
    mode = "exact"
    p = _params(2)
    x, y = _data("fc", 3)
    ref = _stats("fc", "batch_major", p, _feed("fc", x), y, mode=mode)
    for layout in LAYOUTS[1:]:
        other = _stats("fc", layout, p, _feed("fc", x), y, mode=mode)
        for f in ("A", "G"):
            np.testing.assert_allclose(other[f], ref[f], rtol=RTOL, atol=ATOL, err_msg=f"{layout} {f}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fully_connected_diagonal_is_the_per_example_definition_in_every_layout(layout):
    p = _params()
    x, y = _data("fc")
    stats = _stats("fc", layout, p, _feed("fc", x), y, "diagonal")
    a, delta = _truth_rows("fc", p, x, y)
    g = np.einsum("nto,nti->noi", delta, a)  # per-example gradients [N, out, in+1]
    np.testing.assert_allclose(stats["diag"].reshape(H, D + 1), (g * g).mean(0), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layernorm_affine_is_the_per_example_definition_in_every_layout(layout):
    p = _params()
    x, y = _data("layernorm")
    stats = _stats("layernorm", layout, p, _feed("layernorm", x), y)
    xhat, delta = _truth_rows("layernorm", p, x, y)
    g = np.concatenate([(xhat * delta).sum(1), delta.sum(1)], axis=1)  # [N, 2D]: (scale, shift)
    key = "full" if "full" in stats else "diag"
    F = g.T @ g / N
    np.testing.assert_allclose(stats[key], F if key == "full" else np.diag(F), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ekfac_second_moments_are_the_per_example_definition_in_every_layout(layout):
    """ekfac's S in the bases of its first state (the identity): the diagonal Fisher."""
    p = _params()
    x, y = _data("fc")
    stats = _stats("fc", layout, p, _feed("fc", x), y, "ekfac")
    a, delta = _truth_rows("fc", p, x, y)
    g = np.einsum("nto,nti->noi", delta, a)
    np.testing.assert_allclose(stats["S"].reshape(H, D + 1), (g * g).mean(0), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind,approx", [("fc", "diagonal"), ("fc", "ekfac"), ("layernorm", None), ("embedding", None)])
def test_per_example_statistics_agree_across_layouts_in_the_exact_mode(kind, approx):
    """The exact mode's seeds (one per output coordinate) differ from the data gradient: the
    layouts still agree on every factor."""
    p = _params(2)
    x, y = _data(kind, 3)
    ref = _stats(kind, "batch_major", p, _feed(kind, x), y, approx, mode="exact")
    for layout in LAYOUTS[1:]:
        other = _stats(kind, layout, p, _feed(kind, x), y, approx, mode="exact")
        assert other.keys() == ref.keys()
        for f in ref:
            np.testing.assert_allclose(other[f], ref[f], rtol=RTOL, atol=ATOL, err_msg=f"{layout} {f}")


# ---- the pass (passes/batch_axis.py) on its own

def test_reshape_rule_places_merged_axes_from_static_dims():
    lay = ExampleAxis(1)  # [T, N, D]
    assert reshaped((17, "N", 16), lay, ("M", 16)) == ExampleAxis(0, 17, 1)  # [T*N, D]
    assert reshaped((17, "N", 16), lay, (17, "M", 8)) == ExampleAxis(1, 1, 2)  # heads split off D
    assert reshaped(("M", 17, 8), ExampleAxis(0, 1, 2), ("N", 2, 17, 8)) == ExampleAxis(0)  # and back
    assert reshaped((17, 3, 16), ExampleAxis(1), (51, 16)) == ExampleAxis(0, 17, 1)  # a static batch of 3
    assert reshaped((17, "N", 16), lay, ("A", "B")) is None  # two dynamic dims: not pinned
    assert reshaped(("N", 8, 32), ExampleAxis(0), ("N", 8, "H", 16)) == ExampleAxis(0)  # heads split later
    assert reshaped(("T", "N", 16), lay, ("M", 16)) is None  # the entries before N unknown


def test_split_and_concat_along_the_example_axis_follow_the_stacked_steps():
    """An unrolled recurrence: x [T, N, D] flattened to [T*N, D] time-major, split into T equal
    parts (one per step, each [N, D] batch-major), the steps' rows concatenated back. Split
    with sizes, into parts not dividing T, or a Concat with an unplaced piece: not placed."""
    from onnx import shape_inference

    from kfac_compiler.graph import GraphView
    from kfac_compiler.passes.batch_axis import RULES
    g = helper.make_graph(
        [helper.make_node("Flatten", ["x"], ["rows"], axis=2),
         helper.make_node("Split", ["rows"], [f"s{t}" for t in range(T)], axis=0),
         helper.make_node("Concat", [f"s{t}" for t in range(T)], ["back"], axis=0),
         helper.make_node("Concat", ["s0", "s1"], ["pair"], axis=0),
         helper.make_node("Split", ["rows"], ["p0", "p1", "p2"], axis=0),
         helper.make_node("Split", ["rows", "sizes"], ["q0", "q1"], axis=0),
         helper.make_node("Concat", ["s0", "c"], ["mixed"], axis=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "N", D])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("back", "pair", "p0", "q0", "mixed")],
        [numpy_helper.from_array(np.array([2 * N, 2 * N], np.int64), "sizes"),
         numpy_helper.from_array(np.zeros((N, D), np.float32), "c")])
    view = GraphView(shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])))
    layouts: dict = {"x": ExampleAxis(1)}  # x time-major (graph inputs default to axis 0)
    for node in view.nodes:  # the rules in graph order, as example_layouts runs them
        outs = RULES[node.op_type](view, node, [layouts.get(i) for i in node.input]) or [None] * len(node.output)
        layouts.update(zip(node.output, outs))
    assert layouts["rows"] == ExampleAxis(0, T, 1)
    assert all(layouts[f"s{t}"] == ExampleAxis(0) for t in range(T))
    assert layouts["back"] == ExampleAxis(0, T, 1) and layouts["pair"] == ExampleAxis(0, 2, 1)
    assert layouts["p0"] is None and layouts["q0"] is None and layouts["mixed"] is None


def test_vit_attention_projections_are_placed_time_major_and_merged():
    """TorchScript's nn.MultiheadAttention: in_proj on [T, N, D], out_proj on [T*N, D]
    (T = 17 tokens); every other layer batch-major."""
    path = FIXTURES / "vit-ts.onnx"
    if not path.exists():
        pytest.skip("no real-export fixtures")
    plan = kc.compile(str(path), loss="softmax_cross_entropy", output="logits", emit=False)
    moved = {(layer.kind, layer.attrs["example_axes"]) for layer in plan.layers if layer.attrs.get("example_axes")}
    assert moved == {("fully_connected", (((1, 1, 1), (1, 1, 1)),)),  # in_proj: [T, N, D]
                     ("fully_connected", (((0, 17, 1), (0, 17, 1)),)),  # out_proj: [T*N, D]
                     ("broadcast", ((None, (0, 1, 1)),))}  # the class token's Expand to [N, 1, D]: batch-major
    assert not any("groups rows into examples" in n for n in plan.notes)  # kron blocks: layout-free


def _attention_layouts(q_axis: int, mask_shape: list[int] | None) -> dict:
    """The batch-axis rules over Q, K, V [B, H, S, E] (B = 2, from x [B, S, H*E]; Q transposed to
    put the batch on axis `q_axis`, and back only when q_axis is 0) and an optional float mask
    computed from x: the layouts of Attention's outputs."""
    from onnx import shape_inference

    from kfac_compiler.graph import GraphView
    from kfac_compiler.passes.batch_axis import RULES

    perm = [0, 1, 2, 3] if q_axis == 0 else [1, 0, 2, 3]
    nodes = [helper.make_node("Reshape", ["x", "qkv_shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["k"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["k"], ["q"], perm=perm)]
    ins = ["q", "k", "k"]
    if mask_shape is not None:
        nodes += [helper.make_node("ReduceSum", ["x", "mask_axes"], ["m0"], keepdims=1),
                  helper.make_node("Reshape", ["m0", "mask_shape"], ["mask"])]
        ins.append("mask")
    nodes.append(helper.make_node("Attention", ins, ["y", "", "", "scores"], qk_matmul_output_mode=0))
    inits = [numpy_helper.from_array(np.asarray([2, 3, 2, 4], np.int64), "qkv_shape"),
             numpy_helper.from_array(np.asarray([1, 2], np.int64), "mask_axes"),
             numpy_helper.from_array(np.asarray(mask_shape or [1], np.int64), "mask_shape")]
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    view = GraphView(shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])))
    layouts: dict = {"x": ExampleAxis(0)}
    for node in view.nodes:  # the rules in graph order, as example_layouts runs them
        outs = RULES[node.op_type](view, node, [layouts.get(i) for i in node.input]) or [None] * len(node.output)
        layouts.update(zip(node.output, outs))
    return layouts


@pytest.mark.parametrize("q_axis,mask_shape,placed", [
    (0, None, True), (0, [2, 1, 1, 1], True), (0, [1, 1, 2, 1], False), (1, None, False)])
def test_attention_keeps_the_batch_on_axis_0(q_axis, mask_shape, placed):
    """Opset-23 Attention computes each row of its batch axis 0 from that row of Q, K, V and
    the mask: its output y and its scores keep the examples there. A Q whose batch axis is
    elsewhere, or a mask whose batch rides on another axis, leaves them unplaced."""
    lay = _attention_layouts(q_axis, mask_shape)
    want = ExampleAxis(0) if placed else None
    assert lay["y"] == want and lay["scores"] == want


def test_attention_of_an_sdpa_export_is_traced_for_per_example_blocks():
    """torch.export's opset-23 GPT-2 (scaled_dot_product_attention as Attention): with diagonal
    fully connected blocks, the attention's out projection c_proj reads [N*T, D] rows traced
    through the Attention, as c_attn's, with no note that its example axis is unknown."""
    path = FIXTURES / "gpt2_sdpa-dynamo23.onnx"
    if not path.exists():
        pytest.skip("no real-export fixtures")
    plan = kc.compile(str(path), loss="softmax_cross_entropy", emit=False,
                      config={"approximations": {"fully_connected": "diagonal"}})
    axes = {layer.name.rsplit(".", 1)[-1]: layer.attrs.get("example_axes") for layer in plan.layers
            if ".h.0.attn." in layer.name}
    assert axes["c_proj"] == axes["c_attn"] == (((0, 1, 8), (0, 1, 8)),)
    assert not any("could not be traced" in n for n in plan.notes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_broadcast_bias_is_the_per_example_definition_in_every_layout(layout):
    """A parameter added to every row (broadcast block, diagonal): g_n = sum_t delta_nt."""
    p = _params()
    x, y = _data("bias")
    stats = _stats("bias", layout, p, _feed("bias", x), y)
    _, delta = _truth_rows("bias", p, x, y)
    g = delta.sum(1)
    key = "full" if "full" in stats else "diag"
    F = g.T @ g / N
    np.testing.assert_allclose(stats[key], F if key == "full" else np.diag(F), rtol=RTOL, atol=ATOL)


def test_a_block_that_cannot_move_the_example_axis_is_noted():
    """A conv whose batch axis holds examples x segments ([N*S, C, L], a Reshape of
    [N, S, C, L]): its diagonal block groups per-example gradients by the leading axis and
    cannot move the examples (the conv needs [batch, C, L]): the plan says so; batch-major
    (S folded into the channels instead), no note. The Kronecker block needs no note."""
    S, CH, L, K = 2, 3, 5, 4

    def model(merged: bool):
        shape_in = [-1, CH, L] if merged else [-1, S * CH, L]
        nodes = [helper.make_node("Reshape", ["input", "s_in"], ["xr"]),
                 helper.make_node("Conv", ["xr", "w", "cb"], ["y"], kernel_shape=[3], pads=[1, 1]),
                 helper.make_node("Reshape", ["y", "s_out"], ["logits"])]
        w = np.ones((K, CH if merged else S * CH, 3), np.float32)
        graph = helper.make_graph(
            nodes, "conv", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", S, CH, L])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", S * K * L if merged else K * L])],
            [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(K, np.float32), "cb"),
             numpy_helper.from_array(np.array(shape_in, np.int64), "s_in"),
             numpy_helper.from_array(np.array([-1, (S if merged else 1) * K * L], np.int64), "s_out")])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    def notes(merged, approx):
        plan = kc.compile(model(merged), loss="softmax_cross_entropy", output="logits", emit=False)
        name = _layer_of(plan, "w")
        assert plan.layer(name).kind == "conv"
        plan = kc.compile(model(merged), loss="softmax_cross_entropy", output="logits", emit=False,
                          layers={name: approx})
        return [n for n in plan.notes if "groups rows into examples" in n]

    assert notes(False, "diagonal") == [] and notes(True, "kron") == []
    (note,) = notes(True, "diagonal")
    assert f"axis 0 = N*{S}" in note and "biased" in note


def test_every_wav2vec2_layer_is_placed_batch_major():
    """torch.export's wav2vec2 reads its input through a whole-axis Slice (x[:] on the batch
    axis) and reshapes heads after the batch axis (same shape-inference symbol): every layer
    use is placed, and batch-major (no layer carries example_axes)."""
    path = FIXTURES / "wav2vec2-dynamo_noopt.onnx"
    if not path.exists():
        pytest.skip("no real-export fixtures")
    plan = kc.compile(str(path), loss="softmax_cross_entropy", output="logits", emit=False)
    assert [layer.name for layer in plan.layers if layer.attrs.get("example_axes")] == []


def _swin_ts_plan():
    path = FIXTURES / "swin-ts.onnx"
    if not path.exists():
        pytest.skip("no real-export fixtures")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kc.compile(str(path), loss="softmax_cross_entropy", output="logits", emit=False)


@pytest.mark.slow
def test_swin_ts_relative_position_bias_is_per_example():
    """TorchScript's Swin computes its window counts from x.size() at run time (ONNX's shapes:
    `unk__6` windows): ONNX Runtime's symbolic shapes trace them (4*N windows in stage 1, N
    in stage 3), and the position-bias blocks' diagonal is the per-example definition
    1/N sum_n (d l_n / d P)^2, with each example's gradient from a batch of that example alone."""
    from kfac_compiler.runtime.curvature import Curvature

    plan = _swin_ts_plan()
    bias = [layer for layer in plan.layers if layer.kind == "broadcast"]
    assert [layer.attrs.get("example_axes") for layer in bias] == [(((0, 1, 4), (0, 1, 4)),)] * 2 + [None]
    assert not any("could not be traced" in n or "groups rows into examples" in n for n in plan.notes)
    with np.load(FIXTURES / "swin-ts.npz") as d:
        x, y = d["input"], d["targets"]
    curv = Curvature(plan, mode="empirical")
    got = curv.estimate({"input": x}, y)
    per_example = [curv.gradients({"input": x[n:n + 1]}, y[n:n + 1])[1] for n in range(len(y))]
    for layer in bias:
        (p,) = layer.params
        want = np.mean([g[p].astype(np.float64) ** 2 for g in per_example], axis=0)
        np.testing.assert_allclose(got[layer.name]["diag"].reshape(want.shape), want, rtol=1e-3,
                                   atol=1e-6 * np.abs(want).max(), err_msg=layer.name)


def test_an_example_axis_that_cannot_be_traced_is_noted_naming_the_parameter():
    """Tile (no layout rule) makes [2N, D] rows of [N, D]: a bias added there is a broadcast
    layer whose diagonal block would take each of the 2N rows for an example; compile says
    so, naming the parameter. Added before the Tile (batch-major rows): no note."""
    def model(after_tile: bool):
        tile, add = (helper.make_node("Tile", ["input", "reps"], ["t"]), helper.make_node("Add", ["t", "b"], ["s"])) \
            if after_tile else (helper.make_node("Tile", ["a", "reps"], ["s"]), helper.make_node("Add", ["input", "b"], ["a"]))
        nodes = [tile, add] if after_tile else [add, tile]
        nodes += [helper.make_node("Reshape", ["s", "shape"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["logits"])]
        inits = [numpy_helper.from_array(np.array([2, 1], np.int64), "reps"),
                 numpy_helper.from_array(np.array([-1, 2 * D], np.int64), "shape"),
                 numpy_helper.from_array(np.full(D, 0.5, np.float32), "b"),
                 numpy_helper.from_array(np.ones((2 * D, C), np.float32), "w")]
        graph = helper.make_graph(nodes, "tile", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", D])],
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", C])], inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    def notes(after_tile: bool):
        plan = kc.compile(model(after_tile), loss="softmax_cross_entropy", output="logits", emit=False)
        assert plan.layer("b").kind == "broadcast"
        return [n for n in plan.notes if "could not be traced" in n]

    assert notes(False) == []
    (note,) = notes(True)
    assert note.startswith("layer 'b' ('b'): the example axis of use 0's output 's' could not be traced and its "
                           "leading dim is not the batch size: diagonal takes each leading-axis row for an example")


def test_symbolic_shapes_read_constants_given_as_value_ints():
    """torch.export writes Constant nodes as value_ints / value_float; ONNX Runtime's symbolic
    shape inference reads only `value` and failed on them (vit-dynamo_noopt: no symbolic view,
    ONNX's shapes alone). The weight-free copy it reads has them as `value` tensors of the
    same dtype, so a Reshape by such a constant gets its symbolic shape."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from kfac_compiler.graph import GraphView
    from kfac_compiler.passes.batch_axis import symbolic_view, tensor_valued_constants

    nodes = [helper.make_node("Constant", [], ["shape"], value_ints=[-1, 2 * D]),
             helper.make_node("Constant", [], ["half"], value_float=0.5),
             helper.make_node("Mul", ["input", "half"], ["h"]),
             helper.make_node("Reshape", ["h", "shape"], ["logits"])]
    graph = helper.make_graph(nodes, "ints", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 2, D])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(AttributeError):  # ORT's tool itself, on the model as written
        SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    view = symbolic_view(GraphView(model))
    assert view is not None and view.shape("logits") == ("N", 2 * D)
    tensor_valued_constants(model)
    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"}
    assert values["shape"].dtype == np.int64 and values["shape"].tolist() == [-1, 2 * D]
    assert values["half"].dtype == np.float32 and values["half"].shape == () and values["half"] == 0.5
    path = FIXTURES / "vit-dynamo_noopt.onnx"
    if path.exists():
        from kfac_compiler.passes.canonicalize import canonicalize
        from kfac_compiler.passes.load import load_model

        assert symbolic_view(GraphView(canonicalize(load_model(str(path), "logits"), "logits"))) is not None
