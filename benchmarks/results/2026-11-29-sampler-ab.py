"""Steps to given losses (tuned Adam's) on a zoo model, per trainer seed, with softmax
cross-entropy's sampled targets drawn by Gumbel-max (one uniform per class) and by inverse CDF
(one uniform per row), whatever the class count (PER_ROW_NOISE_CLASSES patched for each arm).

    python benchmarks/results/2026-11-29-sampler-ab.py MODEL BATCH TARGET[,TARGET...] SEEDS MAX_STEPS
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_to_target as bt  # noqa: E402
from kfac_compiler.losses import softmax_cross_entropy as sce  # noqa: E402

ARMS = {"gumbel": 2**62, "inverse_cdf": 1}  # PER_ROW_NOISE_CLASSES: never / always per row


def main() -> None:
    model, bs = sys.argv[1], int(sys.argv[2])
    targets = [float(t) for t in sys.argv[3].split(",")]
    seeds, steps = int(sys.argv[4]), int(sys.argv[5])
    out: dict[str, list[list[int | None]]] = {arm: [] for arm in ARMS}
    for seed in range(seeds):
        for arm, classes in ARMS.items():
            sce.PER_ROW_NOISE_CLASSES = classes
            plan, x, y = bt.zoo_case(model)
            r = bt.train(plan, x, y, bs, "kfac", steps, targets=targets, seed=seed)
            out[arm].append([r.hit(t)[0] for t in targets])
        print(seed, {k: v[-1] for k, v in out.items()}, flush=True)
    for arm, v in out.items():
        a = np.array([[np.nan if s is None else s for s in row] for row in v], float)
        print(arm, "per seed", v, "median", np.nanmedian(a, axis=0).tolist(), "reached", (~np.isnan(a)).sum(0).tolist())


if __name__ == "__main__":
    main()
