"""unrolled_rnn: an Elman RNN over the 8 image rows, unrolled with shared weights."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import BATCH_DIM, GraphBuilder, fan_in_normal, float_input


def build_unrolled_rnn(seed: int = 0, hidden: int = 32, steps: int = 8, features: int = 8,
                       num_classes: int = 10) -> onnx.ModelProto:
    """h_{t+1} = Tanh(x_t @ rnn.W_x + h_t @ rnn.W_h + rnn.b), logits = Gemm(h_T, out.weight, out.bias).

    h_0 = 0, so the W_h term is skipped at t=0: rnn.W_x and rnn.b are used
    ``steps`` (8) times, rnn.W_h ``steps - 1`` (7) times.
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder("unrolled_rnn")
    w_x = g.param("rnn.W_x", fan_in_normal(rng, (features, hidden), features))
    w_h = g.param("rnn.W_h", fan_in_normal(rng, (hidden, hidden), hidden))
    b = g.param("rnn.b", np.zeros(hidden, np.float32))
    h = None
    for t in range(steps):
        s = f"step{t}"
        idx = g.const(f"{s}/index", np.array(t, dtype=np.int64))
        x_t = g.op("Gather", ["input", idx], f"{s}/Gather", axis=1)        # [N, F]
        pre = g.op("MatMul", [x_t, w_x], f"{s}/MatMul_x")
        if h is not None:
            hw = g.op("MatMul", [h, w_h], f"{s}/MatMul_h")
            pre = g.op("Add", [pre, hw], f"{s}/Add_xh")
        pre = g.op("Add", [pre, b], f"{s}/Add_b")
        h = g.op("Tanh", [pre], f"{s}/Tanh", output=f"h{t + 1}")
    w_o = g.param("out.weight", fan_in_normal(rng, (hidden, num_classes), hidden))
    b_o = g.param("out.bias", np.zeros(num_classes, np.float32))
    g.op("Gemm", [h, w_o, b_o], "out/Gemm", output="logits", transB=0)
    return g.build(float_input("input", [BATCH_DIM, steps, features]), "logits",
                   TensorProto.FLOAT, [BATCH_DIM, num_classes],
                   doc="Elman RNN over 8 rows, unrolled 8 steps with shared W_x/W_h/b")
