"""mlp_classifier: 64-128-128-10 ReLU MLP with PyTorch-style Gemm layers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import BATCH_DIM, GraphBuilder, fan_in_normal, float_input


def build_mlp_classifier(seed: int = 0, hidden: Sequence[int] = (128, 128),
                         in_features: int = 64, num_classes: int = 10) -> onnx.ModelProto:
    """ReLU MLP; layer i is Gemm(x, fc{i}.weight [out,in], fc{i}.bias [out], transB=1)."""
    rng = np.random.default_rng(seed)
    g = GraphBuilder("mlp_classifier")
    widths = [in_features, *hidden, num_classes]
    x = "input"
    n_layers = len(widths) - 1
    for i in range(n_layers):
        fan_in, fan_out = widths[i], widths[i + 1]
        last = i == n_layers - 1
        name = f"fc{i + 1}"
        w = g.param(f"{name}.weight", fan_in_normal(rng, (fan_out, fan_in), fan_in,
                                                    gain=1.0 if last else 2.0))
        b = g.param(f"{name}.bias", np.zeros(fan_out, np.float32))
        x = g.op("Gemm", [x, w, b], f"{name}/Gemm", output="logits" if last else None,
                 transB=1)
        if not last:
            x = g.op("Relu", [x], f"{name}/Relu")
    return g.build(float_input("input", [BATCH_DIM, in_features]), "logits",
                   TensorProto.FLOAT, [BATCH_DIM, num_classes],
                   doc="64-128-128-10 ReLU MLP (Gemm, transB=1) on flattened digits")
