"""TF K-FAC's remaining block variants: the depthwise conv Kronecker block (per channel),
kron_indep with diagonal factors, and any matrix power of the RNN series blocks; each against
an independent truth (brute-force Fisher, dense numpy algebra)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
import test_blocks
from kfac_compiler import linalg
from kfac_compiler.blocks import APPROXIMATIONS, make_block, series
from kfac_compiler.errors import ConfigError
from kfac_compiler.losses import make_loss
from passes.budget import DIAGONAL_STEPS
from test_blocks import _vec_feeds, conv_case, dense_series_fisher, emitted_stats, f32, fc_case, run_graph
from test_fisher_bruteforce import _statistics

C, MULT, K = 2, 2, 3  # input channels, channel multiplier, kernel size


@pytest.fixture(autouse=True)
def _own_rng(monkeypatch):
    """test_blocks' case builders draw from its module RNG: give them one of our own, so that
    test_blocks' own tests see the draws they always saw whatever runs first."""
    monkeypatch.setattr(test_blocks, "RNG", np.random.default_rng(26))


# ------------------------------------------------------------------------- depthwise kron
def _tiny_depthwise(seed: int = 0):
    """input [N, C, 3, 3] -> depthwise Conv 3x3 (C MULT outputs, bias) -> [N, C MULT] logits:
    one output position (T = 1)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(C * MULT, 1, K, K)).astype(np.float32)
    b = (0.5 * rng.normal(size=C * MULT)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["input", "dw.weight", "dw.bias"], ["y"], name="dw", group=C, kernel_shape=[K, K]),
        helper.make_node("Flatten", ["y"], ["logits"], name="flat"),
    ]
    inits = [numpy_helper.from_array(w, "dw.weight"), numpy_helper.from_array(b, "dw.bias")]
    graph = helper.make_graph(nodes, "tiny_dw", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", C, K, K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", C * MULT])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, w.astype(np.float64), b.astype(np.float64)


def _dw_logits(w, b, x):
    """numpy forward of the tiny depthwise conv for one example x [C, K, K]."""
    return np.array([(w[o, 0] * x[o // MULT]).sum() + b[o] for o in range(C * MULT)])


def _channel_fisher(w, b, x, c):
    """Exact Fisher of channel c's matrix [W_c | b_c] ([MULT, K K + 1], row-major) for one
    example: J^T F_z J. The logits are linear in the parameters, so J's column for an entry is
    the change of the logits when that entry grows by one."""
    base = _dw_logits(w, b, x)
    cols = []
    for o in range(c * MULT, (c + 1) * MULT):
        for k in range(K * K + 1):
            w2, b2 = w.copy(), b.copy()
            if k < K * K:
                w2[o, 0].flat[k] += 1.0
            else:
                b2[o] += 1.0
            cols.append(_dw_logits(w2, b2, x) - base)
    J = np.stack(cols, 1)
    return J.T @ make_loss("softmax_cross_entropy").np_fisher(base) @ J


def test_depthwise_kron_is_the_exact_fisher_of_each_channel_for_one_example():
    model, w, b = _tiny_depthwise()
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False, layers={"dw": "kron"})
    (layer,) = plan.layers
    assert (layer.kind, layer.approximation) == ("depthwise_conv", "kron")
    x = np.random.default_rng(3).normal(size=(1, C, K, K))
    stats = _statistics(plan, x, np.array([1]), "exact")
    A, G = stats["stat/dw/A"], stats["stat/dw/G"]
    assert A.shape == (C, K * K + 1, K * K + 1) and G.shape == (C, MULT, MULT)
    for c in range(C):
        np.testing.assert_allclose(np.kron(G[c], A[c]), _channel_fisher(w, b, x[0], c), rtol=1e-4, atol=1e-6)


def test_depthwise_kron_factors_are_per_channel_moments():
    """A_c, G_c from a hand loop over channels, positions and seeds (stride 2, padding)."""
    layer, blk, inputs, cots = conv_case(kind="depthwise_conv", C_in=2, C_out=6, group=2, spatial=(5, 4),
                                         strides=(2, 1), pads=(1, 0, 1, 1), N=2)
    out = emitted_stats(blk, inputs, cots)
    x = np.pad(np.asarray(inputs[0], np.float64), [(0, 0), (0, 0), (1, 1), (0, 1)])
    ds = [np.asarray(d, np.float64) for d in cots[0]]
    N, _, Ho, Wo = ds[0].shape
    mult = 3
    for c in range(2):
        A, G = 0.0, 0.0
        for n in range(N):
            for i in range(Ho):
                for j in range(Wo):
                    a = np.append(x[n, c, 2 * i:2 * i + 3, j:j + 3].reshape(-1), 1.0)
                    A = A + np.outer(a, a) / (N * Ho * Wo)
                    for d in ds:
                        g = d[n, c * mult:(c + 1) * mult, i, j]
                        G = G + np.outer(g, g) / N
        np.testing.assert_allclose(out["A"][c], A, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["G"][c], G, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_depthwise_cnn_trains_with_kron():
    from kfac_compiler.models import data, get_model
    from kfac_compiler.runtime import Trainer

    plan = kc.compile(get_model("depthwise_cnn"), loss="softmax_cross_entropy", emit=False, layers={"dwconv": "kron"})
    assert {s.name: tuple(s.shape) for s in plan.factors["dwconv"]} == {"A": (8, 10, 10), "G": (8, 1, 1)}
    x, y = data.make_image_classification(256, seed=0)
    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=64, seed=0)
    batches = [slice(i * 64, (i + 1) * 64) for i in range(4)]
    losses = [float(tr.step({"input": x["input"][batches[i % 4]]}, y[batches[i % 4]])["loss"]) for i in range(12)]
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------------------- depthwise channel_full
def test_depthwise_default_is_channel_full_the_exact_fisher_of_each_output_channel():
    """The depthwise default block (no choice given), on the compiled statistics of the tiny
    depthwise model (one position, 3 examples): block c is the mean over the examples of the
    exact Fisher of output channel c's [w_c | b_c] (finite-difference Jacobians, J^T F_z J),
    the diagonal block of the per-input-channel one."""
    assert APPROXIMATIONS["depthwise_conv"][0] == "channel_full"
    model, w, b = _tiny_depthwise()
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    (layer,) = plan.layers
    assert (layer.kind, layer.approximation) == ("depthwise_conv", "channel_full")
    x = np.random.default_rng(4).normal(size=(3, C, K, K))
    F = _statistics(plan, x, np.array([1, 0, 3]), "exact")["stat/dw/full"]
    n = K * K + 1
    assert F.shape == (C * MULT, n, n)
    for c in range(C):
        exact = np.mean([_channel_fisher(w, b, xn, c) for xn in x], axis=0)  # [MULT n, MULT n]
        for m in range(MULT):
            np.testing.assert_allclose(F[c * MULT + m], exact[m * n:(m + 1) * n, m * n:(m + 1) * n], rtol=1e-4, atol=1e-6)


CHANNEL_FULL_CASES = [
    dict(C_in=3, C_out=6, group=3, spatial=(5, 4), strides=(2, 1), pads=(1, 0, 1, 1)),  # multiplier 2
    dict(C_in=4, C_out=4, group=4, spatial=(6, 5), pads=(2, 2, 2, 2), dil=(2, 1), bias=False, uses=2, seeds=1),
    dict(C_in=2, C_out=2, group=2, k=(3,), spatial=(7,), pads=(1, 1), N=4),
]


def _brute_channel_blocks(layer, blk, inputs, cots):
    """Per-output-channel blocks [C_out, K+1, K+1] of the brute-force Fisher 1/N sum vec(g) vec(g)^T
    over per-example gradients from the conv definition (loops; summed over uses)."""
    gs = [sum(test_blocks.explicit_conv_weight_grads(np.asarray(x, np.float64), np.asarray(cots[u][s], np.float64),
                                                     layer.attrs, blk.group, blk.has_bias, blk.C_out)
              for u, x in enumerate(inputs)) for s in range(len(cots[0]))]
    F, n = test_blocks.brute_fisher(gs), blk.nK  # vec(g) of [C_out, K+1] row-major: channel c at c n .. c n + n
    return np.stack([F[c * n:(c + 1) * n, c * n:(c + 1) * n] for c in range(blk.C_out)])


@pytest.mark.parametrize("kw", CHANNEL_FULL_CASES)
def test_channel_full_is_the_brute_force_fisher_of_each_output_channel(kw):
    layer, blk, inputs, cots = conv_case(approx="channel_full", kind="depthwise_conv", **kw)
    want = _brute_channel_blocks(layer, blk, inputs, cots)
    test_blocks.assert_close(emitted_stats(blk, inputs, cots)["full"], want, what="emitted")
    test_blocks.assert_close(blk.numpy_statistics(inputs, cots)["full"], want, 1e-10, 1e-10, what="numpy")
    assert tuple(blk.factor_specs()[0].shape) == want.shape


@pytest.mark.parametrize("kw", CHANNEL_FULL_CASES[:2])
def test_channel_full_preconditions_by_a_solve_of_each_damped_channel_block(kw):
    """(F_c + lambda I)^-1 [w_c | b_c] per output channel, against numpy.linalg.solve of the
    brute-force blocks: the emitted inverse (every emitted method) and the host one."""
    layer, blk, inputs, cots = conv_case(approx="channel_full", kind="depthwise_conv", **kw)
    F, lam = _brute_channel_blocks(layer, blk, inputs, cots), 0.05
    v = _vec_feeds({p: blk.param_shapes[p] for p in layer.params})
    V = np.concatenate([np.asarray(v["W"], np.float64).reshape(blk.C_out, -1)]
                       + ([np.asarray(v["b"], np.float64)[:, None]] if blk.has_bias else []), axis=1)
    X = np.linalg.solve(F + lam * np.eye(blk.nK), V[..., None])[..., 0]
    want = {"W": X[:, :blk.K].reshape(blk.param_shapes["W"])}
    if blk.has_bias:
        want["b"] = X[:, blk.K]
    factors = {"full": f32(F)}
    state, ok = blk.numpy_inverse(factors, lam, "eigh")
    host = blk.numpy_multiply_inverse(v, state)
    assert ok
    for p in want:
        test_blocks.assert_close(host[p], want[p], 2e-3, 2e-4, what=f"host {p}")
    for method in linalg.EMITTED_METHODS:
        def build(b, method=method):
            inv = blk.emit_inverse(b, {"full": "f_full"}, "lam", method)
            out = blk.emit_multiply_inverse(b, {p: p for p in v}, inv)
            out["ok"] = inv.ok
            return out

        res = run_graph(build, {**v, "f_full": factors["full"], "lam": f32(lam)})
        assert bool(res["ok"]), method
        for p in want:
            test_blocks.assert_close(res[p], want[p], 2e-3, 2e-4, what=f"{method} {p}")


def test_depthwise_cnn_trains_with_channel_full():
    from kfac_compiler.models import data, get_model
    from kfac_compiler.runtime import Trainer

    plan = kc.compile(get_model("depthwise_cnn"), loss="softmax_cross_entropy", emit=False,
                      layers={"dwconv": "channel_full"})
    assert {s.name: tuple(s.shape) for s in plan.factors["dwconv"]} == {"full": (8, 10, 10)}
    x, y = data.make_image_classification(256, seed=0)
    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=64, seed=0)
    batches = [slice(i * 64, (i + 1) * 64) for i in range(4)]
    losses = [float(tr.step({"input": x["input"][batches[i % 4]]}, y[batches[i % 4]])["loss"]) for i in range(12)]
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------------------- kron_indep with diagonal factors
def test_kron_indep_diag_names_are_on_the_multi_use_menus_and_the_budget_steps_stay_on_them():
    for key in ("fully_connected_multi", "conv_multi"):
        menu = APPROXIMATIONS[key]
        assert {"kron_indep_in_diag", "kron_indep_out_diag", "kron_indep_both_diag"} <= set(menu)
        assert "kron_indep_in_diag" not in APPROXIMATIONS[key.replace("_multi", "")]
        for src, steps in DIAGONAL_STEPS.items():
            if src in menu and src.startswith("kron_indep"):
                assert all(t in menu and t.startswith("kron_indep") for t in steps.values())


@pytest.mark.parametrize("kind", ["fully_connected", "conv"])
@pytest.mark.parametrize("approx,a_diag,g_diag", [("kron_indep_in_diag", 1, 0), ("kron_indep_out_diag", 0, 1),
                                                  ("kron_indep_both_diag", 1, 1)])
def test_kron_indep_diag_factors_are_diagonals_of_kron_indep_and_products_match_numpy(kind, approx, a_diag, g_diag):
    if kind == "fully_connected":
        layer, shapes, inputs, cots = fc_case(approx=approx, uses=3, lead=(2,))
        full = make_block(fc_case(approx="kron_indep", uses=3)[0], shapes)
    else:
        layer, blk0, inputs, cots = conv_case(approx=approx, uses=2, C_in=3, C_out=4)
        shapes = blk0.param_shapes
        full = make_block(conv_case(approx="kron_indep", uses=2, C_in=3, C_out=4)[0], shapes)
    blk = make_block(layer, shapes)
    got, ref = emitted_stats(blk, inputs, cots), full.numpy_statistics(inputs, cots)
    A = np.diag(ref["A"]) if a_diag else ref["A"]
    G = np.diag(ref["G"]) if g_diag else ref["G"]
    np.testing.assert_allclose(got["A"], A, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["G"], G, rtol=1e-4, atol=1e-5)
    # (F + damping) v and its inverse, densely: pi split on the diagonalized factors
    lam = 0.03
    f = blk.numpy_statistics(inputs, cots)
    Ad, Gd = (np.diag(f["A"]) if a_diag else f["A"]), (np.diag(f["G"]) if g_diag else f["G"])
    pi = np.sqrt((np.trace(Ad) / len(Ad)) / (np.trace(Gd) / len(Gd)))
    Ad, Gd = Ad + pi * np.sqrt(lam) * np.eye(len(Ad)), Gd + np.sqrt(lam) / pi * np.eye(len(Gd))
    F = np.kron(Gd, Ad)  # on the row-major vec of [W | b] (rows outputs)
    v = _vec_feeds(shapes)
    x = blk.view.np_to(v).reshape(-1)
    feeds = {**v, "f_A": f32(f["A"]), "f_G": f32(f["G"]), "lam": f32(lam)}
    out = run_graph(lambda b: blk.emit_multiply(b, {p: p for p in v}, {"A": "f_A", "G": "f_G"}, "lam"), feeds)
    np.testing.assert_allclose(blk.view.np_to(out).reshape(-1), F @ x, rtol=1e-4, atol=1e-5 * np.abs(F @ x).max())
    st, ok = blk.numpy_inverse(f, lam)
    assert ok
    got_inv = blk.view.np_to(blk.numpy_multiply_inverse(v, st)).reshape(-1)
    np.testing.assert_allclose(got_inv, np.linalg.solve(F, x), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------- series: any power
def _series_case(option):
    R = 3
    layer, shapes, inputs, cots = fc_case(approx=f"kron_series_{option}", uses=R, lead=(2,), n_in=3, n_out=2, N=6)
    for u in range(1, R):  # correlated uses: the cross moments matter
        inputs[u] = f32(0.7 * inputs[u - 1] + 0.3 * inputs[u])
        cots[u] = [f32(0.5 * cots[u - 1][s] + 0.5 * cots[u][s]) for s in range(len(cots[u]))]
    blk = make_block(layer, shapes)
    return blk, shapes, blk.numpy_statistics(inputs, cots)


@pytest.mark.parametrize("option", [1, 2])
def test_series_powers_equal_the_dense_power_of_the_dense_fisher(option):
    blk, shapes, f = _series_case(option)
    lam = 0.05
    F = dense_series_fisher(blk, f, lam)  # column-major vec of [W | b]
    s, U = np.linalg.eigh(F)
    v = _vec_feeds(shapes)
    x = blk.view.np_to(v).reshape(-1, order="F")

    def vec(out):
        return blk.view.np_to(out).reshape(-1, order="F")

    def power(e):
        return (U * s**e) @ U.T @ x

    for e in (2, -2, 0.5, -0.5, 3, 0):  # host: repeated F / F^-1, or the dense eigh
        np.testing.assert_allclose(vec(blk.numpy_multiply_matpower(v, f, lam, e)), power(e), rtol=1e-7, atol=1e-9)
    # a matpower state used on its own holds its power (integer: "power" says how often)
    st2, ok = blk.numpy_matpower(f, lam, -2)
    assert ok and float(st2["power"]) == -2
    np.testing.assert_allclose(vec(blk.numpy_multiply_state(v, st2)), power(-2), rtol=1e-7, atol=1e-9)
    # ONNX: F^2 from the factors, F^-2 by the inverse state twice, F^0.5 by the dense state
    feeds = {**v, **{f"f_{k}": f32(a) for k, a in f.items()}, "lam": f32(lam)}
    inv, _ = blk.numpy_inverse(f, lam)
    half, ok = blk.numpy_matpower(f, lam, 0.5)
    assert ok and half["F_pow"].shape == (blk.nA * blk.nG,) * 2
    feeds.update({f"s_{k}": f32(a) for k, a in inv.items()})
    feeds["F_pow"] = f32(half["F_pow"])
    names = {p: p for p in v}
    got = run_graph(lambda b: {
        **{f"two_{p}": t for p, t in blk.emit_multiply_matpower(b, names, {k: f"f_{k}" for k in f}, "lam", 2).items()},
        **{f"mtwo_{p}": t for p, t in blk.emit_power(b, names, -2, state={k: f"s_{k}" for k in inv}).items()},
        **{f"half_{p}": t for p, t in blk.emit_multiply_state(b, names, {"F_pow": "F_pow"}).items()},
    }, feeds)
    for tag, e in (("two", 2), ("mtwo", -2), ("half", 0.5)):
        want = power(e)
        np.testing.assert_allclose(vec({p: got[f"{tag}_{p}"] for p in v}), want, rtol=1e-3,
                                   atol=1e-4 * np.abs(want).max(), err_msg=tag)


def test_series_powers_the_graph_cannot_hold_are_one_line_config_errors(monkeypatch):
    from kfac_compiler.builder import GraphBuilder

    blk, shapes, f = _series_case(1)
    names = {p: p for p in shapes}
    with pytest.raises(ConfigError, match="layer 'layer'.*power -2 needs eigendecompositions"):
        blk.emit_multiply_matpower(GraphBuilder(17), names, {k: k for k in f}, "lam", -2)
    with pytest.raises(ConfigError, match="power 0.5 is not an integer"):
        blk.emit_multiply_matpower(GraphBuilder(17), names, {k: k for k in f}, "lam", 0.5)
    monkeypatch.setattr(series, "DENSE_MAX", blk.nA * blk.nG - 1)
    with pytest.raises(ConfigError) as e:
        blk.numpy_matpower(f, 0.05, 0.5)
    assert "dense eigendecomposition" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_series_powers_through_the_curvature_api_on_the_unrolled_rnn():
    """The device's `multiply` subgraph at exp 2 (F twice, ONNX) equals the host's F^2, and the
    host's F^0.5 applied twice equals F, for both recurrent weights of the zoo RNN."""
    import warnings

    from kfac_compiler.models import get_entry, get_model
    from kfac_compiler.runtime import Curvature

    entry = get_entry("unrolled_rnn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kc.compile(get_model("unrolled_rnn"), loss=entry.loss, emit=False,
                          approximations={"fully_connected_multi": "kron_series_1"})
    series_layers = [l.name for l in plan.layers if l.approximation == "kron_series_1"]
    assert series_layers == ["rnn.W_x", "rnn.W_h"]
    x, y = entry.make_data(64, seed=0)
    curv = Curvature(plan)
    curv.update(x, y)
    rng = np.random.default_rng(0)
    v = {p: rng.normal(size=s).astype(np.float32) for p, s in plan.param_shapes.items() if p in plan.trainable}
    dev2 = curv.multiply_all(v, damping=0.1, exp=2)
    for name in series_layers:
        mine = {p: v[p] for p in plan.layer(name).params}
        sq = curv.multiply_matpower(name, mine, 2, damping=0.1)
        half = curv.multiply_matpower(name, curv.multiply_matpower(name, mine, 0.5, damping=0.1), 0.5, damping=0.1)
        one = curv.multiply(name, mine, damping=0.1)
        for p in mine:
            np.testing.assert_allclose(dev2[p], sq[p], rtol=1e-4, atol=1e-5 * np.abs(sq[p]).max())
            np.testing.assert_allclose(half[p], one[p], rtol=1e-5, atol=1e-6 * np.abs(one[p]).max())


def test_series_blocks_refuse_uses_of_unequal_rows_at_compile():
    """kron_series_1/2 pair each use's rows with the next use's (the cross moments A_1, G_1):
    a weight used on [N, 2, D] and on [N, 3, D] compiled and then failed inside ONNX Runtime
    (a MatMul's dimensions). Refused at compile, naming the layer, the rows and the blocks
    that take it; kron_indep trains it."""
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    rng = np.random.default_rng(0)
    D, H = 3, 4
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("Transpose", ["W"], ["Wt2"], perm=[1, 0]),
             helper.make_node("MatMul", ["x1", "Wt"], ["h1"]), helper.make_node("MatMul", ["x2", "Wt2"], ["h2"]),
             helper.make_node("Concat", ["h1", "h2"], ["hc"], axis=1), helper.make_node("Tanh", ["hc"], ["t"]),
             helper.make_node("Flatten", ["t"], ["f"]), helper.make_node("MatMul", ["f", "Wo"], ["logits"])]
    model = helper.make_model(helper.make_graph(
        nodes, "two_uses", [helper.make_tensor_value_info("x1", TensorProto.FLOAT, ["N", 2, D]),
                            helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["N", 3, D])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.normal(size=(H, D)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.normal(size=(5 * H, 3)).astype(np.float32), "Wo")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for approx in ("kron_series_1", "kron_series_2"):
        with pytest.raises(ConfigError, match=r"layer 'W': kron_series_\d pairs .* 2 and 3 rows per example; use kron_indep"):
            kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False, layers={"W": approx})
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False, layers={"W": "kron_indep"})
    x = {"x1": rng.normal(size=(4, 2, D)).astype(np.float32), "x2": rng.normal(size=(4, 3, D)).astype(np.float32)}
    assert Trainer(plan).step(x, rng.integers(0, 3, 4))["rejected"] == 0.0
