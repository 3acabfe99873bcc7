"""A loss added from outside the package (tests/extensions/poisson_loss.py), end to end.

The truth is independent of the loss class: scipy's Poisson log-pmf and quantiles, float64
numpy forward passes with central finite differences, and the brute-force Fisher
J^T diag(exp z) J of a tiny model (helpers of test_fisher_bruteforce).
"""
from __future__ import annotations

import importlib
import json
import re
import warnings

import numpy as np
import pytest
from scipy.stats import poisson as scipy_poisson

import kfac_compiler as kc
from kfac_compiler.config import CompileConfig
from kfac_compiler.errors import ConfigError, DataError, one_line
from kfac_compiler.losses import LOSSES, loss_kinds, register_loss
from kfac_compiler.models import ZOO, save_model
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.data import batch_indices
from test_fisher_bruteforce import IN, OUT, _forward, _layer_jacobian, _statistics, _tiny_mlp
from test_losses import _run


@pytest.fixture(scope="module")
def poisson():
    """The extension registered for this module only (the other tests see the built-ins)."""
    cls = register_loss(importlib.import_module("extensions.poisson_loss").PoissonLoss)
    yield cls
    LOSSES.pop(cls.kind, None)


def _half_deviance(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per example: log p(y | rate y) - log p(y | rate exp z), summed over coordinates."""
    terms = scipy_poisson.logpmf(y, y) - scipy_poisson.logpmf(y, np.exp(z))
    return terms.reshape(len(z), -1).sum(axis=1)


def _counts(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).poisson(2.0, size=shape).astype(np.float32)


def test_registering_reaches_every_extension_point(poisson, tmp_path):
    from kfac_compiler.cli import build_parser

    assert "poisson" in loss_kinds()
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["compile"].format_help().split())
    assert "poisson: Poisson per output coordinate with log rate z" in help_text
    assert "[options: max_count=64]" in help_text
    with pytest.raises(ConfigError, match="loss_options: poisson max_count must be >= 1, got 0"):
        CompileConfig.from_dict({"loss": "poisson", "loss_options": {"max_count": 0}})
    model, _ = _tiny_mlp()
    plan = kc.compile(model, loss="poisson", output="logits", emit=False, loss_options={"max_count": 32})
    assert plan.loss.to_json() == {"kind": "poisson", "variance": None, "max_count": 32, "recognised_from": None}
    assert plan.targets.to_json() == {"name": "targets", "shape": ["N", OUT], "dtype": "float32", "from_input": None}
    plan.save(tmp_path / "plan")
    with open(tmp_path / "plan" / "plan.json") as f:
        assert json.load(f)["loss"]["max_count"] == 32
    assert kc.load_plan(str(tmp_path / "plan")).loss.build().max_count == 32
    with pytest.raises(DataError, match="'targets' must be counts >= 0 for poisson"):
        kc.gradients(plan, {"input": np.zeros((2, IN))}, -np.ones((2, OUT), np.float32))


def test_loss_and_gradients_match_scipy_and_finite_differences(poisson):
    model, params = _tiny_mlp(5)
    plan = kc.compile(model, loss="poisson", output="logits", emit=False)
    x = np.random.default_rng(6).normal(size=(5, IN))
    y = _counts((5, OUT), 7)
    loss, grads = kc.gradients(plan, {"input": x.astype(np.float32)}, y)

    def truth(p):
        return _half_deviance(_forward(p, x), y).mean()

    assert loss == pytest.approx(truth(params), rel=1e-5)
    eps = 1e-6
    for name, value in params.items():
        fd = np.zeros_like(value)
        for idx in np.ndindex(*value.shape):
            up, down = value.copy(), value.copy()
            up[idx] += eps
            down[idx] -= eps
            fd[idx] = (truth({**params, name: up}) - truth({**params, name: down})) / (2 * eps)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["exact", "exact_GGN"])
def test_kron_factors_equal_the_bruteforce_fisher_for_one_example(poisson, mode):
    model, params = _tiny_mlp(1)
    plan = kc.compile(model, loss="poisson", output="logits", emit=False)
    x = np.array([[0.4, -0.7, 1.1]])
    stats = _statistics(plan, x, _counts((1, OUT), 2), mode)
    z = _forward(params, x)[0]
    for layer in ("fc1", "fc2"):
        j = _layer_jacobian(params, x[0], layer)
        exact = j.T @ np.diag(np.exp(z)) @ j
        np.testing.assert_allclose(np.kron(stats[f"stat/{layer}/G"], stats[f"stat/{layer}/A"]), exact,
                                   rtol=1e-4, atol=1e-6)


def test_output_factor_is_the_mean_predictive_fisher_and_sampling_converges_to_it(poisson):
    model, params = _tiny_mlp(2)
    plan = kc.compile(model, loss="poisson", output="logits", emit=False)
    x = np.random.default_rng(3).normal(size=(6, IN))
    z = _forward(params, x)
    g_exact = _statistics(plan, x, _counts((6, OUT), 4), "exact")["stat/fc2/G"]
    np.testing.assert_allclose(g_exact, np.mean([np.diag(np.exp(zn)) for zn in z], axis=0), rtol=1e-4, atol=1e-6)
    x1 = x[:1]
    g1 = _statistics(plan, x1, _counts((1, OUT), 5), "exact")["stat/fc2/G"]
    errors = []
    for n in (50, 5000):
        g = _statistics(plan, np.repeat(x1, n, axis=0), _counts((n, OUT), n), "gradients", seed=n)["stat/fc2/G"]
        errors.append(np.abs(g - g1).max() / np.abs(g1).max())
    assert errors[1] < 0.05 and errors[1] < errors[0] / 3


def test_sampled_targets_are_poisson_quantiles_of_the_host_noise(poisson):
    """g = exp(z) - y with y = the u-quantile of Poisson(exp z), clipped at max_count."""
    rng = np.random.default_rng(8)
    z = np.log(rng.choice([0.05, 1.0, 3.0, 20.0, 60.0], size=(4000, 1))).astype(np.float32)
    u = rng.uniform(1e-7, 1 - 1e-7, size=z.shape).astype(np.float32)
    g, loss = _run("poisson", lambda l, b: l.emit_sampled_grad(b, "z", "u", z.shape), {"z": z, "u": u}, ["u"])
    drawn = np.exp(z.astype(np.float64)) - g
    want = np.minimum(scipy_poisson.ppf(u.astype(np.float64), np.exp(z.astype(np.float64))), loss.max_count)
    off = np.abs(drawn - want) > 1e-3 * np.maximum(want, 1)
    assert off.mean() < 2e-3  # float32 CDF sums against u right at a step
    assert np.abs(drawn - want)[off].max(initial=0) <= 1 + 1e-3 * want.max()
    assert (want == loss.max_count).any()  # the clipping is exercised


def poisson_autoencoder(n: int):
    """(plan, inputs, counts): the zoo's digits autoencoder with the poisson loss, n examples
    whose pixels 0..16 are the counts."""
    entry = ZOO["digits_autoencoder"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kc.compile(entry.build(seed=0), loss="poisson", output="logits")
    inputs, pixels = entry.make_data(n, seed=0)
    return plan, inputs, np.round(pixels * 16).astype(np.float32)


@pytest.mark.slow
def test_zoo_model_trains_with_kfac_and_evaluates_its_metric(poisson):
    plan, inputs, y = poisson_autoencoder(400)
    # exp(z) makes the curvature grow fast away from the current point: start well damped
    trainer = Trainer(plan, optimizer="kfac", device="cpu", seed=0, batch_size=128, damping=1.0)

    def truth() -> dict[str, float]:
        z = trainer.predict(inputs).astype(np.float64)
        return {"loss": _half_deviance(z, y).mean(), "mean_absolute_error": np.abs(np.exp(z) - y).mean()}

    before, want = trainer.evaluate(inputs, y, batch_size=150), truth()
    assert before.keys() == want.keys()
    for k in want:
        assert before[k] == pytest.approx(want[k], rel=1e-5)
    idx0 = batch_indices(len(y), 128, 0, 0)
    first_truth = _half_deviance(trainer.predict({"input": inputs["input"][idx0]}).astype(np.float64), y[idx0]).mean()
    losses = []
    for k in range(8):
        idx = batch_indices(len(y), 128, k, 0)
        losses.append(trainer.step({"input": inputs["input"][idx]}, y[idx])["loss"])
    assert losses[0] == pytest.approx(first_truth, rel=1e-5)  # the step reports the loss before its update
    after, want = trainer.evaluate(inputs, y), truth()
    for k in want:
        assert after[k] == pytest.approx(want[k], rel=1e-5)
    assert after["loss"] < 0.5 * before["loss"]
    assert after["mean_absolute_error"] < before["mean_absolute_error"]


def test_a_metric_without_weights_serves_plain_evaluations_and_refuses_weighted_ones(poisson):
    """A plugin written before weighted evaluation, metric_totals(outputs, targets): unweighted
    evaluation uses it; a weighted one is one line (it would report unweighted metrics)."""
    plan, inputs, y = poisson_autoencoder(64)
    trainer = Trainer(plan, optimizer="sgd", batch_size=64)
    assert trainer.loss.metrics_take_weights()
    trainer.loss.metric_totals = lambda outputs, targets: {  # type: ignore[method-assign]
        "mean_absolute_error": (float(np.abs(np.exp(outputs) - targets).sum()), targets.size)}
    assert not trainer.loss.metrics_take_weights()
    z = trainer.predict(inputs).astype(np.float64)
    assert trainer.evaluate(inputs, y)["mean_absolute_error"] == pytest.approx(np.abs(np.exp(z) - y).mean(), rel=1e-5)
    with pytest.raises(ConfigError) as e:
        trainer.evaluate(inputs, y, weights=np.ones(64, np.float32))
    assert "metric_totals(outputs, targets, weights=None)" in one_line(e.value)


@pytest.mark.slow
def test_train_command_makes_digits_counts_and_prints_the_metric(poisson, tmp_path, capsys):
    from kfac_compiler.cli import main

    path = save_model("digits_autoencoder", tmp_path / "ae.onnx")
    code = main(["train", path, "--loss", "poisson", "--steps", "3", "--damping", "1.0", "-q"])
    out = capsys.readouterr().out
    assert code == 0
    m = re.search(r"final train loss ([\d.]+) mean_absolute_error ([\d.]+) \(3 steps", out)
    assert m is not None, out
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0


def test_a_loss_missing_a_method_is_refused_naming_it():
    """An ElementwiseLoss without its terms (docs/extending_losses.md) is refused when
    registered, naming them; it used to register and fail with an empty NotImplementedError
    when a graph was first emitted."""
    from kfac_compiler.losses import LOSSES
    from kfac_compiler.losses.base import ElementwiseLoss, register_loss

    class NoTerms(ElementwiseLoss):
        kind = "no_terms"

    with pytest.raises(TypeError, match="loss class NoTerms: implement emit_fisher_sqrt_times, emit_fisher_times, "
                                        "emit_grad, emit_sampled_grad, emit_terms, np_fisher, np_grad, np_terms "
                                        "before registering it"):
        register_loss(NoTerms)
    assert "no_terms" not in LOSSES
