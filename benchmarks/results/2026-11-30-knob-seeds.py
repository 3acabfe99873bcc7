"""Steps to full-data loss targets of a zoo model for K-FAC knob variants over seeds (the seed
picks the batch order and the sampling noise; deterministic, no timing).

    python benchmarks/results/2026-11-30-knob-seeds.py MODEL BATCH TARGETS SEEDS MAX_STEPS VARIANTS_JSON
    python benchmarks/results/2026-11-30-knob-seeds.py mlp_classifier 128 \\
        0.0001657731190789491,5.846880958415568e-05 8 400 \\
        '{"k1": {}, "k0.5": {"max_predicted_decrease": 0.5}}'

TARGETS: comma-separated losses (the classifier's: tuned Adam's 500- and 1000-step losses, lr
0.01, from the digits benchmark's cache); the full-data loss is checked every 5 steps.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_to_target as bt  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices  # noqa: E402


def main(name: str, batch: int, targets: list[float], seeds: int, max_steps: int, variants: dict) -> None:
    plan, x, y = bt.zoo_case(name)
    for label, knobs in variants.items():
        hits = []
        for seed in range(seeds):
            tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=batch, seed=seed, **knobs)
            got: list[int | None] = [None] * len(targets)
            for k in range(max_steps):
                idx = batch_indices(len(y), batch, k, seed)
                tr.step({"input": x[idx]}, y[idx])
                if (k + 1) % 5 == 0:
                    loss = tr.evaluate({"input": x}, y)["loss"]
                    got = [g if g is not None or loss > t else k + 1 for g, t in zip(got, targets)]
                    if all(g is not None for g in got):
                        break
            hits.append(got)
        for t, column in zip(targets, zip(*hits)):
            print(f"{label} target {t:.4g}: steps {list(column)}, median "
                  f"{statistics.median(v if v is not None else max_steps for v in column)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [float(t) for t in sys.argv[3].split(",")], int(sys.argv[4]),
         int(sys.argv[5]), json.loads(sys.argv[6]))
