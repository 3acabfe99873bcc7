"""Convolutional zoo models on [N,1,8,8] digit images."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import BATCH_DIM, GraphBuilder, fan_in_normal, float_input


def _conv_w(rng, c_out: int, c_in_per_group: int, k: int, gain: float = 2.0) -> np.ndarray:
    return fan_in_normal(rng, (c_out, c_in_per_group, k, k), c_in_per_group * k * k, gain)


def build_small_cnn(seed: int = 0, channels: Sequence[int] = (8, 16),
                    num_classes: int = 10) -> onnx.ModelProto:
    """Conv3x3(1->8)+Relu -> MaxPool2 -> Conv3x3(8->16)+Relu -> GAP -> Flatten -> Gemm(16->10)."""
    c1, c2 = channels
    rng = np.random.default_rng(seed)
    g = GraphBuilder("small_cnn")
    x = g.op("Conv", ["input", g.param("conv1.weight", _conv_w(rng, c1, 1, 3)),
                      g.param("conv1.bias", np.zeros(c1, np.float32))],
             "conv1/Conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    x = g.op("Relu", [x], "conv1/Relu")
    x = g.op("MaxPool", [x], "pool1/MaxPool", kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("Conv", [x, g.param("conv2.weight", _conv_w(rng, c2, c1, 3)),
                      g.param("conv2.bias", np.zeros(c2, np.float32))],
             "conv2/Conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    x = g.op("Relu", [x], "conv2/Relu")
    x = g.op("GlobalAveragePool", [x], "gap/GlobalAveragePool")
    x = g.op("Flatten", [x], "flatten/Flatten", axis=1)
    w = g.param("fc.weight", fan_in_normal(rng, (num_classes, c2), c2))
    b = g.param("fc.bias", np.zeros(num_classes, np.float32))
    g.op("Gemm", [x, w, b], "fc/Gemm", output="logits", transB=1)
    return g.build(float_input("input", [BATCH_DIM, 1, 8, 8]), "logits",
                   TensorProto.FLOAT, [BATCH_DIM, num_classes],
                   doc="two-conv CNN with max-pool and global average pool")


def build_depthwise_cnn(seed: int = 0, channels: Sequence[int] = (8, 16),
                        num_classes: int = 10) -> onnx.ModelProto:
    """Conv3x3(no bias)+BN+Relu -> depthwise Conv3x3+Relu -> pointwise Conv1x1+Relu
    -> AvgPool2 -> Flatten -> Gemm(16*4*4 -> 10)."""
    c1, c2 = channels
    rng = np.random.default_rng(seed)
    g = GraphBuilder("depthwise_cnn")
    x = g.op("Conv", ["input", g.param("conv1.weight", _conv_w(rng, c1, 1, 3))],
             "conv1/Conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    x = g.op("BatchNormalization",
             [x, g.param("bn1.scale", np.ones(c1, np.float32)),
              g.param("bn1.bias", np.zeros(c1, np.float32)),
              g.param("bn1.running_mean", np.zeros(c1, np.float32)),
              g.param("bn1.running_var", np.ones(c1, np.float32))],
             "bn1/BatchNormalization", epsilon=1e-5, momentum=0.9)
    x = g.op("Relu", [x], "bn1/Relu")
    x = g.op("Conv", [x, g.param("dwconv.weight", _conv_w(rng, c1, 1, 3)),
                      g.param("dwconv.bias", np.zeros(c1, np.float32))],
             "dwconv/Conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1], group=c1)
    x = g.op("Relu", [x], "dwconv/Relu")
    x = g.op("Conv", [x, g.param("pwconv.weight", _conv_w(rng, c2, c1, 1)),
                      g.param("pwconv.bias", np.zeros(c2, np.float32))],
             "pwconv/Conv", kernel_shape=[1, 1], strides=[1, 1])
    x = g.op("Relu", [x], "pwconv/Relu")
    x = g.op("AveragePool", [x], "pool/AveragePool", kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("Flatten", [x], "flatten/Flatten", axis=1)
    feat = c2 * 4 * 4
    w = g.param("fc.weight", fan_in_normal(rng, (num_classes, feat), feat))
    b = g.param("fc.bias", np.zeros(num_classes, np.float32))
    g.op("Gemm", [x, w, b], "fc/Gemm", output="logits", transB=1)
    return g.build(float_input("input", [BATCH_DIM, 1, 8, 8]), "logits",
                   TensorProto.FLOAT, [BATCH_DIM, num_classes],
                   doc="conv+BN, depthwise-separable block, avg-pool, linear head")


def build_lenet5(seed: int = 0, size: int = 28, channels: Sequence[int] = (6, 16),
                 hidden: Sequence[int] = (120, 84), num_classes: int = 10) -> onnx.ModelProto:
    """LeNet-5 on [N,1,size,size] images (28: MNIST): Conv5x5(1->6, pad 2)+Relu -> MaxPool2
    -> Conv5x5(6->16)+Relu -> MaxPool2 -> Flatten -> Gemm(16*5*5->120)+Relu -> Gemm(120->84)
    +Relu -> Gemm(84->10). Not in the zoo (28x28 inputs): benchmarks/bench_to_target.py's
    `mnist` workload and the stability tests build it; smaller `channels`/`hidden` give a
    cheaper model of the same shape."""
    c1, c2 = channels
    h1, h2 = hidden
    rng = np.random.default_rng(seed)
    g = GraphBuilder("lenet5")
    x = g.op("Conv", ["input", g.param("conv1.weight", _conv_w(rng, c1, 1, 5)),
                      g.param("conv1.bias", np.zeros(c1, np.float32))],
             "conv1/Conv", kernel_shape=[5, 5], pads=[2, 2, 2, 2], strides=[1, 1])
    x = g.op("Relu", [x], "conv1/Relu")
    x = g.op("MaxPool", [x], "pool1/MaxPool", kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("Conv", [x, g.param("conv2.weight", _conv_w(rng, c2, c1, 5)),
                      g.param("conv2.bias", np.zeros(c2, np.float32))],
             "conv2/Conv", kernel_shape=[5, 5], strides=[1, 1])
    x = g.op("Relu", [x], "conv2/Relu")
    x = g.op("MaxPool", [x], "pool2/MaxPool", kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("Flatten", [x], "flatten/Flatten", axis=1)
    side = (size // 2 - 4) // 2
    dims = (c2 * side * side, h1, h2, num_classes)
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:]), start=1):
        w = g.param(f"fc{i}.weight", fan_in_normal(rng, (d_out, d_in), d_in, 2.0 if i < 3 else 1.0))
        b = g.param(f"fc{i}.bias", np.zeros(d_out, np.float32))
        x = g.op("Gemm", [x, w, b], f"fc{i}/Gemm", output="logits" if i == 3 else None, transB=1)
        if i < 3:
            x = g.op("Relu", [x], f"fc{i}/Relu")
    return g.build(float_input("input", [BATCH_DIM, 1, size, size]), "logits",
                   TensorProto.FLOAT, [BATCH_DIM, num_classes], doc="LeNet-5 (ReLU, max pooling)")
