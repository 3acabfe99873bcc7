"""benchmarks/bench_to_target.py's ablation options: `--adam-cache` keeps tuned Adam's targets
so that the next configuration (`--knobs`) trains K-FAC only, against the same targets."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_to_target.py")
_spec = importlib.util.spec_from_file_location("bench_to_target", _PATH)
bt = sys.modules.setdefault("bench_to_target", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bt)


def _results(folder) -> list:
    (path,) = glob.glob(os.path.join(folder, "*-to-target-digits.json"))
    with open(path, encoding="utf-8") as f:
        return json.load(f)["results"]


@pytest.mark.slow
def test_digits_ablation_reuses_adams_targets_and_trains_kfac_with_the_knobs(tmp_path, monkeypatch):
    cache = tmp_path / "adam.json"
    argv = ["digits", "--models", "mlp_classifier", "--scale", "50", "--interleaved-rounds", "0",
            "--adam-cache", str(cache)]
    assert bt.harness.main(bt.parser(), "to-target", [*argv, "--out", str(tmp_path / "a")]) == 0
    first = _results(tmp_path / "a")["mlp_classifier"]
    stored = cache.read_text()

    def no_adam(*a, **k):
        raise AssertionError("tuned Adam ran again despite --adam-cache")

    monkeypatch.setattr(bt, "tuned_adam", no_adam)
    knobs = {"min_damping": 0.01, "damping": 0.01}
    argv += ["--knobs", json.dumps(knobs), "--out", str(tmp_path / "b")]
    assert bt.harness.main(bt.parser(), "to-target", argv) == 0
    second = _results(tmp_path / "b")["mlp_classifier"]
    assert cache.read_text() == stored and second["adam"] == first["adam"] and second["knobs"] == knobs
    targets = [second[f"adam{k}"]["target_loss"] for k in (10, 20)]
    assert targets == [first[f"adam{k}"]["target_loss"] for k in (10, 20)]
    # the same K-FAC run built directly with those knobs: the knobs reached the trainer
    plan, x, y = bt.zoo_case("mlp_classifier")
    direct = bt.train(plan, x, y, 128, "kfac", 20, targets=targets, **knobs)
    assert second["kfac_final_loss"] == pytest.approx(direct.loss, rel=1e-6)
    assert second["kfac_curve"] == [list(p) for p in direct.curve]
    assert [p[1] for p in second["kfac_curve"]] != [p[1] for p in first["kfac_curve"]]  # the defaults' run differs


def test_knobs_must_be_a_json_object():
    args = bt.parser().parse_args(["zoo", "--knobs", "[0.01]"])
    with pytest.raises(SystemExit, match=r"--knobs '\[0.01\]': give a JSON object of K-FAC options"):
        bt.kfac_knobs(args)


@pytest.mark.slow
def test_digits_cache_without_a_mark_reruns_adam_and_reports_both_marks(tmp_path):
    """The autoencoder's targets are Adam's 500- and 1000-step losses (here scaled to 5 and 10):
    a cache written before the 500 mark existed (only the last goal) reruns tuned Adam, and
    the rerun's targets are the first run's (Adam is deterministic)."""
    cache = tmp_path / "adam.json"
    argv = ["digits", "--models", "digits_autoencoder", "--scale", "100", "--interleaved-rounds", "0",
            "--adam-cache", str(cache)]
    assert bt.harness.main(bt.parser(), "to-target", [*argv, "--out", str(tmp_path / "a")]) == 0
    first = _results(tmp_path / "a")["digits_autoencoder"]
    assert {"adam5", "adam10"} <= set(first)
    old = json.loads(cache.read_text())
    del old["digits_autoencoder"]["goals"]["5"]  # an older cache: the 1000-step goal only
    cache.write_text(json.dumps(old))
    assert bt.harness.main(bt.parser(), "to-target", [*argv, "--out", str(tmp_path / "b")]) == 0
    second = _results(tmp_path / "b")["digits_autoencoder"]
    assert set(json.loads(cache.read_text())["digits_autoencoder"]["goals"]) == {"5", "10"}
    for k in ("adam5", "adam10"):
        assert second[k]["target_loss"] == first[k]["target_loss"] and second[k]["kfac_steps"] == first[k]["kfac_steps"]
