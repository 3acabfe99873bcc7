"""The plateau rule for the quadratic model's curvature scale c (optimizers/kfac/plateau.py):
hand-computed decisions on loss sequences, and the Trainer feeding c to the step graph."""
from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import sampled_batch as batch
from helpers import zoo_case
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers.kfac.graph import KfacStepOptions
from kfac_compiler.optimizers.kfac.plateau import CurvatureScaleRule
from kfac_compiler.runtime import Trainer


def scales(rule: CurvatureScaleRule, losses: list[float]) -> list[float]:
    """c after each observed loss."""
    out = []
    for loss in losses:
        rule.observe(loss)
        out.append(rule.scale)
    return out


def test_a_flat_window_doubles_c_up_to_its_cap():
    rule = CurvatureScaleRule(1.0, window=3, plateau=0.02, max_scale=4.0, adapt=True)
    # windows of medians 10, 9.9 (1% below the best: double), 9.85 (double), 9.8 (cap)
    got = scales(rule, [10, 10, 10, 9.9, 9.9, 9.9, 9.85, 9.85, 9.85, 9.8, 9.8, 9.8])
    assert got == [1, 1, 1, 1, 1, 2, 2, 2, 4, 4, 4, 4]


def test_progress_keeps_c_and_a_recovery_halves_it_to_the_start():
    rule = CurvatureScaleRule(2.0, window=2, plateau=0.02, max_scale=8.0, adapt=True)
    # medians 10, 9 (10% below the best: halving, floored at the starting 2), 8.9 (1.1%:
    # doubled to 4), 8.5 (4.5%, between 2% and 10%: kept), 7.5 (11.8%: halved), 7 (6.7%: kept)
    got = scales(rule, [10, 10, 9, 9, 8.9, 8.9, 8.5, 8.5, 7.5, 7.5, 7, 7])
    assert got == [2, 2, 2, 2, 2, 4, 4, 4, 4, 2, 2, 2]


def test_progress_is_measured_from_the_best_window_not_the_previous_one():
    rule = CurvatureScaleRule(1.0, window=2, plateau=0.02, max_scale=8.0, adapt=True)
    # medians 10, 12 (worse: double), 10.5 (12.5% below the previous window but above the best
    # 10: double, not halve), 8.9 (11% below the best: halve)
    assert scales(rule, [10, 10, 12, 12, 10.5, 10.5, 8.9, 8.9]) == [1, 1, 1, 2, 2, 4, 4, 2]
    assert rule.best == 8.9


def test_a_spike_does_not_move_the_window_median():
    rule = CurvatureScaleRule(1.0, window=5, plateau=0.02, max_scale=4.0, adapt=True)
    scales(rule, [10, 10, 10, 10, 10])
    # a 1000x batch loss inside a window that otherwise fell 10%: the median says it fell
    assert scales(rule, [9, 9, 1e4, 9, 9])[-1] == 1.0
    assert rule.best == 9.0


def test_off_non_finite_losses_and_host_state_round_trip():
    off = CurvatureScaleRule(3.0, window=2, plateau=0.02, max_scale=4.0, adapt=False)
    assert scales(off, [1, 1, 1, 1, 1]) == [3.0] * 5 and off.losses == []
    rule = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=4.0, adapt=True)
    scales(rule, [5, 5, math.nan, 5, 5, math.inf, 4])  # non-finite losses are not counted
    assert rule.best == 5.0 and rule.losses == [4.0]
    copy = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=4.0, adapt=True)
    copy.set_host_state(rule.host_state())
    assert copy.host_state() == rule.host_state()
    with pytest.raises(ValueError, match="host.curvature_scale"):
        copy.set_host_state({"curvature_scale": -1.0})
    with pytest.raises(ValueError, match="host.plateau_losses"):
        copy.set_host_state({"plateau_losses": [1.0, math.nan]})
    with pytest.raises(ValueError, match="host.plateau_best"):
        copy.set_host_state({"plateau_best": [1.0, 2.0]})
    copy.restart()
    assert (copy.scale, copy.losses, copy.best) == (1.0, [], None)


def test_restoring_older_or_other_settings():
    """A host state from before the rule (none of its entries) restarts it at the configured c;
    a restored c is kept within [the configured c, the cap] (a resume may lower the cap); with
    the rule off c is the configured one whatever the checkpoint held."""
    rule = CurvatureScaleRule(1.5, window=3, plateau=0.02, max_scale=4.0, adapt=True)
    rule.set_host_state({"damping": 1e-3})
    assert (rule.scale, rule.losses, rule.best) == (1.5, [], None)
    rule.set_host_state({"curvature_scale": 8.0, "plateau_losses": [3.0, 2.0, 1.0, 0.5], "plateau_best": [2.5]})
    assert (rule.scale, rule.losses, rule.best) == (4.0, [1.0, 0.5], 2.5)  # the window's last 2 of 3
    rule.set_host_state({"curvature_scale": 1.0})
    assert rule.scale == 1.5
    off = CurvatureScaleRule(3.0, window=3, plateau=0.02, max_scale=4.0, adapt=False)
    off.set_host_state({"curvature_scale": 4.0})
    assert off.scale == 3.0


EARLY = [10, 10, 8, 8, 8.5, 8.5, 9.8, 9.8, 8.9, 8.9, 8.9, 8.9, 7, 7, 7, 7]


def test_early_windows_judge_the_fall_since_the_first_window():
    """early_window 2, window 4: windows end after losses 2, 4, 6, 8 (they start before 2 * 4
    losses), then every 4. Early windows double c when they are less than 2% * (losses since
    the first window) / 4 below the first window's median, 10: 8 (20% below it; 20% below the
    best too: halve, floored at 1), 8.5 (15%, though above the best 8: kept), 9.8 (2%, under
    the 3% due after 6 steps: double). The 4-loss windows are judged against the best, 8: 8.9
    (above it: double), 7 (12.5% below it: halve)."""
    rule = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=8.0, adapt=True, early_window=2)
    assert scales(rule, EARLY) == [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 2]
    assert (rule.count, rule.first, rule.best) == (16, 10.0, 7.0)
    # a flat start: 0.5% below the first window after 2 steps (1% due), 1% after 4 (2% due)
    flat = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=8.0, adapt=True, early_window=2)
    assert scales(flat, [10, 10, 9.95, 9.95, 9.9, 9.9]) == [1, 1, 1, 2, 2, 4]
    # an early window longer than the window is the window
    assert CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=8.0, adapt=True, early_window=9).early_window == 4


def test_early_windows_resume_where_they_stopped():
    """host_state carries the count of losses and the first window's median, so a restored rule
    ends its windows and takes its decisions as the uninterrupted one does; a state without
    them (written before early windows) continues with full windows, as the rule that wrote it
    would."""
    straight = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=8.0, adapt=True, early_window=2)
    want = scales(straight, EARLY)
    for cut in (3, 7, 9, 13):
        first = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=8.0, adapt=True, early_window=2)
        scales(first, EARLY[:cut])
        resumed = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=8.0, adapt=True, early_window=2)
        resumed.set_host_state(first.host_state())
        assert scales(resumed, EARLY[cut:]) == want[cut:]
        assert resumed.host_state() == straight.host_state()
    older = CurvatureScaleRule(1.0, window=4, plateau=0.02, max_scale=8.0, adapt=True, early_window=2)
    older.set_host_state({"curvature_scale": 1.0, "plateau_losses": [10.0], "plateau_best": []})
    assert older.count == 9 and older.current_window() == 4
    assert scales(older, [10, 10, 10, 9.9, 9.9, 9.9, 9.9]) == [1, 1, 1, 1, 1, 1, 2]  # medians 10, 9.9
    with pytest.raises(ValueError, match="host.plateau_count"):
        older.set_host_state({"plateau_losses": [1.0, 2.0], "plateau_count": 1})
    with pytest.raises(ValueError, match="host.plateau_first"):
        older.set_host_state({"plateau_first": [math.nan]})


@pytest.fixture(scope="module")
def mlp():
    plan, inputs, y = zoo_case("mlp_classifier", 256)
    return plan, inputs["input"], y


def test_the_trainer_doubles_c_on_a_plateau_and_the_step_reads_it(mlp):
    """With a plateau threshold of 0.99 every window is a plateau: c, the step's hp, doubles after
    the second and third two-step windows (capped at 4); the metric reports the c each step ran
    with. The same steps with c fixed at its value give the same learning rate: the graph reads
    the hp."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", seed=3, curvature_scale_window=2, curvature_scale_plateau=0.99,
                 max_curvature_scale=4.0)
    got = [tr.step(*batch(x, y, s)) for s in range(8)]
    assert [m["curvature_scale"] for m in got] == [1, 1, 1, 1, 2, 2, 4, 4]
    assert tr.host_state()["curvature_scale"] == 4.0
    fixed = Trainer(plan, optimizer="kfac", seed=3, adapt_curvature_scale=False)
    plain = [fixed.step(*batch(x, y, s)) for s in range(5)]
    assert [m["learning_rate"] for m in plain[:4]] == [m["learning_rate"] for m in got[:4]]
    assert np.isnan(plain[0]["curvature_scale"])  # c = 1 fixed: the graph has no hp/qmodel_curvature_scale
    assert plain[4]["learning_rate"] != pytest.approx(got[4]["learning_rate"], rel=0.05)  # c = 2 shortens it


@pytest.mark.slow
def test_a_resumed_run_keeps_c_unless_told_otherwise(mlp, tmp_path):
    """The checkpoint carries c and the window (test_checkpoint: bit for bit); a resume that sets
    qmodel_curvature_scale or adapt_curvature_scale starts the rule again from the value given."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", seed=3, curvature_scale_window=2, curvature_scale_plateau=0.99)
    for s in range(5):
        tr.step(*batch(x, y, s))
    path = tr.save_checkpoint(tmp_path / "run.npz")
    kept = Trainer.load_checkpoint(path, plan)
    assert kept.step(*batch(x, y, 5))["curvature_scale"] == 2.0
    again = Trainer.load_checkpoint(path, plan, qmodel_curvature_scale=1.5)
    assert again.step(*batch(x, y, 5))["curvature_scale"] == 1.5
    fixed = Trainer.load_checkpoint(path, plan, adapt_curvature_scale=False)
    assert np.isnan(fixed.step(*batch(x, y, 5))["curvature_scale"])  # c = 1 fixed: no hp in the graph


@pytest.mark.slow
def test_with_accumulation_the_rule_takes_the_cycles_mean_loss(mlp):
    """accumulate=2: the rule's window holds each cycle's mean micro-batch loss (the batch's),
    which the step reports as its loss, not the last micro-batch's."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", seed=3, accumulate=2, curvature_scale_window=4)
    reported = []
    for s in range(6):
        m = tr.step(*batch(x, y, s))
        if not m.get("accumulating"):
            reported.append(m["loss"])
    assert tr.policy.curvature_scale.losses == pytest.approx(reported, rel=1e-12)


def test_bad_plateau_settings_are_one_line(mlp):
    plan = mlp[0]
    with pytest.raises(ConfigError, match="adapt_curvature_scale .* needs the qmodel"):
        Trainer(plan, optimizer="kfac", learning_rate=0.1, adapt_curvature_scale=True)
    with pytest.raises(ConfigError, match="max_curvature_scale 2 is below qmodel_curvature_scale 3"):
        Trainer(plan, optimizer="kfac", qmodel_curvature_scale=3.0, max_curvature_scale=2.0)
    with pytest.raises(ConfigError, match="curvature_scale_window"):
        Trainer(plan, optimizer="kfac", curvature_scale_window=1)
    with pytest.raises(ConfigError, match="curvature_scale_early_window"):
        Trainer(plan, optimizer="kfac", curvature_scale_early_window=1)
    # without adaptation the cap does not apply, and its default follows a larger c
    assert Trainer(plan, optimizer="kfac", qmodel_curvature_scale=3.0, max_curvature_scale=2.0,
                   adapt_curvature_scale=False).policy.curvature_scale.scale == 3.0
    assert Trainer(plan, optimizer="kfac", qmodel_curvature_scale=6.0).policy.curvature_scale.max_scale == 6.0
    with pytest.raises(ConfigError, match="curvature_scale is a bool"):
        KfacStepOptions(curvature_scale=3.0)
