"""The gradients of Gather and GatherND (an embedding's lookup) sum the rows of repeated
indices exactly on ONNX Runtime's CPU provider with several threads. Its ScatterND with
reduction="add" splits the updates over the threads without atomics and lost some of them
(errors of 43 on sums of ~30 with 2 threads, a different result on every run); the rules
use ScatterElements' add (oprules/tensor.py, _scatter_add_rows). Truth: numpy's np.add.at
in float64."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from kfac_compiler.oprules.check import convert_float_type, derivative_model, one_node_model


def run_threads(model, feeds, threads: int = 2, reps: int = 40) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [sess.run(["grad/x"], feeds)[0] for _ in range(reps)]


@pytest.mark.slow
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_gather_gradient_sums_repeated_rows_exactly_on_threads(rng, symbolic):
    V, D, N, T = 17, 128, 64, 256  # 16384 lookups of 17 rows (ScatterND lost updates in 30% of the runs)
    x = rng.standard_normal((V, D)).astype(np.float32)
    idx = rng.integers(-V, V, (N, T)).astype(np.int64)  # negative entries count from the end
    m, _ = one_node_model("Gather", [("x", x), ("i", idx)], runtime_inputs=("i",), symbolic=symbolic)
    model = convert_float_type(derivative_model(m, ["x"], ["y0"]), TensorProto.FLOAT)
    seed = rng.standard_normal((N, T, D)).astype(np.float32)
    want = np.zeros((V, D))
    np.add.at(want, idx % V, seed.astype(np.float64))
    for got in run_threads(model, {"x": x, "i": idx, "seed/y0": seed}):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)


@pytest.mark.slow
def test_gather_nd_gradient_sums_repeated_rows_exactly_on_threads(rng):
    A, B, D, K = 5, 4, 128, 16384
    x = rng.standard_normal((A, B, D)).astype(np.float32)
    idx = np.stack([rng.integers(-A, A, K), rng.integers(0, B, K)], axis=-1).astype(np.int64)
    m, _ = one_node_model("GatherND", [("x", x), ("i", idx)], runtime_inputs=("i",))
    model = convert_float_type(derivative_model(m, ["x"], ["y0"]), TensorProto.FLOAT)
    seed = rng.standard_normal((K, D)).astype(np.float32)
    want = np.zeros((A, B, D))
    np.add.at(want, (idx[:, 0] % A, idx[:, 1]), seed.astype(np.float64))
    for got in run_threads(model, {"x": x, "i": idx, "seed/y0": seed}):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
