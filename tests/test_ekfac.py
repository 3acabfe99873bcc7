"""EKFAC (blocks/ekfac.py) against independent truth: its S is the diagonal of the
brute-force Fisher in the Kronecker eigenbasis (per-example gradients written out from the
layer definitions; finite-difference Jacobians of a tiny MLP), it is never further from that
Fisher (Frobenius) than K-FAC's A (x) G, the step graph preconditions with a hand-written
numpy EKFAC step, and a zoo model trains with it and resumes bit for bit."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from scipy.linalg import block_diag

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.blocks import make_block, plan_blocks
from kfac_compiler.errors import PlanError
from kfac_compiler.losses import make_loss
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.staged import StagedProgram
from test_blocks import (
    brute_fisher,
    conv_case,
    explicit_conv_weight_grads,
    fc_case,
    per_example_fc_grads,
    run_graph,
    stat_tensors,
)
from test_fisher_bruteforce import IN, OUT, _exact_fisher, _forward, _layer_jacobian, _tiny_mlp


# ------------------------------------------------------------------ block level
def _fc(**kw):
    layer, shapes, inputs, cots = fc_case(approx="ekfac", **kw)
    blk = make_block(layer, shapes, [inputs[0].shape] * len(inputs))  # static shapes: T = 1 takes one matmul
    grads = [per_example_fc_grads(layer, shapes, inputs, cots, s) for s in range(len(cots[0]))]
    return blk, inputs, cots, grads


def _conv(**kw):
    layer, blk, inputs, cots = conv_case(approx="ekfac", **kw)
    grads = [sum(explicit_conv_weight_grads(np.asarray(x, np.float64), np.asarray(cots[u][s], np.float64),
                                            layer.attrs, blk.group, blk.has_bias, blk.C_out)
                 for u, x in enumerate(inputs)) for s in range(len(cots[0]))]
    return blk, inputs, cots, grads


BLOCK_CASES = {
    "fc-one-position": lambda: _fc(lead=(), N=9),
    "fc-positions": lambda: _fc(lead=(3,), layout="in_out"),
    "fc-multi-use": lambda: _fc(uses=3, lead=(2,), seeds=1),
    "fc-no-bias": lambda: _fc(bias=False, lead=()),
    "conv": lambda: _conv(pads=(1, 1, 1, 1)),
    "conv-group": lambda: _conv(group=2, strides=(2, 1)),
    "conv-multi-use": lambda: _conv(uses=2, seeds=1, bias=False),
}


def _emitted(blk, inputs, cots, A_Q, G_Q) -> dict:
    """emit_statistics with the eigenbases as graph inputs, run in ONNX Runtime."""
    feeds = {f"x{u}": x for u, x in enumerate(inputs)}
    feeds.update({f"d{u}_{s}": d for u, ds in enumerate(cots) for s, d in enumerate(ds)})
    feeds.update({"AQ": np.asarray(A_Q, np.float32), "GQ": np.asarray(G_Q, np.float32)})
    xs = [f"x{u}" for u in range(len(inputs))]
    ds = [[f"d{u}_{s}" for s in range(len(d))] for u, d in enumerate(cots)]
    return run_graph(lambda b: stat_tensors(b, blk.emit_statistics(b, xs, ds, state={"A_Q": "AQ", "G_Q": "GQ"})),
                     feeds)


def _groups(M, blk):
    return np.asarray(M, np.float64).reshape(-1, *M.shape[-2:]) if blk.batch else np.asarray(M, np.float64)[None]


def _eigenbases(blk, A, G):
    """Ascending eigh per group, in the state's shape."""
    ua = np.stack([np.linalg.eigh(a)[1] for a in _groups(A, blk)])
    ug = np.stack([np.linalg.eigh(g)[1] for g in _groups(G, blk)])
    return (ua, ug) if blk.batch else (ua[0], ug[0])


def _basis(blk, A_Q, G_Q):
    """U = block_diag over groups of U_G (x) U_A, for vec of the [out, in+1] matrix (row major)."""
    return block_diag(*[np.kron(ug, ua) for ua, ug in zip(_groups(A_Q, blk), _groups(G_Q, blk))])


@pytest.fixture(scope="module", params=list(BLOCK_CASES))
def block_case(request):
    blk, inputs, cots, grads = BLOCK_CASES[request.param]()
    F = brute_fisher(grads)  # 1/N sum_{s,n} vec(g) vec(g)^T, the estimator's Fisher of this batch
    eye = (np.broadcast_to(np.eye(blk.nA), (*blk.batch, blk.nA, blk.nA)),
           np.broadcast_to(np.eye(blk.nG), (*blk.batch, blk.nG, blk.nG)))
    first = _emitted(blk, inputs, cots, *eye)
    A_Q, G_Q = _eigenbases(blk, first["A"], first["G"])
    second = _emitted(blk, inputs, cots, A_Q, G_Q)
    return blk, inputs, cots, F, first, second, A_Q, G_Q


def test_S_is_the_fishers_diagonal_in_the_kronecker_eigenbasis(block_case):
    blk, inputs, cots, F, first, second, A_Q, G_Q = block_case
    scale = np.abs(np.diag(F)).max()
    # identity bases: S is the plain diagonal Fisher (the "diagonal" block's statistic)
    np.testing.assert_allclose(first["S"].reshape(-1), np.diag(F), rtol=1e-4, atol=1e-5 * scale)
    U = _basis(blk, A_Q, G_Q)
    projected = np.diag(U.T @ F @ U)
    np.testing.assert_allclose(second["S"].reshape(-1), projected, rtol=2e-4, atol=2e-5 * scale)
    np.testing.assert_allclose(second["A"], first["A"]), np.testing.assert_allclose(second["G"], first["G"])
    # the numpy twin, in float64
    ref = blk.numpy_statistics(inputs, cots, state={"A_Q": A_Q, "G_Q": G_Q})
    np.testing.assert_allclose(ref["S"].reshape(-1), projected, rtol=1e-9, atol=1e-12 * scale)


def test_ekfac_is_never_further_from_the_fisher_than_kfac(block_case):
    """||F - U diag(S) U^T||_F <= ||F - A (x) G||_F: K-FAC is U diag(s_G s_A^T) U^T, another
    diagonal in the same basis, and S is the diagonal that fits F best there."""
    blk, _, _, F, _, second, A_Q, G_Q = block_case
    U = _basis(blk, A_Q, G_Q)
    kfac = block_diag(*[np.kron(g, a) for a, g in zip(_groups(second["A"], blk), _groups(second["G"], blk))])
    ekfac = U @ np.diag(second["S"].reshape(-1).astype(np.float64)) @ U.T
    err_kfac, err_ekfac = np.linalg.norm(F - kfac), np.linalg.norm(F - ekfac)
    assert err_ekfac <= err_kfac * (1 + 1e-5)
    # Pythagoras in the basis U: the two differ only on its diagonal, where EKFAC has F's own
    gap = np.diag(U.T @ F @ U) - np.diag(U.T @ kfac @ U)
    np.testing.assert_allclose(err_kfac**2 - err_ekfac**2, gap @ gap, rtol=1e-3)
    assert gap @ gap > 1e-3 * err_kfac**2  # strictly closer on every case here


def test_refresh_restarts_S_at_kfacs_eigenvalues_and_the_state_inverts(block_case):
    blk, inputs, cots, _, first, _, _, _ = block_case
    factors = {"A": first["A"], "G": first["G"]}
    state, ok = blk.numpy_inverse(factors, 0.05)
    assert ok and float(state["damping"]) == pytest.approx(0.05)
    U = _basis(blk, state["A_Q"], state["G_Q"])
    kfac = block_diag(*[np.kron(g, a) for a, g in zip(_groups(first["A"], blk), _groups(first["G"], blk))])
    np.testing.assert_allclose(state["S"].reshape(-1), np.diag(U.T @ kfac @ U), rtol=1e-4,
                               atol=1e-5 * np.abs(kfac).max())
    # right after a refresh the preconditioner is K-FAC's with exact damping: (A (x) G + lam)^-1
    v = {p: np.random.default_rng(0).standard_normal(s).astype(np.float32) for p, s in blk.param_shapes.items()}
    back = blk.numpy_multiply(blk.numpy_multiply_inverse(v, state), factors, 0.05)
    for p in v:
        np.testing.assert_allclose(back[p], v[p], rtol=1e-3, atol=1e-4)
    state["damping"] = np.float32(np.nan)
    assert not blk.numpy_inverse({"A": first["A"] * np.nan, "G": first["G"]}, 0.05, previous=state)[1]


# ------------------------------------------------------------------ tiny MLP, brute force
def _statistics_with_state(plan, x, y, mode, state):
    model, info = emit_subgraph(plan, "statistics", mode=mode)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input": x.astype(np.float32), "targets": y}
    feeds.update({t.name: numpy_helper.to_array(t) for t in plan.model.graph.initializer if t.name in plan.trainable})
    for slot in info.state_inputs:  # the eigenbases given; S and damping are read by the preconditioner only
        if slot.startswith("inverse/"):
            feeds[slot] = np.asarray(state.get(slot, np.zeros(info.state_specs[slot].shape)), np.float32)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.mark.parametrize("mode", ["exact", "empirical"])
def test_tiny_mlp_S_is_the_projected_diagonal_of_the_brute_force_fisher(mode):
    model, params = _tiny_mlp(5)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False,
                      layers={"fc1": "ekfac", "fc2": "ekfac"})
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(7, IN)), rng.integers(0, OUT, 7)
    eye = {f"inverse/{l}/{q}": np.eye(n) for l, (na, ng) in (("fc1", (IN + 1, 4)), ("fc2", (5, OUT)))
           for q, n in (("A_Q", na), ("G_Q", ng))}
    first = _statistics_with_state(plan, x, y, mode, eye)
    state = {}
    for layer in ("fc1", "fc2"):
        state[f"inverse/{layer}/A_Q"] = np.linalg.eigh(first[f"stat/{layer}/A"].astype(np.float64))[1]
        state[f"inverse/{layer}/G_Q"] = np.linalg.eigh(first[f"stat/{layer}/G"].astype(np.float64))[1]
    stats = _statistics_with_state(plan, x, y, mode, state)
    dz = make_loss("softmax_cross_entropy").np_grad(_forward(params, x), y)
    for layer in ("fc1", "fc2"):
        if mode == "exact":
            F = _exact_fisher(params, x, layer)
        else:  # the empirical Fisher: mean_n g_n g_n^T, g_n = J_n^T dl_n/dz
            gs = [_layer_jacobian(params, x[n], layer).T @ dz[n] for n in range(len(x))]
            F = sum(np.outer(g, g) for g in gs) / len(x)
        U = np.kron(state[f"inverse/{layer}/G_Q"], state[f"inverse/{layer}/A_Q"])
        S = stats[f"stat/{layer}/S"].reshape(-1)
        np.testing.assert_allclose(S, np.diag(U.T @ F @ U), rtol=1e-3, atol=1e-6 * np.abs(F).max())
        kfac = np.kron(stats[f"stat/{layer}/G"], stats[f"stat/{layer}/A"])
        assert np.linalg.norm(F - U @ np.diag(S) @ U.T) < np.linalg.norm(F - kfac)


# ------------------------------------------------------------------ the step graph
def test_step_graph_preconditions_with_the_updated_S():
    """kfac_step (fixed lr 1, no momentum, empirical statistics): S <- (1 - c) S + c S_batch in
    the state's eigenbases, then P = U_G [(U_G^T g U_A) / (S + damping)] U_A^T, against a
    hand-written numpy backward pass of the tiny MLP."""
    model, params = _tiny_mlp(2)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False,
                      layers={"fc1": "ekfac", "fc2": "ekfac"})
    onnx_model, info = emit_subgraph(plan, "kfac_step", qmodel=False, mode="empirical")
    rng = np.random.default_rng(3)
    N, c, lam = 6, 0.3, 0.07
    x, y = rng.normal(size=(N, IN)), rng.integers(0, OUT, N)
    dims = {"fc1": (IN + 1, 4), "fc2": (5, OUT)}
    state = {k: v.astype(np.float32) for k, v in params.items()}
    for layer, (na, ng) in dims.items():
        state[f"inverse/{layer}/A_Q"] = np.linalg.qr(rng.normal(size=(na, na)))[0]
        state[f"inverse/{layer}/G_Q"] = np.linalg.qr(rng.normal(size=(ng, ng)))[0]
        state[f"inverse/{layer}/S"] = rng.uniform(0.1, 1.0, size=(ng, na))
        state[f"inverse/{layer}/damping"] = np.array(lam)
        state[f"factor/{layer}/A"], state[f"factor/{layer}/G"] = np.eye(na), np.eye(ng)
    for p, v in params.items():
        state[f"velocity/{p}"] = np.zeros_like(v)
    hp = {"hp/ema_coeff": c, "hp/learning_rate": 1.0, "hp/momentum": 0.0, "hp/norm_constraint": 0.0}
    feeds = {"input": x.astype(np.float32), "targets": y, **{k: np.array(v, np.float32) for k, v in hp.items()}}
    feeds.update({k: np.asarray(state[k], np.float32) for k in info.state_inputs})
    feeds = {k: v for k, v in feeds.items() if k in info.data_inputs + info.hp_inputs + info.state_inputs}
    sess = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    # numpy: forward, per-example gradients of [W | b] (rows outputs, columns inputs then bias)
    h = np.tanh(x @ params["fc1.weight"].T + params["fc1.bias"])
    d2 = make_loss("softmax_cross_entropy").np_grad(h @ params["fc2.weight"].T + params["fc2.bias"], y)
    d1 = (d2 @ params["fc2.weight"]) * (1 - h * h)
    per_example = {"fc1": np.einsum("no,ni->noi", d1, np.c_[x, np.ones(N)]),
                   "fc2": np.einsum("no,ni->noi", d2, np.c_[h, np.ones(N)])}
    for layer, g_n in per_example.items():
        Ua, Ug = state[f"inverse/{layer}/A_Q"].astype(np.float32).astype(np.float64), \
            state[f"inverse/{layer}/G_Q"].astype(np.float32).astype(np.float64)
        S_batch = np.mean((Ug.T @ g_n @ Ua) ** 2, axis=0)
        S = (1 - c) * state[f"inverse/{layer}/S"].astype(np.float32) + c * S_batch
        np.testing.assert_allclose(out[f"new/inverse/{layer}/S"], S, rtol=1e-4, atol=1e-6)
        g = g_n.mean(0)
        P = Ug @ ((Ug.T @ g @ Ua) / (S + lam)) @ Ua.T
        new_w, new_b = out[f"new/{layer}.weight"], out[f"new/{layer}.bias"]
        np.testing.assert_allclose(params[f"{layer}.weight"] - new_w, P[:, :-1], rtol=2e-3, atol=2e-5)
        np.testing.assert_allclose(params[f"{layer}.bias"] - new_b, P[:, -1], rtol=2e-3, atol=2e-5)
    # a data-parallel step averages S's batch statistic at a cut of its own, before the EMA the
    # preconditioner reads; inside the If of periodic statistics no cut can: refused
    staged = StagedProgram(onnx_model, info, "cpu", None)
    cut = set(info.reductions[C.STATE_STATISTICS_POINT].values())
    assert len(cut) == 2 and cut <= set(staged.stages[0].reduce_after.values())
    periodic, periodic_info = emit_subgraph(plan, "kfac_step", qmodel=False, mode="empirical", stats_if=True)
    with pytest.raises(PlanError, match=r"^layer 'fc1': .*ekfac.*cov_update_period 1.*one process$"):
        StagedProgram(periodic, periodic_info, "cpu", None)


# ------------------------------------------------------------------ training
def _batch(x, y, s, bs=64):
    idx = np.random.default_rng(s).choice(len(y), bs, replace=False)
    return {"input": x[idx]}, y[idx]


@pytest.mark.slow
def test_zoo_mlp_trains_with_ekfac_and_resumes_bit_for_bit(tmp_path):
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False,
                      config={"approximations": {"fully_connected": "ekfac"}})
    inputs, y = e.make_data(256, seed=0)
    x = inputs["input"]
    knobs = dict(inv_update_period=3, damping_adaptation_interval=2)
    straight = Trainer(plan, optimizer="kfac", seed=1, **knobs)
    blk, losses = plan_blocks(plan)["fc1"], []
    for s in range(12):
        m = straight.step(*_batch(x, y, s))
        losses.append(m["loss"])
        # S is K-FAC's eigenvalues right after a refresh (steps 1, 4, 7, 10), re-estimated otherwise
        st = straight.state()
        reset, _ = blk.numpy_inverse({"A": st["factor/fc1/A"], "G": st["factor/fc1/G"]},
                                     float(st["inverse/fc1/damping"]))
        refreshed = not np.isnan(m["inverse_group"])
        assert refreshed == (s % 3 == 0)
        assert np.allclose(st["inverse/fc1/S"], reset["S"], rtol=1e-4, atol=1e-7) == refreshed
    assert np.mean(losses[-3:]) < 0.5 * losses[0]
    first = Trainer(plan, optimizer="kfac", seed=1, **knobs)
    for s in range(8):
        first.step(*_batch(x, y, s))
    S8 = first.state()["inverse/fc1/S"].copy()
    path = first.save_checkpoint(tmp_path / "ekfac.npz")
    resumed = Trainer.load_checkpoint(path, plan)
    np.testing.assert_array_equal(resumed.state()["inverse/fc1/S"], S8)
    again = [resumed.step(*_batch(x, y, s))["loss"] for s in range(8, 12)]
    assert again == losses[8:]
    a, b = straight.state(), resumed.state()
    assert all(np.array_equal(a[k], b[k]) for k in a)
