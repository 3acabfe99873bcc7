"""The zoo's depthwise CNN per seed (its initialization and the batch order) and depthwise block:
K-FAC's steps (defaults otherwise, loss on all 1797 digits every 5) to one fixed target, tuned
Adam's 500-step loss at seed 0 (lr 1e-2: 5.1865e-4, 2026-11-28-depthwise-blocks.md), so the
blocks are compared on the same goal at every seed:

    python benchmarks/results/2026-11-29-depthwise-seeds.py SEEDS BLOCKS    # e.g. 1,2,3 diagonal,kron,channel_full
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_to_target as bt  # noqa: E402
from kfac_compiler.runtime import data as data_mod  # noqa: E402

TARGET, BATCH, MAX_STEPS = 5.1865e-4, 128, 500


def main(seeds: list[int], blocks: list[str]) -> None:
    for s in seeds:
        for blk in blocks:
            plan, x, y = bt.zoo_case("depthwise_cnn", seed=s, config={"approximations": {"depthwise_conv": blk}})
            n = len(y)
            r = bt.train(plan, x, y, BATCH, "kfac", MAX_STEPS, targets=[TARGET],
                         batches=lambda k, s=s, n=n: data_mod.batch_indices(n, BATCH, k, s))
            print("depthwise_cnn seed", s, blk, "steps", r.hit(TARGET)[0], f"final {r.loss:.4g}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1].split(",")], sys.argv[2].split(","))
