"""K-FAC with its default settings against tuned Adam on every zoo model: steps and seconds
to Adam's loss.

    python benchmarks/bench_zoo.py [--models a,b] [--batch-size 128] [--steps 300] [--json out.json]

For each model (all 1797 digits, the batch size of `kfac-compiler train`, 128, unless told):
Adam with lr in {1e-3, 3e-3, 1e-2} trains `--steps` steps; the lowest full-data loss after
them is the target. K-FAC (defaults, no tuning) then trains the same number of steps, its
full-data loss checked every 5 steps (evaluation time excluded): the steps and seconds it
needs to reach the target, its time relative to the best Adam's, and its own final loss.
Seconds are sums of measured step wall times, K-FAC's first step (3-10 ms: sessions' first
runs and the first inverse refresh) included. One run on this machine: the VM's speed drifts.
"""
from __future__ import annotations

import argparse
import sys

import kfac_compiler as kc
from bench_step import ADAM_LRS, run_to_target, write_json
from kfac_compiler.models import ZOO, list_models


def compare(name: str, batch_size: int, steps: int, device: str) -> dict:
    """Tuned Adam's `steps`-step loss, and when K-FAC with its defaults reaches it."""
    entry = ZOO[name]
    plan = kc.compile(entry.build(seed=0), loss=entry.loss, output="logits", emit=False)
    inputs, y = entry.make_data(None, seed=0)
    x = inputs["input"]
    adam = {}
    for lr in ADAM_LRS:
        loss, secs, step_med, _, _ = run_to_target(plan, x, y, batch_size, "adam", steps, device, learning_rate=lr)
        adam[lr] = (loss, secs, step_med)
    best = min(adam, key=lambda lr: adam[lr][0])
    target, adam_s, adam_step = adam[best]
    loss, _, kfac_step, hits, _ = run_to_target(plan, x, y, batch_size, "kfac", steps, device, targets=[target],
                                                   stop=False)
    hit_steps, hit_s = hits.get(target, (None, None))
    return dict(model=name, batch=batch_size, adam_losses={lr: v[0] for lr, v in adam.items()}, best_lr=best,
                target_loss=target, adam_seconds=adam_s, adam_step_ms=1e3 * adam_step, kfac_final_loss=loss,
                kfac_steps=hit_steps, kfac_seconds=hit_s, kfac_step_ms=1e3 * kfac_step,
                kfac_over_adam_time=None if hit_s is None else hit_s / adam_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(list_models()), help="comma-separated zoo names (default: all)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300, help="Adam's steps, and K-FAC's budget (default 300)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--json", help="also write the results as JSON")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in ZOO]
    if unknown:
        ap.error(f"not zoo models: {', '.join(unknown)} (the zoo: {', '.join(list_models())})")
    print(f"{'model':20s} {'Adam lr':>7s} {'Adam loss':>10s} {'Adam s':>7s} {'K-FAC loss':>10s} "
          f"{'K-FAC steps':>11s} {'K-FAC s':>8s} {'time ratio':>10s} {'step ms K-FAC/Adam':>19s}")
    results = []
    for name in args.models.split(","):
        r = compare(name, args.batch_size, args.steps, args.device)
        results.append(r)
        steps = "-" if r["kfac_steps"] is None else str(r["kfac_steps"])
        k_s = "-" if r["kfac_seconds"] is None else f"{r['kfac_seconds']:.2f}"
        ratio = "-" if r["kfac_over_adam_time"] is None else f"{r['kfac_over_adam_time']:.2f}x"
        print(f"{name:20s} {r['best_lr']:7g} {r['target_loss']:10.4g} {r['adam_seconds']:7.2f} "
              f"{r['kfac_final_loss']:10.4g} {steps:>11s} {k_s:>8s} {ratio:>10s} "
              f"{r['kfac_step_ms']:8.2f} / {r['adam_step_ms']:.2f}", flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
