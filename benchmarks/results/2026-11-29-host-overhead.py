"""Issue 40: the K-FAC step's host (Python) time before and after the host-overhead commits,
in ONE process: "before" puts back the code of commit 5cb07f0 that those commits replaced
(the noise drawn into a new array and copied, np.clip; malloc_trim after every run of a
session without an arena; the batch checks' check_range on every array and numpy's function
wrappers), read with `git show`, "after" is the working tree. Interleaved blocks of steps on
one trainer per mode; the parameters of the two modes' trainers are compared bitwise at the end.

    python benchmarks/results/2026-11-29-host-overhead.py [MODEL ...] [--rounds R] [--block B] [--threads T]
    python benchmarks/results/2026-11-29-host-overhead.py --profile MODEL [--steps N] [--threads T]
    python benchmarks/results/2026-11-29-host-overhead.py --refresh MODEL [--rounds R] [--threads T]

Per step: host = step wall - session time (Trainer.step's host_time). --profile: cProfile of N
steps per mode, the host share of the step (everything but run_with_iobinding) and its top
functions by own time. --refresh: K-FAC's raw inverse refresh (every factor), blocks of 10 per
mode and round: wall, session and host medians.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import harness  # noqa: E402

harness.import_paths()
BASE = "5cb07f0"
BATCH = {"mlp_classifier": 128, "small_cnn": 128, "digits_autoencoder": 256}


def _old_module(path: str, name: str) -> types.ModuleType:
    """The module at `path` as of commit BASE, executed in a fresh namespace."""
    src = subprocess.run(["git", "-C", harness.ROOT, "show", f"{BASE}:{path}"], check=True, capture_output=True,
                         text=True).stdout
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(src, f"{BASE}:{path}", "exec"), mod.__dict__)  # noqa: S102 - the repository's own history
    return mod


def modes() -> dict[str, dict]:
    """{mode: {(object, attribute): value}}: what each mode sets before its block runs."""
    from kfac_compiler.losses import softmax_cross_entropy as sce
    from kfac_compiler.losses.base import LOSSES
    from kfac_compiler.runtime import data, device, program, state, trainer

    old_data = _old_module("runtime/data.py", "old_runtime_data")
    registered = dict(LOSSES)
    old_sce = _old_module("kfac_compiler/losses/softmax_cross_entropy.py", "old_sce")
    LOSSES.clear()
    LOSSES.update(registered)  # the old module registered its class: the plans keep the current one

    def old_release_heap():  # 5cb07f0's: malloc_trim after every run of a session without an arena
        trim = device._malloc_trim()
        if trim is not None:
            trim(0)

    def old_trainer_draw_noise(self, prog, d):
        noise = old_data.draw_noise(self.rng, prog.info, prog.data_inputs, d["targets"], prog.name, shares=self.ranks)
        for name in list(noise):
            self.store.write_data(name, noise.pop(name), prog.input_dtypes.get(name))
        return {}

    after = {(data, "validate_dataset"): data.validate_dataset,
             (sce.SoftmaxCrossEntropy, "check_targets"): sce.SoftmaxCrossEntropy.check_targets,
             (trainer.Trainer, "draw_noise"): trainer.Trainer.draw_noise,
             (program, "release_heap"): device.release_heap,
             (state.StateStore, "host_buffer"): state.StateStore.host_buffer}
    before = {(data, "validate_dataset"): old_data.validate_dataset,
              (sce.SoftmaxCrossEntropy, "check_targets"): old_sce.SoftmaxCrossEntropy.check_targets,
              (trainer.Trainer, "draw_noise"): old_trainer_draw_noise,
              (program, "release_heap"): old_release_heap,
              (state.StateStore, "host_buffer"): lambda self, *a, **k: None}
    return {"before": before, "after": after}


def use(mode: dict) -> None:
    for (obj, attr), value in mode.items():
        setattr(obj, attr, value)


def setup(name: str, threads: int | None):
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    e = ZOO[name]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
    inputs, y = e.make_data(None, seed=0)
    bs = BATCH.get(name, 128)
    batches = [({"input": inputs["input"][idx]}, y[idx]) for idx in
               (batch_indices(len(y), bs, i, 0) for i in range(len(y) // bs))]
    return plan, batches, lambda: Trainer(plan, optimizer="kfac", seed=0, threads=threads, batch_size=bs)


def cmd_time(args) -> None:
    ms = modes()
    for name in args.models:
        plan, batches, make = setup(name, args.threads)
        trainers, counts, hosts = {}, {}, {m: [] for m in ms}
        for m, patch in ms.items():
            use(patch)
            trainers[m], counts[m] = make(), 0

        def block(m, trainers=trainers, counts=counts, hosts=hosts, batches=batches):
            def run():
                use(ms[m])
                tr, walls = trainers[m], []
                for i in range(args.block + 2):
                    out = tr.step(*batches[counts[m] % len(batches)])
                    counts[m] += 1
                    if i >= 2:  # two wake-up steps
                        walls.append(out["step_time"])
                        hosts[m].append(out["host_time"])
                return walls
            return run

        load0 = open("/proc/loadavg").read().split()[:3]
        res = harness.interleave({m: block(m) for m in ms}, args.rounds, gap=0.05, warmup=1)
        load1 = open("/proc/loadavg").read().split()[:3]
        print(f"== {name} (batch {BATCH.get(name, 128)}, threads {args.threads or 'default'}, {args.rounds} rounds "
              f"of {args.block} steps; load {' '.join(load0)} -> {' '.join(load1)})")
        for m in ms:
            walls = harness.flat(res[m])
            block_hosts = [statistics.median(hosts[m][i:i + args.block])
                           for i in range(0, len(hosts[m]), args.block)]
            print(f"  {m:6s} step median {1e3 * harness.median(walls):6.3f} ms, mean {1e3 * statistics.fmean(walls):6.3f}"
                  f"; host median {1e3 * harness.median(hosts[m]):6.3f} ms, per-block medians "
                  f"{harness.spread(block_hosts).scaled(1e3).format('.3f', ' ms')}")
        ratios = [statistics.median(a) / statistics.median(b) for a, b in
                  zip(_blocks(hosts["after"], args.block), _blocks(hosts["before"], args.block))]
        print(f"  host after/before per round: {harness.spread(ratios).format('.2f', 'x')}")
        pa, pb = (trainers[m].parameters(layout="plan") for m in ("after", "before"))
        if counts["after"] == counts["before"]:
            same = all(np.array_equal(pa[p], pb[p]) for p in pa)
            print(f"  parameters after {counts['after']} steps of each: {'bitwise equal' if same else 'DIFFER'}")


def _blocks(xs, n):
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def cmd_profile(args) -> None:
    """cProfile per mode over interleaved blocks of 50 steps (args.steps per mode)."""
    ms = modes()
    name = args.profile
    plan, batches, make = setup(name, args.threads)
    trainers, profs = {}, {m: cProfile.Profile() for m in ms}
    for m, patch in ms.items():
        use(patch)
        trainers[m] = make()
        for i in range(30):
            trainers[m].step(*batches[i % len(batches)])
    for r in range(0, args.steps, 50):
        for m, patch in ms.items():
            use(patch)
            profs[m].enable()
            for i in range(r, r + 50):
                trainers[m].step(*batches[i % len(batches)])
            profs[m].disable()
    for m in ms:
        stats = pstats.Stats(profs[m]).stats  # type: ignore[attr-defined]
        step = sum(v[3] for k, v in stats.items() if k[2] == "step" and k[0].endswith("runtime/trainer.py"))
        sess = sum(v[2] for k, v in stats.items() if k[0] == "~" and "run_with_iobinding" in k[2])
        host = step - sess
        print(f"== {name} {m}: {args.steps} steps, Trainer.step {1e3 * step / args.steps:.3f} ms/step under cProfile, "
              f"sessions {1e3 * sess / args.steps:.3f}, host {1e3 * host / args.steps:.3f} ({100 * host / step:.1f}%)")
        own = sorted(((v[2], k) for k, v in stats.items() if not (k[0] == "~" and "run_with_iobinding" in k[2])),
                     reverse=True)
        for t, k in own[:args.top]:
            path = os.path.relpath(k[0], harness.ROOT) if k[0].startswith(harness.ROOT) else os.path.basename(k[0])
            where = k[2] if k[0] == "~" else f"{path}:{k[1]}({k[2]})"
            print(f"    {100 * t / host:5.1f}% of host  {1e6 * t / args.steps:7.1f} us/step  {where}")


def cmd_refresh(args) -> None:
    ms = modes()
    plan, batches, make = setup(args.refresh, args.threads)
    trainers = {}
    for m, patch in ms.items():
        use(patch)
        trainers[m] = make()
        for i in range(12):
            trainers[m].step(*batches[i % len(batches)])

    def block(m):
        def run():
            use(ms[m])
            tr, out = trainers[m], []
            for _ in range(10):
                s0, t0 = tr.session_seconds(), time.perf_counter()
                tr.policy.refresh_inverses()
                out.append((time.perf_counter() - t0, tr.session_seconds() - s0))
            return out
        return run

    res = harness.interleave({m: block(m) for m in ms}, args.rounds, gap=0.05, warmup=1)
    print(f"== {args.refresh}: raw inverse refresh, {args.rounds} rounds of 10 per mode (load "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])})")
    for m in ms:
        got = harness.flat(res[m])
        wall, sess = [w for w, _ in got], [s for _, s in got]
        host = [w - s for w, s in got]
        print(f"  {m:6s} wall {harness.spread(wall).scaled(1e3).format('.3f', ' ms')}, session "
              f"{harness.spread(sess).scaled(1e3).format('.3f', ' ms')}, host {harness.spread(host).scaled(1e3).format('.3f', ' ms')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["mlp_classifier", "small_cnn"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", metavar="MODEL")
    ap.add_argument("--refresh", metavar="MODEL")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    if args.profile:
        cmd_profile(args)
    elif args.refresh:
        cmd_refresh(args)
    else:
        cmd_time(args)


if __name__ == "__main__":
    main()
