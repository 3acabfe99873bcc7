"""Everyday recipe options of SGD and Adam: gradient clipping by global norm (clip_norm) and
decoupled weight decay (decoupled_weight_decay, AdamW's), in both update layouts. Truth: the
update computed by hand in numpy from the gradients of kc.gradients."""
from __future__ import annotations

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.errors import ConfigError
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer


@pytest.fixture(scope="module")
def case():
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    inputs, y = e.make_data(64, seed=0)
    return plan, inputs, y


def _one_step(plan, inputs, y, optimizer, **knobs):
    tr = Trainer(plan, optimizer=optimizer, threads=1, **knobs)
    before = {p: v.astype(np.float64) for p, v in tr.parameters().items()}
    metrics = tr.step(inputs, y)
    return before, {p: v.astype(np.float64) for p, v in tr.parameters().items()}, metrics


@pytest.mark.parametrize("multi_tensor", [False, True], ids=["per-parameter", "multi-tensor"])
@pytest.mark.parametrize("clip", [0.05, 100.0], ids=["clipped", "under-the-norm"])
def test_sgd_clips_the_gradient_and_decays_the_weights_as_computed_by_hand(case, multi_tensor, clip):
    plan, inputs, y = case
    lr, wd = 0.1, 0.01
    _, grads = kc.gradients(plan, inputs, y)
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    before, after, m = _one_step(plan, inputs, y, "sgd", learning_rate=lr, momentum=0.0, clip_norm=clip,
                                 decoupled_weight_decay=wd, multi_tensor=multi_tensor)
    scale = min(1.0, clip / norm)
    assert (scale < 1) == (clip < norm)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)  # reported before clipping
    for p in before:
        want = (1 - lr * wd) * before[p] - lr * scale * grads[p]
        np.testing.assert_allclose(after[p], want, rtol=1e-5, atol=1e-7, err_msg=p)


@pytest.mark.parametrize("multi_tensor", [False, True], ids=["per-parameter", "multi-tensor"])
def test_adamw_first_step_as_computed_by_hand(case, multi_tensor):
    """First Adam step as the runtime defines it (docs/runtime.md): m = (1-b1) g, v = (1-b2) g^2,
    theta -= lr_1 m / (sqrt(v) + eps) with lr_1 = lr sqrt(1-b2) / (1-b1); AdamW first decays the
    weights by lr w (torch.optim.AdamW's order), and the gradient is the clipped one."""
    plan, inputs, y = case
    lr, wd, clip, b1, b2, eps = 1e-2, 0.1, 0.5, 0.9, 0.999, 1e-8
    _, grads = kc.gradients(plan, inputs, y)
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    before, after, _ = _one_step(plan, inputs, y, "adam", learning_rate=lr, decoupled_weight_decay=wd,
                                 clip_norm=clip, multi_tensor=multi_tensor)
    lr_1 = lr * np.sqrt(1 - b2) / (1 - b1)
    for p in before:
        g = grads[p].astype(np.float64) * min(1.0, clip / norm)
        m, v = (1 - b1) * g, (1 - b2) * g * g
        want = (1 - lr * wd) * before[p] - lr_1 * m / (np.sqrt(v) + eps)
        np.testing.assert_allclose(after[p], want, rtol=1e-4, atol=2e-6, err_msg=p)


def test_bad_recipe_values_are_one_line(case):
    plan, _, _ = case
    with pytest.raises(ConfigError, match="clip_norm"):
        Trainer(plan, optimizer="adam", clip_norm=0.0)
    with pytest.raises(ConfigError, match="decoupled_weight_decay"):
        Trainer(plan, optimizer="sgd", decoupled_weight_decay=-1.0)
