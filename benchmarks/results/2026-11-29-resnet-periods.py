"""Do the cost-aware periods pay in steps? ResNet-18 (torchvision, exported) on the digits as
32x32 RGB (bench_step's workload), batch 32, seed 0: tuned Adam's held-out loss after 150 steps
is the target; each K-FAC variant's steps to it (held-out loss every 5 steps, on the last 297
images; training batches drawn from the first 1,500). Steps and losses are deterministic: run
it anywhere; the per-step times come from a quiet machine (knob-ab.py).

    python benchmarks/results/2026-11-29-resnet-periods.py OUT.json [VARIANT ...]
    python benchmarks/results/2026-11-29-resnet-periods.py time ROUNDS BLOCK VARIANT ...   # quiet machine

`time`: the variants' trainers stepped in interleaved blocks of BLOCK steps (after one warm-up
block, which holds the first refresh), ROUNDS rounds; per-round mean step times, their median
and min-max (a block of 10 holds one inverse refresh at period 10).

VARIANT: adam1e-3, adam3e-3, budget (the compiler's choice: statistics and inverses every 10
steps, 7 layers with a diagonal factor), s1 (statistics every step), s5, r20, full (no
cost-aware choice: every factor full, periods 1 / 10), o3 (budget.overhead 3 instead of 1),
big3 (only layer4's three 4609-wide A factors diagonal).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kfac_compiler as kc  # noqa: E402
from bench_step import resnet_export  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

STEPS = int(os.environ.get("RESNET_PERIODS_STEPS", "150"))  # a variant run shorter keeps its curve so far
BATCH, EVERY, TRAIN = 32, 5, 1500
VARIANTS = {
    "adam1e-3": ("adam", {"learning_rate": 1e-3}, {}),
    "adam3e-3": ("adam", {"learning_rate": 3e-3}, {}),
    "budget": ("kfac", {}, {}),
    "s1": ("kfac", {"cov_update_period": 1}, {}),
    "s5": ("kfac", {"cov_update_period": 5}, {}),
    "r20": ("kfac", {"inv_update_period": 20}, {}),
    "full": ("kfac", {}, {"overhead": 0}),
    "o3": ("kfac", {}, {"overhead": 3}),
    # only the three 4609-wide A factors (layer4's 3x3 convs) diagonal, every other factor full
    "big3": ("kfac", {}, {"overhead": 0}, {"layers": {f"onnx::Conv_{k}": "kron_in_diag" for k in (241, 247, 250)}}),
}


def main(out: str, names: list[str]) -> None:
    work = os.path.dirname(os.path.abspath(out))
    path, _, x, y = resnet_export(work)
    y = y.astype(np.int64)
    hx, hy = x[TRAIN:], y[TRAIN:]
    rows = np.random.default_rng(0).integers(0, TRAIN, size=(STEPS, BATCH))
    results = json.load(open(out)) if os.path.exists(out) else {}
    for name in names:
        optimizer, knobs, budget, *config = VARIANTS[name]
        plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", budget={"batch_size": BATCH, **budget},
                          config=config[0] if config else None)
        tr = Trainer(plan, optimizer=optimizer, device="cpu", batch_size=BATCH, seed=0, **knobs)
        curve, t0 = [], time.time()
        for k in range(STEPS):
            tr.step({"input": x[rows[k]]}, y[rows[k]])
            if (k + 1) % EVERY == 0:
                curve.append(float(tr.evaluate({"input": hx}, hy)["loss"]))
                print(name, k + 1, curve[-1], flush=True)
        results[name] = {"optimizer": optimizer, "knobs": knobs, "budget": budget, "heldout_every": EVERY,
                         "curve": curve, "periods": [plan.costs["stats_period"], plan.costs["inverse_period"]],
                         "seconds_under_load": time.time() - t0}
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    adam = [r for r in results.values() if r["optimizer"] == "adam"]
    if adam:
        target = min(r["curve"][-1] for r in adam)
        for name, r in results.items():
            hit = next(((i + 1) * EVERY for i, v in enumerate(r["curve"]) if v <= target), None)
            print(f"{name}: plan periods {r['periods']}, held-out at {len(r['curve']) * EVERY} {r['curve'][-1]:.4f}, "
                  f"steps to Adam's {target:.4f}: {hit}")


def time_steps(rounds: int, block: int, names: list[str]) -> None:
    work = "/tmp/resnet-periods-time"
    os.makedirs(work, exist_ok=True)
    path, _, x, y = resnet_export(work)
    y = y.astype(np.int64)
    rows = np.random.default_rng(0).integers(0, TRAIN, size=((rounds + 1) * block, BATCH))
    trainers = {}
    for name in names:
        optimizer, knobs, budget, *config = VARIANTS[name]
        plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", budget={"batch_size": BATCH, **budget},
                          config=config[0] if config else None)
        trainers[name] = Trainer(plan, optimizer=optimizer, device="cpu", batch_size=BATCH, seed=0, **knobs)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            for k in range(r * block, (r + 1) * block):
                tr.step({"input": x[rows[k]]}, y[rows[k]])
            if r:  # round 0 is the warm-up
                per_round[name].append(1e3 * (time.perf_counter() - t0) / block)
    print(f"load (1/5/15 min) after: {os.getloadavg()}")
    for name, ms in per_round.items():
        print(f"{name}: mean step {np.median(ms):.1f} ms (per-round {min(ms):.1f}-{max(ms):.1f}, {rounds} rounds of {block})")


if __name__ == "__main__":
    if sys.argv[1] == "time":
        time_steps(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        main(sys.argv[1], sys.argv[2:] or list(VARIANTS))
