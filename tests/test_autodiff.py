"""The autodiff pass: whole-model gradients (backward and jvp) of every zoo model against
finite differences, ORT float32 runs of gradient_model/jvp_model, pruning, repeated
backward calls on one builder, accumulation over shared tensors, and error reporting."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.builder import GraphBuilder, value_info
from kfac_compiler.errors import ModelError, UnsupportedOpError
from kfac_compiler.graph import GraphView
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.oprules.check import convert_float_type, fd_check, run_ort, run_reference
from kfac_compiler.passes.autodiff import backward, gradient_model, jvp, jvp_model, path_nodes


def _params(model):
    return [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]


def _randomize(model, seed=0, scale=0.1):
    """Non-zero biases/statistics so no unit sits exactly at a ReLU/MaxPool kink."""
    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.data_type == TensorProto.FLOAT:
            a = numpy_helper.to_array(t)
            if "running_var" in t.name:
                a = rng.uniform(0.5, 1.5, a.shape)
            elif not a.any() or "running_mean" in t.name:
                a = scale * rng.standard_normal(a.shape)
            t.CopyFrom(numpy_helper.from_array(a.astype(np.float32), t.name))
    return m


def _inputs(name, n, rng):
    model = get_model(name)
    inp = model.graph.input[0]
    dims = [n if (d.dim_param or not d.dim_value) else d.dim_value for d in inp.type.tensor_type.shape.dim]
    if inp.type.tensor_type.elem_type == TensorProto.INT64:
        x, _ = ZOO[name].make_data(n=n, seed=1)
        return {"input": x["input"]}
    return {"input": rng.standard_normal(dims)}


ZOO_NAMES = list(ZOO)


@pytest.fixture(scope="module", params=ZOO_NAMES)
def zoo_case(request):
    name = request.param
    rng = np.random.default_rng(3)
    model32 = _randomize(get_model(name, seed=0))
    model64 = convert_float_type(model32, TensorProto.DOUBLE)
    feeds = _inputs(name, 3, rng)
    return name, model32, model64, feeds


@pytest.mark.slow
def test_zoo_gradients_fd(zoo_case):
    name, model32, model64, feeds = zoo_case
    params = _params(model32)
    rep = fd_check(model64, feeds, wrt=params, outputs=["logits"], per_input_jvp=False, seed=5)
    assert rep.ok, f"{name}: {rep}"
    assert set(rep.vjp) == set(params)
    # every parameter of the zoo models influences the logits
    assert all(np.any(rep.grads[p] != 0) for p in params), name


def test_zoo_gradient_model_ort_float32(zoo_case):
    """gradient_model / jvp_model in float32 on ORT CPU agree with float64 references."""
    name, model32, model64, feeds = zoo_case
    params = _params(model32)
    rng = np.random.default_rng(11)
    gm64 = gradient_model(model64, "logits", params)
    gm32 = gradient_model(model32, "logits", params)
    onnx.checker.check_model(gm32)
    names = [o.name for o in gm32.graph.output]
    assert names == ["logits"] + [f"grad/{p}" for p in params]
    assert [i.name for i in gm32.graph.input] == ["input", "logits_grad"]
    assert {t.name for t in gm32.graph.initializer} >= set(params)
    y = run_reference(model64, feeds, ["logits"])["logits"]
    seed = rng.standard_normal(y.shape)
    f32 = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in feeds.items()}
    want = run_reference(gm64, {**feeds, "logits_grad": seed})
    got = run_ort(gm32, {**f32, "logits_grad": seed.astype(np.float32)})
    for k in names:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-3, atol=1e-4 * (1 + np.abs(want[k]).max()),
                                   err_msg=f"{name} {k}")
    jm64 = jvp_model(model64, "logits", params)
    jm32 = jvp_model(model32, "logits", params)
    onnx.checker.check_model(jm32)
    tans = {f"tangent/{p}": rng.standard_normal(numpy_helper.to_array(
        next(t for t in model32.graph.initializer if t.name == p)).shape) for p in params}
    want = run_reference(jm64, {**feeds, **tans})["jvp/logits"]
    got = run_ort(jm32, {**f32, **{k: v.astype(np.float32) for k, v in tans.items()}})["jvp/logits"]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * (1 + np.abs(want).max()), err_msg=name)
    # adjoint identity: <u, J v> = <J^T u, v>
    gres = run_reference(gm64, {**feeds, "logits_grad": seed})
    lhs = float(np.sum(seed * want))
    rhs = sum(float(np.sum(gres[f"grad/{p}"] * tans[f"tangent/{p}"])) for p in params)
    assert abs(lhs - rhs) <= 1e-9 * (1 + abs(lhs))


def test_zoo_intermediate_wrt(zoo_case):
    """extra_wrt: cotangents of intermediate tensors (the K-FAC pre-activations)."""
    name, model32, model64, feeds = zoo_case
    view = GraphView(model64)
    mids = [n.output[0] for n in view.nodes
            if n.op_type in ("Gemm", "Conv", "MatMul", "Add") and n.output[0] != "logits"][:3]
    gm = gradient_model(model64, "logits", [], extra_wrt=mids)
    assert [o.name for o in gm.graph.output] == ["logits"] + [f"grad/{t}" for t in mids]
    y = run_reference(model64, feeds, ["logits"])["logits"]
    seed = np.random.default_rng(2).standard_normal(y.shape)
    res = run_reference(gm, {**feeds, "logits_grad": seed})
    # central differences: perturb the intermediate by adding an input to its consumers
    for t in mids:
        d = res[f"grad/{t}"]
        assert d.shape == tuple(run_reference(_expose(model64, t), feeds, [t])[t].shape)
        v = np.random.default_rng(4).standard_normal(d.shape)
        fd = _fd_through(model64, feeds, t, v, seed)
        assert abs(float(np.sum(d * v)) - fd) <= 1e-6 * (1 + abs(fd)), (name, t)


def _expose(model, t):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(helper.make_tensor_value_info(t, TensorProto.DOUBLE, None))
    return m


def _fd_through(model, feeds, t, v, u, eps=1e-6):
    """d/de <u, f(..., t + e v)> by adding e*v to tensor t (graph input "perturb/t")."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    new = f"{t}/perturbed"
    for node in g.node:
        for i, x in enumerate(node.input):
            if x == t:
                node.input[i] = new
    idx = next(i for i, n in enumerate(g.node) if t in n.output)
    g.node.insert(idx + 1, helper.make_node("Add", [t, "perturb"], [new]))
    g.input.append(value_info("perturb", TensorProto.DOUBLE, list(v.shape)))
    plus = run_reference(m, {**feeds, "perturb": eps * v}, ["logits"])["logits"]
    minus = run_reference(m, {**feeds, "perturb": -eps * v}, ["logits"])["logits"]
    return float(np.sum(u * (plus - minus))) / (2 * eps)


# ------------------------------------------------------------------ pass behaviour
def _mlp():
    """x -> Gemm(W1,b1) -> Relu -> Gemm(W2,b2) = y, plus a side branch z = Shape-based."""
    rng = np.random.default_rng(0)
    W1, b1 = rng.standard_normal((4, 3)), rng.standard_normal(4)
    W2, b2 = rng.standard_normal((2, 4)), rng.standard_normal(2)
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Gemm", ["a", "W2", "b2"], ["y"], name="fc2", transB=1),
        helper.make_node("Shape", ["a"], ["sa"], name="shape"),
        helper.make_node("ConstantOfShape", ["sa"], ["ones"], name="cos",
                         value=numpy_helper.from_array(np.ones(1))),
        helper.make_node("Mul", ["a", "ones"], ["z"], name="side"),
    ]
    inits = [numpy_helper.from_array(v, n) for n, v in [("W1", W1), ("b1", b1), ("W2", W2), ("b2", b2)]]
    g = helper.make_graph(nodes, "mlp", [value_info("x", TensorProto.DOUBLE, ["N", 3])],
                          [value_info("y", TensorProto.DOUBLE, ["N", 2]), value_info("z", TensorProto.DOUBLE, ["N", 4])],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


def test_pruning_and_none():
    m = _mlp()
    view = GraphView(m)
    path, _ = path_nodes(view, ["W2", "b2"], ["y"])
    assert [n.name for n in path] == ["fc2"]
    b = GraphBuilder(17, taken=view.all_names(), float_type=TensorProto.DOUBLE)
    res = backward(b, view, {"y": "gy"}, ["W2", "b2", "W1", "x"])
    assert res["W2"] and res["b2"] and res["W1"]
    assert res["x"] is not None
    # no path from b2 to z; nothing emitted for the side branch
    b2 = GraphBuilder(17, taken=view.all_names(), float_type=TensorProto.DOUBLE)
    res = backward(b2, view, {"z": "gz"}, ["b2"])
    assert res == {"b2": None} and not b2.nodes
    # only W2 needed: the input cotangent of fc2 (dA) is not emitted
    b3 = GraphBuilder(17, taken=view.all_names(), float_type=TensorProto.DOUBLE)
    backward(b3, view, {"y": "gy"}, ["W2"])
    assert len(b3.nodes) == 1 and b3.nodes[0].op_type == "Gemm"


def test_repeated_backward_same_builder():
    """One backward per seed (data targets, sampled targets, ...) on one builder."""
    m = _mlp()
    view = GraphView(m)
    b = GraphBuilder(17, taken=view.all_names(), float_type=TensorProto.DOUBLE)
    wrt = ["W1", "b1", "W2", "b2", "h"]
    r1 = backward(b, view, {"y": "g1"}, wrt)
    r2 = backward(b, view, {"y": "g2"}, wrt)
    r3 = backward(b, view, {"y": "g1", "z": "gz"}, wrt)
    outs = []
    for k, r in enumerate((r1, r2, r3)):
        for w in wrt:
            b.identity(r[w], f"out{k}/{w}")
            outs.append(value_info(f"out{k}/{w}", TensorProto.DOUBLE, None))
    ins = list(m.graph.input) + [value_info(n, TensorProto.DOUBLE, ["N", k]) for n, k in (("g1", 2), ("g2", 2), ("gz", 4))]
    full = b.make_model("multi", ins, outs, base_nodes=m.graph.node, base_initializers=m.graph.initializer)
    names = [n.name for n in full.graph.node]
    assert len(names) == len(set(names))
    assert sum(n.op_type == "Relu" for n in full.graph.node) == 1  # forward not recomputed
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((5, 3)), "g1": rng.standard_normal((5, 2)),
             "g2": rng.standard_normal((5, 2)), "gz": rng.standard_normal((5, 4))}
    res = run_reference(full, feeds)
    ref = gradient_model(m, "y", ["W1", "b1", "W2", "b2"], extra_wrt=["h"])
    for k, seed in ((0, "g1"), (1, "g2")):
        want = run_reference(ref, {"x": feeds["x"], "y_grad": feeds[seed]})
        for w in wrt:
            np.testing.assert_allclose(res[f"out{k}/{w}"], want[f"grad/{w}"], rtol=1e-12, atol=1e-12)
    # two seeds add up: z = relu(h) * 1 contributes through a
    gz = feeds["gz"] * (run_reference(_expose(m, "h"), {"x": feeds["x"]}, ["h"])["h"] > 0)
    np.testing.assert_allclose(res["out2/h"], res["out0/h"] + gz, rtol=1e-12, atol=1e-12)


def test_shared_weight_accumulates():
    """A weight used by several nodes (unrolled RNN, tied embeddings) sums all paths; the
    unrolled RNN's per-step Gemm gradients become one Gemm of the concatenated operands (its
    values: test_zoo_gradients_fd)."""
    for name in ("unrolled_rnn", "transformer_block"):
        model = get_model(name)
        view = GraphView(model)
        b = GraphBuilder(view.opset, taken=view.all_names())
        w = "rnn.W_x" if name == "unrolled_rnn" else "tok_emb"
        res = backward(b, view, {"logits": "g"}, [w])
        total = next(n for n in b.nodes if res[w] in n.output)
        if name == "unrolled_rnn":  # 8 steps: one Gemm [steps*N, F]^T [steps*N, H] plus nothing else
            producer = {o: n for n in b.nodes for o in n.output}
            assert total.op_type == "Gemm" and [producer[i].op_type for i in total.input] == ["Concat"] * 2
            assert [len(producer[i].input) for i in total.input] == [8, 8]
        else:
            assert total.op_type in ("Sum", "Add")


def test_unsupported_op_is_one_line_and_early():
    x = value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
             helper.make_node("MaxRoiPool", ["h", "rois"], ["e"], name="weird/roi", pooled_shape=[4, 4]),
             helper.make_node("Mul", ["e", "s"], ["y"], name="scale")]
    g = helper.make_graph(nodes, "g", [x], [value_info("y", TensorProto.FLOAT, [2, 3, 4, 4])],
                          initializer=[numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W"),
                                       numpy_helper.from_array(np.ones(4, np.float32), "s"),
                                       numpy_helper.from_array(np.asarray([[0, 0, 0, 3, 3], [1, 1, 1, 2, 3]],
                                                                          np.float32), "rois")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    view = GraphView(m)
    b = GraphBuilder(17, taken=view.all_names())
    with pytest.raises(UnsupportedOpError) as ei:
        backward(b, view, {"y": "gy"}, ["W", "s"])
    msg = str(ei.value)
    assert "\n" not in msg and "'weird/roi'" in msg and "op MaxRoiPool (domain ai.onnx, opset 17)" in msg
    assert "(--exclude W)" in msg and "docs/extending.md" in msg  # s does not reach it
    assert not b.nodes  # nothing emitted before the check
    with pytest.raises(UnsupportedOpError, match=r"weird/roi.*--exclude W\)"):
        jvp(b, view, {"W": "tW", "s": "ts"}, ["y"])
    assert not b.nodes
    # an unsupported op off the path is fine
    res = backward(b, view, {"y": "gy"}, ["s"])
    assert res["s"] is not None


def test_unsupported_attribute_is_reported_before_emitting():
    x = value_info("x", TensorProto.FLOAT, [2, 3])
    node = helper.make_node("Pad", ["x", "p"], ["y"], name="pad/reflect", mode="reflect")
    g = helper.make_graph([node], "g", [x], [value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray([0, 1, 0, 1], np.int64), "p")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    view = GraphView(m)
    b = GraphBuilder(17, taken=view.all_names())
    with pytest.raises(UnsupportedOpError, match="pad/reflect.*reflect"):
        backward(b, view, {"y": "gy"}, ["x"])
    assert not b.nodes
    # forward mode is linear for any pad mode
    assert jvp(b, view, {"x": "tx"}, ["y"])["y"] is not None


def test_gradient_model_errors():
    m = _mlp()
    with pytest.raises(ModelError):
        gradient_model(m, "nope", ["W1"])
    with pytest.raises(ModelError):
        gradient_model(m, "y", ["nope"])
    # a parameter with no path gets zeros
    gm = gradient_model(m, "z", ["W2"])
    res = run_reference(gm, {"x": np.ones((2, 3)), "z_grad": np.ones((2, 4))})
    assert res["grad/W2"].shape == (2, 4) and not res["grad/W2"].any()


def test_opset_13_to_max_forms():
    """The same model at the lowest, a middle and the highest supported opsets (Reduce/Squeeze
    forms; ops re-versioned in 21, 23-25 for new types)."""
    from kfac_compiler.builder import MAX_OPSET

    for opset in (13, 22, 23, MAX_OPSET):
        rng = np.random.default_rng(0)
        nodes = [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Softmax", ["h"], ["p"], axis=-1),
            helper.make_node("ReduceSum", ["p", "ax"], ["s"], keepdims=0),
            helper.make_node("Unsqueeze", ["s", "ax"], ["u"]),
            helper.make_node("Mul", ["u", "h"], ["y"]),
        ]
        g = helper.make_graph(nodes, "g", [value_info("x", TensorProto.DOUBLE, ["N", 3])],
                              [value_info("y", TensorProto.DOUBLE, None)],
                              initializer=[numpy_helper.from_array(rng.standard_normal((3, 4)), "W"),
                                           numpy_helper.from_array(np.asarray([0], np.int64), "ax")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 8
        m = onnx.shape_inference.infer_shapes(m)
        rep = fd_check(m, {"x": rng.standard_normal((2, 3))}, wrt=["W", "x"])
        assert rep.ok, f"opset {opset}: {rep}"
        gm = convert_float_type(gradient_model(m, "y", ["W"]), TensorProto.FLOAT)
        run_ort(gm, {"x": np.ones((2, 3), np.float32), "y_grad": np.ones((2, 4), np.float32)})


@pytest.mark.parametrize("batch", [5, "N"])
def test_dense_bias_gradient_is_the_column_sum(batch):
    """y = x W + b: grad b = sum over rows of dL/dy (emitted as ones @ g, a static ones row
    for a fixed batch, ConstantOfShape for a symbolic one), grad W = x^T dL/dy; ORT float32
    against the hand-computed values."""
    rng = np.random.default_rng(4)
    W, bias = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    g = helper.make_graph(nodes, "dense", [value_info("x", TensorProto.FLOAT, [batch, 3])],
                          [value_info("y", TensorProto.FLOAT, [batch, 4])],
                          initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(bias, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    gm = gradient_model(onnx.shape_inference.infer_shapes(m), "y", ["W", "b"])
    x = rng.standard_normal((5, 3)).astype(np.float32)
    gy = rng.standard_normal((5, 4)).astype(np.float32)
    got = run_ort(gm, {"x": x, "y_grad": gy})
    np.testing.assert_allclose(got["grad/b"], gy.astype(np.float64).sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["grad/W"], x.T.astype(np.float64) @ gy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [5, "N"])
def test_multi_use_dense_gradients_fuse(batch):
    """A dense layer applied to three inputs (an unrolled RNN's weight and bias): the three
    weight gradients x_k^T g_k become one Gemm of the concatenated operands, the three bias
    column sums one Gemm of one ones row and the concatenated cotangents (no Sum, no per-use
    product, no per-use ones row at a symbolic batch);
    ORT float32 against the hand-computed sums."""
    rng = np.random.default_rng(5)
    W, bias = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    nodes = []
    for k in range(3):
        nodes += [helper.make_node("MatMul", [f"x{k}", "W"], [f"h{k}"]), helper.make_node("Add", [f"h{k}", "b"], [f"y{k}"])]
    nodes.append(helper.make_node("Concat", ["y0", "y1", "y2"], ["y"], axis=0))
    g = helper.make_graph(nodes, "dense3", [value_info(f"x{k}", TensorProto.FLOAT, [batch, 3]) for k in range(3)],
                          [value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(bias, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    gm = gradient_model(onnx.shape_inference.infer_shapes(m), "y", ["W", "b"])
    ops = [n.op_type for n in gm.graph.node]
    assert ops.count("Gemm") == 2 and "Sum" not in ops and "MatMul" in ops  # the forward's MatMuls only
    assert ops.count("ConstantOfShape") == (batch == "N")  # one ones row over the three uses' rows
    producer = {o: n for n in gm.graph.node for o in n.output}
    dW = producer[producer["grad/W"].input[0]]
    # the uses' operands in the forward's order (the order a Split's gradient concatenates)
    assert dW.op_type == "Gemm" and list(producer[dW.input[0]].input) == ["x0", "x1", "x2"]
    xs = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(3)]
    gy = rng.standard_normal((15, 4)).astype(np.float32)
    got = run_ort(gm, {**{f"x{k}": xs[k] for k in range(3)}, "y_grad": gy})
    gk = np.split(gy.astype(np.float64), 3)
    np.testing.assert_allclose(got["grad/b"], gy.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["grad/W"], sum(x.T.astype(np.float64) @ g for x, g in zip(xs, gk)),
                               rtol=1e-5, atol=1e-5)
