"""Data-parallel K-FAC on MPI ranks (loopback): the same global batches and seed give the
one-process run's losses and parameters, every rank ends with identical parameters, the
inverse work is split by cost, and the bytes sent are what the schedule says
(docs/distributed.md). Runs under tests/mpi_util.py's mpirun; skipped without the mpi extra."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.blocks import plan_blocks
from kfac_compiler.models import ZOO
from kfac_compiler.optimizers.kfac.refresh import inverse_owners
from kfac_compiler.report import rank_assignment
from kfac_compiler.runtime.device import physical_cores

sys.path.insert(0, os.path.dirname(__file__))
from mpi_util import require_mpi, run_ranks  # noqa: E402
from mpi_worker import train, weight_normed  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "mpi_worker.py")
pytestmark = pytest.mark.mpi


def on_ranks(ranks: int, config: dict, tmp_path) -> list[dict]:
    require_mpi()
    proc = run_ranks(ranks, [sys.executable, WORKER, str(tmp_path), json.dumps(config)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(ranks)]


def assert_same_run(ranks: list[dict], single: dict, rtol: float) -> None:
    """Every rank has bitwise the same parameters; losses and parameters match one process."""
    first = ranks[0]
    for other in ranks[1:]:
        assert other["losses"] == first["losses"]
        for p, v in first["params"].items():
            assert np.array_equal(np.asarray(other["params"][p]), np.asarray(v)), p
    np.testing.assert_allclose(first["losses"], single["losses"], rtol=rtol)
    for p, v in single["params"].items():
        np.testing.assert_allclose(first["params"][p], v, rtol=rtol, atol=rtol * np.abs(v).max(), err_msg=p)
    assert [m["rejected"] for m in first["metrics"]] == [m["rejected"] for m in single["metrics"]]


KFAC = {"model": "mlp_classifier", "optimizer": "kfac", "steps": 8, "batch": 64, "seed": 0,
        "knobs": {"inv_update_period": 3, "cov_update_period": 2, "inverse_groups": 2}}


@pytest.mark.slow
def test_two_ranks_take_the_one_process_steps_and_share_the_inverse_work(tmp_path):
    """K-FAC with the quadratic model, damping adaptation, sampled Fisher targets and
    statistics every other step: two ranks match one process; each block's inverse is
    computed on one rank; and each rank sends, per step, the gradients and the loss (4 bytes a
    value), and every factor and inverse once per refresh: at the first step and after steps
    3 and 6 (inv_update_period 3), not on each statistics step."""
    config = {**KFAC, "knobs": {"inv_update_period": 3, "cov_update_period": 2, "inverse_groups": 1}}
    ranks = on_ranks(2, config, tmp_path)
    single = train(config, comm=None)
    assert_same_run(ranks, single, rtol=2e-4)
    # each block's inverse is computed on one rank: the owners partition the blocks, by cost
    owners = ranks[0]["owners"]
    assert sorted(ranks[0]["owned"] + ranks[1]["owned"]) == sorted(owners)
    assert all(owners[layer] == r["rank"] for r in ranks for layer in r["owned"])
    assert {0, 1} == set(owners.values())
    assert ranks[0]["threads"] == ranks[1]["threads"] == max(1, physical_cores() // 2)  # the cores shared
    # and `inspect --ranks 2` reports the assignment the run used
    e = ZOO[config["model"]]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name)
    assert {layer: r["rank"] for r in rank_assignment(plan, 2) for layer in r["blocks"]} == owners
    # the bytes each rank sent, by kind
    n_params = sum(int(np.prod(np.shape(v))) for v in ranks[0]["params"].values())
    steps = config["steps"]
    blocks = plan_blocks(plan, list(owners))
    factor_bytes = sum(4 * int(np.prod(s.shape)) for layer in owners for s in blocks[layer].factor_specs())
    inverse_bytes = sum(4 * int(np.prod(s.shape)) for layer in owners for s in blocks[layer].inverse_specs())
    for rank in ranks:
        sent = rank["sent"]
        assert sent["gradients"] == 4 * n_params * steps
        assert sent["loss"] == 4 * steps
        assert sent["factors"] == 3 * factor_bytes
        assert sent["inverses"] == 3 * inverse_bytes
        assert sent["quadratic model terms"] == 4 * 5 * steps  # c11, c12, c22, b1, b2 (the whole batch's)


@pytest.mark.parametrize("config", [
    pytest.param(KFAC, id="kfac_mlp_two_refresh_groups", marks=pytest.mark.slow),
    pytest.param({"model": "small_cnn", "optimizer": "kfac", "steps": 5, "batch": 32, "seed": 0, "knobs": {}},
                 id="kfac_cnn", marks=pytest.mark.slow),
    pytest.param({"model": "mlp_classifier", "optimizer": "adam", "steps": 5, "batch": 64, "seed": 0, "knobs": {}},
                 id="adam", marks=pytest.mark.slow),
])
def test_four_ranks_take_the_one_process_steps(tmp_path, config):
    """The K-FAC MLP's parameters at rtol 1e-3, the others' at 3e-4: its fc3 A factor (dead
    ReLU units of fc2, condition ~540 damped) carries the ranks' 2e-7 factor difference to
    3.6e-4 in fc3.bias in one step; after 8 steps one process started with every parameter
    one float32 ulp up leaves one process by 0.92 of the 3e-4 bound (fc3.bias), one ulp down
    by 2.4 of it (fc2.weight), and the four ranks by 0.91 (1.01 before their inverses were
    the same bits as one process's); the ranks compute nothing else
    (test_ranks_given_equal_rows_take_the_one_process_steps_bit_for_bit;
    benchmarks/results/2026-11-29-regram.md)."""
    ranks = on_ranks(4, config, tmp_path)
    assert_same_run(ranks, train(config, comm=None), rtol=1e-3 if config is KFAC else 3e-4)
    if config["optimizer"] == "kfac":
        owners = ranks[0]["owners"]
        assert sorted(l for r in ranks for l in r["owned"]) == sorted(owners)


@pytest.mark.slow
def test_ranks_given_equal_rows_take_the_one_process_steps_bit_for_bit(tmp_path):
    """Free of summation order: each of four ranks trains on the whole batch (mpi_worker's
    same_rows), so every all-reduce averages four equal values (exact), and what is left is
    what the data-parallel form computes otherwise: the step cut into stages (the stacked
    Gram of g, P and v among them) and each block's inverse computed by its owner rank in a
    program of the blocks it owns. The owners (one block on each of three ranks) and the two refresh
    groups invert subsets of the factors (A 65, 129, 129 wide, G 128, 128, 10); the subset
    used to decide how a matrix is padded into a stack (fc3's G: alone on its rank, padded
    to 65 rows with fc1's A in one process), which gave another float32 inverse (6e-8 apart
    at step 1; the losses parted at step 2).
    Empirical Fisher (no sampled targets), statistics on the whole batch, one thread each."""
    config = {**KFAC, "same_rows": True,
              "knobs": {**KFAC["knobs"], "mode": "empirical", "stats_batch_size": None, "threads": 1}}
    ranks, single = on_ranks(4, config, tmp_path), train(config, comm=None)
    owned = sorted(l for r in ranks for l in r["owned"])
    assert owned == ["fc1", "fc2", "fc3"] and max(len(r["owned"]) for r in ranks) == 1  # one block a rank
    # the premise: the first step's factors (each rank's own, all of the same rows) are one process's
    for slot, value in single["first_factors"].items():
        assert np.array_equal(ranks[0]["first_factors"][slot], value), slot
    assert ranks[0]["losses"] == single["losses"]
    for p, v in single["params"].items():
        assert np.array_equal(np.asarray(ranks[0]["params"][p]), np.asarray(v)), p
    assert ranks[0]["metrics"] == single["metrics"]


@pytest.mark.slow
def test_two_ranks_take_the_one_process_multi_tensor_adam_steps(tmp_path):
    """The multi-tensor update concatenates the gradients after their reduction point: the
    cut step's second stage reads the ranks' means per parameter, as the per-parameter one."""
    config = {"model": "mlp_classifier", "optimizer": "adam", "steps": 4, "batch": 64, "seed": 0,
              "knobs": {"multi_tensor": True}}
    assert_same_run(on_ranks(2, config, tmp_path), train(config, comm=None), rtol=3e-4)


@pytest.mark.slow
def test_two_ranks_take_the_one_process_multi_tensor_kfac_steps(tmp_path):
    """K-FAC's multi-tensor step (flat velocity and adam momentum's flat gradient sum, its SGD
    group per parameter) cut at its reduction points: the concatenations read the ranks' mean
    gradients, v is split back for the quadratic model's JVPs before its terms are averaged."""
    groups = [{"layers": "fc3", "optimizer": "sgd", "lr": 0.05}]
    for knobs in ({"multi_tensor": True, "clip_norm": 0.5, "l2_reg": 1e-3, "param_groups": groups},
                  {"multi_tensor": True, "momentum_type": "adam", "learning_rate": 0.02}):
        config = {**KFAC, "knobs": {**KFAC["knobs"], **knobs}}
        assert_same_run(on_ranks(2, config, tmp_path), train(config, comm=None), rtol=3e-4)


def test_owners_balance_the_refresh_cost():
    """Longest processing time first, by hand: 9 -> rank 0, 7 -> 1, 6 -> 2, 5 -> 2 (load 11),
    5 -> 1 (12), 4 -> 0 (13); the dearest rank carries 13 of the optimum 12 (<= 4/3)."""
    costs = {"a": 9.0, "b": 7.0, "c": 6.0, "d": 5.0, "e": 5.0, "f": 4.0}
    assert inverse_owners(costs, 3) == {"a": 0, "f": 0, "b": 1, "e": 1, "c": 2, "d": 2}
    assert inverse_owners(costs, 1) == {layer: 0 for layer in costs}


MASKED = {**KFAC, "ignore_index": -100, "knobs": {"inv_update_period": 3, "inverse_groups": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, pytest.param(4, id="4")])
def test_ranks_take_the_one_process_steps_with_ignored_targets(tmp_path, ranks):
    """softmax cross-entropy with ignore_index, batches whose ignored targets fall unevenly on
    the ranks: the loss and gradients are the mean over the global batch's targets that count
    (the runtime weighs them before splitting the batch), and an input factor A, the mean over
    the rows that count, divides each rank's sum over its own by the ranks' mean number of them
    (reduced at the statistics-terms point before the fold), so the ranks' mean A is one
    process's: the runs match (before, each rank divided by its own number: 10% apart in loss
    within 8 steps on two ranks)."""
    assert_same_run(on_ranks(ranks, MASKED, tmp_path), train(MASKED, comm=None), rtol=3e-4)


@pytest.mark.slow
def test_two_ranks_weigh_ignored_targets_over_the_global_batch_with_periodic_statistics(tmp_path):
    """The same with statistics every other step: one process runs them inside an If on the
    step, which a data-parallel step cannot cut, so the ranks run a statistics-free step on
    the other steps instead and cut the statistics steps: the one-process steps (before, each
    rank's A was its own mean: 11% apart in loss within 8 steps)."""
    config = {**KFAC, "ignore_index": -100}
    assert_same_run(on_ranks(2, config, tmp_path), train(config, comm=None), rtol=3e-4)


@pytest.mark.slow
def test_sub_batches_on_two_ranks_stay_in_step(tmp_path):
    """Batch 256 on two ranks: statistics and the quadratic model on a 64-example sub-batch,
    32 of each rank's rows (other examples than one process's first 64, so only the
    agreement between the ranks and the training itself are asserted)."""
    config = {"model": "mlp_classifier", "optimizer": "kfac", "steps": 8, "batch": 256, "seed": 0, "knobs": {}}
    ranks = on_ranks(2, config, tmp_path)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for p, v in ranks[0]["params"].items():
        assert np.array_equal(np.asarray(ranks[1]["params"][p]), np.asarray(v)), p
    assert ranks[0]["losses"][-1] < 0.5 * ranks[0]["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("model,param", [("transformer_block", "pos_emb"), ("unrolled_rnn", "rnn.b")])
def test_two_ranks_take_the_one_process_steps_with_generic_layers(tmp_path, model, param):
    """A generic-fallback block (a parameter without per-example gradients: here the
    transformer's position table or the RNN's bias, linked by the user) is estimated from one
    pseudo-example per batch, u = sum_n g_n / sqrt(N), whose square is not linear in the batch:
    each rank's u_r times sqrt(P) is averaged over the ranks before it is squared, which is
    the global batch's u, so two ranks take the one-process steps (before, each rank squared
    its own u_r: 7.5% (transformer) and 23% (RNN) apart in loss within 6 steps)."""
    config = {"model": model, "optimizer": "kfac", "steps": 6, "batch": 32, "seed": 0, "knobs": {},
              "links": [{"params": [param], "name": "linked"}]}
    ranks = on_ranks(2, config, tmp_path)
    assert_same_run(ranks, train(config, comm=None), rtol=3e-4)
    assert ranks[0]["sent"]["statistics terms"] > 0  # the pseudo-examples travel with the gradients


@pytest.mark.slow
@pytest.mark.parametrize("model", ["transformer_block", "unrolled_rnn"])
def test_two_ranks_take_the_one_process_steps_with_broadcast_layers(tmp_path, model):
    """The same models without the links: the position table and the RNN's bias are broadcast
    layers, whose exact per-example gradients make every factor a mean over examples, so two
    ranks take the one-process steps."""
    config = {"model": model, "optimizer": "kfac", "steps": 6, "batch": 32, "seed": 0, "knobs": {}}
    assert_same_run(on_ranks(2, config, tmp_path), train(config, comm=None), rtol=3e-4)


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [
    {"momentum_type": "adam", "learning_rate": "warmup:2:cosine:0.01,0.001,8", "momentum": "linear:0.5,0.9,8"},
    {"momentum_type": "qmodel_fixedmu", "momentum": 0.7, "damping": "exp:1e-2,0.5,4"},
], ids=["adam_momentum_scheduled", "qmodel_fixedmu_damping_schedule"])
def test_two_ranks_take_the_one_process_steps_with_each_momentum_type(tmp_path, knobs):
    """TF K-FAC's adam momentum (its gradient-sum slot lives in the update stage, fed by the
    reduced gradients) and qmodel_fixedmu, with schedules (host-side hyper-parameters every
    rank computes alike): two ranks match one process."""
    config = {**KFAC, "knobs": {**KFAC["knobs"], **knobs}}
    assert_same_run(on_ranks(2, config, tmp_path), train(config, comm=None), rtol=2e-4)


@pytest.mark.slow
def test_two_ranks_report_the_global_batch_loss_during_burn_in(tmp_path):
    """Burn-in steps (statistics only) reported each rank's own loss (2.529 on rank 0 for one
    process's 2.410; the ranks apart): the metrics are the batch's, the ranks' mean, as every
    other step's; assert_same_run compares the losses of every step, burn-in's included."""
    config = {**KFAC, "knobs": {**KFAC["knobs"], "burn_in_steps": 2}}
    ranks, single = on_ranks(2, config, tmp_path), train(config, comm=None)
    assert ["learning_rate" in m for m in single["metrics"][:3]] == [False, False, True]  # two burn-in steps
    assert_same_run(ranks, single, rtol=2e-4)

@pytest.mark.slow
def test_two_ranks_take_the_one_process_steps_with_parameter_groups(tmp_path):
    """First-order parameter groups beside K-FAC (optimizers/groups.py): their updates read the
    gradients after the reduction point, so the cut step's ranks take the one-process steps;
    the groups' layers have no factors to average and no inverses to share."""
    groups = [{"layers": "fc1", "optimizer": "adam", "lr": 3e-3}, {"layers": "fc3", "optimizer": "sgd", "lr": 0.05}]
    config = {**KFAC, "knobs": {**KFAC["knobs"], "param_groups": groups}}
    ranks = on_ranks(2, config, tmp_path)
    assert_same_run(ranks, train(config, comm=None), rtol=3e-4)
    assert sorted(ranks[0]["owners"]) == ["fc2"]


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [
    pytest.param({"learning_rate": 0.05, "damping": 0.1, "inv_update_period": 3}, id="kfac-regular"),
    pytest.param({"inv_update_period": 3, "mode": "empirical", "adapt_damping": False, "max_predicted_decrease": None,
                  "loss_spike_factor": None}, id="kfac-qmodel"),
])
def test_two_ranks_accumulate_as_one_process(tmp_path, knobs):
    """Gradient accumulation on two ranks: each rank sums its share of every micro-batch, and
    the cycle's mean gradient is averaged over the ranks at the step's reduction point (so
    the quadratic model's terms, the last micro-batch's, are too): the one-process run with
    the same micro-batches, and with a fixed learning rate the one-process run on the whole
    batches."""
    config = {"model": "mlp_classifier", "optimizer": "kfac", "steps": 4, "batch": 64, "seed": 0,
              "knobs": {**knobs, "accumulate": 2}}
    ranks = on_ranks(2, config, tmp_path)
    assert_same_run(ranks, train(config, comm=None), rtol=3e-4)
    if "learning_rate" in knobs:
        assert_same_run(ranks, train({**config, "knobs": knobs}, comm=None), rtol=3e-4)


def worst_gap(run: dict, reference: dict) -> float:
    """The larger of the worst relative loss gap over the steps and the worst parameter
    difference relative to that parameter's largest value, after the last step."""
    loss = np.abs(np.subtract(run["losses"], reference["losses"])) / np.abs(reference["losses"])
    params = [np.abs(np.subtract(run["params"][p], v)).max() / np.abs(v).max() for p, v in reference["params"].items()]
    return float(max(loss.max(), max(params)))


@pytest.mark.slow
def test_two_ranks_accumulating_masked_rows_are_one_process_to_rounding(tmp_path):
    """ignore_index (rows unevenly masked over the ranks) with 2 micro-batches and the quadratic
    model: the first step's factors, each a mean over the rows that count, are one process's to
    float32 rounding (measured 1.7e-7 relative; a count taken per rank or per micro-batch
    instead of the ranks' would put them percents apart). What follows is rounding carried:
    fc3's A has condition number 780, its float32 inverse is 7e-5 from the exact float64 one in
    either run, 1e-4 from each other, and the quadratic model's steps carry that to 3.8e-4 in
    loss over 8 steps, where one process started one float32 ulp away gets 1.4e-4 in loss and
    6.8e-4 in parameters (benchmarks/results/2026-11-29-mpi-gap.md)."""
    config = {"model": "mlp_classifier", "optimizer": "kfac", "steps": 8, "batch": 64, "seed": 0,
              "ignore_index": -100,
              "knobs": {"inv_update_period": 3, "mode": "empirical", "adapt_damping": False,
                        "max_predicted_decrease": None, "loss_spike_factor": None, "accumulate": 2}}
    ranks = on_ranks(2, config, tmp_path)
    single = train(config, comm=None)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for s, v in single["first_factors"].items():
        np.testing.assert_allclose(ranks[0]["first_factors"][s], v, rtol=0, atol=1e-6 * np.abs(v).max(), err_msg=s)
    moved = train({**config, "ulp": True}, comm=None)
    assert worst_gap(ranks[0], single) < 4 * worst_gap(moved, single)


@pytest.mark.slow
def test_two_ranks_take_the_one_process_ekfac_steps(tmp_path):
    """EKFAC's eigenbasis statistics S are averaged over the ranks at their own reduction point
    before the step's preconditioner reads them (statistics on every step, cov_update_period
    1): two ranks match one process, including the refreshes that restart S. On full-rank
    factors (statistics on all 256 rows): the eigenbases then differ only in their vectors'
    signs, which S and the update do not see. A rank-deficient factor (64 rows for fc1's 128
    outputs) has a degenerate null space whose basis the eigensolver picks from rounding-level
    differences (the ranks' reduced factors differ from one process's in the 7th digit), and
    S depends on that basis: there the runs differ by ~10% within 4 steps."""
    config = {**KFAC, "batch": 256, "approximations": {"fully_connected": "ekfac"},
              "knobs": {"inv_update_period": 3, "cov_update_period": 1, "inverse_groups": 1, "stats_batch_size": 256}}
    assert_same_run(on_ranks(2, config, tmp_path), train(config, comm=None), rtol=2e-4)


@pytest.mark.slow
def test_two_ranks_take_the_one_process_ekfac_steps_with_periodic_statistics(tmp_path):
    """With cov_update_period > 1 one process's statistics (S with them) sit inside an If, which
    a data-parallel step cannot cut (a run was refused): the ranks run a statistics-free step
    on the steps without statistics and average S on the others. The losses are one process's
    to 2e-4 (measured 1.9e-5); the parameters only to 5e-3 of their largest: after the refresh
    of step 3 the factors hold fewer batches than with statistics on every step, and fc2's
    have exact zero rows (dead ReLU units: 7 of A's 129 eigenvalues and 3 of G's 128 below 1e-6
    of the largest after 5 steps), a degenerate null space whose eigenbasis, and S in it, the
    eigensolver picks from rounding-level differences (as above): fc2's parameters then differ
    by up to 1.3e-3 of their largest after step 5 (the others' by 9e-5 at most), 3.4e-3 after 8."""
    config = {**KFAC, "batch": 256, "approximations": {"fully_connected": "ekfac"},
              "knobs": {"inv_update_period": 3, "cov_update_period": 2, "inverse_groups": 1, "stats_batch_size": 256}}
    ranks, single = on_ranks(2, config, tmp_path), train(config, comm=None)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    np.testing.assert_allclose(ranks[0]["losses"], single["losses"], rtol=2e-4)
    for p, v in single["params"].items():
        assert np.array_equal(np.asarray(ranks[1]["params"][p]), np.asarray(ranks[0]["params"][p])), p
        np.testing.assert_allclose(ranks[0]["params"][p], v, rtol=0, atol=5e-3 * np.abs(v).max(), err_msg=p)



@pytest.mark.slow
def test_two_ranks_with_static_steps_take_the_one_process_if_form_steps(tmp_path):
    """static_steps on ranks: each step kind a staged program cut at its own reduction points
    (the loss after only in the adaptation kinds), with each rank's share of the batch as its
    static shape; the run is the one-process If form's."""
    knobs = {**KFAC["knobs"], "damping_adaptation_interval": 3}
    config = {**KFAC, "knobs": {**knobs, "static_steps": True}}
    assert_same_run(on_ranks(2, config, tmp_path), train({**KFAC, "knobs": knobs}, comm=None), rtol=3e-4)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp_classifier", "transformer_block"])
def test_two_ranks_stages_declare_the_run_time_shapes(tmp_path, model):
    """The cut steps' stages keep the fused step's declared shapes (backend/shapes.py) of the
    tensors they make: on each of 2 ranks (32 of the 64 rows; statistics and quadratic-model
    sub-batches of 16 and 32 globally, 8 and 16 a rank: the one-process rows, docs/distributed.md)
    every stage's declarations are the shapes ONNX Runtime computes on that rank's last step
    (test_declared_shapes.check_declared: N 32 rows, kfac/sub8/N 8, kfac/sub16/N 16), both step variants (with and without
    statistics) declare some, and the ranks still take the one-process steps; on the MLP,
    bitwise the steps of stages emitted without declarations.
    Tolerance: 3e-4 on the transformer; 1e-3 on the MLP, whose 2-rank run (96-row Schur
    leaves, the default since the regram merge) ends 1.3e-3 elementwise from one process on
    one fc3.bias element (6e-5 absolute), while one process started one float32 ulp up ends
    1.8e-3 elementwise from it on fc3.bias: rounding that K-FAC carries (the factors' and
    gradients' all-reduce sums differ in order every step), measured 2026-11-29, not a
    difference in the math (docs/distributed.md, 2026-11-29-regram.md)."""
    config = {"model": model, "optimizer": "kfac", "steps": 4, "batch": 64, "seed": 0,
              "knobs": {"stats_batch_size": 16, "qmodel_batch_size": 32, "inv_update_period": 3}}
    (tmp_path / "declared").mkdir()
    ranks = on_ranks(2, {**config, "check_declared": True}, tmp_path / "declared")
    for rank in ranks:
        declared = rank["declared"]
        assert {name.split()[0] for name in declared} == {"0", "1"}, sorted(declared)  # both kfac_step variants
        assert all(d["declared"] > 0 for d in declared.values())
        symbols: dict = {}
        for d in declared.values():
            for s, v in d["symbols"].items():
                assert symbols.setdefault(s, v) == v, (s, v, symbols[s])
        assert symbols == {"N": 32, "kfac/sub8/N": 8, "kfac/sub16/N": 16}
    assert_same_run(ranks, train(config, comm=None), rtol=1e-3 if model == "mlp_classifier" else 3e-4)
    if model == "mlp_classifier":
        (tmp_path / "bare").mkdir()
        bare = on_ranks(2, {**config, "bare": True}, tmp_path / "bare")
        assert bare[0]["losses"] == ranks[0]["losses"]
        for p, v in ranks[0]["params"].items():
            assert np.array_equal(np.asarray(bare[0]["params"][p]), np.asarray(v)), p


WEIGHT_NORM = {"model": "small_cnn", "optimizer": "kfac", "steps": 6, "batch": 32, "seed": 0,
               "weight_norm": ["conv1.weight", "conv2.weight"],
               "knobs": {"inv_update_period": 3, "cov_update_period": 2, "inverse_groups": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("ranks,knobs", [
    pytest.param(2, {}, id="2-periodic"),
    pytest.param(2, {"multi_tensor": True, "momentum_type": "adam", "learning_rate": 0.01}, id="2-multi_tensor-adam"),
    pytest.param(4, {}, id="4-periodic"),
])
def test_ranks_take_the_one_process_steps_with_weight_normed_convs(tmp_path, ranks, knobs):
    """Both convs of the small CNN weight-normed as torch exports them (w = v g / ||v||: the
    weight-normed conv block, blocks/weight_norm.py, which reads the current g and v to map its
    w-space curvature to (g, v)): statistics every other step, inverses refreshed every 3 on the
    rank that owns each block (the two weight-normed blocks on different ranks) and broadcast,
    and the preconditioning, which reads the parameters, on every rank: the one-process steps
    (measured on 2 ranks: loss 3e-7, parameters 3e-6 of their largest)."""
    e = ZOO["small_cnn"]
    plan = kc.compile(weight_normed(e.build(seed=0), WEIGHT_NORM["weight_norm"]), loss=e.loss, output=e.output_name)
    assert {layer: b.layer.kind for layer, b in plan_blocks(plan).items()} == {
        "conv1": "weight_norm_conv", "conv2": "weight_norm_conv", "fc": "fully_connected"}
    config = {**WEIGHT_NORM, "knobs": {**WEIGHT_NORM["knobs"], **knobs}}
    runs = on_ranks(ranks, config, tmp_path)
    assert_same_run(runs, train(config, comm=None), rtol=3e-4)
    owners = runs[0]["owners"]
    assert len({owners["conv1"], owners["conv2"]}) == 2
    assert {"conv1.weight_v", "conv1.weight_g", "conv2.weight_v", "conv2.weight_g"} <= set(runs[0]["params"])


@pytest.mark.slow
def test_two_ranks_take_the_one_process_sub_batch_rows_where_m_does_not_divide_the_batch(tmp_path):
    """Batch 96 with the default statistics sub-batch of 64 (which does not divide it): one
    process takes rows floor(k 96 / 64), each rank rows floor(j 48 / 32) of its 48, the same
    rows (backend/forward.sub_batch_pass), so two ranks take the one-process steps: losses
    within 3e-4 (measured 8.7e-5), and the worst loss or parameter gap (measured 3.2e-4) under
    4x that of one process started one float32 ulp away (1.4e-4), rounding carried. With every
    (N // m)-th row from the first, one process took rows 0-63 and the ranks 0-31 and 48-79:
    128% apart in loss at the 5th step."""
    config = {"model": "mlp_classifier", "optimizer": "kfac", "steps": 6, "batch": 96, "seed": 0, "knobs": {}}
    ranks, single = on_ranks(2, config, tmp_path), train(config, comm=None)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for p, v in ranks[0]["params"].items():
        assert np.array_equal(np.asarray(ranks[1]["params"][p]), np.asarray(v)), p
    np.testing.assert_allclose(ranks[0]["losses"], single["losses"], rtol=3e-4)
    assert worst_gap(ranks[0], single) < 4 * worst_gap(train({**config, "ulp": True}, comm=None), single)


SAVE_INTO_A_FOLDER = r"""
import sys
import kfac_compiler as kc
from kfac_compiler.errors import KfacError
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
e = ZOO["mlp_classifier"]
tr = Trainer(kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False), seed=0)
x, y = e.make_data(n=64)
tr.step(x, y)
for name, write in (("save_checkpoint", tr.save_checkpoint), ("export", tr.export)):
    try:
        write(sys.argv[1])
        print(f"rank {tr.rank}: {name} returned", flush=True)
    except KfacError as err:
        print(f"rank {tr.rank}: {name} raised {type(err).__name__}", flush=True)
tr.step(x, y)  # the ranks still step together: nobody waits in a collective
print(f"rank {tr.rank}: stepped", flush=True)
"""


@pytest.mark.slow
def test_a_write_that_fails_on_rank_0_is_raised_on_every_rank(tmp_path):
    """save_checkpoint / export under mpirun: rank 0 writes. Given a folder, rank 0 raised and
    rank 1 returned as if saved, then waited in the next step's collective for ever (the job
    hung). Every rank raises now (rank 0 its own error, the others an OutputError saying rank 0
    could not write), and the ranks go on stepping together."""
    require_mpi()
    script = tmp_path / "save.py"
    script.write_text(SAVE_INTO_A_FOLDER)
    (tmp_path / "folder").mkdir()
    proc = run_ranks(2, [sys.executable, str(script), str(tmp_path / "folder")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == sorted(["rank 0: save_checkpoint raised CheckpointError", "rank 0: export raised OutputError",
                            "rank 1: save_checkpoint raised OutputError", "rank 1: export raised OutputError",
                            "rank 0: stepped", "rank 1: stepped"]), lines
