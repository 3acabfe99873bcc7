"""The quadratic model's stacked Gram in pieces (Layout.stack / gram_of, GRAM_PIECE) against one
Gemm over the whole rows (for 2026-11-30-chunked-gram.md)

    python benchmarks/results/2026-11-30-chunked-gram.py gram THREADS [N]
    python benchmarks/results/2026-11-30-chunked-gram.py step MODEL THREADS [ROUNDS]

`gram`: the Gram of a random [3, N] stack (N: ResNet-18's 11,176,842 parameters by default)
as ONNX Runtime runs it: one Gemm S S^T (before), and the pieces' batched MatMul (now: the
stack reshaped to [3, R, 16384], transposed to [R, 3, 16384], MatMul with its transpose, summed
over R); time (median of 5 rounds of 3 runs) and the largest error of an entry x_i.x_j
against float64 numpy, relative to |x_i| |x_j| (an error in the cosine of two rows).

`step`: two Trainers of one plan in one process, one emitted with the pieces (GRAM_PIECE
16384, shipped), one with GRAM_PIECE so large that every stack is one Gemm's (before); their
default K-FAC steps interleaved (benchmarks/harness.py: interleave, the order rotated each
round), blocks of 10 steps after 20 warm-up steps each, a 50 ms pause before each block;
median (min-max) ms per step. MODEL: resnet18 (the digits as 32x32
RGB, batch 32), gpt (models/torch_exports' GPT on digit sequences, batch 8, the budget
2026-11-30-budget-overhead.py compiles it with), digits_autoencoder (batch 256; 107,360
parameters: 7 pieces), mlp_classifier (batch 128; 26,122: one Gemm either way). Needs torch
for resnet18 and gpt.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))  # benchmarks/

import harness  # noqa: E402


def cmd_gram(threads: int, n: int) -> None:
    import onnxruntime as ort
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    piece = 16384
    pieces = -(-n // piece)

    def session(nodes, inits=()) -> ort.InferenceSession:
        graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("S", TensorProto.FLOAT, [3, pieces * piece])],
                              [oh.make_tensor_value_info("G", TensorProto.FLOAT, None)], list(inits))
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = threads, 3
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    forms = {
        "one Gemm (before)": session([oh.make_node("Gemm", ["S", "S"], ["G"], transB=1)]),
        "pieces (now)": session(
            [oh.make_node("Reshape", ["S", "shape"], ["S3"]), oh.make_node("Transpose", ["S3"], ["X"], perm=[1, 0, 2]),
             oh.make_node("Transpose", ["X"], ["XT"], perm=[0, 2, 1]), oh.make_node("MatMul", ["X", "XT"], ["P"]),
             oh.make_node("ReduceSum", ["P", "axis0"], ["G"], keepdims=0)],
            [nh.from_array(np.array([3, pieces, piece], np.int64), "shape"), nh.from_array(np.array([0], np.int64), "axis0")]),
    }
    rng = np.random.default_rng(0)
    S = np.zeros((3, pieces * piece), np.float32)
    S[:, :n] = rng.standard_normal((3, n))
    ref = S.astype(np.float64) @ S.T.astype(np.float64)
    res: dict[str, list[float]] = {k: [] for k in forms}
    scale = np.sqrt(np.outer(np.diag(ref), np.diag(ref)))  # |x_i| |x_j|: an entry's error as a cosine's
    err = {k: float((np.abs(s.run(["G"], {"S": S})[0] - ref) / scale).max()) for k, s in forms.items()}
    for _ in range(5):
        for k, s in forms.items():
            s.run(["G"], {"S": S})
            t0 = time.perf_counter()
            for _ in range(3):
                s.run(["G"], {"S": S})
            res[k].append((time.perf_counter() - t0) / 3 * 1e3)
    for k, v in res.items():
        print(f"[3, {n}] Gram, {threads} threads, {k:18s} {np.median(v):7.2f} ms ({min(v):.2f}-{max(v):.2f}), "
              f"largest error {err[k]:.1e} of |x_i| |x_j|")


def workload(model: str, threads: int):
    """(a function making a default K-FAC Trainer on a freshly compiled plan, inputs, targets,
    batch)."""
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer
    if model in ("resnet18", "gpt"):
        import importlib.util
        spec = importlib.util.spec_from_file_location("budget_overhead", os.path.join(HERE, "2026-11-30-budget-overhead.py"))
        bo = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(bo)
        path, x, y = bo.workload(model, tempfile.mkdtemp())
        batch = bo.BATCH[model]

        def make_export() -> Trainer:  # as budget-overhead's "o1" (the default budget)
            plan = kc.compile(path, loss="softmax_cross_entropy", output="logits",
                              budget={"batch_size": batch, "overhead": 1.0})
            return Trainer(plan, optimizer="kfac", device="cpu", batch_size=batch, seed=0, threads=threads)
        return make_export, x, y, batch
    from kfac_compiler.models import ZOO
    entry = ZOO[model]
    inputs, y = entry.make_data(None, seed=0)
    batch = {"digits_autoencoder": 256}.get(model, 128)

    def make() -> Trainer:
        plan = kc.compile(entry.build(seed=0), loss=entry.loss, output="logits", emit=False)
        return Trainer(plan, optimizer="kfac", batch_size=batch, seed=0, threads=threads)
    return make, inputs["input"], y, batch


def cmd_step(model: str, threads: int, rounds: int) -> None:
    from kfac_compiler.optimizers import multi_tensor
    warnings.simplefilter("ignore")
    make, x, y, batch = workload(model, threads)

    def trainer(piece: int):
        saved, multi_tensor.GRAM_PIECE = multi_tensor.GRAM_PIECE, piece
        try:
            return make()
        finally:
            multi_tensor.GRAM_PIECE = saved
    trainers = {"pieces (now)": trainer(16384), "one Gemm (before)": trainer(10 ** 12)}
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, len(y), batch) for _ in range(10)]

    def run(tr) -> None:
        for idx in batches:
            tr.step({"input": x[idx]}, y[idx])
    # two warm-up blocks each: every session kind made (the refresh, the adaptation step)
    res = harness.interleaved_ms({k: (lambda tr=tr: run(tr)) for k, tr in trainers.items()}, len(batches), rounds,
                                 warmup=2)
    for k, v in res.items():
        print(f"{model}, {threads} threads, {k:18s} {np.median(v):8.2f} ms ({min(v):.2f}-{max(v):.2f})")
    ratio = np.median(res["pieces (now)"]) / np.median(res["one Gemm (before)"])
    print(f"{model}, {threads} threads: ratio {ratio:.3f} (load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    if sys.argv[1] == "gram":
        cmd_gram(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 11_176_842)
    else:
        cmd_step(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 8)
