"""Every differentiation rule against central finite differences (float64, onnx.reference),
in static-shape and symbolic-shape form, plus an ONNX Runtime (CPU, float32) run of each
emitted derivative graph compared loosely with the float64 result."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from kfac_compiler.errors import UnsupportedOpError
from kfac_compiler.oprules import RULES, Rule, find, lookup, register, supported_ops
from kfac_compiler.oprules.check import (
    convert_float_type,
    derivative_model,
    fd_check,
    one_node_model,
    run_ort,
    run_reference,
)

RNG = np.random.default_rng(1234)  # the case table's draws, made once at import (tests draw from their `rng`)


def r(*shape, lo=None):
    """Random normal array; with `lo`, magnitudes pushed to >= lo (away from kinks/zero)."""
    a = RNG.standard_normal(shape)
    if lo is not None:
        a = np.sign(a) * (np.abs(a) + lo)
        a[a == 0] = lo
    return a


def pos(*shape):
    return RNG.uniform(0.5, 2.0, shape)


def f32(*v):
    return np.asarray(v, dtype=np.float32)


def i64(*v):
    return np.asarray(v, dtype=np.int64)


@dataclass
class Case:
    id: str
    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)
    opset: int = 17
    n_out: int = 1
    runtime: tuple = ()
    symbolic: bool = True  # also run with symbolic input dims
    ort: bool = True
    jvp: bool = True
    rtol: float = 1e-5
    outputs: tuple | None = None  # outputs to seed (default: all float outputs)
    consts: tuple = ()  # float inputs made initializers (constants)
    runner: str = "reference"  # "ort": float32 FD on ORT (op wrong in onnx.reference)
    keep_dtype: tuple = ()  # float inputs that keep their dtype (Resize's float32 scales)
    wrt: tuple | None = None  # inputs differentiated (default: every float graph input)

    def __repr__(self) -> str:
        return self.id


# RoiAlign's boxes (x1, y1, x2, y2): inside, over the top-left edge, past the far edges, under a pixel
ROIS = np.asarray([[0.3, 0.2, 4.1, 3.7], [-1.4, -0.8, 2.6, 2.9], [1.5, 2.0, 6.8, 7.5], [2.2, 1.1, 2.6, 1.5]])


def C(id, op, inputs, **kw):
    return Case(id, op, inputs, **kw)


UNARY = [
    ("Identity", r(3, 4), {}), ("Neg", r(3, 4), {}), ("Sqrt", pos(3, 4), {}),
    ("Reciprocal", r(3, 4, lo=0.5), {}), ("Abs", r(3, 4, lo=0.1), {}), ("Exp", r(3, 4), {}),
    ("Log", pos(3, 4), {}), ("Relu", r(3, 4, lo=0.05), {}), ("LeakyRelu", r(3, 4, lo=0.05), {"alpha": 0.1}),
    ("Elu", r(3, 4, lo=0.05), {"alpha": 0.5}), ("Selu", r(3, 4, lo=0.05), {}),
    ("Celu", r(3, 4, lo=0.05), {"alpha": 0.7}), ("ThresholdedRelu", r(3, 4, lo=0.05) + 0.3, {"alpha": 0.3}),
    ("Tanh", r(3, 4), {}), ("Sigmoid", r(3, 4), {}), ("HardSigmoid", 3 * r(3, 4, lo=0.05), {"alpha": 0.3, "beta": 0.4}),
    ("Softplus", r(3, 4), {}), ("Softsign", r(3, 4, lo=0.05), {}), ("Erf", r(3, 4), {}),
    ("Sin", r(3, 4), {}), ("Cos", r(3, 4), {}), ("Tan", 0.5 * r(3, 4), {}), ("Atan", r(3, 4), {}),
    ("Sinh", r(3, 4), {}), ("Cosh", r(3, 4), {}),
]

CASES = [C(f"{op}", op, [("x", x)], attrs=a) for op, x, a in UNARY] + [
    C("HardSwish", "HardSwish", [("x", 2.5 * r(3, 4, lo=0.05))], opset=14),
    C("Gelu-none", "Gelu", [("x", r(3, 4))], opset=20),
    C("Gelu-tanh", "Gelu", [("x", r(3, 4))], attrs={"approximate": "tanh"}, opset=20),
    # ---------------------------------------------------------------- broadcasting binary
    C("Add-bcast", "Add", [("a", r(3, 4)), ("b", r(4))]),
    C("Add-both", "Add", [("a", r(1, 4)), ("b", r(3, 1))]),
    C("Sub-bcast", "Sub", [("a", r(2, 3, 4)), ("b", r(3, 1))]),
    C("Sub-scalar", "Sub", [("a", r()), ("b", r(2, 3))]),
    C("Mul-bcast", "Mul", [("a", r(2, 3, 4)), ("b", r(3, 1))]),
    C("Mul-same", "Mul", [("a", r(2, 3)), ("b", r(2, 3))]),
    C("Div-bcast", "Div", [("a", r(2, 3, 4)), ("b", r(4, lo=0.5))]),
    C("Pow-const3", "Pow", [("x", r(3, 4)), ("e", np.asarray(3.0))], consts=("e",)),
    C("Pow-const2", "Pow", [("x", r(3, 4)), ("e", np.asarray(2.0))], consts=("e",)),
    C("Pow-consthalf", "Pow", [("x", pos(3, 4)), ("e", np.asarray(0.5))], consts=("e",)),
    C("Pow-const-neg", "Pow", [("x", pos(3, 4)), ("e", np.asarray(-1.5))], consts=("e",)),
    C("Pow-tensor", "Pow", [("x", pos(3, 4)), ("e", r(4))]),
    C("Pow-int", "Pow", [("x", r(3, 4)), ("e", i64(2))]),
    C("PRelu", "PRelu", [("x", r(2, 3, 4, 4, lo=0.05)), ("s", r(3, 1, 1))]),
    C("Sum3", "Sum", [("a", r(2, 3)), ("b", r(3)), ("c", r(2, 1))]),
    C("Mean2", "Mean", [("a", r(2, 3)), ("b", r(3))]),
    C("Max3", "Max", [("a", r(2, 3)), ("b", r(3)), ("c", r(2, 1))]),
    C("Min2", "Min", [("a", r(2, 3)), ("b", r(2, 3))]),
    C("Where", "Where", [("c", RNG.random((2, 3)) > 0.5), ("a", r(2, 3)), ("b", r(3))]),
    C("Clip-const", "Clip", [("x", r(3, 4, lo=0.01)), ("lo", np.asarray(-0.5)), ("hi", np.asarray(0.7))],
      consts=("lo", "hi")),
    C("Clip-diff-bounds", "Clip", [("x", r(3, 4, lo=0.01)), ("lo", np.asarray(-0.5)), ("hi", np.asarray(0.7))]),
    # min > max (valid ONNX): y = max everywhere, the whole cotangent to hi (the rule split it)
    C("Clip-inverted-bounds", "Clip", [("x", r(3, 4, lo=0.01)), ("lo", np.asarray(0.6)), ("hi", np.asarray(-0.4))]),
    C("Clip-minonly", "Clip", [("x", r(3, 4, lo=0.01)), ("lo", np.asarray(-0.5))]),
    C("Clip-none", "Clip", [("x", r(3, 4))]),
    C("Cast", "Cast", [("x", r(3, 4))], attrs={"to": TensorProto.DOUBLE}),
    C("Dropout-inference", "Dropout", [("x", r(3, 4)), ("ratio", np.asarray(0.3))], consts=("ratio",)),
    C("Dropout-mask-off", "Dropout", [("x", r(3, 4)), ("ratio", np.asarray(0.3)), ("t", np.asarray(False))],
      n_out=2, consts=("ratio",)),
    C("Dropout-training", "Dropout", [("x", r(3, 4)), ("ratio", np.asarray(0.3)), ("t", np.asarray(True))],
      attrs={"seed": 3}, n_out=2, consts=("ratio",), ort=False),
    # ------------------------------------------------------------------------- linalg
    *[
        C(f"Gemm-tA{ta}-tB{tb}-C{cs}", "Gemm",
          [("a", r(4, 3) if ta else r(3, 4)), ("b", r(5, 4) if tb else r(4, 5)), ("c", r(*cs) if cs != "none" else None)],
          attrs={"transA": ta, "transB": tb, "alpha": 0.7, "beta": 1.3})
        for ta in (0, 1) for tb in (0, 1) for cs in ([5], [3, 1]) 
    ],
    C("Gemm-C-full", "Gemm", [("a", r(3, 4)), ("b", r(4, 5)), ("c", r(3, 5))]),
    C("Gemm-C-scalar", "Gemm", [("a", r(3, 4)), ("b", r(4, 5)), ("c", r(1))], attrs={"beta": 0.5}),
    C("Gemm-noC", "Gemm", [("a", r(3, 4)), ("b", r(5, 4))], attrs={"transB": 1}),
    C("MatMul-1x1", "MatMul", [("a", r(4)), ("b", r(4))]),
    C("MatMul-1x2", "MatMul", [("a", r(4)), ("b", r(4, 5))]),
    C("MatMul-2x1", "MatMul", [("a", r(3, 4)), ("b", r(4))]),
    C("MatMul-2x2", "MatMul", [("a", r(3, 4)), ("b", r(4, 5))]),
    C("MatMul-3x2", "MatMul", [("a", r(2, 3, 4)), ("b", r(4, 5))]),
    C("MatMul-3x1", "MatMul", [("a", r(2, 3, 4)), ("b", r(4))]),
    C("MatMul-1x3", "MatMul", [("a", r(4)), ("b", r(2, 4, 5))]),
    C("MatMul-2x3", "MatMul", [("a", r(3, 4)), ("b", r(2, 4, 5))]),
    C("MatMul-4x3-bcast", "MatMul", [("a", r(2, 1, 3, 4)), ("b", r(3, 4, 5))]),
    C("MatMul-3x3", "MatMul", [("a", r(2, 3, 4)), ("b", r(2, 4, 5))]),
    # ----------------------------------------------------------------- softmax family
    C("Softmax-ax1", "Softmax", [("x", r(2, 3, 4))], attrs={"axis": 1}),
    C("Softmax-last", "Softmax", [("x", r(2, 3, 4))]),
    C("LogSoftmax-ax0", "LogSoftmax", [("x", r(2, 3, 4))], attrs={"axis": 0}),
    C("Softmax-opset12-flatten", "Softmax", [("x", r(2, 3, 4))], attrs={"axis": 1}, opset=12),
    C("LogSoftmax-opset11-flatten", "LogSoftmax", [("x", r(2, 3, 4))], attrs={"axis": 1}, opset=11),
    *[
        C(f"SCE-{red}{'-w' if w else ''}{'-ii' if ii else ''}{'-lp' if lp else ''}", "SoftmaxCrossEntropyLoss",
          [("s", r(5, 4)), ("y", i64(0, 3, 1, 3, 2)), ("w", pos(4) if w else None)],
          attrs={"reduction": red, **({"ignore_index": 3} if ii else {})}, n_out=2 if lp else 1)
        for red, w, ii, lp in [("mean", 0, 0, 0), ("sum", 0, 0, 0), ("none", 0, 0, 0), ("mean", 1, 0, 0),
                               ("mean", 0, 1, 0), ("mean", 1, 1, 1), ("none", 1, 1, 1), ("sum", 0, 0, 1)]
    ],
    C("SCE-3d", "SoftmaxCrossEntropyLoss", [("s", r(2, 4, 3)), ("y", i64([0, 3, 1], [2, 2, 0]))]),
    C("SCE-ii-neg", "SoftmaxCrossEntropyLoss", [("s", r(3, 4)), ("y", i64(0, -100, 2))],
      attrs={"ignore_index": -100}),
    C("NLL-mean-w", "NegativeLogLikelihoodLoss", [("x", r(5, 4)), ("y", i64(0, 3, 1, 3, 2)), ("w", pos(4))]),
    C("NLL-none-ii", "NegativeLogLikelihoodLoss", [("x", r(2, 4, 3)), ("y", i64([0, 3, 1], [2, 2, 0]))],
      attrs={"reduction": "none", "ignore_index": 2}),
    # --------------------------------------------------------------------------- conv
    C("Conv1d", "Conv", [("x", r(2, 3, 9)), ("w", r(4, 3, 3)), ("b", r(4))], attrs={"strides": [2], "pads": [1, 2]}),
    C("Conv2d-basic", "Conv", [("x", r(2, 3, 6, 6)), ("w", r(4, 3, 3, 3)), ("b", r(4))], attrs={"pads": [1, 1, 1, 1]}),
    C("Conv2d-stride-dil", "Conv", [("x", r(2, 3, 9, 8)), ("w", r(4, 3, 3, 2))],
      attrs={"strides": [2, 3], "pads": [1, 0, 2, 1], "dilations": [2, 1]}),
    C("Conv2d-group2", "Conv", [("x", r(2, 4, 7, 6)), ("w", r(6, 2, 3, 3)), ("b", r(6))],
      attrs={"group": 2, "pads": [1, 1, 1, 1], "strides": [2, 1]}),
    C("Conv2d-depthwise", "Conv", [("x", r(2, 3, 5, 5)), ("w", r(3, 1, 3, 3)), ("b", r(3))],
      attrs={"group": 3, "pads": [1, 1, 1, 1]}),
    C("Conv2d-same-upper", "Conv", [("x", r(1, 2, 7, 6)), ("w", r(3, 2, 3, 2))],
      attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]}, symbolic=False),
    C("Conv2d-same-lower", "Conv", [("x", r(1, 2, 6, 6)), ("w", r(3, 2, 4, 4))],
      attrs={"auto_pad": "SAME_LOWER"}, symbolic=False),
    C("Conv2d-valid", "Conv", [("x", r(1, 2, 6, 6)), ("w", r(3, 2, 3, 3))], attrs={"auto_pad": "VALID", "strides": [2, 2]}),
    C("Conv3d", "Conv", [("x", r(1, 2, 4, 5, 4)), ("w", r(2, 2, 2, 3, 2)), ("b", r(2))],
      attrs={"strides": [1, 2, 1], "pads": [1, 1, 0, 0, 1, 1]}),
    C("ConvT2d", "ConvTranspose", [("x", r(2, 3, 4, 4)), ("w", r(3, 2, 3, 3)), ("b", r(2))],
      attrs={"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]}),
    C("ConvT2d-group", "ConvTranspose", [("x", r(1, 4, 3, 4)), ("w", r(4, 3, 2, 3))],
      attrs={"group": 2, "strides": [2, 1], "dilations": [1, 2]}),
    C("ConvT1d", "ConvTranspose", [("x", r(2, 2, 5)), ("w", r(2, 3, 4)), ("b", r(3))], attrs={"strides": [3], "pads": [2, 1]}),
    C("ConvT2d-all", "ConvTranspose", [("x", r(2, 4, 3, 4)), ("w", r(4, 3, 3, 2)), ("b", r(6))],
      attrs={"group": 2, "strides": [2, 3], "pads": [1, 0, 2, 1], "output_padding": [1, 2], "dilations": [2, 1]}),
    C("ConvT3d", "ConvTranspose", [("x", r(1, 2, 2, 3, 2)), ("w", r(2, 2, 2, 2, 3)), ("b", r(2))],
      attrs={"strides": [2, 1, 2], "pads": [0, 1, 1, 0, 0, 1]}),
    C("ConvT2d-output-shape", "ConvTranspose", [("x", r(1, 2, 3, 3)), ("w", r(2, 2, 3, 3))],
      attrs={"strides": [2, 2], "output_shape": [6, 7]}, symbolic=False, runner="ort"),
    # -------------------------------------------------------------------------- pools
    C("MaxPool-2x2", "MaxPool", [("x", r(2, 3, 6, 6))], attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
    C("MaxPool-2x2-remainder", "MaxPool", [("x", r(2, 3, 7, 5))], attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
    C("MaxPool-1d-tiled", "MaxPool", [("x", r(2, 3, 10))], attrs={"kernel_shape": [3], "strides": [3]}),
    C("MaxPool-overlap-pads", "MaxPool", [("x", r(2, 2, 6, 5))], attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    C("MaxPool-dil-ceil", "MaxPool", [("x", r(1, 2, 7, 7))],
      attrs={"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 1], "ceil_mode": 1}),
    C("MaxPool-indices-out", "MaxPool", [("x", r(1, 2, 5, 5))], attrs={"kernel_shape": [2, 2]}, n_out=2),
    C("MaxPool-storage1", "MaxPool", [("x", r(1, 2, 5, 4))], attrs={"kernel_shape": [2, 2], "storage_order": 1}, n_out=2),
    C("MaxPool-1d", "MaxPool", [("x", r(2, 3, 9))], attrs={"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    C("MaxPool-3d", "MaxPool", [("x", r(1, 2, 4, 4, 4))], attrs={"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
    C("MaxPool-opset13-overlap", "MaxPool", [("x", r(1, 2, 6, 6))], attrs={"kernel_shape": [3, 3], "strides": [1, 2]},
      opset=13),
    C("MaxPool-opset13-disjoint", "MaxPool", [("x", r(1, 2, 6, 6))], attrs={"kernel_shape": [2, 2], "strides": [2, 2]},
      opset=13),
    C("AvgPool-basic", "AveragePool", [("x", r(2, 3, 6, 6))], attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
    C("AvgPool-pads-excl", "AveragePool", [("x", r(2, 2, 6, 5))],
      attrs={"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 1, 1, 1]}, symbolic=False),
    C("AvgPool-pads-incl", "AveragePool", [("x", r(2, 2, 6, 5))],
      attrs={"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 0, 1, 2], "count_include_pad": 1}),
    C("AvgPool-ceil", "AveragePool", [("x", r(1, 2, 7, 7))],
      attrs={"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, symbolic=False),
    C("AvgPool-1d", "AveragePool", [("x", r(2, 3, 9))], attrs={"kernel_shape": [3], "strides": [3]}),
    C("AvgPool-3d", "AveragePool", [("x", r(1, 2, 4, 4, 4))], attrs={"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
    C("AvgPool-dilations-19", "AveragePool", [("x", r(1, 2, 7, 7))],
      attrs={"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [1, 2]}, opset=19),
    C("GlobalAveragePool", "GlobalAveragePool", [("x", r(2, 3, 4, 5))]),
    C("GlobalMaxPool", "GlobalMaxPool", [("x", r(2, 3, 4, 5))]),
    # ------------------------------------------------------------------ normalization
    C("BN-inference", "BatchNormalization", [("x", r(2, 3, 4, 4)), ("s", r(3)), ("b", r(3)), ("m", r(3)), ("v", pos(3))],
      attrs={"epsilon": 1e-3}),
    C("BN-inference-2d", "BatchNormalization", [("x", r(4, 3)), ("s", r(3)), ("b", r(3)), ("m", r(3)), ("v", pos(3))]),
    C("BN-training", "BatchNormalization", [("x", r(4, 3, 2, 2)), ("s", r(3)), ("b", r(3)), ("m", r(3)), ("v", pos(3))],
      attrs={"training_mode": 1}, opset=15, n_out=3, outputs=("y0",)),
    C("LN-last", "LayerNormalization", [("x", r(2, 3, 5)), ("s", r(5)), ("b", r(5))]),
    C("LN-axis1", "LayerNormalization", [("x", r(2, 3, 4)), ("s", r(3, 4)), ("b", r(4))], attrs={"axis": 1, "epsilon": 1e-3}),
    C("LN-nobias-stats", "LayerNormalization", [("x", r(3, 6)), ("s", r(6))], n_out=3),
    C("InstanceNorm", "InstanceNormalization", [("x", r(2, 3, 4, 3)), ("s", r(3)), ("b", r(3))]),
    # ----------------------------------------------------------------- data movement
    C("Reshape-0-neg1", "Reshape", [("x", r(2, 3, 4)), ("sh", i64(0, -1, 2))]),
    C("Flatten-ax2", "Flatten", [("x", r(2, 3, 4, 2))], attrs={"axis": 2}),
    C("Flatten-ax0", "Flatten", [("x", r(2, 3))], attrs={"axis": 0}),
    C("Squeeze", "Squeeze", [("x", r(2, 1, 3, 1)), ("ax", i64(1, -1))]),
    C("Squeeze-all", "Squeeze", [("x", r(2, 1, 3, 1))], symbolic=False),
    C("Unsqueeze", "Unsqueeze", [("x", r(2, 3)), ("ax", i64(0, -1))]),
    C("Transpose-perm", "Transpose", [("x", r(2, 3, 4))], attrs={"perm": [1, 2, 0]}),
    C("Transpose-default", "Transpose", [("x", r(2, 3, 4))]),
    C("Concat-ax1", "Concat", [("a", r(2, 3)), ("b", r(2, 1)), ("c", r(2, 4))], attrs={"axis": 1}),
    C("Concat-neg", "Concat", [("a", r(2, 3, 2)), ("b", r(2, 3, 1))], attrs={"axis": -1}),
    C("Split-13-input", "Split", [("x", r(2, 7)), ("sp", i64(2, 5))], attrs={"axis": 1}, n_out=2),
    C("Split-13-equal", "Split", [("x", r(6, 2))], n_out=3),
    C("Split-18-num", "Split", [("x", r(2, 7))], attrs={"axis": 1, "num_outputs": 3}, n_out=3, opset=18),
    C("Slice-basic", "Slice", [("x", r(5, 6)), ("s", i64(1, 2)), ("e", i64(4, 100)), ("a", i64(0, 1))]),
    C("Slice-neg-steps", "Slice", [("x", r(5, 6, 3)), ("s", i64(-1, 0)), ("e", i64(-100, 6)), ("a", i64(0, 1)),
                                    ("st", i64(-2, 3))]),
    C("Slice-noaxes", "Slice", [("x", r(5, 6)), ("s", i64(-3,)), ("e", i64(-1,))]),
    C("Slice-runtime", "Slice", [("x", r(5, 6)), ("s", i64(1, -5)), ("e", i64(4, 6)), ("a", i64(0, 1)), ("st", i64(2, 1))],
      runtime=("s", "e")),
    C("Expand", "Expand", [("x", r(3, 1)), ("sh", i64(2, 3, 4))]),
    C("Gather-ax0", "Gather", [("x", r(5, 4)), ("i", i64([0, 3], [3, -1]))]),
    C("Gather-ax1", "Gather", [("x", r(3, 5, 4)), ("i", i64([0, 3], [3, 4]))], attrs={"axis": 1}),
    C("Gather-neg-axis-scalar", "Gather", [("x", r(3, 5, 4)), ("i", np.asarray(2, np.int64))], attrs={"axis": -1}),
    C("Gather-runtime-idx", "Gather", [("x", r(5, 4)), ("i", i64(1, -2, 1))], runtime=("i",)),
    C("Gather-opset13", "Gather", [("x", r(3, 5, 2)), ("i", i64([0, 3, 3], [-1, 4, 0]))], attrs={"axis": 1}, opset=13),
    C("GatherElements", "GatherElements", [("x", r(3, 4)), ("i", i64([0, 3, 3, 1], [2, 2, 0, -1], [1, 1, 1, 1]))],
      attrs={"axis": 1}),
    C("GatherND", "GatherND", [("x", r(3, 4, 2)), ("i", i64([0, 1], [2, 3], [0, 1]))]),
    C("ScatterND", "ScatterND", [("x", r(3, 4, 2)), ("i", i64([0, 1], [2, 3])), ("u", r(2, 2))], opset=16),
    C("ScatterND-add-duplicates", "ScatterND", [("x", r(3, 4, 2)), ("i", i64([0, 1], [2, 3], [0, 1])), ("u", r(3, 2))],
      attrs={"reduction": "add"}, opset=16),
    C("ScatterND-rows", "ScatterND", [("x", r(5, 3)), ("i", i64([4], [1])), ("u", r(2, 3))], opset=18),
    C("ScatterElements", "ScatterElements", [("x", r(3, 4)), ("i", i64([0, 3], [2, 1], [1, 0])), ("u", r(3, 2))],
      attrs={"axis": 1}, opset=16),
    C("ScatterElements-add", "ScatterElements", [("x", r(3, 4)), ("i", i64([0, 0], [2, -1], [3, 3])),
                                                 ("u", r(3, 2))], attrs={"axis": 1, "reduction": "add"}, opset=16),
    C("Pad-const", "Pad", [("x", r(2, 3)), ("p", i64(1, 0, 2, 3))]),
    C("Pad-negative", "Pad", [("x", r(4, 5)), ("p", i64(-1, 2, 1, -2)), ("v", np.asarray(0.5))], runner="ort"),
    C("Pad-const-value", "Pad", [("x", r(2, 3)), ("p", i64(1, 0, 2, 3)), ("v", np.asarray(0.5))]),
    C("Pad-axes-18", "Pad", [("x", r(2, 3, 4)), ("p", i64(1, 2)), ("v", None), ("ax", i64(-1))], opset=18),
    C("Tile", "Tile", [("x", r(2, 3)), ("rep", i64(2, 3))]),
    C("TopK", "TopK", [("x", r(3, 6)), ("k", i64(3))], attrs={"axis": 1}, n_out=2),
    C("CumSum", "CumSum", [("x", r(3, 4)), ("ax", np.asarray(1, np.int64))]),
    C("CumSum-excl-rev", "CumSum", [("x", r(3, 4)), ("ax", np.asarray(0, np.int64))], attrs={"exclusive": 1, "reverse": 1}),
    C("Trilu", "Trilu", [("x", r(2, 4, 4)), ("k", np.asarray(1, np.int64))], attrs={"upper": 0}),
    C("DepthToSpace", "DepthToSpace", [("x", r(1, 8, 2, 3))], attrs={"blocksize": 2}),
    C("SpaceToDepth", "SpaceToDepth", [("x", r(1, 2, 4, 6))], attrs={"blocksize": 2}),
    # ---------------------------------------------------------------------- reductions
    C("ReduceSum-axes-keep", "ReduceSum", [("x", r(2, 3, 4)), ("ax", i64(1))]),
    C("ReduceSum-axes-nokeep", "ReduceSum", [("x", r(2, 3, 4)), ("ax", i64(0, -1))], attrs={"keepdims": 0}),
    C("ReduceSum-all", "ReduceSum", [("x", r(2, 3))], attrs={"keepdims": 0}),
    C("ReduceSum-noop", "ReduceSum", [("x", r(2, 3))], attrs={"noop_with_empty_axes": 1}),
    C("ReduceSum-runtime-axes", "ReduceSum", [("x", r(2, 3, 4)), ("ax", i64(1))], attrs={"keepdims": 0},
      runtime=("ax",)),
    C("ReduceMean-attr", "ReduceMean", [("x", r(2, 3, 4))], attrs={"axes": [1], "keepdims": 0}),
    C("ReduceMean-18-input", "ReduceMean", [("x", r(2, 3, 4)), ("ax", i64(-1, 0))], opset=18),
    C("ReduceMean-all", "ReduceMean", [("x", r(2, 3, 4))]),
    C("ReduceSumSquare", "ReduceSumSquare", [("x", r(2, 3, 4))], attrs={"axes": [2], "keepdims": 0}),
    C("ReduceL1", "ReduceL1", [("x", r(2, 3, 4, lo=0.05))], attrs={"axes": [1]}),
    C("ReduceL2", "ReduceL2", [("x", r(2, 3, 4))], attrs={"axes": [0, 2], "keepdims": 0}),
    C("ReduceLogSumExp", "ReduceLogSumExp", [("x", r(2, 3, 4))], attrs={"axes": [1]}),
    C("ReduceMax", "ReduceMax", [("x", r(2, 3, 4))], attrs={"axes": [1], "keepdims": 0}),
    C("ReduceMin-18", "ReduceMin", [("x", r(2, 3, 4)), ("ax", i64(2))], opset=18),
    # -------------------------------------------------------------------------- resize
    *[C(f"Resize-{id}", "Resize", [("x", x), ("roi", None), ("sc", f32(*sc) if sc else None)] + ([("sz", i64(*sz))] if sz else []),
        attrs=a, consts=("sc",), keep_dtype=("sc",), opset=op, symbolic=False)
      for id, x, sc, sz, a, op, sym in [
          ("nearest-x2", r(2, 3, 3, 4), (1, 1, 2, 2), None,
           {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, 17, True),
          ("nearest-sizes-down", r(1, 2, 7, 6), None, (1, 2, 3, 4), {"mode": "nearest"}, 17, True),
          ("bilinear-x2", r(2, 2, 3, 4), (1, 1, 2, 2), None,
           {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, 17, True),
          ("bilinear-align-sizes", r(1, 2, 3, 4), None, (1, 2, 5, 7),
           {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, 17, True),
          ("linear-1d-x3", r(2, 3, 4), (1, 1, 3), None, {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
           17, True),
          ("trilinear-3d", r(1, 1, 2, 3, 2), (1, 1, 2, 1.5, 2), None,
           {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, 17, True),
          ("bicubic", r(1, 2, 4, 4), (1, 1, 2, 2), None, {"mode": "cubic", "coordinate_transformation_mode": "half_pixel"},
           17, True),
          ("linear-antialias-down", r(1, 2, 8, 6), (1, 1, 0.5, 0.5), None, {"mode": "linear", "antialias": 1}, 18, True),
          ("axes-18", r(2, 3, 4, 4), (2, 2), None, {"mode": "nearest", "axes": [2, 3]}, 18, True),
      ]],
    # --------------------------------------------------------------- opset 23+ ops
    C("RMSNorm-last", "RMSNormalization", [("x", r(2, 3, 5)), ("s", r(5))], opset=23),
    C("RMSNorm-axis1", "RMSNormalization", [("x", r(2, 3, 4)), ("s", r(3, 4))], attrs={"axis": 1, "epsilon": 1e-3},
      opset=23),
    C("RMSNorm-bcast-scale", "RMSNormalization", [("x", r(2, 3, 4)), ("s", r(1, 4))], attrs={"axis": -2}, opset=23),
    C("Swish", "Swish", [("x", r(3, 4))], opset=24),
    C("Swish-alpha", "Swish", [("x", r(3, 4))], attrs={"alpha": 0.7}, opset=24),
    C("Attention-mha", "Attention", [("q", r(2, 2, 3, 4)), ("k", r(2, 2, 5, 4)), ("v", r(2, 2, 5, 3))], opset=23, symbolic=False),
    C("Attention-gqa-causal", "Attention", [("q", r(1, 4, 3, 4)), ("k", r(1, 2, 3, 4)), ("v", r(1, 2, 3, 4))],
      attrs={"is_causal": 1}, opset=23, symbolic=False),
    C("Attention-3d-heads-scale", "Attention", [("q", r(2, 3, 8)), ("k", r(2, 4, 4)), ("v", r(2, 4, 6))],
      attrs={"q_num_heads": 2, "kv_num_heads": 1, "scale": 0.3}, opset=23, symbolic=False),
    C("Attention-float-mask", "Attention", [("q", r(2, 2, 3, 4)), ("k", r(2, 2, 5, 4)), ("v", r(2, 2, 5, 4)),
                                            ("m", r(3, 5))], opset=23, symbolic=False),
    C("Attention-bool-mask-24", "Attention", [("q", r(1, 2, 3, 4)), ("k", r(1, 2, 4, 4)), ("v", r(1, 2, 4, 4)),
                                              ("m", np.tril(np.ones((3, 4), bool)) | np.eye(3, 4, 1, dtype=bool))],
      opset=24, symbolic=False),
    C("RotaryEmbedding-4d", "RotaryEmbedding", [("x", r(2, 2, 3, 4)), ("cos", np.cos(r(2, 3, 2))), ("sin", np.sin(r(2, 3, 2)))],
      consts=("cos", "sin"), opset=23, symbolic=False),
    C("RotaryEmbedding-3d-pos-partial-interleaved", "RotaryEmbedding",
      [("x", r(2, 3, 12)), ("cos", np.cos(r(5, 2))), ("sin", np.sin(r(5, 2))), ("pos", i64([0, 2, 4], [1, 1, 3]))],
      attrs={"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1}, consts=("cos", "sin"), opset=23, symbolic=False),
    # -------------------------------------------------------------------------- einsum
    C("Einsum-matmul", "Einsum", [("a", r(3, 4)), ("b", r(4, 5))], attrs={"equation": "ij,jk->ik"}),
    C("Einsum-attn", "Einsum", [("q", r(2, 3, 4, 5)), ("k", r(2, 3, 6, 5))], attrs={"equation": "bhqd,bhkd->bhqk"}),
    C("Einsum-implicit", "Einsum", [("a", r(3, 4)), ("b", r(4, 5))], attrs={"equation": "ij,jk"}),
    C("Einsum-three", "Einsum", [("a", r(2, 3)), ("b", r(3, 4)), ("c", r(4, 2))], attrs={"equation": "ij,jk,kl->il"}),
    C("Einsum-sum-only-in-a", "Einsum", [("a", r(3, 4, 2)), ("b", r(4, 5))], attrs={"equation": "ijm,jk->ik"}),
    C("Einsum-transpose", "Einsum", [("a", r(2, 3, 4))], attrs={"equation": "ijk->kij"}),
    C("Einsum-trace", "Einsum", [("a", r(4, 4))], attrs={"equation": "ii->"}),
    C("Einsum-diag", "Einsum", [("a", r(3, 4, 3))], attrs={"equation": "iji->ij"}),
    C("Einsum-diag-bilinear", "Einsum", [("a", r(3, 3)), ("b", r(3, 2))], attrs={"equation": "ii,ij->j"}),
    C("Einsum-outer", "Einsum", [("a", r(3)), ("b", r(4))], attrs={"equation": "i,j->ij"}),
    C("Einsum-ellipsis", "Einsum", [("a", r(2, 3, 4, 5)), ("b", r(5, 6))], attrs={"equation": "...ij,jk->...ik"},
      symbolic=False),
    C("Einsum-ellipsis-both", "Einsum", [("a", r(2, 3, 4)), ("b", r(2, 4, 5))], attrs={"equation": "...ij,...jk->...ik"},
      symbolic=False),
    # inverse trigonometric / hyperbolic and Mish (torch.asin, ..., nn.Mish export them); last so
    # that the draws above stay as they were; inside each domain, away from its edges
    C("Asin", "Asin", [("x", RNG.uniform(-0.8, 0.8, (3, 4)))]),
    C("Acos", "Acos", [("x", RNG.uniform(-0.8, 0.8, (3, 4)))]),
    C("Asinh", "Asinh", [("x", r(3, 4))]),
    C("Acosh", "Acosh", [("x", RNG.uniform(1.2, 3.0, (3, 4)))]),
    C("Atanh", "Atanh", [("x", RNG.uniform(-0.8, 0.8, (3, 4)))]),
    C("Mish", "Mish", [("x", r(3, 4))], opset=18),
    # issue 38: differentiable ops without rules (torch.prod, F.softshrink/hardshrink, torch.fmod,
    # F.grid_sample, F.fold, ... ; benchmarks/results/2026-11-29-op-coverage.md); last, as above
    C("ReduceProd-axis", "ReduceProd", [("x", r(2, 3, 4, lo=0.3))], attrs={"axes": [1], "keepdims": 0}),
    C("ReduceProd-18-all", "ReduceProd", [("x", r(2, 3, lo=0.3))], opset=18),
    C("ReduceProd-18-input-axes", "ReduceProd", [("x", r(3, 2, 4, lo=0.3)), ("ax", i64(0, -1))], opset=18),
    C("ReduceProd-zeros", "ReduceProd", [("x", r(3, 4) * np.array([[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 1, 1]]))],
      attrs={"axes": [1]}),  # one zero in a row: its partner product; two: all zero
    C("ReduceLogSum", "ReduceLogSum", [("x", pos(2, 3, 4))], attrs={"axes": [2], "keepdims": 0}),
    C("ReduceLogSum-18-input-axes", "ReduceLogSum", [("x", pos(2, 3, 4)), ("ax", i64(1))], opset=18),
    C("Shrink-soft", "Shrink", [("x", 2 * r(3, 4, lo=0.1))], attrs={"lambd": 0.5, "bias": 0.5}),
    C("Shrink-hard", "Shrink", [("x", 2 * r(3, 4, lo=0.1))], attrs={"lambd": 0.5}),
    C("Mod-fmod-bcast", "Mod", [("a", 3 * r(2, 3, 4)), ("b", pos(4) + 0.3)], attrs={"fmod": 1}),
    C("Mod-fmod-neg-divisor", "Mod", [("a", 3 * r(3, 4)), ("b", -pos(3, 4))], attrs={"fmod": 1}),
    C("LpNormalization-p2", "LpNormalization", [("x", r(2, 3, 4))], attrs={"axis": 1}),
    C("LpNormalization-p1-last", "LpNormalization", [("x", r(3, 5, lo=0.1))], attrs={"p": 1}),
    C("LRN-odd", "LRN", [("x", r(2, 5, 3, 2))], attrs={"size": 3, "alpha": 0.5, "beta": 0.75, "bias": 1.5}),
    C("LRN-even", "LRN", [("x", r(2, 6, 4, 1))], attrs={"size": 4, "alpha": 0.8, "beta": 0.6, "bias": 2.0},
      ort=False),  # ONNX Runtime's LRN takes odd sizes only
    C("MVN-default", "MeanVarianceNormalization", [("x", r(2, 3, 2, 3))]),
    C("MVN-axes", "MeanVarianceNormalization", [("x", r(2, 3, 4))], attrs={"axes": [2]}),
    C("ReverseSequence", "ReverseSequence", [("x", r(4, 3, 2)), ("l", i64(4, 1, 3))], attrs={"batch_axis": 1, "time_axis": 0}),
    C("Det-batch", "Det", [("a", r(2, 3, 3))], symbolic=False),
    C("Det-2x2", "Det", [("a", r(2, 2))], symbolic=False),
    C("MaxUnpool", "MaxUnpool", [("x", r(1, 2, 2, 2)), ("i", i64([[[1, 6], [8, 15]], [[16, 19], [28, 30]]]))],
      attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
    C("LpPool-p2-tiled", "LpPool", [("x", r(2, 3, 4, 4))], attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
    C("LpPool-p3-overlap-pads", "LpPool", [("x", r(1, 2, 5, 4, lo=0.1))],
      attrs={"kernel_shape": [3, 2], "pads": [1, 0, 1, 1], "p": 3}),
    C("LpPool-p1-1d", "LpPool", [("x", r(2, 2, 7, lo=0.1))], attrs={"kernel_shape": [3], "strides": [2], "p": 1}),
    # F.grid_sample (both exporters): grid points partly outside [-1, 1]
    C("GridSample-bilinear-zeros", "GridSample", [("x", r(2, 3, 4, 5)), ("g", RNG.uniform(-1.2, 1.2, (2, 3, 2, 2)))],
      opset=16),
    C("GridSample-bilinear-border-align", "GridSample", [("x", r(1, 2, 3, 4)), ("g", RNG.uniform(-1.2, 1.2, (1, 4, 3, 2)))],
      attrs={"padding_mode": "border", "align_corners": 1}, opset=16),
    C("GridSample-linear-20", "GridSample", [("x", r(1, 2, 5, 3)), ("g", RNG.uniform(-1.1, 1.1, (1, 2, 3, 2)))],
      attrs={"mode": "linear"}, opset=20),
    C("GridSample-nearest", "GridSample", [("x", r(2, 2, 4, 4)), ("g", RNG.uniform(-1.2, 1.2, (2, 3, 3, 2)))],
      attrs={"mode": "nearest"}, opset=16),
    # F.fold (dynamo): Col2Im
    C("Col2Im", "Col2Im", [("x", r(2, 3 * 4, 6)), ("im", i64(3, 4)), ("bl", i64(2, 2))], opset=18),
    C("Col2Im-stride-pad-dil", "Col2Im", [("x", r(1, 2 * 6, 3)), ("im", i64(5, 4)), ("bl", i64(2, 3))],
      attrs={"strides": [2, 1], "pads": [1, 0, 0, 1], "dilations": [1, 2]}, opset=18),
    C("AffineGrid-2d", "AffineGrid", [("t", r(2, 2, 3)), ("sz", i64(2, 1, 3, 4))], opset=20),
    C("AffineGrid-3d-align", "AffineGrid", [("t", r(1, 3, 4)), ("sz", i64(1, 2, 2, 3, 2))],
      attrs={"align_corners": 1}, opset=20),
    # torch.fft.rfft / torch.stft (dynamo): DFT, real [..., 1] and complex [..., 2] inputs
    C("DFT-real-onesided", "DFT", [("x", r(2, 8, 1))], attrs={"onesided": 1}),
    C("DFT-complex", "DFT", [("x", r(2, 5, 2))]),
    C("DFT-inverse-axis2", "DFT", [("x", r(2, 3, 6, 2))], attrs={"axis": 2, "inverse": 1}),
    C("DFT-length-pad", "DFT", [("x", r(2, 5, 2)), ("n", np.asarray(8, np.int64))]),
    C("DFT-length-crop-onesided", "DFT", [("x", r(3, 7, 1)), ("n", np.asarray(4, np.int64))], attrs={"onesided": 1}),
    C("DFT-20-axis-input-odd", "DFT", [("x", r(2, 7, 3, 1)), ("n", None), ("ax", np.asarray(1, np.int64))],
      attrs={"onesided": 1}, opset=20),
    C("DFT-20-inverse-real", "DFT", [("x", r(4, 3, 1))], attrs={"inverse": 1}, opset=20),
    # torch.stft: frames (overlapping or not, the signal's tail in none), window or none; onesided
    # spelled out: onnx 1.23's shape inference reads an absent onesided as 0 (its default is 1)
    C("STFT-real-window", "STFT", [("x", r(2, 16, 1)), ("st", np.asarray(4, np.int64)), ("w", r(6))],
      attrs={"onesided": 1}, symbolic=False),
    C("STFT-complex-twosided-overlap", "STFT", [("x", r(1, 10, 2)), ("st", np.asarray(3, np.int64)), ("w", None),
                                                ("fl", np.asarray(4, np.int64))], attrs={"onesided": 0}),
    C("STFT-const-window", "STFT", [("x", r(2, 12, 1)), ("st", np.asarray(2, np.int64)), ("w", pos(5)),
                                    ("fl", np.asarray(5, np.int64))], attrs={"onesided": 1}, consts=("w",)),
    C("STFT-window-grad-fl", "STFT", [("x", r(1, 9, 1)), ("st", np.asarray(2, np.int64)), ("w", r(4)),
                                      ("fl", np.asarray(4, np.int64))], attrs={"onesided": 1}),
    # torch.stft through TorchScript: a real signal as [B, L] (not [B, L, 1]); ORT takes it,
    # onnx.reference does not, so the differences run on ORT (STFT is linear in each input)
    C("STFT-2d-signal", "STFT", [("x", r(2, 14)), ("st", np.asarray(3, np.int64)), ("w", r(5))],
      attrs={"onesided": 1}, runner="ort", symbolic=False),
    # CumProd (opset 26): zeros (one and two in a row), every exclusive/reverse form
    *[C(f"CumProd-ex{ex}-rev{rv}", "CumProd", [("x", r(3, 5) * np.array([[1, 0, 1, 1, 1], [0, 1, 1, 0, 1], [1, 1, 1, 1, 1]])),
                                                ("ax", np.asarray(1, np.int64))],
        attrs={"exclusive": ex, "reverse": rv}, opset=26) for ex in (0, 1) for rv in (0, 1)],
    C("CumProd-axis0-3d", "CumProd", [("x", r(4, 2, 3)), ("ax", np.asarray(-3, np.int64))], opset=26),
    C("GlobalLpPool-p2", "GlobalLpPool", [("x", r(2, 3, 4, 5))]),
    C("GlobalLpPool-p3-1d", "GlobalLpPool", [("x", r(2, 3, 6, lo=0.1))], attrs={"p": 3}),
    C("GlobalLpPool-p1-3d", "GlobalLpPool", [("x", r(1, 2, 3, 2, 2, lo=0.1))], attrs={"p": 1}),
    # torchvision.ops.deform_conv2d (dynamo): offsets move taps partly outside the input
    C("DeformConv-basic", "DeformConv", [("x", r(1, 2, 5, 5)), ("w", r(3, 2, 2, 2)), ("off", 0.7 * r(1, 8, 4, 4))],
      opset=19, symbolic=False),
    C("DeformConv-groups-mask-bias", "DeformConv",
      [("x", r(2, 4, 6, 5)), ("w", r(4, 2, 3, 2)), ("off", 0.8 * r(2, 24, 3, 4)), ("b", r(4)), ("m", pos(2, 12, 3, 4))],
      attrs={"group": 2, "offset_group": 2, "pads": [1, 0, 1, 1], "strides": [2, 1], "dilations": [1, 2]},
      opset=19, symbolic=False),
    # torchvision.ops.roi_align(sampling_ratio=2): rois partly outside the image, one under a
    # pixel (output_half_pixel reads it as one); rois as data or constants, never differentiated
    C("RoiAlign-half-pixel-rois-data", "RoiAlign", [("x", r(2, 3, 6, 5)), ("rois", ROIS), ("bi", i64(1, 0, 1, 1))],
      attrs={"output_height": 2, "output_width": 3, "sampling_ratio": 2, "spatial_scale": 0.8}, opset=16,
      wrt=("x",)),
    C("RoiAlign-output-half-pixel", "RoiAlign", [("x", r(3, 2, 5, 7)), ("rois", ROIS), ("bi", i64(2, 2, 0, 1))],
      attrs={"output_height": 3, "output_width": 2, "sampling_ratio": 3,
             "coordinate_transformation_mode": "output_half_pixel"}, opset=16, consts=("rois",)),
    C("RoiAlign-18-default-mode", "RoiAlign", [("x", r(1, 2, 4, 4)), ("rois", ROIS[:2]), ("bi", i64(0, 0))],
      attrs={"output_height": 2, "output_width": 2, "sampling_ratio": 1, "spatial_scale": 0.5}, opset=18,
      consts=("rois",)),
]


# ops whose rules mix static parameter shapes with dynamic data shapes
_DATA_SYMBOLIC = {"RMSNormalization", "Resize", "Conv", "ConvTranspose", "MaxPool", "AveragePool", "MatMul", "Gemm", "Gather",
                  "LayerNormalization", "BatchNormalization", "InstanceNormalization", "Add", "Mul",
                  "PRelu", "GlobalAveragePool", "Slice", "Pad", "Concat"}


def _params():
    out = []
    for c in CASES:
        out.append(pytest.param(c, False, id=f"{c.id}-static"))
        if c.symbolic:
            out.append(pytest.param(c, True, id=f"{c.id}-symbolic"))
            if c.op in _DATA_SYMBOLIC and len([i for i in c.inputs if i[1] is not None]) > 1:
                # only the data input symbolic (static weights), as in real models
                out.append(pytest.param(c, (c.inputs[0][0],), id=f"{c.id}-symbolic-data"))
    return out


def _ort_agrees(model64, feeds, wrt, outs, jvp: bool) -> None:
    """The derivative graphs, converted to float32, run on ORT CPU and match the float64
    results loosely."""
    f32 = {k: (v.astype(np.float32) if np.asarray(v).dtype.kind == "f" else v) for k, v in feeds.items()}
    rng = np.random.default_rng(7)
    vm = convert_float_type(derivative_model(model64, wrt, outs, "vjp"), TensorProto.FLOAT)
    ref_vm = derivative_model(model64, wrt, outs, "vjp")
    y = run_reference(model64, feeds, outs)
    seeds = {f"seed/{o}": rng.standard_normal(np.shape(y[o])) for o in outs}
    want = run_reference(ref_vm, {**feeds, **seeds}, [f"grad/{w}" for w in wrt])
    got = run_ort(vm, {**f32, **{k: v.astype(np.float32) for k, v in seeds.items()}}, [f"grad/{w}" for w in wrt])
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-3, atol=2e-3 * (1 + np.max(np.abs(want[k]), initial=0)),
                                   err_msg=f"ORT float32 vs float64 for {k}")
    if jvp:
        jm = derivative_model(model64, wrt, outs, "jvp")
        tans = {f"tan/{w}": rng.standard_normal(np.shape(feeds[w])) for w in wrt}
        want = run_reference(jm, {**feeds, **tans}, [f"jvp/{o}" for o in outs])
        got = run_ort(convert_float_type(jm, TensorProto.FLOAT),
                      {**f32, **{k: v.astype(np.float32) for k, v in tans.items()}}, [f"jvp/{o}" for o in outs])
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-3,
                                       atol=2e-3 * (1 + np.max(np.abs(want[k]), initial=0)),
                                       err_msg=f"ORT float32 vs float64 for {k}")


@pytest.mark.slow
@pytest.mark.parametrize("case,symbolic", _params())
def test_rule_fd(case: Case, symbolic):
    model, feeds = one_node_model(case.op, case.inputs, case.attrs, n_out=case.n_out, opset=case.opset,
                                  runtime_inputs=case.runtime, symbolic=symbolic, constants=case.consts,
                                  keep_dtype=case.keep_dtype)
    outs = list(case.outputs) if case.outputs else [
        o.name for o in model.graph.output if o.type.tensor_type.elem_type == TensorProto.DOUBLE]
    if case.runner == "ort":  # float32 differences of a (bi)linear op: exact up to rounding
        m32 = convert_float_type(model, TensorProto.FLOAT)
        f32 = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in feeds.items()}
        rep = fd_check(m32, f32, wrt=case.wrt, outputs=outs, eps=0.5, rtol=2e-3, atol=1e-4, run=run_ort,
                       check_jvp=case.jvp)
    else:
        rep = fd_check(model, feeds, wrt=case.wrt, outputs=outs, check_jvp=case.jvp, rtol=case.rtol)
    assert rep.ok, str(rep)
    assert rep.vjp, "nothing was differentiated"
    if case.ort and case.runner != "ort":
        wrt = list(case.wrt or [w for w in feeds if np.asarray(feeds[w]).dtype.kind == "f"])
        _ort_agrees(model, feeds, wrt, outs, case.jvp)


# ----------------------------------------------------------------- hypothesis: broadcasting
@st.composite
def _bcast_pair(draw):
    out = draw(st.lists(st.integers(2, 3), min_size=1, max_size=3))
    def operand():
        k = draw(st.integers(0, len(out)))
        tail = out[len(out) - k:]
        return [d if draw(st.booleans()) else 1 for d in tail]
    return operand(), operand()


@settings(max_examples=12, deadline=None)
@given(pair=_bcast_pair(), op=st.sampled_from(["Add", "Sub", "Mul", "Div", "Max"]), symbolic=st.booleans())
def test_broadcasting_property(pair, op, symbolic):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(pair[0])
    b = rng.uniform(0.5, 2.0, pair[1]) * np.sign(rng.standard_normal(pair[1]) + 0.1)
    if np.ndim(b) == 0:
        b = np.asarray(1.3)
    model, feeds = one_node_model(op, [("a", a), ("b", b)], symbolic=symbolic)
    rep = fd_check(model, feeds)
    assert rep.ok, str(rep)


# ---------------------------------------------------------------------- registry
def test_lookup_unknown_op_one_line():
    node = helper.make_node("MaxRoiPool", ["a", "r"], ["c"], name="my/roi", pooled_shape=[2, 2])
    with pytest.raises(UnsupportedOpError) as ei:
        lookup(node, 17)
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 300
    assert "'my/roi'" in msg and "op MaxRoiPool (domain ai.onnx, opset 17)" in msg
    assert "--exclude" in msg and "docs/extending.md" in msg and "Gemm" not in msg
    msg = str(pytest.raises(UnsupportedOpError, lookup, node, 17, ["fc1.weight", "fc1.bias"]).value)
    assert "--exclude fc1.weight --exclude fc1.bias" in msg
    many = [f"p{i}" for i in range(9)]
    msg = str(pytest.raises(UnsupportedOpError, lookup, node, 17, many).value)
    assert "--exclude p5 ..." in msg and "(9 parameters in all)" in msg and "p6" not in msg


def test_lookup_opset_ranges():
    node = helper.make_node("Gelu", ["x"], ["y"], name="g")
    with pytest.raises(UnsupportedOpError, match="opset 17"):
        lookup(node, 17)
    assert lookup(node, 20).op_type == "Gelu"
    sm = helper.make_node("Softmax", ["x"], ["y"], name="s")
    assert lookup(sm, 12) is lookup(sm, 13)  # one rule serves both semantics (flatten < 13)
    assert find(helper.make_node("Shape", ["x"], ["y"]), 17).nondiff


def test_register_custom_rule_and_override():
    @register("MyScale", domain="com.example", since=1)
    def _vjp(b, view, node, gys):
        return [b.mul(gys[0], b.const(np.asarray(3.0, np.float32)))]

    try:
        node = helper.make_node("MyScale", ["x"], ["y"], domain="com.example", name="n")
        rule = lookup(node, 17)
        assert isinstance(rule, Rule) and rule.domain == "com.example" and not rule.has_jvp
        assert "com.example::MyScale" in supported_ops()
    finally:
        RULES.pop(("com.example", "MyScale"), None)


def test_every_zoo_op_has_jvp():
    zoo_ops = ["Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Relu", "Tanh", "Sigmoid", "Erf", "Softmax",
               "LayerNormalization", "BatchNormalization", "Conv", "MaxPool", "AveragePool", "GlobalAveragePool",
               "Flatten", "Reshape", "Transpose", "Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Sqrt",
               "Pow", "Exp", "Log", "ReduceMean", "ReduceSum", "Cast", "Identity"]
    have = set(supported_ops(jvp=True))
    assert not [o for o in zoo_ops if o not in have]


def test_resize_symbolic_batch_and_dynamic_scales(rng):
    """Resize with a symbolic batch (the constant interpolation matrices do not depend on it);
    non-constant scales are refused in one line."""
    import onnx

    from kfac_compiler.graph import GraphView

    x = rng.standard_normal((2, 3, 3, 4))
    model, feeds = one_node_model("Resize", [("x", x), ("roi", None), ("sc", f32(1, 1, 2, 2))],
                                  {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
                                  constants=("sc",), keep_dtype=("sc",))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    del model.graph.value_info[:]
    model = onnx.shape_inference.infer_shapes(model)
    rep = fd_check(model, feeds)
    assert rep.ok and rep.vjp, str(rep)
    dyn, _ = one_node_model("Resize", [("x", x), ("roi", None), ("sc", f32(1, 1, 2, 2))], {"mode": "nearest"},
                            keep_dtype=("sc",), runtime_inputs=("sc",))
    node = dyn.graph.node[0]
    with pytest.raises(UnsupportedOpError, match="constant roi/scales/sizes") as ei:
        lookup(node, 17).check(GraphView(dyn), node)
    assert "\n" not in str(ei.value)
    from kfac_compiler.builder import GraphBuilder
    from kfac_compiler.passes.autodiff import backward

    with pytest.raises(UnsupportedOpError, match=r"constant roi/scales/sizes; .*extend its rule \(docs/extending.md") as ei:
        backward(GraphBuilder(17), GraphView(dyn), {"y0": "g"}, ["x"])
    assert "\n" not in str(ei.value)
    # a full-rank sizes (before opset 18) fixes the symbolic batch to a constant: named, with both ways out
    sized, _ = one_node_model("Resize", [("x", x), ("roi", None), ("sc", None), ("sz", i64(2, 3, 6, 8))],
                              {"mode": "linear"}, constants=("sz",))
    sized.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    node = sized.graph.node[0]
    with pytest.raises(UnsupportedOpError, match=r"sets axis 0 of size 'N' to the constant 2, .*scales .*axes"):
        lookup(node, 17).check(GraphView(sized), node)


def test_maxpool_tiled_ties_share_the_cotangent():
    """Tiled MaxPool windows (kernel == strides) route the cotangent through a mask of the
    window's maxima: a window with t tied maxima gives each g/t (the sum stays g), untied
    windows match the Indices' scatter, and a Relu in front makes it the first maximum's
    gradient exactly (tied windows there are all zeros, whose cotangent the Relu drops)."""
    x = np.array([[[[1.0, 3.0, 2.0, 2.0, 9.0],
                    [0.5, 2.0, 2.0, 2.0, 9.0],
                    [-1.0, -1.0, 0.0, 4.0, 9.0],
                    [-1.0, -1.0, 4.0, 0.0, 9.0],
                    [7.0, 7.0, 7.0, 7.0, 9.0]]]])
    g = np.array([[[[10.0, 20.0], [30.0, 40.0]]]])
    model, feeds = one_node_model("MaxPool", [("x", x)], {"kernel_shape": [2, 2], "strides": [2, 2]})
    vm = derivative_model(model, ["x"], ["y0"], "vjp")
    for run in (run_reference, run_ort):
        m = vm if run is run_reference else convert_float_type(vm, TensorProto.FLOAT)
        dx = run(m, {"x": x, "seed/y0": g} if run is run_reference else
                 {"x": x.astype(np.float32), "seed/y0": g.astype(np.float32)}, ["grad/x"])["grad/x"]
        want = np.zeros_like(x)
        want[0, 0, 0, 1] = 10.0                       # one maximum
        want[0, 0, 0:2, 2:4] = [[5.0, 5.0], [5.0, 5.0]]  # four-way tie: 20 / 4 each
        want[0, 0, 2, 1] = want[0, 0, 2, 0] = 0.0
        want[0, 0, 2:4, 0:2] = 30.0 / 4               # all -1
        want[0, 0, 2, 3] = want[0, 0, 3, 2] = 20.0    # two-way tie of 4
        np.testing.assert_allclose(dx, want, rtol=1e-6)  # row 4 and column 4 lie in no window
    relu = np.maximum(np.random.default_rng(0).standard_normal((2, 3, 6, 6)), 0)
    relu[0, 0, :2, :2] = 0.0  # an all-zero (tied) window
    gy = np.random.default_rng(1).standard_normal((2, 3, 3, 3))
    model, _ = one_node_model("MaxPool", [("x", relu)], {"kernel_shape": [2, 2], "strides": [2, 2]})
    vm = derivative_model(model, ["x"], ["y0"], "vjp")
    dx = run_reference(vm, {"x": relu, "seed/y0": gy}, ["grad/x"])["grad/x"] * (relu > 0)
    first = np.zeros_like(relu)  # the first maximum of each window, as ONNX Runtime's Indices and torch
    for n, ch, i, j in np.ndindex(gy.shape):
        w = relu[n, ch, 2 * i:2 * i + 2, 2 * j:2 * j + 2]
        a, b = np.unravel_index(np.argmax(w), (2, 2))
        first[n, ch, 2 * i + a, 2 * j + b] = gy[n, ch, i, j]
    np.testing.assert_allclose(dx, first * (relu > 0), rtol=1e-12)
    assert np.abs(first[0, 0, :2, :2]).sum() > 0 and not dx[0, 0, :2, :2].any()


def test_maxpool_tiled_jvp_is_the_vjps_transpose_at_ties_and_runs_no_second_maxpool():
    """The tiled MaxPool's jvp (the quadratic model's J P, J v) averages the tangent over a
    window's tied maxima, the transpose of the vjp's sharing: <J t, g> = <t, J^T g> on the
    tied windows above, and each window's value by hand; its graph holds no MaxPool of its
    own (the Indices form ran a second, 6-20x slower MaxPool beside the forward's)."""
    x = np.array([[[[1.0, 3.0, 2.0, 2.0, 9.0],
                    [0.5, 2.0, 2.0, 2.0, 9.0],
                    [-1.0, -1.0, 0.0, 4.0, 9.0],
                    [-1.0, -1.0, 4.0, 0.0, 9.0],
                    [7.0, 7.0, 7.0, 7.0, 9.0]]]])
    t = np.random.default_rng(2).standard_normal(x.shape)
    g = np.random.default_rng(3).standard_normal((1, 1, 2, 2))
    model, _ = one_node_model("MaxPool", [("x", x)], {"kernel_shape": [2, 2], "strides": [2, 2]})
    jm = derivative_model(model, ["x"], ["y0"], "jvp")
    vm = derivative_model(model, ["x"], ["y0"], "vjp")
    assert [n.op_type for n in jm.graph.node].count("MaxPool") == 1  # the forward's
    ty = run_reference(jm, {"x": x, "tan/x": t}, ["jvp/y0"])["jvp/y0"]
    dx = run_reference(vm, {"x": x, "seed/y0": g}, ["grad/x"])["grad/x"]
    np.testing.assert_allclose(float(np.sum(ty * g)), float(np.sum(t * dx)), rtol=1e-12)
    want = [[t[0, 0, 0, 1], t[0, 0, 0:2, 2:4].mean()],
            [t[0, 0, 2:4, 0:2].mean(), (t[0, 0, 2, 3] + t[0, 0, 3, 2]) / 2]]
    np.testing.assert_allclose(ty[0, 0], want, rtol=1e-12)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_globallppool_jvp_without_the_input_rank(p):
    """GlobalLpPool's jvp sums over the spatial dims without knowing how many there are (an
    input declared without a shape, so shape inference gives no rank): the tangent equals
    the central finite difference of the forward."""
    x, t = r(2, 3, 4, 5, lo=0.1), r(2, 3, 4, 5)
    model, feeds = one_node_model("GlobalLpPool", [("x", x)], {"p": p})
    x_in = model.graph.input[0]
    x_in.type.tensor_type.ClearField("shape")
    del model.graph.output[0].type.tensor_type.shape.dim[:]
    jm = derivative_model(model, ["x"], ["y0"], "jvp")
    got = run_reference(jm, {"x": x, "tan/x": t}, ["jvp/y0"])["jvp/y0"]
    eps = 1e-6
    plus, minus = (run_reference(model, {"x": x + s * eps * t}, ["y0"])["y0"] for s in (1, -1))
    np.testing.assert_allclose(got, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-9)
    assert got.shape == (2, 3, 1, 1)


def test_scatter_with_a_multiplicative_reduction_has_no_rule():
    m, _ = one_node_model("ScatterND", [("x", r(3, 2)), ("i", i64([0], [2])), ("u", r(2, 2))],
                          attrs={"reduction": "mul"}, opset=16)
    with pytest.raises(UnsupportedOpError, match="reduction 'none' and 'add', not 'mul'"):
        derivative_model(m, ["x", "u"], ["y0"])


@pytest.mark.parametrize("op,x,attrs", [
    ("LRN", r(2, 5, 3, 2), {"size": 3, "alpha": 0.5, "beta": 0.75, "bias": 1.5}),
    ("LRN", r(1, 4, 3, 2), {"size": 5}),
    ("LpNormalization", r(3, 5), {"p": 1}),
    ("LpNormalization", r(2, 3, 4), {"p": 2, "axis": 1}),
    ("MeanVarianceNormalization", r(2, 3, 2, 3), {}),
    ("MeanVarianceNormalization", r(2, 3, 4), {"axes": [0, 2]}),
    *[("GridSample", r(2, 3, 4, 5), {**a, "g": RNG.uniform(-1.3, 1.3, (2, 3, 4, 2))})
      for a in ({}, {"padding_mode": "border"}, {"align_corners": 1}, {"mode": "nearest", "padding_mode": "border"})],
    ("AffineGrid", r(2, 2, 3), {"sz": i64(2, 1, 3, 4)}),
    ("AffineGrid", r(1, 3, 4), {"sz": i64(1, 2, 2, 3, 2), "align_corners": 1}),
    ("GlobalLpPool", r(2, 3, 4, 5), {}),
    ("GlobalLpPool", r(2, 3, 6), {"p": 3}),
    ("DeformConv", r(2, 4, 6, 5), {"w": r(4, 2, 3, 2), "off": 0.8 * r(2, 24, 3, 4), "b": r(4), "m": pos(2, 12, 3, 4),
                                   "group": 2, "offset_group": 2, "pads": [1, 0, 1, 1], "strides": [2, 1],
                                   "dilations": [1, 2]}),
], ids=["LRN-size3", "LRN-size5", "LpNorm-p1", "LpNorm-p2", "MVN-default", "MVN-axes", "GridSample-zeros",
        "GridSample-border", "GridSample-align", "GridSample-nearest-border", "AffineGrid-2d", "AffineGrid-3d-align",
        "GlobalLpPool-p2", "GlobalLpPool-p3", "DeformConv"])
def test_reference_fixes_agree_with_ort(op, x, attrs):
    """The float64 truth of the finite-difference cases (run_reference with
    check._reference_fixes: onnx.reference's LRN, p=1 LpNormalization and float64 MVN are
    wrong) agrees with ONNX Runtime's float32 forward."""
    attrs = dict(attrs)
    extra = [(k, attrs.pop(k)) for k in ("g", "sz", "w", "off", "b", "m") if k in attrs]
    model, feeds = one_node_model(op, [("x", x), *extra], attrs, opset={"AffineGrid": 20, "DeformConv": 19}.get(op, 16))
    want = run_ort(convert_float_type(model, TensorProto.FLOAT),
                   {k: v.astype(np.float32) for k, v in feeds.items()}, ["y0"])["y0"]
    np.testing.assert_allclose(run_reference(model, feeds, ["y0"])["y0"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs,why", [({"padding_mode": "reflection"}, "padding_mode 'reflection'"),
                                       ({"mode": "bicubic"}, "mode 'bicubic'")])
def test_gridsample_unsupported_forms_are_one_line(attrs, why):
    """GridSample forms the rule does not cover are refused before anything is emitted."""
    model, _ = one_node_model("GridSample", [("x", r(1, 1, 3, 3)), ("g", r(1, 2, 2, 2))], attrs, opset=16)
    with pytest.raises(UnsupportedOpError, match=why) as ei:
        derivative_model(model, ["x", "g"], ["y0"])
    assert "\n" not in str(ei.value) and "GridSample_0" in str(ei.value)


@pytest.mark.parametrize("op,inputs,attrs,runtime,why", [
    ("DFT", [("x", r(2, 4, 2))], {"inverse": 1, "onesided": 1}, (), "inverse=1 and onesided=1"),
    ("STFT", [("x", r(1, 8, 1)), ("st", np.asarray(2, np.int64)), ("w", r(4))], {}, ("st",), "constant frame_step"),
])
def test_spectral_unsupported_forms_are_one_line(op, inputs, attrs, runtime, why):
    """DFT and STFT forms the rules do not cover are refused before anything is emitted."""
    model, _ = one_node_model(op, inputs, attrs, runtime_inputs=runtime)
    with pytest.raises(UnsupportedOpError, match=why) as ei:
        derivative_model(model, ["x"], ["y0"])
    assert "\n" not in str(ei.value) and f"{op}_0" in str(ei.value)


def test_deformconv_needs_static_dims_one_line():
    """DeformConv with symbolic channel/spatial dims is refused before anything is emitted."""
    model, _ = one_node_model("DeformConv", [("x", r(1, 2, 4, 4)), ("w", r(2, 2, 2, 2)), ("off", r(1, 8, 3, 3))],
                              opset=19, symbolic=("x",))
    with pytest.raises(UnsupportedOpError, match="static channel, spatial and output dims") as ei:
        derivative_model(model, ["x", "w", "off"], ["y0"])
    assert "\n" not in str(ei.value) and "DeformConv_0" in str(ei.value)


@pytest.mark.parametrize("attrs,why", [
    ({"sampling_ratio": 0}, "sampling_ratio 0 .* export it with sampling_ratio > 0"),
    ({"sampling_ratio": 2, "mode": "max"}, "mode 'max'; the rule covers avg only"),
])
def test_roialign_unsupported_forms_are_one_line(attrs, why):
    """RoiAlign with the adaptive sample count (sampling_ratio 0, the default) or max pooling
    is refused before anything is emitted, naming the node."""
    model, _ = one_node_model("RoiAlign", [("x", r(1, 2, 4, 4)), ("rois", ROIS[:1]), ("bi", i64(0))],
                              {"output_height": 2, "output_width": 2, **attrs}, opset=16, constants=("rois",))
    with pytest.raises(UnsupportedOpError, match=why) as ei:
        derivative_model(model, ["x"], ["y0"])
    assert "\n" not in str(ei.value) and "RoiAlign_0" in str(ei.value)


def test_an_output_without_an_inferred_shape_trains_with_the_hand_computed_gradient():
    """GroupNormalization as the graph's output: onnx's shape inference gives it no shape, and
    its ValueInfo without one was read as a scalar ('squared_error expects the output's shape
    []'). Unknown rank now; the gradient of scale and bias is numpy's: out = s_c xhat + b_c,
    xhat normalized over each group of 2 channels, dL/ds_c = 1/N sum r xhat, dL/db_c = 1/N sum r."""
    from onnx import numpy_helper

    import kfac_compiler as kc
    from kfac_compiler.runtime import gradients

    rng = np.random.default_rng(0)
    s, b = rng.normal(size=4), rng.normal(size=4)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("GroupNormalization", ["input", "S", "B"], ["out"], num_groups=2, epsilon=1e-3)], "t",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 3, 2])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(s.astype(np.float32), "S"), numpy_helper.from_array(b.astype(np.float32), "B")]),
        opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    x, y = rng.normal(size=(3, 4, 3, 2)), rng.normal(size=(3, 4, 3, 2))
    plan = kc.compile(model, loss="squared_error", output="out", emit=False)
    loss, grads = gradients(plan, {"input": x.astype(np.float32)}, y.astype(np.float32))
    g = x.reshape(3, 2, -1)
    xhat = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-3)).reshape(x.shape)
    r = s[:, None, None] * xhat + b[:, None, None] - y
    assert loss == pytest.approx(0.5 * np.sum(r ** 2) / 3, rel=1e-5)
    np.testing.assert_allclose(grads["S"], np.sum(r * xhat, (0, 2, 3)) / 3, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["B"], np.sum(r, (0, 2, 3)) / 3, rtol=1e-4, atol=1e-5)
