"""EKFAC against K-FAC on the zoo: steps and seconds to tuned Adam's loss, side by side.

    python benchmarks/bench_ekfac.py [--models a,b] [--seeds 3] [--batch-size 128] [--steps 300] [--out FILE.md]

bench_zoo.py's measure (benchmarks/bench_step.py run_to_target): for each model and seed
(the model's initialization and the optimizers' sampling), Adam with lr in {1e-3, 3e-3, 1e-2}
trains `--steps` steps on all 1797 digits and its lowest full-data loss is the target; K-FAC
(approximation "kron", the default), EKFAC ("ekfac" for every fully connected and conv
layer) and K-FAC with exact damping (damping_split "exact", EKFAC's damping form), all with the
optimizer's defaults, then train up to the same number of steps, their
full-data loss checked every 5 steps (evaluation time excluded). Reported per model: the
medians over the seeds of the steps and seconds to the target, EKFAC / K-FAC and each / Adam
as time ratios, and each run's final loss. The three runs alternate, so that the VM's
drift hits both alike.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import kfac_compiler as kc
from bench_step import ADAM_LRS, run_to_target
from kfac_compiler.models import ZOO

# compile configs: K-FAC (the defaults: pi damping), EKFAC, and K-FAC with exact damping (the
# damping EKFAC uses: A (x) G + lambda I), which tells the eigenvalue correction from the damping form
CONFIGS = {"kron": None, "ekfac": {"approximations": {"fully_connected": "ekfac", "conv": "ekfac"}},
           "kron_exact": {"inverse": {"damping_split": "exact"}}}


def one_seed(name: str, seed: int, batch_size: int, steps: int) -> dict:
    entry = ZOO[name]
    inputs, y = entry.make_data(None, seed=0)
    x = inputs["input"]
    plans = {a: kc.compile(entry.build(seed=seed), loss=entry.loss, output="logits", emit=False, config=c)
             for a, c in CONFIGS.items()}
    adam = {lr: run_to_target(plans["kron"], x, y, batch_size, "adam", steps, "cpu", learning_rate=lr, seed=seed)
            for lr in ADAM_LRS}
    best = min(adam, key=lambda lr: adam[lr][0])
    target, adam_s = adam[best][0], adam[best][1]
    out = {"seed": seed, "adam_lr": best, "target": target, "adam_seconds": adam_s}
    for a, plan in plans.items():  # alternating, per seed
        loss, _, step_med, hits, _ = run_to_target(plan, x, y, batch_size, "kfac", steps, "cpu", targets=[target],
                                                    stop=False, seed=seed)
        hit_steps, hit_s = hits.get(target, (None, None))
        out[a] = {"final_loss": loss, "steps": hit_steps, "seconds": hit_s, "step_ms": 1e3 * step_med}
    return out


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp_classifier,digits_autoencoder")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)
    lines = [f"# EKFAC vs K-FAC: time to tuned Adam's loss ({datetime.date.today()}, CPU, batch {args.batch_size}, "
             f"{args.steps} steps, median of {args.seeds} seeds)", "",
             "| model | K-FAC steps | EKFAC steps | K-FAC exact-damping steps | K-FAC s | EKFAC s | "
             "EKFAC / K-FAC time | EKFAC / K-FAC-exact time | K-FAC / Adam | EKFAC / Adam | "
             "step ms K-FAC / EKFAC | reached (K-FAC, EKFAC, exact) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    runs = {}
    for name in args.models.split(","):
        per = [one_seed(name, s, args.batch_size, args.steps) for s in range(args.seeds)]
        runs[name] = per
        med = {a: {k: median([r[a][k] for r in per]) for k in ("steps", "seconds", "step_ms")} for a in CONFIGS}

        def ratio(a, b, per=per):
            return median([r[a]["seconds"] / r[b]["seconds"] for r in per if r[a]["seconds"] and r[b]["seconds"]])

        over = {a: median([r[a]["seconds"] / r["adam_seconds"] for r in per if r[a]["seconds"]]) for a in CONFIGS}
        reached = ", ".join(f"{sum(r[a]['steps'] is not None for r in per)}/{len(per)}" for a in CONFIGS)
        line = (f"| {name} | {fmt(med['kron']['steps'], 'g')} | {fmt(med['ekfac']['steps'], 'g')} | "
                f"{fmt(med['kron_exact']['steps'], 'g')} | {fmt(med['kron']['seconds'])} | "
                f"{fmt(med['ekfac']['seconds'])} | {fmt(ratio('ekfac', 'kron'))}x | "
                f"{fmt(ratio('ekfac', 'kron_exact'))}x | "
                f"{fmt(over['kron'])}x | {fmt(over['ekfac'])}x | "
                f"{fmt(med['kron']['step_ms'])} / {fmt(med['ekfac']['step_ms'])} | {reached} |")
        lines.append(line)
        print(line, flush=True)
    lines += ["", "Per seed (Adam lr, target loss; steps to it and final loss for K-FAC, EKFAC, "
                  "K-FAC with exact damping):", ""]
    for name, per in runs.items():
        for r in per:
            lines.append(f"- {name} seed {r['seed']}: Adam lr {r['adam_lr']:g}, target {r['target']:.4g}; K-FAC "
                         f"{fmt(r['kron']['steps'], 'g')} steps ({fmt(r['kron']['seconds'])} s), final "
                         f"{r['kron']['final_loss']:.4g}; EKFAC {fmt(r['ekfac']['steps'], 'g')} steps "
                         f"({fmt(r['ekfac']['seconds'])} s), final {r['ekfac']['final_loss']:.4g}; K-FAC exact damping "
                         f"{fmt(r['kron_exact']['steps'], 'g')} steps, final {r['kron_exact']['final_loss']:.4g}")
    print("\n".join(lines[-sum(len(p) for p in runs.values()):]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
