"""The weight-normed conv block (blocks/weight_norm.py) against a brute-force Fisher.

A tiny model: one Conv whose weight is w = g v / ||v|| (both exporters' forms, torch's dim=0
and Wav2Vec2's dim=2), one example at one output position, so that the K-FAC factors of the
conv (exact mode) are the exact w-space Fisher. The truth is computed in float64 numpy
without the compiler: the Jacobian of the logits w.r.t. (v, b, g) and of w w.r.t. (v, g) by
central differences, F = J^T F_z J in (v, b, g); the block must multiply by F + lambda J_w^T
J_w (w-space damping, pulled back) and precondition by its pseudo-inverse, on the host
(numpy twins) and in the emitted graphs.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.losses import make_loss
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.curvature import Curvature

CIN, COUT, K = 2, 3, 3
V, G, B = "conv.weight_v", "conv.weight_g", "conv.bias"


def _model(axes: tuple[int, ...], gain_first: bool, seed: int = 0, bias: bool = True):
    """x [N, CIN, K] -> Conv(x, w(g, v), b) [N, COUT, 1] -> Flatten -> logits [N, COUT]."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(COUT, CIN, K)).astype(np.float32)
    g_shape = tuple(1 if i in axes else d for i, d in enumerate(v.shape))
    values = {V: v, G: rng.uniform(0.5, 1.5, size=g_shape).astype(np.float32),
              B: (0.3 * rng.normal(size=COUT)).astype(np.float32)}
    if not bias:
        del values[B]
    w_nodes = ([helper.make_node("Div", [G, "norm"], ["gain"]), helper.make_node("Mul", [V, "gain"], ["w"])]
               if gain_first else
               [helper.make_node("Div", [V, "norm"], ["dir"]), helper.make_node("Mul", ["dir", G], ["w"])])
    nodes = [helper.make_node("ReduceL2", [V, "axes"], ["norm"], keepdims=1), *w_nodes,
             helper.make_node("Conv", ["input", "w"] + ([B] if bias else []), ["y"], kernel_shape=[K]),
             helper.make_node("Flatten", ["y"], ["logits"], axis=1)]
    inits = [numpy_helper.from_array(a, n) for n, a in values.items()]
    inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    graph = helper.make_graph(nodes, "wn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", CIN, K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", COUT])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model, {n: a.astype(np.float64) for n, a in values.items()}


def _weight(p, axes):
    return p[G] * p[V] / np.sqrt((p[V] ** 2).sum(axis=axes, keepdims=True))


def _logits(p, x, axes):
    return np.einsum("ock,nck->no", _weight(p, axes), x) + p.get(B, 0.0)


ORDER = (V, B, G)  # the layer's parameters: weight (v), bias, then the gain


def _flat(p):
    return np.concatenate([np.ravel(p[n]) for n in ORDER if n in p])


def _unflat(theta, like):
    out, i = {}, 0
    for n in (n for n in ORDER if n in like):
        out[n] = theta[i:i + like[n].size].reshape(like[n].shape)
        i += like[n].size
    return out


def _jacobian(fn, theta, eps=1e-6):
    cols = [(fn(theta + eps * e) - fn(theta - eps * e)) / (2 * eps) for e in np.eye(theta.size)]
    return np.stack(cols, axis=1)


def _truth(p, x, axes):
    """(F, D): the exact Fisher of one example in (v, b, g) and the w-space damping pulled
    back, J_w^T J_w with J_w = d(w, b)/d(v, b, g)."""
    theta = _flat(p)
    J = _jacobian(lambda t: _logits(_unflat(t, p), x, axes)[0], theta)
    F = J.T @ make_loss("softmax_cross_entropy").np_fisher(_logits(p, x, axes)[0]) @ J
    Jw = _jacobian(lambda t: np.concatenate([np.ravel(_weight(_unflat(t, p), axes)), _unflat(t, p).get(B, [])]), theta)
    return F, Jw.T @ Jw


# torch dim=0, Wav2Vec2's dim=2, TorchScript's form, no bias
CASES = [((1, 2), True, True), ((0, 1), True, True), ((1, 2), False, True), ((0, 1), True, False)]


@pytest.mark.parametrize("axes,gain_first,bias", CASES, ids=["dim0", "dim2", "dim0-div", "dim2-nobias"])
def test_block_is_the_pseudo_inverse_of_the_pulled_back_damped_fisher(axes, gain_first, bias):
    model, p = _model(axes, gain_first, bias=bias)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False,
                      config={"inverse": {"damping_split": "exact"}})
    (layer,) = plan.layers
    order = tuple(n for n in ORDER if n in p)
    assert (layer.name, layer.kind, layer.approximation, layer.params, layer.bias) == (
        "conv", "weight_norm_conv", "kron", order, B if bias else None)
    x = np.random.default_rng(1).normal(size=(1, CIN, K))
    lam = 0.05
    F, D = _truth(p, x, axes)
    curv = Curvature(plan, mode="exact", ema_decay=0.0, damping_floor=0.0)
    curv.update({"input": x.astype(np.float32)}, np.array([2]))
    curv.update_inverses(lam)
    rng = np.random.default_rng(2)
    vec = _unflat(rng.normal(size=F.shape[0]), p)
    mine = {n: vec[n].astype(np.float32) for n in order}

    want = (F + lam * D) @ _flat(vec)
    for got in (curv.multiply(layer.name, mine, lam), curv.multiply_all(mine, lam)):  # numpy twin, emitted
        np.testing.assert_allclose(_flat(got), want, rtol=2e-3, atol=2e-4 * np.abs(want).max())

    want = np.linalg.pinv(F + lam * D, rcond=1e-10, hermitian=True) @ _flat(vec)
    for got in (curv.multiply_inverse(layer.name, mine), curv.precondition(mine)):
        np.testing.assert_allclose(_flat(got), want, rtol=2e-3, atol=2e-4 * np.abs(want).max())


def test_gradients_of_g_and_v_are_finite_differences_of_the_loss():
    axes = (0, 1)
    model, p = _model(axes, True)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    x, y = np.random.default_rng(3).normal(size=(4, CIN, K)), np.array([0, 2, 1, 2])
    loss = make_loss("softmax_cross_entropy")

    def mean_loss(theta):
        return float(np.mean(loss.np_per_example(_logits(_unflat(theta, p), x, axes), y)))

    want = _jacobian(lambda t: np.array([mean_loss(t)]), _flat(p))[0]
    _, got = kc.gradients(plan, inputs={"input": x.astype(np.float32)}, targets=y)
    np.testing.assert_allclose(_flat(got), want, rtol=1e-4, atol=1e-6)


def test_kfac_trains_g_and_v_and_export_keeps_the_weight_norm(tmp_path):
    """K-FAC steps train g and v (the user's parameters; the exported graph still computes
    w = g v / ||v||) and lower the loss; the exported model computes the trained logits."""
    import onnx

    model, p = _model((1, 2), True)
    path = tmp_path / "wn.onnx"
    onnx.save(model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kc.compile(str(path), loss="softmax_cross_entropy", output="logits")
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(16, CIN, K)).astype(np.float32), rng.integers(0, COUT, size=16)
    tr = Trainer(plan, optimizer="kfac", device="cpu", seed=0)
    before = tr.evaluate({"input": x}, y)["loss"]
    for _ in range(10):
        tr.step({"input": x}, y)
    after = tr.evaluate({"input": x}, y)["loss"]
    assert after < 0.8 * before, (before, after)
    out = onnx.load(tr.export(tmp_path / "out.onnx", graph="source"))
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in model.graph.node]
    trained = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in out.graph.initializer if t.name in ORDER}
    assert not np.allclose(trained[G], p[G]) and not np.allclose(trained[V], p[V])
    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(["logits"], {"input": x})[0], _logits(trained, x, (1, 2)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tr.predict({"input": x}), _logits(trained, x, (1, 2)), rtol=1e-4, atol=1e-5)
