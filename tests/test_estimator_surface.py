"""TF K-FAC's estimator surface on real ONNX Runtime sessions: emitted matrix powers (any
integer or half-integer exp), Cholesky products, params_stats, K-FAC's precon_power and the
lower-level API's safeguards. The truths are dense numpy matrices: the block's damped
curvature assembled column by column from its products with unit vectors, raised to a power
by numpy eigh or factored by numpy Cholesky."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.errors import ConfigError, DataError
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Curvature, Trainer

IN, HID, OUT, N = 3, 4, 3, 12


def _two_layer(scale_shift: bool = False):
    """tanh MLP 3-4-3; with scale_shift the hidden activation is h * s + t (a full block)."""
    rng = np.random.default_rng(0)
    w1, b1 = rng.normal(size=(HID, IN)), rng.normal(size=HID) * 0.5
    w2, b2 = rng.normal(size=(OUT, HID)), rng.normal(size=OUT) * 0.5
    nodes = [helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("Tanh", ["h"], ["a"])]
    inits = [("fc1.weight", w1), ("fc1.bias", b1), ("fc2.weight", w2), ("fc2.bias", b2)]
    last = "a"
    if scale_shift:
        nodes += [helper.make_node("Mul", ["a", "ss.scale"], ["as"]), helper.make_node("Add", ["as", "ss.shift"], ["ab"])]
        inits += [("ss.scale", 1 + 0.1 * rng.normal(size=HID)), ("ss.shift", 0.1 * rng.normal(size=HID))]
        last = "ab"
    nodes.append(helper.make_node("Gemm", [last, "fc2.weight", "fc2.bias"], ["logits"], transB=1))
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", IN])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", OUT])],
                              [numpy_helper.from_array(v.astype(np.float32), n) for n, v in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _curvature(approx: str = "kron", scale_shift: bool = False, **kw) -> Curvature:
    plan = kc.compile(_two_layer(scale_shift), loss="softmax_cross_entropy", output="logits", emit=False,
                      config={"approximations": {"fully_connected": approx}})
    curv = Curvature(plan, mode="exact", **kw)
    rng = np.random.default_rng(1)
    for _ in range(2):
        curv.update({"input": rng.normal(size=(N, IN)).astype(np.float32)}, rng.integers(0, OUT, N))
    return curv


def _dense(curv: Curvature, layer: str, damping: float) -> tuple[np.ndarray, list[str]]:
    """The layer's damped curvature F + damping as a dense matrix over its parameters
    flattened in order, from the host product (exp = 1) with every unit vector."""
    params = curv.blocks()[layer].layer.params
    shapes = {p: curv.parameters()[p].shape for p in params}
    sizes = [int(np.prod(s)) for s in shapes.values()]
    cols = []
    for j in range(sum(sizes)):
        e = np.zeros(sum(sizes))
        e[j] = 1.0
        parts = dict(zip(params, np.split(e, np.cumsum(sizes)[:-1])))
        out = curv.multiply(layer, {p: parts[p].reshape(shapes[p]) for p in params}, damping)
        cols.append(np.concatenate([np.asarray(out[p], np.float64).ravel() for p in params]))
    return np.stack(cols, axis=1), list(params)


def _flat(vectors, params):
    return np.concatenate([np.asarray(vectors[p], np.float64).ravel() for p in params])


def _random(curv, seed=2):
    rng = np.random.default_rng(seed)
    return {p: rng.normal(size=a.shape).astype(np.float32) for p, a in curv.parameters().items()}


@pytest.mark.slow
@pytest.mark.parametrize("approx,scale_shift", [("kron", False), ("diagonal", False), ("kron", True)])
def test_emitted_powers_equal_eigh_powers_of_the_dense_block(approx, scale_shift):
    """-1/2, 1/2, -3/2 (the emitted square root) and 2 (MatMuls) in the `multiply` subgraph
    equal numpy eigh powers of the dense damped block, for Kronecker, diagonal and full blocks."""
    curv, damping = _curvature(approx, scale_shift), 1e-2
    v = _random(curv)
    dense = {layer: _dense(curv, layer, damping) for layer in curv.blocks()}
    kinds = {type(b).__name__ for b in curv.blocks().values()}
    assert ("ScaleShiftFull" in kinds) == scale_shift
    for exp in (-0.5, 0.5, -1.5, 2):
        got = curv.multiply_all(v, damping=damping, exp=exp)
        for layer, (M, params) in dense.items():
            s, U = np.linalg.eigh((M + M.T) / 2)
            want = (U * s ** exp) @ U.T @ _flat(v, params)
            err = np.abs(_flat(got, params) - want).max() / np.abs(want).max()
            assert err < 2e-4, (exp, layer, err)


def test_a_square_root_beyond_float32_falls_back_to_the_host():
    """fc1's A made ill-conditioned (eigenvalues 1 .. 1e-12, damping 1e-14; fc2 fails too, its softmax G being singular): the emitted root
    fails its probe check, the graph gives NaN for that layer and multiply_all redoes it on
    the host; the result still equals the dense block's eigh power."""
    from kfac_compiler import contract as C

    curv, damping = _curvature(damping_floor=0.0), 1e-14  # unfloored: the root must fail
    n = IN + 1
    Q, _ = np.linalg.qr(np.random.default_rng(7).normal(size=(n, n)))
    curv.store.set(C.factor("fc1", "A"), ((Q * np.logspace(0, -12, n)) @ Q.T).astype(np.float32))
    v = _random(curv)
    raw = curv.program("multiply", exp=-0.5).run(curv.store, {C.vec(p): a for p, a in v.items()},
                                                  hp={C.DAMPING: damping}, results=True)
    assert np.isnan(raw[C.product("fc1.weight")]).all()
    got = curv.multiply_all(v, damping=damping, exp=-0.5)
    M, params = _dense(curv, "fc1", damping)
    s, U = np.linalg.eigh((M + M.T) / 2)
    want = (U * s ** -0.5) @ U.T @ _flat(v, params)
    assert np.abs(_flat(got, params) - want).max() / np.abs(want).max() < 1e-3


def test_other_powers_name_the_host_way():
    curv = _curvature()
    with pytest.raises(ConfigError, match="multiply_matpower"):
        curv.multiply_all(_random(curv), damping=1e-2, exp=0.25)


def test_device_powers_are_bounded_and_an_overflow_is_named():
    """exp 3 on the device equals the dense block's cube; |exp| above MAX_DEVICE_EXP (a chain of
    |exp| - 1 float32 products: 1e6 ran for minutes, 40 overflowed) names the host way; a
    power that overflows float32 ((F + 1e6)^8 ~ 1e48) is a DivergedError naming the layer,
    not infs returned."""
    from kfac_compiler.errors import DivergedError
    from kfac_compiler.runtime.curvature import MAX_DEVICE_EXP

    curv, damping = _curvature(), 1e-2
    v = _random(curv)
    got = curv.multiply_all(v, damping=damping, exp=3)
    for layer in curv.blocks():
        M, params = _dense(curv, layer, damping)
        want = np.linalg.matrix_power(M, 3) @ _flat(v, params)
        assert np.abs(_flat(got, params) - want).max() / np.abs(want).max() < 1e-4
    for exp in (MAX_DEVICE_EXP + 1, -(MAX_DEVICE_EXP + 0.5), 1e6):
        with pytest.raises(ConfigError, match=r"above 8 .*multiply_matpower"):
            curv.multiply_all(v, damping=damping, exp=exp)
    with pytest.raises(DivergedError, match=r"multiply_all\(exp=8\): the product of layer 'fc1' is not finite"):
        curv.multiply_all(v, damping=1e6, exp=MAX_DEVICE_EXP)


def test_products_of_averages_that_saw_no_batch_are_refused():
    """Before a batch is folded in (or when every update was skipped) the moving averages are
    zeros: a product or inverse of them is the damping alone. Every method reading them says
    to call update first, in one line (update_inverses and multiply_all were a KeyError from
    inside their graphs); estimate and gradients need no averages."""
    plan = kc.compile(_two_layer(), loss="softmax_cross_entropy", output="logits", emit=False)
    curv = Curvature(plan, mode="exact")
    v = _random(curv)
    fc1 = {p: v[p] for p in ("fc1.weight", "fc1.bias")}
    calls = {"update_inverses": lambda: curv.update_inverses(1e-3), "multiply_all": lambda: curv.multiply_all(v),
             "multiply": lambda: curv.multiply("fc1", fc1),
             "multiply_matpower": lambda: curv.multiply_matpower("fc1", fc1, 2),
             "compute_cholesky": lambda: curv.compute_cholesky(1e-3),
             "compute_cholesky_inverse": lambda: curv.compute_cholesky_inverse(1e-3)}
    for name, call in calls.items():
        with pytest.raises(ConfigError, match=rf"^{name}: no batch has been folded .*call update\(inputs, targets\)"):
            call()
    x = np.random.default_rng(1).normal(size=(N, IN)).astype(np.float32)
    y = np.arange(N) % OUT
    assert np.isfinite(curv.gradients({"input": x}, y)[0]) and curv.estimate({"input": x}, y)
    x[0, 0] = 1e30  # A = x x^T overflows float32: the update is skipped, the averages stay empty
    curv.update({"input": x}, y)
    assert curv.report["skipped_updates"] == 1
    with pytest.raises(ConfigError, match=r"every update so far \(1\) was skipped"):
        curv.update_inverses(1e-3)
    x[0, 0] = 0.0
    curv.update({"input": x}, y)
    assert curv.update_inverses(1e-3)


@pytest.mark.parametrize("approx", ["kron", "diagonal"])
def test_cholesky_products_equal_numpy_cholesky(approx):
    """multiply_cholesky(_inverse) with and without transpose against numpy's Cholesky of the
    dense damped block; a Kronecker block's L is kron(L_A, L_G) of its damped factors (vec
    column-major), so L L^T v = (F + damping) v."""
    curv, damping = _curvature(approx), 3e-2
    curv.compute_cholesky(damping)
    curv.compute_cholesky_inverse(damping)
    v = _random(curv)
    outs = {(k, t): f(v, transpose=t) for k, f in (("L", curv.multiply_cholesky), ("Li", curv.multiply_cholesky_inverse))
            for t in (False, True)}
    for layer, block in curv.blocks().items():
        M, params = _dense(curv, layer, damping)
        x = _flat(v, params)
        if approx == "kron":  # the dense operator's own Cholesky factor in our vec order
            parts = block.np_cholesky_parts(curv.factors()[layer], damping)
            L_A, L_G = parts["A"], parts["G"]
            np.testing.assert_allclose(np.kron(L_A @ L_A.T, L_G @ L_G.T), np.kron(*[block._np_damped(
                curv.factors()[layer], damping)[k] for k in ("A", "G")]), rtol=1e-5, atol=1e-8)
            # the view: params (W [out, in], b [out]) <-> X [out, in+1]; vec column-major
            L = np.kron(L_A, L_G)
            perm = np.array([c * OUT + r if layer == "fc2" else c * HID + r
                             for r, c in _param_order(layer)])
            L = L[np.ix_(perm, perm)]
        else:
            L = np.linalg.cholesky(M)
        want = {("L", False): L @ x, ("L", True): L.T @ x,
                ("Li", False): np.linalg.solve(L, x), ("Li", True): np.linalg.solve(L.T, x)}
        for key, w in want.items():
            np.testing.assert_allclose(_flat(outs[key], params), w, rtol=2e-4, atol=1e-5 * np.abs(w).max())
        # L L^T v = (F + damping) v
        LLt = curv.multiply_cholesky(curv.multiply_cholesky(v, transpose=True))
        np.testing.assert_allclose(_flat(LLt, params), M @ x, rtol=1e-4, atol=1e-5 * np.abs(M @ x).max())


def _param_order(layer):
    """(row, col) of X = [W | b] for each flattened parameter entry (W row-major, then b)."""
    n_out, n_in = (HID, IN) if layer == "fc1" else (OUT, HID)
    return [(r, c) for r in range(n_out) for c in range(n_in)] + [(r, n_in) for r in range(n_out)]


def test_params_stats_is_the_empirical_gradient():
    curv = _curvature()
    rng = np.random.default_rng(5)
    x, y = {"input": rng.normal(size=(N, IN)).astype(np.float32)}, rng.integers(0, OUT, N)
    with pytest.raises(ConfigError, match="empirical"):
        curv.compute_params_stats(x, y)
    emp = Curvature(curv.plan, mode="empirical")
    stats = emp.compute_params_stats(x, y)
    _, grads = emp.gradients(x, y)
    for p in grads:
        np.testing.assert_array_equal(stats[p], grads[p])


@pytest.mark.slow
@pytest.mark.parametrize("power", [-0.5, -0.75])
def test_precon_power_first_step_is_the_numpy_matrix_power(power):
    """precon_power with a fixed learning rate and no momentum: the first update is
    -lr (F + damping)^p g, F the damped Kronecker blocks of the first batch's factors
    (-1/2: the emitted power_update; -3/4: host eigh, numpy_power_state)."""
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0, hidden=(16,)), loss=e.loss, output="logits", emit=False)
    inputs, y = e.make_data(None, seed=0)
    batch, yb = {"input": inputs["input"][:32]}, y[:32]
    lr, damping = 0.05, 1e-2
    curv = Curvature(plan, mode="exact")
    curv.update(batch, yb)
    _, g = curv.gradients(batch, yb)
    want = {}
    for layer, block in curv.blocks().items():
        want.update(curv.multiply_matpower(layer, {p: g[p] for p in block.layer.params}, power, damping))
    tr = Trainer(plan, optimizer="kfac", precon_power=power, learning_rate=lr, momentum=0.0, damping=damping,
                 min_damping=1e-4, adapt_damping=False, mode="exact", stats_batch_size=None)
    before = {p: tr.store.to_numpy(p) for p in tr.params}
    losses = [tr.step(batch, yb)["loss"]]
    for p in tr.params:
        step = before[p] - tr.store.to_numpy(p)
        np.testing.assert_allclose(step, lr * want[p], rtol=2e-3, atol=2e-4 * np.abs(lr * want[p]).max())
    losses += [tr.step(batch, yb)["loss"] for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("model,menu,approx", [("unrolled_rnn", "fully_connected_multi", "kron_series_1"),
                                               ("mlp_classifier", "fully_connected", "ekfac")])
@pytest.mark.slow
def test_precon_power_is_refused_by_a_block_without_it(model, menu, approx):
    e = ZOO[model]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False,
                      config={"approximations": {menu: approx}})
    with pytest.raises(ConfigError, match=f"'{approx}' block .*precon_power -0.5"):
        Trainer(plan, optimizer="kfac", precon_power=-0.5)
    with pytest.raises(ConfigError, match="precon_power"):
        Trainer(plan, optimizer="kfac", precon_power=0.5)


def _foreign_loop(curv, x, y, lr, steps, damping=1e-2):
    """The issue's loop: numpy gradients, update, update_inverses, precondition, params -= lr P."""
    params, oks = curv.parameters(), []
    for s in range(steps):
        idx = np.random.default_rng([0, s]).choice(len(y), 64, replace=False)
        xb, yb = {"input": x[idx]}, y[idx]
        _, g = curv.gradients(xb, yb)
        curv.update(xb, yb)
        oks.append(curv.update_inverses(damping))
        P = curv.precondition(g)
        params = {p: params[p] - lr * P[p] for p in params}
        curv.set_parameters(params)
    return oks


@pytest.mark.slow
def test_foreign_loop_with_damping_1e2_stays_finite_with_the_floor_and_stops_cleanly_without():
    """Reproduced (issue 26): a numpy loop at damping 1e-2 and lr 3 overshoots (nothing checks
    the step's quadratic model, as K-FAC's Trainer does), the logits and so the factors grow
    to ~1e12, damping 1e-2 no longer keeps them invertible in float32 (refreshes fail from
    step 3 on) and the next steps overflow into NaN. With the damping floor (default 1e-6
    times the largest block scale) the damping grows with the factors, every refresh
    succeeds and the loop stays finite; without it (damping_floor=0) the failed refresh is
    named in the report and the loop stops at the first NaN gradient with a one-line
    DataError from precondition, before NaN reaches the parameters."""
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
    inputs, y = e.make_data(None, seed=0)
    floored = Curvature(plan)
    assert all(_foreign_loop(floored, inputs["input"], y, 3.0, 12))
    assert np.isfinite(np.concatenate([a.ravel() for a in floored.parameters().values()])).all()
    assert floored.report["damping_floored"] and floored.report["damping_used"] > 10.0
    bare = Curvature(plan, damping_floor=0.0)
    with pytest.raises(DataError, match="precondition: the vector for .* NaN/Inf"):
        _foreign_loop(bare, inputs["input"], y, 3.0, 12)
    assert bare.report["failed_blocks"] and bare.report["damping_used"] == 1e-2
    assert np.isfinite(np.concatenate([a.ravel() for a in bare.parameters().values()])).all()


def test_products_use_the_floored_damping_like_the_stored_inverses():
    """With the floor active (damping 1e-6 below damping_floor 0.1 times the largest block
    scale), multiply_all(v, d, -1), the Cholesky products and precondition(v) after
    update_inverses(d) all use max(d, floor * scale), scale recomputed here from the factors'
    traces, and equal the dense block's solve at that damping."""
    curv, d = _curvature(damping_floor=0.1), 1e-6
    scale = max(np.trace(f["A"]) / len(f["A"]) * np.trace(f["G"]) / len(f["G"]) for f in curv.factors().values())
    assert curv.update_inverses(d) and curv.report["damping_floored"]
    used = curv.report["damping_used"]
    np.testing.assert_allclose(used, 0.1 * scale, rtol=1e-5)
    v = _random(curv)
    pre = curv.precondition(v)
    prod = curv.multiply_all(v, damping=d, exp=-1)
    assert curv.report["product_damping_used"] == used
    curv.compute_cholesky_inverse(d)
    chol = curv.multiply_cholesky_inverse(curv.multiply_cholesky_inverse(v), transpose=True)  # L^-T L^-1 v
    curv.damping_floor = 0.0  # the truth: the dense block at the floored damping, unfloored
    unfloored = curv.multiply_all(v, damping=d, exp=-1)
    for layer in curv.blocks():
        M, params = _dense(curv, layer, used)
        want = np.linalg.solve(M, _flat(v, params))
        for got in (pre, prod, chol):
            np.testing.assert_allclose(_flat(got, params), want, rtol=2e-3, atol=1e-4 * np.abs(want).max())
        assert np.abs(_flat(unfloored, params) - want).max() > 0.1 * np.abs(want).max()


def test_a_sane_foreign_loop_is_unchanged_by_the_floor():
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
    inputs, y = e.make_data(None, seed=0)
    curv = Curvature(plan)
    assert all(_foreign_loop(curv, inputs["input"], y, 0.1, 3))
    assert curv.report["damping_used"] == 1e-2 and not curv.report["damping_floored"]
    assert curv.report["skipped_updates"] == 0 and curv.report["last_update_ok"] is True


@pytest.mark.parametrize("model,menu,approx,why", [
    ("unrolled_rnn", "fully_connected_multi", "kron_series_1", "a series"),
    ("unrolled_rnn", "fully_connected_multi", "kron_series_2", "a series"),
    ("mlp_classifier", "fully_connected", "ekfac", "damps its eigenvalues exactly")])
@pytest.mark.slow
def test_cholesky_is_refused_by_series_and_ekfac_blocks(model, menu, approx, why):
    """Their F + damping is not the product of two damped factors (the series adds A_1, G_1
    terms; EKFAC damps S exactly), so compute_cholesky(_inverse) refuses in one line naming the
    layer instead of returning KronBlock's L_A (x) L_G; the symmetric root it names instead
    squares to the block's own (F + damping) v."""
    e = ZOO[model]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False,
                      config={"approximations": {menu: approx}})
    curv = Curvature(plan, mode="exact")
    inputs, y = e.make_data(None, seed=0)
    curv.update({k: a[:16] for k, a in inputs.items()}, y[:16])
    layer = next(name for name, b in curv.blocks().items() if b.name == approx)
    for compute in (curv.compute_cholesky, curv.compute_cholesky_inverse):
        with pytest.raises(ConfigError, match=f"^layer '{layer}': the '{approx}' block has no .*Cholesky.*{why}"
                                              ".*multiply_matpower") as err:
            compute(1e-2)
        assert "\n" not in str(err.value) and "damping_mode" not in str(err.value)
    params = curv.blocks()[layer].layer.params
    v = {p: a for p, a in _random(curv).items() if p in params}
    root = curv.multiply_matpower(layer, curv.multiply_matpower(layer, v, 0.5, 1e-2), 0.5, 1e-2)
    want = curv.multiply(layer, v, 1e-2)
    np.testing.assert_allclose(_flat(root, params), _flat(want, params), rtol=1e-4,
                               atol=1e-5 * np.abs(_flat(want, params)).max())


def test_half_powers_of_a_grouped_conv_equal_the_host_powers():
    """A grouped conv's Kronecker factors are [groups, n, n], and the emitted square root's
    check is one flag per group: Where(ok [2], P [2, n, n], NaN) did not broadcast and
    multiply_all(v, exp=+-0.5) failed inside ONNX Runtime. Now it equals the host's float64
    eigh power (multiply_matpower) of the same damped factors."""
    rng = np.random.default_rng(0)
    inits = {"k": rng.normal(size=(4, 2, 3, 3)), "kb": rng.normal(size=4) * 0.1, "w": rng.normal(size=(3, 4 * 9)) * 0.3}
    nodes = [helper.make_node("Conv", ["input", "k", "kb"], ["c"], group=2), helper.make_node("Tanh", ["c"], ["t"]),
             helper.make_node("Flatten", ["t"], ["f"]), helper.make_node("Gemm", ["f", "w"], ["logits"], transB=1)]
    model = helper.make_model(helper.make_graph(
        nodes, "grouped", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 5, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    curv = Curvature(plan, mode="exact")
    curv.update({"input": rng.normal(size=(8, 4, 5, 5)).astype(np.float32)}, rng.integers(0, 3, 8))
    conv = next(name for name, block in curv.blocks().items() if "k" in block.layer.params)
    v = _random(curv)
    mine = {p: v[p] for p in curv.blocks()[conv].layer.params}
    for exp in (0.5, -0.5):
        got = curv.multiply_all(v, damping=1e-2, exp=exp)
        want = curv.multiply_matpower(conv, mine, exp, damping=1e-2)
        for p in mine:
            np.testing.assert_allclose(got[p], want[p], rtol=1e-3, atol=1e-4 * np.abs(want[p]).max())


def test_block_scales_follow_each_blocks_structure():
    """block_scales (the damping floor's reference) is the block's np_scale: a diagonal
    block's mean over every entry (it had taken the largest row mean: 0.0505 for 0.0359), a
    Kronecker block's product of trace means, and a tied embedding's Kronecker product of its
    combined factors (a kron_tied layer had made update_inverses and multiply a KeyError 'A'
    with the default floor). Truths from the stored factors with numpy."""
    curv = _curvature("diagonal")
    for layer, f in curv.factors().items():
        assert curv.block_scales()[layer] == pytest.approx(np.mean(f["diag"], dtype=np.float64), rel=1e-6)
    curv = _curvature("kron")
    for layer, f in curv.factors().items():
        want = np.trace(f["A"]) / len(f["A"]) * np.trace(f["G"]) / len(f["G"])
        assert curv.block_scales()[layer] == pytest.approx(want, rel=1e-5)
    rng = np.random.default_rng(0)
    V, D, T = 6, 3, 3
    nodes = [helper.make_node("Gather", ["E", "ids"], ["x"], axis=0), helper.make_node("MatMul", ["x", "Wm"], ["u"]),
             helper.make_node("Tanh", ["u"], ["h"]), helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Et"], ["logits"])]
    model = helper.make_model(helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", T])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", T, V])],
        [numpy_helper.from_array(rng.normal(size=(V, D)).astype(np.float32), "E"),
         numpy_helper.from_array(rng.normal(size=(D, D)).astype(np.float32), "Wm")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for approx in ("kron_tied", "kron_tied_vocab_diag"):
        plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False, layers={"E": approx})
        tied = Curvature(plan)  # the default damping floor
        tied.update({"ids": rng.integers(0, V, (6, T))}, rng.integers(0, V, (6, T)))
        combined = tied.blocks()["E"].np_combined(tied.factors()["E"])
        A, G = (np.asarray(combined[k], np.float64) for k in ("A", "G"))
        mean_a = A.mean() if A.ndim == 1 else np.trace(A) / len(A)
        assert tied.block_scales()["E"] == pytest.approx(mean_a * np.trace(G) / len(G), rel=1e-5)
        assert tied.update_inverses(1e-3)
        assert np.isfinite(tied.multiply("E", {"E": np.ones((V, D), np.float32)}, damping=1e-3)["E"]).all()


@pytest.mark.slow
def test_a_power_state_beyond_float32_is_not_written():
    """precon_power -50: (F + damping)^-50 is finite in float64 and overflows float32; the
    refresh reports it not ok and writes nothing non-finite (inf had been written into the
    inverse slots, reported ok, and every step reading them rejected)."""
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0, hidden=(16,)), loss=e.loss, output="logits", emit=False)
    inputs, y = e.make_data(None, seed=0)
    tr = Trainer(plan, optimizer="kfac", precon_power=-50.0, threads=1)
    m = tr.step({"input": inputs["input"][:32]}, y[:32])
    assert m["inverse_ok"] == 0.0
    assert all(np.all(np.isfinite(v)) for v in tr.state().values())
