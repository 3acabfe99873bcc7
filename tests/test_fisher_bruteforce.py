"""Compiled curvature statistics against the brute-force Fisher of tiny models.

The truth is computed independently in float64 numpy: a numpy forward pass, per-example
Jacobians of the logits w.r.t. each layer's parameter matrix [W | b] by central finite
differences, and F = 1/N sum_n J_n^T F_z(z_n) J_n with F_z the predictive distribution's
Fisher. Statistics come from the plan's `statistics` subgraph run in ONNX Runtime.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.losses import make_loss
from kfac_compiler.runtime.data import noise_shape

IN, HID, OUT = 3, 4, 3


def _tiny_mlp(seed: int = 0):
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(HID, IN)).astype(np.float32)
    b1 = rng.normal(size=HID).astype(np.float32) * 0.5
    w2 = rng.normal(size=(OUT, HID)).astype(np.float32)
    b2 = rng.normal(size=OUT).astype(np.float32) * 0.5
    nodes = [
        helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"], name="fc1", transB=1),
        helper.make_node("Tanh", ["h"], ["a"], name="act"),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], name="fc2", transB=1),
    ]
    inits = [numpy_helper.from_array(v, n) for n, v in
             [("fc1.weight", w1), ("fc1.bias", b1), ("fc2.weight", w2), ("fc2.bias", b2)]]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", IN])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", OUT])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    params = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in inits}
    return model, params


def _forward(params, x):
    h = np.tanh(x @ params["fc1.weight"].T + params["fc1.bias"])
    return h @ params["fc2.weight"].T + params["fc2.bias"]


def _layer_jacobian(params, x_n, layer, eps=1e-6, forward=None):
    """d z_n / d vec_rowmajor([W | b]) for one example, by central differences (of `forward`,
    default this module's tiny MLP)."""
    forward = forward or _forward
    w, b = params[f"{layer}.weight"], params[f"{layer}.bias"]
    mat = np.concatenate([w, b[:, None]], axis=1)
    cols = []
    for idx in np.ndindex(*mat.shape):
        out = []
        for sign in (1, -1):
            m = mat.copy()
            m[idx] += sign * eps
            p = dict(params, **{f"{layer}.weight": m[:, :-1], f"{layer}.bias": m[:, -1]})
            out.append(forward(p, x_n[None])[0])
        cols.append((out[0] - out[1]) / (2 * eps))
    return np.stack(cols, axis=1)


def _exact_fisher(params, x, layer, kind="softmax_cross_entropy"):
    loss = make_loss(kind)
    z = _forward(params, x)
    blocks = [(_layer_jacobian(params, x[n], layer), loss.np_fisher(z[n])) for n in range(len(x))]
    return sum(j.T @ f @ j for j, f in blocks) / len(x)


def _statistics(plan, x, y, mode, num_samples=1, seed=0, stats_batch=None):
    model, info = emit_subgraph(plan, "statistics", mode=mode, num_samples=num_samples, stats_batch=stats_batch)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input": x.astype(np.float32), "targets": y}
    feeds.update({p: numpy_helper.to_array(t) for p, t in
                  ((t.name, t) for t in plan.model.graph.initializer) if p in plan.trainable})
    rng = np.random.default_rng(seed)
    for s in range(info.noise.count):
        feeds[f"noise/{s}"] = rng.uniform(1e-6, 1 - 1e-6, size=noise_shape(info, y)).astype(np.float32)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


@pytest.fixture(scope="module")
def tiny():
    model, params = _tiny_mlp()
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    return plan, params


@pytest.mark.parametrize("mode", ["exact", "exact_GGN"])
def test_kron_equals_exact_fisher_for_one_example(tiny, mode):
    """One example: a~ is deterministic, so A (x) G is the exact Fisher block of every layer."""
    plan, params = tiny
    x = np.array([[0.3, -1.2, 0.8]])
    stats = _statistics(plan, x, np.array([1]), mode)
    for layer in ("fc1", "fc2"):
        A, G = stats[f"stat/{layer}/A"], stats[f"stat/{layer}/G"]
        exact = _exact_fisher(params, x, layer)
        np.testing.assert_allclose(np.kron(G, A), exact, rtol=1e-4, atol=1e-6)


def test_kron_for_a_batch_matches_its_definition_and_differs_from_exact(tiny):
    """N > 1: A and G are the batch means of the definition; A (x) G is then only an
    approximation of the exact block (the Kronecker factorization of an expectation)."""
    plan, params = tiny
    x = np.random.default_rng(1).normal(size=(6, IN))
    stats = _statistics(plan, x, np.zeros(6, np.int64), "exact")
    a = np.concatenate([np.tanh(x @ params["fc1.weight"].T + params["fc1.bias"]), np.ones((6, 1))], axis=1)
    np.testing.assert_allclose(stats["stat/fc2/A"], a.T @ a / 6, rtol=1e-5, atol=1e-6)
    # G of the output layer is the mean predictive Fisher of the logits
    z = _forward(params, x)
    mean_fz = sum(make_loss("softmax_cross_entropy").np_fisher(z[n]) for n in range(6)) / 6
    np.testing.assert_allclose(stats["stat/fc2/G"], mean_fz, rtol=1e-4, atol=1e-6)
    exact = _exact_fisher(params, x, "fc2")
    approx = np.kron(stats["stat/fc2/G"], stats["stat/fc2/A"])
    assert np.abs(approx - exact).max() > 1e-3
    # both are PSD and agree on the bias-bias block (a~ bias coordinate is always 1)
    bias_idx = [o * (HID + 1) + HID for o in range(OUT)]
    np.testing.assert_allclose(approx[np.ix_(bias_idx, bias_idx)], exact[np.ix_(bias_idx, bias_idx)], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["exact", "exact_GGN"])
def test_squared_error_g_is_the_mean_over_the_batch(mode):
    """Squared error with variance 2, six examples: G of the output layer is the mean output
    Fisher I / variance and the hidden layer's 1/N sum_n D_n W2^T W2 D_n / variance (D_n the
    tanh derivative). The exact seeds e_k / sqrt(variance) read no z and were one [1, OUT] row:
    G came out 1/N of this (0.0833 for 0.5), which N = 1 tests cannot see."""
    model, params = _tiny_mlp()
    plan = kc.compile(model, loss="squared_error", output="logits", emit=False, loss_options={"variance": 2.0})
    x = np.random.default_rng(1).normal(size=(6, IN))
    stats = _statistics(plan, x, np.zeros((6, OUT), np.float32), mode)
    np.testing.assert_allclose(stats["stat/fc2/G"], np.eye(OUT) / 2.0, rtol=1e-5, atol=1e-7)
    d = 1 - np.tanh(x @ params["fc1.weight"].T + params["fc1.bias"]) ** 2
    w2 = params["fc2.weight"]
    want = sum(np.diag(d[n]) @ w2.T @ w2 @ np.diag(d[n]) for n in range(6)) / 6 / 2.0
    np.testing.assert_allclose(stats["stat/fc1/G"], want, rtol=1e-4, atol=1e-6)


def test_empirical_mode_is_the_outer_product_of_the_data_gradient(tiny):
    plan, params = tiny
    x = np.array([[0.5, 0.1, -0.4]])
    y = np.array([2])
    stats = _statistics(plan, x, y, "empirical")
    z = _forward(params, x)
    dz = make_loss("softmax_cross_entropy").np_grad(z, y)[0]
    for layer in ("fc1", "fc2"):
        j = _layer_jacobian(params, x[0], layer)
        g = j.T @ dz
        np.testing.assert_allclose(np.kron(stats[f"stat/{layer}/G"], stats[f"stat/{layer}/A"]), np.outer(g, g),
                                   rtol=1e-4, atol=1e-6)


def test_diagonal_blocks_equal_the_diagonal_of_the_exact_fisher():
    model, params = _tiny_mlp(3)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False,
                      layers={"fc1": "diagonal", "fc2": "diagonal"})
    x = np.random.default_rng(4).normal(size=(5, IN))
    stats = _statistics(plan, x, np.zeros(5, np.int64), "exact")
    for layer in ("fc1", "fc2"):
        diag = stats[f"stat/{layer}/diag"].reshape(-1)
        np.testing.assert_allclose(diag, np.diag(_exact_fisher(params, x, layer)), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", ["gradients", "curvature_prop"])
def test_sampled_estimates_converge_to_the_exact_factor(tiny, mode):
    """One example repeated N times: each copy is an independent sample; the error of the
    sampled G shrinks like 1/sqrt(N) towards the exact G."""
    plan, params = tiny
    x1 = np.array([[0.3, -1.2, 0.8]])
    exact_g = _statistics(plan, x1, np.array([0]), "exact")["stat/fc1/G"]
    errors = []
    for n in (50, 5000):
        g = _statistics(plan, np.repeat(x1, n, axis=0), np.zeros(n, np.int64), mode, seed=n)["stat/fc1/G"]
        errors.append(np.abs(g - exact_g).max() / np.abs(exact_g).max())
    assert errors[1] < 0.05
    assert errors[1] < errors[0] / 3


@pytest.mark.parametrize("mode", ["exact", "empirical"])
@pytest.mark.parametrize("n,rows", [(6, [0, 2, 4]), (7, [0, 2, 4]), (8, [0, 2, 5]), (3, [0, 1, 2])])
def test_stats_batch_equals_the_statistics_of_every_kth_example(tiny, mode, n, rows):
    """stats_batch=m estimates the factors on a clone of the forward graph fed m of the
    batch's N examples spread evenly, rows floor(k N / m) (8 rows, m = 3: 0, 2, 5, where every
    (N // m)-th took 0, 2, 4; the rows a data-parallel run's ranks take too): the same numbers
    as running the statistics on those examples alone."""
    plan, _ = tiny
    x = np.random.default_rng(7).normal(size=(n, IN))
    y = np.array([0, 2, 1, 1, 0, 2, 1, 0])[:n]
    sliced = _statistics(plan, x, y, mode, stats_batch=3)
    alone = _statistics(plan, x[rows], y[rows], mode)
    for layer in ("fc1", "fc2"):
        for f in ("A", "G"):
            np.testing.assert_allclose(sliced[f"stat/{layer}/{f}"], alone[f"stat/{layer}/{f}"], rtol=1e-5, atol=1e-7)
    if n > 3:
        assert not np.allclose(_statistics(plan, x, y, mode)["stat/fc2/A"], alone["stat/fc2/A"])
