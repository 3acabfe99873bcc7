"""Gradient accumulation (accumulate=k): k micro-batches, one Trainer.step each, give the
update of one step on their concatenation. Truth: the project's own step on the
concatenated batch (an independent path: one session, no running sum, the whole batch's
statistics in one pass), for SGD, Adam and K-FAC with a fixed learning rate, factors and
inverses included; for K-FAC's quadratic model the same step with the model on the last
micro-batch's examples (what accumulation documents); numpy for the moving-average weights."""
from __future__ import annotations

import csv

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.errors import ConfigError
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.optimizers.accumulate import Accumulation
from kfac_compiler.runtime import Trainer, fit
from kfac_compiler.runtime import batches as seeded
from kfac_compiler.runtime.checkpoint import read_meta

BATCH = 128


@pytest.fixture(scope="module")
def mlp():
    entry = ZOO["mlp_classifier"]
    plan = kc.compile(get_model("mlp_classifier", hidden=(16, 16)), loss=entry.loss, output="logits", emit=False)
    x, y = entry.make_data(4 * BATCH, seed=0)
    return plan, x["input"], y


def batches(x, y, steps: int, batch: int = BATCH):
    return [(x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]) for s in range(steps)]


def whole(tr: Trainer, xb, yb) -> dict:
    return tr.step({"input": xb}, yb)


def in_pieces(tr: Trainer, xb, yb, k: int) -> dict:
    """The batch as k micro-batches; the last call's metrics (the update's)."""
    for part in np.array_split(np.arange(len(yb)), k):
        m = tr.step({"input": xb[part]}, yb[part])
    return m


def assert_state_close(a: Trainer, b: Trainer, prefixes: tuple[str, ...], rtol: float) -> None:
    sa, sb = a.state(), b.state()
    slots = [s for s in sb if s in a.params or s.startswith(prefixes)]
    assert slots
    for s in slots:
        scale = float(np.abs(sb[s]).max())
        np.testing.assert_allclose(sa[s], sb[s], rtol=rtol, atol=rtol * scale, err_msg=s)


@pytest.mark.parametrize("optimizer,knobs,state", [
    ("sgd", {}, ("velocity/",)),
    ("sgd", dict(clip_norm=0.5, decoupled_weight_decay=0.1, l2_reg=1e-3, multi_tensor=True), ("velocity/",)),
    ("adam", dict(learning_rate=1e-2), ("adam_m/", "adam_v/")),
    ("adam", dict(learning_rate=1e-2, clip_norm=0.5, decoupled_weight_decay=0.1), ("adam_m/", "adam_v/")),
], ids=["sgd", "sgd-recipes-multi-tensor", "adam", "adamw-clipped"])
@pytest.mark.slow
def test_first_order_accumulation_takes_the_whole_batch_steps(mlp, optimizer, knobs, state):
    """Three updates from 4 micro-batches of 32 each equal three steps on the 128-example
    batches: parameters and optimizer state to float32 rounding, and the update's metrics
    (the loss the mean of the micro-batches', the gradient norm the whole batch's, before
    clipping)."""
    plan, x, y = mlp
    full = Trainer(plan, optimizer=optimizer, threads=1, **knobs)
    acc = Trainer(plan, optimizer=optimizer, threads=1, accumulate=4, **knobs)
    for xb, yb in batches(x, y, 3):
        mf, ma = whole(full, xb, yb), in_pieces(acc, xb, yb, 4)
        for key in ("loss", "grad_norm", "update_norm"):
            assert ma[key] == pytest.approx(mf[key], rel=2e-5), key
        assert "accumulating" not in ma and ma["micro_batch"] == 3 and ma["rejected"] == 0
    assert (acc.step_count, acc.applied_steps) == (full.step_count, full.applied_steps) == (3, 3)
    assert_state_close(acc, full, state, rtol=2e-5)


KFAC_FIXED = dict(learning_rate=0.1, momentum=0.5, damping=0.1, inv_update_period=2)


@pytest.mark.parametrize("k,knobs", [
    (4, dict(KFAC_FIXED, stats_batch_size=32)),
    (2, dict(KFAC_FIXED, stats_batch_size=None, cov_update_period=2, burn_in_steps=1, clip_norm=0.3,
             decoupled_weight_decay=0.1)),
    (2, dict(KFAC_FIXED, momentum_type="adam", mode="empirical", stats_batch_size=None)),
], ids=["regular-sampled-sub-batch", "statistics-every-2nd-burn-in-recipes", "adam-momentum-empirical"])
@pytest.mark.slow
def test_kfac_accumulation_takes_the_whole_batch_steps_factors_included(mlp, k, knobs):
    """K-FAC with a fixed learning rate: after every update (the first, whose inverses come
    from its own batch; inverse refreshes every 2nd step) the factors, the inverses, the
    parameters and the velocity equal those of the step on the whole batch. The factors are
    the whole batch's statistics folded into the moving average: every micro-batch folds its
    own with the weight Accumulation.coefficient gives, on the rows the whole batch's
    statistics sub-batch takes (k divides stats_batch_size), with the sampled-Fisher noise of
    the same rows (drawn in order from the same stream)."""
    plan, x, y = mlp
    full = Trainer(plan, optimizer="kfac", threads=1, **knobs)
    acc = Trainer(plan, optimizer="kfac", threads=1, accumulate=k, **knobs)
    for xb, yb in batches(x, y, 4):
        mf, ma = whole(full, xb, yb), in_pieces(acc, xb, yb, k)
        assert ma["loss"] == pytest.approx(mf["loss"], rel=1e-5)
        assert ma.get("burn_in") == mf.get("burn_in") and ma["rejected"] == mf["rejected"] == 0
        assert_state_close(acc, full, ("factor/",), rtol=2e-5)  # one accumulated step's factors: the whole batch's
        assert_state_close(acc, full, ("inverse/", "velocity/", "grad_velocity/"), rtol=5e-5)
    assert acc.policy.ema_weight == pytest.approx(full.policy.ema_weight, rel=1e-12)


@pytest.mark.slow
def test_a_sub_batch_the_micro_batches_do_not_divide_is_said_and_is_the_rounded_up_one(mlp):
    """stats_batch_size 64 over 3 micro-batches of 40: each takes ceil(64 / 3) = 22 rows, as
    the warning says, and the factors after each update are those of the whole 120-row batch's
    statistics on 66 rows, the size the warning names (rows floor(k 120 / 66) are micro-batch
    i's rows floor(j 40 / 22))."""
    plan, x, y = mlp
    knobs = dict(KFAC_FIXED, stats_batch_size=64)
    full = Trainer(plan, optimizer="kfac", threads=1, **dict(knobs, stats_batch_size=66))
    acc = Trainer(plan, optimizer="kfac", threads=1, accumulate=3, **knobs)
    with pytest.warns(UserWarning, match="stats_batch_size 64 does not divide among 3 micro-batches: each "
                                         "takes 22 rows, 66 in all") as told:
        for xb, yb in batches(x, y, 3, batch=120):
            whole(full, xb, yb), in_pieces(acc, xb, yb, 3)
            assert_state_close(acc, full, ("factor/",), rtol=2e-5)
    assert len([w for w in told if "does not divide" in str(w.message)]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["empirical", "gradients"])
def test_broadcast_layers_accumulate_to_the_whole_batch_statistics(mode):
    """The transformer block's position table (a broadcast layer: exact per-example gradients)
    and every other factor: 2 micro-batches fold into the moving average the statistics of the
    whole batch, so the accumulated steps are the whole-batch steps. (The sqrt(N) x batch
    gradient of the generic fallback was not: its u u^T is not linear in the batch.)"""
    entry = ZOO["transformer_block"]
    plan = kc.compile(get_model("transformer_block"), loss=entry.loss, output="logits", emit=False)
    assert plan.layer("pos_emb").kind == "broadcast"
    x, y = entry.make_data(3 * 64, seed=0)
    knobs = dict(KFAC_FIXED, mode=mode, stats_batch_size=None)
    full = Trainer(plan, optimizer="kfac", threads=1, **knobs)
    acc = Trainer(plan, optimizer="kfac", threads=1, accumulate=2, **knobs)
    for xb, yb in batches(x["input"], y, 3, 64):
        mf, ma = whole(full, xb, yb), in_pieces(acc, xb, yb, 2)
        assert ma["loss"] == pytest.approx(mf["loss"], rel=1e-5)
        sa, sf = acc.state(), full.state()
        factors = [s for s in sf if s.startswith("factor/")]
        assert "factor/pos_emb/diag" in factors
        for s in factors:
            np.testing.assert_allclose(sa[s], sf[s], rtol=2e-5, atol=2e-5 * np.abs(sf[s]).max(), err_msg=s)
        # parameters and inverses: the transformer's float32 rounding, amplified by the steps
        assert_state_close(acc, full, ("inverse/", "velocity/"), rtol=2e-4)


@pytest.mark.slow
def test_kfac_quadratic_model_runs_on_the_last_micro_batch(mlp):
    """With the quadratic model (the default) the gradient, the factors and P are the whole
    batch's and the model's curvature and gradient terms are the last micro-batch's: the
    accumulated steps equal whole-batch steps whose model runs on a sub-batch made of the last
    micro-batch's examples (the batch ordered so that the sub-batch's rows, every 2nd, are
    they). The safeguards that evaluate the batch again (damping adaptation, the decrease cap,
    the spike guard) are off: they too see the last micro-batch here, the whole batch there."""
    plan, x, y = mlp
    knobs = dict(mode="empirical", stats_batch_size=None, adapt_damping=False, max_predicted_decrease=None,
                 loss_spike_factor=None)
    full = Trainer(plan, optimizer="kfac", threads=1, qmodel_batch_size=BATCH // 2, **knobs)
    acc = Trainer(plan, optimizer="kfac", threads=1, accumulate=2, **knobs)
    for step, (xb, yb) in enumerate(batches(x, y, 3)):
        order = np.empty(BATCH, np.int64)  # rows 0, 2, 4, ... of the whole batch: the second micro-batch
        order[0::2], order[1::2] = np.arange(BATCH // 2, BATCH), np.arange(BATCH // 2)
        mf, ma = whole(full, xb[order], yb[order]), in_pieces(acc, xb, yb, 2)
        rel = 1e-5 if step == 0 else 2e-4  # the 2x2 solve amplifies the rounding of the reordered sums
        assert (ma["learning_rate"], ma["momentum"]) == (pytest.approx(mf["learning_rate"], rel=rel),
                                                         pytest.approx(mf["momentum"], rel=rel, abs=1e-6))
        assert_state_close(acc, full, ("factor/",), rtol=rel)
        assert_state_close(acc, full, ("velocity/",), rtol=10 * rel)
    assert abs(ma["momentum"]) > 0.05  # the momentum term took part


def test_micro_batch_weights_fold_into_the_whole_batch_moving_average():
    """Accumulation.coefficient: k folds f <- (1 - c_i) f + c_i S_i equal (1 - c) f + c mean S
    (numpy, float64), for the first batch's c = 1 (the running mean) and a later c."""
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 7):
        for c in (1.0, 0.1, 0.35):
            f0, stats = rng.standard_normal(5), rng.standard_normal((k, 5))
            cycle, f = Accumulation(k), f0.copy()
            for s in stats:
                c_i = cycle.coefficient(c)
                assert 0 < c_i <= 1
                f = (1 - c_i) * f + c_i * s
                cycle.taken += 1
            np.testing.assert_allclose(f, (1 - c) * f0 + c * stats.mean(axis=0), rtol=1e-13, atol=1e-13)


@pytest.mark.slow  # as the other K-FAC accumulation comparisons
def test_kfac_accumulation_of_per_example_blocks_takes_the_whole_batch_steps():
    """The same on the depthwise CNN with its depthwise conv's channel_full block, a mean of
    per-example outer products [C_out, K+1, K+1]: folded per micro-batch it equals the whole
    batch's (factors, inverses, parameters, velocity)."""
    entry = ZOO["depthwise_cnn"]
    plan = kc.compile(get_model("depthwise_cnn"), loss=entry.loss, output="logits", emit=False,
                      layers={"dwconv": "channel_full"})
    assert {s.name for s in plan.factors["dwconv"]} == {"full"}
    x, y = entry.make_data(2 * BATCH, seed=0)
    knobs = dict(KFAC_FIXED, stats_batch_size=32)
    full = Trainer(plan, optimizer="kfac", threads=1, **knobs)
    acc = Trainer(plan, optimizer="kfac", threads=1, accumulate=2, **knobs)
    for xb, yb in batches(x["input"], y, 2):
        mf, ma = whole(full, xb, yb), in_pieces(acc, xb, yb, 2)
        assert ma["loss"] == pytest.approx(mf["loss"], rel=1e-5) and ma["rejected"] == mf["rejected"] == 0
        assert_state_close(acc, full, ("factor/",), rtol=2e-5)
        assert_state_close(acc, full, ("inverse/", "velocity/"), rtol=5e-5)


def test_micro_batch_calls_report_accumulating_and_the_update_the_cycle_mean(mlp):
    """Every call but the cycle's last returns accumulating 1, its index and its own loss, and
    changes no parameter; the last returns the update's metrics with the mean loss; the step
    counters advance once per cycle."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="sgd", threads=1, accumulate=3)
    before = tr.parameters()
    parts = [slice(0, 32), slice(32, 64), slice(64, 96)]
    losses = [tr.evaluate({"input": x[p]}, y[p])["loss"] for p in parts]
    metrics = [tr.step({"input": x[p]}, y[p]) for p in parts]
    for i, m in enumerate(metrics[:2]):
        assert (m["accumulating"], m["micro_batch"], m["step"]) == (1.0, i, 0.0)
        assert m["loss"] == pytest.approx(losses[i], rel=1e-6)
    last = metrics[2]
    assert "accumulating" not in last and last["micro_batch"] == 2
    assert last["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    assert (tr.step_count, tr.applied_steps) == (1, 1)
    assert all(not np.array_equal(before[p], v) for p, v in tr.parameters().items())


@pytest.mark.slow
def test_accumulation_holds_one_gradient_sized_sum_and_no_activations(mlp):
    """What accumulation keeps between micro-batches: a running sum per parameter, of its
    shape (no slot sized by the batch: a micro-batch's activations live only in its run)."""
    plan, x, y = mlp
    for optimizer, knobs in (("adam", {}), ("kfac", KFAC_FIXED)):
        full = Trainer(plan, optimizer=optimizer, threads=1, **knobs)
        acc = Trainer(plan, optimizer=optimizer, threads=1, accumulate=4, **knobs)
        whole(full, x[:BATCH], y[:BATCH])
        acc.step({"input": x[:32]}, y[:32])
        extra = {s: v.shape for s, v in acc.state().items() if s not in full.state()}
        assert extra == {f"grad_accum/{p}": v.shape for p, v in acc.parameters().items()}


def test_a_non_finite_micro_batch_rejects_the_update(mlp):
    """A micro-batch whose loss overflows (inputs of 3e38) poisons its cycle: the update is
    rejected (parameters, moments and velocity as they were, loss NaN, K-FAC's damping raised
    ten-fold), and for Adam the next cycle takes the step a fresh trainer takes on its batch.
    (K-FAC's factors keep the finite micro-batches' statistics: docs/runtime.md.)"""
    plan, x, y = mlp
    bad = x[:64].copy()
    bad[:32] = 3e38
    for optimizer, knobs in (("adam", {}), ("kfac", KFAC_FIXED)):
        tr = Trainer(plan, optimizer=optimizer, threads=1, accumulate=2, **knobs)
        before = tr.state()
        m = in_pieces(tr, bad, y[:64], 2)
        assert m["rejected"] == 1 and np.isnan(m["loss"]) and tr.applied_steps == 0 and tr.step_count == 1
        kept = [s for s in before if s in tr.params or s.startswith(("adam_", "velocity/"))]
        assert len(kept) > len(tr.params) and all(np.array_equal(tr.state()[s], before[s]) for s in kept)
        if optimizer == "kfac":
            assert tr.damping == pytest.approx(10 * knobs["damping"])
            continue
        fresh = Trainer(plan, optimizer=optimizer, threads=1, accumulate=2, **knobs)
        assert in_pieces(tr, x[64:128], y[64:128], 2)["rejected"] == 0
        in_pieces(fresh, x[64:128], y[64:128], 2)
        for p, v in fresh.parameters().items():
            np.testing.assert_array_equal(tr.parameters()[p], v, err_msg=p)


@pytest.mark.slow
def test_checkpoints_come_between_cycles_and_resume_the_run_bit_for_bit(mlp, tmp_path):
    """save_checkpoint in the middle of a cycle is refused with one line (the running sum is
    not stored); between cycles it stores no running sum, and a trainer loaded from it
    continues exactly as the uninterrupted one. It loads without accumulation too."""
    plan, x, y = mlp
    knobs = dict(inv_update_period=2, accumulate=2)
    straight = Trainer(plan, optimizer="kfac", threads=1, **knobs)
    first = Trainer(plan, optimizer="kfac", threads=1, **knobs)
    steps = batches(x, y, 3)
    for xb, yb in steps:
        in_pieces(straight, xb, yb, 2)
    in_pieces(first, *steps[0], 2)
    path = first.save_checkpoint(tmp_path / "c.npz")
    assert not [s for s in read_meta(path)["slots"] if s.startswith("grad_accum/")]
    first.step({"input": x[:16]}, y[:16])
    with pytest.raises(ConfigError) as e:
        first.save_checkpoint(tmp_path / "mid.npz")
    assert str(e.value) == ("save_checkpoint: the trainer is in the middle of an accumulation cycle (1 of 2 "
                            "micro-batches taken); call it after the cycle's last micro-batch (the step whose "
                            "metrics have no 'accumulating')")
    assert not (tmp_path / "mid.npz").exists()
    with pytest.raises(ConfigError, match="^burn_in: the trainer is in the middle of an accumulation cycle"):
        first.burn_in({"input": x[:16]}, y[:16])
    resumed = Trainer.load_checkpoint(path, plan, threads=1)
    assert resumed.config.accumulate == 2 and read_meta(path)["host"]["batch_size"] == BATCH  # the step's rows
    for xb, yb in steps[1:]:
        in_pieces(resumed, xb, yb, 2)
    for s, v in straight.state().items():
        assert np.array_equal(resumed.state()[s], v), s
    plain = Trainer.load_checkpoint(path, plan, threads=1, accumulate=1)
    assert plain.step({"input": steps[1][0]}, steps[1][1])["rejected"] == 0


@pytest.mark.parametrize("knobs,message", [
    (dict(accumulate=0), "optimizer option 'accumulate' must be an integer >= 1, got 0"),
    (dict(accumulate=2.0), "optimizer option 'accumulate' must be an integer, got 2.0"),
    (dict(accumulate=True), "optimizer option 'accumulate' must be an integer, got True"),
])
def test_bad_accumulate_values_are_one_line(mlp, knobs, message):
    plan, _, _ = mlp
    for optimizer in ("sgd", "kfac"):
        with pytest.raises(ConfigError) as e:
            Trainer(plan, optimizer=optimizer, **knobs)
        assert str(e.value) == message


def test_an_optimizer_plugin_without_accumulation_refuses_it(mlp):
    from extensions import normalized_gd  # noqa: F401  (registers the plugin; tests/ is on sys.path)

    plan, _, _ = mlp
    with pytest.raises(ConfigError) as e:
        Trainer(plan, optimizer="normalized_gd", accumulate=2)
    assert str(e.value) == ("optimizer 'normalized_gd' does not support gradient accumulation (accumulate=2): its "
                            "step graph does not read the accumulated gradient; use accumulate=1")


def test_fit_runs_each_batch_as_the_cycles_micro_batches(mlp):
    """runtime.fit with accumulate=4: each batch is one step's, in 4 micro-batches: the history
    has one entry per step, equal to the plain fit's; a batch that does not split is one line."""
    plan, x, y = mlp
    plain = fit(Trainer(plan, optimizer="adam", threads=1), seeded({"input": x}, y, 64), steps=3)
    pieces = fit(Trainer(plan, optimizer="adam", threads=1, accumulate=4), seeded({"input": x}, y, 64), steps=3)
    assert [m["step"] for m in pieces.steps] == [0.0, 1.0, 2.0]
    np.testing.assert_allclose(pieces.losses, plain.losses, rtol=1e-6)
    with pytest.raises(ConfigError) as e:
        fit(Trainer(plan, optimizer="adam", accumulate=4), seeded({"input": x}, y, 30), steps=1)
    assert str(e.value) == ("fit: batch 0 has 30 rows, which do not split into accumulate=4 equal micro-batches; "
                            "give batches of a multiple of it")


# --------------------------------------------------------------------------- the command line
def train(argv, capsys):
    from kfac_compiler.cli import main

    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_train_accumulate_gives_the_plain_runs_metrics(tmp_path, capsys):
    """`--accumulate 4` runs each 64-example batch as 4 micro-batches: the same batches, the
    same metrics rows (to float32 rounding) as the plain run; the checkpoint records the step's
    batch size, which a resume defaults to."""
    common = ["mlp_classifier", "--optimizer", "kfac", "--learning-rate", "0.05", "--damping", "0.1", "--steps", "3",
              "--batch-size", "64", "-q"]
    plain, pieces, ck = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "c.npz"
    assert train([*common, "--metrics", str(plain)], capsys)[0] == 0
    code, out, err = train([*common, "--metrics", str(pieces), "--accumulate", "4", "--checkpoint", str(ck)], capsys)
    assert code == 0, err
    a, b = list(csv.DictReader(open(plain))), list(csv.DictReader(open(pieces)))
    assert [r["step"] for r in a] == [r["step"] for r in b] == ["0", "1", "2"]
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "update_norm"):
            assert float(rb[key]) == pytest.approx(float(ra[key]), rel=1e-4), key
    meta = read_meta(ck)
    assert meta["knobs"]["accumulate"] == 4 and meta["host"]["batch_size"] == 64


@pytest.mark.parametrize("argv,line", [
    (["--accumulate", "0"], "error: --accumulate must be >= 1, got 0"),
    (["--batch-size", "30", "--accumulate", "4"],
     "error: --batch-size 30 does not split into --accumulate 4 equal micro-batches; use a batch size divisible by 4"),
    (["--knob", "accumulate=2"], "error: --knob accumulate: use --accumulate instead (it has its own flag)"),
], ids=["zero", "indivisible", "as-knob"])
def test_bad_accumulate_options_are_one_line(capsys, argv, line):
    code, out, err = train(["mlp_classifier", "--steps", "1", "-q", *argv], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == line
