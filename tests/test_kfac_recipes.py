"""K-FAC's everyday recipe options: gradient clipping by global norm (clip_norm, before the
preconditioner) and decoupled weight decay (decoupled_weight_decay, AdamW's, outside it).
Truth: the update computed by hand in float64 numpy from kc.gradients and the factor slots
(the damped Kronecker inverse of each block, the pi split of docs/conventions.md), and the
quadratic model's algebra (a clipped gradient s g gives s times the unclipped step)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.errors import ConfigError
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.runtime import Trainer, gradients

LAYERS = ("fc1", "fc2", "fc3")


@pytest.fixture(scope="module")
def mlp():
    entry = ZOO["mlp_classifier"]
    plan = kc.compile(get_model("mlp_classifier", hidden=(16, 16)), loss=entry.loss, output="logits", emit=False)
    x, y = entry.make_data(128, seed=0)
    return plan, x["input"], y


def f64(values: dict) -> dict:
    return {p: np.asarray(v, np.float64) for p, v in values.items()}


def norm(v: dict) -> float:
    return math.sqrt(sum(float((a * a).sum()) for a in v.values()))


def precondition(state: dict, grads: dict, damping: float) -> dict:
    """(F + damping)^-1 g of the MLP's Kronecker blocks from the factor slots, in float64:
    [dW | db] -> (G + sqrt(d)/pi)^-1 [dW | db] (A + pi sqrt(d))^-1, pi^2 = (tr A/dim A)/(tr G/dim G)."""
    out = {}
    for layer in LAYERS:
        A, G = (np.asarray(state[f"factor/{layer}/{f}"], np.float64) for f in ("A", "G"))
        pi = math.sqrt((np.trace(A) / len(A)) / (np.trace(G) / len(G)))
        a_d = A + pi * math.sqrt(damping) * np.eye(len(A))
        g_d = G + math.sqrt(damping) / pi * np.eye(len(G))
        w, b = f"{layer}.weight", f"{layer}.bias"
        x = np.concatenate([grads[w], grads[b][:, None]], axis=1)
        y = np.linalg.solve(a_d.T, np.linalg.solve(g_d, x).T).T
        out[w], out[b] = y[:, :-1], y[:, -1]
    return out


def assert_close(got: dict, want: dict, rtol: float) -> None:
    scale = max(float(np.abs(v).max()) for v in want.values())
    for p in want:
        np.testing.assert_allclose(got[p], want[p], rtol=rtol, atol=rtol * scale, err_msg=p)


@pytest.mark.parametrize("clip", [0.05, 100.0], ids=["clipped", "under-the-norm"])
def test_regular_kfac_clips_before_preconditioning_and_decays_outside_it(mlp, clip):
    """Two steps of momentum_type "regular" (fixed lr and momentum): u_k = -lr P(s_k g_k) +
    mu u_{k-1}, s_k = min(1, c / |g_k|), P = (F + damping)^-1 from the first batch's factors
    (refreshed every 10 steps); theta_{k+1} = (1 - lr w) theta_k + u_k; velocity = u_k;
    grad_norm = |g_k| before clipping."""
    plan, x, y = mlp
    lr, mu, wd, damping = 0.2, 0.5, 0.5, 0.1
    tr = Trainer(plan, optimizer="kfac", learning_rate=lr, momentum=mu, damping=damping, clip_norm=clip,
                 decoupled_weight_decay=wd, stats_batch_size=None, threads=1)
    theta = f64(tr.parameters())
    u_prev = {p: np.zeros_like(v) for p, v in theta.items()}
    factors = None
    scales = []
    for k in range(2):
        xb, yb = {"input": x[64 * k:64 * (k + 1)]}, y[64 * k:64 * (k + 1)]
        _, g = gradients(plan, xb, yb, params=tr.parameters())
        g = f64(g)
        m = tr.step(xb, yb)
        if factors is None:  # the first step's inverses: its own batch's factors, kept for step 2
            factors = tr.state()
        s = min(1.0, clip / norm(g))
        scales.append(s)
        P = precondition(factors, {p: s * v for p, v in g.items()}, damping)
        u = {p: -lr * P[p] + mu * u_prev[p] for p in theta}
        want = {p: (1 - lr * wd) * theta[p] + u[p] for p in theta}
        assert m["rejected"] == 0 and m["grad_norm"] == pytest.approx(norm(g), rel=1e-5)
        assert_close(f64(tr.parameters()), want, rtol=1e-5)
        assert_close(f64({p: tr.store.to_numpy(f"velocity/{p}") for p in theta}), u, rtol=1e-5)
        theta, u_prev = f64(tr.parameters()), u
    assert (max(scales) < 1) == (clip < 1)  # the small norm clips both steps, the large one neither


@pytest.fixture(scope="module")
def first_steps(mlp):
    """One qmodel step on the first batch without clipping or decay: (theta0, metrics, theta1)."""
    plan, x, y = mlp
    knobs = dict(adapt_damping=False, max_predicted_decrease=None, stats_batch_size=None, threads=1)
    tr = Trainer(plan, optimizer="kfac", **knobs)
    theta0 = f64(tr.parameters())
    m = tr.step({"input": x[:64]}, y[:64])
    return knobs, theta0, m, f64(tr.parameters())


@pytest.mark.slow
def test_qmodel_takes_the_clipped_gradient_and_predicts_with_the_raw_one(mlp, first_steps):
    """The quadratic model minimizes its value with the clipped gradient s g: on the first step
    (no velocity) alpha is the unclipped model's and the update s times its update (with the
    raw gradient in the linear term alpha would be 1/s times larger and the clipping undone).
    The predicted change is the model of the true objective at that update: with u0 the
    unclipped optimum, g.u0 = 2 m0 and u0.C u0 = -2 m0, so m(s u0) = (2 s - s^2) m0 (the
    clipped gradient's model would say s^2 m0)."""
    plan, x, y = mlp
    knobs, theta0, m0, theta1 = first_steps
    _, g = gradients(plan, {"input": x[:64]}, y[:64])
    s = 0.3
    tr = Trainer(plan, optimizer="kfac", clip_norm=s * norm(f64(g)), **knobs)
    m = tr.step({"input": x[:64]}, y[:64])
    u0 = {p: theta1[p] - theta0[p] for p in theta0}
    assert m["rejected"] == 0 and m["learning_rate"] == pytest.approx(m0["learning_rate"], rel=1e-4)
    assert_close({p: v - theta0[p] for p, v in f64(tr.parameters()).items()}, {p: s * v for p, v in u0.items()},
                 rtol=1e-5)
    assert m["qmodel_change"] == pytest.approx((2 * s - s * s) * m0["qmodel_change"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-6)


def test_qmodel_decays_the_weights_by_its_learning_rate(mlp, first_steps):
    """decoupled_weight_decay w with the quadratic model: theta1 = (1 - alpha w) theta0 + u,
    alpha the step's learning rate (metric learning_rate) and u the update the step takes
    without decay (the model does not see the decay); the velocity is u."""
    plan, x, y = mlp
    knobs, theta0, m0, theta1 = first_steps
    wd = 0.05
    tr = Trainer(plan, optimizer="kfac", decoupled_weight_decay=wd, **knobs)
    m = tr.step({"input": x[:64]}, y[:64])
    alpha = m["learning_rate"]
    assert m["rejected"] == 0 and alpha == pytest.approx(m0["learning_rate"], rel=1e-5) and alpha > 0.05
    u = {p: theta1[p] - theta0[p] for p in theta0}
    assert_close(f64(tr.parameters()), {p: (1 - alpha * wd) * theta0[p] + u[p] for p in theta0}, rtol=1e-5)
    assert_close(f64({p: tr.store.to_numpy(f"velocity/{p}") for p in theta0}), u, rtol=1e-5)


@pytest.mark.slow
def test_loss_after_with_l2_and_decay_is_the_objective_at_the_undecayed_update(mlp):
    """Damping adaptation's loss after the step with l2_reg and decoupled decay: the batch's
    loss at theta0 + u (u the update, which the decay-free run takes; the quadratic model does
    not describe the decay) plus l2 (|theta0 + u|^2 - |theta0|^2) / 2, the change of the
    objective the model describes; the parameters applied are the decayed ones."""
    plan, x, y = mlp
    l2, wd = 1e-2, 0.2
    knobs = dict(optimizer="kfac", l2_reg=l2, reject_increase=False, stats_batch_size=None, threads=1)
    tr = Trainer(plan, decoupled_weight_decay=wd, **knobs)
    plain = Trainer(plan, **knobs)
    theta0 = f64(tr.parameters())
    xb, yb = {"input": x[:64]}, y[:64]
    m = tr.step(xb, yb)  # step 0 adapts the damping: it reports new_loss
    plain.step(xb, yb)
    moved = f64(plain.parameters())  # theta0 + u
    want = plain.evaluate(xb, yb)["loss"] + l2 / 2 * (norm(moved) ** 2 - norm(theta0) ** 2)
    alpha = m["learning_rate"]
    assert m["rejected"] == 0 and alpha > 0.05  # a decay that matters: alpha w > 1%
    assert m["new_loss"] == pytest.approx(want, rel=2e-6)
    assert_close(f64(tr.parameters()), {p: moved[p] - alpha * wd * theta0[p] for p in theta0}, rtol=1e-5)


@pytest.mark.slow
def test_decay_with_alpha_w_above_one_zeroes_the_weights_instead_of_flipping_them(mlp, first_steps):
    """alpha w is capped at 1: (1 - alpha w) theta never turns theta's sign (with w = 30 and
    alpha > 0.05 the factor was below -0.5), and the host's last_decay, which a checkpoint
    stores and a roll-back divides by, stays in [0, 1]."""
    plan, x, y = mlp
    knobs, theta0, m0, theta1 = first_steps
    tr = Trainer(plan, optimizer="kfac", decoupled_weight_decay=30.0, **knobs)
    m = tr.step({"input": x[:64]}, y[:64])
    assert m["rejected"] == 0 and m["learning_rate"] * 30.0 > 1.5
    assert_close(f64(tr.parameters()), {p: theta1[p] - theta0[p] for p in theta0}, rtol=1e-5)  # 0 theta + u
    assert tr.policy.last_decay == 1.0


@pytest.mark.parametrize("knobs,message", [
    (dict(clip_norm=0.0), "optimizer option 'clip_norm' must be > 0, got 0.0"),
    (dict(clip_norm=float("inf")), "optimizer option 'clip_norm' must be a finite number"),
    (dict(decoupled_weight_decay=-0.1), "optimizer option 'decoupled_weight_decay' must be >= 0, got -0.1"),
    (dict(decoupled_weight_decay="0.1"), "optimizer option 'decoupled_weight_decay' must be a number"),
])
def test_bad_kfac_recipe_values_are_one_line(mlp, knobs, message):
    plan, _, _ = mlp
    with pytest.raises(ConfigError) as e:
        Trainer(plan, optimizer="kfac", **knobs)
    assert message in str(e.value) and "\n" not in str(e.value)
