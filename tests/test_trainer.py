"""Trainer, optimizers and the Curvature API on real plans of the model zoo, with real ONNX
Runtime sessions (CPU; the CUDA comparisons are in test_cuda.py)."""
from __future__ import annotations

import math
import re

import numpy as np
import onnxruntime as ort
import pytest

import kfac_compiler as kc
from helpers import zoo_plan
from kfac_compiler.errors import ConfigError, DataError, PlanError
from kfac_compiler.models import ZOO
from kfac_compiler.optimizers import (
    AdamConfig,
    KfacConfig,
    SgdConfig,
    ema_coefficient,
    lm_adapt,
    make_config,
    reduction_ratio,
)
from kfac_compiler.runtime import Curvature, Trainer, gradients


def _plan(name):
    e = ZOO[name]
    return kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)


@pytest.fixture(scope="module")
def mlp():
    plan = _plan("mlp_classifier")
    inputs, y = ZOO["mlp_classifier"].make_data(None, seed=0)
    return plan, inputs["input"], y


@pytest.fixture(scope="module")
def ae():
    plan = _plan("digits_autoencoder")
    inputs, y = ZOO["digits_autoencoder"].make_data(None, seed=0)
    return plan, inputs["input"], y


def batches(x, y, bs, steps, seed=0):
    n = len(y)
    for s in range(steps):
        idx = np.random.default_rng([seed, s]).choice(n, bs, replace=False)
        yield {"input": x[idx]}, y[idx]


def train(plan, x, y, optimizer, steps, bs, seed=0, **kw):
    tr = Trainer(plan, optimizer=optimizer, seed=seed, **kw)
    for inputs, t in batches(x, y, bs, steps, seed):
        tr.step(inputs, t)
    return tr


# ----------------------------------------------------------------------------- host logic
def test_ema_coefficient_is_zero_debiased():
    c, w = ema_coefficient(0.0, 0.95)
    assert c == pytest.approx(1.0) and w == pytest.approx(0.05)
    # the moving average of a constant is that constant from the first step on
    f, w = 0.0, 0.0
    for _ in range(5):
        c, w = ema_coefficient(w, 0.95)
        f = f + c * (3.0 - f)
        assert f == pytest.approx(3.0)
    c2, _ = ema_coefficient(w, 0.95)
    assert c2 < c


def test_levenberg_marquardt_rule():
    cfg = make_config("kfac", None, damping=1e-2, min_damping=1e-4)
    omega = 0.95**5
    assert cfg.omega == pytest.approx(omega)
    assert lm_adapt(1e-2, 0.9, cfg) == pytest.approx(1e-2 * omega)
    assert lm_adapt(1e-2, 0.1, cfg) == pytest.approx(1e-2 / omega)
    assert lm_adapt(1e-2, 0.5, cfg) == 1e-2
    assert lm_adapt(1e-2, float("nan"), cfg) == pytest.approx(1e-2 / omega)
    assert lm_adapt(1e-4, 0.9, cfg) == 1e-4  # clamped at min_damping
    # rho: actual over predicted change, the damping term taken out by default
    assert reduction_ratio(1.0, 0.9, -0.2, 0.0, 1.0, False) == pytest.approx(0.5)
    assert reduction_ratio(1.0, 0.9, -0.1, 1.0, 0.2, False) == pytest.approx(0.5)
    assert reduction_ratio(1.0, 0.9, -0.1, 1.0, 0.2, True) == pytest.approx(1.0)
    # an update below float32's resolution measures nothing: agreement (1), not 0 / tiny = 0
    assert reduction_ratio(0.5, 0.5, -1e-9, 0.0, 1.0, False) == 1.0  # the loss did not move at all
    assert reduction_ratio(0.5, 0.5 - 2e-8, -3e-8, 0.0, 1.0, False) == 1.0  # within 16 ulps of 0.5 (6e-8 an ulp)
    assert reduction_ratio(0.5, 0.5 - 2e-6, -3e-8, 0.0, 1.0, False) == pytest.approx(2e-6 / 3e-8)  # it moved


@pytest.mark.slow
def test_the_damping_comes_down_from_max_damping():
    """At max_damping (where a run of rejected steps puts it) an update rounds away in float32:
    the loss after it equals the loss before. rho counts that as agreement, so Levenberg-
    Marquardt lowers the damping (it had read rho = 0 and raised it for good)."""
    plan = zoo_plan("mlp_classifier", hidden=(16, 16))
    x, y = ZOO["mlp_classifier"].make_data(1024, seed=0)
    tr = Trainer(plan, optimizer="kfac", threads=1, seed=0, damping=1e8)
    for s in range(60):
        rows = slice(64 * (s % 16), 64 * (s % 16 + 1))
        m = tr.step({"input": x["input"][rows]}, y[rows])
    assert m["damping"] < 1e8 * 0.95 ** 50  # the rule's pace: one omega = 0.95^5 every 5th step


def test_optimizer_defaults_and_validation():
    sgd = make_config("sgd")
    assert (sgd.learning_rate, sgd.momentum) == (0.1, 0.9)
    adam = make_config("adam", learning_rate=3e-3)
    assert (adam.beta1, adam.beta2, adam.epsilon) == (0.9, 0.999, 1e-8)
    assert adam.lr_at(1) == pytest.approx(3e-3 * math.sqrt(1 - 0.999) / (1 - 0.9))
    k = make_config("kfac")
    assert isinstance(k, KfacConfig) and k.use_qmodel and k.adapt_damping and k.learning_rate is None
    k = make_config("kfac", learning_rate=0.01)
    assert not k.use_qmodel and k.momentum == 0.9 and not k.adapt_damping
    assert make_config("kfac", initial_damping=0.5).damping == 0.5  # kfac-jax spelling
    with pytest.raises(ConfigError):
        make_config("kfac", learning_rate=0.1, use_qmodel=True)
    with pytest.raises(ConfigError):
        make_config("kfac", use_qmodel=False)
    with pytest.raises(ConfigError):
        make_config("kfac", norm_constraint=1e-3)  # KL clipping needs a fixed learning rate
    with pytest.raises(ConfigError):
        make_config("kfac", bogus=1)
    with pytest.raises(ConfigError):
        make_config("kfac", cov_ema_decay=1.5)
    with pytest.raises(ConfigError):
        make_config("lbfgs")
    assert isinstance(make_config("sgd"), SgdConfig) and isinstance(make_config("adam"), AdamConfig)


def test_plan_defaults_are_used(mlp):
    plan, _, _ = mlp
    cfg = make_config("kfac", plan)
    assert cfg.damping == plan.schedule.damping
    assert cfg.inv_update_period == plan.schedule.inverse.update_period
    assert cfg.cov_ema_decay == plan.schedule.ema_decay
    assert cfg.mode == plan.estimator.mode


# ----------------------------------------------------------------------------- steps
def test_kfac_step_keeps_state_on_device_and_reports_metrics(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", device="cpu", inv_update_period=3)
    assert all(s in tr.store for s in ("velocity/fc1.weight", "factor/fc1/A", "factor/fc1/G"))
    assert any(s.startswith("inverse/fc1/") for s in tr.store.slots())
    p0 = tr.parameters()
    it = batches(x, y, 64, 6)
    m = tr.step(*next(it))
    for k in ("loss", "damping", "learning_rate", "momentum", "update_norm", "grad_norm", "rejected"):
        assert k in m and isinstance(m[k], float)
    assert m["rejected"] == 0 and m["inverse"] == 1 and m["stats"] == 1 and math.isfinite(m["rho"])
    assert m["loss"] == pytest.approx(2.3, abs=0.3)  # ~log(10) at init
    p1 = tr.parameters()
    assert any(not np.array_equal(p0[k], p1[k]) for k in p0)
    # factor A of fc1 = E[a~ a~^T] of the first batch (zero-debiased EMA: c_1 = 1)
    A = tr.store.to_numpy("factor/fc1/A")
    assert A.shape == (65, 65) and A[-1, -1] == pytest.approx(1.0)
    # steady state: only data (input, targets, noise) and changed hp scalars are uploaded (the
    # spike guard's hp/loss_limit follows the recent losses: one scalar more)
    tr.step(*next(it))
    before = tr.store.uploads
    tr.step(*next(it))  # step 2: fused kfac_step, no inverse
    assert tr.store.uploads - before <= 5
    assert tr.step_count == 3



def test_kfac_noise_is_drawn_into_its_input_and_changes_nothing(mlp, monkeypatch):
    """On the CPU the sampled-Fisher noise is drawn straight into the step's input buffer: it
    holds the draw of the trainer's stream (numpy's clip of its uniforms), and 30 steps give
    bitwise the parameters and losses of the same run that draws new arrays and copies them."""
    from kfac_compiler import contract as C
    from kfac_compiler.runtime.data import NOISE_EPS
    from kfac_compiler.runtime.state import StateStore

    plan, x, y = mlp

    def run():
        tr = Trainer(plan, optimizer="kfac", seed=3, batch_size=64)
        losses = [tr.step(*b)["loss"] for b in batches(x, y, 64, 30)]
        return tr, losses

    tr, losses = run()
    params = tr.parameters(layout="plan")
    (noise,) = [n for n in tr.policy.step_program().data_inputs if C.is_noise(n)]
    shape = tuple(tr.store.data(noise).shape())
    rng = np.random.default_rng()
    rng.bit_generator.state = tr.rng.bit_generator.state
    tr.step(*next(batches(x, y, 64, 1)))  # step 30: statistics (cov_update_period 1), no refresh before
    expected = np.clip(rng.random(shape, dtype=np.float32), NOISE_EPS, np.float32(1) - NOISE_EPS)
    np.testing.assert_array_equal(tr.store.data(noise).numpy(), expected)
    monkeypatch.setattr(StateStore, "host_buffer", lambda self, *a, **k: None)  # allocate and copy
    tr2, losses2 = run()
    assert losses2 == losses
    for p, v in tr2.parameters(layout="plan").items():
        assert np.array_equal(v, params[p]), p

@pytest.mark.slow
def test_factor_moving_average_matches_numpy(mlp):
    """factor/fc1/A after two steps = (1 - c) A_0 + c A_1 with A_k = [x 1]^T [x 1] / 64 over
    the statistics sub-batch (every other one of 128 examples: 64) and c the zero-debiased
    coefficient: step 1's fused kfac_step folds this into one Gemm; numpy in float64."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac")
    assert tr.config.stats_batch_size == 64
    data = list(batches(x, y, 128, 2))
    for inputs, t in data:
        tr.step(inputs, t)

    def batch_A(inputs):
        rows = np.hstack([inputs["input"][::2].astype(np.float64), np.ones((64, 1))])
        return rows.T @ rows / 64

    c0, w = ema_coefficient(0.0, tr.config.cov_ema_decay)
    c1, _ = ema_coefficient(w, tr.config.cov_ema_decay)
    assert c0 == 1.0 and 0.0 < c1 < 1.0
    want = (1 - c1) * batch_A(data[0][0]) + c1 * batch_A(data[1][0])
    got = tr.store.to_numpy("factor/fc1/A")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_overflowing_step_is_rejected_keeps_state_and_raises_damping(mlp):
    """A finite input so large that the forward pass overflows to Inf/NaN inside the graph:
    the step is rejected, every state slot is kept and the damping goes up x10."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac")
    it = batches(x, y, 64, 3)
    tr.step(*next(it))
    tr.step(*next(it))
    params, state, damping = tr.parameters(), tr.state(), tr.damping
    inputs, t = next(it)
    bad = inputs["input"].copy()
    bad[3, :] = 3e38
    m = tr.step({"input": bad}, t)
    assert m["rejected"] == 1.0 and m.get("rolled_back", 0.0) == 0.0  # the batch is bad, not the last update
    after = tr.parameters()
    assert all(np.array_equal(params[k], after[k]) for k in params)
    # velocity and factors are kept too
    now = tr.state()
    assert all(np.array_equal(state[k], now[k]) for k in state)
    assert tr.damping == pytest.approx(damping * 10)
    m = tr.step(inputs, t)  # a clean batch trains again
    assert m["rejected"] == 0.0


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_gradient_whose_square_overflows_is_rejected(mlp, optimizer):
    """Inputs of 1e20: loss and gradient finite (~1e20), the gradient's square beyond float32.
    Adam took the step (its update m / (sqrt(inf) + eps) is 0, finite), its v became inf and
    those coordinates never moved again; now the step is rejected like SGD's and every slot
    is kept, and the next clean batch trains every coordinate."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer=optimizer, learning_rate=1e-2)
    it = batches(x, y, 64, 3)
    tr.step(*next(it))
    before = tr.state()
    inputs, t = next(it)
    m = tr.step({"input": inputs["input"] * np.float32(1e20)}, t)
    assert np.isfinite(m["loss"]) and m["grad_norm"] == np.inf and m["rejected"] == 1.0
    assert all(np.array_equal(before[k], v) for k, v in tr.state().items())
    tr.step(*next(it))
    moved = {k: np.abs(v - before[k]) > 0 for k, v in tr.parameters().items()}
    assert np.mean(moved["fc1.weight"]) > 0.5  # pixels that are 0 in every example leave their columns


def test_nan_input_is_a_one_line_data_error(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac")
    inputs, t = next(batches(x, y, 64, 1))
    bad = inputs["input"].copy()
    bad[3, 7] = np.nan
    with pytest.raises(DataError, match="NaN/Inf"):
        tr.step({"input": bad}, t)
    with pytest.raises(DataError, match="labels in"):
        tr.step(inputs, t + 100)
    with pytest.raises(DataError, match="without its last axis"):
        tr.step(inputs, t[:, None])


def test_nan_parameter_rejects_step(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac")
    it = batches(x, y, 64, 3)
    tr.step(*next(it))
    w = tr.parameters()["fc2.weight"]
    w[0, 0] = np.nan
    with pytest.raises(DataError, match=r"^parameter 'fc2.weight' holds 1 NaN/Inf value\(s\)$"):
        tr.set_parameters({"fc2.weight": w})  # the API refuses it: put it in the device state directly
    tr.store.set("fc2.weight", w)
    before, damping = tr.state(), tr.damping
    m = tr.step(*next(it))
    assert m["rejected"] == 1.0 and tr.damping == pytest.approx(10 * damping)
    after = tr.state()
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["small_cnn", "depthwise_cnn", "unrolled_rnn", "transformer_block"])
def test_kfac_runs_every_zoo_model(name):
    e = ZOO[name]
    plan = _plan(name)
    inputs, y = e.make_data(256, seed=0)
    tr = Trainer(plan, optimizer="kfac", inv_update_period=4)
    ms = [tr.step({k: v[i:i + 64] for k, v in inputs.items()}, y[i:i + 64]) for i in range(0, 256, 64)]
    assert all(m["rejected"] == 0 and math.isfinite(m["loss"]) for m in ms)
    ev = tr.evaluate(inputs, y)
    assert ev["loss"] < ms[0]["loss"] and 0 <= ev["accuracy"] <= 1


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_baselines_reject_nan_and_train(mlp, opt):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer=opt, learning_rate=0.05 if opt == "sgd" else 3e-3)
    it = list(batches(x, y, 64, 30))
    losses = [tr.step(*b)["loss"] for b in it]
    assert losses[-1] < 0.5 * losses[0]
    p = tr.parameters()
    bad = {"input": np.full_like(it[0][0]["input"], 3e38)}  # finite, overflows inside the graph
    m = tr.step(bad, it[0][1])
    assert m["rejected"] == 1.0
    assert all(np.array_equal(p[k], v) for k, v in tr.parameters().items())


def test_kfac_fixed_learning_rate_with_norm_constraint(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", learning_rate=0.1, momentum=0.5, norm_constraint=1e-2, damping=0.1)
    ms = [tr.step(*b) for b in batches(x, y, 128, 40)]
    assert all(m["rejected"] == 0 for m in ms)
    assert ms[-1]["loss"] < 0.5 * ms[0]["loss"]
    assert ms[-1]["momentum"] == pytest.approx(0.5)


def test_burn_in_and_stats_period(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", burn_in_steps=2, cov_update_period=2, inv_update_period=4)
    p0 = tr.parameters()
    it = batches(x, y, 64, 8)
    for _ in range(2):
        m = tr.step(*next(it))
        assert m["burn_in"] == 1.0
    assert all(np.array_equal(p0[k], v) for k, v in tr.parameters().items())
    assert np.abs(tr.store.to_numpy("factor/fc2/G")).sum() > 0
    stats = [tr.step(*b)["stats"] for b in it]
    assert stats == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert tr.step_count == 6 and tr.burn_in_count == 2


@pytest.mark.slow
def test_evaluate_export_and_predict(mlp, tmp_path):
    plan, x, y = mlp
    tr = train(plan, x, y, "kfac", 20, 128)
    ev = tr.evaluate({"input": x}, y, batch_size=500)
    ev_all = tr.evaluate({"input": x}, y)
    assert ev["loss"] == pytest.approx(ev_all["loss"], rel=1e-5)
    assert 0.8 < ev["accuracy"] <= 1.0
    path = tr.export(tmp_path / "trained.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(["logits"], {"input": x})
    acc = float(np.mean(np.argmax(logits, -1) == y))
    assert acc == pytest.approx(ev["accuracy"])
    z = logits - logits.max(-1, keepdims=True)
    ce = -np.mean(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(-1)))
    assert ce == pytest.approx(ev["loss"], rel=1e-4)
    assert [p.name for p in tmp_path.iterdir()] == ["trained.onnx"]  # atomic: no temp file left
    np.testing.assert_allclose(tr.predict({"input": x[:5]}), logits[:5], rtol=1e-5, atol=1e-6)


def test_predict_keeps_one_session_that_reads_the_current_parameters(mlp):
    """predict runs the `predict` subgraph, built once and bound to the state like evaluate's:
    after each step its output is ONNX Runtime's on the exported model, computed
    independently, and no session is added."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.5)
    before = tr.predict({"input": x[:5]})
    sessions = len(tr.programs())
    for k in range(2):
        tr.step({"input": x[64 * k:64 * (k + 1)]}, y[64 * k:64 * (k + 1)])
        sess = ort.InferenceSession(tr.exported_model().SerializeToString(), providers=["CPUExecutionProvider"])
        (logits,) = sess.run(["logits"], {"input": x[:5]})
        np.testing.assert_allclose(tr.predict({"input": x[:5]}), logits, rtol=1e-5, atol=1e-6)
    assert not np.allclose(before, logits) and len(tr.programs()) == sessions and "predict" in tr.programs()


def test_bad_batches_raise_data_error(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="sgd")
    with pytest.raises(DataError, match="input"):
        tr.step({"pixels": x[:4]}, y[:4])
    with pytest.raises(DataError):
        tr.step({"input": x[:4, :10]}, y[:4])
    with pytest.raises(DataError):
        tr.step({"input": x[:4]}, y[:5])


def _adam_best(plan, x, y, steps, bs):
    best = math.inf
    for lr in (1e-3, 3e-3, 1e-2):
        tr = train(plan, x, y, "adam", steps, bs, learning_rate=lr)
        best = min(best, tr.evaluate({"input": x}, y)["loss"])
    return best


@pytest.mark.slow
def test_kfac_beats_tuned_adam_on_digits_classifier(mlp):
    plan, x, y = mlp
    steps, bs = 60, 128
    kfac_loss = train(plan, x, y, "kfac", steps, bs).evaluate({"input": x}, y)["loss"]
    adam_loss = _adam_best(plan, x, y, steps, bs)
    assert kfac_loss < 0.5 * adam_loss, (kfac_loss, adam_loss)


@pytest.mark.slow
def test_kfac_beats_tuned_adam_on_digits_autoencoder(ae):
    plan, x, y = ae
    steps, bs = 80, 256
    kfac_loss = train(plan, x, y, "kfac", steps, bs).evaluate({"input": x}, y)["loss"]
    adam_loss = _adam_best(plan, x, y, steps, bs)
    assert kfac_loss < adam_loss - 1.0, (kfac_loss, adam_loss)


@pytest.mark.slow
def test_kfac_stays_stable_for_long_runs(mlp):
    plan, x, y = mlp
    for seed in (0, 1):
        tr = train(plan, x, y, "kfac", 600, 128, seed=seed)
        assert tr.evaluate({"input": x}, y)["loss"] < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("bs,final", [(16, 0.05), (32, 0.05), (64, 1e-2), (256, 1e-2)])
def test_kfac_defaults_do_not_diverge_at_small_or_large_batches(mlp, bs, final):
    """Regression: small batches ran away (|mu| up to 1e5, loss 1e28, then every step
    rejected) before the momentum cap; batch 256 diverged with a quadratic model that mixed
    the whole batch's gradient with a sub-batch's curvature (the default model is the
    64-example sub-batch's own); batches 16 (seeds 0, 1) and 32 (seed 0) still ran away, from
    a step whose model promised a decrease of 10-15x the loss, before max_predicted_decrease.
    Batches 16 and 32 are noisier: a looser final loss (measured 0.009-0.04)."""
    plan, x, y = mlp
    for seed in (0, 1):
        tr = Trainer(plan, optimizer="kfac", seed=seed, batch_size=bs)
        ms = [tr.step(inputs, t) for inputs, t in batches(x, y, bs, 200, seed)]
        assert sum(m["rejected"] for m in ms) <= 5
        assert max(abs(m["momentum"]) for m in ms if not m["rejected"]) <= 1.0 + 1e-6
        assert tr.evaluate({"input": x}, y)["loss"] < final


# ----------------------------------------------------------------------------- curvature API
def test_gradients_match_numpy_for_last_layer(mlp):
    plan, x, y = mlp
    xb, yb = x[:32], y[:32]
    loss, grads = gradients(plan, {"input": xb}, yb)
    assert set(grads) == set(plan.trainable)
    tr = Trainer(plan, optimizer="sgd")
    h = tr.predict({"input": xb})
    z = h - h.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    assert loss == pytest.approx(float(-np.mean(np.log(p[np.arange(32), yb]))), rel=1e-5)
    onehot = np.eye(10, dtype=np.float32)[yb]
    np.testing.assert_allclose(grads["fc3.bias"], (p - onehot).mean(0), atol=1e-6)


def test_curvature_estimate_update_and_precondition(mlp):
    plan, x, y = mlp
    xb, yb = x[:40], y[:40]
    curv = Curvature(plan, device="cpu")
    stats = curv.estimate({"input": xb}, yb, mode="empirical")
    assert set(stats) == {"fc1", "fc2", "fc3"}
    a = np.concatenate([xb, np.ones((40, 1), np.float32)], 1)
    np.testing.assert_allclose(stats["fc1"]["A"], a.T @ a / 40, rtol=1e-5, atol=1e-6)
    # empirical G of the last layer: 1/N sum delta delta^T, delta = softmax - onehot
    h = Trainer(plan, optimizer="sgd").predict({"input": xb})
    p = np.exp(h - h.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d = p - np.eye(10, dtype=np.float32)[yb]
    np.testing.assert_allclose(stats["fc3"]["G"], d.T @ d / 40, rtol=1e-4, atol=1e-6)
    # sampled estimator: reproducible with the same seed
    s1 = Curvature(plan, seed=5).estimate({"input": xb}, yb)
    s2 = Curvature(plan, seed=5).estimate({"input": xb}, yb)
    np.testing.assert_array_equal(s1["fc2"]["G"], s2["fc2"]["G"])
    # moving averages + inverses + preconditioning; multiply undoes multiply_inverse
    curv.update({"input": xb}, yb)
    f = curv.factors()
    assert set(f["fc1"]) >= {"A", "G"}
    assert curv.update_inverses(damping=1e-2)
    _, grads = curv.gradients({"input": xb}, yb)
    pre = curv.precondition(grads)
    layer_grads = {k: grads[k] for k in ("fc2.weight", "fc2.bias")}
    host = curv.multiply_inverse("fc2", layer_grads)
    for k in layer_grads:
        np.testing.assert_allclose(pre[k], host[k], rtol=2e-3, atol=1e-5)
    back = curv.multiply("fc2", host, damping=1e-2)
    for k in layer_grads:
        np.testing.assert_allclose(back[k], layer_grads[k], rtol=2e-2, atol=2e-5)
    with pytest.raises(ConfigError):
        curv.estimate({"input": xb}, yb, mode="bogus")


@pytest.mark.slow
def test_host_side_eigh_inverses_match_emitted_inverses(mlp):
    """The host methods (eigh; cholesky, LAPACK on the host in float32) and the emitted
    schur ("auto" = the CPU default) follow the emitted inverse_op's trajectory."""
    plan, x, y = mlp
    losses = {}
    for method in ("eigh", "cholesky", "auto", "inverse_op"):
        tr = Trainer(plan, optimizer="kfac", inverse_method=method, inv_update_period=5)
        assert tr.inverse_method == ("schur" if method == "auto" else method)
        # host methods: every block is inverted on the host with its numpy twin
        host = {"fc1", "fc2", "fc3"} if method in ("eigh", "cholesky") else set()
        assert set(tr.policy.refresher.host_layers) == host
        ms = [tr.step(*b) for b in batches(x, y, 128, 12)]
        assert all(m["rejected"] == 0 for m in ms)
        assert [m["inverse_ok"] for m in ms if m["inverse"]] == [1.0, 1.0, 1.0]  # steps 0, 5, 10
        assert [m["inverse_fallbacks"] for m in ms if m["inverse"]] == [0.0, 0.0, 0.0]
        losses[method] = [m["loss"] for m in ms]
    # float32 rounding differences grow along a 12-step trajectory (2.2e-3 at step 8 with
    # the quadratic model on 64 of 128 examples); a wrong inverse differs by far more
    for method in ("eigh", "cholesky"):
        np.testing.assert_allclose(losses[method], losses["inverse_op"], rtol=5e-3)
    # schur's float32 inverses are ~5x less accurate than LU's or Cholesky's (2e-5 against
    # 4e-6 on fc3's input factor at cond 5e2), enough for the quadratic model to take another
    # branch by step 9 (losses 2.5% apart there): its first steps are compared, and its
    # inverses after a refresh below
    np.testing.assert_allclose(losses["auto"][:4], losses["inverse_op"][:4], rtol=1e-3)


def damped_inverse_errors(tr, layer, damping):
    """{"A"/"G": (max-entry relative error of the float32 inverse slot against the float64
    inverse of the pi-damped factor, A + pi sqrt(damping) I and G + sqrt(damping)/pi I; that
    damped factor's condition number)} for a kron layer of trainer `tr`."""
    A = tr.store.to_numpy(f"factor/{layer}/A").astype(np.float64)
    G = tr.store.to_numpy(f"factor/{layer}/G").astype(np.float64)
    pi = math.sqrt((np.trace(A) / len(A)) / (np.trace(G) / len(G)))
    s = math.sqrt(damping)
    out = {}
    for name, M, d in (("A", A, pi * s), ("G", G, s / pi)):
        inv = tr.store.to_numpy(f"inverse/{layer}/{name}_inv")
        assert inv.dtype == np.float32
        M = M + d * np.eye(len(M))
        ref = np.linalg.inv(M)
        out[name] = (np.abs(inv - ref).max() / np.abs(ref).max(), np.linalg.cond(M))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method,tol", [("cholesky", 1e-5), ("auto", 1e-4)])
def test_cpu_inverse_is_the_damped_factors_inverse(mlp, method, tol):
    """After a refresh the inverse slots hold (A + pi sqrt(lambda) I)^-1 and
    (G + sqrt(lambda)/pi I)^-1 of the current factors (float32: LAPACK on the host, and the
    CPU default schur emitted, to ~cond^2 eps32 with fc3's cond 4e2)."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", inv_update_period=4, inverse_method=method)
    ms = [tr.step(*b) for b in batches(x, y, 128, 5)]
    assert ms[4]["inverse"] == 1 and ms[4]["inverse_ok"] == 1.0  # refreshed after step 4
    for layer in ("fc1", "fc3"):
        # tr.damping: the damping adapted at step 4, which the refresh used
        for name, (err, _) in damped_inverse_errors(tr, layer, tr.damping).items():
            assert err <= tol, (layer, name, err)  # a 10% damping error: 5e-2


@pytest.mark.slow
def test_emitted_inverse_beyond_its_accuracy_falls_back_to_host_cholesky(mlp):
    """With damping 1e-9 the first refresh meets factors of cond > 1e5, where the CPU
    default schur's float32 probe residual exceeds linalg.SCHUR_TOL: those blocks are redone
    by LAPACK Cholesky on the host in float64, so every inverse slot holds the damped
    factor's inverse (schur's to ~cond^2 eps32; the fallback's to float32 rounding, where a
    float32 Cholesky's error grows like cond eps32) and inverse_ok stays 1."""
    plan, x, y = mlp
    d = 1e-9
    tr = Trainer(plan, optimizer="kfac", inv_update_period=100, damping=d, min_damping=d, adapt_damping=False)
    m = tr.step(*next(batches(x, y, 128, 1)))  # the first step: statistics, refresh, step
    fallbacks = tr.policy.refresher.fallbacks
    assert m["inverse_ok"] == 1.0 and m["inverse_fallbacks"] == len(fallbacks) and "fc3" in fallbacks
    # the emitted refresh alone rates those blocks not ok (and keeps their previous inverses)
    before = {p: tr.store.to_numpy(p) for p in tr.store.slots() if p.startswith("inverse/fc3/")}
    out = tr.policy.refresher.emitted.run(tr.store, hp={"hp/damping": d})
    assert [layer for layer in ("fc1", "fc2", "fc3") if out[f"metric/inverse_ok/{layer}"] < 0.5] == fallbacks
    for p, v in before.items():
        np.testing.assert_array_equal(tr.store.to_numpy(p), v)
    worst_cond = 0.0
    for layer in ("fc1", "fc2", "fc3"):
        for name, (err, cond) in damped_inverse_errors(tr, layer, d).items():
            assert err < (1e-5 if layer in fallbacks else 1e-2), (layer, name, err)  # schur's: at most 3.2e-3
            if layer in fallbacks:
                worst_cond = max(worst_cond, cond)
    assert worst_cond > 1e5


def test_saved_plan_directory_trains_like_the_in_memory_plan(tmp_path):
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits")  # with the default subgraphs
    plan.save(tmp_path / "plan")
    inputs, y = e.make_data(256, seed=0)
    x = inputs["input"]
    a = Trainer(plan, seed=4)
    b = Trainer(str(tmp_path / "plan"), seed=4)  # a path is loaded with load_plan
    for batch in batches(x, y, 64, 5):
        assert a.step(*batch)["loss"] == b.step(*batch)["loss"]


def test_sample_counts_and_empty_settings_are_refused(mlp):
    """num_samples has a ceiling (each sample is a backward pass of its own in every statistics
    update: 1e9 grew to gigabytes for minutes), for the Trainer and Curvature alike; Curvature's
    0 and "" are refused, not replaced by the plan's values."""
    plan = mlp[0]
    with pytest.raises(ConfigError, match="'num_samples' must be at most 64"):
        Trainer(plan, num_samples=10**9)
    with pytest.raises(PlanError, match="Trainer takes a compiled plan .* got int"):
        Trainer(3)
    for kw, words in [({"num_samples": 65}, "num_samples must be at most 64"),
                      ({"num_samples": 0}, "num_samples must be an integer >= 1, got 0"),
                      ({"inverse_method": ""}, "unknown inverse method ''")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            Curvature(plan, **kw)


def test_curvature_products_refuse_bad_vectors_and_arguments(mlp):
    """The lower-level API's products take finite vectors only (NaN came back as NaN), a
    strict transpose flag ('no' computed the transposed product), estimate's num_samples has
    the constructor's ceiling, and gradients() names a wrong params or plan type in one line."""
    from kfac_compiler.errors import DataError

    plan, x, y = mlp
    curv = Curvature(plan)
    curv.update({"input": x[:64]}, y[:64])
    curv.update_inverses(1e-2)
    curv.compute_cholesky(1e-2)
    v = {p: np.ones(s, np.float32) for p, s in curv._shapes(curv.params).items()}
    bad = {**v, "fc1.weight": np.full_like(v["fc1.weight"], np.nan)}
    layer = next(iter(curv.blocks()))
    mine = {p: bad[p] for p in curv.blocks()[layer].layer.params}
    for call in (lambda: curv.multiply(layer, mine), lambda: curv.multiply_inverse(layer, mine),
                 lambda: curv.multiply_matpower(layer, mine, 0.5), lambda: curv.multiply_all(bad)):
        with pytest.raises(DataError, match="NaN/Inf"):
            call()
    with pytest.raises(ConfigError, match="transpose must be True or False, got 'no'"):
        curv.multiply_cholesky(v, transpose="no")
    with pytest.raises(ConfigError, match="num_samples must be at most 64"):
        curv.estimate({"input": x[:64]}, y[:64], num_samples=65)
    with pytest.raises(ConfigError, match="params must be a dict"):
        gradients(plan, {"input": x[:8]}, y[:8], params=[1, 2])
    with pytest.raises(ConfigError, match="expected a compiled plan"):
        gradients("plan_dir", {"input": x[:8]}, y[:8])
