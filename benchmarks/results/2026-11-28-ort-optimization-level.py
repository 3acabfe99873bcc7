"""Session setup and K-FAC step time per ONNX Runtime optimization level (interleaved rounds).

    python benchmarks/results/2026-11-28-ort-optimization-level.py MODEL BATCH STEPS ROUNDS
"""
import statistics
import sys
import time

import onnxruntime as ort

import kfac_compiler as kc
import kfac_compiler.runtime.device as dev
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.data import batch_indices

LEVELS = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
          "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}
orig = dev.session_options
def with_level(level):
    def so(threads=None, spin=True):
        o = orig(threads, spin); o.graph_optimization_level = LEVELS[level]; return o
    return so
name, bs, steps, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
e = ZOO[name]
plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits")
x, y = e.make_data(None, seed=0)
res = {lv: {"setup": [], "step": []} for lv in LEVELS}
for _ in range(rounds):
    for lv in LEVELS:
        dev.session_options = with_level(lv)
        t = time.perf_counter(); tr = Trainer(plan, optimizer="kfac", batch_size=bs, threads=2); setup = time.perf_counter() - t
        times = []
        for k in range(steps):
            idx = batch_indices(len(y), bs, k, 0)
            t = time.perf_counter(); tr.step({"input": x["input"][idx]}, y[idx]); times.append(time.perf_counter() - t)
        res[lv]["setup"].append(setup); res[lv]["step"].append(statistics.mean(times[10:]))
        del tr
for lv, d in res.items():
    s, m = d["setup"], d["step"]
    print(f"{name} {lv:8s} setup median {statistics.median(s):.2f} s ({min(s):.2f}-{max(s):.2f}); mean step median {1e3*statistics.median(m):.2f} ms ({1e3*min(m):.2f}-{1e3*max(m):.2f})")
