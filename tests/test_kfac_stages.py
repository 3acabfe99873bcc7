"""The K-FAC step's stages: the reduction points the emitted step passes through, in order,
are those STAGES declares, and the values at each point are what the stage hands on."""
from __future__ import annotations

import pytest

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler.backend import Emission, plan_parts
from kfac_compiler.models import ZOO
from kfac_compiler.optimizers.kfac.graph import STAGES, KfacStepOptions, QuadraticModel, emit_kfac_step


@pytest.fixture(scope="module")
def parts():
    e = ZOO["mlp_classifier"]
    return plan_parts(kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False))


def points(parts, **options):
    em = Emission.start(parts)
    emit_kfac_step(em, KfacStepOptions(**options))
    return em, [p for p, _ in em.reductions]


def test_a_full_step_reduces_at_every_declared_point_in_stage_order(parts):
    declared = [p for stage in STAGES for p in stage.reduces if p != C.STATE_STATISTICS_POINT]  # no ekfac block
    em, got = points(parts, with_stats=True, qmodel=True, loss_after=True, stats_batch=16, qmodel_batch=16)
    assert got == declared
    values = dict(em.reductions)
    assert set(values["gradients"]) == set(parts.params)  # one gradient per parameter
    assert set(values[C.FACTOR_STATISTICS_POINT]) == {l.name for l in parts.layers}
    assert isinstance(values["quadratic model terms"], QuadraticModel)
    # what the stage boundaries hand on are tensors the emitted nodes produce
    produced = {o for n in em.b.nodes for o in n.output}
    assert values["loss"] in produced and values["loss after the update"] in produced
    assert all(g in produced for g in values["gradients"].values())


def test_points_follow_the_options(parts):
    assert points(parts, with_stats=False, qmodel=False, loss_after=False)[1] == ["loss", "gradients"]
    assert points(parts, with_stats=True, qmodel=False, loss_after=False)[1] == [
        "loss", "gradients", C.FACTOR_STATISTICS_POINT]


def test_ekfac_cuts_the_step_after_its_eigenbasis_statistics():
    """ekfac's S (kept in its inverse state, read at its new average by the same step's
    preconditioner) passes a reduction point of its own after the factor statistics; inside
    the If of periodic statistics it cannot, and the step has none (runtime/staged.py refuses
    it in a data-parallel run)."""
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False,
                      config={"approximations": {"fully_connected": "ekfac"}})
    parts = plan_parts(plan)
    em, got = points(parts, with_stats=True, qmodel=True, loss_after=True, stats_batch=16, qmodel_batch=16)
    assert got == [p for stage in STAGES for p in stage.reduces]
    stated = dict(em.reductions)[C.STATE_STATISTICS_POINT]
    assert set(stated) == {l.name for l in parts.layers} and all(set(d) == {"S"} for d in stated.values())
    assert set(em.info.reductions[C.STATE_STATISTICS_POINT].values()) == {d["S"] for d in stated.values()}
    em, got = points(parts, with_stats=True, stats_if=True, qmodel=True, loss_after=True)
    assert C.STATE_STATISTICS_POINT not in got and C.STATE_STATISTICS_POINT not in em.info.reductions
