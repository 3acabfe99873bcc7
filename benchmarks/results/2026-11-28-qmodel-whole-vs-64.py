"""K-FAC with the quadratic model on the whole batch (the default since 2026-11-28) against its
64-example sub-batch (the default before): steps to tuned Adam's loss (the targets of
2026-11-28-to-target-digits.md) and interleaved step times. Run from the repository root:

    python benchmarks/results/2026-11-28-qmodel-whole-vs-64.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402

import harness  # noqa: E402

harness.import_paths()
from bench_to_target import ours, train, zoo_case  # noqa: E402

TARGETS = {"digits_autoencoder": (256, 14.32364), "mlp_classifier": (128, 0.00017)}
VARIANTS = {"whole": {}, "q64": {"qmodel_batch_size": 64}}

for name, (bs, target) in TARGETS.items():
    plan, x, y = zoo_case(name)
    steps = {v: train(plan, x, y, bs, "kfac", 600, targets=[target], **kw).hit(target)[0] for v, kw in VARIANTS.items()}
    steppers = {v: ours(plan, x, y, bs, "kfac", **kw)[0] for v, kw in VARIANTS.items()}
    done = dict.fromkeys(steppers, 0)
    times: dict[str, list[float]] = {v: [] for v in steppers}
    for v, step in steppers.items():  # warm up
        for _ in range(20):
            step(done[v])
            done[v] += 1
    for _ in range(5):  # rounds, interleaved
        for v, step in steppers.items():
            t0 = time.perf_counter()
            for _ in range(40):
                step(done[v])
                done[v] += 1
            times[v].append((time.perf_counter() - t0) / 40 * 1e3)
    med = {v: float(np.median(t)) for v, t in times.items()}
    span = {v: f"{min(t):.2f}-{max(t):.2f}" for v, t in times.items()}
    ratio = steps["whole"] * med["whole"] / (steps["q64"] * med["q64"]) if all(steps.values()) else float("nan")
    print(f"{name}: steps to target whole {steps['whole']} q64 {steps['q64']}; ms/step whole {med['whole']:.2f} "
          f"({span['whole']}) q64 {med['q64']:.2f} ({span['q64']}); time to target whole/q64 {ratio:.2f}x")
