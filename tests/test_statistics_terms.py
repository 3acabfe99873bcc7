"""The statistics terms a data-parallel step averages over its ranks before they are squared or
divide (backend/factors.py: the generic fallback's pseudo-example, a masked statistic's number
of live rows) leave one process's statistics as they were: the factors a K-FAC fold writes
(update_statistics, which marks that reduction point) equal the batch statistics of the
`statistics` subgraph (which does not), on a plan with a generic layer and masked rows.
tests/test_distributed.py checks the ranks against one process."""
from __future__ import annotations

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler.backend.registry import emit_subgraph
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Curvature


@pytest.fixture(scope="module")
def plan():
    e = ZOO["transformer_block"]
    return kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name,
                      links=[{"params": ["pos_emb"], "name": "linked"}])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gradients", "empirical"])
def test_one_process_folds_the_statistics_it_estimates(plan, mode):
    e = ZOO["transformer_block"]
    inputs, targets = e.make_data(n=24)
    weights = np.where(np.arange(24) % 3 == 0, 0.0, 1.0).astype(np.float32)  # examples of weight 0
    curvature = Curvature(plan, mode=mode, seed=0)
    stats = curvature.estimate(inputs, targets, weights=weights)
    curvature.rng = np.random.default_rng(0)  # the same sampled targets for the fold
    curvature.update(inputs, targets, weights=weights)  # the first fold: the factors are the batch's statistics
    factors = curvature.factors()
    assert "linked" in factors and set(factors) == set(stats)
    for layer, items in stats.items():
        for name, value in items.items():
            np.testing.assert_allclose(factors[layer][name], value, rtol=1e-6, atol=1e-7 * np.abs(value).max(),
                                       err_msg=f"{layer}/{name}")


@pytest.mark.slow
def test_the_fold_marks_the_terms_and_the_estimate_does_not(plan):
    """update_statistics marks the linked layer's pseudo-example and the masked numbers of rows
    (one per masking block) at the statistics-terms point and reads hp/ranks; `statistics`
    neither."""
    _, fold = emit_subgraph(plan, C.UPDATE_STATISTICS, mode="exact", weighted=True)
    _, estimate = emit_subgraph(plan, C.STATISTICS, mode="exact", weighted=True)
    assert len(fold.reductions[C.STATISTICS_TERMS_POINT]) >= 2 and C.RANKS in fold.hp_inputs
    assert C.STATISTICS_TERMS_POINT not in estimate.reductions and C.RANKS not in estimate.hp_inputs
