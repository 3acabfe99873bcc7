"""Learning-rate, momentum and damping schedules (kfac-jax's *_schedule): the grammar's values
by hand, the values each step uses (and that reach the graphs), one-line errors for bad text
and bad combinations, and a resumed run that continues its schedule bit-for-bit."""
from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from helpers import zoo_case
from kfac_compiler import contract as C
from kfac_compiler.cli import main
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import make_config
from kfac_compiler.optimizers.schedules import parse
from kfac_compiler.runtime import Trainer, gradients

BATCH = 32


@pytest.fixture(scope="module")
def mlp():
    plan, x, y = zoo_case("mlp_classifier", BATCH * 6, hidden=(16, 16))
    return plan, x["input"], y


def batch(x, y, k):
    return {"input": x[k * BATCH:(k + 1) * BATCH]}, y[k * BATCH:(k + 1) * BATCH]


@pytest.mark.parametrize("text,values", [
    ("0.25", {0: 0.25, 10**6: 0.25}),
    ("0.1@0,0.01@1000,0.001@2000", {0: 0.1, 999: 0.1, 1000: 0.01, 1999: 0.01, 2000: 0.001, 10**6: 0.001}),
    ("exp:0.1,0.5,1000", {0: 0.1, 1000: 0.05, 2000: 0.025, 500: 0.1 / math.sqrt(2)}),
    ("linear:0.1,0.001,100", {0: 0.1, 50: 0.0505, 100: 0.001, 300: 0.001}),
    ("cosine:0.1,0.001,100", {0: 0.1, 50: 0.0505, 100: 0.001, 25: 0.001 + 0.099 * (1 + math.sqrt(0.5)) / 2}),
    ("warmup:10:0.1", {0: 0.01, 4: 0.05, 9: 0.1, 500: 0.1}),
    ("warmup:4:linear:1,0,8", {0: 0.25, 1: 0.4375, 4: 0.5, 8: 0.0}),
])
def test_schedule_text_gives_the_documented_values(text, values):
    sched = parse(text, "test")
    for step, value in values.items():
        got = sched if isinstance(sched, float) else sched(step)
        assert got == pytest.approx(value, rel=1e-12, abs=1e-15), step


@pytest.mark.parametrize("text,message", [
    ("fast", "'fast' is not a number or a schedule; use a number, V@STEP"),
    ("cosine:0.1,0.01", "cosine: expects 3 comma-separated numbers"),
    ("exp:0.1,0.5,0", "the step count must be an integer >= 1"),
    ("linear:0.1,x,100", "linear: 'x' is not a number"),
    ("0.1@10,0.01@20", "must start at @0 and increase"),
    ("0.1@0,0.01@0", "must start at @0 and increase"),
    ("0.1@0,0.01", "'0.01' is not VALUE@STEP"),
    ("warmup:10", "warmup:STEPS: must be followed by a schedule"),
    ("nan", "'nan' is not a finite number"),
    ("exp:0.9,-0.5,100", "exp: the rate must be > 0, got -0.5"),
])
def test_bad_schedule_text_is_one_line(text, message, capsys):
    with pytest.raises(ConfigError) as e:
        parse(text, "--learning-rate")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["train", "--optimizer", "sgd", "--learning-rate", text, "--steps", "1", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: argument --learning-rate:") and message in err[0]


@pytest.mark.parametrize("knobs,message", [
    (dict(learning_rate="exp:0.1,0.5,100", use_qmodel=True), "chooses learning rate and momentum itself"),
    (dict(momentum_type="qmodel_fixedmu", learning_rate=lambda k: 0.1), "chooses the learning rate itself"),
    (dict(momentum_schedule="linear:0.9,0.5,10", momentum_type="qmodel"), "chooses learning rate and momentum itself"),
    (dict(damping_schedule="exp:1e-2,0.5,100", adapt_damping=True), "a damping schedule sets the damping"),
    (dict(learning_rate=0.1, learning_rate_schedule="exp:0.1,0.5,100", use_qmodel=False), "given twice"),
    # text is checked at construction, every value it can produce (not at the step it goes bad)
    (dict(learning_rate="linear:0.1,-0.1,10", use_qmodel=False),
     "'learning_rate' must be >= 0, got -0.1 (a value of its schedule 'linear:0.1,-0.1,10')"),
    (dict(learning_rate="exp:0.9,-0.5,100", use_qmodel=False), "exp: the rate must be > 0, got -0.5"),
    (dict(momentum="0.5@0,0.9@10,1.0@20", use_qmodel=False, learning_rate=0.1),
     "'momentum' must be in [0, 1), got 1.0 (a value of its schedule '0.5@0,0.9@10,1.0@20')"),
    (dict(momentum="warmup:5:cosine:0.9,-0.1,10", momentum_type="qmodel_fixedmu"), "'momentum' must be in [0, 1), got -0.1"),
    (dict(damping=lambda k: -1.0), "'damping' must be >= 0, got -1.0 (its schedule at step 0)"),
])
def test_bad_schedule_combinations_are_one_line(knobs, message):
    with pytest.raises(ConfigError) as e:
        make_config("kfac", **knobs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_callable_that_goes_bad_mid_run_is_refused_at_that_step():
    """A callable cannot be checked ahead: step 5's 0 passes, step 6's -0.25 is one line naming the step."""
    cfg = make_config("kfac", learning_rate=lambda k: (5 - k) / 4, use_qmodel=False)
    assert (cfg.at("learning_rate", 4), cfg.at("learning_rate", 5)) == (0.25, 0.0)
    with pytest.raises(ConfigError, match=r"^optimizer option 'learning_rate' must be >= 0, got -0\.25 "
                                          r"\(its schedule at step 6\)$"):
        cfg.at("learning_rate", 6)


@pytest.mark.parametrize("optimizer,knobs", [
    ("sgd", dict(learning_rate="cosine:0.1,0,2", momentum=0.0)),
    ("kfac", dict(momentum_type="adam", learning_rate="linear:0.05,0,2", momentum=0.5, damping=0.1)),
])
def test_a_schedule_that_decays_to_zero_ends_the_run_gracefully(mlp, tmp_path, optimizer, knobs):
    """A learning rate scheduled down to exactly 0 is a legal end of a run: from step 2 on the
    steps run and leave the parameters unchanged (update -0 * ...), also after a resume there."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer=optimizer, batch_size=BATCH, **knobs)
    for k in range(2):
        assert tr.step(*batch(x, y, k))["learning_rate"] > 0
    before = tr.parameters()
    assert tr.step(*batch(x, y, 2))["learning_rate"] == 0.0
    for p, v in before.items():
        np.testing.assert_array_equal(tr.parameters()[p], v)
    resumed = Trainer.load_checkpoint(tr.save_checkpoint(tmp_path / "end.ckpt"), plan, batch_size=BATCH)
    assert resumed.learning_rate == 0.0
    assert resumed.step(*batch(x, y, 3))["learning_rate"] == 0.0
    for p, v in before.items():
        np.testing.assert_array_equal(resumed.parameters()[p], v)


def test_a_failing_callable_is_one_line_naming_the_step(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="sgd", learning_rate=lambda k: [0.1, 0.05][k], batch_size=BATCH)
    tr.step(*batch(x, y, 0))
    tr.step(*batch(x, y, 1))
    with pytest.raises(ConfigError, match=r"^optimizer option 'learning_rate' schedule failed at step 2: IndexError"):
        tr.step(*batch(x, y, 2))


def test_sgd_steps_use_the_scheduled_learning_rate_and_momentum(mlp):
    """SGD's velocity after step k is mu_k v - lr_k g_k with the schedules' values at k (g from
    the gradients at the step's parameters); the metrics report them."""
    plan, x, y = mlp
    lr = lambda k: 0.2 / (k + 1)  # noqa: E731
    tr = Trainer(plan, optimizer="sgd", learning_rate=lr, momentum="0.0@0,0.5@2", batch_size=BATCH)
    v = {p: 0.0 for p in tr.params}
    for k in range(4):
        _, g = gradients(plan, *batch(x, y, k), params=tr.parameters())
        m = tr.step(*batch(x, y, k))
        mu = 0.0 if k < 2 else 0.5
        assert (m["learning_rate"], m["momentum"]) == (pytest.approx(lr(k)), mu)
        v = {p: mu * v[p] - lr(k) * g[p] for p in tr.params}
        for p in tr.params:
            np.testing.assert_allclose(tr.store.to_numpy(C.velocity(p)), v[p], rtol=2e-4, atol=1e-7)


def test_adams_first_step_moves_each_weight_by_the_scheduled_learning_rate(mlp):
    """Adam's bias-corrected first step is -lr_0 g / (|g| + eps): every weight with a gradient
    moves by lr_0, here the schedule's 0.003 (not the default 1e-3)."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="adam", learning_rate="linear:0.003,0.0003,10", batch_size=BATCH)
    before = tr.parameters()
    m = tr.step(*batch(x, y, 0))
    moved = np.concatenate([np.abs(tr.parameters()[p] - before[p]).ravel() for p in tr.params])
    assert m["learning_rate"] == pytest.approx(0.003)
    assert np.median(moved) == pytest.approx(0.003, rel=1e-3)
    assert tr.step(*batch(x, y, 1))["learning_rate"] == pytest.approx(0.003 - 0.0027 / 10)


def test_kfac_damping_schedule_reaches_the_step_and_the_inverses(mlp):
    """With a damping schedule (adaptation off) step k uses schedule(k), within [min_damping,
    max_damping], and the inverses refreshed after step k are damped with schedule(k + 1):
    (F + damping) P = g for P preconditioned with them, F the block's numpy twin on the
    trainer's factors (and not with step 4's own damping)."""
    from kfac_compiler.blocks import plan_blocks

    plan, x, y = mlp
    sched = lambda k: 0.1 * 0.25 ** k  # noqa: E731  step 5: 9.8e-5, below min_damping 3e-4
    tr = Trainer(plan, optimizer="kfac", momentum_type="regular", learning_rate=0.05, damping=sched,
                 inv_update_period=1, batch_size=BATCH)
    assert not tr.config.adapt_damping
    for k in range(5):
        assert tr.step(*batch(x, y, k))["damping"] == pytest.approx(max(sched(k), 3e-4))
    assert tr.damping == 3e-4  # step 5's, clipped
    rng = np.random.default_rng(0)
    layer = plan.layers[1]
    g = {p: rng.standard_normal(v.shape).astype(np.float32) for p, v in tr.parameters().items()}
    out = tr.program("precondition").run(tr.store, {f"vec/{p}": g[p] for p in tr.params}, results=True)
    P = {p: out[f"precond/{p}"] for p in layer.params}
    factors = {s.rpartition("/")[2]: tr.store.to_numpy(s) for s in tr.store.slots()
               if s.startswith(f"factor/{layer.name}/")}
    block = plan_blocks(plan, [layer.name])[layer.name]
    for damping, close in ((3e-4, True), (sched(4), False)):
        back = block.numpy_multiply(P, factors, damping)
        err = max(np.abs(back[p] - g[p]).max() / np.abs(g[p]).max() for p in layer.params)
        assert (err < 1e-3) == close, (damping, err)


@pytest.mark.parametrize("optimizer,knobs", [
    ("kfac", dict(momentum_type="adam", learning_rate="warmup:2:cosine:0.02,0.002,6", momentum="linear:0.5,0.9,6")),
    pytest.param("kfac", dict(momentum_type="qmodel_fixedmu", momentum="0.5@0,0.9@3", damping="exp:1e-2,0.5,2"),
                 marks=pytest.mark.slow),
    ("sgd", dict(learning_rate=lambda k: 0.1 / (1 + k), momentum="linear:0.0,0.9,5")),
])
def test_resume_mid_schedule_continues_it_bit_for_bit(mlp, tmp_path, optimizer, knobs):
    """Three steps, a checkpoint, three more from it equal six uninterrupted steps exactly: the
    schedules are functions of the step count, text is stored with the knobs, a callable is
    passed again (refused in one line when it is not)."""
    plan, x, y = mlp
    straight = Trainer(plan, optimizer=optimizer, batch_size=BATCH, **knobs)
    first = Trainer(plan, optimizer=optimizer, batch_size=BATCH, **knobs)
    ms_straight = [straight.step(*batch(x, y, k)) for k in range(6)]
    for k in range(3):
        first.step(*batch(x, y, k))
    path = first.save_checkpoint(tmp_path / "run.ckpt")
    again = {k: v for k, v in knobs.items() if callable(v)}
    if again:
        with pytest.raises(ConfigError, match=r"callable learning_rate schedule, which it cannot store; pass it again"):
            Trainer.load_checkpoint(path, plan)
    resumed = Trainer.load_checkpoint(path, plan, batch_size=BATCH, **again)
    ms = [resumed.step(*batch(x, y, k)) for k in range(3, 6)]
    for a, b in zip(ms, ms_straight[3:]):
        assert (a["learning_rate"], a["momentum"], a.get("damping")) == (b["learning_rate"], b["momentum"],
                                                                          b.get("damping"))
    for p, v in straight.parameters().items():
        np.testing.assert_array_equal(resumed.parameters()[p], v)


def test_cli_schedule_is_remembered_on_resume(tmp_path, capsys):
    """`train --learning-rate TEXT`: the metrics report the schedule's values per step, and
    --resume without the flag continues the same schedule (the checkpoint stores its text)."""
    common = ["train", "--optimizer", "sgd", "--batch-size", "32", "-q", "--learning-rate", "0.1@0,0.01@3",
              "--momentum", "linear:0,0.5,4"]
    whole, part = tmp_path / "whole.csv", tmp_path / "part.csv"
    assert main([*common, "--steps", "6", "--metrics", str(whole)]) == 0
    assert main([*common, "--steps", "3", "--metrics", str(part), "--checkpoint", str(tmp_path / "c.ckpt")]) == 0
    assert main(["train", "--resume", str(tmp_path / "c.ckpt"), "--steps", "6", "-q", "--metrics", str(part)]) == 0
    capsys.readouterr()
    rows = [list(csv.DictReader(open(f))) for f in (whole, part)]
    assert [float(r["learning_rate"]) for r in rows[0]] == [0.1, 0.1, 0.1, 0.01, 0.01, 0.01]
    assert [float(r["momentum"]) for r in rows[0]] == [0.0, 0.125, 0.25, 0.375, 0.5, 0.5]
    assert rows[0] == [{**r, "step_time": rows[0][i]["step_time"]} for i, r in enumerate(rows[1])]
