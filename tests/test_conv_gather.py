"""The Gather forms of Conv (oprules/conv.py): the im2col/col2im tables against loops over
positions and offsets, the weight and input cotangents (col2im, or ConvTranspose at stride 1
in the weight-major layout) against a numpy reference conv, and
the lowered forward Conv of an emitted training step against torch's SGD."""
from __future__ import annotations

import collections
from itertools import product

import numpy as np
import pytest
from onnx import TensorProto, helper

from kfac_compiler.oprules.check import convert_float_type, one_node_model, run_ort
from kfac_compiler.oprules.conv import NOMINAL_BATCH, Geom, gather_table
from kfac_compiler.passes.autodiff import gradient_model, jvp_model


def _geom(xs, ws, attrs) -> Geom:
    class View:  # the two shapes Geom reads
        def shape(self, name):
            return {"x": list(xs), "w": list(ws)}[name]

    return Geom(View(), helper.make_node("Conv", ["x", "w"], ["y"], **attrs), "x", "w")


GEOMS = [  # (x shape, w shape, attributes)
    ((2, 8, 4, 4), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 8, 9, 8), (8, 8, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 3], "dilations": [1, 2]}),
    ((2, 8, 1, 1), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]}),  # only the centre tap meets the input
    ((2, 8, 6, 5), (16, 8, 3, 3), {"pads": [1, 0, 0, 0]}),  # pads less than "same": ConvTranspose
    ((2, 8, 2, 3), (8, 8, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    ((3, 8, 7), (8, 8, 3), {"pads": [1, 2], "strides": [2]}),
    ((1, 8, 3, 4, 3), (8, 8, 2, 3, 2), {"pads": [1, 0, 1, 0, 1, 1], "strides": [1, 2, 1]}),
    # patch-major (NOMINAL_BATCH * output positions < output channels), whole kernel
    ((2, 8, 1, 1), (40, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 8, 2, 3), (200, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 8, 4, 4), (136, 8, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
]


def _taps(geo, so):
    """(output position, offset) -> flat input position, or None: loops over both."""
    out = {}
    for o in product(*map(range, so)):
        for kk in product(*map(range, geo.k)):
            i = [o[a] * geo.s[a] + kk[a] * geo.d[a] - geo.pb[a] for a in range(geo.nd)]
            ok = all(0 <= i[a] < geo.S[a] for a in range(geo.nd))
            out[o, kk] = int(np.ravel_multi_index(i, geo.S)) if ok else None
    return out


@pytest.mark.parametrize("xs,ws,attrs", GEOMS)
def test_gather_tables_against_loops(xs, ws, attrs):
    geo = _geom(xs, ws, attrs)
    so = geo.out_size()
    taps = _taps(geo, so)
    fwd, box = gather_table(so, geo.S, geo, adjoint=False)
    adj, box_adj = gather_table(geo.S, so, geo, adjoint=True)
    assert box == box_adj
    full, whole = gather_table(so, geo.S, geo, adjoint=False, full=True)
    assert whole == [(0, k) for k in geo.k]
    for (o, kk), i in taps.items():
        assert full[np.ravel_multi_index(o, so), np.ravel_multi_index(kk, geo.k)] == (
            int(np.prod(geo.S)) if i is None else i)
    offsets = list(product(*[range(lo, hi) for lo, hi in box]))
    assert fwd.shape == (int(np.prod(so)), len(offsets)) and adj.shape == (int(np.prod(geo.S)), len(offsets))
    zero_in, zero_out = int(np.prod(geo.S)), int(np.prod(so))
    for (o, kk), i in taps.items():
        if not all(lo <= kk[a] < hi for a, (lo, hi) in enumerate(box)):
            assert i is None  # offsets outside the box never meet the input
            continue
        col = offsets.index(kk)
        assert fwd[np.ravel_multi_index(o, so), col] == (zero_in if i is None else i)
        if i is not None:  # the adjoint table inverts the forward one
            assert adj[i, col] == np.ravel_multi_index(o, so)
    hits = collections.Counter((i, kk) for (o, kk), i in taps.items() if i is not None)
    assert all(v == 1 for v in hits.values())
    n_live = sum(1 for (i, kk) in hits)
    assert int((adj != zero_out).sum()) == n_live


def _numpy_conv_grads(x, w, g, geo):
    """dx, dw of y[n, m, o] = sum_{c, kk} w[m, c, kk] x_pad[n, c, o*s + kk*d] by loops."""
    xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(geo.pb, geo.pe)))
    dxp, dw = np.zeros_like(xp), np.zeros_like(w)
    so = g.shape[2:]
    for o in product(*map(range, so)):
        for kk in product(*map(range, geo.k)):
            at = (slice(None), slice(None)) + tuple(o[a] * geo.s[a] + kk[a] * geo.d[a] for a in range(geo.nd))
            go = g[(slice(None), slice(None)) + o]  # [N, M]
            dw[(slice(None), slice(None)) + kk] += go.T @ xp[at]
            dxp[at] += go @ w[(slice(None), slice(None)) + kk]
    crop = (slice(None), slice(None)) + tuple(slice(geo.pb[a], geo.pb[a] + geo.S[a]) for a in range(geo.nd))
    return dxp[crop], dw


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "dynamic-batch"])
@pytest.mark.parametrize("xs,ws,attrs", GEOMS)
def test_gather_cotangents_against_numpy(xs, ws, attrs, symbolic):
    rng = np.random.default_rng(3)
    model, feeds = one_node_model("Conv", [("x", rng.standard_normal(xs)), ("w", rng.standard_normal(ws)),
                                           ("b", rng.standard_normal(ws[0]))], attrs)
    if symbolic:  # the batch dimension named, as in exported models (the rest stays static)
        for vi in (model.graph.input[0], model.graph.output[0]):
            vi.type.tensor_type.shape.dim[0].dim_param = "N"
    m32 = convert_float_type(model, TensorProto.FLOAT)
    out = m32.graph.output[0].name
    gm = gradient_model(m32, out, [], extra_wrt=["x", "w"])
    ops = collections.Counter(n.op_type for n in gm.graph.node)
    geo = _geom(xs, ws, attrs)
    patch_major = NOMINAL_BATCH * int(np.prod(geo.out_size())) < ws[0]
    assert patch_major == (ws[0] > 16)  # both layouts are covered
    col2im = patch_major or any(v != 1 for v in geo.s)
    # else the input cotangent is a Conv with the flipped kernel where that pads no more than
    # the forward ("same" convs), otherwise a ConvTranspose
    pads = geo.pb + geo.pe
    flipped = not col2im and all(e - 1 - p <= p for e, p in zip(geo.eff * 2, pads))
    assert ops["Gather"] == 1 + col2im  # the forms under test ran
    assert (ops["ConvTranspose"], ops["Conv"]) == (int(not col2im and not flipped), 1 + flipped)  # and the forward
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    y = run_ort(m32, f32, [out])[out]
    g = rng.standard_normal(y.shape)
    got = run_ort(gm, {**f32, f"{out}_grad": g.astype(np.float32)}, ["grad/x", "grad/w"])
    dx, dw = _numpy_conv_grads(feeds["x"], feeds["w"], g, geo)
    np.testing.assert_allclose(got["grad/x"], dx, rtol=1e-4, atol=1e-4 * np.abs(dx).max())
    np.testing.assert_allclose(got["grad/w"], dw, rtol=1e-4, atol=1e-4 * np.abs(dw).max())


def test_lowered_forward_steps_match_torch():
    """conv2 of a (8, 16) small CNN (4x4 inputs, 8 channels) runs as Gather + Gemm in the
    emitted step, its weight cotangent from the same patches, its input cotangent a Conv
    with the flipped kernel (a "same" conv); three SGD steps (momentum 0.9) move the
    parameters as torch.optim.SGD does."""
    torch = pytest.importorskip("torch")
    from onnx import numpy_helper

    import kfac_compiler as kc
    from kfac_compiler.backend import emit_subgraph
    from kfac_compiler.models import ZOO, build_small_cnn
    from kfac_compiler.runtime import Trainer

    model = build_small_cnn(seed=0, channels=(8, 16))
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    step, _ = emit_subgraph(plan, "sgd_step")
    convs = [n.input[1] for n in step.graph.node if n.op_type == "Conv"]
    assert convs[0] == "conv1.weight" and "conv2.weight" not in convs  # conv2's forward lowered
    ops = [n.op_type for n in step.graph.node]
    # conv2: one patch Gather (the forward's and dW's copies merged at emission, backend/dedupe.py);
    # its input gradient is the second Conv, on the flipped kernel
    assert ops.count("Gather") == 1 and ops.count("Conv") == 2 and "ConvTranspose" not in ops
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
    net = torch.nn.ModuleDict({"conv1": torch.nn.Conv2d(1, 8, 3, padding=1),
                               "conv2": torch.nn.Conv2d(8, 16, 3, padding=1), "fc": torch.nn.Linear(16, 10)})
    net.load_state_dict(weights)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    tr = Trainer(plan, optimizer="sgd", device="cpu", seed=0, learning_rate=0.1, momentum=0.9)
    inputs, y = ZOO["small_cnn"].make_data(96, seed=0)
    for i in range(3):
        xb, yb = inputs["input"][32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)]
        ours = tr.step({"input": xb}, yb)["loss"]
        opt.zero_grad()
        h = torch.max_pool2d(torch.relu(net["conv1"](torch.from_numpy(xb))), 2)
        logits = net["fc"](torch.relu(net["conv2"](h)).mean((2, 3)))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(yb))
        loss.backward()
        opt.step()
        assert ours == pytest.approx(loss.item(), rel=1e-5)
    for name, value in tr.parameters().items():
        np.testing.assert_allclose(value, net.state_dict()[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def _numpy_conv(x, w, geo):
    """y[n, m, o] = sum_{c, kk} w[m, c, kk] x_pad[n, c, o*s + kk*d] by loops."""
    xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(geo.pb, geo.pe)))
    so = geo.out_size()
    y = np.zeros((x.shape[0], w.shape[0], *so))
    for o in product(*map(range, so)):
        for kk in product(*map(range, geo.k)):
            at = (slice(None), slice(None)) + tuple(o[a] * geo.s[a] + kk[a] * geo.d[a] for a in range(geo.nd))
            y[(slice(None), slice(None)) + o] += xp[at] @ w[(slice(None), slice(None)) + kk].T
    return y


@pytest.mark.parametrize("wrt", [("x", "w", "b"), ("w", "b"), ("x",)], ids=["all", "params", "input"])
@pytest.mark.parametrize("xs,ws,attrs", GEOMS)
def test_gather_tangents_against_numpy(xs, ws, attrs, wrt):
    """The quadratic model's JVPs: dY = conv(tX, W) + conv(X, tW) + tB by Gather + Gemm."""
    rng = np.random.default_rng(4)
    vals = {"x": rng.standard_normal(xs), "w": rng.standard_normal(ws), "b": rng.standard_normal(ws[0])}
    model, feeds = one_node_model("Conv", list(vals.items()), attrs)
    m32 = convert_float_type(model, TensorProto.FLOAT)
    out = m32.graph.output[0].name
    jm = jvp_model(m32, out, list(wrt))
    ops = collections.Counter(n.op_type for n in jm.graph.node)
    assert ops["Conv"] == 1 and ops["Gather"] == ("x" in wrt) + ("w" in wrt)  # the model's Conv; tangents via patches
    tans = {p: rng.standard_normal(vals[p].shape) for p in wrt}
    geo = _geom(xs, ws, attrs)
    want = np.zeros((xs[0], ws[0], *geo.out_size()))
    if "x" in tans:
        want += _numpy_conv(tans["x"], vals["w"], geo)
    if "w" in tans:
        want += _numpy_conv(vals["x"], tans["w"], geo)
    if "b" in tans:
        want += tans["b"].reshape([1, -1] + [1] * geo.nd)
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    got = run_ort(jm, {**f32, **{f"tangent/{p}": t.astype(np.float32) for p, t in tans.items()}})[f"jvp/{out}"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
