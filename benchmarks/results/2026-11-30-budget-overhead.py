"""Does the cost-aware choice's `budget.overhead` (default 1) pay in time to target? Issue 36
item 4 / issue 40 item 4: the choice bounds the curvature FLOPs per step at B x the forward and
backward's; only steps x step time says whether that trade wins.

Workloads (bench_step's torch exports): ResNet-18 on the digits as 32x32 RGB, batch 32, and the
4-layer GPT (width 256) on the digits' pixel sequences, batch 8. Per seed s the training
batches are drawn by default_rng(s) from the first 1,500 examples and the trainer's seed (its
sampling noise) is s; the model's initial weights are fixed. The target is tuned Adam's
held-out loss after 150 steps (the lower of lr 1e-3 and 3e-3, that seed), held-out loss every
5 steps on the last 297 examples. Steps and losses are deterministic: run `steps` anywhere;
`time` needs a quiet machine.

    python benchmarks/results/2026-11-30-budget-overhead.py steps OUT.json MODEL SEEDS VARIANT ...
    python benchmarks/results/2026-11-30-budget-overhead.py time OUT.json MODEL ROUNDS BLOCK VARIANT ...
    python benchmarks/results/2026-11-30-budget-overhead.py report OUT.json

MODEL: resnet18 or gpt. VARIANT: adam1e-3, adam3e-3, oB (budget.overhead B, e.g. o1 the
default, o4), o0 (no cost-aware choice: every factor full, statistics every step); a K-FAC
variant may add Trainer knobs as +NAME=JSON, e.g. o1+max_predicted_decrease=0.5.
`time`: per variant a trainer, stepped in interleaved blocks of BLOCK steps after one warm-up
block, ROUNDS rounds: mean step per round (a block of 10 holds one inverse refresh).
`report`: steps to each seed's target per variant, mean step times, and steps x mean step
against Adam's 150 steps.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kfac_compiler as kc  # noqa: E402
from bench_step import _torch_exports  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

ADAM_STEPS, EVERY, TRAIN = 150, 5, 1500
MAX_STEPS = int(os.environ.get("BUDGET_MAX_STEPS", "150"))
BATCH = {"resnet18": 32, "gpt": 8}


def workload(model: str, work: str):
    """(ONNX path, inputs, targets) of `model`."""
    te = _torch_exports(model)
    net, (inputs, y) = (te.resnet18(), te.digits_images()) if model == "resnet18" else (te.gpt(), te.digits_sequences())
    path = os.path.join(work, f"{model}.onnx")
    if not os.path.exists(path):
        te.export(net, path, inputs["input"][:2])
    return path, inputs["input"], y.astype(np.int64)


def trainer(path: str, model: str, variant: str, seed: int) -> Trainer:
    if variant.startswith("adam"):
        plan = kc.compile(path, loss="softmax_cross_entropy", output="logits")
        return Trainer(plan, optimizer="adam", device="cpu", batch_size=BATCH[model], seed=seed,
                       learning_rate=float(variant[4:]))
    budget, *knobs = variant[1:].split("+")
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits",
                      budget={"batch_size": BATCH[model], "overhead": float(budget)})
    return Trainer(plan, optimizer="kfac", device="cpu", batch_size=BATCH[model], seed=seed,
                   **{k: json.loads(v) for k, v in (knob.split("=", 1) for knob in knobs)})


def load(out: str) -> dict:
    return json.load(open(out)) if os.path.exists(out) else {}


def save(out: str, results: dict) -> None:
    with open(out + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(out + ".tmp", out)


def target_of(results: dict, model: str, seed: int) -> float | None:
    adam = [r for k, r in results.get(model, {}).get("steps", {}).items()
            if k.startswith("adam") and str(seed) in r and len(r[str(seed)]) * EVERY >= ADAM_STEPS]
    return min(r[str(seed)][ADAM_STEPS // EVERY - 1] for r in adam) if adam else None


def steps(out: str, model: str, seeds: list[int], variants: list[str]) -> None:
    work = os.path.dirname(os.path.abspath(out))
    path, x, y = workload(model, work)
    hx, hy = x[TRAIN:], y[TRAIN:]
    results = load(out)
    for variant in variants:
        for seed in seeds:
            rows = np.random.default_rng(seed).integers(0, TRAIN, size=(max(MAX_STEPS, ADAM_STEPS), BATCH[model]))
            tr = trainer(path, model, variant, seed)
            target = None if variant.startswith("adam") else target_of(results, model, seed)
            n = ADAM_STEPS if variant.startswith("adam") else MAX_STEPS
            curve: list[float] = []
            for k in range(n):
                tr.step({"input": x[rows[k]]}, y[rows[k]])
                if (k + 1) % EVERY == 0:
                    curve.append(float(tr.evaluate({"input": hx}, hy)["loss"]))
                    print(model, variant, seed, k + 1, f"{curve[-1]:.4f}", flush=True)
                    if target is not None and curve[-1] <= target:
                        break
            results.setdefault(model, {}).setdefault("steps", {}).setdefault(variant, {})[str(seed)] = curve
            save(out, results)


def time_steps(out: str, model: str, rounds: int, block: int, variants: list[str]) -> None:
    with tempfile.TemporaryDirectory() as work:
        path, x, y = workload(model, work)
        rows = np.random.default_rng(0).integers(0, TRAIN, size=((rounds + 1) * block, BATCH[model]))
        trainers = {v: trainer(path, model, v, 0) for v in variants}
        per_round: dict[str, list[float]] = {v: [] for v in variants}
        load_before = os.getloadavg()
        for r in range(rounds + 1):
            for v, tr in trainers.items():
                time.sleep(0.05)
                t0 = time.perf_counter()
                for k in range(r * block, (r + 1) * block):
                    tr.step({"input": x[rows[k]]}, y[rows[k]])
                if r:  # round 0 is the warm-up
                    per_round[v].append(1e3 * (time.perf_counter() - t0) / block)
    results = load(out)
    results.setdefault(model, {})["time"] = {"rounds": rounds, "block": block, "load_before": load_before,
                                             "load_after": os.getloadavg(), "per_round_ms": per_round}
    save(out, results)
    for v, ms in per_round.items():
        print(f"{model} {v}: mean step {statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f})")


def report(out: str) -> None:
    results = load(out)
    for model, r in results.items():
        times = {v: statistics.median(ms) for v, ms in r.get("time", {}).get("per_round_ms", {}).items()}
        seeds = sorted({int(s) for c in r.get("steps", {}).values() for s in c})
        print(f"\n{model} (batch {BATCH[model]}); targets: "
              + ", ".join(f"seed {s} {target_of(results, model, s):.4f}" for s in seeds if target_of(results, model, s)))
        adam_time = None
        if "time" in r:
            adam_time = min(times[v] for v in times if v.startswith("adam")) * ADAM_STEPS
        print("| variant | steps to target per seed | median | mean step ms | steps x step / Adam's 150 steps |")
        print("|---|---|---|---|---|")
        for v, curves in r.get("steps", {}).items():
            hits = []
            for s, c in sorted(curves.items()):
                t = target_of(results, model, int(s))
                hits.append(next(((i + 1) * EVERY for i, val in enumerate(c) if t is not None and val <= t), None))
            got = [h for h in hits if h is not None]
            med = statistics.median(got) if len(got) == len(hits) and got else None
            ms = times.get(v)
            ratio = f"{med * ms / adam_time:.2f}x" if med and ms and adam_time else "-"
            print(f"| {v} | {', '.join(str(h) if h else f'>{len(c) * EVERY}' for h, c in zip(hits, curves.values()))} "
                  f"| {med if med else '-'} | {f'{ms:.1f}' if ms else '-'} | {ratio} |")


if __name__ == "__main__":
    cmd, out = sys.argv[1], sys.argv[2]
    if cmd == "steps":
        steps(out, sys.argv[3], [int(s) for s in sys.argv[4].split(",")], sys.argv[5:])
    elif cmd == "time":
        time_steps(out, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
    else:
        report(out)
