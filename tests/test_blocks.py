"""Fisher blocks: emitted statistics (run in ONNX Runtime) against independent numpy
computations from the definitions, brute-force per-example Fisher blocks, inverse/multiply
round trips, damping and the NaN guard."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import TensorProto

from helpers import f32, run_graph  # noqa: F401 - other test files import them from here
from kfac_compiler import linalg
from kfac_compiler.blocks import APPROXIMATIONS, BLOCK_CLASSES, emit_inverses, make_block, numpy_inverses
from kfac_compiler.blocks._parts import emit_statistic
from kfac_compiler.builder import GraphBuilder
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import Layer, LayerUse

# the case builders' generator: conftest restarts it for every test (other files import the builders)
RNG = np.random.default_rng(1234)


# ------------------------------------------------------------------------- harness
def stat_tensors(b, stats):
    """emit_statistics' values as tensors (GramStatistic operands multiplied out)."""
    return {k: emit_statistic(b, v) for k, v in stats.items()}


def with_ok(state):
    """emit_inverse's InverseState as a plain dict with its flag under "ok"."""
    assert "ok" not in state and state.ok
    return {**state, "ok": state.ok}


def make_layer(kind, params, n_uses=1, approximation="kron", **attrs):
    uses = tuple(LayerUse((f"node{u}",), f"in{u}", f"out{u}") for u in range(n_uses))
    return Layer("layer", kind, tuple(params), uses, attrs=attrs, approximation=approximation)


def emitted_stats(blk, inputs, cots, opset=17):
    feeds = {f"x{u}": x for u, x in enumerate(inputs)}
    feeds.update({f"d{u}_{s}": d for u, ds in enumerate(cots) for s, d in enumerate(ds)})
    names_in = [f"x{u}" for u in range(len(inputs))]
    names_cot = [[f"d{u}_{s}" for s in range(len(ds))] for u, ds in enumerate(cots)]
    return run_graph(lambda b: stat_tensors(b, blk.emit_statistics(b, names_in, names_cot)), feeds, opset)


def assert_close(a, b, rtol=1e-4, atol=1e-5, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=what)


# ------------------------------------------------------------------------- cases
def fc_case(approx="kron", layout="out_in", bias=True, n_in=5, n_out=4, lead=(3,), uses=1, seeds=2, N=6, alpha=1.0, beta=1.0):
    wshape = (n_out, n_in) if layout == "out_in" else (n_in, n_out)
    params = ("W", "b") if bias else ("W",)
    shapes = {"W": wshape, "b": (n_out,)}
    attrs = {"weight_layout": layout}
    if alpha != 1.0:
        attrs["alpha"] = alpha
    if beta != 1.0:
        attrs["beta"] = beta
    layer = make_layer("fully_connected", params, uses, approx, **attrs)
    inputs = [f32(RNG.standard_normal((N, *lead, n_in))) for _ in range(uses)]
    cots = [[f32(RNG.standard_normal((N, *lead, n_out))) for _ in range(seeds)] for _ in range(uses)]
    return layer, {p: shapes[p] for p in params}, inputs, cots


def fc_tilde(x, n_in, alpha, beta, bias):
    x = alpha * np.asarray(x, np.float64).reshape(x.shape[0], -1, n_in)
    if bias:
        x = np.concatenate([x, np.full((*x.shape[:2], 1), beta)], axis=2)
    return x  # [N, T, in+1]


def fc_reference(layer, shapes, inputs, cots):
    """Kronecker factors straight from the definitions (einsum over n, t, uses, seeds)."""
    W = shapes["W"]
    n_in, n_out = (W[1], W[0]) if layer.attrs["weight_layout"] == "out_in" else W
    al, be = layer.attrs.get("alpha", 1.0), layer.attrs.get("beta", 1.0)
    bias = len(layer.params) > 1
    xs = [fc_tilde(x, n_in, al, be, bias) for x in inputs]
    N, T, R = xs[0].shape[0], xs[0].shape[1], len(xs)
    A = sum(np.einsum("nti,ntj->ij", x, x) for x in xs) / (N * T * R)
    ds64 = [np.asarray(d, np.float64).reshape(N, T, n_out) for ds in cots for d in ds]
    G = sum(np.einsum("nti,ntj->ij", d, d) for d in ds64) / N
    return A, G


def per_example_fc_grads(layer, shapes, inputs, cots, s):
    """[N, out, in+1] per-example gradients of [W | b] for seed s (summed over t, uses)."""
    W = shapes["W"]
    n_in, n_out = (W[1], W[0]) if layer.attrs["weight_layout"] == "out_in" else W
    al, be = layer.attrs.get("alpha", 1.0), layer.attrs.get("beta", 1.0)
    bias = len(layer.params) > 1
    g = 0.0
    for u, x in enumerate(inputs):
        xt = fc_tilde(x, n_in, al, be, bias)
        d = np.asarray(cots[u][s], np.float64).reshape(xt.shape[0], -1, n_out)
        g = g + np.einsum("nto,nti->noi", d, xt)
    return g


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(layout="in_out"),
        dict(bias=False),
        dict(lead=()),
        dict(lead=(2, 3), seeds=1),
        dict(alpha=0.5, beta=2.0, layout="in_out"),
        dict(uses=3, approx="kron_indep"),
    ],
)
def test_fc_kron_statistics(kw):
    layer, shapes, inputs, cots = fc_case(**kw)
    blk = make_block(layer, shapes)
    out = emitted_stats(blk, inputs, cots)
    A, G = fc_reference(layer, shapes, inputs, cots)
    assert_close(out["A"], A, what="A")
    assert_close(out["G"], G, what="G")
    twin = blk.numpy_statistics(inputs, cots)
    assert_close(twin["A"], A, 1e-10, 1e-10)
    assert_close(twin["G"], G, 1e-10, 1e-10)
    assert [s.shape for s in blk.factor_specs()] == [A.shape, G.shape]


@pytest.mark.parametrize("opset", [13, 15, 18, 21])
def test_fc_kron_statistics_opsets(opset):
    layer, shapes, inputs, cots = fc_case(layout="in_out")
    out = emitted_stats(make_block(layer, shapes), inputs, cots, opset=opset)
    A, G = fc_reference(layer, shapes, inputs, cots)
    assert_close(out["A"], A)
    assert_close(out["G"], G)


def test_hand_computed_A():
    layer = make_layer("fully_connected", ("W", "b"), weight_layout="in_out")
    blk = make_block(layer, {"W": (2, 3), "b": (3,)})
    x = f32([[1, 2], [3, 4]])
    out = emitted_stats(blk, [x], [[f32(np.ones((2, 3)))]])
    np.testing.assert_allclose(out["A"], [[5, 7, 2], [7, 10, 3], [2, 3, 1]], rtol=1e-6)


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_linear_single_example_is_exact_fisher_block(layout):
    layer, shapes, inputs, cots = fc_case(layout=layout, lead=(), N=1, seeds=1)
    out = emitted_stats(make_block(layer, shapes), inputs, cots)
    g = per_example_fc_grads(layer, shapes, inputs, cots, 0)[0]  # [out, in+1]
    v = g.reshape(-1, order="F")  # vec of [W | b], column-major
    np.testing.assert_allclose(np.kron(out["A"], out["G"]), np.outer(v, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("approx,a_diag,g_diag", [("kron_in_diag", 1, 0), ("kron_out_diag", 0, 1), ("kron_both_diag", 1, 1)])
def test_fc_kron_diag_variants(approx, a_diag, g_diag):
    layer, shapes, inputs, cots = fc_case(approx=approx)
    out = emitted_stats(make_block(layer, shapes), inputs, cots)
    A, G = fc_reference(layer, shapes, inputs, cots)
    assert_close(out["A"], np.diag(A) if a_diag else A)
    assert_close(out["G"], np.diag(G) if g_diag else G)


def brute_fisher(grads_per_seed):
    """1/N sum_{s,n} vec(g) vec(g)^T from per-example gradients [N, ...] per seed."""
    F = 0.0
    for g in grads_per_seed:
        v = g.reshape(g.shape[0], -1)
        F = F + v.T @ v / g.shape[0]
    return F


@pytest.mark.parametrize("kw", [dict(), dict(layout="in_out", lead=()), dict(uses=2, lead=(2,)), dict(bias=False)])
def test_fc_diagonal_is_brute_force_diagonal(kw):
    layer, shapes, inputs, cots = fc_case(approx="diagonal", **kw)
    blk = make_block(layer, shapes)
    out = emitted_stats(blk, inputs, cots)
    gs = [per_example_fc_grads(layer, shapes, inputs, cots, s) for s in range(len(cots[0]))]
    F = brute_fisher(gs)
    assert_close(out["diag"], np.diag(F).reshape(gs[0].shape[1:]))
    assert_close(blk.numpy_statistics(inputs, cots)["diag"], np.diag(F).reshape(gs[0].shape[1:]), 1e-10, 1e-10)


# ------------------------------------------------------------------------- conv
def conv_case(approx="kron", kind="conv", C_in=4, C_out=6, k=(3, 3), spatial=(6, 5), strides=None, pads=None, dil=None, group=1, bias=True, uses=1, seeds=2, N=3):
    nd = len(k)
    attrs = dict(kernel_shape=list(k), strides=list(strides or [1] * nd), pads=list(pads or [0] * 2 * nd), dilations=list(dil or [1] * nd), group=group)
    params = ("W", "b") if bias else ("W",)
    shapes = {"W": (C_out, C_in // group, *k), "b": (C_out,)}
    layer = make_layer(kind, params, uses, approx, **attrs)
    blk = make_block(layer, {p: shapes[p] for p in params})
    inputs = [f32(RNG.standard_normal((N, C_in, *spatial))) for _ in range(uses)]
    out_sp = blk._out_sizes(list(spatial))
    cots = [[f32(RNG.standard_normal((N, C_out, *out_sp))) for _ in range(seeds)] for _ in range(uses)]
    return layer, blk, inputs, cots


def explicit_patches(x, attrs, group, bias):
    """Patch loop straight from the conv definition: [N, group, K(+1), T]."""
    N, C_in, *sp = x.shape
    k, s, d, p = attrs["kernel_shape"], attrs["strides"], attrs["dilations"], attrs["pads"]
    nd = len(k)
    out = [(sp[i] + p[i] + p[i + nd] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(nd)]
    Cg = C_in // group
    K = Cg * int(np.prod(k))
    T = int(np.prod(out))
    P = np.zeros((N, group, K + int(bias), T))
    for n in range(N):
        for t, o in enumerate(itertools.product(*[range(m) for m in out])):
            for j in range(group):
                row = 0
                for c in range(Cg):
                    for off in itertools.product(*[range(m) for m in k]):
                        pos = [o[i] * s[i] + off[i] * d[i] - p[i] for i in range(nd)]
                        if all(0 <= pos[i] < sp[i] for i in range(nd)):
                            P[n, j, row, t] = x[(n, j * Cg + c, *pos)]
                        row += 1
                if bias:
                    P[n, j, K, t] = 1.0
    return P


CONV_CASES = [
    dict(),
    dict(strides=(2, 1), pads=(1, 0, 0, 2), dil=(1, 2)),
    dict(group=2, pads=(1, 1, 1, 1)),
    dict(k=(3,), spatial=(7,), strides=(2,), pads=(1, 1), bias=False),
    dict(k=(2, 2, 2), spatial=(3, 4, 3), C_in=2, C_out=3, N=2),
    dict(uses=2, approx="kron_indep", seeds=1),
    dict(kind="depthwise_conv", C_in=3, C_out=6, group=3, pads=(1, 1, 1, 1)),  # per-channel factors
]


@pytest.mark.parametrize("kw", CONV_CASES)
def test_conv_kron_statistics(kw):
    layer, blk, inputs, cots = conv_case(**kw)
    out = emitted_stats(blk, inputs, cots)
    g, bias = blk.group, blk.has_bias
    Ps = [explicit_patches(np.asarray(x, np.float64), layer.attrs, g, bias) for x in inputs]
    N, T = Ps[0].shape[0], sum(P.shape[3] for P in Ps)
    A = sum(np.einsum("njat,njbt->jab", P, P) for P in Ps) / (N * T)
    Co_g = blk.Co_g
    G = 0.0
    for ds in cots:
        for d in ds:
            d = np.asarray(d, np.float64).reshape(N, g, Co_g, -1)
            G = G + np.einsum("njat,njbt->jab", d, d) / N
    if g == 1:
        A, G = A[0], G[0]
    assert_close(out["A"], A, what="A")
    assert_close(out["G"], G, what="G")
    twin = blk.numpy_statistics(inputs, cots)
    assert_close(twin["A"], A, 1e-10, 1e-10)
    assert_close(twin["G"], G, 1e-10, 1e-10)
    assert tuple(blk.factor_specs()[0].shape) == A.shape


@pytest.mark.parametrize("approx,a_diag,g_diag", [("kron_in_diag", 1, 0), ("kron_out_diag", 0, 1), ("kron_both_diag", 1, 1)])
@pytest.mark.parametrize("kw", [dict(), dict(group=2, pads=(1, 1, 1, 1)), dict(uses=2, seeds=1, strides=(2, 1))])
def test_conv_kron_diag_variants_keep_the_diagonals_of_the_kfc_factors(approx, a_diag, g_diag, kw):
    layer, blk, inputs, cots = conv_case(approx=approx, **kw)
    full = conv_case(**kw)[1]  # the same geometry with both factors full (checked above against loops)
    ref = full.numpy_statistics(inputs, cots)
    out = emitted_stats(blk, inputs, cots)

    def diag(M):
        return np.diagonal(M, axis1=-2, axis2=-1)

    for name, d in (("A", a_diag), ("G", g_diag)):
        want = diag(ref[name]) if d else ref[name]
        assert_close(out[name], want, what=name)
        assert_close(blk.numpy_statistics(inputs, cots)[name], want, 1e-10, 1e-10)
        spec = {s.name: s for s in blk.factor_specs()}[name]
        assert tuple(spec.shape) == want.shape
    # the preconditioning's FLOPs by hand: G X A per group, X [C_out/g, K + 1]
    g, nG, nA = blk.group, blk.Co_g, blk.nK
    fa = nG * nA if a_diag else 2 * nG * nA * nA
    fg = nG * nA if g_diag else 2 * nG * nG * nA
    assert blk.apply_flops() == g * (fa + fg)


def explicit_conv_weight_grads(x, d, attrs, group, bias, C_out):
    """Per-example gradients [N, C_out, K(+1)] from the conv definition (loops)."""
    P = explicit_patches(x, attrs, group, bias)  # [N, g, K+1, T]
    N = x.shape[0]
    Co_g = C_out // group
    d = d.reshape(N, group, Co_g, -1)
    g = np.zeros((N, C_out, P.shape[2]))
    for n in range(N):
        for j in range(group):
            for o in range(Co_g):
                g[n, j * Co_g + o] = (P[n, j] * d[n, j, o][None, :]).sum(axis=1)
    return g


@pytest.mark.parametrize(
    "kw",
    [
        dict(approx="diagonal"),
        dict(approx="diagonal", group=2, strides=(2, 2), pads=(1, 1, 1, 1)),
        dict(approx="diagonal", kind="depthwise_conv", C_in=4, C_out=8, group=4, pads=(1, 1, 1, 1)),
        dict(approx="diagonal", uses=2, seeds=1, bias=False),
    ],
)
def test_conv_diagonal_is_brute_force_diagonal(kw):
    layer, blk, inputs, cots = conv_case(**kw)
    out = emitted_stats(blk, inputs, cots)
    gs = []
    for s in range(len(cots[0])):
        g = sum(
            explicit_conv_weight_grads(np.asarray(x, np.float64), np.asarray(cots[u][s], np.float64), layer.attrs, blk.group, blk.has_bias, blk.C_out)
            for u, x in enumerate(inputs)
        )
        gs.append(g)
    F = brute_fisher(gs)
    assert_close(out["diag"], np.diag(F).reshape(gs[0].shape[1:]))


def test_conv_kron_single_example_exact():
    """Conv with one output location and N=1: A (x) G is the exact per-example Fisher."""
    layer, blk, inputs, cots = conv_case(spatial=(3, 3), N=1, seeds=1)
    out = emitted_stats(blk, inputs, cots)
    g = explicit_conv_weight_grads(np.asarray(inputs[0], np.float64), np.asarray(cots[0][0], np.float64), layer.attrs, 1, True, blk.C_out)[0]
    v = g.reshape(-1, order="F")
    np.testing.assert_allclose(np.kron(out["A"], out["G"]), np.outer(v, v), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- embedding
@pytest.mark.parametrize("opset", [13, 17])
def test_embedding_kron(opset):
    vocab, dim, N = 7, 5, 4
    layer = make_layer("embedding", ("E",), 2, "kron", vocab=vocab, dim=dim)
    blk = make_block(layer, {"E": (vocab, dim)})
    idx = [RNG.integers(0, vocab, size=(N, 3)).astype(np.int64), RNG.integers(0, vocab, size=(N, 3)).astype(np.int64)]
    cots = [[f32(RNG.standard_normal((N, 3, dim)))] for _ in range(2)]
    out = emitted_stats(blk, idx, cots, opset=opset)
    counts = np.zeros(vocab)
    for x in idx:
        for v in x.reshape(-1):
            counts[v] += 1
    assert_close(out["A"], counts / (N * 3 * 2))
    G = sum(np.einsum("nti,ntj->ij", d[0], d[0]) for d in cots) / N
    assert_close(out["G"], G)
    # one example, one index: diag(A) (x) G is the exact Fisher of the gathered row
    blk1 = make_block(make_layer("embedding", ("E",), 1, "kron", vocab=vocab, dim=dim), {"E": (vocab, dim)})
    x1, d1 = np.array([[3]], np.int64), f32(RNG.standard_normal((1, 1, dim)))
    o1 = emitted_stats(blk1, [x1], [[d1]])
    grad = np.zeros((dim, vocab))  # [W]^T layout: [dim, vocab]
    grad[:, 3] = d1.reshape(-1)
    v = grad.reshape(-1, order="F")
    np.testing.assert_allclose(np.kron(np.diag(o1["A"]), o1["G"]), np.outer(v, v), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- scale and shift
def ss_case(approx, normalization=None, shape=(4, 3, 5), scale_axes=None, pshape=None, shift=True, uses=1, seeds=2, extra=None):
    params = ("s", "t") if shift else ("s",)
    attrs = {"normalization": normalization}
    if scale_axes is not None:
        attrs["scale_axes"] = scale_axes
    if extra:
        attrs.update(extra)
    layer = make_layer("scale_and_shift", params, uses, approx, **attrs)
    pshape = pshape or (shape[-1],)
    blk = make_block(layer, {"s": pshape, "t": pshape})
    inputs = [f32(RNG.standard_normal(shape)) for _ in range(uses)]
    cots = [[f32(RNG.standard_normal(shape)) for _ in range(seeds)] for _ in range(uses)]
    return layer, blk, inputs, cots


def ss_brute(xhats, cots, red_axes, shift):
    gs = []
    for s in range(len(cots[0])):
        g = 0.0
        for u, xh in enumerate(xhats):
            d = np.asarray(cots[u][s], np.float64)
            parts = [(xh * d).sum(axis=red_axes).reshape(d.shape[0], -1)]
            if shift:
                parts.append(d.sum(axis=red_axes).reshape(d.shape[0], -1))
            g = g + np.concatenate(parts, axis=1)
        gs.append(g)
    return brute_fisher(gs)


def ln_ref(x, axis, eps):
    x = np.asarray(x, np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    mu = x.mean(axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axes, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


@pytest.mark.parametrize("approx", ["full", "diagonal"])
@pytest.mark.parametrize(
    "kw,red",
    [
        (dict(), (1,)),  # Mul+Add, scale on the last axis, rank unknown (trailing layout)
        (dict(scale_axes=[1], pshape=(3, 1), shape=(4, 3, 5)), (2,)),  # leading layout
        (dict(scale_axes=[-3], pshape=(3, 1, 1), shape=(4, 3, 2, 2)), (2, 3)),
        (dict(shift=False, uses=2, seeds=1), (1,)),
        (dict(scale_axes=[1, -1], pshape=(3, 5), extra={"input_shape": (None, 3, 2, 5)}, shape=(4, 3, 2, 5)), (2,)),
    ],
)
def test_scale_shift_plain(approx, kw, red):
    layer, blk, inputs, cots = ss_case(approx, **kw)
    out = emitted_stats(blk, inputs, cots)
    F = ss_brute([np.asarray(x, np.float64) for x in inputs], cots, red, blk.shift is not None)
    key = "full" if approx == "full" else "diag"
    assert_close(out[key], F if approx == "full" else np.diag(F))
    assert_close(blk.numpy_statistics(inputs, cots)[key], F if approx == "full" else np.diag(F), 1e-10, 1e-10)


@pytest.mark.parametrize("opset", [13, 17])
def test_scale_shift_layernorm(opset):
    norm = {"op": "LayerNormalization", "axis": -1, "epsilon": 1e-5}
    layer, blk, inputs, cots = ss_case("full", normalization=norm)
    out = emitted_stats(blk, inputs, cots, opset=opset)
    F = ss_brute([ln_ref(x, -1, 1e-5) for x in inputs], cots, (1,), True)
    assert_close(out["full"], F, rtol=1e-3, atol=1e-4)


def test_scale_shift_batchnorm():
    C = 3
    mean, var = f32(RNG.standard_normal(C)), f32(RNG.uniform(0.5, 2.0, C))
    norm = {"op": "BatchNormalization", "mean": "bn_mean", "var": "bn_var", "epsilon": 1e-5}
    layer, blk, inputs, cots = ss_case("diagonal", normalization=norm, shape=(4, C, 2, 3), pshape=(C,))
    feeds = {"x0": inputs[0], "d0_0": cots[0][0], "d0_1": cots[0][1], "bn_mean": mean, "bn_var": var}
    out = run_graph(lambda b: stat_tensors(b, blk.emit_statistics(b, ["x0"], [["d0_0", "d0_1"]])), feeds)
    xh = (np.asarray(inputs[0], np.float64) - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5)
    F = ss_brute([xh], cots, (2, 3), True)
    assert_close(out["diag"], np.diag(F))
    blk.set_norm_values(mean=mean, var=var)
    assert_close(blk.numpy_statistics(inputs, cots)["diag"], np.diag(F), 1e-6, 1e-6)


# ------------------------------------------------------------------------- generic
@pytest.mark.parametrize("approx", ["diagonal", "full"])
@pytest.mark.parametrize("M", [5, 1])
def test_generic(approx, M):
    shapes = {"p": (3, 2), "q": (4,)}
    layer = make_layer("generic", ("p", "q"), 1, approx)
    blk = make_block(layer, shapes)
    cots = [[f32(RNG.standard_normal((M, *shapes[p]))) for _ in range(2)] for p in ("p", "q")]
    out = emitted_stats(blk, [], cots)
    gs = [np.concatenate([np.asarray(cots[0][s], np.float64).reshape(M, -1), np.asarray(cots[1][s], np.float64).reshape(M, -1)], 1) for s in range(2)]
    F = brute_fisher(gs)
    assert_close(out["full" if approx == "full" else "diag"], F if approx == "full" else np.diag(F))


# ------------------------------------------------------------------------- all blocks: inverse round trip
def all_block_cases():
    cases = []
    for approx in ("kron", "kron_in_diag", "kron_out_diag", "kron_both_diag", "diagonal"):
        cases.append((f"fc-{approx}", lambda a=approx: fc_case(approx=a, layout="in_out")))
    cases.append(("fc-kron_indep", lambda: fc_case(approx="kron_indep", uses=3)))
    cases.append(("fc-kron_series_1", lambda: fc_case(approx="kron_series_1", uses=4, lead=(2,))))
    cases.append(("fc-kron_series_2", lambda: fc_case(approx="kron_series_2", uses=4, lead=(2,))))
    cases.append(("fc-diagonal-multi", lambda: fc_case(approx="diagonal", uses=3)))
    cases.append(("fc-kron_indep_in_diag", lambda: fc_case(approx="kron_indep_in_diag", uses=3)))
    cases.append(("fc-kron_indep_out_diag", lambda: fc_case(approx="kron_indep_out_diag", uses=2)))

    def conv(**kw):
        layer, blk, inputs, cots = conv_case(**kw)
        return layer, {p: blk.param_shapes[p] for p in layer.params}, inputs, cots

    cases.append(("conv-kron", lambda: conv()))
    cases.append(("conv-kron-group", lambda: conv(group=2)))
    cases.append(("conv-kron_indep", lambda: conv(approx="kron_indep", uses=2)))
    cases.append(("conv-diagonal", lambda: conv(approx="diagonal")))
    cases.append(("conv-kron_in_diag", lambda: conv(approx="kron_in_diag")))
    cases.append(("conv-kron_both_diag-group", lambda: conv(approx="kron_both_diag", group=2)))
    cases.append(("fc-ekfac", lambda: fc_case(approx="ekfac", layout="in_out")))
    cases.append(("fc-ekfac-multi", lambda: fc_case(approx="ekfac", uses=3)))
    cases.append(("conv-ekfac-group", lambda: conv(approx="ekfac", group=2)))
    cases.append(("depthwise-diagonal", lambda: conv(approx="diagonal", kind="depthwise_conv", C_in=4, C_out=4, group=4)))
    cases.append(("depthwise-kron", lambda: conv(approx="kron", kind="depthwise_conv", C_in=3, C_out=6, group=3)))
    cases.append(("depthwise-channel_full", lambda: conv(approx="channel_full", kind="depthwise_conv", C_in=3, C_out=6,
                                                         group=3, pads=(1, 1, 1, 1))))
    cases.append(("conv-kron_indep_both_diag", lambda: conv(approx="kron_indep_both_diag", uses=2)))
    cases.append(("conv-kron_indep_in_diag", lambda: conv(approx="kron_indep_in_diag", uses=2, group=2)))

    def emb():
        layer = make_layer("embedding", ("E",), 1, "kron", vocab=6, dim=3)
        return layer, {"E": (6, 3)}, [RNG.integers(0, 6, size=(8, 5)).astype(np.int64)], [[f32(RNG.standard_normal((8, 5, 3)))]]

    cases.append(("embedding-kron", emb))

    def tied(a):
        # a table used by two lookups and a head (Gemm alpha 0.5), two seeds
        layer = make_layer("tied_embedding", ("E",), 3, a, vocab=6, dim=3,
                           use_kinds=("embedding", "fully_connected", "embedding"), alphas=(1.0, 0.5, 1.0))
        inputs = [RNG.integers(0, 6, size=(8, 5)).astype(np.int64), f32(RNG.standard_normal((8, 5, 3))),
                  RNG.integers(0, 6, size=(8, 2)).astype(np.int64)]
        cots = [[f32(RNG.standard_normal((8, t, w))) for _ in range(2)] for t, w in ((5, 3), (5, 6), (2, 3))]
        return layer, {"E": (6, 3)}, inputs, cots

    for approx in ("kron_tied", "kron_tied_vocab_diag", "diagonal"):
        cases.append((f"tied-{approx}", lambda a=approx: tied(a)))
    for approx in ("full", "diagonal"):

        def ss(a=approx):
            layer, blk, inputs, cots = ss_case(a)
            return layer, {"s": (5,), "t": (5,)}, inputs, cots

        cases.append((f"scale_shift-{approx}", ss))

        def gen(a=approx):
            shapes = {"p": (3, 2), "q": (4,)}
            layer = make_layer("generic", ("p", "q"), 1, a)
            return layer, shapes, [], [[f32(RNG.standard_normal((6, *shapes[p])))] for p in ("p", "q")]

        cases.append((f"generic-{approx}", gen))
    return cases


CASES = all_block_cases()


def test_every_registered_block_has_a_case():
    covered = {name.split("-")[1] for name, _ in CASES}
    assert {n for n, _ in BLOCK_CLASSES} <= covered
    for kind, names in APPROXIMATIONS.items():
        for n in names:
            assert (n, kind.replace("_multi", "")) in BLOCK_CLASSES


def _vec_feeds(shapes):
    return {p: f32(RNG.standard_normal(s)) for p, s in shapes.items()}


@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_multiply_inverse_of_multiply_is_identity(name, case):
    layer, shapes, inputs, cots = case()
    blk = make_block(layer, shapes)
    f64 = blk.numpy_statistics(inputs, cots)
    factors = {k: f32(v) for k, v in f64.items()}
    lam = 0.05
    v = _vec_feeds(shapes)
    # numpy twins, float64
    st, ok = blk.numpy_inverse(f64, lam, "eigh")
    assert ok
    back = blk.numpy_multiply_inverse(blk.numpy_multiply(v, f64, lam), st)
    for p in shapes:
        assert_close(back[p], v[p], 1e-8, 1e-9, what=p)
    st, ok = blk.numpy_inverse(factors, lam, "eigh")  # float32 factors -> float32 state
    assert ok and all(x.dtype == np.float32 for x in st.values())
    # emitted: (F + lam) v in ONNX, then the inverse (emitted or host state), in ONNX
    feeds = dict(v)
    feeds.update({f"f_{k}": x for k, x in factors.items()})
    feeds["lam"] = f32(lam)
    fnames = {k: f"f_{k}" for k in factors}
    host = blk.inverse_is_host(linalg.DEFAULT_METHOD)
    if host:
        feeds.update({f"s_{k}": f32(x) for k, x in st.items()})

    def build(b):
        mv = blk.emit_multiply(b, {p: p for p in shapes}, fnames, "lam")
        if host:
            inv = {k: f"s_{k}" for k in st}
        else:
            inv = blk.emit_inverse(b, fnames, "lam", linalg.DEFAULT_METHOD)
        out = blk.emit_multiply_inverse(b, mv, inv)
        out.update({f"mv_{p}": t for p, t in mv.items()})
        if getattr(inv, "ok", None):
            out["ok"] = inv.ok
        return out

    res = run_graph(build, feeds)
    mv_np = blk.numpy_multiply(v, factors, lam)
    for p in shapes:
        assert_close(res[f"mv_{p}"], mv_np[p], 2e-4, 2e-4, what=f"multiply {p}")
        assert_close(res[p], v[p], 2e-3, 2e-3, what=f"round trip {p}")
    if "ok" in res:
        assert bool(res["ok"])
    assert {s.name for s in blk.inverse_specs()} == set(st)
    for s in blk.inverse_specs():
        assert tuple(st[s.name].shape) == tuple(s.shape)
    assert blk.stats_flops(8) > 0 and blk.inverse_flops() > 0


EMITTED_CASES = [c for c in CASES if "series" not in c[0] and "ekfac" not in c[0]]  # their inverses are host-side


@pytest.mark.slow
@pytest.mark.parametrize("name,case", EMITTED_CASES, ids=[c[0] for c in EMITTED_CASES])
def test_emitted_inverse_matches_numpy_and_guards_nan(name, case):
    layer, shapes, inputs, cots = case()
    blk = make_block(layer, shapes)
    factors = {k: f32(v) for k, v in blk.numpy_statistics(inputs, cots).items()}
    lam = 0.1
    ref, ok = blk.numpy_inverse(factors, lam, "eigh")
    assert ok
    prev = {k: f32(RNG.standard_normal(np.shape(x))) for k, x in ref.items()}
    bad = dict(factors)
    first = next(iter(bad))
    bad[first] = bad[first].copy()
    bad[first].flat[0] = np.nan
    for method in linalg.EMITTED_METHODS:
        for fac, expect_ok in ((factors, True), (bad, False)):
            feeds = {f"f_{k}": x for k, x in fac.items()}
            feeds.update({f"p_{k}": x for k, x in prev.items()})
            feeds["lam"] = f32(lam)
            out = run_graph(
                lambda b, fac=fac, method=method: with_ok(blk.emit_inverse(b, {k: f"f_{k}" for k in fac}, "lam", method, {k: f"p_{k}" for k in prev})),
                feeds,
            )
            assert bool(out["ok"]) == expect_ok, (method, expect_ok)
            for k in ref:
                want = ref[k] if expect_ok else prev[k]
                assert np.isfinite(out[k]).all()
                assert_close(out[k], want, 2e-3, 2e-4, what=f"{method} {k}")
        # host twin of the guard
        st, ok2 = blk.numpy_inverse(bad, lam, "eigh", prev)
        assert not ok2 and all(np.array_equal(st[k], prev[k]) for k in prev)


def test_emitted_inverse_without_previous_falls_back_to_identity():
    layer, shapes, inputs, cots = fc_case()
    blk = make_block(layer, shapes)
    f = {k: f32(v) for k, v in blk.numpy_statistics(inputs, cots).items()}
    f["G"][0, 0] = np.inf
    out = run_graph(lambda b: with_ok(blk.emit_inverse(b, {"A": "A", "G": "G"}, "lam", "inverse_op")), {"A": f["A"], "G": f["G"], "lam": f32(0.1)})
    assert not bool(out["ok"])
    np.testing.assert_array_equal(out["A_inv"], np.eye(6))
    np.testing.assert_array_equal(out["G_inv"], np.eye(4))


def test_singular_factor_without_damping_is_flagged():
    layer, shapes, _, _ = fc_case()
    blk = make_block(layer, shapes)
    A = np.zeros((6, 6), np.float32)
    A[0, 0] = 1.0  # rank one, zero damping: singular
    G = np.eye(4, dtype=np.float32)
    prev = {"A_inv": np.full((6, 6), 2.0, np.float32), "G_inv": np.full((4, 4), 3.0, np.float32)}
    for method in linalg.EMITTED_METHODS:
        out = run_graph(
            lambda b, method=method: with_ok(blk.emit_inverse(b, {"A": "A", "G": "G"}, "lam", method, {"A_inv": "pa", "G_inv": "pg"})),
            {"A": A, "G": G, "lam": f32(0.0), "pa": prev["A_inv"], "pg": prev["G_inv"]},
        )
        assert not bool(out["ok"]), method
        np.testing.assert_array_equal(out["A_inv"], prev["A_inv"])
    st, ok = blk.numpy_inverse({"A": A, "G": G}, 0.0, "cholesky", prev)
    assert not ok and np.array_equal(st["A_inv"], prev["A_inv"])


def test_pi_damping_split():
    layer, shapes, inputs, cots = fc_case(layout="in_out")
    blk = make_block(layer, shapes)
    f = blk.numpy_statistics(inputs, cots)
    A, G, lam = f["A"], f["G"], 0.3
    pi = np.sqrt((np.trace(A) / A.shape[0]) / (np.trace(G) / G.shape[0]))
    dA, dG = linalg.np_damping_split(A, G, lam)
    np.testing.assert_allclose([dA, dG], [pi * np.sqrt(lam), np.sqrt(lam) / pi])
    np.testing.assert_allclose(dA * dG, lam)
    out = run_graph(
        lambda b: dict(zip(("dA", "dG"), linalg.emit_damping_split(b, "A", 6, "G", 4, "lam"))),
        {"A": f32(A), "G": f32(G), "lam": f32(lam)},
    )
    np.testing.assert_allclose([out["dA"], out["dG"]], [dA, dG], rtol=1e-5)
    # the damped block: (A + dA I) (x) (G + dG I)
    st, _ = blk.numpy_inverse(f, lam, "eigh")
    dense = np.kron(A + dA * np.eye(6), G + dG * np.eye(4))
    np.testing.assert_allclose(np.kron(st["A_inv"], st["G_inv"]), np.linalg.inv(dense), rtol=1e-6, atol=1e-8)
    # guard: a zero factor gives pi = 1
    np.testing.assert_allclose(linalg.np_pi(np.zeros((3, 3)), G), 1.0)
    z = run_graph(lambda b: {"pi": linalg.emit_pi(b, "A", 3, "G", 4)}, {"A": np.zeros((3, 3), np.float32), "G": f32(G)})
    assert float(z["pi"]) == 1.0
    # diagonal factors use the mean of the diagonal
    np.testing.assert_allclose(linalg.np_pi(np.diag(A), G, a_diag=True), pi)


def test_exact_damping():
    layer, shapes, inputs, cots = fc_case(layout="in_out")
    blk = make_block(layer, shapes, damping_mode="exact")
    assert blk.inverse_is_host("inverse_op")
    f = blk.numpy_statistics(inputs, cots)
    lam = 0.05
    st, ok = blk.numpy_inverse(f, lam)
    assert ok
    v = _vec_feeds(shapes)
    X = blk.view.np_to(v)
    dense = np.kron(f["A"], f["G"]) + lam * np.eye(X.size)
    want = np.linalg.solve(dense, X.reshape(-1, order="F")).reshape(X.shape, order="F")
    got = blk.view.np_to(blk.numpy_multiply_inverse(v, st))
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    feeds = dict(v)
    feeds.update({k: f32(x) for k, x in st.items()})
    out = run_graph(lambda b: blk.emit_multiply_inverse(b, {p: p for p in v}, {k: k for k in st}), feeds)
    np.testing.assert_allclose(blk.view.np_to(out), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError):
        run_graph(lambda b: blk.emit_inverse(b, {"A": "A", "G": "G"}, "lam", "inverse_op"), {"A": f32(f["A"]), "G": f32(f["G"]), "lam": f32(lam)})


@pytest.mark.parametrize("exp", [-1, 1, 2, -2])
def test_matpower(exp):
    layer, shapes, inputs, cots = fc_case(layout="in_out")
    blk = make_block(layer, shapes)
    f = blk.numpy_statistics(inputs, cots)
    lam = 0.1
    dA, dG = linalg.np_damping_split(f["A"], f["G"], lam)
    dense = np.kron(f["A"] + dA * np.eye(6), f["G"] + dG * np.eye(4))
    v = _vec_feeds(shapes)
    X = blk.view.np_to(v)
    s, U = np.linalg.eigh(dense)
    want = ((U * s**exp) @ U.T @ X.reshape(-1, order="F")).reshape(X.shape, order="F")
    got = blk.view.np_to(blk.numpy_multiply_matpower(v, f, lam, exp))
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    feeds = dict(v)
    feeds.update({"A": f32(f["A"]), "G": f32(f["G"]), "lam": f32(lam)})
    out = run_graph(lambda b: blk.emit_multiply_matpower(b, {p: p for p in v}, {"A": "A", "G": "G"}, "lam", exp), feeds)
    assert_close(blk.view.np_to(out), want, 1e-3, 1e-4)


def test_fractional_matpower_host_state():
    layer, shapes, inputs, cots = fc_case(layout="out_in")
    blk = make_block(layer, shapes)
    f = blk.numpy_statistics(inputs, cots)
    state, ok = blk.numpy_matpower(f, 0.1, -0.5)
    assert ok
    v = _vec_feeds(shapes)
    twice = blk.numpy_multiply_state(blk.numpy_multiply_state(v, state), state)
    want = blk.numpy_multiply_matpower(v, f, 0.1, -1)
    for p in v:
        np.testing.assert_allclose(twice[p], want[p], rtol=1e-8, atol=1e-10)
    feeds = dict(v)
    feeds.update({k: f32(x) for k, x in state.items()})
    out = run_graph(lambda b: blk.emit_multiply_state(b, {p: p for p in v}, {k: k for k in state}), feeds)
    ref = blk.numpy_multiply_state(v, state)
    for p in v:
        assert_close(out[p], ref[p], 1e-4, 1e-5)
    # half-integer powers are emitted (the coupled Newton-Schulz square root); others are host-only
    fed = {**v, "A": f32(f["A"]), "G": f32(f["G"]), "lam": f32(0.1)}
    out = run_graph(lambda b: blk.emit_multiply_matpower(b, {p: p for p in v}, {"A": "A", "G": "G"}, "lam", -0.5), fed)
    for p in v:
        assert_close(out[p], ref[p], 1e-4, 1e-5)
    with pytest.raises(ConfigError):
        run_graph(lambda b: blk.emit_multiply_matpower(b, {p: p for p in v}, {"A": "A", "G": "G"}, "lam", 0.25), fed)


def test_batched_inverses_across_blocks_match_single():
    blocks, feeds = [], {}
    for i, kw in enumerate([dict(n_in=4, n_out=4), dict(n_in=4, n_out=5), dict(n_in=3, n_out=4)]):
        layer, shapes, inputs, cots = fc_case(**kw)
        blk = make_block(layer, shapes)
        f = blk.numpy_statistics(inputs, cots)
        blocks.append((blk, f))
        feeds.update({f"b{i}_{k}": f32(x) for k, x in f.items()})
    feeds["lam"] = f32(0.1)
    for method in linalg.EMITTED_METHODS:

        def build(b, method=method):
            items = [(blk, {k: f"b{i}_{k}" for k in f}, "lam", None) for i, (blk, f) in enumerate(blocks)]
            states = emit_inverses(b, items, method)
            out = {}
            for i, st in enumerate(states):
                out.update({f"{i}_{k}": t for k, t in with_ok(st).items()})
            return out

        b = GraphBuilder(17)
        build(b)
        n_inverse = sum(1 for n in b.nodes if n.op_type == "Inverse")
        if method == "inverse_op":
            # A: 5, 5, 4; G: 4, 5, 4 -> one Inverse: leaf-sized matrices share a size class (the
            # 4 x 4 ones padded to 5 x 5 with an identity block, linalg.size_classes)
            assert n_inverse == 1
        out = run_graph(build, feeds)
        for i, (blk, f) in enumerate(blocks):
            ref, _ = blk.numpy_inverse(f, 0.1, "eigh")
            assert bool(out[f"{i}_ok"])
            for k in ref:
                assert_close(out[f"{i}_{k}"], ref[k], 2e-3, 1e-4, what=f"{method} {i} {k}")


# ------------------------------------------------------------------------- RNN series blocks
def dense_series_fisher(blk, f, lam):
    """The LGGM Fisher written out densely from its definition (no eigen tricks)."""
    R = blk.R
    dA, dG = linalg.np_damping_split(f["A"], f["G"], lam)
    A = f["A"] + dA * np.eye(blk.nA)
    G = f["G"] + dG * np.eye(blk.nG)
    A1, G1 = f["A_1"], f["G_1"]
    if blk.option == 1:
        A1, G1 = (A1 + A1.T) / 2, (G1 + G1.T) / 2
    V0 = np.kron(A, G) / R  # per-use covariance V_0 = A_0 (x) G_0
    Psi = np.kron(A1 @ np.linalg.inv(A), G1 @ np.linalg.inv(G))
    if blk.option == 1:  # finite R: sum_{r,s} V_{r-s}
        F = R * V0
        P = np.eye(len(V0))
        for d in range(1, R):
            P = P @ Psi
            F = F + (R - d) * (P @ V0 + V0 @ P.T)
        return F
    n = len(V0)  # R -> inf: R * sum_d V_d = R (I - Psi)^-1 (V0 - Psi V0 Psi^T) (I - Psi^T)^-1
    S = V0 - Psi @ V0 @ Psi.T
    Minv = np.linalg.inv(np.eye(n) - Psi)
    return R * Minv @ S @ Minv.T


@pytest.mark.parametrize("option", [1, 2])
def test_series_blocks(option):
    R, N, T = 4, 6, 2
    layer, shapes, inputs, cots = fc_case(approx=f"kron_series_{option}", uses=R, lead=(T,), n_in=3, n_out=3, N=N)
    # correlate consecutive uses so that the cross moments matter
    for u in range(1, R):
        inputs[u] = f32(0.7 * inputs[u - 1] + 0.3 * inputs[u])
        cots[u] = [f32(0.5 * cots[u - 1][s] + 0.5 * cots[u][s]) for s in range(len(cots[u]))]
    blk = make_block(layer, shapes)
    out = emitted_stats(blk, inputs, cots)
    xs = [fc_tilde(x, 3, 1.0, 1.0, True) for x in inputs]
    A1 = sum(np.einsum("nti,ntj->ij", xs[u + 1], xs[u]) for u in range(R - 1)) / (N * T * (R - 1))
    G1 = sum(np.einsum("nti,ntj->ij", cots[u + 1][s], cots[u][s]) for u in range(R - 1) for s in range(2)) / N * R / (R - 1)
    A, G = fc_reference(layer, shapes, inputs, cots)
    for k, want in (("A", A), ("G", G), ("A_1", A1), ("G_1", G1)):
        assert_close(out[k], want, what=k)
    f = blk.numpy_statistics(inputs, cots)
    lam = 0.05
    F = dense_series_fisher(blk, f, lam)
    v = _vec_feeds(shapes)
    X = blk.view.np_to(v)
    x = X.reshape(-1, order="F")
    st, ok = blk.numpy_inverse(f, lam)
    assert ok
    got = blk.view.np_to(blk.numpy_multiply(v, f, lam)).reshape(-1, order="F")
    np.testing.assert_allclose(got, F @ x, rtol=1e-6, atol=1e-8)
    got = blk.view.np_to(blk.numpy_multiply_inverse(v, st)).reshape(-1, order="F")
    np.testing.assert_allclose(got, np.linalg.solve(F, x), rtol=1e-6, atol=1e-8)
    # emitted multiply (ONNX, Inverse op, truncated series for option 2) vs numpy
    feeds = dict(v)
    feeds.update({f"f_{k}": f32(a) for k, a in f.items()})
    feeds["lam"] = f32(lam)
    res = run_graph(lambda b: blk.emit_multiply(b, {p: p for p in v}, {k: f"f_{k}" for k in f}, "lam"), feeds)
    assert_close(blk.view.np_to(res).reshape(-1, order="F"), F @ x, 1e-3, 1e-4)
    with pytest.raises(ConfigError):
        blk.emit_inverse(GraphBuilder(17), {k: k for k in f}, "lam", "inverse_op")
    # NaN factor: previous state kept, flagged
    bad = dict(f)
    bad["A_1"] = bad["A_1"].copy()
    bad["A_1"][0, 0] = np.nan
    st2, ok2 = blk.numpy_inverse(bad, lam, previous=st)
    assert not ok2 and all(np.array_equal(st2[k], st[k]) for k in st)


def test_series_reduces_to_indep_without_cross_moments():
    layer, shapes, inputs, cots = fc_case(approx="kron_series_1", uses=3)
    blk = make_block(layer, shapes)
    f = blk.numpy_statistics(inputs, cots)
    f["A_1"], f["G_1"] = np.zeros_like(f["A"]), np.zeros_like(f["G"])
    ind = make_block(fc_case(approx="kron_indep", uses=3)[0], shapes)
    v = _vec_feeds(shapes)
    for blk_ in (blk, make_block(fc_case(approx="kron_series_2", uses=3)[0], shapes)):
        a = blk_.numpy_multiply(v, f, 0.1)
        b = ind.numpy_multiply(v, {"A": f["A"], "G": f["G"]}, 0.1)
        for p in v:
            np.testing.assert_allclose(a[p], b[p], rtol=1e-8, atol=1e-10)


def test_registry_and_errors():
    layer, shapes, _, _ = fc_case()
    with pytest.raises(ConfigError):
        make_block(Layer("l", "conv", ("W",), layer.uses, approximation="kron_series_1"), {"W": (2, 2, 1, 1)})
    with pytest.raises(ConfigError):
        make_block(layer, shapes, damping_mode="bogus")
    with pytest.raises(ConfigError):
        make_block(make_layer("fully_connected", ("W",), 1, "kron_series_1", weight_layout="in_out"), {"W": (2, 2)})
    with pytest.raises(ConfigError):
        linalg.check_method("svd")


DERIVED = (
    "emit_multiply", "emit_multiply_inverse", "emit_multiply_state", "emit_multiply_matpower",
    "numpy_multiply", "numpy_multiply_inverse", "numpy_multiply_state", "numpy_multiply_matpower",
)


def test_multiplies_derive_from_the_power_hook():
    """Every block implements emit_power / numpy_power only; the multiplies are the base's."""
    from kfac_compiler.blocks import FisherBlock

    for (name, kind), cls in BLOCK_CLASSES.items():
        assert cls.emit_power is not FisherBlock.emit_power and cls.numpy_power is not FisherBlock.numpy_power
        for method in DERIVED:
            assert getattr(cls, method) is getattr(FisherBlock, method), (name, kind, method)


def test_numpy_inverses_across_blocks_match_single():
    items = []
    for _name, case in CASES:
        layer, shapes, inputs, cots = case()
        blk = make_block(layer, shapes)
        f = blk.numpy_statistics(inputs, cots)
        items.append((blk, f, 0.07, None))
    for method in ("eigh", "cholesky"):
        batched = numpy_inverses(items, method)
        for (blk, f, lam, _), (st, ok) in zip(items, batched):
            ref, ok_ref = blk.numpy_inverse(f, lam, method)
            assert ok and ok_ref
            for k in ref:
                np.testing.assert_allclose(st[k], ref[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,case", EMITTED_CASES, ids=[c[0] for c in EMITTED_CASES])
def test_emitted_matpower_matches_numpy(name, case):
    layer, shapes, inputs, cots = case()
    blk = make_block(layer, shapes)
    f = blk.numpy_statistics(inputs, cots)
    v = _vec_feeds(shapes)
    feeds = {**{p: np.asarray(x, np.float64) for p, x in v.items()}, **{f"f_{k}": x for k, x in f.items()}, "lam": np.float64(0.1)}
    for exp in (2, -1):
        want = blk.numpy_multiply_matpower(v, f, 0.1, exp)
        out = run_graph(
            lambda b, exp=exp: blk.emit_multiply_matpower(b, {p: p for p in v}, {k: f"f_{k}" for k in f}, "lam", exp),
            feeds,
            float_type=TensorProto.DOUBLE,
        )
        for p in v:
            assert_close(out[p], want[p], 1e-9, 1e-10, what=f"{exp} {p}")


def test_float64_graph_statistics_and_inverse():
    layer, shapes, inputs, cots = conv_case(group=2)
    blk = make_block(layer, {p: blk_shape for p, blk_shape in [("W", (6, 2, 3, 3)), ("b", (6,))]})
    x64 = [np.asarray(x, np.float64) for x in inputs]
    d64 = [[np.asarray(d, np.float64) for d in ds] for ds in cots]
    feeds = {"x0": x64[0], "d0_0": d64[0][0], "d0_1": d64[0][1], "lam": np.float64(0.01)}

    def build(b):
        st = stat_tensors(b, blk.emit_statistics(b, ["x0"], [["d0_0", "d0_1"]]))
        inv = blk.emit_inverse(b, st, "lam", "inverse_op")
        return {**st, **with_ok(inv)}

    out = run_graph(build, feeds, float_type=TensorProto.DOUBLE)
    ref = blk.numpy_statistics(x64, d64)
    # 1e-7, not 1e-15: with static shapes ORT folds the 1/(N T) into FusedMatMul's alpha,
    # a float32 attribute, even in float64 graphs
    for k in ref:
        assert_close(out[k], ref[k], 1e-7, 1e-9, what=k)
    st, _ = blk.numpy_inverse(ref, 0.01, "cholesky")
    for k in st:
        assert_close(out[k], st[k], 1e-7, 1e-8, what=k)


def test_newton_schulz_warm_start_across_blocks():
    items_np, feeds = [], {"lam": f32(0.1)}
    for i, kw in enumerate([dict(n_in=4, n_out=4), dict(n_in=3, n_out=4)]):
        layer, shapes, inputs, cots = fc_case(**kw)
        blk = make_block(layer, shapes)
        f = blk.numpy_statistics(inputs, cots)
        prev, _ = blk.numpy_inverse({k: 1.02 * x for k, x in f.items()}, 0.1, "eigh")  # slightly stale
        items_np.append((blk, f, prev))
        feeds.update({f"b{i}_{k}": f32(x) for k, x in f.items()})
        feeds.update({f"p{i}_{k}": f32(x) for k, x in prev.items()})

    def build(b):
        items = [(blk, {k: f"b{i}_{k}" for k in f}, "lam", {k: f"p{i}_{k}" for k in prev}) for i, (blk, f, prev) in enumerate(items_np)]
        out = {}
        for i, st in enumerate(emit_inverses(b, items, "newton_schulz", iterations=5)):
            out.update({f"{i}_{k}": t for k, t in with_ok(st).items()})
        return out

    out = run_graph(build, feeds)
    for i, (blk, f, _) in enumerate(items_np):
        ref, _ = blk.numpy_inverse(f, 0.1, "eigh")
        assert bool(out[f"{i}_ok"])
        for k in ref:
            assert_close(out[f"{i}_{k}"], ref[k], 1e-3, 1e-4)


def test_conv_auto_pad_same():
    layer, blk, inputs, cots = conv_case(strides=(2, 2), spatial=(7, 6))
    layer = Layer(layer.name, layer.kind, layer.params, layer.uses, attrs={**layer.attrs, "auto_pad": "SAME_UPPER", "pads": None}, approximation="kron")
    blk = make_block(layer, {"W": (6, 4, 3, 3), "b": (6,)})
    out_sp = blk._out_sizes([7, 6])
    assert out_sp == [4, 3]
    cots = [[f32(RNG.standard_normal((3, 6, *out_sp)))]]
    out = emitted_stats(blk, inputs, cots)
    attrs = {**layer.attrs, "pads": blk._np_pads([7, 6])}
    P = explicit_patches(np.asarray(inputs[0], np.float64), attrs, 1, True)
    assert_close(out["A"], np.einsum("njat,njbt->ab", P, P) / (P.shape[0] * P.shape[3]))


@pytest.mark.parametrize("kw", CONV_CASES + [dict(approx="diagonal", group=2, strides=(2, 1), dil=(2, 1), pads=(2, 0, 1, 1))])
def test_conv_patches_by_slices_match(kw):
    layer, blk, inputs, cots = conv_case(**kw)
    blk2 = make_block(layer, blk.param_shapes, patches="slices")
    a, c = emitted_stats(blk, inputs, cots), emitted_stats(blk2, inputs, cots)
    for k in a:
        np.testing.assert_allclose(a[k], c[k], rtol=1e-5, atol=1e-6)
