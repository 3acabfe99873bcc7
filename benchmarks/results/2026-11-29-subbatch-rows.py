"""The statistics' sub-batch rows (every (N // m)-th since 1141f7e, the first m before) on the
digits and LeNet-5 workloads of 2026-11-29-autoencoder-bisect.md. Run it from a checkout
(main, or one with 1141f7e's forward.py change reverted: the same script measures both).

    python benchmarks/results/2026-11-29-subbatch-rows.py seeds digits_autoencoder 0,1,2,3,4,5,6,7
    python benchmarks/results/2026-11-29-subbatch-rows.py seeds mlp_classifier 0,1,2,3,4,5
    python benchmarks/results/2026-11-29-subbatch-rows.py seeds digits_autoencoder 0,1,2,3,4,5,6,7 '{"cov_ema_decay": 0.8}'
    python benchmarks/results/2026-11-29-subbatch-rows.py exact
    python benchmarks/results/2026-11-29-subbatch-rows.py reorder SEED R1,R2,... STEPS ADAM_CACHE

seeds: K-FAC (defaults) steps to tuned Adam's 1000-step loss (the autoencoder's 14.32364, the
classifier's 5.85e-5), the model's initialization and the batch order both seeded by SEED.
exact: LeNet-5's factors after one step with stats_batch_size 64 on a 128-row batch against
the whole-batch statistics of every 2nd row alone, and of the first 64 rows alone.
reorder: LeNet-5 (seed SEED) with each batch's rows in a random order seeded by (R, step)
(R = -1: the batch as drawn): every whole-batch term is the same, the statistics take another
random half of the batch; steps to Adam's held-out target (bench_to_target mnist's cache).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
import bench_to_target as bt  # noqa: E402
import kfac_compiler as kc  # noqa: E402
import kfac_compiler.runtime.data as data_mod  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

TARGETS = {"digits_autoencoder": (256, 14.32364, 300), "mlp_classifier": (128, 5.85e-5, 400)}


def seeds(name: str, which: str, knobs: dict) -> None:
    """Steps to the target per seed (init and batch order), K-FAC's defaults or `knobs`."""
    bs, target, max_steps = TARGETS[name]
    found = []
    for s in (int(a) for a in which.split(",")):
        plan, x, y = bt.zoo_case(name, seed=s)
        n = len(y)
        r = bt.train(plan, x, y, bs, "kfac", max_steps, targets=[target],
                     batches=lambda k, s=s, n=n: data_mod.batch_indices(n, bs, k, s), **knobs)
        found.append(r.hit(target)[0])
        print(name, "seed", s, "steps", found[-1], f"final {r.loss:.5g}", flush=True)
    print("all", name, found, "mean", np.mean([f for f in found if f is not None]))


def lenet(seed: int):
    from models.cnn import build_lenet5

    return kc.compile(build_lenet5(seed=seed), loss="softmax_cross_entropy", output="logits", emit=False)


def exact() -> None:
    """The sub-batch's factors are those of its rows alone (every 2nd), not the first 64's."""
    x, y, _, _ = bt.mnist_data_split()
    xb, yb = x[:128], y[:128]
    plan = lenet(0)

    def factors(xx, yy, sbs, mode):
        tr = Trainer(plan, optimizer="kfac", batch_size=len(yy), seed=0, stats_batch_size=sbs, mode=mode)
        tr.step({"input": xx}, yy)
        return {k: v for k, v in tr.state().items() if "/A" in k or "/G" in k}

    for mode in ("gradients", "empirical"):
        sub = factors(xb, yb, 64, mode)
        for label, rows in (("every 2nd row", slice(0, 128, 2)), ("first 64 rows", slice(0, 64))):
            alone = factors(xb[rows], yb[rows], None, mode)
            err = max(float(np.abs(sub[k] - alone[k]).max() / np.abs(alone[k]).max()) for k in alone)
            print(f"{mode}: {len(alone)} factor slots, sub-batch of 64 against {label} alone: max rel diff {err:.2e}")


def reorder(seed: int, which: str, steps: int, cache: str) -> None:
    """Steps to Adam's held-out loss with each batch's rows reordered (R = -1: as drawn)."""
    target = json.load(open(cache))[str(seed)]["target"]
    data = bt.mnist_data_split()
    plan = lenet(seed)
    drawn = data_mod.batch_indices
    for r in (int(a) for a in which.split(",")):
        def shuffled(n, bs, k, s, r=r):
            idx = drawn(n, bs, k, s)
            return idx if r < 0 else idx[np.random.default_rng([r, k]).permutation(len(idx))]

        data_mod.batch_indices = shuffled  # mnist_run imports it at call time
        out = bt.mnist_run(plan, data, "kfac", steps, seed)
        hit = next((s for s, v in out["curve"] if v <= target), None)
        print(f"seed {seed} reorder {r}: steps {hit}, best {out['best']:.4f} @ {out['best_step']}", flush=True)
    data_mod.batch_indices = drawn


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "seeds":
        seeds(args[0], args[1], json.loads(args[2]) if len(args) > 2 else {})
    elif cmd == "exact":
        exact()
    else:
        reorder(int(args[0]), args[1], int(args[2]), args[3])
