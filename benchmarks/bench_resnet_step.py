"""ResNet-18 (32x32 digits, CPU) step time of our K-FAC, Adam and SGD side by side, and the plan's size.

    python benchmarks/bench_resnet_step.py [--rounds 6] [--batch 32] [--knob learning_rate=0.05 ...]

Needs torch (kfac_compiler.models.torch_exports builds and exports the ResNet-18 twin). One process,
interleaved rounds of 10 steps per optimizer (this machine drifts by +-30%, so only the ratios of one run
compare); the first 3 steps of each optimizer are not timed; K-FAC's mean includes its inverse refreshes.
`--knob` passes K-FAC options (e.g. learning_rate=0.05 momentum=0.9: fixed step, no quadratic model).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402


def main(argv=None) -> None:
    from kfac_compiler.models import torch_exports as te

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--knob", action="append", default=[], help="K-FAC option KEY=VALUE")
    args = ap.parse_args(argv)
    knobs = {k: _number(v) for k, v in (kv.split("=", 1) for kv in args.knob)}
    inputs, y = te.digits_images()
    x, bs = inputs["input"], args.batch
    work = tempfile.mkdtemp()
    path = te.export(te.resnet18(), os.path.join(work, "resnet18.onnx"), x[:2])
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", budget={"batch_size": bs})
    out = plan.save(os.path.join(work, "plan"))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"model {os.path.getsize(path) / 1e6:.1f} MB, plan directory {size / 1e6:.1f} MB "
          f"({size / os.path.getsize(path):.2f}x)")
    c = plan.costs
    print(f"predicted: curvature {c['overhead']:.2f}x the forward+backward, statistics every {c['stats_period']}, "
          f"inverses every {c['inverse_period']} steps; {sum(l.approximation != 'kron' for l in plan.layers)} layers "
          "with a diagonal factor")
    trainers = {"kfac": Trainer(plan, optimizer="kfac", device="cpu", batch_size=bs, seed=0, **knobs),
                "adam": Trainer(plan, optimizer="adam", device="cpu", batch_size=bs, seed=0),
                "sgd": Trainer(plan, optimizer="sgd", device="cpu", batch_size=bs, seed=0)}
    walls: dict[str, list[float]] = {o: [] for o in trainers}
    steps = dict.fromkeys(trainers, 0)
    for _ in range(args.rounds):
        for o, tr in trainers.items():
            for _ in range(10):
                s = steps[o]
                steps[o] += 1
                idx = np.arange(s * bs, (s + 1) * bs) % len(y)
                t = time.perf_counter()
                tr.step({"input": x[idx]}, y[idx])
                if s >= 3:
                    walls[o].append(time.perf_counter() - t)
    for o, w in walls.items():
        print(f"{o:5s} step median {1e3 * np.median(w):8.1f} ms  mean {1e3 * np.mean(w):8.1f} ms  max {1e3 * np.max(w):8.1f} ms")
    for o in ("adam", "sgd"):
        print(f"K-FAC / {o}: mean {np.mean(walls['kfac']) / np.mean(walls[o]):.2f}x, "
              f"median {np.median(walls['kfac']) / np.median(walls[o]):.2f}x")


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


if __name__ == "__main__":
    main()
