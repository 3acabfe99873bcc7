"""The fused K-FAC step's quadratic model and its Levenberg-Marquardt forward pass, against
independent numpy computations (finite-difference Jacobian-vector products in float64)."""
from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest

import kfac_compiler as kc
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.optimizers import ema_coefficient
from kfac_compiler.runtime import Trainer, gradients

LAYERS = ("fc1", "fc2", "fc3")


@pytest.fixture(scope="module")
def mlp():
    entry = ZOO["mlp_classifier"]
    plan = kc.compile(get_model("mlp_classifier", hidden=(16, 16)), loss=entry.loss, output="logits", emit=False)
    x, y = entry.make_data(64)
    return plan, x["input"], y


def logits(params: dict, x: np.ndarray) -> np.ndarray:
    """The zoo MLP (Gemm transB=1, ReLU) in float64 numpy."""
    h = np.asarray(x, np.float64)
    for i, layer in enumerate(LAYERS):
        h = h @ params[f"{layer}.weight"].T + params[f"{layer}.bias"]
        if i < len(LAYERS) - 1:
            h = np.maximum(h, 0.0)
    return h


def ggn_products(params: dict, x: np.ndarray, vectors: list[dict], step: float = 1e-6) -> np.ndarray:
    """C_ij = 1/m sum_n (J_n u_i)^T F_n (J_n u_j) for softmax cross-entropy, F_n = diag(p) - p p^T,
    with J u from central differences of the float64 forward pass (a step of length `step`
    along u, so that few ReLU kinks are crossed)."""
    ju = []
    for u in vectors:
        eps = step / max(1.0, math.sqrt(dot(u, u)))
        plus = {k: v + eps * u[k] for k, v in params.items()}
        minus = {k: v - eps * u[k] for k, v in params.items()}
        ju.append((logits(plus, x) - logits(minus, x)) / (2 * eps))
    z = logits(params, x)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    C = np.empty((len(vectors), len(vectors)))
    for i, a in enumerate(ju):
        for j, b in enumerate(ju):
            fb = p * b - p * (p * b).sum(axis=1, keepdims=True)
            C[i, j] = (a * fb).sum() / len(x)
    return C


def dot(a: dict, b: dict) -> float:
    return float(sum((np.asarray(a[k], np.float64) * b[k]).sum() for k in a))


def softmax_cross_entropy(params: dict, x: np.ndarray, y: np.ndarray) -> float:
    z = logits(params, x)
    z = z - z.max(axis=1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]))


@pytest.mark.parametrize("qmodel_batch,max_momentum,l2,max_decrease,curvature_scale", [
    (None, 1.0, 0.0, 1.0, 1.0), (24, 1.0, 0.0, 1.0, 1.0), (None, 0.05, 0.0, 1.0, 1.0), (24, 1.0, 1e-2, 1.0, 1.0),
    (None, 1.0, 0.0, 1e-3, 1.0), (24, 1.0, 1e-2, 1e-3, 1.0), (None, 1.0, 0.0, 1.0, 3.0), (24, 1.0, 1e-2, 1.0, 3.0)])
@pytest.mark.slow
def test_qmodel_learning_rate_and_momentum_solve_the_damped_quadratic_model(mlp, qmodel_batch, max_momentum, l2,
                                                                              max_decrease, curvature_scale):
    _assert_step_solves_the_model(mlp, qmodel_batch, max_momentum, l2, max_decrease, curvature_scale)


@pytest.fixture(scope="module")
def wide_mlp():
    """The zoo MLP with a head 2.5x wider than its input rows (4 -> 10 classes): its
    curvature terms take the pulled-back form (optimizers/kfac/curvature.py)."""
    entry = ZOO["mlp_classifier"]
    plan = kc.compile(get_model("mlp_classifier", hidden=(16, 4)), loss=entry.loss, output="logits", emit=False)
    x, y = entry.make_data(64)
    return plan, x["input"], y


@pytest.mark.parametrize("qmodel_batch,l2,curvature_scale", [(None, 0.0, 1.0), (24, 1e-2, 3.0)])
@pytest.mark.slow
def test_qmodel_with_a_wide_head_solves_the_damped_quadratic_model(wide_mlp, qmodel_batch, l2, curvature_scale):
    """The same check where C's terms with P are g = F J P pulled back through the head and
    paired with P's and v's tangents at the head's inputs (the vocabulary-sized heads' form)."""
    from kfac_compiler.backend.head import WIDENING

    assert 10 >= WIDENING * 4  # the head is wide: the pulled-back form is the one checked
    _assert_step_solves_the_model(wide_mlp, qmodel_batch, 1.0, l2, 1.0, curvature_scale)


def _assert_step_solves_the_model(mlp, qmodel_batch, max_momentum, l2, max_decrease, curvature_scale):
    """alpha, mu of step 3 minimize m(u) = g.u + 1/2 u.(C + lambda)u over u = -alpha P + mu v,
    with C the exact GGN and g the gradient, both on the batch's qmodel sub-batch (every
    (N // m)-th example here, m of them, m dividing N: backend/forward.py's sub_batch_pass; all when None), P = the preconditioned whole-batch gradient, v = the previous update;
    with |mu| capped at max_momentum, alpha is the best one for the capped mu.
    qmodel_change = m(u) with the whole batch's gradient. With weight decay l2 both gradients
    include l2 theta and the damping is lambda + l2. Where m(u) < -k gap (k =
    max_predicted_decrease, gap = the objective L + l2 |theta|^2 / 2 above the loss's bound 0)
    the applied update is s u with s = k gap / -m(u), and qmodel_change = m(s u). With
    qmodel_curvature_scale c the model's C is c times the GGN (the damping term unchanged)."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", qmodel_batch_size=qmodel_batch, stats_batch_size=None, batch_size=48,
                 max_momentum=max_momentum, l2_reg=l2, max_predicted_decrease=max_decrease,
                 qmodel_curvature_scale=curvature_scale)
    batches = [np.arange(48) + 8 * s for s in range(3)]
    for idx in batches[:2]:
        tr.step({"input": x[idx]}, y[idx])
    xb, yb = x[batches[2]], y[batches[2]]
    theta = {k: v.astype(np.float64) for k, v in tr.parameters().items()}
    v = {p: tr.store.to_numpy(f"velocity/{p}").astype(np.float64) for p in tr.params}
    lam = tr.damping + l2
    _, g = gradients(plan, {"input": xb}, yb, params=tr.parameters())
    m_sub = qmodel_batch or len(xb)
    rows = np.arange(m_sub) * len(xb) // m_sub  # the sub-batch: rows floor(k N / m)
    _, g_sub = gradients(plan, {"input": xb[rows]}, yb[rows], params=tr.parameters())
    g = {p: g[p] + l2 * theta[p] for p in g}
    g_sub = {p: g_sub[p] + l2 * theta[p] for p in g_sub}
    pre = tr.program("precondition").run(tr.store, {f"vec/{p}": g[p] for p in tr.params}, results=True)
    P = {p: pre[f"precond/{p}"].astype(np.float64) for p in tr.params}
    m = tr.step({"input": xb}, yb)
    assert m["rejected"] == 0 and dot(v, v) > 0

    C = curvature_scale * ggn_products(theta, xb[rows], [P, v]) + lam * np.array([[dot(P, P), dot(P, v)], [dot(v, P), dot(v, v)]])
    bvec = np.array([dot(g_sub, P), dot(g_sub, v)])
    a, mu = np.linalg.solve(C, -bvec)
    if abs(mu) > max_momentum:
        mu = math.copysign(max_momentum, mu)
        a = -(bvec[0] + mu * C[0, 1]) / C[0, 0]
    w = np.array([a, mu])
    whole_bvec = np.array([dot(g, P), dot(g, v)])
    change = w @ whole_bvec + 0.5 * w @ C @ w
    gap = softmax_cross_entropy(theta, xb, yb) + 0.5 * l2 * dot(theta, theta)
    scale = max_decrease * gap / -change if change < -max_decrease * gap else 1.0
    assert (scale < 0.5) == (max_decrease < 1)  # the cap binds exactly in the cases meant to test it
    w = scale * w
    assert m["update_scale"] == pytest.approx(scale, rel=1e-3)
    assert m["learning_rate"] == pytest.approx(-w[0], rel=2e-4)
    assert m["momentum"] == pytest.approx(w[1], rel=2e-4, abs=1e-5 * scale)
    assert m["qmodel_change"] == pytest.approx(w @ whole_bvec + 0.5 * w @ C @ w, rel=1e-3)
    moved = {p: tr.parameters()[p] - theta[p] for p in tr.params}  # the applied update, w0 P + w1 v
    expected = {p: w[0] * P[p] + w[1] * v[p] for p in tr.params}
    assert math.sqrt(dot({p: moved[p] - expected[p] for p in tr.params}, {p: moved[p] - expected[p] for p in tr.params})) \
        < 1e-3 * math.sqrt(dot(expected, expected))
    if max_momentum < 1:
        assert abs(m["momentum"]) == pytest.approx(max_momentum)  # the cap was active
    if qmodel_batch:  # the sub-batch's gradient matters: the whole batch's g gives other values
        a_mixed, _ = np.linalg.solve(C, -whole_bvec)
        assert abs(a_mixed - a) > 10 * 2e-4 * abs(a)


@pytest.mark.slow
def test_loss_after_runs_only_on_damping_adaptation_steps(mlp):
    """The forward pass at the new parameters sits in an If: metric/loss_after is the
    objective on adaptation steps (every damping_adaptation_interval-th) and NaN otherwise."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", damping_adaptation_interval=3)
    seen = []
    for name, prog in tr.programs().items():
        if name.startswith("kfac_step"):
            run = prog.run

            def recording(*args, _run=run, **kw):
                out = _run(*args, **kw)
                seen.append(out["metric/loss_after"])
                return out

            prog.run = recording
    ms = [tr.step({"input": x[:32]}, y[:32]) for _ in range(7)]
    adapt = [k % 3 == 0 for k in range(7)]
    assert ["new_loss" in m for m in ms] == adapt
    assert [not math.isnan(v) for v in seen] == adapt
    for m, v in zip(ms, seen):
        if "new_loss" in m:
            assert m["new_loss"] == v and math.isfinite(m["rho"])


@pytest.mark.slow
def test_statistics_and_qmodel_sub_batches_of_different_sizes(mlp):
    """Two sub-batch forward clones (statistics on 16, quadratic model on 24 examples) live
    side by side in one step graph (distinct node names) and train; the statistics sub-batch
    is really used: other factors give another preconditioned step."""
    plan, x, y = mlp
    runs = []
    for stats in (16, 24):
        tr = Trainer(plan, optimizer="kfac", stats_batch_size=stats, qmodel_batch_size=24, batch_size=48)
        runs.append([tr.step({"input": x[:48]}, y[:48]) for _ in range(2)])
    assert all(math.isfinite(m["loss"]) for ms in runs for m in ms)
    assert runs[0][0]["learning_rate"] != runs[1][0]["learning_rate"]  # other factors, other P


@pytest.mark.parametrize("reject", [True, False])
def test_a_step_that_raises_the_objective_is_rejected_on_adaptation_steps(mlp, reject):
    """With a far too large fixed learning rate, step 0 (a damping-adaptation step) raises
    the batch loss by far more than its model promised to lower it (rho < -1): the state is
    kept and the damping multiplied by damping_rejection_factor, unless reject_increase=False."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", learning_rate=50.0, adapt_damping=True, reject_increase=reject)
    before = tr.parameters()
    m = tr.step({"input": x[:32]}, y[:32])
    assert m["new_loss"] > m["loss"] and m["rho"] < -1
    after = tr.parameters()
    unchanged = all(np.array_equal(before[k], after[k]) for k in before)
    assert m["rejected"] == (1.0 if reject else 0.0) and unchanged == reject
    if reject:
        assert tr.damping == pytest.approx(10 * m["damping"])


@pytest.mark.slow
def test_statistics_run_only_on_the_steps_that_update_them(mlp):
    """The step's factor statistics sit in an If on hp/update_stats: with cov_update_period=2
    a step that skips them leaves every factor bit-for-bit as it was, and the next one gives
    the moving average (1 - c) F + c S, with S from the `statistics` subgraph (brute-force
    checked in test_fisher_bruteforce) at the parameters that step starts from."""
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", mode="exact", cov_update_period=2, batch_size=32)
    stats = emit_subgraph(plan, "statistics", mode="exact")[0]
    sess = ort.InferenceSession(stats.SerializeToString(), providers=["CPUExecutionProvider"])
    batches = [(x[i:i + 32], y[i:i + 32]) for i in (0, 32, 16)]
    factors = [s for s in tr.store.slots() if s.startswith("factor/")]
    assert len(factors) == 2 * len(LAYERS)
    tr.step({"input": batches[0][0]}, batches[0][1])
    f0 = {s: tr.store.to_numpy(s) for s in factors}
    m1 = tr.step({"input": batches[1][0]}, batches[1][1])
    assert m1["stats"] == 0.0
    assert all(np.array_equal(tr.store.to_numpy(s), f0[s]) for s in factors)
    params = tr.parameters()
    feeds = {"input": batches[2][0], "targets": batches[2][1], **params}
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    weight = tr.ema_weight
    m2 = tr.step({"input": batches[2][0]}, batches[2][1])
    assert m2["stats"] == 1.0 and m2["rejected"] == 0.0
    assert sum(name.startswith("kfac_step") for name in tr.programs()) == 1  # one session for all steps
    c, _ = ema_coefficient(weight, tr.config.cov_ema_decay)
    for s in factors:
        layer, f = s.split("/")[1:]
        expect = (1 - c) * f0[s].astype(np.float64) + c * want[f"stat/{layer}/{f}"]
        np.testing.assert_allclose(tr.store.to_numpy(s), expect, rtol=1e-5, atol=1e-7)
        assert not np.allclose(tr.store.to_numpy(s), f0[s])
    # the If, not a zero coefficient, keeps them: a skipping run with c = 0.5 changes nothing
    prog = tr.program("kfac_step", options=tr.policy.step_options())  # with_stats, stats_if
    before = {s: tr.store.to_numpy(s) for s in factors}
    assert prog.run(tr.store, hp={"hp/update_stats": 0.0, "hp/ema_coeff": 0.5})["metric/finite"] == 1.0
    assert all(np.array_equal(tr.store.to_numpy(s), before[s]) for s in factors)
    prog.run(tr.store, hp={"hp/update_stats": 1.0, "hp/ema_coeff": 0.5})
    assert not any(np.array_equal(tr.store.to_numpy(s), before[s]) for s in factors)


@pytest.mark.slow
def test_step_program_follows_the_batch_size_and_weights(mlp):
    """The trainer's memoized step program is the one its options call for after every change
    of batch size (a batch no larger than the sub-batch needs no slice) and of weighting; a
    weighted step really runs the weighted graph: weights 2 double the reported loss."""
    plan, x, y = mlp
    runs = {}
    for weighted in (False, True):
        tr = Trainer(plan, optimizer="kfac", stats_batch_size=16, qmodel_batch_size=16, batch_size=48)
        losses = []
        for rows in (48, 8, 48):
            w = np.full(rows, 2.0, np.float32) if weighted else None
            losses.append(tr.step({"input": x[:rows]}, y[:rows], weights=w)["loss"])
            assert tr.policy.step_program() is tr.program("kfac_step", options=tr.policy.step_options())
        runs[weighted] = losses
    assert tr.policy.step_options().stats_batch == 16 and tr.policy.step_options().weighted
    # step 0 of both runs starts from the same parameters
    assert runs[True][0] == pytest.approx(2.0 * runs[False][0], rel=1e-6)


@pytest.mark.slow
def test_wide_head_form_with_example_weights_steps_like_the_two_tangent_form(monkeypatch):
    """With example weights (w in C = 1/N sum w J^T F J) the pulled-back form's steps equal
    those of Loss.emit_fisher_dots on both tangents (the form the test above checks against
    numpy), forced by raising the width the wide form needs: alpha, mu and the model change of
    three steps to float rounding."""
    from kfac_compiler.backend import head

    entry = ZOO["mlp_classifier"]
    x, y = entry.make_data(48)
    w = np.random.default_rng(3).uniform(0.0, 2.0, 48).astype(np.float32)

    def run():
        plan = kc.compile(get_model("mlp_classifier", hidden=(16, 4)), loss=entry.loss, output="logits", emit=False)
        tr = Trainer(plan, optimizer="kfac", stats_batch_size=None)
        return [tr.step({"input": x["input"]}, y, weights=w) for _ in range(3)]

    wide = run()
    monkeypatch.setattr(head, "WIDENING", 10**6)
    both = run()
    assert wide[-1]["learning_rate"] != 0
    for a, b in zip(wide, both):
        for key in ("learning_rate", "momentum", "qmodel_change"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
