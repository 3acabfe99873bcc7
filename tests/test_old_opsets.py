"""Models that declare the oldest opsets we accept (13, 14) train end to end. Every model at
opset 13 or 14 failed inside ONNX Runtime (`Unrecognized attribute: end for operator Shape`):
the loss's batch size and the unrolled recurrence's zero state were emitted with Shape's
start/end attributes, which came in opset 15. The truth here is the same model converted to
opset 17 by onnx's version converter, whose gradients the finite-difference suites check:
gradients equal, and K-FAC and SGD steps equal to float32 rounding. The embedding models take
int32 ids (a Keras Embedding's, tf2onnx): the embedding block's token counts at opset < 16 and
the tied block's per-example gradients at every opset fed them to a OneHot with an int64
depth, for which ONNX Runtime has no kernel (the K-FAC step's session failed to build). The
reshape model's Reshape takes a target computed from Shape, to which onnx's inference gives no
rank at opset 13 (the MatMul after it was refused: tf2onnx's Keras transformer)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper, version_converter

import kfac_compiler as kc
from kfac_compiler.runtime import Trainer, gradients

N, IN, H, OUT, T, VOCAB = 6, 4, 5, 3, 3, 7


def _model(kind: str, opset: int) -> onnx.ModelProto:
    """A small regression model with a symbolic batch: an MLP, a conv net, or an LSTM."""
    rng = np.random.default_rng(0)
    init = {}

    def w(name, *shape):
        init[name] = (0.5 * rng.normal(size=shape)).astype(np.float32)
        return name

    if kind == "mlp":
        x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", IN])
        nodes = [helper.make_node("Gemm", ["input", w("w1", H, IN), w("b1", H)], ["h"], transB=1),
                 helper.make_node("Relu", ["h"], ["a"]),
                 helper.make_node("Gemm", ["a", w("w2", OUT, H), w("b2", OUT)], ["out"], transB=1)]
    elif kind == "conv":
        x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 6, 6])
        nodes = [helper.make_node("Conv", ["input", w("k", 2, 1, 3, 3), w("kb", 2)], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node("Relu", ["c"], ["r"]),
                 helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
                 helper.make_node("Flatten", ["p"], ["f"]),
                 helper.make_node("Gemm", ["f", w("w2", OUT, 18), w("b2", OUT)], ["out"], transB=1)]
    elif kind == "reshape":  # tf2onnx's Tensordot: a Reshape to a target computed from Shape
        x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", IN])
        init["i0"], init["tail"] = np.array([0], np.int64), np.array([2, 3], np.int64)
        nodes = [helper.make_node("MatMul", ["input", w("w1", IN, 6)], ["h"]),
                 helper.make_node("Shape", ["h"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
                 helper.make_node("Concat", ["n", "tail"], ["shape"], axis=0),
                 helper.make_node("Reshape", ["h", "shape"], ["r"]),  # [N, 2, 3], no shape inferred at opset 13
                 helper.make_node("MatMul", ["r", w("w2", 3, OUT)], ["rw"]),
                 helper.make_node("ReduceMean", ["rw"], ["out"], axes=[1], keepdims=0)]
    elif kind in ("embedding", "tied"):  # int32 ids, as a Keras Embedding's (tf2onnx)
        x = helper.make_tensor_value_info("input", TensorProto.INT32, ["N", T])
        nodes = [helper.make_node("Gather", [w("E", VOCAB, H), "input"], ["e"], axis=0),  # [N, T, H]
                 helper.make_node("ReduceMean", ["e"], ["m"], axes=[1], keepdims=0)]
        if kind == "embedding":
            nodes.append(helper.make_node("Gemm", ["m", w("w2", OUT, H), w("b2", OUT)], ["out"], transB=1))
        else:  # the head reads the table transposed: one tied_embedding layer
            nodes += [helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
                      helper.make_node("MatMul", ["m", "Et"], ["out"])]
    else:  # an LSTM over T steps, batch symbolic (its zero initial state is shaped from the input)
        x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", T, IN])
        init["last"] = np.array([T - 1], np.int64)
        init["axes"] = np.array([0], np.int64)
        nodes = [helper.make_node("Transpose", ["input"], ["xt"], perm=[1, 0, 2]),  # time-major [T, N, IN]
                 helper.make_node("LSTM", ["xt", w("W", 1, 4 * H, IN), w("R", 1, 4 * H, H), w("B", 1, 8 * H)],
                                  ["Y"], hidden_size=H),
                 helper.make_node("Gather", ["Y", "last"], ["yl"], axis=0),  # [1, 1, N, H]
                 helper.make_node("Squeeze", ["yl", "axes"], ["s1"]),
                 helper.make_node("Squeeze", ["s1", "axes"], ["s2"]),
                 helper.make_node("Gemm", ["s2", w("w2", OUT, H), w("b2", OUT)], ["out"], transB=1)]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", VOCAB if kind == "tied" else OUT])
    graph = helper.make_graph(nodes, kind, [x], [out],
                              [numpy_helper.from_array(v, k) for k, v in init.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _data(kind: str):
    rng = np.random.default_rng(1)
    if kind in ("embedding", "tied"):
        ids = rng.integers(0, VOCAB, (N, T)).astype(np.int32)
        return {"input": ids}, rng.normal(size=(N, VOCAB if kind == "tied" else OUT)).astype(np.float32)
    shape = {"mlp": (N, IN), "reshape": (N, IN), "conv": (N, 1, 6, 6), "lstm": (N, T, IN)}[kind]
    return {"input": rng.normal(size=shape).astype(np.float32)}, rng.normal(size=(N, OUT)).astype(np.float32)


@pytest.mark.parametrize("opset", [13, 14])
@pytest.mark.parametrize("kind", ["mlp", "conv", "lstm", "embedding", "tied", "reshape"])
def test_a_model_at_an_old_opset_trains_like_its_opset_17_conversion(kind, opset):
    old = _model(kind, opset)
    new = version_converter.convert_version(old, 17)
    inputs, y = _data(kind)
    plans = {o: kc.compile(m, loss="squared_error", output="out", emit=False) for o, m in ((opset, old), (17, new))}
    (loss_old, g_old), (loss_new, g_new) = (gradients(plans[o], inputs, y) for o in (opset, 17))
    assert loss_old == pytest.approx(loss_new, rel=1e-6)
    for p, g in g_new.items():
        np.testing.assert_allclose(g_old[p], g, rtol=1e-5, atol=1e-6 * np.abs(g).max())
    for optimizer in ("kfac", "sgd"):
        runs = {}
        for o, plan in plans.items():
            tr = Trainer(plan, optimizer=optimizer, seed=0, learning_rate=None if optimizer == "kfac" else 0.05)
            metrics = [tr.step(inputs, y) for _ in range(3)]
            assert all(m["rejected"] == 0.0 for m in metrics) and metrics[-1]["loss"] < metrics[0]["loss"]
            runs[o] = tr.parameters()
        for p, v in runs[17].items():
            np.testing.assert_allclose(runs[opset][p], v, rtol=1e-4, atol=1e-5 * np.abs(v).max())
