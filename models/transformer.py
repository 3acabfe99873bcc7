"""transformer_block: a one-block, single-head causal LM over pixel-intensity tokens."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from ._graph import BATCH_DIM, GraphBuilder, fan_in_normal, int64_input


def build_transformer_block(seed: int = 0, d_model: int = 16, vocab: int = 17,
                            seq_len: int = 8, mlp_ratio: int = 4,
                            ln_epsilon: float = 1e-5) -> onnx.ModelProto:
    """Pre-LN transformer block with tied embedding / output head.

    logits [N,T,V] = LN_f(block(Gather(tok_emb, input) + pos_emb)) @ Transpose(tok_emb).
    """
    D, V, T, H = d_model, vocab, seq_len, mlp_ratio * d_model
    rng = np.random.default_rng(seed)
    g = GraphBuilder("transformer_block")

    def linear(x: str, name: str, d_in: int, d_out: int) -> str:
        w = g.param(f"{name}.weight", fan_in_normal(rng, (d_in, d_out), d_in))
        b = g.param(f"{name}.bias", np.zeros(d_out, np.float32))
        return g.op("Add", [g.op("MatMul", [x, w], f"{name}/MatMul"), b], f"{name}/Add")

    def layer_norm(x: str, name: str) -> str:
        s = g.param(f"{name}.scale", np.ones(D, np.float32))
        b = g.param(f"{name}.bias", np.zeros(D, np.float32))
        return g.op("LayerNormalization", [x, s, b], f"{name}/LayerNormalization",
                    axis=-1, epsilon=ln_epsilon)

    # embeddings
    emb = g.param("tok_emb", fan_in_normal(rng, (V, D), D))
    pos = g.param("pos_emb", fan_in_normal(rng, (T, D), D))
    x = g.op("Gather", [emb, "input"], "tok_emb/Gather", axis=0)          # [N,T,D]
    x = g.op("Add", [x, pos], "pos_emb/Add")

    # attention sub-block
    a = layer_norm(x, "ln1")
    q = linear(a, "attn.q", D, D)
    k = linear(a, "attn.k", D, D)
    v = linear(a, "attn.v", D, D)
    kt = g.op("Transpose", [k], "attn/Transpose_k", perm=[0, 2, 1])      # [N,D,T]
    scores = g.op("MatMul", [q, kt], "attn/MatMul_qk")                   # [N,T,T]
    scale = g.const("attn/scale", np.array(1.0 / np.sqrt(D), dtype=np.float32))
    scores = g.op("Mul", [scores, scale], "attn/Mul_scale")
    mask = np.triu(np.full((T, T), -1e4, dtype=np.float32), k=1)
    scores = g.op("Add", [scores, g.const("attn/causal_mask", mask)], "attn/Add_mask")
    probs = g.op("Softmax", [scores], "attn/Softmax", axis=-1)
    ctx = g.op("MatMul", [probs, v], "attn/MatMul_pv")                   # [N,T,D]
    x = g.op("Add", [x, linear(ctx, "attn.proj", D, D)], "attn/Add_residual")

    # MLP sub-block with erf-GELU
    m = linear(layer_norm(x, "ln2"), "mlp.fc1", D, H)
    inv_sqrt2 = g.const("mlp/gelu/inv_sqrt2", np.array(1.0 / np.sqrt(2.0), dtype=np.float32))
    one = g.const("mlp/gelu/one", np.array(1.0, dtype=np.float32))
    half = g.const("mlp/gelu/half", np.array(0.5, dtype=np.float32))
    e = g.op("Erf", [g.op("Mul", [m, inv_sqrt2], "mlp/gelu/Mul_scale")], "mlp/gelu/Erf")
    e = g.op("Add", [e, one], "mlp/gelu/Add_one")
    m = g.op("Mul", [g.op("Mul", [m, half], "mlp/gelu/Mul_half"), e], "mlp/gelu/Mul")
    x = g.op("Add", [x, linear(m, "mlp.fc2", H, D)], "mlp/Add_residual")

    # tied output head
    x = layer_norm(x, "lnf")
    emb_t = g.op("Transpose", [emb], "head/Transpose_emb", perm=[1, 0])  # [D,V]
    g.op("MatMul", [x, emb_t], "head/MatMul", output="logits")
    return g.build(int64_input("input", [BATCH_DIM, T]), "logits",
                   TensorProto.FLOAT, [BATCH_DIM, T, V],
                   doc="1-block single-head causal LM over row pixel tokens, tied head")
