"""Rules against what ONNX Runtime itself computes: gradient_model / jvp_model run on ORT CPU
against element-wise central differences of the ORIGINAL model on ORT (float64 where ORT has
the op's double kernel). These are the forms where onnx.reference, onnx shape inference or a
rule's reading of the spec differ from ORT (the finite differences of tests/test_oprules.py
run on onnx.reference and would share such a mistake)."""
from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.errors import UnsupportedOpError
from kfac_compiler.oprules.check import lift_initializers, run_reference
from kfac_compiler.passes.autodiff import gradient_model, jvp_model
from kfac_compiler.passes.canonicalize import canonicalize


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _model(nodes, inputs: Mapping[str, tuple[int, list]], inits: Mapping[str, np.ndarray], opset: int = 17,
           out: str = "y") -> onnx.ModelProto:
    """inputs: name -> (elem type, shape); the output `out` gets its inferred type."""
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
                          [helper.make_tensor_value_info(out, TensorProto.UNDEFINED, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    m.graph.output[0].CopyFrom(onnx.shape_inference.infer_shapes(m).graph.output[0])
    return m


def ort_check(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], params: Sequence[str] = ("W",),
              out: str = "y", eps: float = 1e-6, tol: float = 1e-6, seed: int = 0) -> None:
    """grad/<p> and jvp/<out> on ORT against central differences of `model` on ORT, every
    element of every param (small params); tol relative to the largest magnitude."""
    rng = np.random.default_rng(seed)
    lifted, vals = lift_initializers(model, list(params))
    fwd = _session(lifted)

    def f(v: Mapping[str, np.ndarray]) -> np.ndarray:
        return fwd.run([out], {**feeds, **v})[0].astype(np.float64)

    y0 = fwd.run([out], {**feeds, **vals})[0]
    u = rng.standard_normal(y0.shape)
    tang = {p: rng.standard_normal(vals[p].shape) for p in params}
    dt = {p: vals[p].dtype for p in params}
    gm = gradient_model(model, out, list(params))
    got = _session(gm).run([f"grad/{p}" for p in params], {**feeds, f"{out}_grad": u.astype(y0.dtype)})
    got = [g.astype(np.float64) for g in got]
    jm = jvp_model(model, out, list(params))
    (jv,) = _session(jm).run([f"jvp/{out}"], {**feeds, **{f"tangent/{p}": tang[p].astype(dt[p]) for p in params}})
    assert np.all(np.isfinite(jv)), f"jvp not finite: {jv}"
    for p, g in zip(params, got):
        assert np.all(np.isfinite(g)), f"grad/{p} not finite: {g}"
        fd = np.zeros(vals[p].shape)
        for i in range(fd.size):
            plus, minus = vals[p].copy(), vals[p].copy()
            plus.reshape(-1)[i] += eps
            minus.reshape(-1)[i] -= eps
            fd.reshape(-1)[i] = np.sum(u * (f({**vals, p: plus}) - f({**vals, p: minus}))) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=0, atol=tol * (1 + np.max(np.abs(fd))), err_msg=f"grad/{p}")
    fdj = (f({**vals, **{p: (vals[p] + eps * tang[p]).astype(dt[p]) for p in params}})
           - f({**vals, **{p: (vals[p] - eps * tang[p]).astype(dt[p]) for p in params}})) / (2 * eps)
    np.testing.assert_allclose(jv.astype(np.float64), fdj, rtol=0, atol=tol * (1 + np.max(np.abs(fdj))),
                               err_msg=f"jvp/{out}")


# ---------------------------------------------------------------------------- Dropout
def test_dropout_with_a_runtime_training_mode_is_the_identity_when_false(rng):
    """training_mode a graph input: false makes ORT's Dropout the identity (mask all true,
    no 1/(1-ratio)); the rule scaled by 1/(1-ratio) = 2 regardless."""
    m = _model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                helper.make_node("Dropout", ["h", "ratio", "training_mode"], ["y", "mask"])],
               {"x": (TensorProto.DOUBLE, [2, 3]), "training_mode": (TensorProto.BOOL, [])},
               {"W": rng.standard_normal((3, 4)), "ratio": np.asarray(0.5)})
    x = rng.standard_normal((2, 3))
    ort_check(m, {"x": x, "training_mode": np.asarray(False)})
    # training at run time: y = h * mask / (1 - ratio), the mask drawn per run; with ratio 0
    # the mask is all true and the scale 1, so differences see the same function
    m0 = _model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                 helper.make_node("Dropout", ["h", "ratio", "training_mode"], ["y", "mask"])],
                {"x": (TensorProto.DOUBLE, [2, 3]), "training_mode": (TensorProto.BOOL, [])},
                {"W": rng.standard_normal((3, 4)), "ratio": np.asarray(0.0)})
    ort_check(m0, {"x": x, "training_mode": np.asarray(True)})


# ------------------------------------------------------- norms of an all-zero group
def _zero_row_case(rng, op: str, attrs: dict, hshape: list, opset: int, extra=(), dtype=TensorProto.DOUBLE):
    """x [2, 3] whose row 1 is zero: h = Reshape(x W) has an all-zero example (every window,
    group and vector of it zero for any W), so the function of W is smooth there."""
    npt = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h0"]), helper.make_node("Reshape", ["h0", "shp"], ["h"]),
             helper.make_node(op, ["h", *extra], ["y"], **attrs)]
    inits = {"W": rng.standard_normal((3, int(np.prod(hshape)))).astype(npt),
             "shp": np.asarray([2, *hshape], np.int64)}
    if extra:
        inits["axes"] = np.asarray(attrs.pop("_axes"), np.int64)
        nodes[-1] = helper.make_node(op, ["h", *extra], ["y"], **attrs)
    m = _model(nodes, {"x": (dtype, [2, 3])}, inits, opset=opset)
    x = rng.standard_normal((2, 3)).astype(npt)
    x[1] = 0
    return m, {"x": x}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reducel2_of_an_all_zero_group_has_a_zero_not_nan_gradient(rng, opset, keepdims):
    attrs: dict = {"keepdims": keepdims}
    extra: tuple = ()
    if opset >= 18:
        attrs["_axes"], extra = [2], ("axes",)
    else:
        attrs["axes"] = [2]
    m, feeds = _zero_row_case(rng, "ReduceL2", attrs, [2, 3], opset, extra)
    ort_check(m, feeds)


@pytest.mark.parametrize("op,attrs,hshape", [
    ("LpPool", {"kernel_shape": [2, 2], "strides": [2, 2], "p": 2}, [2, 4, 4]),
    ("LpPool", {"kernel_shape": [2, 2], "strides": [1, 1], "p": 3}, [1, 3, 3]),
    ("GlobalLpPool", {"p": 2}, [2, 3, 3]),
    ("LpNormalization", {"p": 2, "axis": -1}, [2, 4]),
    ("LpNormalization", {"p": 1, "axis": 1}, [3, 2]),
])
def test_lp_norms_of_a_zero_window_or_vector_have_a_zero_not_nan_gradient(rng, op, attrs, hshape):
    if op == "LpNormalization":
        m, feeds = _zero_row_case(rng, op, dict(attrs), hshape, 18)
        ort_check(m, feeds)
    else:  # ORT has float kernels only: float32 differences
        m, feeds = _zero_row_case(rng, op, dict(attrs), hshape, 18, dtype=TensorProto.FLOAT)
        ort_check(m, feeds, eps=1e-2, tol=2e-3)


# ------------------------------------------------------- BatchNormalization-9 training form
def _bn9(rng, outputs: list[str]) -> onnx.ModelProto:
    C = 3
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h0"]), helper.make_node("Reshape", ["h0", "shp"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], outputs,
                              name="bn", epsilon=1e-3, momentum=0.9)]
    inits = {"W": rng.standard_normal((3, C * 4)), "shp": np.asarray([2, C, 4], np.int64),
             "scale": rng.uniform(0.5, 2, C), "bias": rng.standard_normal(C),
             "mean": rng.standard_normal(C), "var": rng.uniform(0.5, 2, C)}
    return _model(nodes, {"x": (TensorProto.DOUBLE, [2, 3])}, inits, opset=13)


def test_batchnorm_at_opset_13_with_its_training_outputs_is_refused_in_one_line(rng):
    """Training signalled by the output count: ORT's forward for it is batch-statistics BN
    without graph optimizations and neither form with them; the rule differentiated it as
    inference BN (34% off). Refused, naming the node and the two ways out."""
    m = _bn9(rng, ["y", "rm", "rv", "sm", "sv"])
    with pytest.raises(UnsupportedOpError) as e:
        gradient_model(m, "y", ["W"])
    msg = str(e.value)
    assert "\n" not in msg and "'bn'" in msg and "opset >= 14" in msg and "eval mode" in msg
    with pytest.raises(UnsupportedOpError):
        jvp_model(m, "y", ["W", "scale"])
    # the inference form (one output) keeps its rule: exact against ORT's forward
    ort_check(_bn9(rng, ["y"]), {"x": rng.standard_normal((2, 3))}, params=("W", "scale", "bias", "mean", "var"))


# ------------------------------------------------------------------------------- Resize
@pytest.mark.parametrize("opset,attrs,scales,hw", [
    (13, {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1.7, 1.0], (3, 4)),
    (13, {"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, [1.0, 1.7], (4, 3)),
    (13, {"mode": "nearest", "coordinate_transformation_mode": "align_corners", "nearest_mode": "floor"},
     [1.7, 1.0], (3, 4)),
    (18, {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}, [1.7, 1.0], (3, 4)),
    (13, {"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "floor"},
     [0.6, 1.0], (5, 4)),
    (19, {"mode": "nearest", "coordinate_transformation_mode": "half_pixel_symmetric", "nearest_mode": "floor"},
     [0.6, 1.0], (5, 4)),
    (13, {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1.5, 1.5], (5, 5)),
])
def test_resize_vjp_is_the_transpose_of_orts_forward(rng, opset, attrs, scales, hw):
    """Forms where onnx.reference's Resize differs from ORT's (align_corners and
    tf_crop_and_resize with in * scale not an integer, nearest rounding ties): the vjp's
    matrices came from onnx.reference while the forward and the jvp are ORT's. ORT has a
    float32 kernel only; the op is linear in W, so wide float32 differences are exact."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h0"]), helper.make_node("Reshape", ["h0", "shp"], ["h"]),
             helper.make_node("Resize", ["h", "", "sc"], ["y"], **attrs)]
    inits = {"W": rng.standard_normal((3, hw[0] * hw[1])).astype(np.float32),
             "shp": np.asarray([2, 1, *hw], np.int64), "sc": np.asarray([1, 1, *scales], np.float32)}
    m = _model(nodes, {"x": (TensorProto.FLOAT, [2, 3])}, inits, opset=opset)
    ort_check(m, {"x": rng.standard_normal((2, 3)).astype(np.float32)}, eps=0.5, tol=1e-5)


def test_resize_align_corners_scale_factor_matches_torch_autograd():
    """torch's F.interpolate(scale_factor=1.5, bilinear, align_corners=True) through
    TorchScript's export: the weight gradient against torch autograd (33% off before)."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2 * 5 * 5)

        def forward(self, x):
            h = self.fc(x).reshape(-1, 2, 5, 5)
            return torch.nn.functional.interpolate(h, scale_factor=1.5, mode="bilinear",
                                                   align_corners=True).flatten(1)

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(4, 3)
    buf = io.BytesIO()
    torch.onnx.export(net, (x,), buf, dynamo=False, input_names=["x"], output_names=["y"], opset_version=17)
    m = onnx.load_from_string(buf.getvalue())
    y = net(x)
    u = torch.randn_like(y)
    (y * u).sum().backward()
    wname = next(t.name for t in m.graph.initializer if tuple(t.dims) == (50, 3))
    (g,) = _session(gradient_model(m, "y", [wname])).run([f"grad/{wname}"], {"x": x.numpy(), "y_grad": u.numpy()})
    want = net.fc.weight.grad.numpy()
    np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * (1 + np.abs(want).max()))


# ---------------------------------------------------------------- pools with ceil_mode
def _ceil_pool(rng, op: str, opset: int, batch, tail: str = "gap") -> onnx.ModelProto:
    """x [batch, 3] -> W -> [batch, 2, 5, 7] -> op(kernel 2, stride 2, pads 1, ceil_mode) -> y,
    float32 (ORT's pools and Conv have no double kernels). The last window along both axes
    would start in the right padding: ORT (and torch, and the spec) drop it (3 x 4), onnx's
    shape inference before opset 22 keeps it (4 x 5)."""
    npt = np.float32
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}
    if op == "LpPool":
        attrs["p"] = 2
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h0"]), helper.make_node("Reshape", ["h0", "shp"], ["h"]),
             helper.make_node(op, ["h"], ["p"], name="pool", **attrs)]
    if tail == "gap":
        nodes += [helper.make_node("GlobalAveragePool", ["p"], ["g"]), helper.make_node("Flatten", ["g"], ["y"])]
    else:  # a Conv over the pooled map (its static shapes follow the pool's inferred ones)
        nodes += [helper.make_node("Conv", ["p", "K"], ["y"], kernel_shape=[2, 2])]
    inits = {"W": rng.standard_normal((3, 70)).astype(npt), "K": rng.standard_normal((3, 2, 2, 2)).astype(npt),
             "shp": np.asarray([-1 if isinstance(batch, str) else batch, 2, 5, 7], np.int64)}
    return _model(nodes, {"x": (TensorProto.FLOAT, [batch, 3])}, inits, opset=opset)


@pytest.mark.parametrize("op,opset", [("AveragePool", 17), ("MaxPool", 17), ("LpPool", 18)])
def test_ceil_mode_pool_uses_orts_output_size_not_the_inferred_one(rng, op, opset):
    """A symbolic batch: the pool rules take the output size from the geometry (as ORT),
    not from onnx's inferred 4 x 5 (AveragePool's adjoint reshaped its cotangent to it)."""
    m = _ceil_pool(rng, op, opset, "N")
    ort_check(m, {"x": rng.standard_normal((4, 3)).astype(np.float32)}, eps=1e-3 if op == "MaxPool" else 1e-2,
              tol=2e-3)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("tail", ["gap", "conv"])
def test_ceil_mode_pool_whose_inferred_shape_is_wrong_is_refused_with_a_static_batch(rng, op, tail):
    """A static batch: every shape after the pool is inferred from onnx's wrong 4 x 5, which
    the rules downstream trust (MaxPool's gradient graph failed at run time, AveragePool's
    gradient was 0.6x the true one, silently). Refused in one line naming the node; at
    opset 22, whose shape inference drops the window, the same model is differentiated."""
    with pytest.raises(UnsupportedOpError) as e:
        gradient_model(_ceil_pool(rng, op, 17, 4, tail=tail), "y", ["W"])
    msg = str(e.value)
    assert "\n" not in msg and "'pool'" in msg and "[4, 2, 3, 4]" in msg and "opset >= 22" in msg
    ort_check(_ceil_pool(rng, op, 22, 4, tail=tail), {"x": rng.standard_normal((4, 3)).astype(np.float32)},
              eps=1e-3 if op == "MaxPool" else 1e-2, tol=2e-3)


# ----------------------------------------------------------- MaxPool's tiled (mask) form
def _tiled_maxpool(rng, dtype: int) -> onnx.ModelProto:
    npt = helper.tensor_dtype_to_np_dtype(dtype)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h0"]), helper.make_node("Reshape", ["h0", "shp"], ["h"]),
             helper.make_node("MaxPool", ["h"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    inits = {"W": rng.standard_normal((3, 32)).astype(npt), "shp": np.asarray([2, 2, 4, 4], np.int64)}
    return _model(nodes, {"x": (dtype, [2, 3])}, inits)


def test_maxpool_with_tiled_windows_in_a_float64_model(rng):
    """Non-overlapping windows (the mask form: the forward's maxima upsampled by Resize): its
    Resize scales came out in float64, an invalid graph (ORT refused to load it). Valid now;
    ORT has no float64 Resize kernel (compiled plans compute in float32), so the float64
    graph runs on onnx.reference, against differences of the model on ORT in float64."""
    m = _tiled_maxpool(rng, TensorProto.DOUBLE)
    gm = gradient_model(m, "y", ["W"])
    onnx.checker.check_model(gm, full_check=True)
    x = rng.standard_normal((2, 3))
    u = rng.standard_normal((2, 2, 2, 2))
    got = run_reference(gm, {"x": x, "y_grad": u}, ["grad/W"])["grad/W"]
    lifted, vals = lift_initializers(m, ["W"])
    fwd = _session(lifted)
    fd = np.zeros(vals["W"].shape)
    for i in range(fd.size):
        d = np.zeros(fd.shape)
        d.reshape(-1)[i] = 1e-6
        fd.reshape(-1)[i] = np.sum(u * (fwd.run(["y"], {"x": x, "W": vals["W"] + d})[0]
                                        - fwd.run(["y"], {"x": x, "W": vals["W"] - d})[0])) / 2e-6
    np.testing.assert_allclose(got, fd, rtol=0, atol=1e-6 * (1 + np.abs(fd).max()))
    m32 = _tiled_maxpool(rng, TensorProto.FLOAT)  # the float32 form runs on ORT
    assert "Resize" in {n.op_type for n in gradient_model(m32, "y", ["W"]).graph.node}
    ort_check(m32, {"x": rng.standard_normal((2, 3)).astype(np.float32)}, eps=1e-3, tol=2e-3)


# ------------------------------------------------------- constant folding at canonicalization
@pytest.mark.parametrize("case", ["LpNormalization-p1", "LRN", "MaxPool-Indices", "Resize-align-corners",
                                  "ConvTranspose-group2"])
def test_folded_constant_subgraphs_compute_what_ort_computes(rng, case):
    """A float Constant through an op whose plain onnx.reference differs from ORT was folded
    to other values (the plan then trained another function: predict 0.14-2.4 off): folding
    uses the rules' reference fixes, and Resize, which they do not cover, is not folded."""
    k4 = rng.standard_normal((1, 4, 2, 2)).astype(np.float32) * 3
    body = {
        "LpNormalization-p1": ([rng.standard_normal((1, 4)).astype(np.float32)],
                               [helper.make_node("LpNormalization", ["k0"], ["kn"], p=1, axis=-1)], [4]),
        "LRN": ([k4], [helper.make_node("LRN", ["k0"], ["kn"], size=3, alpha=0.5, beta=0.75)], [4, 2, 2]),
        "MaxPool-Indices": ([rng.standard_normal((1, 1, 4, 4)).astype(np.float32)],
                            [helper.make_node("MaxPool", ["k0"], ["kp", "ki"], kernel_shape=[3, 3], strides=[1, 1],
                                              pads=[1, 1, 1, 1]),
                             helper.make_node("Cast", ["ki"], ["kn"], to=TensorProto.FLOAT)], [1, 4, 4]),
        "Resize-align-corners": ([rng.standard_normal((1, 1, 2, 5)).astype(np.float32),
                                  np.asarray([1, 1, 1, 1.7], np.float32)],
                                 [helper.make_node("Resize", ["k0", "", "k1"], ["kn"], mode="linear",
                                                   coordinate_transformation_mode="align_corners")], [1, 2, 8]),
        "ConvTranspose-group2": ([k4, rng.standard_normal((4, 1, 2, 2)).astype(np.float32)],
                                 [helper.make_node("ConvTranspose", ["k0", "k1"], ["kn"], group=2)], [2, 3, 3]),
    }[case]
    consts, ops, hshape = body
    nodes = [helper.make_node("Constant", [], [f"k{i}"], value=numpy_helper.from_array(v, f"k{i}"))
             for i, v in enumerate(consts)]
    nodes += [helper.make_node("MatMul", ["x", "W"], ["h0"]), helper.make_node("Reshape", ["h0", "shp"], ["h"]),
              *ops, helper.make_node("Add", ["h", "kn"], ["y"])]
    m = _model(nodes, {"x": (TensorProto.FLOAT, ["N", 3])},
               {"W": rng.standard_normal((3, int(np.prod(hshape)))).astype(np.float32),
                "shp": np.asarray([-1, *hshape], np.int64)})
    cm = canonicalize(m, "y")
    assert case == "Resize-align-corners" or ops[0].op_type not in {n.op_type for n in cm.graph.node}
    x = rng.standard_normal((2, 3)).astype(np.float32)
    want = _session(m).run(["y"], {"x": x})[0]
    got = _session(cm).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
