"""Per-example loss weights and masks: loss, gradients and curvature against their definitions."""
from __future__ import annotations

import numpy as np
import pytest

import kfac_compiler as kc
from helpers import zoo_case
from kfac_compiler.errors import DataError
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.runtime import Curvature, Trainer


@pytest.fixture(scope="module")
def mlp():
    return zoo_case("mlp_classifier", 12, hidden=(16, 16))


def test_weighted_loss_and_gradients_are_the_weighted_sums(mlp):
    """L = 1/N sum_n w_n l_n: gradients are linear in w, so they equal the weighted sum of
    one-example gradients (each computed independently, N = 1)."""
    plan, x, y = mlp
    w = np.linspace(0.0, 2.0, len(y)).astype(np.float32)
    loss, grads = kc.gradients(plan, x, y, weights=w)
    singles = [kc.gradients(plan, {k: v[i:i + 1] for k, v in x.items()}, y[i:i + 1]) for i in range(len(y))]
    assert loss == pytest.approx(sum(wi * l for wi, (l, _) in zip(w, singles)) / len(y), rel=1e-5)
    for p, g in grads.items():
        expect = sum(wi * gi[p] for wi, (_, gi) in zip(w, singles)) / len(y)
        np.testing.assert_allclose(g, expect, rtol=1e-4, atol=1e-6)


def test_a_zero_mask_removes_examples_from_the_output_factor(mlp):
    """Exact mode with a 0/1 mask: G (sum over the output seeds) equals G of the kept examples
    times their share of the batch; A is not weighted (documented)."""
    plan, x, y = mlp
    mask = np.array([1, 0] * 6, np.float32)
    curv = Curvature(plan)
    masked = curv.estimate(x, y, mode="exact", weights=mask)
    kept = {k: v[mask == 1] for k, v in x.items()}
    only = curv.estimate(kept, y[mask == 1], mode="exact")
    for layer in ("fc1", "fc2", "fc3"):
        np.testing.assert_allclose(masked[layer]["G"] * 2.0, only[layer]["G"], rtol=1e-4, atol=1e-7)


def test_trainer_steps_with_weights_and_rejects_bad_ones(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac")
    w = np.ones(len(y), np.float32)
    m = tr.step(x, y, weights=w)
    assert np.isfinite(m["loss"]) and m["rejected"] == 0.0
    with pytest.raises(DataError, match="one weight per example"):
        tr.step(x, y, weights=w[:3])
    with pytest.raises(DataError, match="finite and >= 0"):
        tr.step(x, y, weights=-w)


def test_block_products_on_the_device_and_host_agree_and_invert(mlp):
    """multiply (graph) == numpy twin; matpower(2) == multiply twice; matpower(-1) inverts
    multiply; matpower(-0.5) twice == matpower(-1) (all from the same moving-average factors)."""
    plan, x, y = mlp
    curv = Curvature(plan)
    curv.update(x, y)
    rng = np.random.default_rng(0)
    v = {p: rng.normal(size=s).astype(np.float32) for p, s in plan.param_shapes.items() if p in plan.trainable}
    damping = 0.1
    dev = curv.multiply_all(v, damping=damping)
    dev2 = curv.multiply_all(v, damping=damping, exp=2)
    for layer in ("fc1", "fc2", "fc3"):
        mine = {p: v[p] for p in plan.layer(layer).params}
        host = curv.multiply(layer, mine, damping=damping)
        for p in mine:
            np.testing.assert_allclose(dev[p], host[p], rtol=1e-4, atol=1e-5)
        twice = curv.multiply(layer, host, damping=damping)
        sq = curv.multiply_matpower(layer, mine, 2, damping=damping)
        back = curv.multiply_matpower(layer, host, -1, damping=damping)
        half = curv.multiply_matpower(layer, curv.multiply_matpower(layer, mine, -0.5, damping=damping), -0.5, damping=damping)
        inv = curv.multiply_matpower(layer, mine, -1, damping=damping)
        for p in mine:
            np.testing.assert_allclose(sq[p], twice[p], rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(dev2[p], twice[p], rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(back[p], mine[p], rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(half[p], inv[p], rtol=1e-3, atol=1e-4)


def test_models_may_name_their_tensors_output_and_weights():
    """The runtime's own names (kfac/output, example_weights) never collide with a model's
    `output` output or `weights` input."""
    import onnx
    model = get_model("mlp_classifier", hidden=(8,))
    for node in model.graph.node:
        node.input[:] = ["weights" if t == "input" else t for t in node.input]
        node.output[:] = ["output" if t == "logits" else t for t in node.output]
    model.graph.input[0].name = "weights"
    model.graph.output[0].name = "output"
    onnx.checker.check_model(model)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="output")
    x, y = ZOO["mlp_classifier"].make_data(16)
    tr = Trainer(plan)
    m = tr.step({"weights": x["input"]}, y, weights=np.ones(16, np.float32))
    ev = tr.evaluate({"weights": x["input"]}, y)
    assert np.isfinite(m["loss"]) and 0.0 <= ev["accuracy"] <= 1.0


@pytest.mark.parametrize("l2", [0.0, 1e-2])
def test_loss_after_is_the_objective_at_the_new_parameters(mlp, l2):
    """Levenberg-Marquardt's actual change: metric loss_after (reported as new_loss at k=0)
    equals the same batch's loss at the updated parameters, plus the l2 regularizer's change
    l2 (theta.u + |u|^2/2), recomputed here from the parameters before and after the step."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", l2_reg=l2)
    before = tr.parameters()
    m = tr.step(x, y)
    after = tr.parameters()
    u = {p: after[p].astype(np.float64) - before[p] for p in before}
    reg = l2 * sum(float((before[p] * u[p]).sum() + 0.5 * (u[p] ** 2).sum()) for p in u)
    assert m["new_loss"] == pytest.approx(tr.evaluate(x, y)["loss"] + reg, rel=1e-4, abs=1e-6)


def test_bad_api_input_is_a_one_line_error(mlp, tmp_path):
    from kfac_compiler.errors import ConfigError, PlanError

    plan, x, y = mlp
    tr = Trainer(plan)
    with pytest.raises(ConfigError, match=r"parameter 'fc1.weight' has shape \[16, 64\]; got \[3\]"):
        tr.set_parameters({"fc1.weight": np.zeros(3)})
    with pytest.raises(ConfigError, match="not a trainable parameter"):
        tr.set_parameters({"nope": np.zeros(3)})
    with pytest.raises(DataError, match="missing"):
        tr.predict({"x": x["input"]})
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        tr.evaluate(x, y, batch_size=0)
    with pytest.raises(PlanError, match="expects a plan directory path"):
        kc.load_plan(None)
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(plan.model.SerializeToString())
    with pytest.raises(PlanError, match="compile it first"):
        Trainer(str(onnx_file))
