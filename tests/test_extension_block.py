"""A block defined outside the package (tests/extensions/scaled_identity.py) becomes
selectable by registering it, compiles into a plan and trains: the trainer's factors,
inverse state and parameters after each K-FAC step equal an independent numpy run of the
same algorithm (forward and backward of the MLP by hand, c = mean(a~^2) sum(delta^2) /
(N out), a zero-debiased moving average, theta <- theta - lr g / (c + damping))."""
from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
from onnx import numpy_helper

import kfac_compiler
from kfac_compiler.blocks import APPROXIMATIONS, unregister_block
from kfac_compiler.config import CompileConfig
from kfac_compiler.models import ZOO
from kfac_compiler.report import render
from kfac_compiler.runtime import Trainer

MODULE = "extensions.scaled_identity"
LAYERS = ("fc1", "fc2", "fc3")
LR, DAMPING, DECAY, STEPS, N = 0.1, 1e-2, 0.9, 4, 32


@pytest.fixture(scope="module")
def extension():
    """Import the extension (its @register_block runs); withdraw it afterwards so that the
    other test modules see the built-in menu."""
    module = importlib.reload(sys.modules[MODULE]) if MODULE in sys.modules else importlib.import_module(MODULE)
    yield module
    unregister_block(module.ScaledIdentity)


def test_registering_makes_it_selectable(extension):
    assert APPROXIMATIONS["fully_connected"][-1] == "scaled_identity"  # menu_rank 100: last
    assert APPROXIMATIONS["fully_connected_multi"][-1] == "scaled_identity"  # uses = "any"
    assert APPROXIMATIONS["fully_connected"][0] == "kron"  # the default is unchanged
    cfg = CompileConfig.from_dict({"approximations": {"fully_connected": "scaled_identity"}})
    assert cfg.approximations["fully_connected"] == "scaled_identity"


def numpy_step(theta: dict, x: np.ndarray, y: np.ndarray) -> tuple[dict, dict]:
    """Per layer: the statistic c and the gradient of the mean softmax cross-entropy, for
    the 64-128-128-10 ReLU MLP (Gemm, weights [out, in]) at theta, in float64."""
    acts, pre, h = [], [], x.astype(np.float64)
    for name in LAYERS:
        acts.append(h)
        z = h @ theta[f"{name}.weight"].T + theta[f"{name}.bias"]
        pre.append(z)
        h = np.maximum(z, 0.0)
    z = pre[-1]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    delta = p - np.eye(z.shape[1])[y]  # per example: N x the mean loss's gradient
    stats, grads = {}, {}
    for i in reversed(range(len(LAYERS))):
        name, a = LAYERS[i], acts[i]
        a_tilde = np.concatenate([a, np.ones((len(a), 1))], axis=1)
        stats[name] = np.mean(a_tilde**2) * np.sum(delta**2) / (len(a) * delta.shape[1])
        grads[f"{name}.weight"] = delta.T @ a / len(a)
        grads[f"{name}.bias"] = delta.mean(0)
        if i:
            delta = (delta @ theta[f"{name}.weight"]) * (pre[i - 1] > 0)
    return stats, grads


def test_compile_and_train_match_numpy(extension):
    entry = ZOO["mlp_classifier"]
    model = entry.build(seed=0)
    config = {"approximations": {"fully_connected": "scaled_identity"}, "estimator": {"mode": "empirical"}}
    plan = kfac_compiler.compile(model, loss=entry.loss, output="logits", config=config)
    assert [layer.approximation for layer in plan.layers] == ["scaled_identity"] * 3
    assert "scaled_identity" in render(plan, "table")
    # the spike guard off: the numpy twin is plain K-FAC, and its step 0 raises step 1's batch
    # loss 14x (2.49 -> 34.7), which the guard would rightly undo
    trainer = Trainer(plan, optimizer="kfac", device="cpu", learning_rate=LR, momentum=0.0, damping=DAMPING,
                      cov_ema_decay=DECAY, cov_update_period=1, inv_update_period=1, mode="empirical",
                      loss_spike_factor=None)

    theta = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    history: dict[str, list[float]] = {name: [] for name in LAYERS}
    inverse: dict[str, float] = {}
    for step in range(STEPS):
        inputs, targets = entry.make_data(n=N, seed=step)
        stats, grads = numpy_step(theta, inputs["input"], targets)
        for name in LAYERS:
            history[name].append(stats[name])
        weights = DECAY ** np.arange(step, -1, -1.0)  # zero-debiased moving average
        factor = {name: float(weights @ history[name] / weights.sum()) for name in LAYERS}
        if step == 0:  # the first step is preconditioned by its own batch
            inverse = {name: 1.0 / (factor[name] + DAMPING) for name in LAYERS}
        for name in LAYERS:
            for p in (f"{name}.weight", f"{name}.bias"):
                theta[p] = theta[p] - LR * inverse[name] * grads[p]
        metrics = trainer.step(inputs, targets)
        assert metrics["rejected"] == 0.0 and np.isfinite(metrics["loss"])
        if step > 0:  # refreshed after the step, used from the next one on
            inverse = {name: 1.0 / (factor[name] + DAMPING) for name in LAYERS}

        state = trainer.state()
        for name in LAYERS:
            np.testing.assert_allclose(state[f"factor/{name}/c"], factor[name], rtol=2e-5, err_msg=f"{step} {name}")
            np.testing.assert_allclose(state[f"inverse/{name}/c_inv"], inverse[name], rtol=2e-5,
                                       err_msg=f"{step} {name}")
        for p, value in trainer.parameters().items():
            np.testing.assert_allclose(value, theta[p], rtol=1e-4, atol=1e-6, err_msg=f"step {step} {p}")
    assert history["fc3"][0] > 0 and len(set(history["fc3"])) == STEPS  # real, changing statistics
