"""Trainers with different knobs on one plan, stepped in interleaved blocks in one process
(the first one is the reference of the per-round ratios): e.g. K-FAC's static_steps against
the If form, with Adam beside them. Per-round mean step times, their median and min-max.

    python benchmarks/results/2026-11-29-knob-ab.py resnet18|ZOO_NAME ROUNDS BLOCK \\
        'if=kfac:{}' 'static=kfac:{"static_steps": true}' 'adam=adam:{}'
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import harness  # noqa: E402
import kfac_compiler as kc  # noqa: E402
from kfac_compiler.models import ZOO  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402


def case(name: str, work: str):
    """(plan, inputs, targets, batch)."""
    if name == "resnet18":
        from bench_step import resnet_export
        path, _, x, y = resnet_export(work)
        return kc.compile(path, loss="softmax_cross_entropy", output="logits", budget={"batch_size": 32}), x, y, 32
    z = ZOO[name]
    inputs, y = z.make_data(1792, seed=0)
    plan = kc.compile(z.build(seed=0), loss=z.loss, output=z.output_name, budget={"batch_size": 128})
    return plan, inputs[z.input_name], y, 128


def main() -> None:
    name, rounds, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    specs = []
    for arg in sys.argv[4:]:
        label, rest = arg.split("=", 1)
        opt, knobs = rest.split(":", 1)
        specs.append((label, opt, json.loads(knobs)))
    with tempfile.TemporaryDirectory() as work:
        plan, x, y, bs = case(name, work)
        trainers = {label: Trainer(plan, optimizer=opt, device="cpu", batch_size=bs, seed=0, **knobs)
                    for label, opt, knobs in specs}
        count = dict.fromkeys(trainers, 0)

        def steps(key: str) -> list[float]:
            walls = []
            for _ in range(block):
                s = count[key]
                count[key] += 1
                idx = np.arange(s * bs, (s + 1) * bs) % len(y)
                walls.append(trainers[key].step({"input": x[idx]}, y[idx])["step_time"])
            return walls

        for key in trainers:  # sessions built, first runs made: not timed
            steps(key)
        res = harness.interleave({k: (lambda k=k: steps(k)) for k in trainers}, rounds, gap=0.3)
    print(f"{name} batch {bs}, {rounds} rounds x {block} steps, load {os.getloadavg()}")
    means = {k: [1e3 * float(np.mean(r)) for r in res[k]] for k in trainers}
    base = specs[0][0]
    for k, m in means.items():
        ratios = [a / b for a, b in zip(m, means[base])]
        print(f"{k:14s} mean/round median {harness.median(m):8.2f} ms ({min(m):.2f}-{max(m):.2f})  "
              f"/ {base}: {harness.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
