"""A step cut at its reduction points (runtime/stages.py) computes what the fused step does:
run stage by stage in one process, with each reduced tensor fed the local value (the mean over
one rank), every metric and state output equals the fused graph's."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime import stages as stages_module
from kfac_compiler.runtime.data import draw_noise
from kfac_compiler.runtime.stages import VIEW_OPS, StageError, split_stages


def _feeds(model: onnx.ModelProto, trainer: Trainer, data: dict, hp: dict, specs: dict) -> dict:
    """Every graph input: the trainer's state (zeros for a zero-initialized slot its runs have
    not made: adam momentum's gradient sum), the batch, the hyper-parameters."""
    feeds = {}
    for vi in model.graph.input:
        n = vi.name
        if n in data:
            feeds[n] = data[n]
        elif n in hp:
            feeds[n] = np.float32(hp[n])
        elif n in trainer.store:
            feeds[n] = trainer.store.to_numpy(n)
        elif n in specs and specs[n].init == "zeros":
            feeds[n] = np.zeros(specs[n].shape, np.float32)
        else:
            raise KeyError(n)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict, names: list[str]) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    feeds = {k: np.asarray(v) for k, v in feeds.items() if k in wanted}
    return {n: np.asarray(v) for n, v in zip(names, sess.run(names, feeds))}


def _three_steps_in(model: str, **options):
    """(plan, trainer, batch): a zoo model 3 K-FAC steps in (velocity, factors and inverses
    non-trivial) and its batch of 32."""
    e = ZOO[model]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name)
    tr = Trainer(plan, seed=0, batch_size=32, comm=None, **options)
    x, y = e.make_data(n=32)
    for _ in range(3):
        tr.step(x, y)
    return plan, tr, {**x, C.TARGETS: y}


@pytest.fixture(scope="module")
def trained():
    """A classifier 3 K-FAC steps in and a batch."""
    return _three_steps_in("mlp_classifier")


@pytest.mark.parametrize("options", [
    dict(with_stats=True, stats_if=True, qmodel=True, loss_after=True),
    dict(with_stats=True, qmodel=False, loss_after=False, l2=True),
    dict(with_stats=True, qmodel=True, loss_after=True, stats_batch=16, qmodel_batch=16),
], ids=["qmodel+stats_if+loss_after", "fixed_lr+l2", "sub_batches"])
def test_stages_compute_what_the_fused_step_computes(trained, options):
    assert_stages_compute_the_fused_step(*trained, options)


@pytest.fixture(scope="module")
def trained_flat():
    """`trained` with the multi-tensor K-FAC step (its velocity one flat slot velocity/*)."""
    plan, tr, batch = _three_steps_in("mlp_classifier", multi_tensor=True)
    assert C.flat(C.VELOCITY) in tr.store
    return plan, tr, batch


@pytest.mark.parametrize("options", [
    dict(with_stats=True, qmodel=True, loss_after=True, l2=True, clip=True, decay=True),
    dict(with_stats=True, qmodel=False, momentum_type="adam", l2=True),
], ids=["qmodel+l2+clip+decay", "adam_momentum"])
def test_multi_tensor_stages_compute_what_the_fused_step_computes(trained_flat, options):
    """The concatenations and splits of the multi-tensor step land in the stages their inputs
    allow: the gradient's after the gradients' reduction point, v's split before the JVPs."""
    assert_stages_compute_the_fused_step(*trained_flat, {**options, "multi_tensor": True})


def test_stages_cut_also_for_their_size_compute_what_the_fused_step_computes(trained):
    """A large graph's data-parallel step is cut at its reduction points and every max_nodes
    nodes besides (runtime/program.py's STAGE_NODES): the same values, the cuts' reductions
    where they were."""
    assert_stages_compute_the_fused_step(*trained, dict(with_stats=True, stats_if=True, qmodel=True,
                                                        loss_after=True), max_nodes=60)


def test_cnn_stages_compute_what_the_fused_step_computes():
    """A CNN's step, whose views of patches and activations move to the stages that read them."""
    assert_stages_compute_the_fused_step(*_three_steps_in("small_cnn"),
                                         dict(with_stats=True, stats_if=True, qmodel=True, loss_after=True))


def assert_stages_compute_the_fused_step(plan, tr, data, options, max_nodes=None):
    model, info = emit_subgraph(plan, "kfac_step", **options)
    hp = {n: 1.0 for n in info.hp_inputs}
    hp.update({C.DAMPING: 0.1, C.hp("max_momentum"): 0.9, C.hp("max_predicted_decrease"): 0.0, C.L2: 1e-3,
               C.hp("clip_norm"): 0.05, C.hp("decoupled_weight_decay"): 0.1,
               C.EMA_COEFF: 0.2, C.LEARNING_RATE: 0.05, C.MOMENTUM: 0.5, C.hp("norm_constraint"): 0.0})
    noise = draw_noise(np.random.default_rng(0), info, info.data_inputs, data[C.TARGETS])
    feeds = _feeds(model, tr, {**data, **noise}, hp, info.state_specs)
    outputs = [o.name for o in model.graph.output]
    fused = _run(model, feeds, outputs)

    stages = split_stages(model, info, max_nodes)
    assert len(stages) >= (2 if max_nodes is None else len(model.graph.node) // max_nodes)
    assert not stages[-1].reduce_after
    # every reduced tensor is reduced once, after one stage
    assert sorted(r for s in stages for r in s.reduce_after) == sorted(
        r for pairs in info.reductions.values() for r in pairs)
    values, staged = dict(feeds), {}
    for stage in stages:
        names = [o.name for o in stage.model.graph.output]
        got = _run(stage.model, values, names)
        values.update(got)
        staged.update(got)
        for reduced, local in stage.reduce_after.items():  # one rank: the mean is the local value
            values[reduced] = got[local]
    assert set(outputs) <= set(staged)
    for name in outputs:
        np.testing.assert_allclose(staged[name], fused[name], rtol=1e-6, atol=1e-7, err_msg=name)
    # every output comes from exactly one stage, and the stages read only what earlier ones made
    made = [o.name for s in stages for o in s.model.graph.output if o.name in outputs]
    assert sorted(made) == sorted(outputs)


def test_the_cuts_follow_the_data_dependencies(trained):
    """Loss and gradients are reduced after stage 0; the quadratic model's terms along P need
    the reduced gradients (after stage 1), those along the velocity alone do not; the loss after
    the update needs (alpha, mu) from the reduced model (after stage 2); the rejection test and
    metric/finite read the reduced loss after (stage 3)."""
    plan, _, _ = trained
    model, info = emit_subgraph(plan, "kfac_step", with_stats=True, qmodel=True, loss_after=True)
    stages = split_stages(model, info)
    assert len(stages) == 4
    point = {r: p for p, pairs in info.reductions.items() for r in pairs}
    cut = [sorted({point[r] for r in s.reduce_after}) for s in stages]
    assert cut[0][:2] == ["gradients", "loss"] and cut[1] == ["quadratic model terms"]
    assert cut[2] == ["loss after the update"] and cut[3] == []
    assert C.FINITE in stages[3].info.metrics
    assert all(C.new(p) in stages[2].info.state_outputs for p in plan.trainable)
    assert len(info.reductions["gradients"]) == len(plan.trainable)


def _unread_views(model: onnx.ModelProto, stages) -> list[str]:
    """The views (VIEW_OPS outputs) a stage hands on to a later one without reading them itself."""
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    out = []
    for k, stage in enumerate(stages):
        read_here = {i for n in stage.model.graph.node for i in n.input} | set(stage.reduce_after.values())
        read_later = {n for s in stages[k + 1:] for n in s.carried_in}
        out += [n for n in stage.carried_out if n in read_later and producer.get(n) in VIEW_OPS and n not in read_here]
    return out


def test_a_stage_hands_on_no_view_it_does_not_read(monkeypatch):
    """A view (Reshape, Flatten, Unsqueeze, ...) that only later stages read runs in the first of
    them, so the stage before hands on the viewed tensor, not a copy of it (here a diagonal
    factor's unsqueezed inverse, which only preconditioning reads, as on ResNet-18's
    budget-diagonalized convs); the values stay the fused step's
    (test_stages_compute_what_the_fused_step_computes)."""
    e = ZOO["small_cnn"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name,
                      config={"approximations": {"conv": "kron_in_diag"}})
    model, info = emit_subgraph(plan, "kfac_step", with_stats=True, qmodel=True, loss_after=True)
    assert _unread_views(model, split_stages(model, info)) == []
    monkeypatch.setattr(stages_module, "_sink_views", lambda *args: None)  # the cut without the move
    assert len(_unread_views(model, split_stages(model, info))) > 0


def test_a_marker_missing_from_the_graph_is_a_stage_error(trained):
    plan, _, _ = trained
    model, info = emit_subgraph(plan, "kfac_step", with_stats=True, qmodel=False, loss_after=False)
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    reduced = next(iter(info.reductions["loss"]))
    for node in bad.graph.node:
        if list(node.output) == [reduced]:
            node.op_type = "Neg"  # no longer an Identity marker
    with pytest.raises(StageError, match="no Identity marker"):
        split_stages(bad, info)


def test_an_output_made_from_constants_alone_comes_out_of_the_last_stage(monkeypatch):
    """With its inverses computed on the host (inverse method cholesky) a plan's
    inverse_update is one Identity of a constant: cut for size (STAGED_ABOVE_NODES 0), it
    made one stage with no nodes and no outputs, which ONNX Runtime refused with a C++ error
    when the Trainer was made. Now the last stage makes such an output; every graph output
    comes out of one stage, and the staged trainer steps as the whole graphs do."""
    from kfac_compiler.runtime import program

    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False,
                      config={"inverse": {"method": "cholesky"}})
    model, info = emit_subgraph(plan, "inverse_update")
    made = [o for stage in split_stages(model, info, max_nodes=1) for o in stage.model.graph.output]
    assert sorted(o.name for o in made) == sorted(o.name for o in model.graph.output)
    x, y = e.make_data(n=32)
    whole = Trainer(plan, optimizer="kfac", seed=0, batch_size=32, threads=1)
    monkeypatch.setattr(program, "STAGED_ABOVE_NODES", 0)
    staged = Trainer(plan, optimizer="kfac", seed=0, batch_size=32, threads=1)
    for _ in range(3):
        assert whole.step(x, y)["loss"] == staged.step(x, y)["loss"]
    for name, value in whole.parameters().items():
        np.testing.assert_array_equal(staged.parameters()[name], value)
