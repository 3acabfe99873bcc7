"""Issue 40's CPU step targets against the arithmetic, and the step after an evaluation.

    python benchmarks/results/2026-11-30-step-arithmetic.py flops
    python benchmarks/results/2026-11-30-step-arithmetic.py after-eval MODEL BATCH OPTIMIZER [STEPS]

`flops`: the compiler's own prediction (plan.costs, passes/budget.py) of a default K-FAC step's
FLOPs on the digits workloads, as a multiple of the forward+backward's (which is Adam's step
up to its elementwise update): preconditioning, statistics (with their sampled backward) per
statistics period, the quadratic model's two JVPs (whole batch; plan.costs counts them so from
2026-11-30 on), the refresh per inverse period.
`after-eval`: a default CPU trainer on the digits, evaluated on 297 examples after every 5th
step; median step time of the steps right after an evaluation against the others (issue 40
item 6: the evaluation's thread pool must not take the next step's cores).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_to_target as bt  # noqa: E402
import kfac_compiler as kc  # noqa: E402
from kfac_compiler.models import ZOO  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices  # noqa: E402

WORKLOADS = (("mlp_classifier", 128), ("digits_autoencoder", 256), ("small_cnn", 128))


def flops() -> None:
    print("| workload, batch | fwd+bwd MFLOP | precondition | statistics / period | quadratic model | refresh / period "
          "| K-FAC step / fwd+bwd |")
    print("|---|---|---|---|---|---|---|")
    for name, batch in WORKLOADS:
        e = ZOO[name]
        plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False,
                          budget={"batch_size": batch})
        c = plan.costs
        fb = c["forward_backward_flops"]
        sp, ip = c["stats_period"], c["inverse_period"]
        parts = [c["apply_flops"], c["stats_flops_per_update"] / sp,  # its sampled backward included
                 c["qmodel_flops"], c["inverse_flops_per_refresh"] / ip]
        print(f"| {name}, {batch} | {fb / 1e6:.1f} | " + " | ".join(f"{p / 1e6:.1f} ({p / fb:.2f}x)" for p in parts)
              + f" | **{(fb + sum(parts)) / fb:.2f}x** |")


def after_eval(name: str, batch: int, optimizer: str, steps: int) -> None:
    plan, x, y = bt.zoo_case(name)
    hx, hy = x[-297:], y[-297:]
    tr = Trainer(plan, optimizer=optimizer, device="cpu", batch_size=batch, seed=0)
    after, other = [], []
    load = os.getloadavg()
    for k in range(steps):
        idx = batch_indices(len(y), batch, k, 0)
        t0 = time.perf_counter()
        tr.step({"input": x[idx]}, y[idx])
        ms = 1e3 * (time.perf_counter() - t0)
        if k > 20:  # after the first refreshes and the sessions' warm-up
            (after if k % 5 == 1 else other).append(ms)
        if k % 5 == 0:
            tr.evaluate({"input": hx}, hy)
    print(f"{name} {optimizer} batch {batch}: steps right after an evaluation median {statistics.median(after):.3f} ms, "
          f"the others {statistics.median(other):.3f} ms ({statistics.median(after) / statistics.median(other):.2f}x); "
          f"load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "flops":
        flops()
    else:
        after_eval(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 400)
