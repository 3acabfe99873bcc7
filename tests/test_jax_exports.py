"""jax2onnx exports of small flax.nnx / JAX models against JAX's own gradients
(tests/fixtures/jax, README there).

With the squared-error loss (variance 1) at targets y = z - u, `kc.gradients` returns the
ONNX gradient of sum(z * u) times 1/N; the fixtures hold JAX's float64 gradient of
sum(logits * u) in each initializer's layout."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import kfac_compiler as kc
from helpers import run_model
from kfac_compiler.errors import ConfigError
from kfac_compiler.runtime import Trainer

FIXTURES = Path(__file__).parent / "fixtures" / "jax"


def fixture(stem: str) -> tuple[str, dict[str, np.ndarray]]:
    return str(FIXTURES / f"{stem}.onnx"), dict(np.load(FIXTURES / f"{stem}.npz"))


def gradient_check(path: str, data: dict[str, np.ndarray], input_name: str = "input", **options) -> kc.Plan:
    """The plan, after checking its gradients (in the user's layout) against JAX's float64
    ones: within 1e-5 of the largest."""
    x, u = data["x"], data["u"]
    z = run_model(onnx.load(path), {input_name: x}, "logits")
    plan = kc.compile(path, loss="squared_error", output="logits", emit=False, **options)
    _, grads = kc.gradients(plan, {input_name: x}, (z - u).astype(np.float32))
    ours = {k: v * len(x) for k, v in plan.source_values(grads).items()}
    truth = {k[4:]: v for k, v in data.items() if k.startswith("g64/")}
    scale = max(np.abs(v).max() for v in truth.values())
    for name, g in truth.items():
        np.testing.assert_allclose(ours.get(name, 0.0), g, rtol=0, atol=1e-5 * scale, err_msg=name)
    return plan


def test_stale_value_info_of_an_inner_tensor_is_dropped():
    """jax2onnx declares a Relu output NHWC [B, 10, 10, 8] that the graph computes NCHW
    [B, 8, 10, 10]; ONNX Runtime runs the file, but the compiler kept the declaration and
    every training graph it emitted was refused by ONNX Runtime (a raw onnxruntime Fail)."""
    path, data = fixture("cnn")
    plan = gradient_check(path, data)
    shapes = {vi.name: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
              for vi in plan.model.graph.value_info}
    assert shapes["relu_out_0"][1:] == [8, 10, 10]
    x, u = data["x"], data["u"]
    metrics = Trainer(plan, optimizer="kfac", seed=0).step({"input": x}, u)
    assert np.isfinite(metrics["loss"])


def test_gemm_c_multiplied_by_beta_zero_is_frozen():
    """jax2onnx writes jnp.dot(x, W) as Gemm(x, W, dot_bias_k, beta=0) with a dummy zero C:
    its gradient is identically 0, and it was trained as a generic layer of its own."""
    path, data = fixture("plain_mlp")
    plan = gradient_check(path, data)
    assert sorted(plan.frozen) == ["dot_bias_0", "dot_bias_1"]
    assert plan.frozen_reasons["dot_bias_0"] == ("constant: reaches the output only through non-learnable inputs "
                                                 "(Gemm 'node_Gemm_0' input 2 (C), multiplied by beta = 0)")
    assert [l.kind for l in plan.layers if l.kind == "generic"] == []


def test_parameters_as_graph_inputs_are_named_with_how_to_train_them():
    """jax2onnx's f(x, W1, b1, W2, b2) form writes the weights as graph inputs: compile took
    them for data (axis 0 their batch) and trained nothing of the model without a word. With
    the dummy Gemm Cs frozen nothing is left to train: the one-line error names the inputs
    and says to make them initializers."""
    with pytest.raises(ConfigError, match=re.escape(
            "float graph inputs 'W1' [6, 16], 'b1' [16], 'W2' [16, 4], 'b2' [4] have no batch axis (a static "
            "shape, where 'input' has ['B', 6]): they are treated as data, fed with every batch and not trained; "
            "if they are the model's parameters (jax2onnx's f(x, W, b) form), make them initializers holding "
            "their values (export with the parameters closed over) and compile again")):
        kc.compile(str(FIXTURES / "params_as_inputs.onnx"), loss="softmax_cross_entropy", output="logits", emit=False)
