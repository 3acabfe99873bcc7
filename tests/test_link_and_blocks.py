"""link_params (weight sharing, biases, tied parameters, user links, names) and choose_blocks."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers import onnx_model, randn
from kfac_compiler.blocks import APPROXIMATIONS
from kfac_compiler.config import CompileConfig
from kfac_compiler.errors import ConfigError
from kfac_compiler.frontend import compile_frontend
from kfac_compiler.graph import GraphView
from kfac_compiler.ir import Layer, LayerUse
from kfac_compiler.models import get_model
from kfac_compiler.passes.canonicalize import canonicalize
from kfac_compiler.passes.choose_blocks import allowed_approximations, choose_blocks
from kfac_compiler.passes.link_params import layer_base_names, link_params
from kfac_compiler.passes.match_layers import match_layers
from kfac_compiler.passes.trainable import trainable_params


def link(model, output="y", links=(), config=None):
    canon = canonicalize(model, output)
    tr, _ = trainable_params(canon, output)
    view = GraphView(canon)
    layers = link_params(match_layers(canon, tr, view=view), tr, links, view=view)
    return choose_blocks(layers, config)


def table(layers):
    return [(l.name, l.kind, l.params, l.num_uses, l.approximation) for l in layers]


def shared_weight_model(rng, bias2="b"):
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h1"], name="mm1"),
        helper.make_node("Add", ["h1", "b"], ["a1"], name="add1"),
        helper.make_node("Tanh", ["a1"], ["t1"], name="t1"),
        helper.make_node("MatMul", ["t1", "W"], ["h2"], name="mm2"),
        helper.make_node("Add", ["h2", bias2], ["y"], name="add2"),
    ]
    inits = {"W": randn(rng, 4, 4), "b": randn(rng, 4)}
    if bias2 != "b":
        inits[bias2] = randn(rng, 4)
    return onnx_model(nodes, {"x": ["N", 4]}, inits)


def test_same_weight_same_bias_is_one_multi_use_layer(rng):
    layers = link(shared_weight_model(rng))
    assert table(layers) == [("W", "fully_connected", ("W", "b"), 2, "kron_indep")]
    assert [u.nodes for u in layers[0].uses] == [("mm1", "add1"), ("mm2", "add2")]


def test_same_weight_different_biases_releases_the_biases(rng):
    layers = link(shared_weight_model(rng, "b2"))
    assert table(layers) == [
        ("W", "fully_connected", ("W",), 2, "kron_indep"),
        ("b", "broadcast", ("b",), 1, "diagonal"),  # released biases added to the data
        ("b2", "broadcast", ("b2",), 1, "diagonal"),
    ]
    # the bias Adds are trimmed from the weight's uses
    assert [u.nodes for u in layers[0].uses] == [("mm1",), ("mm2",)]
    assert [u.output for u in layers[0].uses] == ["h1", "h2"]
    assert any("'b'" in n for n in layers[0].notes)


def test_bias_shared_by_two_weights_is_released(rng):
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"),
        helper.make_node("Add", ["h1", "b"], ["a1"], name="add1"),
        helper.make_node("MatMul", ["a1", "W2"], ["h2"], name="mm2"),
        helper.make_node("Add", ["h2", "b"], ["y"], name="add2"),
    ]
    inits = {"W1": randn(rng, 4, 4), "W2": randn(rng, 4, 4), "b": randn(rng, 4)}
    layers = link(onnx_model(nodes, {"x": ["N", 4]}, inits))
    assert table(layers) == [
        ("W1", "fully_connected", ("W1",), 1, "kron"),
        ("b", "broadcast", ("b",), 2, "diagonal"),  # added to the data twice: one broadcast layer
        ("W2", "fully_connected", ("W2",), 1, "kron"),
    ]


def test_tied_embedding_and_head_become_one_tied_embedding_layer_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layers = link(canonicalize(get_model("transformer_block"), "logits"), "logits")
    tok = layers[0]
    assert (tok.name, tok.kind, tok.params, tok.num_uses, tok.approximation) == ("tok_emb", "tied_embedding", ("tok_emb",), 2, "diagonal")
    assert tok.attrs["use_kinds"] == ("embedding", "fully_connected")
    assert (tok.attrs["vocab"], tok.attrs["dim"]) == (17, 16)


def test_parameter_shared_across_other_kinds_becomes_one_generic_layer_with_a_warning(rng):
    # a lookup and an "in_out" MatMul of the same table: not the tied pair (the head would
    # read the table as [in, out]), so the generic layer and the warning remain
    nodes = [
        helper.make_node("Gather", ["W", "ids"], ["e"], name="g", axis=0),
        helper.make_node("MatMul", ["e", "W"], ["y"], name="mm"),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])
    with pytest.warns(UserWarning, match=r"parameter 'W' is used as embedding and fully_connected"):
        layers = link(onnx_model(nodes, {"ids": ids}, {"W": randn(rng, 4, 4)}))
    assert table(layers) == [("W", "generic", ("W",), 2, "diagonal")]
    assert layers[0].attrs["shared_kinds"] == ("embedding", "fully_connected")


def test_same_kind_with_different_attributes_is_generic(rng):
    nodes = [
        helper.make_node("Gemm", ["x", "W"], ["h"], name="g1", transB=1),
        helper.make_node("MatMul", ["h", "W"], ["y"], name="mm"),
    ]
    with pytest.warns(UserWarning, match="different attributes"):
        layers = link(onnx_model(nodes, {"x": ["N", 4]}, {"W": randn(rng, 4, 4)}))
    assert table(layers) == [("W", "generic", ("W",), 2, "diagonal")]


def test_user_links(rng):
    links = [{"params": ["W", "b"], "approximation": "full", "name": "both"}]
    layers = link(shared_weight_model(rng), links=links)
    assert table(layers) == [("both", "generic", ("W", "b"), 4, "full")]
    assert layers[0].attrs["linked_by_user"] is True
    # default name: the parameters joined with "+"; the remaining bias gets its own layer
    layers = link(shared_weight_model(rng, "b2"), links=[{"params": ["W"], "approximation": "diagonal"}])
    assert table(layers) == [
        ("W", "generic", ("W",), 2, "diagonal"),
        ("b", "generic", ("b",), 1, "diagonal"),
        ("b2", "generic", ("b2",), 1, "diagonal"),
    ]
    assert layers[0].pattern == "user_link"
    # linking only a bias leaves the weight layer without it
    layers = link(shared_weight_model(rng), links=[{"params": ["b"], "approximation": "full"}])
    assert table(layers) == [("W", "fully_connected", ("W",), 2, "kron_indep"), ("b", "generic", ("b",), 2, "full")]


def test_user_link_errors(rng):
    with pytest.raises(ConfigError, match=r"links\[0\]: 'nope' is not a trainable parameter"):
        link(shared_weight_model(rng), links=[{"params": ["nope"], "approximation": "full"}])
    with pytest.raises(ConfigError, match=r"already linked in links\[0\]"):
        link(shared_weight_model(rng), links=[{"params": ["W"], "approximation": "full"}, {"params": ["W"]}])
    with pytest.raises(ConfigError, match="unknown key 'links\\[0\\].parms'"):
        CompileConfig.from_dict({"links": [{"parms": ["W"]}]})
    with pytest.raises(ConfigError, match="not allowed for linked parameters"):
        CompileConfig.from_dict({"links": [{"params": ["W"], "approximation": "kron"}]})


def test_tied_embedding_linked_by_user_through_config():
    cfg = {"links": [{"params": ["tok_emb"], "approximation": "full"}]}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        plan = compile_frontend(get_model("transformer_block"), "softmax_cross_entropy", config=cfg)
    assert not [r for r in rec if "tok_emb" in str(r.message)]
    tok = plan.layer("tok_emb")
    assert (tok.kind, tok.approximation, tok.num_uses) == ("generic", "full", 2)


def test_layer_names(rng):
    for weight, names in [("fc1.weight", ["fc1", "fc1.weight"]), ("enc1.kernel", ["enc1", "enc1.kernel"]),
                          ("ln.scale", ["ln", "ln.scale"]), ("dense/kernel", ["dense", "dense/kernel"]),
                          ("conv_weight", ["conv", "conv_weight"]), (".weight", [".weight"]), ("rnn.W_x", ["rnn.W_x"]),
                          ("m/dense/MatMul/ReadVariableOp:0", ["m/dense", "m/dense/MatMul", "m/dense/MatMul/ReadVariableOp:0"])]:
        assert layer_base_names(weight) == names
    # collisions fall back to the full weight name
    nodes = [
        helper.make_node("MatMul", ["x", "a.weight"], ["h"], name="mm1"),
        helper.make_node("MatMul", ["h", "a.kernel"], ["h2"], name="mm2"),
        helper.make_node("Mul", ["h2", "a"], ["y"], name="mul"),
    ]
    inits = {"a.weight": randn(rng, 4, 4), "a.kernel": randn(rng, 4, 4), "a": randn(rng, 4)}
    layers = link(onnx_model(nodes, {"x": ["N", 4]}, inits))
    assert [l.name for l in layers] == ["a.weight", "a.kernel", "a"]
    # tf2onnx's kernel and bias of one Keras layer in layers of their own: the op tells them apart
    # (both had the whole name, which inspect's table cut to the same '...~adVariableOp:0')
    k, b = "m/ff/Tensordot/ReadVariableOp:0", "m/ff/BiasAdd/ReadVariableOp:0"
    nodes = [helper.make_node("MatMul", ["x", k], ["h"], name="mm"), helper.make_node("Reshape", ["h", "s"], ["r"]),
             helper.make_node("Add", ["r", b], ["y"], name="add")]
    layers = link(onnx_model(nodes, {"x": ["N", 4]}, {k: randn(rng, 4, 3), b: randn(rng, 3),
                                                       "s": np.array([-1, 3], np.int64)}))
    assert sorted(l.name for l in layers) == ["m/ff/BiasAdd", "m/ff/Tensordot"]


# --------------------------------------------------------------------- choose blocks
def _layer(name, kind, uses=1):
    return Layer(name=name, kind=kind, params=(name + ".w",), uses=tuple(LayerUse((f"n{i}",), "x", "y") for i in range(uses)))


def test_default_approximations_are_the_first_menu_entry():
    layers = [_layer("a", "fully_connected"), _layer("b", "fully_connected", 3), _layer("c", "conv"),
              _layer("d", "conv", 2), _layer("e", "depthwise_conv"), _layer("f", "embedding"),
              _layer("g", "scale_and_shift"), _layer("h", "generic")]
    assert [l.approximation for l in choose_blocks(layers)] == [
        "kron", "kron_indep", "kron", "kron_indep", "channel_full", "kron", "full", "diagonal"]
    assert allowed_approximations(layers[1]) == APPROXIMATIONS["fully_connected_multi"]


def test_overrides_per_kind_menu_key_and_layer():
    layers = [_layer("fc1", "fully_connected"), _layer("fc2", "fully_connected"), _layer("rnn", "fully_connected", 4),
              _layer("conv1", "conv")]
    cfg = CompileConfig(approximations={"fully_connected": "diagonal", "fully_connected_multi": "kron_series_1"},
                        layers={"fc2": "kron_in_diag", "conv.*": "diagonal"})
    got = {l.name: l.approximation for l in choose_blocks(layers, cfg)}
    assert got == {"fc1": "diagonal", "fc2": "kron_in_diag", "rnn": "kron_series_1", "conv1": "diagonal"}
    # a per-kind choice applies to multi-use layers too when it is on their menu
    cfg = CompileConfig(approximations={"fully_connected": "diagonal"})
    assert choose_blocks([layers[2]], cfg)[0].approximation == "diagonal"


def test_impossible_choices_name_the_layer_and_the_allowed_values():
    with pytest.raises(ConfigError) as e:
        choose_blocks([_layer("rnn", "fully_connected", 3)], CompileConfig(approximations={"fully_connected": "kron"}))
    msg = str(e.value)
    assert "'rnn'" in msg and "kron_indep, kron_series_1, kron_series_2, kron_indep_in_diag" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="layer 'dw'.*choose one of channel_full, diagonal, kron$"):
        choose_blocks([_layer("dw", "depthwise_conv")], CompileConfig(layers={"dw": "kron_in_diag"}))
    with pytest.raises(ConfigError, match=r"layers\['nothing.\*'\] matches no layer"):
        choose_blocks([_layer("a", "conv")], CompileConfig(layers={"nothing.*": "kron"}))
    with pytest.raises(ConfigError, match="approximations.conv: 'full' is not allowed"):
        CompileConfig.from_dict({"approximations": {"conv": "full"}})
    with pytest.raises(ConfigError, match="unknown layer kind 'dense'"):
        CompileConfig.from_dict({"approximations": {"dense": "kron"}})


def test_frontend_applies_config_overrides():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile_frontend(get_model("unrolled_rnn"), "softmax_cross_entropy",
                                config={"approximations": {"fully_connected_multi": "kron_series_2"},
                                        "layers": {"out": "diagonal"}})
    assert {l.name: l.approximation for l in plan.layers} == {
        "rnn.W_x": "kron_series_2", "rnn.b": "diagonal", "rnn.W_h": "kron_series_2", "out": "diagonal"}


# -------------------------------------------------------------------- factor specs
def _block_or_skip(plan, layer):
    from kfac_compiler.blocks.base import BLOCK_CLASSES

    if (layer.approximation, layer.kind) not in BLOCK_CLASSES or plan.factors.get(layer.name) is None:
        pytest.skip(f"Fisher block {layer.approximation!r} for {layer.kind} is not registered yet")
    return {s.name: tuple(s.shape) for s in plan.factors[layer.name]}


@pytest.fixture(scope="module")
def zoo_plans():
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("mlp_classifier", "small_cnn", "depthwise_cnn", "transformer_block", "unrolled_rnn"):
            out[name] = compile_frontend(get_model(name), "softmax_cross_entropy")
    return out


def test_factor_shapes_fully_connected(zoo_plans):
    plan = zoo_plans["mlp_classifier"]
    for name, (i, o) in {"fc1": (64, 128), "fc2": (128, 128), "fc3": (128, 10)}.items():
        assert _block_or_skip(plan, plan.layer(name)) == {"A": (i + 1, i + 1), "G": (o, o)}
    rnn = zoo_plans["unrolled_rnn"]
    assert _block_or_skip(rnn, rnn.layer("rnn.W_x")) == {"A": (8, 8), "G": (32, 32)}  # no bias
    assert _block_or_skip(rnn, rnn.layer("rnn.W_h")) == {"A": (32, 32), "G": (32, 32)}


def test_factor_shapes_conv(zoo_plans):
    plan = zoo_plans["small_cnn"]
    assert _block_or_skip(plan, plan.layer("conv1")) == {"A": (1 * 9 + 1,) * 2, "G": (8, 8)}
    assert _block_or_skip(plan, plan.layer("conv2")) == {"A": (8 * 9 + 1,) * 2, "G": (16, 16)}
    dw = zoo_plans["depthwise_cnn"]
    assert _block_or_skip(dw, dw.layer("conv1")) == {"A": (9, 9), "G": (8, 8)}  # no bias
    assert _block_or_skip(dw, dw.layer("pwconv")) == {"A": (9, 9), "G": (16, 16)}


def test_factor_shapes_channel_full_and_scale_and_shift(zoo_plans):
    dw = zoo_plans["depthwise_cnn"]
    layer = dw.layer("dwconv")  # the depthwise default: per output channel its [w_c | b_c] block
    assert _block_or_skip(dw, layer) == {"full": (8, 9 + 1, 9 + 1)}
    bn = dw.layer("bn1")
    assert _block_or_skip(dw, bn) == {"full": (16, 16)}  # (2 * size)^2
    tr = zoo_plans["transformer_block"]
    assert _block_or_skip(tr, tr.layer("ln1")) == {"full": (32, 32)}
    tok = tr.layer("tok_emb")  # tied: lookup A_V, G_D and head A_D, G_V
    assert _block_or_skip(tr, tok) == {"diag": (16, 17)}  # the tied table E [17, 16] as M = E^T


def test_factor_shapes_embedding(rng):
    # an untied embedding: Gather on a 2-D initializer
    node = helper.make_node("Gather", ["E", "ids"], ["y"], name="g", axis=0)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 3])
    plan = compile_frontend(onnx_model([node], {"ids": ids}, {"E": randn(rng, 11, 4)}), "squared_error")
    layer = plan.layer("E")
    assert layer.kind == "embedding"
    assert _block_or_skip(plan, layer) == {"A": (11,), "G": (4, 4)}
    assert plan.totals()["factor_bytes"] == (11 + 16) * 4


def test_a_weight_read_by_a_node_no_match_covers_is_generic_with_every_use():
    """A tied autoencoder as torch.export writes it: the encoder's Gemm reads W (a fully
    connected match) and the decoder reads Transpose(W), which no pattern matched. The
    fully connected layer held the encoder's use alone, so its block left the decoder's
    curvature out (the implied gradient's cosine with the true one: 0.937). It is one generic
    layer over both readers now, with a warning naming the Transpose; on one example its
    empirical diagonal is the square of the true gradient (numpy: dL/dW of both uses)."""
    import numpy as np
    from onnx import numpy_helper

    import kfac_compiler as kc
    from kfac_compiler.runtime import Curvature, gradients

    rng = np.random.default_rng(0)
    W, b, d = rng.normal(size=(3, 5)), rng.normal(size=3), rng.normal(size=5)
    nodes = [helper.make_node("Gemm", ["input", "W", "b"], ["h"], transB=1), helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("Transpose", ["W"], ["Wt"], name="decoder_t", perm=[1, 0]),
             helper.make_node("Transpose", ["Wt"], ["Wtt"], perm=[1, 0]),
             helper.make_node("MatMul", ["a", "Wtt"], ["m"]), helper.make_node("Add", ["m", "d"], ["out"])]
    model = helper.make_model(helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in (("W", W), ("b", b), ("d", d))]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = kc.compile(model, loss="squared_error", output="out", emit=False)
    assert any("'W' is also read by node 'decoder_t' (Transpose)" in str(w.message) for w in caught)
    layer = next(l for l in plan.layers if "W" in l.params)
    assert layer.kind == "generic" and len(layer.uses) == 2
    x, y = rng.normal(size=(1, 5)), rng.normal(size=(1, 5))
    _, g = gradients(plan, {"input": x.astype(np.float32)}, y.astype(np.float32))
    a = np.tanh(x @ W.T + b)
    r = a @ W + d - y  # squared error, one example: dL/dW = (r^T-side through both uses)
    want = (((r @ W.T) * (1 - a ** 2)).T @ x) + a.T @ r
    np.testing.assert_allclose(g["W"], want, rtol=1e-4, atol=1e-5)
    stats = Curvature(plan).estimate({"input": x.astype(np.float32)}, y.astype(np.float32), mode="empirical")
    diag = next(v for v in stats[layer.name].values())
    np.testing.assert_allclose(np.asarray(diag).reshape(-1)[:W.size], (want ** 2).reshape(-1), rtol=1e-3, atol=1e-6)


def test_exact_damping_with_a_diagonal_factor_is_refused_at_compile():
    """inverse.damping_split = "exact" on a plan whose embedding block keeps a diagonal A
    compiled, and then every statistics run (other layers' estimates too) raised. The blocks
    are built with the plan's split at compile now: one line naming the layer and the ways
    out; a plan without such a factor compiles with it."""
    import numpy as np
    from onnx import numpy_helper

    import kfac_compiler as kc

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["x"], axis=0),
             helper.make_node("ReduceMean", ["x"], ["h"], axes=[1], keepdims=0),
             helper.make_node("MatMul", ["h", "W"], ["logits"])]
    model = helper.make_model(helper.make_graph(
        nodes, "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 2])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.normal(size=(5, 3)).astype(np.float32), "E"),
         numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "W")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(ConfigError, match=r"layer 'E': exact damping needs full factors, .*damping_split 'pi'"):
        kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False, inverse={"damping_split": "exact"})
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False,
                      inverse={"damping_split": "exact"}, exclude=["E"])
    assert [(l.name, l.approximation) for l in plan.layers] == [("W", "kron")]
