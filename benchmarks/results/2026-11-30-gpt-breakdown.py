"""The default K-FAC step's parts on 2026-11-30-budget-overhead.py's workloads (bench_step's
kfac_breakdown: marginal costs from variants of the fused step, medians of 7 runs), beside
Adam's median step over 20 steps, both after 12 warm-up steps.

    python benchmarks/results/2026-11-30-gpt-breakdown.py gpt      # or resnet18
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import bench_step as bs  # noqa: E402

_spec = importlib.util.spec_from_file_location("budget_overhead", os.path.join(HERE, "2026-11-30-budget-overhead.py"))
bo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bo)


def main(model: str) -> None:
    path, x, y = bo.workload(model, tempfile.mkdtemp())
    kfac, adam = bo.trainer(path, model, "o1", 0), bo.trainer(path, model, "adam1e-3", 0)
    batch = bo.BATCH[model]
    rows = np.random.default_rng(0).integers(0, bo.TRAIN, size=(32, batch))
    for k in range(12):
        kfac.step({"input": x[rows[k]]}, y[rows[k]])
        adam.step({"input": x[rows[k]]}, y[rows[k]])
    times = []
    for k in range(12, 32):
        began = time.perf_counter()
        adam.step({"input": x[rows[k]]}, y[rows[k]])
        times.append(time.perf_counter() - began)
    print(f"{model}: Adam's step, median {1e3 * statistics.median(times):.1f} ms; K-FAC's parts:")
    for part, seconds in bs.kfac_breakdown(kfac, x[:bo.TRAIN], y[:bo.TRAIN], batch, 7).items():
        print(f"  {part:28s} {1e3 * seconds:8.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
