"""K-FAC's momentum_type (TF K-FAC's regular / adam / qmodel / qmodel_fixedmu): the update
sequence over five steps of the zoo MLP against an independent float64 numpy twin of TF
K-FAC's rule (kfac/python/ops/optimizer.py, _compute_raw_update_steps), with the trainer's
own preconditioner as the one shared piece (a linear map read from the inverse slots the step
uses) and the quadratic model's curvature from finite-difference GGN products."""
from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from helpers import zoo_case
from kfac_compiler.cli import main
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import make_config
from kfac_compiler.runtime import Trainer, gradients
from test_kfac_step import dot, ggn_products

BATCH, STEPS, DAMPING, MU = 32, 5, 1e-2, 0.8


@pytest.fixture(scope="module")
def mlp():
    plan, x, y = zoo_case("mlp_classifier", BATCH * STEPS, hidden=(16, 16))
    return plan, x["input"], y


def combine(*terms) -> dict:
    """sum_i c_i u_i over parameter dicts, terms (c_i, u_i)."""
    return {p: sum(c * u[p] for c, u in terms) for p in terms[0][1]}


def clip(lr: float, sq: float, c: float | None) -> float:
    """TF K-FAC's _update_clip_coeff: min(1, sqrt(c / (lr^2 v.F^-1 v)))."""
    return 1.0 if c is None else min(1.0, math.sqrt(c / (lr * lr * abs(sq))))


class Twin:
    """TF K-FAC's update rule in float64 numpy, from its own state (parameters, velocity)."""

    def __init__(self, kind: str, theta: dict, lr, norm_constraint: float | None) -> None:
        self.kind, self.theta, self.lr, self.c = kind, theta, lr, norm_constraint
        self.velocity = {p: np.zeros_like(v) for p, v in theta.items()}  # TF's slot "velocity"
        self.prev = {p: np.zeros_like(v) for p, v in theta.items()}      # the last update
        self.alpha = self.mu = float("nan")

    def step(self, k: int, xb: np.ndarray, g: dict, precondition) -> None:
        lr = self.lr(k) if callable(self.lr) else self.lr
        if self.kind == "regular":  # v <- mu v + clip P; update = -lr v
            P = precondition(g)
            s = clip(lr, dot(g, P), self.c)
            self.velocity = combine((MU, self.velocity), (s, P))
            update = combine((-lr, self.velocity))
            self.alpha, self.mu = lr * s, MU
        elif self.kind == "regular_scheduled":  # ours with a varying lr: update = -lr_k clip P + mu u_{k-1}
            P = precondition(g)
            s = clip(lr, dot(g, P), self.c)
            update = combine((-lr * s, P), (MU, self.prev))
            self.alpha, self.mu = lr * s, MU
        elif self.kind == "adam":  # v <- mu v + g; update = -lr clip(v) F^-1 v
            self.velocity = combine((MU, self.velocity), (1.0, g))
            P = precondition(self.velocity)
            s = clip(lr, dot(self.velocity, P), self.c)
            update = combine((-lr * s, P))
            self.alpha, self.mu = lr * s, MU
        else:  # qmodel, qmodel_fixedmu: the damped exact quadratic model in span(P, prev)
            P = precondition(g)
            prev = self.prev
            m = ggn_products(self.theta, xb, [P, prev]) + DAMPING * np.array(
                [[dot(P, P), dot(P, prev)], [dot(prev, P), dot(prev, prev)]])
            c = np.array([dot(g, P), dot(g, prev)])
            if self.kind == "qmodel_fixedmu" or c[1] == 0.0:  # TF's fixed_mu / zero_prevupd_case
                mu = MU if self.kind == "qmodel_fixedmu" else 0.0
                alpha = -(mu * m[0, 1] + c[0]) / m[0, 0]  # d/dalpha of the model = 0
            else:
                alpha, mu = -np.linalg.solve(m, c)
            update = combine((alpha, P), (mu, prev))
            self.alpha, self.mu = -alpha, mu
        self.theta = combine((1.0, self.theta), (1.0, update))
        self.prev = update


def gradients64(plan, xb: np.ndarray, yb: np.ndarray, theta: dict) -> dict:
    """The batch gradient at float64 parameters `theta` (in float32, as float64)."""
    _, g = gradients(plan, {"input": xb}, yb, params={p: v.astype(np.float32) for p, v in theta.items()})
    return {p: v.astype(np.float64) for p, v in g.items()}


def relative_gap(a: dict, b: dict, ref: dict) -> float:
    diff = {p: a[p] - b[p] for p in a}
    return math.sqrt(dot(diff, diff) / dot(ref, ref))


@pytest.mark.parametrize("kind,lr,norm_constraint", [
    ("regular", 0.05, None), ("regular", 0.2, 1e-3), ("adam", 0.02, None), ("adam", 0.05, 1e-3),
    ("qmodel", None, None), ("qmodel_fixedmu", None, None),
    ("regular_scheduled", lambda k: 0.08 * 0.5 ** k, None)])
@pytest.mark.slow
def test_update_sequence_equals_tf_kfacs_rule(mlp, kind, lr, norm_constraint):
    """Five steps (inverses refreshed after step 2 and 4) of each momentum type equal TF
    K-FAC's rule run in numpy from the same initial parameters and batches: every step's
    parameters within 2e-4 of the total change, and the metrics report the step size and
    momentum used. qmodel_fixedmu's alpha is the closed-form minimizer -(mu c12 + b1)/c11 of
    the model for the fixed mu. "regular_scheduled": ours with a varying learning rate keeps
    each update's own lr (u_k = -lr_k P + mu u_{k-1}), where TF rescales its whole velocity by
    the current lr; the test shows the two differ."""
    plan, x, y = mlp
    ours = "regular" if kind == "regular_scheduled" else kind
    knobs = dict(momentum_type=ours, damping=DAMPING, adapt_damping=False, stats_batch_size=None,
                 qmodel_batch_size=None, inv_update_period=2, max_predicted_decrease=None, batch_size=BATCH)
    if not ours.startswith("qmodel"):
        knobs.update(learning_rate=lr, norm_constraint=norm_constraint)
    if ours != "qmodel":
        knobs["momentum"] = MU
    tr = Trainer(plan, optimizer="kfac", **knobs)
    precond = tr.program("precondition")

    def precondition(vec: dict) -> dict:  # (F + damping)^-1 v with the inverse slots as they are now
        out = precond.run(tr.store, {f"vec/{p}": vec[p].astype(np.float32) for p in tr.params}, results=True)
        return {p: out[f"precond/{p}"].astype(np.float64) for p in tr.params}

    start = {p: v.astype(np.float64) for p, v in tr.parameters().items()}
    twin = Twin(kind, start, lr, norm_constraint)
    clipped = 0
    for k in range(STEPS):
        xb, yb = x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]
        g = gradients64(plan, xb, yb, twin.theta)
        if k == 0:  # the first step makes its inverses before it: they are in the slots after it
            m = tr.step({"input": xb}, yb)
            twin.step(k, xb, g, precondition)
        else:  # the inverses refreshed after step k serve step k + 1
            twin.step(k, xb, g, precondition)
            m = tr.step({"input": xb}, yb)
        assert m["rejected"] == 0
        got = {p: v.astype(np.float64) for p, v in tr.parameters().items()}
        moved = {p: twin.theta[p] - start[p] for p in start}
        assert relative_gap(got, twin.theta, moved) < 2e-4, k
        assert m["learning_rate"] == pytest.approx(twin.alpha, rel=2e-4)
        assert m["momentum"] == pytest.approx(twin.mu, rel=2e-4, abs=1e-6)
        clipped += norm_constraint is not None and twin.alpha < 0.999 * (lr if not callable(lr) else lr(k))
    if norm_constraint is not None:
        assert clipped >= 2  # the KL clipping was active (on the momentum sum for adam)
    if kind == "adam":  # the gradient sum is its own slot; velocity holds the last update (roll_back)
        assert relative_gap({p: tr.store.to_numpy(f"grad_velocity/{p}").astype(np.float64) for p in tr.params},
                            twin.velocity, twin.velocity) < 1e-4
        assert relative_gap({p: tr.store.to_numpy(f"velocity/{p}").astype(np.float64) for p in tr.params},
                            twin.prev, twin.prev) < 1e-3
    if kind == "regular_scheduled":  # TF's rule (velocity rescaled by the current lr) ends elsewhere
        tf = Twin("regular", start, lr, None)
        for k in range(STEPS):
            xb, yb = x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]
            g = gradients64(plan, xb, yb, tf.theta)
            tf.step(k, xb, g, precondition)  # the last inverses: the point is the momentum term
        assert relative_gap(tf.theta, twin.theta, {p: twin.theta[p] - start[p] for p in start}) > 1e-2


@pytest.mark.parametrize("knobs,message", [
    (dict(momentum_type="nesterov", learning_rate=0.1), "unknown momentum_type 'nesterov'; choose one of regular"),
    (dict(momentum_type="adam", use_qmodel=True, learning_rate=0.1),
     "use_qmodel=True contradicts momentum_type='adam'"),
    (dict(momentum_type="qmodel", use_qmodel=False), "use_qmodel=False contradicts momentum_type='qmodel'"),
    (dict(momentum_type="qmodel_fixedmu", learning_rate=0.1), "'qmodel_fixedmu' chooses the learning rate itself"),
    (dict(momentum_type="qmodel", momentum=0.5), "chooses learning rate and momentum itself"),
    (dict(momentum_type="qmodel_fixedmu", norm_constraint=1e-3), "norm_constraint (KL clipping) only applies"),
    (dict(momentum_type="adam"), "momentum_type='adam' (use_qmodel=False) needs a learning_rate"),
    (dict(momentum_type="qmodel_fixedmu", momentum=1.0), "'momentum' must be in [0, 1)"),
    (dict(damping_adaptation_decay=0.0), "'damping_adaptation_decay' must be in (0, 1), got 0.0"),
])
def test_bad_momentum_type_combinations_are_one_line(knobs, message):
    with pytest.raises(ConfigError) as e:
        make_config("kfac", **knobs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_use_qmodel_maps_onto_momentum_type():
    """use_qmodel (kfac-jax) stays: True is "qmodel", False with a learning rate "regular";
    an explicit momentum_type sets use_qmodel."""
    assert make_config("kfac").momentum_type == "qmodel"
    assert make_config("kfac", use_qmodel=False, learning_rate=0.1).momentum_type == "regular"
    assert make_config("kfac", learning_rate=0.1).momentum_type == "regular"
    cfg = make_config("kfac", momentum_type="qmodel_fixedmu")
    assert cfg.use_qmodel and cfg.momentum == 0.9 and cfg.adapt_damping
    cfg = make_config("kfac", momentum_type="adam", learning_rate=0.01)
    assert not cfg.use_qmodel and cfg.momentum == 0.9 and not cfg.adapt_damping


def test_roll_back_clears_adam_momentums_gradient_sum(mlp):
    """roll_back restores the parameters before the last update and zeroes the velocity and
    adam momentum's gradient sum with it."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", momentum_type="adam", learning_rate=0.01, batch_size=BATCH)
    for k in range(2):
        before = {p: tr.store.to_numpy(p) for p in tr.params}
        tr.step({"input": x[k * BATCH:(k + 1) * BATCH]}, y[k * BATCH:(k + 1) * BATCH])
    assert any(np.abs(tr.store.to_numpy(f"grad_velocity/{p}")).max() > 0 for p in tr.params)
    assert tr.policy.roll_back(tr.policy.trainer._prepare({"input": x[:BATCH]}, y[:BATCH]))
    for p in tr.params:
        np.testing.assert_array_equal(tr.store.to_numpy(p), before[p])
        assert not np.any(tr.store.to_numpy(f"grad_velocity/{p}")) and not np.any(tr.store.to_numpy(f"velocity/{p}"))



@pytest.mark.parametrize("momentum_type", ["regular", "qmodel"])
def test_roll_back_undoes_the_decoupled_decay_too(mlp, momentum_type):
    """With decoupled_weight_decay w the update was theta = (1 - alpha w) theta_prev +
    velocity; the roll-back (after a divergence or a loss spike) subtracted the velocity only
    and left theta at (1 - alpha w) theta_prev. Now it gives theta_prev back, the parameters
    read before the step, here with alpha w = 0.05 (regular) and the quadratic model's alpha."""
    plan, x, y = mlp
    knobs = dict(learning_rate=0.1, momentum=0.5) if momentum_type == "regular" else {}
    tr = Trainer(plan, optimizer="kfac", momentum_type=momentum_type, decoupled_weight_decay=0.5, batch_size=BATCH,
                 **knobs)
    tr.step({"input": x[:BATCH]}, y[:BATCH])
    before = tr.parameters()
    m = tr.step({"input": x[BATCH:2 * BATCH]}, y[BATCH:2 * BATCH])
    assert m["rejected"] == 0.0 and m["learning_rate"] * 0.5 > 1e-3
    assert max(np.abs(tr.parameters()[p] - before[p]).max() for p in before) > 1e-3
    assert tr.policy.roll_back(tr.policy.trainer._prepare({"input": x[:BATCH]}, y[:BATCH]))
    for p, value in tr.parameters().items():
        np.testing.assert_allclose(value, before[p], rtol=1e-5, atol=1e-6)

@pytest.fixture(scope="module")
def qmodel_checkpoint(mlp, tmp_path_factory):
    """Two qmodel steps (the default type) saved: the checkpoint stores momentum_type='qmodel'
    and use_qmodel=True both, and no grad_velocity slots."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", batch_size=BATCH)
    for k in range(2):
        tr.step({"input": x[k * BATCH:(k + 1) * BATCH]}, y[k * BATCH:(k + 1) * BATCH])
    assert tr.config.momentum_type == "qmodel" and not any(s.startswith("grad_velocity/") for s in tr.store.slots())
    return tr.save_checkpoint(tmp_path_factory.mktemp("qmodel") / "q.ckpt")


@pytest.mark.parametrize("overrides,kind", [
    (dict(use_qmodel=False, learning_rate=0.01), "regular"),
    (dict(momentum_type="regular", learning_rate=0.01), "regular"),
    (dict(learning_rate=0.01), "regular"),  # a learning rate means regular, as on a fresh run
    (dict(use_adaptive_learning_rate=False, learning_rate=0.01, momentum=0.5), "regular"),  # TF's alias
])
@pytest.mark.slow
def test_resume_switches_from_qmodel_to_regular(mlp, qmodel_checkpoint, overrides, kind):
    """An override of momentum_type, use_qmodel or a learning rate the stored qmodel refuses
    decides the type: the stored derived pair is dropped, and the step uses the fresh run's
    values (momentum 0.9 unless given)."""
    plan, x, y = mlp
    tr = Trainer.load_checkpoint(qmodel_checkpoint, plan, batch_size=BATCH, **overrides)
    fresh = make_config("kfac", plan, **overrides)
    assert (tr.config.momentum_type, tr.config.use_qmodel) == (kind, False) == (fresh.momentum_type, fresh.use_qmodel)
    assert tr.config.adapt_damping is False is fresh.adapt_damping  # derived for regular, not the stored qmodel's True
    m = tr.step({"input": x[2 * BATCH:3 * BATCH]}, y[2 * BATCH:3 * BATCH])
    assert (m["learning_rate"], m["momentum"]) == (pytest.approx(0.01), pytest.approx(overrides.get("momentum", 0.9)))
    assert tr.step_count == 3


@pytest.mark.slow
def test_resume_switches_from_qmodel_to_adam_with_empty_gradient_sums(mlp, qmodel_checkpoint):
    """qmodel -> adam: the checkpoint has no grad_velocity slots; they start at zero (a
    warning says so), so after the first resumed step the sum is that step's gradient."""
    plan, x, y = mlp
    with pytest.warns(UserWarning, match=r"has no momentum sums \('grad_velocity/.*they start at zero$"):
        tr = Trainer.load_checkpoint(qmodel_checkpoint, plan, batch_size=BATCH, momentum_type="adam",
                                     learning_rate=0.01)
    assert (tr.config.momentum_type, tr.config.use_qmodel, tr.config.momentum) == ("adam", False, 0.9)
    xb, yb = {"input": x[2 * BATCH:3 * BATCH]}, y[2 * BATCH:3 * BATCH]
    _, g = gradients(plan, xb, yb, params=tr.parameters())
    tr.step(xb, yb)
    for p in tr.params:
        np.testing.assert_allclose(tr.store.to_numpy(f"grad_velocity/{p}"), g[p], rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_resume_switches_from_regular_to_qmodel(mlp, tmp_path):
    """regular -> use_qmodel=True: the stored learning rate and momentum (which the qmodel
    chooses itself) are dropped with the stored type."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", learning_rate=0.01, norm_constraint=1e-3, batch_size=BATCH)
    tr.step({"input": x[:BATCH]}, y[:BATCH])
    resumed = Trainer.load_checkpoint(tr.save_checkpoint(tmp_path / "r.ckpt"), plan, use_qmodel=True)
    cfg = resumed.config
    assert (cfg.momentum_type, cfg.learning_rate, cfg.momentum, cfg.norm_constraint) == ("qmodel", None, None, None)
    assert resumed.learning_rate is None and cfg.adapt_damping is True  # the qmodel's default, not regular's False
    kept = Trainer.load_checkpoint(tmp_path / "r.ckpt", plan, use_qmodel=True, adapt_damping=False)
    assert kept.config.adapt_damping is False  # given: honoured


@pytest.mark.slow
def test_resume_without_a_type_switch_keeps_the_stored_adapt_damping(mlp, tmp_path):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", learning_rate=0.01, adapt_damping=True, batch_size=BATCH)
    tr.step({"input": x[:BATCH]}, y[:BATCH])
    resumed = Trainer.load_checkpoint(tr.save_checkpoint(tmp_path / "r.ckpt"), plan, momentum=0.5)
    assert (resumed.config.momentum_type, resumed.config.adapt_damping) == ("regular", True)


@pytest.mark.slow
def test_cli_resume_switches_momentum_type_with_a_knob(tmp_path, capsys):
    """`train --resume C --knob momentum_type=regular --learning-rate 0.01` continues a qmodel
    run as regular K-FAC: the resumed steps report lr 0.01 and momentum 0.9."""
    ckpt, metrics = tmp_path / "c.ckpt", tmp_path / "m.csv"
    assert main(["train", "--optimizer", "kfac", "--batch-size", "32", "-q", "--steps", "2",
                 "--checkpoint", str(ckpt)]) == 0
    assert main(["train", "--resume", str(ckpt), "--steps", "4", "-q", "--knob", "momentum_type=regular",
                 "--learning-rate", "0.01", "--metrics", str(metrics)]) == 0, capsys.readouterr().err
    rows = list(csv.DictReader(open(metrics)))
    got = [(float(r["step"]), float(r["learning_rate"]), float(r["momentum"])) for r in rows]
    assert got == [(2.0, pytest.approx(0.01, rel=1e-6), pytest.approx(0.9, rel=1e-6)),
                   (3.0, pytest.approx(0.01, rel=1e-6), pytest.approx(0.9, rel=1e-6))]


@pytest.mark.slow
@pytest.mark.parametrize("power,quadratic", [(-1.0, True), (-0.5, False)])
def test_adam_momentums_predicted_change_is_tf_approx_qmodel_change(mlp, power, quadratic):
    """TF K-FAC's _compute_approx_qmodel_change for adam momentum: u.g + u.(F + damping) u / 2
    with u = -lr P, P = (F + damping)^-1 m, i.e. -lr g.P + lr^2 m.P / 2, from g (the gradients
    subgraph), m (grad_velocity) and P (the precondition program on the step's inverses); at a
    power other than -1 only the first-order -lr g.P (u.(F + damping) u is not m.P there)."""
    plan, x, y = mlp
    lr = 0.02
    tr = Trainer(plan, optimizer="kfac", momentum_type="adam", learning_rate=lr, momentum=0.5, damping=0.1,
                 adapt_damping=True, precon_power=power, inv_update_period=100, batch_size=BATCH)
    for k in range(3):
        xb, yb = {"input": x[k * BATCH:(k + 1) * BATCH]}, y[k * BATCH:(k + 1) * BATCH]
        _, g = gradients(plan, xb, yb, params=tr.parameters())
        metrics = tr.step(xb, yb)
        m = {p: tr.store.to_numpy(f"grad_velocity/{p}").astype(np.float64) for p in tr.params}
        out = tr.program("precondition").run(tr.store, {f"vec/{p}": m[p].astype(np.float32) for p in tr.params},
                                             results=True)
        P = {p: out[f"precond/{p}"].astype(np.float64) for p in tr.params}
        expected = -lr * dot(g, P) + (0.5 * lr * lr * dot(m, P) if quadratic else 0.0)
        assert metrics["qmodel_change"] == pytest.approx(expected, rel=1e-4), k
        assert (0.5 * lr * lr * dot(m, P)) > 1e-3 * abs(expected)  # the quadratic term is not negligible
