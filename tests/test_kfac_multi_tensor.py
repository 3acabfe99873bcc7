"""K-FAC's multi-tensor step (kfac_step's `multi_tensor`, optimizers/kfac/graph.py): the
gradient's clipping and l2 term, the dot products, the update, the new parameters and the
velocity once over the concatenation of K-FAC's parameters, the velocity (and adam momentum's
gradient sum) one flat slot each. Its trajectories equal the per-parameter step's to float32
rounding (the dot products sum in another order) on zoo models through statistics, refresh
and damping-adaptation steps and every recipe option; the host's roll back, checkpoints (in
either layout), parameter groups and the step cut in stages read the flat slots; and it emits
fewer nodes by about a dozen per parameter."""
from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

import kfac_compiler as kc
from helpers import sampled_batch as batch
from helpers import zoo_case, zoo_plan
from kfac_compiler import contract as C
from kfac_compiler.optimizers import multi_tensor
from kfac_compiler.optimizers.multi_tensor import concat_groups, split_flat
from kfac_compiler.requests import MULTI_TENSOR_DEFAULT, Settings, request
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.checkpoint import read_meta, stored_state
from test_multi_tensor import op_counts
from test_safeguards import batch as linear_batch
from test_safeguards import linear_model, sqrt_model

STEPS = 6
# every step kind within 6 steps: the first (statistics, inverses, then the step), refreshes
# after steps 2 and 4, damping adaptation (loss_after) on steps 0, 2, 4
SCHEDULE = dict(inv_update_period=2, damping_adaptation_interval=2)
GROUP = [{"kind": "fully_connected", "optimizer": "sgd", "lr": 0.01, "momentum": 0.9}]


def norm_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: list[str]) -> float:
    """|b - a| / |a| over the concatenation of `names`: the velocity a P + mu v cancels in
    places, so its entries' rounding is relative to the whole update's, not to each entry."""
    x = np.concatenate([a[n].ravel().astype(np.float64) for n in names])
    y = np.concatenate([b[n].ravel().astype(np.float64) for n in names])
    return float(np.linalg.norm(y - x) / max(np.linalg.norm(x), 1e-30))


def trajectory(plan, x, y, multi: bool, steps: int = STEPS, **knobs) -> tuple[Trainer, list[dict]]:
    tr = Trainer(plan, optimizer="kfac", seed=0, multi_tensor=multi, **SCHEDULE, **knobs)
    (req,) = {r for r in tr.requests() if r.name == "kfac_step" and r.options.with_stats}
    assert req.options.multi_tensor is multi
    return tr, [tr.step(*batch(x, y, k)) for k in range(steps)]


def assert_same_runs(per: tuple[Trainer, list[dict]], flat: tuple[Trainer, list[dict]], rtol: float = 1e-4) -> None:
    """Losses, alpha, mu and every decision step by step; parameters, velocity, factors and
    inverses after the run, as the checkpoint stores them (per parameter)."""
    (t0, m0), (t1, m1) = per, flat
    for a, b in zip(m0, m1):
        for key in ("rejected", "stats", "inverse", "burn_in", "rolled_back"):
            assert a.get(key) == b.get(key), (key, a, b)
        for key in ("loss", "new_loss", "learning_rate", "momentum"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rtol, abs=1e-7, nan_ok=True), (key, a, b)
    s0, s1 = stored_state(t0), stored_state(t1)
    assert set(s0) == set(s1)
    kinds = collections.defaultdict(list)
    for name in s0:
        kinds["param" if name in t0.params else C.parse_slot(name).kind].append(name)
    for kind, names in kinds.items():
        assert norm_rel(s0, s1, names) < rtol, kind


def kfac_flat_slots(tr: Trainer) -> set[str]:
    """The flat slots the trainer holds (with any, none of K-FAC's per-parameter velocity slots)."""
    flat = {s for s in tr.store.slots() if C.flat_kind(s)}
    own = tr.policy.flat_params()
    assert not flat or not ({C.velocity(p) for p in own} | {C.grad_velocity(p) for p in own}) & set(tr.store.slots())
    return flat


@pytest.fixture(scope="module")
def cases():
    memo = {}

    def get(model: str):
        if model not in memo:
            plan, inputs, y = zoo_case(model, 256)
            memo[model] = plan, inputs["input"], y
        return memo[model]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("model, knobs", [
    ("mlp_classifier", {}),
    ("small_cnn", {}),
    ("transformer_block", {}),
    ("mlp_classifier", dict(cov_update_period=2)),
    ("mlp_classifier", dict(l2_reg=1e-3)),
    ("mlp_classifier", dict(clip_norm=0.05)),
    ("small_cnn", dict(clip_norm=0.05, l2_reg=1e-3, decoupled_weight_decay=0.1)),
    ("mlp_classifier", dict(momentum_type="adam", learning_rate=0.02, l2_reg=1e-3, norm_constraint=1e-3)),
    ("small_cnn", dict(momentum_type="regular", learning_rate=0.02, norm_constraint=1e-3)),
    ("mlp_classifier", dict(momentum_type="qmodel_fixedmu", momentum=0.5)),
    ("mlp_classifier", dict(accumulate=2)),
    ("small_cnn", dict(param_groups=GROUP, clip_norm=0.05)),
], ids=["mlp", "cnn", "transformer", "period2", "l2", "clip", "clip_l2_decay", "adam", "regular", "fixedmu",
        "accumulate", "groups"])
def test_multi_tensor_trajectories_equal_the_per_parameter_ones(cases, model, knobs):
    plan, x, y = cases(model)
    per, flat = trajectory(plan, x, y, False, **knobs), trajectory(plan, x, y, True, **knobs)
    kinds = {C.VELOCITY} | ({C.GRAD_VELOCITY} if knobs.get("momentum_type") == "adam" else set())
    assert kfac_flat_slots(flat[0]) == {C.flat(k) for k in kinds}
    assert not kfac_flat_slots(per[0])
    metrics = per[1]
    assert sum(m.get("inverse", 0.0) for m in metrics) >= 2  # refreshes ran
    if "learning_rate" not in knobs:
        assert any(np.isfinite(m.get("rho", np.nan)) for m in metrics)  # damping adaptation ran
    assert_same_runs(per, flat)
    if "param_groups" in knobs:  # the group keeps its own per-parameter velocity beside K-FAC's flat one
        group = [p for p in flat[0].params if p not in flat[0].policy.flat_params()]
        assert group and all(C.velocity(p) in flat[0].store for p in group)


def test_multi_tensor_resolves_by_device_as_the_first_order_steps(cases):
    plan, _, _ = cases("mlp_classifier")
    for device in ("cpu", "cuda"):
        req = request("kfac_step").resolve(Settings.of(plan, device))
        assert req.options.multi_tensor is MULTI_TENSOR_DEFAULT[device]
    assert request("kfac_step", multi_tensor=True).resolve(Settings.of(plan, "cuda")).options.multi_tensor is True
    assert kc.optimizers.make_config("kfac", plan).parse_option("multi_tensor", "on") == ("multi_tensor", True)


@pytest.mark.parametrize("momentum_type", ["regular", "adam"])
def test_the_spike_guard_rolls_back_the_flat_velocity(momentum_type):
    """test_safeguards' spike (lr 11 on a quadratic): the undo restores the parameters before
    the update bit for bit, zeroes the flat velocity/* and adam's flat gradient sum, and both
    layouts take the same steps."""
    inputs, y = linear_batch()
    runs = {}
    for multi in (False, True):
        tr = Trainer(kc.compile(linear_model(), loss="squared_error"), optimizer="kfac", momentum=0.0,
                     adapt_damping=False, learning_rate=11.0, momentum_type=momentum_type, multi_tensor=multi)
        before = tr.parameters()["fc.weight"]
        m0 = tr.step(inputs, targets=y)
        assert np.any(stored_state(tr)[C.velocity("fc.weight")])
        m1 = tr.step(inputs, targets=y)
        assert (m1["spike"], m1["rolled_back"], m1["rejected"]) == (1.0, 1.0, 1.0)
        np.testing.assert_array_equal(tr.parameters()["fc.weight"], before)
        state = stored_state(tr)
        assert not np.any(state[C.velocity("fc.weight")])
        if momentum_type == "adam":
            assert not np.any(state[C.grad_velocity("fc.weight")])
        runs[multi] = [m0, m1, tr.step(inputs, targets=y)], tr.parameters()
    assert C.flat(C.VELOCITY) in tr.store
    for a, b in zip(runs[False][0], runs[True][0]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b.get("rolled_back") == a.get("rolled_back")
    np.testing.assert_allclose(runs[True][1]["fc.weight"], runs[False][1]["fc.weight"], rtol=1e-6)


@pytest.mark.slow
def test_a_nan_loss_rolls_back_the_flat_velocity_of_two_parameters():
    """test_safeguards' sqrt model (its weight and s in one flat velocity): an update whose next
    loss is NaN is undone from the flat slot as from the per-parameter ones."""
    inputs, y = linear_batch()
    histories = {}
    for multi in (False, True):
        tr = Trainer(kc.compile(sqrt_model(), loss="squared_error"), optimizer="kfac", damping_adaptation_interval=5,
                     multi_tensor=multi)
        histories[multi] = [tr.step(inputs, targets=y) for _ in range(6)], tr.parameters()
    assert any(m.get("rolled_back") for m in histories[True][0])
    for a, b in zip(histories[False][0], histories[True][0]):
        assert a.get("rolled_back") == b.get("rolled_back") and a["rejected"] == b["rejected"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, nan_ok=True)
    for p, v in histories[False][1].items():
        np.testing.assert_allclose(histories[True][1][p], v, rtol=1e-5, atol=1e-8, err_msg=p)


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [dict(momentum_type="adam", learning_rate=0.02), dict(param_groups=GROUP)],
                         ids=["adam", "groups"])
@pytest.mark.parametrize("saved_multi", [False, True])
def test_checkpoints_move_between_the_layouts(cases, tmp_path, saved_multi, knobs):
    """A checkpoint stores K-FAC's flat slots per parameter (a group's own velocity slots as
    they are): the other layout resumes it and takes the steps the saving run takes."""
    plan, x, y = cases("small_cnn")
    steady = Trainer(plan, optimizer="kfac", seed=0, multi_tensor=saved_multi, **SCHEDULE, **knobs)
    for k in range(3):
        steady.step(*batch(x, y, k))
    path = steady.save_checkpoint(tmp_path / "c.npz")
    assert not any(C.flat_kind(s) for s in read_meta(path)["slots"])
    resumed = Trainer(plan, optimizer="kfac", seed=0, multi_tensor=not saved_multi, **SCHEDULE, **knobs).restore(path)
    assert bool(kfac_flat_slots(resumed)) is not saved_multi
    a = [steady.step(*batch(x, y, k)) for k in range(3, 6)]
    b = [resumed.step(*batch(x, y, k)) for k in range(3, 6)]
    assert_same_runs((steady, a), (resumed, b))


def test_flat_params_order_the_flat_slot(cases):
    """K-FAC's flat velocity holds its own parameters (a group's left out) in concat_groups'
    order: the checkpoint's split of it is the per-parameter velocity."""
    plan, x, y = cases("small_cnn")
    tr = Trainer(plan, optimizer="kfac", seed=0, multi_tensor=True, param_groups=GROUP, **SCHEDULE)
    tr.step(*batch(x, y, 0))
    own = tr.policy.flat_params()
    assert own and len(own) < len(tr.params)
    shapes = {p: tuple(tr.store.spec(p)[0]) for p in own}
    flat = tr.store.to_numpy(C.flat(C.VELOCITY))
    assert flat.size == sum(int(np.prod(s)) for s in shapes.values())
    first = concat_groups(shapes)[0][0]
    np.testing.assert_array_equal(flat[:int(np.prod(shapes[first]))], split_flat(flat, shapes)[first].ravel())
    assert set(stored_state(tr)) >= {C.velocity(p) for p in tr.params}  # the group's own and K-FAC's split


def test_the_flat_step_emits_a_few_nodes_fewer_per_parameter():
    """Both layouts take the Gram of g, P and v as one stack (Layout.stack, gram_of: a Concat,
    a Gemm, a Split) and the update a P + mu v as one combination of its rows in the
    per-parameter layout (Gram.combine: the coefficients' Concat, one MatMul, the split into
    the parameters: a Split per group of one trailing shape and one into the groups). Per
    parameter the per-parameter step keeps theta + update (1 node; with clipping, l2 and
    decay also the gradient's scale, the l2 term, theta's decay and the norms of the raw
    gradient). The flat one has those once, and adds the concatenations (3 Concats: the
    gradient, theta, P) and the splits back (the new parameters; v for the quadratic model's
    JVPs; with clipping or l2 the gradient, for the preconditioner; without them the
    preconditioner reads the gradients the Concat packed, Layout.unpack's, no Split)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = zoo_plan("transformer_block")
    values = plan.parameter_values()
    n, groups = len(values), len(concat_groups({p: v.shape for p, v in values.items()}))
    assert n >= 20 and groups < n

    def compute(c: collections.Counter) -> int:
        return sum(v for k, v in c.items() if k not in ("Reshape", "Identity"))

    for options, per_param, unpacked in ((dict(), 0, 2), (dict(l2=True, clip=True, decay=True), 4, 3)):
        per = op_counts(plan, "kfac_step", multi_tensor=False, **options)
        flat = op_counts(plan, "kfac_step", multi_tensor=True, **options)
        assert compute(per) - compute(flat) >= per_param * n + 1, (options, per - flat)
        assert per["Add"] - flat["Add"] >= n - 2, (options, per - flat)  # theta + update per parameter
        assert flat["Concat"] - per["Concat"] == 2  # 3 packs against the update's coefficients
        assert per["MatMul"] - flat["MatMul"] == 1 and per["Gemm"] == flat["Gemm"]  # combine; the one Gram
        assert abs(flat["Split"] - per["Split"]) <= unpacked * (groups + 1)  # the new parameters, v, with l2/clip g
        assert sum(flat.values()) < sum(per.values())


def _plan_with_pieces(cases, monkeypatch, piece: int | None):
    """small_cnn's (plan, x, y); with `piece`, Layout.stack's rows in pieces of that many floats
    (GRAM_PIECE, as a large model's are; its 1,418 parameters end in a padded piece), on a
    plan of its own: the back end caches its emitted graphs per plan."""
    plan, x, y = cases("small_cnn")
    if piece is None:
        return plan, x, y
    monkeypatch.setattr(multi_tensor, "GRAM_PIECE", piece)
    plan = zoo_case("small_cnn", 256)[0]
    assert sum(v.size for v in plan.parameter_values().values()) % piece
    return plan, x, y


@pytest.mark.parametrize("multi, piece", [(False, None), (True, None), (False, 160), (True, 160)])
def test_the_stacked_gram_gives_numpys_norms_and_model(cases, multi, piece, monkeypatch):
    """The step's Gram entries (Layout.stack: g, P, v flattened from parameters of rank 1, 2
    and 4 into one stack) against float64 numpy: grad_norm is |g| of this batch's gradient
    (g.g), update_norm the size of the update the step applied (|a P + mu v|^2 from P.P, P.v
    and v.v, with the velocity of the earlier steps). `piece`: the stack in pieces of that
    many floats (GRAM_PIECE; the rows zero-padded to whole pieces), as a large model's is."""
    plan, x, y = _plan_with_pieces(cases, monkeypatch, piece)
    tr = Trainer(plan, optimizer="kfac", seed=0, multi_tensor=multi, **SCHEDULE)
    for k in range(3):
        tr.step(*batch(x, y, k))
    theta = {p: v.astype(np.float64) for p, v in tr.parameters().items()}
    feeds, yb = batch(x, y, 3)
    _, g = kc.gradients(plan, feeds, yb, params=tr.parameters())
    m = tr.step(feeds, yb)
    assert m["rejected"] == 0
    u = {p: tr.parameters()[p].astype(np.float64) - theta[p] for p in tr.params}
    g_norm = np.sqrt(sum(float((g[p].astype(np.float64) ** 2).sum()) for p in tr.params))
    u_norm = np.sqrt(sum(float((u[p] ** 2).sum()) for p in tr.params))
    assert m["grad_norm"] == pytest.approx(g_norm, rel=1e-5)
    assert m["update_norm"] == pytest.approx(u_norm, rel=1e-4)


@pytest.mark.parametrize("multi, piece", [(False, None), (True, None), (False, 160), (True, 160)])
def test_the_velocity_is_the_update_of_numpys_preconditioned_gradient(cases, multi, piece, monkeypatch):
    """The step's update u = -alpha P + mu v (per parameter one MatMul of (a, mu) with the
    Gram's stacked rows, Gram.combine; flat, elementwise) against float64 numpy: P from the
    blocks' numpy twins with the inverses the step read, g from kc.gradients, v the velocity
    before the step; the new velocity is theta_new - theta. A step that reads no refresh of
    its own (the refresh runs after steps 0, 2, 4)."""
    from kfac_compiler.host_blocks import host_blocks

    plan, x, y = _plan_with_pieces(cases, monkeypatch, piece)  # the update combined from the pieces
    tr = Trainer(plan, optimizer="kfac", seed=0, multi_tensor=multi, **SCHEDULE)
    for k in range(3):
        tr.step(*batch(x, y, k))
    before = stored_state(tr)
    theta = {p: v.astype(np.float64) for p, v in tr.parameters().items()}
    v_prev = {p: before[C.velocity(p)].astype(np.float64) for p in tr.params}
    assert any(np.any(v) for v in v_prev.values())
    feeds, yb = batch(x, y, 3)
    _, g = kc.gradients(plan, feeds, yb, params=tr.parameters())
    precond: dict[str, np.ndarray] = {}
    for layer, block in host_blocks(plan).items():
        state = {name: before[C.inverse(layer, name)].astype(np.float64) for name in ("A_inv", "G_inv")}
        grads = {p: g[p].astype(np.float64) for p in block.layer.params}
        precond.update(block.numpy_multiply_inverse(grads, state, {p: theta[p] for p in block.layer.params}))
    m = tr.step(feeds, yb)
    assert m["rejected"] == 0 and m["inverse"] == 0
    after = stored_state(tr)
    want = {p: -m["learning_rate"] * precond[p] + m["momentum"] * v_prev[p] for p in tr.params}
    new = {p: tr.parameters()[p].astype(np.float64) for p in tr.params}
    velocity = {p: after[C.velocity(p)] for p in tr.params}
    assert norm_rel(want, velocity, tr.params) < 1e-4
    assert norm_rel(want, {p: new[p] - theta[p] for p in tr.params}, tr.params) < 1e-4
    assert norm_rel({p: new[p] - theta[p] for p in tr.params}, velocity, tr.params) < 1e-5
