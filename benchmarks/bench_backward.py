"""Forward+backward (all parameter gradients) versus forward alone, per zoo model, on ONNX
Runtime CPU.

    python benchmarks/bench_backward.py [--batch 256] [--runs 30] [--threads 1,0] [--json out.json]

For each model in kfac_compiler.models.ZOO: the forward model and gradient_model(model,
"logits", params) (forward + seed input + all "grad/<param>" outputs) run in ORT sessions
(graph optimizations on); the table shows median wall time over `runs` runs after warm-up
and the ratio (forward+backward) / forward, once per intra-op thread setting (default: 1
thread, then ORT's default pool; on a shared or busy machine the single-thread figures are
the stable ones: ORT's spinning thread pool suffers from contention on many small ops).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from kfac_compiler.models import ZOO, get_model
from kfac_compiler.passes.autodiff import gradient_model


def _session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _median_time(sess: ort.InferenceSession, feeds: dict, runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        sess.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(name: str, batch: int, runs: int, threads: int) -> dict:
    model = get_model(name)
    params = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]
    x, _ = ZOO[name].make_data(n=batch, seed=0)
    fwd = _session(model, threads)
    (y,) = fwd.run(["logits"], x)
    gm = gradient_model(model, "logits", params)
    bwd = _session(gm, threads)
    seed = np.random.default_rng(0).standard_normal(y.shape).astype(np.float32)
    feeds = {**x, "logits_grad": seed}
    t_f = _median_time(fwd, x, runs)
    t_b = _median_time(bwd, feeds, runs)
    n_bwd = len(gm.graph.node) - len(model.graph.node)
    return {"model": name, "batch": batch, "forward_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_b,
            "ratio": t_b / t_f, "forward_nodes": len(model.graph.node), "backward_nodes": n_bwd}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", default="1,0",
                    help="comma-separated ORT intra-op thread counts to run (0: ORT default)")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    names = args.models or list(ZOO)
    rows = []
    for threads in [int(t) for t in str(args.threads).split(",")]:
        label = f"{threads} thread{'s' if threads != 1 else ''}" if threads else "ORT default threads"
        print(f"ONNX Runtime {ort.__version__} CPU ({label}), batch {args.batch}, median of {args.runs} runs, "
              f"{os.cpu_count()} cores")
        head = f"{'model':<20}{'fwd ms':>10}{'fwd+bwd ms':>12}{'ratio':>8}{'fwd nodes':>11}{'bwd nodes':>11}"
        print(head)
        print("-" * len(head))
        for name in names:
            r = bench(name, args.batch, args.runs, threads)
            r["threads"] = threads
            rows.append(r)
            print(f"{name:<20}{r['forward_ms']:>10.3f}{r['fwd_bwd_ms']:>12.3f}{r['ratio']:>8.2f}"
                  f"{r['forward_nodes']:>11}{r['backward_nodes']:>11}")
            sys.stdout.flush()
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
