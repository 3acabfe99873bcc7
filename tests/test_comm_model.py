"""benchmarks/comm_model.py counts the bytes data-parallel K-FAC communicates: checked on the
zoo's 64-128-128-10 MLP against a hand count from its layer widths."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import kfac_compiler
from kfac_compiler.models import get_model

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "comm_model.py")
_spec = importlib.util.spec_from_file_location("comm_model", _PATH)
cm = sys.modules.setdefault("comm_model", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(cm)

WIDTHS = (64, 128, 128, 10)


@pytest.fixture(scope="module")
def comm():
    plan = kfac_compiler.compile(get_model("mlp_classifier"), loss="softmax_cross_entropy", emit=False)
    return cm.plan_comm(plan)


def test_gradient_bytes_are_the_parameters_and_scalars(comm):
    params = sum(i * o + o for i, o in zip(WIDTHS, WIDTHS[1:]))  # weights and biases: 26,122
    assert comm.param_elements == params == 26122
    assert comm.gradient_bytes == 4 * params + 4 * 10


def test_factor_and_inverse_bytes_are_the_kronecker_factors(comm):
    # each Gemm layer: A over its input plus the bias column [(in+1)^2], G over its output [out^2]
    expect = 4 * sum((i + 1) ** 2 + o**2 for i, o in zip(WIDTHS, WIDTHS[1:]))
    assert comm.factor_bytes == expect == 4 * (65**2 + 128**2 + 129**2 + 128**2 + 129**2 + 10**2)
    assert comm.inverse_bytes == expect  # pi-damped inverses: one per factor, same shapes
    assert sorted(comm.blocks) == ["fc1", "fc2", "fc3"] and comm.without_factors == []


def test_ring_allreduce_broadcast_and_hiding_period(comm):
    link = cm.Link("test", 1e9, "none")
    P, T = 4, 10
    t = cm.step_times(comm, link, ranks=P, batch=1, period=T)
    assert t["gradients"] == pytest.approx(2 * 3 / 4 * comm.gradient_bytes / 1e9)
    assert t["factors"] == pytest.approx(2 * 3 / 4 * comm.factor_bytes / 1e9 / T)
    assert t["inverses"] == pytest.approx(comm.inverse_bytes / 1e9 / T)
    # a refresh moves 1.5 F + I = 2.5 x 4 x 70,375 = 703,750 bytes per rank, a step's gradients
    # 1.5 G = 1.5 x 104,528 = 156,792: 4.49 steps' worth, so period 5 hides it
    refresh = 1.5 * comm.factor_bytes + comm.inverse_bytes
    assert refresh == 703750
    assert cm.hiding_period(refresh, 1.5 * comm.gradient_bytes) == 5
    assert cm.hiding_period(1.0, 0.0) is None


def test_inverse_owners_balance_by_flops(comm):
    flops = sorted((b.inverse_flops for b in comm.blocks.values()), reverse=True)
    assert cm.largest_rank_inverse_flops(comm, 1) == sum(flops)
    assert cm.largest_rank_inverse_flops(comm, 3) == flops[0]  # one block each
    assert cm.largest_rank_inverse_flops(comm, 2) == max(flops[0], flops[1] + flops[2])
