"""An optimizer registered from one file (tests/extensions/normalized_gd.py) trains a zoo
model through the generic Trainer, and its steps are the update rule it states."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

import kfac_compiler as kc
from extensions import normalized_gd  # noqa: F401  (registers the optimizer; tests/ is on sys.path)
from kfac_compiler.errors import ConfigError
from kfac_compiler.models import ZOO
from kfac_compiler.optimizers import OPTIMIZERS, OptimizerConfig
from kfac_compiler.runtime import Trainer


@pytest.fixture(scope="module")
def mlp():
    e = ZOO["mlp_classifier"]
    inputs, y = e.make_data(n=256, seed=0)
    return kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False), inputs, y


def test_registered_optimizer_trains_with_its_update_rule(mlp):
    plan, inputs, y = mlp
    assert "normalized_gd" in OPTIMIZERS
    tr = Trainer(plan, optimizer="normalized_gd", learning_rate=0.05)
    losses = []
    for k in range(5):
        idx = np.arange(32 * k, 32 * (k + 1))
        batch = {"input": inputs["input"][idx]}
        before = tr.parameters()
        _, g = kc.gradients(plan, batch, y[idx], params=before)  # the gradients subgraph at theta_k
        norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in g.values()))
        m = tr.step(batch, y[idx])
        losses.append(m["loss"])
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
        after = tr.parameters()
        for p in before:
            np.testing.assert_allclose(after[p], before[p] - 0.05 * g[p] / norm, rtol=1e-5, atol=1e-7)
    assert losses[-1] < losses[0]
    assert tr.step_count == 5 and tr.applied_steps == 5


def test_registered_optimizer_settings_are_checked(mlp):
    plan, _, _ = mlp
    with pytest.raises(ConfigError, match="eps"):
        Trainer(plan, optimizer="normalized_gd", eps=-1.0)
    with pytest.raises(ConfigError, match="no option"):
        Trainer(plan, optimizer="normalized_gd", momentum_typo=0.9)


def test_a_schedule_reaches_only_the_options_a_plugin_lists(mlp):
    """normalized_gd lists learning_rate in `schedulable`: its step uses the schedule's value.
    A plugin that lists nothing (the base default) refuses a schedule in one line instead of
    handing its step a Schedule object."""
    plan, inputs, y = mlp
    tr = Trainer(plan, optimizer="normalized_gd", learning_rate="0.05@0,0.01@1")
    assert (tr.learning_rate, tr.step({"input": inputs["input"][:32]}, y[:32])["step"]) == (0.05, 0.0)
    assert tr.learning_rate == 0.01  # the next step's value, a number

    @dataclass
    class PlainConfig(OptimizerConfig):
        name: ClassVar[str] = "plain"
        eps: float = 1e-12

    for value in ("exp:0.1,0.5,100", lambda k: 0.1):
        with pytest.raises(ConfigError) as e:
            PlainConfig.from_knobs(learning_rate=value)
        assert str(e.value) == ("optimizer 'plain' takes no schedule for option 'learning_rate' (no option does); "
                                "pass a number")
    with pytest.raises(ConfigError, match="^optimizer option 'eps' must be a number, got 'tiny'$"):
        PlainConfig.from_knobs(eps="tiny")  # plain bad text is still a type error
    assert PlainConfig.from_knobs(learning_rate=0.1).learning_rate == 0.1


def test_a_step_that_reports_no_loss_is_one_line(mlp, monkeypatch):
    """A registered optimizer whose step returns no 'loss' (the CLI's progress, fit and the
    metrics file read it) is a ConfigError naming it, not a KeyError in the caller."""
    plan, inputs, y = mlp
    monkeypatch.setattr(normalized_gd.NormalizedGd, "step", lambda self, data: {"step": 0.0})
    tr = Trainer(plan, optimizer="normalized_gd", learning_rate=0.05)
    with pytest.raises(ConfigError, match="optimizer 'normalized_gd': its step returned no 'loss' metric"):
        tr.step({"input": inputs["input"][:32]}, y[:32])
