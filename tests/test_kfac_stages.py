"""The K-FAC step's stages: the reduction points the emitted step passes through, in order,
are those STAGES declares, and the values at each point are what the stage hands on."""
from __future__ import annotations

import dataclasses
import itertools

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
    """The emission and the points it passed, in order (a point passed several times in a row,
    once per value, listed once)."""
    em = Emission.start(parts)
    emit_kfac_step(em, KfacStepOptions(**options))
    return em, [p for p, _ in itertools.groupby(p for p, _ in em.reductions)]


def test_a_full_step_reduces_at_every_declared_point_in_stage_order(parts):
    # no ekfac block, no generic block, no weights
    declared = [p for stage in STAGES for p in stage.reduces if p not in (C.STATE_STATISTICS_POINT,
                                                                          C.STATISTICS_TERMS_POINT)]
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


def test_a_weighted_step_reduces_its_masked_row_counts_before_the_factor_statistics(parts):
    """A weighted loss's fully connected A divide by the ranks' mean number of rows that count:
    one count per layer passes the statistics-terms point, before the factor statistics and
    outside an If (where there is none)."""
    weighted = dataclasses.replace(parts, weighted=True)
    em, got = points(weighted, with_stats=True, qmodel=True, loss_after=True)
    assert got == [p for stage in STAGES for p in stage.reduces if p != C.STATE_STATISTICS_POINT]
    assert len(em.info.reductions[C.STATISTICS_TERMS_POINT]) == len(parts.layers)
    em, got = points(weighted, with_stats=True, stats_if=True, qmodel=True, loss_after=True)
    assert C.STATISTICS_TERMS_POINT not in got


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
    assert got == [p for stage in STAGES for p in stage.reduces if p != C.STATISTICS_TERMS_POINT]
    stated = dict(em.reductions)[C.STATE_STATISTICS_POINT]
    assert set(stated) == {l.name for l in parts.layers} and all(set(d) == {"S"} for d in stated.values())
    assert set(em.info.reductions[C.STATE_STATISTICS_POINT].values()) == {d["S"] for d in stated.values()}
    em, got = points(parts, with_stats=True, stats_if=True, qmodel=True, loss_after=True)
    assert C.STATE_STATISTICS_POINT not in got and C.STATE_STATISTICS_POINT not in em.info.reductions
