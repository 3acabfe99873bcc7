"""Inverse methods (kfac_compiler.linalg): emitted ones in ONNX Runtime and the numpy twins,
against float64 numpy/scipy references; NaN/singular guards; batching."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
from onnx import TensorProto

from helpers import run_graph, spd
from kfac_compiler import linalg
from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError


def rel_err(X, ref):
    return float(np.abs(np.asarray(X, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("method", linalg.EMITTED_METHODS)
@pytest.mark.parametrize("n,batch", [(5, ()), (17, (3,)), (33, (2, 2))])
def test_emitted_inverse_vs_float64(method, n, batch, rng):
    M = spd(rng, n, 100.0, batch)
    ref = np.linalg.inv(M)
    out = run_graph(lambda b: dict(zip(("X", "ok"), linalg.emit_inverse(b, "M", n, method))), {"M": M.astype(np.float32)})
    assert out["ok"].shape == batch and out["ok"].all()
    assert rel_err(out["X"], ref) < 1e-4
    # float64 graph: near machine precision
    out64 = run_graph(
        lambda b: dict(zip(("X", "ok"), linalg.emit_inverse(b, "M", n, method, iterations=30))),
        {"M": M},
        float_type=TensorProto.DOUBLE,
    )
    assert rel_err(out64["X"], ref) < 1e-10


@pytest.mark.parametrize("method", linalg.METHODS)
def test_numpy_inverse_methods(method, rng):
    M = spd(rng, 9, 1e3, (4,))
    X, ok = linalg.np_inverse(M, method, iterations=40)
    assert ok.all()
    assert rel_err(X, np.linalg.inv(M)) < 1e-9


def test_cholesky_and_cholesky_inverse(rng):
    M = spd(rng, 8, 50.0)
    L = linalg.np_cholesky(M)
    np.testing.assert_allclose(L, scipy.linalg.cholesky(M, lower=True), rtol=1e-10, atol=1e-12)
    Linv = linalg.np_cholesky_inverse(M)
    np.testing.assert_allclose(Linv @ L, np.eye(8), atol=1e-10)
    np.testing.assert_allclose(Linv.T @ Linv, np.linalg.inv(M), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("exp", [-1, -0.5, 0.5, 1, 2, 3])
def test_matpower_vs_scipy(exp, rng):
    M = spd(rng, 7, 20.0)
    P, ok = linalg.np_matpower(M, exp)
    assert ok
    np.testing.assert_allclose(P, np.real(scipy.linalg.fractional_matrix_power(M, exp)), rtol=1e-8, atol=1e-10)
    if exp == int(exp):
        out = run_graph(
            lambda b: dict(zip(("P", "ok"), linalg.emit_matpower_int(b, "M", 7, int(exp)))),
            {"M": M},
            float_type=TensorProto.DOUBLE,
        )
        assert out["ok"] and rel_err(out["P"], P) < 1e-10


def test_matpower_rejects_nonpositive_for_negative_powers():
    M = np.diag([1.0, 0.0, 2.0])
    _, ok = linalg.np_matpower(M, -1)
    assert not ok
    P, ok = linalg.np_matpower(M, 0.5)
    assert ok and np.allclose(P, np.diag(np.sqrt([1.0, 0.0, 2.0])))


def test_newton_schulz_warm_start(rng):
    n = 40
    M = spd(rng, n, 1e3)
    M2 = M + 1e-3 * spd(rng, n, 10.0)  # the factor moved a little
    X_prev = np.linalg.inv(M)
    cold, _ = linalg.np_newton_schulz(M2, iterations=6)
    warm, ok = linalg.np_newton_schulz(M2, iterations=6, X0=X_prev)
    ref = np.linalg.inv(M2)
    assert ok and rel_err(warm, ref) < 1e-8
    assert rel_err(cold, ref) > 1e-2  # 6 iterations are far too few from a cold start
    out = run_graph(
        lambda b: dict(zip(("X", "ok"), linalg.emit_newton_schulz(b, "M", n, "P", iterations=6))),
        {"M": M2, "P": X_prev},
        float_type=TensorProto.DOUBLE,
    )
    assert out["ok"] and rel_err(out["X"], ref) < 1e-8
    # a previous inverse that does not contract is ignored (cold start)
    bad_prev = -X_prev
    X, _ = linalg.np_newton_schulz(M2, iterations=40, X0=bad_prev)
    assert rel_err(X, ref) < 1e-8


def test_newton_schulz_twin_matches_emitted(rng):
    M = spd(rng, 12, 1e3, (2,))
    ref, _ = linalg.np_newton_schulz(M, iterations=12)
    out = run_graph(lambda b: dict(zip(("X", "ok"), linalg.emit_newton_schulz(b, "M", 12, iterations=12))), {"M": M}, float_type=TensorProto.DOUBLE)
    np.testing.assert_allclose(out["X"], ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n,cond", [(33, 3e6), (129, 1e6), (257, 1e6)])
def test_newton_schulz_ok_means_its_residual_is_within_the_bound(n, cond, rng):
    """ok promises ||M X - I||_F / sqrt(n) <= RESIDUAL_TOL (a block that fails it goes to the
    host fallback): unconverged iterations at cond ~1e6 (residuals 0.14-0.21, errors 51-69%)
    had been rated ok by a bound sqrt(n) times too loose."""
    M = spd(rng, n, cond, (3,)).astype(np.float32)
    out = run_graph(lambda b: dict(zip(("X", "ok"), linalg.emit_newton_schulz(b, "M", n))), {"M": M})
    for m, x, ok in zip(M.astype(np.float64), out["X"].astype(np.float64), out["ok"]):
        residual = np.linalg.norm(m @ x - np.eye(n)) / np.sqrt(n)
        assert not ok or residual <= linalg.RESIDUAL_TOL, residual


@pytest.mark.parametrize("method", linalg.EMITTED_METHODS)
def test_emitted_guard_nan_inf_singular(method, rng):
    M = spd(rng, 6, 10.0, (4,)).astype(np.float32)
    M[1, 2, 3] = np.nan
    M[2, 0, 0] = np.inf
    M[3] = 0.0  # singular
    out = run_graph(lambda b: dict(zip(("X", "ok"), linalg.emit_inverse(b, "M", 6, method))), {"M": M})
    assert out["ok"].tolist() == [True, False, False, False]
    assert rel_err(out["X"][0], np.linalg.inv(M[0].astype(np.float64))) < 1e-4


@pytest.mark.parametrize("method", linalg.METHODS)
def test_numpy_guard_keeps_previous(method, rng):
    M = spd(rng, 5, 10.0, (3,))
    M[1, 0, 0] = np.nan
    M[2] = np.diag([1.0, 1.0, 0.0, 1.0, 1.0])
    prev = np.stack([np.full((5, 5), float(i)) for i in range(3)])
    X, ok = linalg.np_inverse(M, method, previous=prev)
    assert ok.tolist() == [True, False, False]
    np.testing.assert_array_equal(X[1:], prev[1:])
    assert np.isfinite(X).all()


def test_emit_inverse_batch_groups_by_size(rng):
    mats = {"a": spd(rng, 4, 10.0), "b": spd(rng, 6, 10.0), "c": spd(rng, 4, 10.0, (3,)), "d": spd(rng, 6, 10.0)}
    feeds = {k: v.astype(np.float32) for k, v in mats.items()}

    def build(b):
        reqs = [linalg.InverseRequest(k, v.shape[-1], v.shape[:-2]) for k, v in mats.items()]
        res = linalg.emit_inverse_batch(b, reqs, "inverse_op")
        out = {}
        for k, (X, ok) in zip(mats, res):
            out[k], out[k + "_ok"] = X, ok
        return out

    b = GraphBuilder(17)
    build(b)
    # leaf-sized matrices share one class: the 4 x 4 ones padded to 6 x 6 with an identity block
    assert sum(n.op_type == "Inverse" for n in b.nodes) == 1
    out = run_graph(build, feeds)
    for k, v in mats.items():
        assert out[k].shape == v.shape and out[k + "_ok"].shape == v.shape[:-2]
        assert rel_err(out[k], np.linalg.inv(v)) < 1e-4
    res = linalg.np_inverse_batch(list(mats.values()), "eigh")
    for (X, ok), v in zip(res, mats.values()):
        assert ok.all() and rel_err(X, np.linalg.inv(v)) < 1e-10


def test_size_classes_pad_within_ratio():
    """A size joins a larger one's stack down to SIZE_CLASS_RATIO of it (or anything up to
    the Schur leaf, 96 rows); 100 and 96 share, 100 and 90 do not, 90, 30 and 10 do (one
    Inverse), 200 and 30 do not."""
    assert linalg.SCHUR_LEAF == 96
    assert linalg.size_classes([100, 96, 90, 30, 10]) == {100: 100, 96: 100, 90: 90, 30: 90, 10: 90}
    assert linalg.size_classes([200, 30]) == {200: 200, 30: 30}
    assert linalg.size_classes([100, 30, 10], small=48) == {100: 100, 30: 30, 10: 30}


@pytest.mark.parametrize("method", ["schur", "newton_schulz", "inverse_op"])
def test_padded_inverses_match_numpy(rng, method):
    """Matrices of sizes 97 and 100 (and a batch of 99s) inverted in one padded stack: each
    as accurate as numpy's inverse allows in float32, ok, and the stack holds one chain."""
    mats = {"a": spd(rng, 100, 30.0), "b": spd(rng, 97, 30.0), "c": spd(rng, 99, 30.0, (2,))}
    feeds = {k: v.astype(np.float32) for k, v in mats.items()}

    def build(b):
        reqs = [linalg.InverseRequest(k, v.shape[-1], v.shape[:-2]) for k, v in mats.items()]
        out = {}
        for k, (X, ok) in zip(mats, linalg.emit_inverse_batch(b, reqs, method)):
            out[k], out[k + "_ok"] = X, ok
        return out

    b = GraphBuilder(17)
    build(b)
    if method == "inverse_op":
        assert sum(n.op_type == "Inverse" for n in b.nodes) == 1
    out = run_graph(build, feeds)
    for k, v in mats.items():
        assert out[k].shape == v.shape and np.all(out[k + "_ok"])
        assert rel_err(out[k], np.linalg.inv(v)) < 1e-4


def test_cholesky_keeps_float32_and_guards(rng):
    """LAPACK potrf/potrs in the input's precision: float32 in, float32 out, accurate to
    float32 at cond 1e3; a non-positive-definite or NaN matrix is not ok and keeps previous."""
    M = spd(rng, 40, 1e3, (3,))
    X, ok = linalg.np_inverse(M.astype(np.float32), "cholesky")
    assert X.dtype == np.float32 and ok.all()
    assert rel_err(X, np.linalg.inv(M)) < 1e-4  # cond * eps32 ~ 1e-4
    np.testing.assert_array_equal(X, np.swapaxes(X, -1, -2))  # both triangles filled
    bad = M.astype(np.float32)
    bad[1] = -bad[1]  # negative definite: potrf fails
    bad[2, 4, 4] = np.nan
    prev = np.full_like(bad, 7.0)
    X, ok = linalg.np_inverse(bad, "cholesky", previous=prev)
    assert ok.tolist() == [True, False, False] and (X[1:] == 7.0).all()


def test_auto_method_is_schur_on_cpu_and_inverse_op_elsewhere():
    assert linalg.concrete_method("auto", "cpu") == "schur"
    assert linalg.concrete_method("auto", "cuda") == "schur"
    assert linalg.concrete_method("auto") == "inverse_op"  # emitting a plan: the device op
    assert linalg.concrete_method("eigh", "cuda") == "eigh"
    b = GraphBuilder(17)
    linalg.emit_inverse(b, "M", 3, "auto")
    assert [n.op_type for n in b.nodes][0] == "Inverse"


def activation_factor(n, rows=512, seed=0):
    """A damped input factor like a tanh layer's: E[a a^T] with the bias entry, entries ~0.8
    and cond ~1e3, plus the asymmetric rounding of the Gemm that accumulates it."""
    rng = np.random.default_rng(seed)
    a = np.tanh(rng.standard_normal((rows, 16)) @ rng.standard_normal((16, n - 1)) * 0.3 + 1.0)
    a = np.concatenate([a, np.ones((rows, 1))], axis=1)
    F = (a.T @ a / rows).astype(np.float32)
    F += 1e-7 * rng.standard_normal(F.shape).astype(np.float32)
    return F + np.float32(0.05) * np.eye(n, dtype=np.float32)


def test_schur_inverse_of_a_correlated_factor():
    """The schur recursion at 257 = 128 + 129 (down to blocks of at most SCHUR_LEAF rows) on
    a correlated factor: within ~cond * eps32 of the float64 inverse, ok, exactly symmetric;
    in float64 near machine precision and equal to its numpy twin. Symmetrizing every block
    inverse is what makes it so: without it the float32 error was 1e-1."""
    M = activation_factor(257)
    sym = 0.5 * (M.astype(np.float64) + M.T)
    ref = np.linalg.inv(sym)
    assert np.linalg.cond(sym) > 500
    out = run_graph(lambda b: dict(zip(("X", "ok"), linalg.emit_inverse(b, "M", 257, "schur"))), {"M": M})
    assert out["ok"] and rel_err(out["X"], ref) < 1e-3
    np.testing.assert_array_equal(out["X"], out["X"].T)
    out64 = run_graph(lambda b: {"X": linalg.emit_schur_inverse(b, "M", 257)}, {"M": sym}, float_type=TensorProto.DOUBLE)
    assert rel_err(out64["X"], ref) < 1e-10
    np.testing.assert_allclose(out64["X"], linalg.np_schur_inverse(sym), rtol=1e-8, atol=1e-10 * np.abs(ref).max())


@pytest.mark.slow
def test_schur_inverse_batched_and_guarded(rng):
    """A stack of 150 x 150 matrices (75 + 75, each a leaf): accurate where the
    matrix is SPD; a NaN or a singular matrix is not ok (the probe residual catches it)."""
    M = spd(rng, 150, 1e3, (3,)).astype(np.float32)
    M[1, 100, 3] = np.nan
    M[2, :, 140:] = 0.0
    M[2, 140:, :] = 0.0  # singular
    out = run_graph(lambda b: dict(zip(("X", "ok"), linalg.emit_inverse(b, "M", 150, "schur"))), {"M": M})
    assert out["ok"].tolist() == [True, False, False]
    assert rel_err(out["X"][0], np.linalg.inv(M[0].astype(np.float64))) < 1e-3


@pytest.mark.parametrize("cond,ok", [(1e3, True), (3e4, True), (1e5, False), (1e6, False)])
def test_schur_loses_accuracy_like_cond_squared(cond, ok, rng):
    """schur's documented limit (n = 257, float32): its probe residual grows like cond^2 eps
    and passes linalg.SCHUR_TOL up to cond ~3e4, with the inverse then within 5e-3 of the
    float64 one; beyond it the block is not ok (the runtime redoes it by host Cholesky,
    which is still accurate at 1e6)."""
    M = spd(rng, 257, cond).astype(np.float32)
    ref = np.linalg.inv(M.astype(np.float64))
    out = run_graph(lambda b: dict(zip(("X", "ok"), linalg.emit_inverse(b, "M", 257, "schur"))), {"M": M})
    assert bool(out["ok"]) == ok
    if ok:
        assert rel_err(out["X"], ref) < 5e-3
    X, chol_ok = linalg.np_inverse(M, "cholesky")
    assert chol_ok and rel_err(X, ref) < 1e-2


def test_host_methods_are_not_emitted():
    assert linalg.is_host_method("eigh") and linalg.is_host_method("cholesky")
    assert not linalg.is_host_method("inverse_op")
    with pytest.raises(ConfigError):
        linalg.emit_inverse(GraphBuilder(17), "M", 3, "eigh")
    with pytest.raises(ConfigError):
        linalg.check_method("qr")


def test_trace_mean_and_pi_batched(rng):
    A, G = spd(rng, 5, 10.0, (3,)), 3.0 * spd(rng, 4, 10.0, (3,))
    pi = linalg.np_pi(A, G)
    want = np.sqrt((np.trace(A, axis1=1, axis2=2) / 5) / (np.trace(G, axis1=1, axis2=2) / 4))
    np.testing.assert_allclose(pi, want)
    out = run_graph(lambda b: {"pi": linalg.emit_pi(b, "A", 5, "G", 4)}, {"A": A, "G": G}, float_type=TensorProto.DOUBLE)
    np.testing.assert_allclose(out["pi"], want, rtol=1e-12)
    bad = G.copy()
    bad[1, 0, 0] = np.nan
    np.testing.assert_allclose(linalg.np_pi(A, bad)[1], 1.0)


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_diagonal_and_shift_diagonal_without_an_identity(batch, rng):
    """diag(M) and M + v I (scalar v, or one per matrix) are numpy's, and the graph holds no
    n x n constant."""
    n = 6
    M = rng.standard_normal((*batch, n, n))
    v = np.asarray(rng.standard_normal(batch))
    feeds = {"M": M, "s": np.asarray(0.25), "v": v}

    def build(b):
        return {"diag": linalg.emit_diagonal(b, "M", n), "scalar": linalg.emit_shift_diagonal(b, "M", n, "s"),
                "batched": linalg.emit_add_diagonal(b, "M", n, "v", batched=True),
                "trace": linalg.emit_trace_mean(b, "M", n)}

    out = run_graph(build, feeds, float_type=TensorProto.DOUBLE)
    eye = np.eye(n)
    np.testing.assert_array_equal(out["diag"], np.diagonal(M, axis1=-2, axis2=-1))
    np.testing.assert_array_equal(out["scalar"], M + 0.25 * eye)
    np.testing.assert_array_equal(out["batched"], M + v[..., None, None] * eye)
    np.testing.assert_allclose(out["trace"], np.trace(M, axis1=-2, axis2=-1) / n, rtol=1e-14)
    b = GraphBuilder(17, taken=feeds.keys(), float_type=TensorProto.DOUBLE)
    build(b)
    assert max(int(np.prod(t.dims)) for t in b.initializers) <= 2  # scalars and shape vectors
