"""The conv_transpose layer kind: pattern, Kronecker and diagonal blocks against brute force
computed from the ConvTranspose definition (loops), and a K-FAC step end to end."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.blocks import make_block
from test_blocks import assert_close, brute_fisher, emitted_stats, f32, make_layer, run_graph


def out_sizes(sp, a):
    nd = len(sp)
    k, s, d, p, op = a["kernel_shape"], a["strides"], a["dilations"], a["pads"], a["output_padding"]
    return [s[i] * (sp[i] - 1) + op[i] + (k[i] - 1) * d[i] + 1 - p[i] - p[i + nd] for i in range(nd)]


def convt_case(rng, approx="kron", C_in=4, C_out=6, k=(3, 3), spatial=(3, 4), strides=None, pads=None, dil=None,
               opad=None, group=1, bias=True, uses=1, seeds=2, N=3):
    nd = len(k)
    a = dict(kernel_shape=list(k), strides=list(strides or [1] * nd), pads=list(pads or [0] * 2 * nd),
             dilations=list(dil or [1] * nd), output_padding=list(opad or [0] * nd), group=group)
    params = ("W", "b") if bias else ("W",)
    shapes = {"W": (C_in, C_out // group, *k), "b": (C_out,)}
    layer = make_layer("conv_transpose", params, uses, approx, **a)
    blk = make_block(layer, {p: shapes[p] for p in params})
    xs = [f32(rng.standard_normal((N, C_in, *spatial))) for _ in range(uses)]
    osp = out_sizes(list(spatial), a)
    cots = [[f32(rng.standard_normal((N, C_out, *osp))) for _ in range(seeds)] for _ in range(uses)]
    return layer, blk, xs, cots


def explicit(x, d, a, group, C_out):
    """(X per group [N, g, Cg, T], D patches [N, g, Co_g*K, T], per-example dW [N, C_in, Co_g, *k],
    per-example db [N, C_out]) straight from dW[c,o,m] = sum_i X[c,i] dY[o, s i + d m - p]."""
    x, d = np.asarray(x, np.float64), np.asarray(d, np.float64)
    N, C_in, *sp = x.shape
    osp = d.shape[2:]
    k, s, dl, p = a["kernel_shape"], a["strides"], a["dilations"], a["pads"]
    nd = len(k)
    Cg, Co_g = C_in // group, C_out // group
    T = int(np.prod(sp))
    K = Co_g * int(np.prod(k))
    D = np.zeros((N, group, K, T))
    for t, i in enumerate(itertools.product(*[range(m) for m in sp])):
        for j in range(group):
            row = 0
            for o in range(Co_g):
                for m in itertools.product(*[range(q) for q in k]):
                    pos = [s[e] * i[e] + dl[e] * m[e] - p[e] for e in range(nd)]
                    if all(0 <= pos[e] < osp[e] for e in range(nd)):
                        D[:, j, row, t] = d[(slice(None), j * Co_g + o, *pos)]
                    row += 1
    X = x.reshape(N, group, Cg, T)
    gW = np.einsum("njct,njkt->njck", X, D).reshape(N, C_in, Co_g, *k)
    gb = d.reshape(N, C_out, -1).sum(-1)
    return X, D, gW, gb


CASES = [
    dict(),
    dict(strides=(2, 2), pads=(1, 1, 1, 1), opad=(1, 0)),
    dict(strides=(2, 3), pads=(1, 0, 2, 1), opad=(1, 2), dil=(2, 1), group=2),
    dict(k=(4,), spatial=(5,), strides=(2,), pads=(1, 1), bias=False),
    dict(k=(2, 2, 2), spatial=(2, 3, 2), C_in=2, C_out=3, strides=(2, 1, 2), N=2),
    dict(uses=2, seeds=1, strides=(2, 2)),
]


@pytest.mark.parametrize("kw", CASES)
def test_conv_transpose_kron_statistics(kw, rng):
    layer, blk, xs, cots = convt_case(rng, **kw)
    out = emitted_stats(blk, xs, cots)
    a, g = layer.attrs, blk.group
    N = xs[0].shape[0]
    ex = [[explicit(x, cots[u][s], a, g, blk.C_out) for s in range(len(cots[0]))] for u, x in enumerate(xs)]
    Xs = [e[0][0] for e in ex]
    T = sum(X.shape[3] for X in Xs)
    A = sum(np.einsum("njat,njbt->jab", X, X) for X in Xs) / (N * T)
    G = sum(np.einsum("njat,njbt->jab", e[1], e[1]) for eu in ex for e in eu) / N
    if g == 1:
        A, G = A[0], G[0]
    want = {"A": A, "G": G}
    if blk.has_bias:
        gbs = [sum(ex[u][s][3] for u in range(len(xs))) for s in range(len(cots[0]))]
        want["B"] = sum(gb.T @ gb for gb in gbs) / N
    assert set(out) == set(want)
    twin = blk.numpy_statistics(xs, cots)
    for key in want:
        assert_close(out[key], want[key], what=key)
        assert_close(twin[key], want[key], 1e-10, 1e-10, what=key)
    assert [tuple(s.shape) for s in blk.factor_specs()] == [want[k].shape for k in ("A", "G", "B") if k in want]


def test_conv_transpose_kron_single_position_exact(rng):
    """One input position, N = 1: A (x) G is the exact Fisher of W (as the matrix
    M[(o, m), c]), B the exact Fisher of the bias."""
    layer, blk, xs, cots = convt_case(rng, spatial=(1, 1), N=1, seeds=1, strides=(2, 2))
    out = emitted_stats(blk, xs, cots)
    _, _, gW, gb = explicit(xs[0], cots[0][0], layer.attrs, 1, blk.C_out)
    M = blk.view.np_to({"W": gW[0]})  # [Co_g*K, C_in]
    v = M.reshape(-1, order="F")
    np.testing.assert_allclose(np.kron(out["A"], out["G"]), np.outer(v, v), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["B"], np.outer(gb[0], gb[0]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(strides=(2, 3), pads=(1, 0, 2, 1), opad=(1, 2), dil=(2, 1), group=2),
                                dict(uses=2, seeds=1, bias=False)])
def test_conv_transpose_diagonal_is_brute_force(kw, rng):
    layer, blk, xs, cots = convt_case(rng, approx="diagonal", **kw)
    out = emitted_stats(blk, xs, cots)
    gs = []
    for s in range(len(cots[0])):
        parts = [explicit(x, cots[u][s], layer.attrs, blk.group, blk.C_out) for u, x in enumerate(xs)]
        g = sum(np.concatenate([p[2].reshape(p[2].shape[0], -1)] + ([p[3]] if blk.has_bias else []), axis=1)
                for p in parts)
        gs.append(g)
    assert_close(out["diag"], np.diag(brute_fisher(gs)))


def test_conv_transpose_kron_multiply_and_inverse(rng):
    """The power hook: (A (x) G (+) B + damping) v in ONNX equals the numpy twin and the
    explicit matrix; the inverse undoes it."""
    layer, blk, xs, cots = convt_case(rng, strides=(2, 2), group=2, C_in=4, C_out=4, k=(2, 2))
    fac = blk.numpy_statistics(xs, cots)
    vec = {"W": rng.standard_normal(blk.wshape), "b": rng.standard_normal(blk.C_out)}
    lam = 0.1
    want = blk.numpy_multiply(vec, fac, lam)
    feeds = {**{f"f_{k}": f32(v) for k, v in fac.items()}, **{f"v_{k}": f32(v) for k, v in vec.items()},
             "lam": np.asarray(lam, np.float32)}
    got = run_graph(lambda b: blk.emit_multiply(b, {k: f"v_{k}" for k in vec}, {k: f"f_{k}" for k in fac}, "lam"),
                    feeds)
    for k in vec:
        assert_close(got[k], want[k], 1e-4, 1e-4, what=k)
    state, ok = blk.numpy_inverse(fac, lam)
    assert ok
    back = blk.numpy_multiply_inverse(want, state)
    for k in vec:
        np.testing.assert_allclose(back[k], vec[k], rtol=1e-6, atol=1e-8)


def _decoder_model(opset=17):
    """x [N, 8] -> Gemm -> [N, 4, 2, 2] -> ConvTranspose(s2, p1, op1) -> Relu -> ConvTranspose(group 2)."""
    rng = np.random.default_rng(0)
    inits = {
        "fc.weight": rng.standard_normal((16, 8)) * 0.3, "fc.bias": np.zeros(16),
        "up1.weight": rng.standard_normal((4, 3, 3, 3)) * 0.3, "up1.bias": np.zeros(3),
        "up2.weight": rng.standard_normal((3, 2, 2, 2)) * 0.3,
    }
    nodes = [
        helper.make_node("Gemm", ["input", "fc.weight", "fc.bias"], ["h"], transB=1, name="fc"),
        helper.make_node("Reshape", ["h", "shape"], ["h4"], name="reshape"),
        helper.make_node("ConvTranspose", ["h4", "up1.weight", "up1.bias"], ["u1"], name="up1", strides=[2, 2],
                         pads=[1, 1, 1, 1], output_padding=[1, 1], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["u1"], ["r1"], name="relu"),
        helper.make_node("ConvTranspose", ["r1", "up2.weight"], ["u2"], name="up2", strides=[1, 1]),
        helper.make_node("Flatten", ["u2"], ["logits"], name="flat"),
    ]
    g = helper.make_graph(nodes, "decoder", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
                          + [numpy_helper.from_array(np.asarray([-1, 4, 2, 2], np.int64), "shape")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("approx", ["kron", "diagonal"])
def test_conv_transpose_layers_compile_and_train(approx):
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    m = _decoder_model()
    plan = kc.compile(m, loss="squared_error", output="logits", config={"approximations": {"conv_transpose": approx}})
    kinds = {l.name: (l.kind, l.approximation, l.params) for l in plan.layers}
    assert kinds["up1"] == ("conv_transpose", approx, ("up1.weight", "up1.bias"))
    assert kinds["up2"] == ("conv_transpose", approx, ("up2.weight",))
    x = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
    y = np.random.default_rng(2).standard_normal((16, 2 * 5 * 5)).astype(np.float32) * 0.1
    tr = Trainer(plan, optimizer="kfac", device="cpu")
    losses = [float(tr.step({"input": x}, targets=y)["loss"]) for _ in range(6)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_patterns_registered_and_auto_pad_falls_back():
    import warnings

    from kfac_compiler.frontend import compile_frontend
    from kfac_compiler.patterns.builtin import BUILTIN_PATTERN_NAMES

    for nd in (1, 2, 3):
        assert f"conv_transpose{nd}d" in BUILTIN_PATTERN_NAMES and f"conv_transpose{nd}d_bias" in BUILTIN_PATTERN_NAMES
    assert "rms_norm" in BUILTIN_PATTERN_NAMES
    m = _decoder_model()
    for n in m.graph.node:
        if n.name == "up2":
            n.attribute.append(helper.make_attribute("auto_pad", "SAME_UPPER"))
    del m.graph.value_info[:]  # the shapes inferred before the edit are stale (a declared output is checked)
    m.graph.output[0].type.tensor_type.ClearField("shape")
    m = onnx.shape_inference.infer_shapes(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = compile_frontend(m, loss="squared_error", output="logits")
    kinds = {l.name: l.kind for l in plan.layers}
    assert kinds["up1"] == "conv_transpose" and kinds["up2"] == "generic", kinds
    assert any("auto_pad=SAME_UPPER" in str(w.message) for w in caught)
