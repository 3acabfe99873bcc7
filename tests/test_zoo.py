"""Tests for the model zoo (kfac_compiler.models)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from kfac_compiler.models import LOSSES, ZOO, ZooEntry, get_model, list_models, save_model

EXPECTED_NAMES = [
    "mlp_classifier", "digits_autoencoder", "small_cnn",
    "depthwise_cnn", "unrolled_rnn", "transformer_block",
]

EXPECTED_INITIALIZERS = {
    "mlp_classifier": [
        ("fc1.weight", (128, 64)), ("fc1.bias", (128,)),
        ("fc2.weight", (128, 128)), ("fc2.bias", (128,)),
        ("fc3.weight", (10, 128)), ("fc3.bias", (10,)),
    ],
    "digits_autoencoder": [
        ("enc1.kernel", (64, 256)), ("enc1.bias", (256,)),
        ("enc2.kernel", (256, 128)), ("enc2.bias", (128,)),
        ("enc3.kernel", (128, 32)), ("enc3.bias", (32,)),
        ("dec1.kernel", (32, 128)), ("dec1.bias", (128,)),
        ("dec2.kernel", (128, 256)), ("dec2.bias", (256,)),
        ("dec3.kernel", (256, 64)), ("dec3.bias", (64,)),
    ],
    "small_cnn": [
        ("conv1.weight", (8, 1, 3, 3)), ("conv1.bias", (8,)),
        ("conv2.weight", (16, 8, 3, 3)), ("conv2.bias", (16,)),
        ("fc.weight", (10, 16)), ("fc.bias", (10,)),
    ],
    "depthwise_cnn": [
        ("conv1.weight", (8, 1, 3, 3)),
        ("bn1.scale", (8,)), ("bn1.bias", (8,)),
        ("bn1.running_mean", (8,)), ("bn1.running_var", (8,)),
        ("dwconv.weight", (8, 1, 3, 3)), ("dwconv.bias", (8,)),
        ("pwconv.weight", (16, 8, 1, 1)), ("pwconv.bias", (16,)),
        ("fc.weight", (10, 256)), ("fc.bias", (10,)),
    ],
    "unrolled_rnn": [
        ("rnn.W_x", (8, 32)), ("rnn.W_h", (32, 32)), ("rnn.b", (32,)),
        ("out.weight", (32, 10)), ("out.bias", (10,)),
    ],
    "transformer_block": [
        ("tok_emb", (17, 16)), ("pos_emb", (8, 16)),
        ("ln1.scale", (16,)), ("ln1.bias", (16,)),
        ("attn.q.weight", (16, 16)), ("attn.q.bias", (16,)),
        ("attn.k.weight", (16, 16)), ("attn.k.bias", (16,)),
        ("attn.v.weight", (16, 16)), ("attn.v.bias", (16,)),
        ("attn.proj.weight", (16, 16)), ("attn.proj.bias", (16,)),
        ("ln2.scale", (16,)), ("ln2.bias", (16,)),
        ("mlp.fc1.weight", (16, 64)), ("mlp.fc1.bias", (64,)),
        ("mlp.fc2.weight", (64, 16)), ("mlp.fc2.bias", (16,)),
        ("lnf.scale", (16,)), ("lnf.bias", (16,)),
    ],
}

EXPECTED_IO = {
    # name: (input shape after batch, input dtype, logits shape after batch, target shape after batch, target dtype)
    "mlp_classifier": ((64,), np.float32, (10,), (), np.int64),
    "digits_autoencoder": ((64,), np.float32, (64,), (64,), np.float32),
    "small_cnn": ((1, 8, 8), np.float32, (10,), (), np.int64),
    "depthwise_cnn": ((1, 8, 8), np.float32, (10,), (), np.int64),
    "unrolled_rnn": ((8, 8), np.float32, (10,), (), np.int64),
    "transformer_block": ((8,), np.int64, (8, 17), (8,), np.int64),
}


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    return {name: get_model(name) for name in ZOO}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _params(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_registry():
    assert list_models() == EXPECTED_NAMES
    for name, entry in ZOO.items():
        assert isinstance(entry, ZooEntry)
        assert entry.name == name
        assert entry.loss in LOSSES
        assert entry.input_name == "input" and entry.output_name == "logits"
        assert entry.description and "\n" not in entry.description
        assert entry.build.__name__ == f"build_{name}" and entry.build.__doc__
    assert ZOO["digits_autoencoder"].loss == "sigmoid_cross_entropy"
    assert all(ZOO[n].loss == "softmax_cross_entropy" for n in EXPECTED_NAMES if n != "digits_autoencoder")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZOO["mlp_classifier"].loss = "squared_error"  # frozen
    with pytest.raises(KeyError):
        get_model("nope")


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_model_structure(models, name):
    model = models[name]
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    g = model.graph
    assert [i.name for i in g.input] == ["input"]
    assert [o.name for o in g.output] == ["logits"]
    assert g.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    assert g.output[0].type.tensor_type.shape.dim[0].dim_param == "N"
    names = [n.name for n in g.node]
    assert all(names) and len(set(names)) == len(names)
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in g.initializer)
    got = [(t.name, tuple(t.dims)) for t in g.initializer]
    assert got == EXPECTED_INITIALIZERS[name]
    # every initializer is actually consumed
    used = {i for n in g.node for i in n.input}
    assert {t.name for t in g.initializer} <= used


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_ort_runs_on_data(models, name):
    entry = ZOO[name]
    inputs, targets = entry.make_data(n=5)
    in_shape, in_dtype, out_shape, tgt_shape, tgt_dtype = EXPECTED_IO[name]
    assert set(inputs) == {"input"}
    assert inputs["input"].shape == (5, *in_shape) and inputs["input"].dtype == in_dtype
    assert targets.shape == (5, *tgt_shape) and targets.dtype == tgt_dtype
    (out,) = _session(models[name]).run(None, inputs)
    assert out.shape == (5, *out_shape) and out.dtype == np.float32
    assert np.isfinite(out).all()


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_determinism(models, name):
    again = get_model(name, seed=0)
    other = get_model(name, seed=1)
    p0, p1, p2 = _params(models[name]), _params(again), _params(other)
    assert all(np.array_equal(p0[k], p1[k]) for k in p0)
    assert any(not np.array_equal(p0[k], p2[k]) for k in p0)
    x0, y0 = ZOO[name].make_data(n=7, seed=3)
    x1, y1 = ZOO[name].make_data(n=7, seed=3)
    assert np.array_equal(x0["input"], x1["input"]) and np.array_equal(y0, y1)


def test_data_contents():
    x, y = ZOO["mlp_classifier"].make_data()
    assert x["input"].shape == (1797, 64) and y.shape == (1797,)
    assert x["input"].min() == 0.0 and x["input"].max() == 1.0
    assert set(np.unique(y)) == set(range(10))
    xa, ya = ZOO["digits_autoencoder"].make_data(n=4)
    assert np.array_equal(xa["input"], ya)
    xc, yc = ZOO["small_cnn"].make_data(n=4)
    np.testing.assert_array_equal(xc["input"].reshape(4, 64), x["input"][:4])
    np.testing.assert_array_equal(yc, y[:4])
    xr, _ = ZOO["unrolled_rnn"].make_data(n=4)
    np.testing.assert_array_equal(xr["input"].reshape(4, 64), x["input"][:4])
    xt, yt = ZOO["transformer_block"].make_data(n=50)
    tok = xt["input"]
    assert tok.min() >= 0 and tok.max() <= 16
    np.testing.assert_array_equal(yt, np.roll(tok, -1, axis=1))
    # each token row is one row of the corresponding image
    pix = np.rint(x["input"][:50] * 16).astype(np.int64).reshape(50, 8, 8)
    assert all(any(np.array_equal(tok[i], pix[i, r]) for r in range(8)) for i in range(50))


def test_size_kwargs():
    m = get_model("mlp_classifier", hidden=(32,))
    assert [tuple(t.dims) for t in m.graph.initializer] == [(32, 64), (32,), (10, 32), (10,)]
    m = get_model("digits_autoencoder", widths=(16, 4, 16))
    assert [tuple(t.dims) for t in m.graph.initializer][::2] == [(64, 16), (16, 4), (4, 16), (16, 64)]
    m = get_model("unrolled_rnn", hidden=12)
    assert _params(m)["rnn.W_h"].shape == (12, 12)


def test_save_model(tmp_path):
    path = save_model("small_cnn", tmp_path / "sub" / "small_cnn.onnx")
    loaded = onnx.load(path)
    onnx.checker.check_model(loaded, full_check=True)
    assert [t.name for t in loaded.graph.initializer] == [n for n, _ in EXPECTED_INITIALIZERS["small_cnn"]]


# ---------------------------------------------------------------- weight sharing
def _consumers(model: onnx.ModelProto, tensor: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if tensor in n.input]


def test_rnn_weight_sharing(models):
    m = models["unrolled_rnn"]
    assert len(_consumers(m, "rnn.W_x")) == 8
    assert len(_consumers(m, "rnn.W_h")) == 7
    assert len(_consumers(m, "rnn.b")) == 8


def test_transformer_tied_head_and_causality(models):
    m = models["transformer_block"]
    ops = sorted(n.op_type for n in _consumers(m, "tok_emb"))
    assert ops == ["Gather", "Transpose"]
    sess = _session(m)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 17, size=(3, 8)).astype(np.int64)
    tok2 = tok.copy()
    tok2[:, 5:] = (tok2[:, 5:] + 3) % 17
    (a,) = sess.run(None, {"input": tok})
    (b,) = sess.run(None, {"input": tok2})
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-5)
    assert not np.allclose(a[:, 5:], b[:, 5:])


# ---------------------------------------------------------------- numpy references
def _ref_mlp(p, x):
    h = x
    for i in (1, 2, 3):
        h = h @ p[f"fc{i}.weight"].T + p[f"fc{i}.bias"]
        if i < 3:
            h = np.maximum(h, 0)
    return h


def _ref_autoencoder(p, x):
    layers = ["enc1", "enc2", "enc3", "dec1", "dec2", "dec3"]
    h = x
    for i, name in enumerate(layers):
        h = h @ p[f"{name}.kernel"] + p[f"{name}.bias"]
        if i < len(layers) - 1:
            h = np.tanh(h)
    return h


def _ref_rnn(p, x):
    h = np.zeros((x.shape[0], p["rnn.W_h"].shape[0]), np.float32)
    for t in range(x.shape[1]):
        h = np.tanh(x[:, t] @ p["rnn.W_x"] + h @ p["rnn.W_h"] + p["rnn.b"])
    return h @ p["out.weight"] + p["out.bias"]


@pytest.mark.parametrize("name,ref", [
    ("mlp_classifier", _ref_mlp),
    ("digits_autoencoder", _ref_autoencoder),
    ("unrolled_rnn", _ref_rnn),
])
def test_numpy_reference(name, ref):
    # non-zero biases so the bias paths are exercised too
    model = get_model(name, seed=2)
    rng = np.random.default_rng(11)
    for t in model.graph.initializer:
        if t.name.endswith("bias") or t.name == "rnn.b":
            arr = (0.1 * rng.standard_normal(tuple(t.dims))).astype(np.float32)
            t.CopyFrom(numpy_helper.from_array(arr, name=t.name))
    inputs, _ = ZOO[name].make_data(n=16, seed=5)
    (out,) = _session(model).run(None, inputs)
    expected = ref({k: v.astype(np.float64) for k, v in _params(model).items()},
                   inputs["input"].astype(np.float64))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
