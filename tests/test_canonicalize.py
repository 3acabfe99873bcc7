"""canonicalize / trainable_params / recognise_loss."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import onnx_model, run_model
from kfac_compiler.builder import IR_VERSION
from kfac_compiler.errors import ConfigError, ModelError, UnsupportedOpError
from kfac_compiler.frontend import compile_frontend
from kfac_compiler.graph import GraphView
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.passes.canonicalize import canonicalize, recognise_loss
from kfac_compiler.passes.trainable import trainable_params

F = TensorProto.FLOAT


def const(name, value):
    return helper.make_node("Constant", [], [name], name=f"{name}/const", value=numpy_helper.from_array(np.asarray(value), name))


def ops(model):
    return [n.op_type for n in model.graph.node]


W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10


def test_input_is_not_mutated_and_ir_version_is_pinned():
    m = get_model("transformer_block")
    m.ir_version = 9
    before = m.SerializeToString()
    c = canonicalize(m, "logits")
    assert m.SerializeToString() == before
    assert c.ir_version == IR_VERSION
    assert [o.name for o in c.graph.output] == ["logits"]


def test_nodes_get_unique_names():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Relu", ["r"], ["r2"], name="dup"),
        helper.make_node("Relu", ["r2"], ["r3"], name="dup"),
        helper.make_node("Relu", ["r3"], ["y"], name="W"),  # clashes with the initializer
    ]
    c = canonicalize(onnx_model(nodes, {"x": ["N", 4]}, {"W": W}), "y")
    names = [n.name for n in c.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert "W" not in names and names.count("dup") == 1
    GraphView(c).to_networkx()  # one vertex per node and per initializer


def test_identity_cast_dropout_collapse():
    nodes = [
        helper.make_node("Identity", ["x"], ["x1"], name="id0"),
        helper.make_node("Cast", ["x1"], ["x2"], name="cast_noop", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x2", "W"], ["h"], name="mm"),
        helper.make_node("Dropout", ["h"], ["d"], name="drop"),
        helper.make_node("Cast", ["d"], ["dd"], name="cast_real", to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["dd"], ["d2"], name="cast_back", to=TensorProto.FLOAT),
        helper.make_node("Identity", ["d2"], ["y"], name="id_out"),
    ]
    m = onnx_model(nodes, {"x": ["N", 4]}, {"W": W})
    c = canonicalize(m, "y")
    assert ops(c) == ["MatMul", "Cast", "Cast"]
    assert c.graph.node[0].input[0] == "x"
    assert c.graph.node[-1].output[0] == "y"  # output name kept: the producer was renamed
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(run_model(c, {"x": x}), run_model(m, {"x": x}), rtol=1e-6)


def test_identity_from_input_to_output_is_kept():
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Identity", ["x"], ["y"], name="id")]
    m = onnx_model(nodes, {"x": ["N", 4]}, {"W": W}, outputs=("y", "h"))
    c = canonicalize(m, "y")
    assert ops(c) == ["Identity"]


def test_dropout_kept_when_training_or_mask_used():
    train = const("t", np.array(True))
    nodes = [train, helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Dropout", ["h", "", "t"], ["y"], name="drop")]
    assert "Dropout" in ops(canonicalize(onnx_model(nodes, {"x": ["N", 4]}, {"W": W}), "y"))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Dropout", ["h"], ["d", "mask"], name="drop"),
             helper.make_node("Cast", ["mask"], ["mf"], name="c", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["d", "mf"], ["y"], name="mul")]
    assert "Dropout" in ops(canonicalize(onnx_model(nodes, {"x": ["N", 4]}, {"W": W}), "y"))
    false = const("f", np.array(False))
    nodes = [false, helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Dropout", ["h", "", "f"], ["y"], name="drop")]
    assert ops(canonicalize(onnx_model(nodes, {"x": ["N", 4]}, {"W": W}), "y")) == ["MatMul"]


def test_constant_subgraphs_are_folded_but_float_initializers_never():
    nodes = [
        const("c_a", np.array([2], np.int64)),
        helper.make_node("Mul", ["c_a", "three"], ["prod"], name="shape_mul"),  # int initializer
        helper.make_node("Concat", ["minus1", "prod"], ["shape"], name="shape_cat", axis=0),
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Reshape", ["h", "shape"], ["r"], name="reshape"),
        const("two", np.array(2.0, np.float32)),
        helper.make_node("Mul", ["scale", "two"], ["scale2"], name="scale_mul"),  # float init: kept
        helper.make_node("Mul", ["r", "scale2"], ["y"], name="out"),
    ]
    inits = {"W": np.ones((4, 6), np.float32), "three": np.array([3], np.int64),
             "minus1": np.array([-1], np.int64), "scale": np.float32(0.5)}
    m = onnx_model(nodes, {"x": ["N", 4]}, inits)
    c = canonicalize(m, "y")
    assert "Concat" not in ops(c) and "shape_mul" not in [n.name for n in c.graph.node]
    view = GraphView(c)
    assert view.producer["shape"].op_type == "Constant"
    np.testing.assert_array_equal(view.constant_value("shape"), [-1, 6])
    assert "scale_mul" in [n.name for n in c.graph.node]
    assert {t.name for t in c.graph.initializer} == {"W", "scale"}  # int initializers folded away
    assert view.shape("r") == (None, 6) or view.shape("r")[-1] == 6  # data_prop / folding gives the shape
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run_model(c, {"x": x}), run_model(m, {"x": x}), rtol=1e-6)


def _two_round_shape_model():
    """x [N, 4, 6] @ W [6, 6] = h, r = Reshape(h, [-1, 6 / 2]) (Div: ONNX's data propagation
    stops there, so r's width is known only once [-1, 3] is a constant), y = Reshape(r, [-1,
    8 * width(r)]): y's shape arithmetic reads r's dims, static only after a second shape
    inference."""
    nodes = [
        helper.make_node("MatMul", ["x", "W6"], ["h"], name="mm"),
        helper.make_node("Shape", ["h"], ["h_shape"], name="h_shape"),
        helper.make_node("Gather", ["h_shape", "two"], ["h_width"], name="h_width", axis=0),
        helper.make_node("Div", ["h_width", "two"], ["half"], name="half"),
        helper.make_node("Unsqueeze", ["half", "zero"], ["half1"], name="half1"),
        helper.make_node("Concat", ["minus1", "half1"], ["shape1"], name="shape1", axis=0),
        helper.make_node("Reshape", ["h", "shape1"], ["r"], name="r"),
        helper.make_node("Shape", ["r"], ["r_shape"], name="r_shape"),
        helper.make_node("Gather", ["r_shape", "one"], ["r_width"], name="r_width", axis=0),
        helper.make_node("Mul", ["r_width", "eight"], ["wide"], name="wide"),
        helper.make_node("Unsqueeze", ["wide", "zero"], ["wide1"], name="wide1"),
        helper.make_node("Concat", ["minus1", "wide1"], ["shape2"], name="shape2", axis=0),
        helper.make_node("Reshape", ["r", "shape2"], ["y"], name="y"),
    ]
    ints = {k: np.array(v, np.int64) for k, v in
            {"two": 2, "one": 1, "eight": 8, "zero": [0], "minus1": [-1]}.items()}
    W6 = np.arange(36, dtype=np.float32).reshape(6, 6) / 36
    return onnx_model(nodes, {"x": ["N", 4, 6]}, {"W6": W6, **ints})


def test_shape_arithmetic_is_folded_to_a_fixed_point():
    """One round of static-dim and constant folding leaves y's shape arithmetic (it reads r's
    width, which only the shape inference after the round knows); canonicalize folds rounds
    until none removes a node: both Reshapes read constants [-1, 3] and [-1, 24], y is [N, 24]
    and computes what the source does."""
    from kfac_compiler.passes.canonicalize import fold_to_fixed_point, infer_shapes

    m = _two_round_shape_model()
    one = fold_to_fixed_point(infer_shapes(m, keep_going=True), "y", rounds=1)
    assert {"Shape", "Gather", "Mul", "Concat"} <= set(ops(one)) and "Div" not in ops(one)
    c = canonicalize(m, "y")
    assert [op for op in ops(c) if op != "Constant"] == ["MatMul", "Reshape", "Reshape"]
    view = GraphView(c)
    np.testing.assert_array_equal(view.constant_value("shape1"), [-1, 3])
    np.testing.assert_array_equal(view.constant_value("shape2"), [-1, 24])
    assert view.shape("y") == (None, 24) or view.shape("y")[1] == 24
    x = np.random.default_rng(0).standard_normal((2, 4, 6)).astype(np.float32)
    got, want = run_model(c, {"x": x}), run_model(m, {"x": x})
    assert np.shape(got) == (2, 24)
    np.testing.assert_array_equal(got, want)


def test_restrict_to_output_drops_dead_code_and_unused_inputs():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
        helper.make_node("Sigmoid", ["h"], ["z"], name="sig"),
        helper.make_node("Add", ["z", "other"], ["w"], name="add"),
        helper.make_node("Tanh", ["x"], ["dead"], name="dead"),
    ]
    m = onnx_model(nodes, {"x": ["N", 4], "other": ["N", 3]}, {"W": W, "V": np.ones(3, np.float32)}, outputs=("y", "w"))
    c = canonicalize(m, "h")
    assert ops(c) == ["MatMul"]
    assert [o.name for o in c.graph.output] == ["h"]
    assert [i.name for i in c.graph.input] == ["x"]
    assert [t.name for t in c.graph.initializer] == ["W"]
    assert GraphView(c).shape("h") == ("N", 3)


def test_value_info_has_shapes_and_canonicalize_is_idempotent():
    c = canonicalize(get_model("small_cnn"), "logits")
    view = GraphView(c)
    assert view.shape("pool1/MaxPool:0") == ("N", 8, 4, 4)
    again = canonicalize(c, "logits")
    assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in again.graph.node] == [
        (n.name, n.op_type, list(n.input), list(n.output)) for n in c.graph.node]


@pytest.mark.parametrize("name", list(ZOO))
def test_canonical_zoo_models_compute_the_same(name):
    entry = ZOO[name]
    m = entry.build()
    c = canonicalize(m, "logits")
    inputs, _ = entry.make_data(n=5)
    np.testing.assert_allclose(run_model(c, inputs), run_model(m, inputs), rtol=1e-5, atol=1e-6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 4), width=st.integers(1, 6), noise=st.lists(st.sampled_from(["Identity", "Cast", "Dropout", "none"]), min_size=4, max_size=4))
def test_canonicalize_preserves_random_mlps(depth, width, noise):
    rng = np.random.default_rng(depth * 10 + width)
    nodes, inits, x = [], {}, "x"
    d_in = 3
    for i in range(depth):
        inits[f"l{i}.weight"] = rng.standard_normal((d_in, width)).astype(np.float32)
        nodes.append(helper.make_node("MatMul", [x, f"l{i}.weight"], [f"m{i}"], name=f"l{i}/mm"))
        x = f"m{i}"
        kind = noise[i % len(noise)]
        if kind != "none":
            attrs = {"to": TensorProto.FLOAT} if kind == "Cast" else {}
            nodes.append(helper.make_node(kind, [x], [f"n{i}"], **attrs))
            x = f"n{i}"
        nodes.append(helper.make_node("Tanh", [x], [f"t{i}"], name=f"l{i}/tanh"))
        x, d_in = f"t{i}", width
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    m = onnx_model(nodes, {"x": ["N", 3]}, inits)
    c = canonicalize(m, "y")
    assert "Identity" not in ops(c) and "Dropout" not in ops(c)
    assert trainable_params(c, "y")[0] == [f"l{i}.weight" for i in range(depth)]
    xv = rng.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(run_model(c, {"x": xv}), run_model(m, {"x": xv}), rtol=1e-6)


# ----------------------------------------------------------------- trainable params
def test_trainable_params_include_exclude():
    c = canonicalize(get_model("mlp_classifier"), "logits")
    all_p = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert trainable_params(c, "logits") == (all_p, [])
    tr, fr = trainable_params(c, "logits", exclude=[r".*\.bias"])
    assert tr == ["fc1.weight", "fc2.weight", "fc3.weight"] and fr == ["fc1.bias", "fc2.bias", "fc3.bias"]
    tr, fr = trainable_params(c, "logits", include=["fc3.weight", r"fc2\..*"], exclude=["fc2.bias"])
    assert tr == ["fc2.weight", "fc3.weight"]
    assert fr == ["fc1.weight", "fc1.bias", "fc2.bias", "fc3.bias"]
    # parameters that do not reach the output are neither
    tr, fr = trainable_params(c, "fc1/Gemm:0")
    assert (tr, fr) == (["fc1.weight", "fc1.bias"], [])


def test_trainable_params_errors():
    c = canonicalize(get_model("mlp_classifier"), "logits")
    with pytest.raises(ConfigError, match=r"bad regular expression '\(fc'"):
        trainable_params(c, "logits", exclude=["(fc"])
    with pytest.raises(ConfigError, match="include: 'fc9.*' matches no float initializer"):
        trainable_params(c, "logits", include=["fc9.*"])
    with pytest.raises(ConfigError, match="no trainable parameters"):
        trainable_params(c, "logits", exclude=[".*"])


def test_batch_norm_running_stats_never_trainable():
    c = canonicalize(get_model("depthwise_cnn"), "logits")
    tr, fr = trainable_params(c, "logits", include=[r"bn1\..*"])
    assert tr == ["bn1.scale", "bn1.bias"]
    assert "bn1.running_mean" in fr and "bn1.running_var" in fr


# ------------------------------------------------------------------------ losses
def _with_sce(model):
    g = model.graph
    g.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]))
    g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="loss/sce",
                                   reduction="mean"))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", F, []))
    return model


def test_recognise_softmax_cross_entropy_loss():
    m = _with_sce(get_model("mlp_classifier"))
    rec = recognise_loss(m, "loss")
    assert (rec.kind, rec.scores, rec.target_input, rec.op) == ("softmax_cross_entropy", "logits", "labels", "SoftmaxCrossEntropyLoss")
    plan = compile_frontend(m, None)
    assert plan.output == "logits" and plan.loss.kind == "softmax_cross_entropy"
    assert plan.loss.recognised_from == "SoftmaxCrossEntropyLoss"
    assert plan.targets.from_input == "labels" and plan.targets.dtype == "int64"
    assert [i.name for i in plan.inputs] == ["input"]
    assert [l.name for l in plan.layers] == ["fc1", "fc2", "fc3"]
    # the same loss kind may be given; another one is an error
    assert compile_frontend(m, "softmax_cross_entropy").output == "logits"
    with pytest.raises(ConfigError, match="ends in a SoftmaxCrossEntropyLoss loss .* but loss 'squared_error'"):
        compile_frontend(m, "squared_error")


def test_recognise_nll_of_log_softmax():
    m = get_model("mlp_classifier")
    g = m.graph
    g.input.append(helper.make_tensor_value_info("y", TensorProto.INT64, ["N"]))
    g.node.extend([helper.make_node("LogSoftmax", ["logits"], ["lp"], name="lsm", axis=1),
                   helper.make_node("NegativeLogLikelihoodLoss", ["lp", "y"], ["loss"], name="nll")])
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", F, []))
    rec = recognise_loss(m, "loss")
    assert (rec.kind, rec.scores, rec.target_input) == ("softmax_cross_entropy", "logits", "y")


@pytest.mark.parametrize("square", ["Mul", "Pow"])
@pytest.mark.parametrize("pred_first", [True, False])
def test_recognise_mean_squared_error(square, pred_first):
    m = get_model("digits_autoencoder")
    g = m.graph
    g.input.append(helper.make_tensor_value_info("target", F, ["N", 64]))
    sub = ["logits", "target"] if pred_first else ["target", "logits"]
    nodes = [helper.make_node("Sub", sub, ["d"], name="sub")]
    if square == "Mul":
        nodes.append(helper.make_node("Mul", ["d", "d"], ["d2"], name="sq"))
    else:
        nodes += [const("p2", np.array(2.0, np.float32)), helper.make_node("Pow", ["d", "p2"], ["d2"], name="sq")]
    nodes.append(helper.make_node("ReduceMean", ["d2"], ["mse"], name="mse", keepdims=0))
    g.node.extend(nodes)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("mse", F, []))
    rec = recognise_loss(m, "mse")
    assert (rec.kind, rec.scores, rec.target_input) == ("squared_error", "logits", "target")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile_frontend(m, None, config={"loss_variance": 0.5})
    assert plan.loss.kind == "squared_error" and plan.loss.options["variance"] == 0.5
    assert plan.targets.to_json() == {"name": "targets", "shape": ["N", 64], "dtype": "float32", "from_input": "target"}


def test_scalar_output_without_recognised_loss_is_an_error():
    m = get_model("mlp_classifier")
    g = m.graph
    g.node.append(helper.make_node("ReduceSum", ["logits"], ["s"], name="rs", keepdims=0))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("s", F, []))
    with pytest.raises(ModelError, match="output 's' is a scalar"):
        compile_frontend(m, "squared_error")
    with pytest.raises(ConfigError, match="no loss given"):
        compile_frontend(m, None)


def test_sce_with_classes_not_last_is_rejected():
    m = get_model("transformer_block")
    g = m.graph
    g.node.append(helper.make_node("Transpose", ["logits"], ["scores"], name="tr", perm=[0, 2, 1]))
    g.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N", 8]))
    g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], name="sce"))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", F, []))
    with pytest.raises(UnsupportedOpError, match="class axis last"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile_frontend(m, None)


def test_split_to_sequence_with_a_chunk_read_twice_has_the_hand_computed_gradient():
    """torch.split in a torch.export graph without the exporter's optimizer: SplitToSequence
    read by SequenceAt at constant positions becomes Split. Two readers of one chunk (positions
    0 and -2 of 2) lost the first reader's tensor (ONNX Runtime: 'Node input ... is not an
    output of a previous node'); now both read it. out = a * b + a with a, b = x * P split in
    two along axis 1; squared error, so dL/dP = 1/N sum_n r * (b + 1) * x_a | r * a * x_b."""
    import kfac_compiler as kc
    from kfac_compiler.runtime import gradients

    rng = np.random.default_rng(0)
    P = rng.normal(size=(4, 3))
    ints = {"sp": [2, 2], "p0": 0, "p1": 1, "p2": -2}
    nodes = [helper.make_node("Mul", ["input", "P"], ["h"]),
             helper.make_node("SplitToSequence", ["h", "sp"], ["s"], axis=1),
             helper.make_node("SequenceAt", ["s", "p0"], ["a"]), helper.make_node("SequenceAt", ["s", "p1"], ["b"]),
             helper.make_node("SequenceAt", ["s", "p2"], ["a2"]),
             helper.make_node("Mul", ["a", "b"], ["ab"]), helper.make_node("Add", ["ab", "a2"], ["out"])]
    inits = [numpy_helper.from_array(P.astype(np.float32), "P")]
    inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    model = helper.make_model(helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 2, 3])], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    x, y = rng.normal(size=(5, 4, 3)), rng.normal(size=(5, 2, 3))
    plan = kc.compile(model, loss="squared_error", output="out", emit=False)
    loss, grads = gradients(plan, {"input": x.astype(np.float32)}, y.astype(np.float32))
    a, b = x[:, :2] * P[:2], x[:, 2:] * P[2:]
    r = a * b + a - y
    assert loss == pytest.approx(0.5 * np.sum(r ** 2) / 5, rel=1e-5)
    want = np.concatenate([np.sum(r * (b + 1) * x[:, :2], 0), np.sum(r * a * x[:, 2:], 0)]) / 5
    np.testing.assert_allclose(grads["P"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["Cast", "Identity"])
def test_a_no_op_read_inside_an_if_body_keeps_its_name(op):
    """A no-op Cast or Identity of a weight read only inside an If body: the no-op collapse
    renamed the tensor in the top graph but not in the bodies, which then read a name that no
    longer existed (the weight vanished from the plan: ONNX Runtime's InvalidGraph, or 'no
    trainable parameters'). The name stays, and the weight read inside the body gets the
    documented one-line control-flow error."""
    rng = np.random.default_rng(0)
    noop = (helper.make_node("Cast", ["W"], ["Wc"], to=TensorProto.FLOAT) if op == "Cast"
            else helper.make_node("Identity", ["W"], ["Wc"]))
    branch = [helper.make_graph([helper.make_node("MatMul", ["x", "Wc"], [o])], o, [],
                                [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)]) for o in ("t", "e")]
    model = helper.make_model(helper.make_graph(
        [noop, helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=branch[0], else_branch=branch[1]),
         helper.make_node("Add", ["z", "b"], ["logits"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array(True), "cond"),
         numpy_helper.from_array(rng.normal(size=3).astype(np.float32), "b")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    view_model = canonicalize(model, "logits")
    assert any(n.op_type == op for n in view_model.graph.node)  # kept: the body reads its output
    with pytest.raises(UnsupportedOpError, match=r"node 'branch' \(If\) reads 'Wc' inside its (then|else)_branch .*'W'") as e:
        compile_frontend(model, loss="softmax_cross_entropy", output="logits")
    assert "\n" not in str(e.value)


def test_same_auto_pad_with_dilations_becomes_explicit_pads():
    """TorchScript writes Conv1d(padding="same", dilation=2) as auto_pad SAME_UPPER with
    dilations [2], which ONNX Runtime's CPU Conv refuses at run time (the gradients and the
    first step died with its traceback). The canonical Conv carries the explicit pads [2, 2]
    instead, and the gradients equal those of the same model written with those pads."""
    import kfac_compiler as kc
    from kfac_compiler.runtime import gradients

    rng = np.random.default_rng(0)
    k, w = rng.normal(size=(2, 3, 3)).astype(np.float32), rng.normal(size=(4, 2 * 7)).astype(np.float32)

    def model(**pad):
        nodes = [helper.make_node("Conv", ["input", "k"], ["c"], dilations=[2], **pad),
                 helper.make_node("Flatten", ["c"], ["f"]), helper.make_node("Gemm", ["f", "w"], ["out"], transB=1)]
        m = helper.make_model(helper.make_graph(
            nodes, "t", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 7])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4])],
            [numpy_helper.from_array(k, "k"), numpy_helper.from_array(w, "w")]), opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = IR_VERSION
        return m

    same, explicit = model(auto_pad="SAME_UPPER"), model(pads=[2, 2])
    conv = next(n for n in canonicalize(same, "out").graph.node if n.op_type == "Conv")
    attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    assert "auto_pad" not in attrs and attrs["pads"] == [2, 2]
    x, y = rng.normal(size=(5, 3, 7)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)
    got, want = (gradients(kc.compile(m, loss="squared_error", output="out", emit=False), {"input": x}, y)
                 for m in (same, explicit))
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for p in ("k", "w"):
        np.testing.assert_allclose(got[1][p], want[1][p], rtol=1e-5, atol=1e-6)
