"""A real-export fixture's 30-step held-out loss, K-FAC (defaults) against Adam (lr 1e-3), over
seeds: bench_to_target's real-exports comparison (held_out_run: batch 32, models/real_data's
batches, the last HELD_OUT examples held out) with the batches drawn in a seeded order and the
trainer's seed set, so that one fixture's K-FAC - Adam gap can be told from noise.

    python benchmarks/results/2026-11-30-real-export-seeds.py FIXTURE SEEDS [STEPS]
    python benchmarks/results/2026-11-30-real-export-seeds.py swin-dynamo_noopt 0,1,2,3
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_to_target as b  # noqa: E402
from kfac_compiler.models.real_data import batch  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

BATCH = 32


def run(plan, kind: str, optimizer: str, seed: int, steps: int, **knobs) -> float:
    x, y = batch(kind, None, seed=0)
    ex, ey = x[-b.HELD_OUT:], y[-b.HELD_OUT:]
    rows = np.random.default_rng(seed).integers(0, len(y) - b.HELD_OUT, size=(steps, BATCH))
    tr = Trainer(plan, optimizer=optimizer, device="cpu", seed=seed, batch_size=BATCH, **knobs)
    for s in range(steps):
        tr.step({"input": x[rows[s]]}, y[rows[s]])
    return float(tr.evaluate({"input": ex}, ey)["loss"])


def main(fixture: str, seeds: list[int], steps: int) -> None:
    fixtures = b.ROOT / "tests/fixtures/real"
    kind = json.loads((fixtures / "manifest.json").read_text())[fixture]["kind"]
    plan = b._compile_quiet(fixtures / f"{fixture}.onnx")
    gaps = []
    for seed in seeds:
        kfac, adam = run(plan, kind, "kfac", seed, steps), run(plan, kind, "adam", seed, steps, learning_rate=1e-3)
        gaps.append(kfac - adam)
        print(f"{fixture} seed {seed}: K-FAC {kfac:.4f}, Adam {adam:.4f}, K-FAC - Adam {kfac - adam:+.4f}", flush=True)
    print(f"{fixture}: K-FAC - Adam after {steps} steps, median {statistics.median(gaps):+.4f} "
          f"({min(gaps):+.4f} to {max(gaps):+.4f}), below Adam on {sum(g < 0 for g in gaps)} of {len(gaps)} seeds")


if __name__ == "__main__":
    main(sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]) if len(sys.argv) > 3 else 30)
