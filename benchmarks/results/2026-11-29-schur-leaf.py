"""schur's leaf size against its nodes and accuracy, and ORT's batched Inverse op (issue 40
item 3): a stack of two SPD float32 matrices (cond 1e2 and 1e4) of each size n, inverted by
emit_schur_inverse with leaves of 48..384 rows and by one com.microsoft Inverse over the
[2, n, n] stack; nodes in ORT's optimized CPU graph, relative Frobenius error against
numpy.linalg.inv in float64, and the run's time (one ORT thread; 5 runs, median and range:
noisy on a shared machine). Then the Inverse op alone on one block of each leaf size (30
interleaved runs).

    python benchmarks/results/2026-11-29-schur-leaf.py 1153,513
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_step as bs  # noqa: E402
from kfac_compiler.builder import GraphBuilder  # noqa: E402
from kfac_compiler.linalg.emitted import emit_schur_inverse  # noqa: E402


def model(n: int, k: int, leaf: int | None):
    """X = M^-1 of M [k, n, n]: schur with `leaf`, or the Inverse op (leaf None)."""
    b = GraphBuilder(17, prefix="t")
    X = emit_schur_inverse(b, "M", n, leaf) if leaf else b.op("Inverse", ["M"], domain="com.microsoft")
    b.identity(X, "X")
    return b.make_model("t", inputs=[helper.make_tensor_value_info("M", TensorProto.FLOAT, [k, n, n])],
                        outputs=[helper.make_tensor_value_info("X", TensorProto.FLOAT, [k, n, n])])


def session(m):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def spd(n: int, cond: float, rng) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return (q * np.geomspace(1, 1 / cond, n)) @ q.T


def main() -> None:
    rng = np.random.default_rng(0)
    for n in [int(v) for v in sys.argv[1].split(",")]:
        M = np.stack([spd(n, c, rng) for c in (1e2, 1e4)]).astype(np.float32)
        ref = np.stack([np.linalg.inv(m.astype(np.float64)) for m in M])
        for leaf in (48, 96, 192, 384, None):
            if leaf and leaf >= n:
                continue
            m = model(n, len(M), leaf)
            nodes = bs.ort_optimized(m).graph.node
            s = session(m)
            X = s.run(None, {"M": M})[0]
            err = [float(np.linalg.norm(X[i] - ref[i]) / np.linalg.norm(ref[i])) for i in range(len(M))]
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                s.run(None, {"M": M})
                ts.append(time.perf_counter() - t)
            print(f"n={n} {'schur leaf ' + str(leaf) if leaf else 'Inverse op'}: {len(nodes)} nodes "
                  f"({sum(x.op_type == 'Inverse' for x in nodes)} Inverse), rel. error {err[0]:.1e} (cond 1e2) "
                  f"{err[1]:.1e} (cond 1e4), {1e3 * statistics.median(ts):.0f} ms ({1e3 * min(ts):.0f}-{1e3 * max(ts):.0f})",
                  flush=True)
    blocks = {n: (session(model(n, 1, None)), spd(n, 1e2, rng)[None].astype(np.float32)) for n in (48, 96, 144, 192)}
    res: dict[int, list[float]] = {n: [] for n in blocks}
    for _ in range(30):
        for n, (s, M) in blocks.items():
            t = time.perf_counter()
            s.run(None, {"M": M})
            res[n].append(time.perf_counter() - t)
    for n, ts in res.items():
        print(f"Inverse op [1, {n}, {n}]: median {1e6 * statistics.median(ts):.0f} us (min {1e6 * min(ts):.0f})")


if __name__ == "__main__":
    main()
