"""Benchmark the damped-inverse methods of kfac_compiler.linalg on ONNX Runtime (CPU).

For each factor size (65, 129, 257 and the sizes of the model zoo's Kronecker factors) and
each method, time one inverse update of a damped SPD float32 factor (condition number
--cond: damping 1/cond on a second moment with eigenvalues in [1/cond, 1]) and measure its
accuracy against float64 numpy (np.linalg.inv of the same float32 matrix):

  inverse_op        com.microsoft Inverse + residual check (emitted, ORT)
  schur             2x2 block recursion on Schur complements, MatMuls + Inverse on blocks
                    of <= 48 rows, probe residual check (emitted, ORT)
  ns_cold           Newton-Schulz, NS_ITERATIONS iterations from I/||M||_F (emitted, ORT)
  ns_warm6          Newton-Schulz, 6 iterations warm-started from the inverse of the
                    factor before one moving-average step (decay 0.95, batch 128 rows from
                    the same distribution) (emitted, ORT)
  cholesky          host LAPACK potrf + potrs in float32 (one BLAS thread)
  eigh              host numpy float64 (incl. casts and the residual check)
and the batched variant: all zoo factors in one emitted graph (stacked per size) versus one
graph per factor.

    python benchmarks/bench_inverse.py [--cond 1e3] [--repeats 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kfac_compiler import linalg  # noqa: E402
from kfac_compiler.builder import GraphBuilder, value_info  # noqa: E402

# Kronecker factor sizes of the model zoo (models/README.md): (A = in+1, G = out) per layer
#   mlp_classifier       fc1 (65, 128)  fc2 (129, 128)  fc3 (129, 10)
#   digits_autoencoder   enc1 (65, 256) enc2 (257, 128) enc3 (129, 32)
#                        dec1 (33, 128) dec2 (129, 256) dec3 (257, 64)
#   small_cnn            conv1 (1*9+1=10, 8)  conv2 (8*9+1=73, 16)  fc (17, 10)
#   depthwise_cnn        conv1 (9, 8) (no bias)  pwconv (9, 16)  fc (257, 10)
#   unrolled_rnn         W_x (9, 32)  W_h (32 or 33, 32)  out (33, 10)
#   transformer_block    q/k/v/proj (17, 16)  mlp.fc1 (17, 64)  mlp.fc2 (65, 16)  tok_emb G 16
ZOO_SIZES = [8, 9, 10, 16, 17, 32, 33, 64, 65, 73, 128, 129, 256, 257]


def zoo_factor_sizes() -> list[int]:
    return list(ZOO_SIZES)


def covariance(n: int, cond: float, rng) -> np.ndarray:
    """A population second moment with eigenvalues log-spaced in [1/cond, 1]."""
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = np.logspace(-np.log10(cond), 0, n)
    return (Q * s) @ Q.T


def factor(n: int, cond: float, rng) -> np.ndarray:
    """An SPD float32 (damped) factor with condition number ~cond."""
    return covariance(n, cond, rng).astype(np.float32)


def ema_pair(n: int, cond: float, rng, batch: int = 128, decay: float = 0.95):
    """(M_old, M): a damped moving-average factor before and after one update with a batch
    estimate (batch rows drawn from the same distribution), damping = 1/cond."""
    C = covariance(n, cond, rng)
    L = np.linalg.cholesky(C + 1e-12 * np.eye(n))

    def batch_estimate():
        X = rng.standard_normal((batch, n)) @ L.T
        return X.T @ X / batch

    old = C.copy()
    for _ in range(5):
        old = decay * old + (1 - decay) * batch_estimate()
    new = decay * old + (1 - decay) * batch_estimate()
    d = np.eye(n) / cond
    return (old + d).astype(np.float32), (new + d).astype(np.float32)


def session(build, inputs):
    b = GraphBuilder(17, taken=[k for k, _ in inputs])
    outs = build(b)
    model = b.make_model(
        "bench", [value_info(k, TensorProto.FLOAT, list(s)) for k, s in inputs], [helper.make_empty_tensor_value_info(o) for o in outs]
    )
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def timeit(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def rel(X, ref) -> float:
    return float(np.linalg.norm(np.asarray(X, np.float64) - ref) / np.linalg.norm(ref))


def bench_size(n: int, cond: float, repeats: int, rng) -> dict:
    M_old, M = ema_pair(n, cond, rng)
    prev = np.linalg.inv(M_old.astype(np.float64)).astype(np.float32)
    ref = np.linalg.inv(M.astype(np.float64))
    row = {"n": n}

    s = session(lambda b: list(linalg.emit_inverse(b, "M", n, "inverse_op")), [("M", (n, n))])
    X, ok = s.run(None, {"M": M})
    row["inverse_op"] = (timeit(lambda: s.run(None, {"M": M}), repeats), rel(X, ref), bool(ok))

    s = session(lambda b: list(linalg.emit_inverse(b, "M", n, "inverse_op", check="finite")), [("M", (n, n))])
    X, ok = s.run(None, {"M": M})
    row["inverse_op_nocheck"] = (timeit(lambda: s.run(None, {"M": M}), repeats), rel(X, ref), bool(ok))

    s = session(lambda b: list(linalg.emit_inverse(b, "M", n, "schur")), [("M", (n, n))])
    X, ok = s.run(None, {"M": M})
    row["schur"] = (timeit(lambda: s.run(None, {"M": M}), repeats), rel(X, ref), bool(ok))

    s = session(lambda b: list(linalg.emit_newton_schulz(b, "M", n)), [("M", (n, n))])
    X, ok = s.run(None, {"M": M})
    row["ns_cold"] = (timeit(lambda: s.run(None, {"M": M}), repeats), rel(X, ref), bool(ok))

    s = session(lambda b: list(linalg.emit_newton_schulz(b, "M", n, "P", iterations=6)), [("M", (n, n)), ("P", (n, n))])
    X, ok = s.run(None, {"M": M, "P": prev})
    row["ns_warm6"] = (timeit(lambda: s.run(None, {"M": M, "P": prev}), repeats), rel(X, ref), bool(ok))

    for method in linalg.HOST_METHODS:
        X, ok = linalg.np_inverse(M, method)
        X = X.astype(np.float32)
        row[method] = (timeit(lambda method=method: linalg.np_inverse(M, method)[0].astype(np.float32), repeats), rel(X, ref), bool(ok))
    return row


def bench_batched(sizes, cond, repeats, rng) -> dict:
    mats = {f"m{i}": factor(n, cond, rng) for i, n in enumerate(sizes)}
    inputs = [(k, v.shape) for k, v in mats.items()]
    out = {}
    for method in linalg.EMITTED_METHODS:

        def build(b, method=method):
            reqs = [linalg.InverseRequest(k, v.shape[-1]) for k, v in mats.items()]
            res = linalg.emit_inverse_batch(b, reqs, method)
            return [x for pair in res for x in pair]

        s = session(build, inputs)
        out[f"{method}_batched"] = timeit(lambda s=s: s.run(None, mats), repeats)
        sessions = [session(lambda b, k=k, n=v.shape[-1], method=method: list(linalg.emit_inverse(b, k, n, method)), [(k, v.shape)]) for k, v in mats.items()]
        out[f"{method}_separate"] = timeit(lambda sessions=sessions: [ss.run(None, {k: mats[k]}) for ss, k in zip(sessions, mats)], repeats)
    out["eigh_host_all"] = timeit(lambda: linalg.np_inverse_batch(list(mats.values()), "eigh"), repeats)
    out["cholesky_host_all"] = timeit(lambda: linalg.np_inverse_batch(list(mats.values()), "cholesky"), repeats)
    return out


METHODS = ["inverse_op", "inverse_op_nocheck", "schur", "ns_cold", "ns_warm6", "cholesky", "eigh"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cond", type=float, nargs="*", default=[1e3, 1e5])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    zoo = zoo_factor_sizes()
    sizes = sorted(set([65, 129, 257] + zoo))
    print(f"onnxruntime {ort.__version__} CPU, {os.cpu_count()} cores; NS_ITERATIONS={linalg.NS_ITERATIONS}")
    print(f"zoo factor sizes: {zoo}")
    results = {"sizes": sizes, "zoo": zoo, "per_size": {}, "batched": {}}
    for cond in args.cond:
        print(f"\ncondition number {cond:g}: time per inverse update [ms] (relative Frobenius error vs float64, ok)")
        print("| n | " + " | ".join(METHODS) + " |")
        print("|---|" + "---|" * len(METHODS))
        rows = []
        for n in sizes:
            row = bench_size(n, cond, args.repeats, rng)
            rows.append(row)
            cells = [f"{row[m][0] * 1e3:.3f} ({row[m][1]:.1e}{'' if row[m][2] else ', NOT ok'})" for m in METHODS]
            print(f"| {n} | " + " | ".join(cells) + " |")
        results["per_size"][str(cond)] = rows
        bt = bench_batched(zoo, cond, args.repeats, rng)
        results["batched"][str(cond)] = bt
        print(f"all {len(zoo)} zoo sizes at once [ms]: " + ", ".join(f"{k}={v * 1e3:.2f}" for k, v in bt.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
