"""digits_autoencoder: tanh MLP autoencoder written TF/tf2onnx-style (MatMul + Add)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import BATCH_DIM, GraphBuilder, fan_in_normal, float_input


def _layer_names(n_layers: int) -> list[str]:
    n_enc = (n_layers + 1) // 2
    return [f"enc{i + 1}" for i in range(n_enc)] + [f"dec{i + 1}" for i in range(n_layers - n_enc)]


def build_digits_autoencoder(seed: int = 0, widths: Sequence[int] = (256, 128, 32, 128, 256),
                             in_features: int = 64) -> onnx.ModelProto:
    """64-256-128-32-128-256-64 autoencoder; each layer MatMul(x, kernel [in,out]) + bias [out].

    Tanh between layers, none after the last; ``logits`` are the
    pre-sigmoid reconstruction [N,64].
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("digits_autoencoder")
    dims = [in_features, *widths, in_features]
    names = _layer_names(len(dims) - 1)
    x = "input"
    for i, name in enumerate(names):
        fan_in, fan_out = dims[i], dims[i + 1]
        last = i == len(names) - 1
        w = g.param(f"{name}.kernel", fan_in_normal(rng, (fan_in, fan_out), fan_in))
        b = g.param(f"{name}.bias", np.zeros(fan_out, np.float32))
        x = g.op("MatMul", [x, w], f"{name}/MatMul")
        x = g.op("Add", [x, b], f"{name}/Add", output="logits" if last else None)
        if not last:
            x = g.op("Tanh", [x], f"{name}/Tanh")
    return g.build(float_input("input", [BATCH_DIM, in_features]), "logits",
                   TensorProto.FLOAT, [BATCH_DIM, in_features],
                   doc="tanh autoencoder 64-256-128-32-128-256-64 (MatMul+Add, TF style)")
