"""Spread inverse refreshes (optimizers/kfac/refresh.py): the blocks split into groups
balanced by predicted cost, one group refreshed after each of a few steps of the period."""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.errors import ConfigError, PlanError
from kfac_compiler.models import ZOO
from kfac_compiler.optimizers.kfac import refresh as R
from kfac_compiler.runtime import Trainer


@pytest.fixture(scope="module")
def mlp():
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
    inputs, y = e.make_data(256, seed=0)
    return plan, inputs["input"], y


def batch(x, y, s, bs=64):
    idx = np.random.default_rng(s).choice(len(y), bs, replace=False)
    return {"input": x[idx]}, y[idx]


# ----------------------------------------------------------------------------- host logic
def test_balanced_groups_is_longest_processing_time_first():
    costs = {"a": 5, "b": 4, "c": 3, "d": 3, "e": 3}
    # a -> 0 (5, 0), b -> 1 (5, 4), c -> 1 (5, 7), d -> 0 (8, 7), e -> 1 (8, 10)
    assert R.balanced_groups(costs, 2) == [["a", "d"], ["b", "c", "e"]]
    assert R.balanced_groups(costs, 1) == [["a", "b", "c", "d", "e"]]
    # each group keeps the layers' order; ties go to the lower group index
    assert R.balanced_groups({"x": 1, "y": 1, "z": 1}, 3) == [["x"], ["y"], ["z"]]


def test_group_count():
    big = R.SPREAD_FLOPS
    assert R.group_count({"a": big / 2, "b": big / 2}, period=10) == 1  # cheap: all at once
    # ResNet-18-like: three 131-GFLOP blocks and 78 GFLOP of others -> 4 groups reach the
    # largest block's cost, more would not lower the dearest group
    costs = {"a": 131e9, "b": 131e9, "c": 131e9, **{f"s{i}": 78e9 / 18 for i in range(18)}}
    assert R.group_count(costs, period=10) == math.ceil(471e9 / 131e9) == 4
    groups = R.balanced_groups(costs, 4)
    assert sorted(sum(costs[l] for l in g) for g in groups)[-1] == 131e9
    assert R.group_count(costs, period=3) == 3  # at most one group per step of the period
    # many equal blocks: groups of SPREAD_FLOPS each, capped by the period
    assert R.group_count({f"l{i}": big for i in range(4)}, period=10) == 4
    assert R.group_count({f"l{i}": big / 4 for i in range(12)}, period=10) == 3
    # a number: capped by the blocks and the period
    assert R.group_count({"a": 1, "b": 1}, period=10, groups=5) == 2
    assert R.group_count({"a": 1, "b": 1, "c": 1}, period=2, groups=3) == 2
    for bad in (0, -1, 1.5, "two", True):
        with pytest.raises(ConfigError):
            R.check_groups(bad)


def test_refresh_threads_by_factor_width():
    from kfac_compiler.ir import FactorSpec

    assert R.refresh_threads(R.MULTI_THREAD_WIDTH - 1, "cpu") == 1
    assert R.refresh_threads(R.MULTI_THREAD_WIDTH, "cpu") is None  # the trainer's (ORT's default)
    assert R.refresh_threads(10, "cuda") is None
    specs = [FactorSpec("A_Q", (4, 4609, 4609)), FactorSpec("D_inv", (512, 9000)), FactorSpec("G_inv", (512,))]
    assert R.widest_factor(specs) == 4609 and R.widest_factor(specs[1:]) == 0


def test_due_group_refreshes_each_group_once_per_period():
    for period, count in ((10, 4), (10, 10), (4, 3), (5, 1), (1, 1)):
        due = [R.due_group(k, period, count) for k in range(3 * period)]
        for start in range(0, 2 * period):
            window = [g for g in due[start:start + period] if g is not None]
            assert sorted(window) == list(range(count)), (period, count, start)
        assert due[0] == 0  # group 0 keeps the single refresh's steps
    assert [R.due_group(k, 10, 4) for k in range(10)] == [0, 1, 2, 3, None, None, None, None, None, None]


# ----------------------------------------------------------------------------- emitted subset
def test_a_spread_refresh_runs_more_nodes_than_one_group(mlp):
    """Why a refresh of up to SPREAD_FLOPS runs at once: a group stacks only its own blocks.
    The mlp's factors (A 65, 129, 129 wide; G 128, 128, 10) go into stacks of the sizes the
    plan's factors decide (every group pads a matrix alike: 128 to 129, and 10, below the
    96-row Schur leaf, to 65) and split down to leaves of at most 96 rows: the 129 stack in 2
    leaves (64 + 65, 4 MatMuls), the 65 stack in 1, each stack's probe check 2 MatMuls. One
    group over every block runs 2 + 1 = 3 Inverse leaves and 4 + 2 + 2 = 8 MatMuls; one group
    per layer runs fc1 (129, 65) 3 and 8, fc2 (129) 2 and 6, fc3 (129, 65) 3 and 8: 8 and 22;
    the FLOPs do not change. A
    GPT-sized refresh (16 GFLOP in blocks of 1.6) stays in one group, one with an
    ImageNet-ResNet-18-sized block (131 GFLOP) is spread."""
    plan, _, _ = mlp

    def ops(layers) -> collections.Counter:
        model, _ = emit_subgraph(plan, "inverse_update", method="schur", layers=tuple(layers))
        return collections.Counter(n.op_type for n in model.graph.node)

    one = ops(["fc1", "fc2", "fc3"])
    spread = sum((ops([layer]) for layer in ("fc1", "fc2", "fc3")), collections.Counter())
    assert (one["Inverse"], one["MatMul"]) == (3, 8) and (spread["Inverse"], spread["MatMul"]) == (8, 22)
    assert sum(spread.values()) > sum(one.values())
    gpt = {f"l{i}": 1.6e9 for i in range(10)}
    assert R.SPREAD_FLOPS == 2e10 and R.group_count(gpt, period=10) == 1
    assert R.group_count({**gpt, "big": 131e9}, period=10) == math.ceil((16e9 + 131e9) / 131e9)


plan_sizes = {"fc1": (65, 128), "fc2": (129, 128), "fc3": (129, 10)}  # the mlp's A and G factors


def test_a_block_inverse_is_the_same_bits_whichever_blocks_share_its_program(mlp):
    """A refresh group, or a data-parallel rank's blocks (runtime/distributed.py), inverts a
    subset of the blocks in a program of its own; a matrix is padded into a stack of the size
    the plan's factors decide, not the subset's, so each inverse is the bits one program over
    every block gives. Was: fc3's 10-row G, alone in fc3's program, was inverted at 10 rows,
    and padded to 65 (fc1's A) over every block: another float32 LU, 6e-8 apart (4 ranks on
    equal rows then left one process's loss at step 2: tests/test_distributed.py)."""
    import onnxruntime as ort

    plan, _, _ = mlp
    rng = np.random.default_rng(0)
    factors = {}  # the same SPD factors (covariances of 3n random rows) for every program
    for layer in ("fc1", "fc2", "fc3"):
        for side, n in zip("AG", plan_sizes[layer]):
            X = rng.standard_normal((n, 3 * n))
            factors[C.factor(layer, side)] = (X @ X.T / (3 * n)).astype(np.float32)

    def run(layers) -> dict[str, np.ndarray]:
        model, _ = emit_subgraph(plan, "inverse_update", method="schur", layers=tuple(layers))
        feeds = {"hp/damping": np.array(1e-3, np.float32)}
        for vi in model.graph.input:
            shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
            feeds.setdefault(vi.name, factors.get(vi.name, np.zeros(shape, np.float32)))
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in model.graph.output if o.name.startswith("new/")]
        return dict(zip(names, sess.run(names, feeds)))

    every = run(["fc1", "fc2", "fc3"])
    for layer in ("fc1", "fc2", "fc3"):
        for name, value in run([layer]).items():
            assert np.array_equal(value, every[name]), name


def test_inverse_update_layers_option_writes_only_those_layers(mlp):
    plan, _, _ = mlp
    _, info = emit_subgraph(plan, "inverse_update", method="schur", layers=("fc2",))
    assert sorted(info.state_outputs) == [C.new(C.inverse("fc2", i)) for i in ("A_inv", "G_inv")]
    assert C.inverse_ok("fc2") in info.metrics and C.inverse_ok("fc1") not in info.metrics
    with pytest.raises(PlanError, match="no layer 'fc9'"):
        emit_subgraph(plan, "inverse_update", method="schur", layers=("fc2", "fc9"))


# ----------------------------------------------------------------------------- in the trainer
def _inverse_slots(tr) -> dict[str, np.ndarray]:
    return {s: tr.store.to_numpy(s) for s in tr.store.slots() if s.startswith("inverse/")}


def _damped_inverse_error(tr, layer: str, damping: float) -> float:
    """Largest max-entry relative error of the layer's float32 inverse slots against numpy's
    float64 inverse of its pi-damped factors."""
    A = tr.store.to_numpy(f"factor/{layer}/A").astype(np.float64)
    G = tr.store.to_numpy(f"factor/{layer}/G").astype(np.float64)
    pi = math.sqrt((np.trace(A) / len(A)) / (np.trace(G) / len(G)))
    err = 0.0
    for name, M, d in (("A", A, pi * math.sqrt(damping)), ("G", G, math.sqrt(damping) / pi)):
        ref = np.linalg.inv(M + d * np.eye(len(M)))
        inv = tr.store.to_numpy(f"inverse/{layer}/{name}_inv")
        err = max(err, np.abs(inv - ref).max() / np.abs(ref).max())
    return err


@pytest.mark.slow
def test_a_group_refresh_writes_exactly_its_blocks_inverses(mlp):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", seed=0, inverse_groups=3, inv_update_period=4)
    ref = tr.policy.refresher
    assert len(ref.groups) == 3 and sorted(l for g in ref.groups for l in g) == ["fc1", "fc2", "fc3"]
    for group, prog in zip(ref.groups, ref.programs):  # one program per group, its slots only
        assert sorted(prog.written_slots) == sorted(C.inverse(l, i) for l in group for i in ("A_inv", "G_inv"))
    for s in range(3):
        tr.step(*batch(x, y, s))
    damping = 0.05  # unlike the damping of the inverses in the store
    before = _inverse_slots(tr)
    assert ref(tr.store, damping) is True  # a full refresh from the same factors
    full = _inverse_slots(tr)
    for group in range(3):
        for s, v in before.items():
            tr.store.set(s, v)
        assert ref(tr.store, damping, group) is True
        after = _inverse_slots(tr)
        mine = {C.inverse(l, i) for l in ref.groups[group] for i in ("A_inv", "G_inv")}
        for s in after:
            if s in mine:
                np.testing.assert_array_equal(after[s], full[s])
                assert not np.array_equal(after[s], before[s])
            else:
                np.testing.assert_array_equal(after[s], before[s])
    for layer in ("fc1", "fc2", "fc3"):  # and the full refresh is right
        for s, v in full.items():
            tr.store.set(s, v)
        assert _damped_inverse_error(tr, layer, damping) < 1e-3


@pytest.mark.slow
def test_every_block_is_refreshed_once_per_period(mlp):
    plan, x, y = mlp
    period = 4
    tr = Trainer(plan, optimizer="kfac", seed=0, inverse_groups=3, inv_update_period=period)
    groups = tr.policy.refresher.groups
    last = _inverse_slots(tr)
    refreshed_at: dict[str, list[int]] = {}
    for k in range(2 * period + 1):
        m = tr.step(*batch(x, y, k))
        now = _inverse_slots(tr)
        changed = sorted({C.parse_slot(s).owner for s in now if not np.array_equal(now[s], last[s])})
        for layer in changed:
            refreshed_at.setdefault(layer, []).append(k)
        if k == 0:
            assert m["inverse_group"] == -1.0 and changed == ["fc1", "fc2", "fc3"]
        elif math.isnan(m["inverse_group"]):
            assert changed == [] and m["inverse"] == 0.0
        else:  # exactly the due group's blocks, with fresh and right inverses
            assert changed == sorted(groups[int(m["inverse_group"])]) and m["inverse"] == 1.0
            for layer in changed:
                assert _damped_inverse_error(tr, layer, tr.damping) < 1e-3  # the damping after the step's adaptation
        last = now
    # steps 1, 2 (groups 1, 2), 4 (group 0), 5, 6, 8: each block once in every period after
    # the first step's full refresh
    for layer, steps in refreshed_at.items():
        assert steps[0] == 0 and all(b - a == period for a, b in zip(steps[1:], steps[2:])), (layer, steps)
        assert len(steps) == 3


@pytest.mark.slow
def test_auto_keeps_the_zoo_refresh_in_one_group(mlp):
    plan, _, _ = mlp
    tr = Trainer(plan, optimizer="kfac", seed=0)
    assert tr.policy.config.inverse_groups == "auto"
    assert tr.policy.refresher.groups == [["fc1", "fc2", "fc3"]] and len(tr.policy.refresher.programs) == 1
    assert tr.policy.refresher.programs[0].session.get_session_options().intra_op_num_threads == 1
    with pytest.raises(ConfigError, match="inverse_groups"):
        Trainer(plan, optimizer="kfac", inverse_groups=0)
