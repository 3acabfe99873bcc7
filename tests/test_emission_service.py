"""The emission service: typed requests resolved against the plan and the device before they
are keys, plans that store their graphs under those keys, and a run of a saved plan at the
settings it was compiled for that emits nothing and loads none of the compiler's modules
(checked in a fresh interpreter by its sys.modules)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.backend import emit, emit_subgraph
from kfac_compiler.backend.service import emitted
from kfac_compiler.blocks import plan_blocks
from kfac_compiler.errors import ConfigError
from kfac_compiler.host_blocks import refresh_costs
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.optimizers.kfac import KfacStepOptions
from kfac_compiler.plan import load_plan
from kfac_compiler.requests import InverseOptions, PowerOptions, Request, Settings, StatisticsOptions, request
from kfac_compiler.runtime import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _compile(name: str = "mlp_classifier", **overrides):
    entry = ZOO[name]
    return kc.compile(get_model(name, seed=0), loss=entry.loss, output=entry.output_name, **overrides)


# ----------------------------------------------------------------------------- requests
def test_resolution_makes_every_plan_and_device_choice_concrete():
    plan = _compile(emit=False, estimator={"mode": "empirical", "num_samples": 1})
    req = request("inverse_update").resolve(Settings.of(plan, "cuda"))
    assert req.options == InverseOptions(method="schur", damping_split="pi", conv_gather=True)  # "auto" on CUDA
    assert request("inverse_update", method="newton_schulz").resolve(Settings.of(plan)).options.method == \
        "newton_schulz"
    stats = request("update_statistics", stats_batch=64).resolve(Settings.of(plan))
    assert (stats.options.mode, stats.options.num_samples, stats.options.stats_batch) == ("empirical", 1, 64)
    # equal resolved requests are one key, whatever was left to the defaults
    explicit = Request("update_statistics", StatisticsOptions(mode="empirical", num_samples=1, stats_batch=64,
                                                              damping_split="pi", conv_gather=True))
    assert stats == explicit and hash(stats) == hash(explicit) and stats.key() == explicit.key()
    with pytest.raises(ConfigError, match=r"subgraph 'kfac_step' has no option 'layers'"):
        request("kfac_step", layers=("fc1",))
    with pytest.raises(ConfigError, match="unknown subgraph 'kfac_stpe'"):
        request("kfac_stpe")
    with pytest.raises(ConfigError, match="takes KfacStepOptions options"):
        request("kfac_step", options=InverseOptions())
    with pytest.raises(ConfigError, match="takes InverseOptions options"):  # a subclass is another kind's
        request("inverse_update", options=PowerOptions(power=-0.5))
    assert InverseOptions(layers=["fc1"]) == InverseOptions(layers=("fc1",))  # lists are keys too
    with pytest.raises(ValueError, match="not resolved"):
        emit(plan, request("inverse_update"))


def test_every_option_that_changes_a_graph_is_in_its_key():
    """conv_gather, formerly a module switch, is a compile option every request resolves: the
    small CNN's Adam step without the Gather forms is another key and another graph."""
    plans = {g: _compile("small_cnn", emit=False, conv_gather=g) for g in (True, False)}
    reqs = {g: request("adam_step").resolve(Settings.of(p)) for g, p in plans.items()}
    assert reqs[True] != reqs[False] and reqs[True].options.conv_gather and not reqs[False].options.conv_gather
    ops = {g: sorted(n.op_type for n in emit(plans[g], reqs[g])[0].graph.node) for g in (True, False)}
    assert "Gather" in ops[True] and ops[True] != ops[False]


# ----------------------------------------------------------------------------- storage
def test_a_plan_stores_several_graphs_of_one_kind_and_finds_them_after_a_round_trip(tmp_path):
    plan = _compile(emit=False)
    settings = Settings.of(plan)
    first, steady = (Request("kfac_step", KfacStepOptions(with_stats=w)).resolve(settings) for w in (False, True))
    for req in (first, steady):
        model, info = emit(plan, req)
        plan.store_subgraph(req, model, info)
    assert sorted(plan.subgraphs) == ["kfac_step", "kfac_step-2"]
    back = load_plan(plan.save(tmp_path / "plan"))
    for req in (first, steady):
        model, info = back.stored_subgraph(req)
        assert info.kind == "kfac_step" and info.options == req.options.to_json()
        assert model.SerializeToString() == plan.stored_subgraph(req)[0].SerializeToString()
    assert back.stored_subgraph(Request("kfac_step", KfacStepOptions(l2=True)).resolve(settings)) is None
    # storing the same request again replaces it in place
    plan.store_subgraph(first, *emit(plan, first))
    assert sorted(plan.subgraphs) == ["kfac_step", "kfac_step-2"]


def test_compile_stores_exactly_what_a_default_run_at_its_batch_requests():
    plan = _compile(budget={"batch_size": 96})
    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=96, sessions=False)
    wanted = {req for req in tr._programs}
    stored = {Request(info.kind, type(req.options).from_json(info.options)) for req in wanted
              for info in plan.subgraph_info.values() if info.kind == req.name}
    assert wanted <= stored and len(plan.subgraphs) == len(wanted) == 4
    # such a trainer runs nothing and holds no values (compiling a 2.2 GB table allocated two
    # copies of it here): a step, the parameters, an export say how to train, in one line
    inputs, y = ZOO["mlp_classifier"].make_data(96, seed=0)
    assert tr.store.slots() == []
    for call in (lambda: tr.step(inputs, y), tr.parameters, tr.exported_model, lambda: tr.export("unused.onnx"),
                 lambda: tr.save_checkpoint("unused.ckpt")):
        with pytest.raises(ConfigError, match="sessions=True"):
            call()


@pytest.mark.slow
def test_an_older_plan_without_kinds_still_trains(tmp_path):
    """A plan written before the typed requests (entries keyed by kind, options with "auto"
    unresolved) loads; the runtime does not take its stale graphs for resolved requests and
    emits them again, and training matches a fresh plan's."""
    plan = _compile()
    path = Path(plan.save(tmp_path / "plan"))
    doc = json.loads((path / "plan.json").read_text())
    for entry in doc["subgraphs"].values():
        entry["info"].pop("kind")
        entry["info"]["options"].pop("conv_gather")
        if "method" in entry["info"]["options"]:
            entry["info"]["options"]["method"] = "auto"
    (path / "plan.json").write_text(json.dumps(doc))
    old, fresh = load_plan(path), load_plan(plan.save(tmp_path / "fresh"))
    x, y = ZOO["mlp_classifier"].make_data(n=64)
    runs = []
    for p in (old, fresh):
        tr = Trainer(p, optimizer="kfac", device="cpu", batch_size=32, seed=0)
        runs.append([tr.step({"input": x["input"][i:i + 32]}, y[i:i + 32])["loss"] for i in (0, 32)])
    assert runs[0] == runs[1]
    assert sorted(req.name for req in emitted(old)) == ["inverse_update", "kfac_step", "kfac_step", "update_statistics"]
    assert emitted(fresh) == {}  # the current plan's graphs were all stored


@pytest.mark.parametrize("name,gather", [("mlp_classifier", True), ("small_cnn", False)])
def test_emit_subgraph_is_emit_of_the_resolved_request(name, gather):
    plan = _compile(name, emit=False, conv_gather=gather)
    a, info = emit_subgraph(plan, "statistics", mode="exact")
    b, _ = emit(plan, request("statistics", mode="exact").resolve(Settings.of(plan)))
    assert a.SerializeToString() == b.SerializeToString() and info.options["conv_gather"] is gather


def test_refresh_costs_are_the_blocks_own_for_the_plans_damping_split():
    """K-FAC groups its refreshes by their FLOPs: the plan's recorded costs serve where they
    price the plan's own damping split (the budget prices every block at it), else the blocks
    count (exact damping costs more: its eigendecompositions)."""
    recorded = {}
    for split in ("pi", "exact"):
        plan = _compile(emit=False, inverse={"damping_split": split})
        own = {name: float(b.inverse_flops("schur")) for name, b in plan_blocks(plan).items()}
        assert refresh_costs(plan, list(own), "schur") == own
        recorded[split] = plan.costs["layers"]["fc1"]["inverse"]
    assert recorded["exact"] > 5 * recorded["pi"]


@pytest.mark.slow
def test_compile_stores_nothing_where_a_default_run_refuses_the_plan():
    """A compile damping below K-FAC's default min_damping is a valid plan: compile succeeds,
    says why it stored no graphs, and a run that widens min_damping emits them and trains."""
    plan = _compile(damping=1e-4)
    assert plan.subgraphs == {} and "no training subgraphs stored" in plan.notes[-1] and "min_damping" in plan.notes[-1]
    x, y = ZOO["mlp_classifier"].make_data(n=32)
    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=32, min_damping=1e-5)
    assert np.isfinite(tr.step({"input": x["input"]}, y)["loss"])


# ----------------------------------------------------------------------------- at run time
CHILD = r"""
import json, sys
import kfac_compiler as kc
from kfac_compiler.runtime import Trainer
from kfac_compiler.models import ZOO
plan = kc.load_plan(sys.argv[1])
batch = int(sys.argv[2])
tr = Trainer(plan, optimizer="kfac", device="cpu", seed=0, batch_size=batch)
x, y = ZOO["mlp_classifier"].make_data(n=3 * batch)
losses = [tr.step({"input": x["input"][s * batch:(s + 1) * batch]}, y[s * batch:(s + 1) * batch])["loss"]
          for s in range(3)]
internal = sorted(m for m in sys.modules if m.startswith(tuple(f"kfac_compiler.{p}" for p in
                  ("backend", "blocks", "oprules", "passes", "patterns", "frontend"))))
emitted = []
if "kfac_compiler.backend.service" in sys.modules:
    from kfac_compiler.backend.service import emitted as emitted_for
    emitted = sorted(req.name for req in emitted_for(plan))
print(json.dumps({"internal": internal, "losses": losses, "emitted": emitted}))
"""


def _train_in_fresh_interpreter(plan_dir: str, batch: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, plan_dir, str(batch)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    plan = _compile(budget={"batch_size": 96})
    return plan, plan.save(str(tmp_path_factory.mktemp("plan") / "plan"))


@pytest.mark.slow
def test_training_a_stored_plan_emits_nothing_and_loads_no_compiler_internals(saved_plan):
    """A default K-FAC run at the batch the plan was compiled for (96: statistics and the
    quadratic model on a 64-example sub-batch, not the batch-32 defaults) finds every graph
    stored: three steps load none of the compiler's modules."""
    plan, path = saved_plan
    assert {info.kind for info in plan.subgraph_info.values()} == {"kfac_step", "update_statistics", "inverse_update"}
    assert {i.options["stats_batch"] for i in plan.subgraph_info.values() if "stats_batch" in i.options} == {64}
    run = _train_in_fresh_interpreter(path, 96)
    assert run["internal"] == [] and run["emitted"] == []
    assert np.isfinite(run["losses"]).all() and run["losses"][2] < run["losses"][0]


@pytest.mark.slow
def test_other_settings_emit_only_what_differs(saved_plan):
    """At batch 48 the statistics run on the whole batch (no 64-example sub-batch), so the two
    steps and the statistics graph are emitted through the service; the inverse refresh's
    request resolves to the stored one and is not."""
    _, path = saved_plan
    other = _train_in_fresh_interpreter(path, 48)
    assert "kfac_compiler.backend.service" in other["internal"]
    assert other["emitted"] == ["kfac_step", "kfac_step", "update_statistics"]


@pytest.mark.slow
def test_the_step_sessions_come_from_the_kinds_registry(tmp_path, monkeypatch):
    """Which sessions spin, keep the arena and are profiled as the steady step is the kind's
    every_step flag (an optimizer plugin's declaration), not a list of names: a plugin step
    (tests/extensions) gets it like the built-in ones, a refresh does not."""
    from extensions import normalized_gd  # noqa: F401  (registers the plugin and its kind; tests/ is on sys.path)
    from kfac_compiler.runtime.device import PROFILE_ENV, every_step
    from kfac_compiler.runtime.ort_profile import step_profiles

    assert every_step("normalized_gd_step") and every_step("kfac_step/stage1") and not every_step("inverse_update")
    plan = _compile(emit=False)
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "prof"))
    trainers = {name: Trainer(plan, optimizer=name, device="cpu", batch_size=32) for name in ("normalized_gd", "kfac")}
    monkeypatch.delenv(PROFILE_ENV)
    x, y = ZOO["mlp_classifier"].make_data(n=32)
    for tr in trainers.values():
        for _ in range(2):
            tr.step({"input": x["input"]}, y)
    gd = step_profiles(trainers["normalized_gd"])
    assert list(gd) == ["normalized_gd_step"] and gd["normalized_gd_step"].runs == 2
    kfac = step_profiles(trainers["kfac"])
    assert sorted(kfac) == ["kfac_step[with_stats=False]", "kfac_step[with_stats=True]"]
    assert kfac["kfac_step[with_stats=True]"].runs == 1 and sum(kfac["kfac_step[with_stats=True]"].nodes.values()) > 0
    # the time per op type covers every node the profile counted, the step's MatMuls among them
    prof = kfac["kfac_step[with_stats=True]"]
    assert sum(n for n, _ in prof.op_times.values()) == sum(prof.nodes.values())
    assert prof.op_times[("MatMul", "CPUExecutionProvider")][1] > 0
