"""Spread inverse refreshes: step times on ResNet-18, convergence on the zoo.

Part 1 (`--resnet`): ResNet-18 (torch export, 32x32 digits, batch 32, K-FAC defaults, CPU):
the refresh as it was (one program, every block after every inv_update_period-th step, on one
ORT thread: refresh.refresh_threads patched to 1), one group with the threads chosen by size,
and the default "auto" (blocks split into groups balanced by predicted FLOPs, one group after
each of the first few steps of the period), on the same batches. In
each round each config trains a fresh trainer (one at a time: ~5 GB each) for steps
0..--steps, in turn (interleaved rounds: the machine drifts); reported over the steps after
the first (which refreshes everything in both): mean, median, p90 and max step time, the
refresh steps, the per-round ratio of mean steps, and the batch loss.

Part 2 (`--zoo`): the zoo keeps one group under "auto"; to check that spreading itself does
not slow convergence, the digits autoencoder (batch 256, target: tuned Adam's 1000-step loss
14.324) and the classifier (batch 128, target 1.8e-4) train with inverse_groups 1 and 3
(period 10) for seeds 0..--seeds-1: steps to the target, full-data loss checked every 5.

    python benchmarks/bench_refresh_spread.py --resnet [--rounds 2] [--steps 20] [--zoo] [--seeds 8] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.contract import plan_blocks  # noqa: E402
from kfac_compiler.optimizers.kfac import refresh as R  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

ZOO_TARGETS = {"digits_autoencoder": (256, 14.324, 300), "mlp_classifier": (128, 1.8e-4, 400)}


def resnet_plan():
    from kfac_compiler.models import torch_exports as te

    path = os.path.join(tempfile.gettempdir(), "bench_refresh_spread_resnet18.onnx")
    if not os.path.exists(path):
        te.export(te.resnet18(), path, te.digits_images()[0]["input"][:2])
    inputs, y = te.digits_images()
    return kc.compile(path, loss="softmax_cross_entropy", output="logits"), inputs["input"], y


def stats(ts) -> dict:
    ts = np.asarray(ts)
    return {"mean": ts.mean(), "median": np.median(ts), "p90": np.percentile(ts, 90), "max": ts.max()}


def bench_resnet(rounds: int, batch: int, steps: int, threads: int | None = None) -> list[str]:
    """Per round and config a fresh trainer (one at a time: a ResNet-18 K-FAC trainer holds
    ~5 GB) runs steps 0..steps on the same batches; steps 1..steps are recorded."""
    import gc

    plan, x, y = resnet_plan()
    # "before": the refresh as it was, one program on one ORT thread (refresh_threads patched)
    configs = {"before: 1 group, 1 thread": (dict(inverse_groups=1), 1),
               "1 group, threads by size": (dict(inverse_groups=1), None),
               "after: auto": ({}, None)}
    blocks = plan_blocks(plan)

    def batch_at(k):
        idx = np.random.default_rng([0, k]).choice(len(y), batch, replace=False)
        return {"input": x[idx]}, y[idx]

    times = {k: [] for k in configs}
    losses = {k: [] for k in configs}
    refresh = {k: [] for k in configs}
    cpu = {k: [] for k in configs}  # process CPU seconds per step: steadier than wall time
    refresh_cpu = {k: [] for k in configs}  # on a shared machine (with one ORT thread, no spinning)
    first, desc, ratios = {}, {}, []
    names = list(configs)
    for r in range(rounds):
        means = {}
        for name, (kw, refresh_threads) in configs.items():
            rule = R.refresh_threads
            if refresh_threads is not None:
                R.refresh_threads = lambda cost, device, n=refresh_threads: n
            try:
                tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=batch, seed=0, threads=threads, **kw)
            finally:
                R.refresh_threads = rule
            groups = tr.policy.refresher.groups
            gf = [sum(blocks[l].inverse_flops(tr.inverse_method) for l in g) / 1e9 for g in groups]
            desc[name] = (f"* {name}: {len(groups)} group(s), period {tr.policy.config.inv_update_period}: "
                          + ", ".join(f"{len(g)} blocks {f:.0f} GFLOP" for g, f in zip(groups, gf)))
            first.setdefault(name, []).append(tr.step(*batch_at(0))["step_time"])
            round_times = []
            for k in range(1, steps + 1):
                data = batch_at(k)
                c0 = time.process_time()
                m = tr.step(*data)
                cpu[name].append(time.process_time() - c0)
                round_times.append(m["step_time"])
                if r == 0:
                    losses[name].append(m["loss"])
                if m["inverse"]:
                    refresh[name].append(m["step_time"])
                    refresh_cpu[name].append(cpu[name][-1])
            times[name] += round_times
            means[name] = np.mean(round_times)
            del tr
            gc.collect()
        a, b = means[names[0]], means[names[-1]]
        ratios.append(b / a)
        print(f"round {r}: " + ", ".join(f"{k} mean {v:.3f} s" for k, v in means.items()), file=sys.stderr, flush=True)
    lines = list(desc.values())
    lines += ["", f"ResNet-18, batch {batch}, ORT threads {threads or 'default'}, {rounds} rounds, each config's fresh trainer in turn, steps 1..{steps} "
              "recorded; step 0 (sessions' first runs, full refresh): "
              + ", ".join(f"{k} {np.median(v):.2f} s" for k, v in first.items()), "",
              "| config | mean step [s] | median | p90 | max | refresh steps [s] | batch loss at steps 1, 10, 20 |",
              "|---|---|---|---|---|---|---|"]
    for name in configs:
        st = stats(times[name])
        picks = [losses[name][i - 1] for i in (1, 10, 20) if i <= len(losses[name])]
        lines.append(f"| {name} | {st['mean']:.3f} | {st['median']:.3f} | {st['p90']:.3f} | {st['max']:.3f} | "
                     + " ".join(f"{t:.2f}" for t in refresh[name]) + " | "
                     + " ".join(f"{v:.3f}" for v in picks) + " |")
    lines += ["", "Process CPU time per step [s] (the same steps):", "",
              "| config | mean | median | p90 | max | refresh steps |", "|---|---|---|---|---|---|"]
    for name in configs:
        st = stats(cpu[name])
        lines.append(f"| {name} | {st['mean']:.3f} | {st['median']:.3f} | {st['p90']:.3f} | {st['max']:.3f} | "
                     + " ".join(f"{t:.2f}" for t in refresh_cpu[name]) + " |")
    c0, c1 = stats(cpu[names[0]]), stats(cpu[names[-1]])
    lines.append(f"\nCPU time, max step after / before: {c1['max'] / c0['max']:.3f}; mean: {c1['mean'] / c0['mean']:.3f}")
    lines += ["", "per-round mean step, after / before (first and last config): " + ", ".join(f"{r:.3f}" for r in ratios)
              + f" (median {np.median(ratios):.3f})"]
    s0, s1 = stats(times[names[0]]), stats(times[names[-1]])
    lines.append(f"max step after / before: {s1['max'] / s0['max']:.3f}; mean: {s1['mean'] / s0['mean']:.3f}")
    return lines


def steps_to_target(plan, x, y, batch, target, budget, seed, **kw) -> int | None:
    tr = Trainer(plan, optimizer="kfac", device="cpu", seed=seed, **kw)
    n = len(y)
    for s in range(budget):
        idx = np.random.default_rng([seed, s]).choice(n, batch, replace=False)
        tr.step({"input": x[idx]}, y[idx])
        if (s + 1) % 5 == 0 and tr.evaluate({"input": x}, y, batch_size=2048)["loss"] <= target:
            return s + 1
    return None


def bench_zoo(seeds: int) -> list[str]:
    from kfac_compiler.models import ZOO

    lines = ["", f"| model (batch, target) | inverse_groups | steps to target, seeds 0..{seeds - 1} | mean |",
             "|---|---|---|---|"]
    for name, (batch, target, budget) in ZOO_TARGETS.items():
        e = ZOO[name]
        plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
        inputs, y = e.make_data(None, seed=0)
        for groups in (1, 3):
            hits = [steps_to_target(plan, inputs["input"], y, batch, target, budget, seed, inverse_groups=groups)
                    for seed in range(seeds)]
            got = [h for h in hits if h is not None]
            mean = f"{np.mean(got):.1f}" if len(got) == len(hits) else f"{len(hits) - len(got)} missed"
            lines.append(f"| {name} ({batch}, {target:g}) | {groups} | "
                         + ", ".join(str(h) if h else f">{budget}" for h in hits) + f" | {mean} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resnet", action="store_true", help="ResNet-18 step times, groups 1 vs auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="recorded steps per round (after step 0)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="the trainers' ORT threads (default: ORT's)")
    ap.add_argument("--zoo", action="store_true", help="zoo convergence, groups 1 vs 3")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# bench_refresh_spread {datetime.date.today()} (CPU, {os.cpu_count()} cores)", "",
             f"`python benchmarks/bench_refresh_spread.py {cmd}`", ""]
    t0 = time.perf_counter()
    if args.resnet:
        lines += bench_resnet(args.rounds, args.batch_size, args.steps, args.threads)
    if args.zoo:
        lines += bench_zoo(args.seeds)
    lines.append(f"\n({time.perf_counter() - t0:.0f} s)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
