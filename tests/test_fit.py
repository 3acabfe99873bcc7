"""runtime.fit: the API's loop with held-out evaluation, against the same loop written by hand."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import zoo_case
from kfac_compiler.errors import ConfigError
from kfac_compiler.runtime import Trainer, batches, fit
from kfac_compiler.runtime.data import batch_indices


@pytest.fixture(scope="module")
def case():
    plan, inputs, y = zoo_case("mlp_classifier", 300, hidden=(16,))
    train = ({k: v[:240] for k, v in inputs.items()}, y[:240])
    held = ({k: v[240:] for k, v in inputs.items()}, y[240:])
    return plan, train, held


def _trainer(plan):
    return Trainer(plan, optimizer="sgd", learning_rate=0.2, seed=0)


def test_fit_is_the_hand_written_loop(case):
    plan, (x, y), held = case
    history = fit(_trainer(plan), batches(x, y, 32, seed=3), steps=7, validation=held, eval_every=3)

    by_hand = _trainer(plan)
    losses, evaluations = [], []
    for s in range(7):
        idx = batch_indices(240, 32, s, 3)
        losses.append(by_hand.step({k: v[idx] for k, v in x.items()}, y[idx])["loss"])
        if s in (2, 5, 6):  # every 3rd step and the last
            evaluations.append(by_hand.evaluate(*held, batch_size=1024))

    assert history.losses == losses
    assert [m["step"] for m in history.evaluations] == [2.0, 5.0, 6.0]
    assert [m["eval_loss"] for m in history.evaluations] == [e["loss"] for e in evaluations]
    assert [m["eval_accuracy"] for m in history.evaluations] == [e["accuracy"] for e in evaluations]
    assert history.steps[5]["eval_loss"] == evaluations[1]["loss"] and "eval_loss" not in history.steps[4]
    assert history.best() == min(history.evaluations, key=lambda m: m["eval_loss"])
    assert losses[-1] < losses[0]


def test_a_callback_stops_and_the_last_parameters_are_evaluated(case):
    plan, (x, y), held = case
    seen = []
    trainer = _trainer(plan)
    history = fit(trainer, batches(x, y, 32), steps=50, validation=held,
                  callback=lambda step, m: seen.append(step) or step < 3)
    assert seen == [0, 1, 2, 3] and len(history.steps) == 4 and trainer.step_count == 4
    assert history.evaluations[-1]["step"] == 3.0
    assert history.evaluations[-1]["eval_loss"] == trainer.evaluate(*held, batch_size=1024)["loss"]


def test_keep_best_ends_with_the_best_evaluation_s_model(case):
    """SGD at lr 1.0 passes its best held-out loss at step 5 and ends well above it: with
    keep_best the trainer holds the parameters a trainer stepped by hand to step 5 has
    (bitwise), evaluates to the best loss, and keeps its step count; without, the last."""
    plan, (x, y), held = case
    kept, last = (Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0) for _ in range(2))
    history = fit(kept, batches(x, y, 32, seed=3), steps=30, validation=held, eval_every=1, keep_best=True)
    fit(last, batches(x, y, 32, seed=3), steps=30, validation=held, eval_every=1)
    best = history.best()
    assert best is not None and 0 < best["step"] < 29
    assert history.evaluations[-1]["eval_loss"] > 1.2 * best["eval_loss"]

    by_hand = Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0)
    for s in range(int(best["step"]) + 1):
        idx = batch_indices(240, 32, s, 3)
        by_hand.step({k: v[idx] for k, v in x.items()}, y[idx])
    for name, value in by_hand.parameters().items():
        np.testing.assert_array_equal(kept.parameters()[name], value)
    assert kept.evaluate(*held, batch_size=1024)["loss"] == best["eval_loss"]
    assert kept.step_count == last.step_count == 30
    assert last.evaluate(*held, batch_size=1024)["loss"] == history.evaluations[-1]["eval_loss"]


def test_patience_stops_after_that_many_evaluations_without_a_new_lowest_loss(case):
    """SGD at lr 1.0 (the run above): with patience 3 the loop ends at the third evaluation in
    a row above the lowest held-out loss, the evaluations of an unstopped run's prefix; with
    keep_best the trainer then holds the best model; a patience longer than the run stops
    nothing."""
    plan, (x, y), held = case
    full = fit(Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0), batches(x, y, 32, seed=3), steps=30,
               validation=held, eval_every=1)
    losses = [m["eval_loss"] for m in full.evaluations]
    lowest, waited, expected = float("inf"), 0, None  # the rule, by hand, on the unstopped run's losses
    for step, loss in enumerate(losses):
        lowest, waited = (loss, 0) if loss < lowest else (lowest, waited + 1)
        if waited == 3:
            expected = step
            break
    assert expected is not None and expected < 29
    trainer = Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0)
    history = fit(trainer, batches(x, y, 32, seed=3), steps=30, validation=held, eval_every=1, patience=3,
                  keep_best=True)
    assert history.stopped_early == expected and trainer.step_count == expected + 1
    assert [m["eval_loss"] for m in history.evaluations] == losses[:expected + 1]
    assert trainer.evaluate(*held, batch_size=1024)["loss"] == min(losses[:expected + 1])
    long = fit(Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0), batches(x, y, 32, seed=3), steps=30,
               validation=held, eval_every=1, patience=100)
    assert long.stopped_early is None and len(long.steps) == 30
    with pytest.raises(ConfigError, match="patience needs validation"):
        fit(Trainer(plan, optimizer="sgd", seed=0), batches(x, y, 32), steps=2, patience=2)
    with pytest.raises(ConfigError, match="patience"):
        fit(Trainer(plan, optimizer="sgd", seed=0), batches(x, y, 32), steps=2, validation=held, patience=0)


def test_a_checkpoint_carries_the_kept_model_and_a_resumed_fit_must_beat_it(case, tmp_path):
    """The best model kept by fit(keep_best) is saved in the checkpoint beside the last state;
    a trainer loaded from it continues to step 30 with keep_best and ends with the model of
    the best evaluation over both parts, as one uninterrupted run does (bitwise)."""
    plan, (x, y), held = case
    whole = Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0)
    history = fit(whole, batches(x, y, 32, seed=3), steps=30, validation=held, eval_every=1, keep_best=True)
    best = history.best()
    assert best is not None and best["step"] < 12

    first, path = Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0), str(tmp_path / "c.ckpt")

    def stop_at_11(step, metrics):  # a checkpoint of the run as it is (fit restores the kept model only at its end)
        if step == 11:
            first.save_checkpoint(path)
        return step < 11

    fit(first, batches(x, y, 32, seed=3), steps=30, validation=held, eval_every=1, keep_best=True, callback=stop_at_11)
    resumed = Trainer.load_checkpoint(path, plan)
    assert resumed.best_model is not None and resumed.best_model.step == best["step"]
    assert resumed.best_model.loss == best["eval_loss"]
    later = fit(resumed, batches(x, y, 32, seed=3, start=12), steps=18, validation=held, eval_every=1, keep_best=True)
    assert min(m["eval_loss"] for m in later.evaluations) > best["eval_loss"]  # the kept one came from the first part
    for name, value in whole.parameters().items():
        np.testing.assert_array_equal(resumed.parameters()[name], value)
    assert resumed.step_count == 30


def test_a_resumed_fit_evaluates_at_the_uninterrupted_run_s_steps(case, tmp_path):
    """Evaluations every 4 steps of the trainer's count, not of the call's: resumed after step
    17, fit evaluates after steps 19, 23, 27 (and the last, 29) as the uninterrupted run does,
    so keep_best keeps the same evaluation's model (it kept step 25's, at 21, 25, 29, before)."""
    plan, (x, y), held = case
    whole = Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0)
    history = fit(whole, batches(x, y, 32, seed=3), steps=30, validation=held, eval_every=4, keep_best=True)
    assert [int(m["step"]) for m in history.evaluations] == [3, 7, 11, 15, 19, 23, 27, 29]
    first, path = Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0), str(tmp_path / "c.ckpt")

    def stop_at_17(step, metrics):
        if step == 17:
            first.save_checkpoint(path)
        return step < 17

    fit(first, batches(x, y, 32, seed=3), steps=30, validation=held, eval_every=4, keep_best=True, callback=stop_at_17)
    resumed = Trainer.load_checkpoint(path, plan)
    later = fit(resumed, batches(x, y, 32, seed=3, start=18), steps=12, validation=held, eval_every=4, keep_best=True)
    assert [int(m["step"]) for m in later.evaluations] == [19, 23, 27, 29]
    assert [m["eval_loss"] for m in later.evaluations] == [m["eval_loss"] for m in history.evaluations[4:]]
    for name, value in whole.parameters().items():
        np.testing.assert_array_equal(resumed.parameters()[name], value)
    # the default interval is a 20th of the run, 40 steps: every 2nd, resumed or not
    default = fit(Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0), batches(x, y, 32, seed=3), steps=40,
                  validation=held)
    again = Trainer.load_checkpoint(path, plan)
    rest = fit(again, batches(x, y, 32, seed=3, start=18), steps=22, validation=held)
    assert [int(m["step"]) for m in rest.evaluations] == [int(m["step"]) for m in default.evaluations if m["step"] >= 18]


def test_a_checkpoint_s_damaged_kept_model_is_one_line(case, tmp_path):
    import json

    from kfac_compiler.errors import CheckpointError

    plan, (x, y), held = case
    tr = Trainer(plan, optimizer="sgd", learning_rate=1.0, seed=0)
    fit(tr, batches(x, y, 32, seed=3), steps=3, validation=held, eval_every=1, keep_best=True)
    path = tr.save_checkpoint(str(tmp_path / "c.ckpt"))
    arrays = dict(np.load(path))
    meta = json.loads(bytes(arrays["__meta__"]).decode())
    name = meta["best"]["values"][0]
    bad_shape = {**arrays, "best_00000": np.zeros((1, 1), np.float32)}
    bad_meta = {**meta, "best": {**meta["best"], "loss": "low"}}
    for i, (damaged, message) in enumerate([
            (bad_shape, f"the kept best model's {name!r} is float32 [1, 1], expected"),
            ({**arrays, "__meta__": np.frombuffer(json.dumps(bad_meta).encode(), np.uint8)},
             "metadata entry 'best' must be an object with 'step', a finite 'loss'")]):
        np.savez(tmp_path / f"bad{i}.npz", **damaged)
        with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
            Trainer.load_checkpoint(str(tmp_path / f"bad{i}.npz"), plan)


def test_batches_run_out_and_resume_where_they_stopped(case):
    plan, (x, y), held = case
    finite = [(xb, yb) for (xb, yb), _ in zip(batches(x, y, 32, seed=1), range(3))]
    history = fit(_trainer(plan), finite, validation=held)  # no steps: until the batches run out
    assert len(history.steps) == 3 and [m["step"] for m in history.evaluations] == [2.0]

    resumed = next(batches(x, y, 32, seed=1, start=2))
    np.testing.assert_array_equal(resumed[1], finite[2][1])
    np.testing.assert_array_equal(resumed[0]["input"], finite[2][0]["input"])


@pytest.mark.parametrize("kwargs,message", [
    ({"eval_every": 2}, "fit: eval_every needs validation=(inputs, targets)"),
    ({"steps": -1}, "fit: steps must be an integer >= 0"),
    ({"validation": [1, 2, 3]}, "fit: validation must be a tuple (inputs, targets)"),
    ({"keep_best": True}, "fit: keep_best needs validation=(inputs, targets)"),
])
def test_bad_arguments_are_one_line(case, kwargs, message):
    plan, (x, y), _ = case
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fit(_trainer(plan), batches(x, y, 32), **kwargs)


def test_a_batch_that_is_not_a_tuple_is_named(case):
    plan, (x, y), _ = case
    with pytest.raises(ConfigError, match="fit: batch 0 must be a tuple"):
        fit(_trainer(plan), [x], steps=1)
