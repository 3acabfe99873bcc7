"""Session setup that stays near linear in the layers (issue 38 item 4): emitted graphs
listed by topological generation (backend.schedule), ONNX Runtime's planned memory reuse off
for very large graphs and their graph optimizations off where they do not run every step
(runtime.device.LARGE_GRAPH_NODES); none may change a step's values."""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.backend import emission, emit_subgraph
from kfac_compiler.builder import node_reads
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime import device as D
from kfac_compiler.runtime.stages import split_stages


def deep_mlp(layers: int, width: int = 8) -> onnx.ModelProto:
    """Gemm + Relu layers (as benchmarks/bench_step.py:deep_mlp)."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "input"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
                                          f"fc{i}.weight"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"fc{i}.bias")]
        out = "logits" if i == layers - 1 else f"fc{i}/Gemm:0"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [out], transB=1))
        x = out
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    g = helper.make_graph(nodes, "deep_mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", width])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _producers(graph: onnx.GraphProto) -> list[list[int]]:
    made = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    return [sorted({made[t] for t in node_reads(n) if t in made}) for n in graph.node]


def ort_sort_walk(graph: onnx.GraphProto) -> int:
    """What one of ONNX Runtime's topological sorts walks: it visits the lowest-index ready
    node first from a sorted std::list, each push walking the list (graph.cc,
    VisitorPriorityQueue), so the sum over pushes of the ready nodes waiting."""
    preds = _producers(graph)
    succ: dict[int, list[int]] = defaultdict(list)
    waiting = [len(p) for p in preds]
    for i, p in enumerate(preds):
        for j in p:
            succ[j].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    walk = len(ready) * (len(ready) - 1) // 2
    while ready:
        i = heapq.heappop(ready)
        for j in succ[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                walk += len(ready)
                heapq.heappush(ready, j)
    return walk


def test_emitted_nodes_are_listed_by_generation_and_ort_sorts_them_in_linear_walks(monkeypatch):
    plan = kc.compile(deep_mlp(40), loss="softmax_cross_entropy", emit=False)
    ordered, _ = emit_subgraph(plan, "kfac_step")
    monkeypatch.setattr(emission, "order_by_generation", lambda graph: None)
    appended, _ = emit_subgraph(kc.compile(deep_mlp(40), loss="softmax_cross_entropy", emit=False), "kfac_step")
    g = ordered.graph
    assert sorted(n.SerializeToString() for n in g.node) == sorted(n.SerializeToString() for n in appended.graph.node)
    # each node after its producers, and the generations (longest path from a node that reads
    # no other node's output) never decrease along the list
    generation: list[int] = []
    for i, preds in enumerate(_producers(g)):
        assert all(p < i for p in preds)
        generation.append(1 + max((generation[p] for p in preds), default=-1))
    assert generation == sorted(generation)
    # ONNX Runtime's sort of the emitters' order walked many more list nodes than the graph
    # has; listed by generation, a few per node (11.6x fewer while the per-parameter Gram
    # emitted 9 nodes per parameter late in the list, 7.3x with the stacked Gram)
    before, after = ort_sort_walk(appended.graph), ort_sort_walk(g)
    assert before > 6 * after, (before, after)
    assert after < 60 * len(g.node)


def _steps(model: str, steps: int = 3) -> dict[str, np.ndarray]:
    e = ZOO[model]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    tr = Trainer(plan, seed=0, batch_size=32, comm=None, threads=1)
    x, y = e.make_data(n=32)
    for _ in range(steps):
        tr.step(x, y)
    return tr.parameters()


@pytest.mark.parametrize("model", ["mlp_classifier", pytest.param("transformer_block", marks=pytest.mark.slow)])
def test_generation_order_and_no_memory_reuse_keep_every_value(monkeypatch, model):
    reference = _steps(model)
    with monkeypatch.context() as m:
        m.setattr(emission, "order_by_generation", lambda graph: None)  # the emitters' order
        appended = _steps(model)
    with monkeypatch.context() as m:
        m.setattr(D, "LARGE_GRAPH_NODES", 0)  # every session: no planned reuse; no optimizations off the step
        unplanned = _steps(model)
    assert reference.keys() == appended.keys() == unplanned.keys()
    for p, v in reference.items():
        np.testing.assert_array_equal(v, appended[p], err_msg=p)
        np.testing.assert_array_equal(v, unplanned[p], err_msg=p)


def test_a_graph_listed_out_of_order_is_still_ordered_by_generation():
    """The one-pass generations need a topological list; any other goes through networkx."""
    from kfac_compiler.backend.schedule import order_by_generation

    nodes = [helper.make_node("Relu", ["b"], ["c"], name="second"),   # reads b, made below
             helper.make_node("Neg", ["x"], ["b"], name="first"),
             helper.make_node("Abs", ["x"], ["d"], name="root2"),
             helper.make_node("Add", ["c", "d"], ["y"], name="third")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    order_by_generation(g)
    assert [n.name for n in g.node] == ["first", "root2", "second", "third"]


def _non_constant_nodes(stage_graph: onnx.GraphProto) -> int:
    """A stage's nodes less those fed by initializers and constants alone (copied into every
    stage that reads them, runtime/stages.py)."""
    made = {t.name for t in stage_graph.initializer}
    count = 0
    for n in stage_graph.node:
        if all(t in made for t in node_reads(n)) and n.op_type != "If":
            made.update(n.output)
        else:
            count += 1
    return count


def test_a_large_graph_cut_in_stages_sorts_in_walks_that_grow_with_its_nodes():
    """Cut every max_nodes nodes, a step's sessions each sort at most that many nodes: their
    simulated sort walks (ort_sort_walk) per node stay flat as the model deepens, where the
    whole graph's grow with the depth (the update's per-layer chains all become ready after
    the global step size: docs/runtime.md, `kfac-compiler train`, what made setup superlinear)."""
    per_node = {}
    for layers in (40, 160):
        plan = kc.compile(deep_mlp(layers), loss="softmax_cross_entropy", emit=False)
        model, info = emit_subgraph(plan, "kfac_step")
        stages = split_stages(model, replace(info, reductions={}), max_nodes=100)
        assert len(stages) >= 20 and all(_non_constant_nodes(s.model.graph) <= 100 for s in stages)
        nodes = len(model.graph.node)
        per_node[layers] = (ort_sort_walk(model.graph) / nodes,
                            sum(ort_sort_walk(s.model.graph) for s in stages) / nodes)
    (whole40, cut40), (whole160, cut160) = per_node[40], per_node[160]
    assert whole160 > 2 * whole40, per_node  # 14.2 -> 30.4 walked per node
    assert cut160 < 1.25 * cut40 and cut160 < whole160 / 2, per_node  # 11.4 -> 13.1


def _trajectory(optimizer: str, steps: int = 12) -> dict:
    """Losses, parameters, an evaluation and a batch's gradients of a classifier trained
    `steps` steps, statistics every 2nd and inverses every 4th (K-FAC): every session kind runs."""
    from kfac_compiler.runtime.curvature import gradients

    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    knobs = dict(cov_update_period=2, inv_update_period=4) if optimizer == "kfac" else {}
    tr = Trainer(plan, optimizer=optimizer, seed=0, batch_size=32, comm=None, **knobs)
    x, y = e.make_data(n=96, seed=1)
    losses = []
    for k in range(steps):
        rows = slice(32 * (k % 3), 32 * (k % 3 + 1))
        losses.append(tr.step({n: v[rows] for n, v in x.items()}, y[rows])["loss"])
    loss, grads = gradients(plan, x, y, params=tr.parameters())
    return {"losses": losses, "params": tr.parameters(), "eval": tr.evaluate(x, y), "grad loss": loss,
            "grads": grads, "stages": [len(getattr(p, "programs", [p])) for p in tr.programs().values()]}


@pytest.mark.parametrize("optimizer", ["kfac", "adam"])
def test_a_graph_cut_for_its_size_trains_as_the_whole_graph(monkeypatch, optimizer):
    """Every session cut in stages of at most 40 nodes (runtime/program.py's rule, with the
    thresholds lowered): the same losses, parameters, evaluation and gradients, bit for bit,
    as the whole graphs; the stages hand each other activations, metrics (the loss, the step
    size) and state outputs (a new velocity a later stage reads)."""
    from kfac_compiler.runtime import program

    whole = _trajectory(optimizer)
    monkeypatch.setattr(program, "STAGED_ABOVE_NODES", 0)
    monkeypatch.setattr(program, "STAGE_NODES", 40)
    cut = _trajectory(optimizer)
    # (the loss graph behind the evaluation has fewer nodes than a stage may)
    assert set(whole["stages"]) == {1} and sorted(cut["stages"])[1] >= 3, cut["stages"]
    assert cut["losses"] == whole["losses"] and cut["eval"] == whole["eval"]
    assert cut["grad loss"] == whole["grad loss"]
    for p, v in whole["params"].items():
        np.testing.assert_array_equal(cut["params"][p], v, err_msg=p)
        np.testing.assert_array_equal(cut["grads"][p], whole["grads"][p], err_msg=p)


def test_a_graph_that_cannot_be_cut_runs_whole(monkeypatch):
    """A size cut is an optimization: where a crossing tensor cannot be typed (StageError), the
    graph runs in one session, with the whole graph's values."""
    from kfac_compiler.runtime import program, staged
    from kfac_compiler.runtime.stages import StageError

    whole = _trajectory("adam", steps=3)

    def untypable(*args, **kwargs):
        raise StageError("cannot type tensor 't', which crosses a stage boundary")

    monkeypatch.setattr(program, "STAGED_ABOVE_NODES", 0)
    monkeypatch.setattr(staged, "split_stages", untypable)
    fallback = _trajectory("adam", steps=3)
    assert set(fallback["stages"]) == {1}
    assert fallback["losses"] == whole["losses"]


def _curvature_run() -> dict:
    """The Curvature API's calls on a classifier: gradients, statistics, a refresh and a
    preconditioned gradient."""
    from kfac_compiler.runtime.curvature import Curvature

    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    x, y = e.make_data(n=32, seed=1)
    cv = Curvature(plan)
    loss, grads = cv.gradients(x, y)
    cv.update(x, y)
    ok = cv.update_inverses(1e-2)
    return {"loss": loss, "grads": grads, "ok": ok, "precond": cv.precondition(grads),
            "stages": [len(getattr(p, "programs", [p])) for p in cv._programs.values()]}


def test_the_curvature_api_on_graphs_cut_for_their_size(monkeypatch):
    """Curvature's programs cut in stages (its refresh is one staged program, which the
    refresher once took for a list of group programs: a TypeError): the same gradients,
    inverses and preconditioned gradient, bit for bit, as the whole graphs."""
    from kfac_compiler.runtime import program

    whole = _curvature_run()
    monkeypatch.setattr(program, "STAGED_ABOVE_NODES", 0)
    monkeypatch.setattr(program, "STAGE_NODES", 40)
    cut = _curvature_run()
    assert set(whole["stages"]) == {1} and sum(n > 1 for n in cut["stages"]) >= 3, cut["stages"]
    assert cut["ok"] and whole["ok"] and cut["loss"] == whole["loss"]
    for p, g in whole["grads"].items():
        np.testing.assert_array_equal(cut["grads"][p], g, err_msg=p)
        np.testing.assert_array_equal(cut["precond"][p], whole["precond"][p], err_msg=p)
