"""Every zoo model compiles (from a real .onnx file) to exactly the expected layer table."""
from __future__ import annotations

import warnings

import pytest

from kfac_compiler.frontend import compile_frontend
from kfac_compiler.models import ZOO, save_model

# name, kind, params, number of uses, default approximation
EXPECTED = {
    "mlp_classifier": [
        ("fc1", "fully_connected", ("fc1.weight", "fc1.bias"), 1, "kron"),
        ("fc2", "fully_connected", ("fc2.weight", "fc2.bias"), 1, "kron"),
        ("fc3", "fully_connected", ("fc3.weight", "fc3.bias"), 1, "kron"),
    ],
    "digits_autoencoder": [
        ("enc1", "fully_connected", ("enc1.kernel", "enc1.bias"), 1, "kron"),
        ("enc2", "fully_connected", ("enc2.kernel", "enc2.bias"), 1, "kron"),
        ("enc3", "fully_connected", ("enc3.kernel", "enc3.bias"), 1, "kron"),
        ("dec1", "fully_connected", ("dec1.kernel", "dec1.bias"), 1, "kron"),
        ("dec2", "fully_connected", ("dec2.kernel", "dec2.bias"), 1, "kron"),
        ("dec3", "fully_connected", ("dec3.kernel", "dec3.bias"), 1, "kron"),
    ],
    "small_cnn": [
        ("conv1", "conv", ("conv1.weight", "conv1.bias"), 1, "kron"),
        ("conv2", "conv", ("conv2.weight", "conv2.bias"), 1, "kron"),
        ("fc", "fully_connected", ("fc.weight", "fc.bias"), 1, "kron"),
    ],
    "depthwise_cnn": [
        ("conv1", "conv", ("conv1.weight",), 1, "kron"),
        ("bn1", "scale_and_shift", ("bn1.scale", "bn1.bias"), 1, "full"),
        ("dwconv", "depthwise_conv", ("dwconv.weight", "dwconv.bias"), 1, "channel_full"),
        ("pwconv", "conv", ("pwconv.weight", "pwconv.bias"), 1, "kron"),
        ("fc", "fully_connected", ("fc.weight", "fc.bias"), 1, "kron"),
    ],
    "unrolled_rnn": [
        # rnn.b is added after Add(x W_x, h W_h) at steps 1..7 but right after x W_x at step 0:
        # not the same bias on every use of W_x, so it is released: every use adds it to the
        # data, so it is a broadcast layer over its 8 Adds.
        ("rnn.W_x", "fully_connected", ("rnn.W_x",), 8, "kron_indep"),
        ("rnn.b", "broadcast", ("rnn.b",), 8, "diagonal"),
        ("rnn.W_h", "fully_connected", ("rnn.W_h",), 7, "kron_indep"),
        ("out", "fully_connected", ("out.weight", "out.bias"), 1, "kron"),
    ],
    "transformer_block": [
        # tok_emb: Gather (embedding) and Transpose -> head MatMul (fully_connected): a tied
        # embedding -> one tied_embedding layer with both uses.
        ("tok_emb", "tied_embedding", ("tok_emb",), 2, "diagonal"),
        ("pos_emb", "broadcast", ("pos_emb",), 1, "diagonal"),
        ("ln1", "scale_and_shift", ("ln1.scale", "ln1.bias"), 1, "full"),
        ("attn.q", "fully_connected", ("attn.q.weight", "attn.q.bias"), 1, "kron"),
        ("attn.k", "fully_connected", ("attn.k.weight", "attn.k.bias"), 1, "kron"),
        ("attn.v", "fully_connected", ("attn.v.weight", "attn.v.bias"), 1, "kron"),
        ("attn.proj", "fully_connected", ("attn.proj.weight", "attn.proj.bias"), 1, "kron"),
        ("ln2", "scale_and_shift", ("ln2.scale", "ln2.bias"), 1, "full"),
        ("mlp.fc1", "fully_connected", ("mlp.fc1.weight", "mlp.fc1.bias"), 1, "kron"),
        ("mlp.fc2", "fully_connected", ("mlp.fc2.weight", "mlp.fc2.bias"), 1, "kron"),
        ("lnf", "scale_and_shift", ("lnf.scale", "lnf.bias"), 1, "full"),
    ],
}

FROZEN = {"depthwise_cnn": ["bn1.running_mean", "bn1.running_var"]}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("zoo")
    out = {}
    for name, entry in ZOO.items():
        path = save_model(name, d / f"{name}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = compile_frontend(path, entry.loss)
    return out


def test_every_zoo_model_has_an_expected_table():
    assert set(EXPECTED) == set(ZOO)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_zoo_layer_table(plans, name):
    plan = plans[name]
    table = [(l.name, l.kind, l.params, l.num_uses, l.approximation) for l in plan.layers]
    assert table == EXPECTED[name]
    assert plan.frozen == FROZEN.get(name, [])
    # every trainable parameter is in exactly one layer
    params = [p for l in plan.layers for p in l.params]
    assert sorted(params) == sorted(plan.trainable)
    assert plan.output == "logits"
    assert plan.loss.kind == ZOO[name].loss


def test_zoo_details(plans):
    rnn = plans["unrolled_rnn"]
    wx = rnn.layer("rnn.W_x")
    assert [u.nodes for u in wx.uses] == [(f"step{t}/MatMul_x",) for t in range(8)]
    assert [u.output for u in wx.uses] == [f"step{t}/MatMul_x:0" for t in range(8)]
    assert [u.input for u in wx.uses] == [f"step{t}/Gather:0" for t in range(8)]
    assert any("rnn.b" in n for n in wx.notes)
    wh = rnn.layer("rnn.W_h")
    assert [u.input for u in wh.uses] == [f"h{t}" for t in range(1, 8)]
    b = rnn.layer("rnn.b")
    assert [u.nodes for u in b.uses] == [(f"step{t}/Add_b",) for t in range(8)]
    assert rnn.layer("out").attrs["weight_layout"] == "in_out"

    tr = plans["transformer_block"]
    tok = tr.layer("tok_emb")
    assert tok.attrs["use_kinds"] == ("embedding", "fully_connected")
    assert [u.nodes for u in tok.uses] == [("tok_emb/Gather",), ("head/Transpose_emb", "head/MatMul")]
    assert [(u.input, u.output) for u in tok.uses] == [("input", "tok_emb/Gather:0"), ("lnf/LayerNormalization:0", "logits")]
    # no warning, only the note that the tie is trained as one parameter
    assert [n for n in tr.notes if "tok_emb" in n] == [
        "parameter 'tok_emb' is shared by 2 nodes (tok_emb/Gather, head/Transpose_emb) and trained as one tied "
        "parameter (untie it with --untie tok_emb if that is not intended)"]
    q = tr.layer("attn.q")
    assert q.uses[0].nodes == ("attn.q/MatMul", "attn.q/Add")
    assert q.uses[0].input == "ln1/LayerNormalization:0"
    assert q.uses[0].output == "attn.q/Add:0"
    assert q.attrs["weight_layout"] == "in_out"
    ln1 = tr.layer("ln1")
    assert ln1.attrs["normalization"] == {"op": "LayerNormalization", "axis": 2, "epsilon": 1e-5}
    assert ln1.attrs["scale_axes"] == (2,)
    assert ln1.uses[0].input == "pos_emb/Add:0"
    assert tr.targets.shape == ["N", 8] and tr.targets.dtype == "int64"

    dw = plans["depthwise_cnn"]
    assert dw.layer("dwconv").attrs["group"] == 8
    bn = dw.layer("bn1")
    assert bn.attrs["normalization"] == {
        "op": "BatchNormalization", "mean": "bn1.running_mean", "var": "bn1.running_var", "epsilon": 1e-5,
    }
    assert bn.attrs["scale_axes"] == (1,)
    conv1 = plans["small_cnn"].layer("conv1")
    assert conv1.attrs["kernel_shape"] == (3, 3)
    assert conv1.attrs["pads"] == (1, 1, 1, 1)
    assert conv1.attrs["strides"] == (1, 1) and conv1.attrs["dilations"] == (1, 1)
    assert plans["mlp_classifier"].layer("fc1").attrs == {
        "weight_layout": "out_in", "alpha": 1.0, "beta": 1.0, "input_shape": ("N", 64),
    }
    assert plans["digits_autoencoder"].targets.to_json() == {
        "name": "targets", "shape": ["N", 64], "dtype": "float32", "from_input": None,
    }
