"""benchmarks/harness.py, the loop and records every benchmark entry point shares: the
to-target loop's stops and bookkeeping, the medians, interleaving and the results file (no
timing is asserted)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "harness.py")
_spec = importlib.util.spec_from_file_location("harness", _PATH)
harness = sys.modules.setdefault("harness", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(harness)


def decaying(losses):
    """(step, loss) over a list of losses: step k sets the current loss to losses[k]."""
    state = {"loss": float("inf")}

    def step(k):
        state["loss"] = losses[k]
        return losses[k]

    return step, lambda: state["loss"]


def test_to_target_stops_at_the_first_evaluation_at_or_below_the_target():
    step, loss = decaying([5.0, 4.0, 3.0, 2.0, 1.0, 0.5])
    run = harness.to_target(step, loss, max_steps=6, targets=[2.5], every=2)
    # evaluated after steps 2 (4.0) and 4 (2.0): reached at 4
    assert run.reached and run.stop == "reached"
    assert run.steps == 4 and run.loss == 2.0
    assert run.hit(2.5)[0] == 4 and run.curve == [(2, 4.0), (4, 2.0)]
    assert len(run.step_times) == 4 and run.seconds == pytest.approx(sum(run.step_times))


def test_to_target_without_stopping_records_every_target_and_checkpoint():
    step, loss = decaying([5.0, 4.0, 3.0, 2.0, 1.0, 0.5])
    run = harness.to_target(step, loss, max_steps=6, targets=[3.5, 0.75, 0.1], every=2, checkpoints=[3],
                            stop_at_target=False)
    assert run.steps == 6 and run.loss == 0.5  # the last step is always evaluated
    assert run.hit(3.5)[0] == 3 and run.hit(0.75)[0] == 6 and run.hit(0.1) == (None, None)
    assert run.marks[3][0] == 3.0 and run.stop == "steps" and not run.reached


def test_to_target_stops_on_a_non_finite_loss():
    step, loss = decaying([5.0, float("nan"), 1.0])
    run = harness.to_target(step, loss, max_steps=3, targets=[2.0])
    assert run.stop == "diverged" and run.steps == 2 and math.isnan(run.loss)

    # a step that reports no batch loss: the evaluated loss decides
    state = {"k": 0}
    run = harness.to_target(lambda k: state.update(k=k), lambda: float("inf") if state["k"] else 1.0,
                            max_steps=5, every=1)
    assert run.stop == "diverged" and run.steps == 2


def test_to_target_stops_at_its_time_cap():
    step, loss = decaying([5.0] * 10)
    run = harness.to_target(step, loss, max_steps=10, targets=[1.0], every=100, max_seconds=0.0)
    assert run.stop == "time" and run.steps == 1 and run.curve == [(1, 5.0)]


def test_median_and_spread_ignore_missing_values():
    assert harness.median([3.0, None, 1.0, 2.0]) == 2.0
    assert math.isnan(harness.median([None]))
    s = harness.spread([0.002, 0.001, None, 0.004])
    assert (s.median, s.lo, s.hi, s.n) == (0.002, 0.001, 0.004, 3)
    assert s.scaled(1e3).format(".1f", " ms") == "2.0 ms (1.0-4.0)"
    assert harness.spread([]).format() == "-"


def test_interleave_rotates_the_order_and_keeps_each_rounds_samples():
    order = []

    def contender(name, value):
        def go():
            order.append(name)
            return [value, value]
        return go

    res = harness.interleave({"a": contender("a", 1.0), "b": contender("b", 2.0)}, rounds=3, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then rounds starting a, b, a
    assert res == {"a": [[1.0, 1.0]] * 3, "b": [[2.0, 2.0]] * 3}
    assert harness.round_ratios(res, "b", "a") == [2.0, 2.0, 2.0]
    assert harness.flat(res["a"]) == [1.0] * 6


def test_timed_returns_one_duration_per_call_after_the_warm_up():
    calls = []
    times = harness.timed(lambda: calls.append(1), reps=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_run_writes_a_dated_file_with_machine_commit_and_load(tmp_path):
    run = harness.Run("demo", ["--flag"], script="benchmarks/demo.py")
    run.extra["device"] = "cpu"
    path = run.write("| a |\n|---|\n| 1 |", {"x": 1.5}, str(tmp_path))
    assert os.path.basename(path) == f"{run.date}-demo.md"
    text = open(path).read()
    assert text.startswith(f"# demo ({run.date})")
    for field in ("- command: `python benchmarks/demo.py --flag`", "- machine: ", "- commit: ", "- load (1/5/15 min): ",
                  "- device: cpu", "| 1 |"):
        assert field in text
    data = json.load(open(path[:-3] + ".json"))
    assert data["results"] == {"x": 1.5}
    head = data["header"]
    assert head["machine"]["cores"] == os.cpu_count() and head["date"] == run.date
    assert set(head) >= {"commit", "dirty", "load_before", "load_after"}
    assert run.write("body", None, "-") is None  # "-": print only


def test_parse_knobs():
    assert harness.parse_knobs("learning_rate=0.05,momentum=0.9") == {"learning_rate": 0.05, "momentum": 0.9}
    assert harness.parse_knobs(["inv_update_period=50"]) == {"inv_update_period": 50}
    assert harness.parse_knobs(None) == {}
