"""Issue 38 item 4 (session setup linear in the layers): a large graph run as a chain of
bounded stages (runtime/staged.py, `STAGED_ABOVE_NODES` / `STAGE_NODES` in
runtime/program.py) against the whole graph in one session (2026-11-30-staged-setup.md).

    python benchmarks/results/2026-11-30-staged-setup.py [--optimizer kfac] [--stage-nodes 1000]
        [--whole] [--steps-below 1500] [--out FILE.json] LAYERS...

Per size, in a child process each (one run per cell, whole graph first when --whole): a deep
MLP (bench_step.py:deep_mlp, width 32) compiled without emission, then a Trainer (batch 32)
made and stepped 12 times (every session kind made: statistics, steady step, refresh), then
20 more steps timed. The setup is split by the `kfac_compiler.setup` logger's stages
(kfac_compiler/progress.py): emission, cutting in stages, ONNX Runtime sessions. With
--whole, below --steps-below layers, one more child makes both trainers and alternates their
steps (40 rounds after 12 warm-up steps each): the step times to compare, and whether the
losses are the same.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def one(layers: int, optimizer: str, above: int, stage_nodes: int) -> dict:
    import warnings

    import numpy as np

    import kfac_compiler as kc
    from bench_step import deep_mlp
    from kfac_compiler import progress
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime import program as RP

    RP.STAGED_ABOVE_NODES, RP.STAGE_NODES = above, stage_nodes
    parts: dict[str, float] = defaultdict(float)

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            what = record.getMessage().split(":")[0]
            kind = ("emission" if what.startswith("emitted") else "cut" if what.startswith("cut ")
                    else "sessions" if what.startswith("ONNX Runtime session") and "/stage" not in what else None)
            if kind:
                parts[kind] += float(getattr(record, "seconds", 0.0))

    progress.LOGGER.addHandler(Collect())
    progress.LOGGER.setLevel(logging.INFO)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    plan = kc.compile(deep_mlp(layers, 32), loss="softmax_cross_entropy", emit=False)
    compile_s = time.perf_counter() - t0
    parts.clear()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32)).astype(np.float32)
    y = rng.integers(0, 32, 512).astype(np.int64)
    t0 = time.perf_counter()
    tr = Trainer(plan, optimizer=optimizer, batch_size=32, seed=0)
    for i in range(12):
        tr.step({"input": x[32 * i:32 * (i + 1)]}, y[32 * i:32 * (i + 1)])
    setup = time.perf_counter() - t0
    walls = []
    for i in range(12, 32):
        j = i % 16
        began = time.perf_counter()
        tr.step({"input": x[32 * j:32 * (j + 1)]}, y[32 * j:32 * (j + 1)])
        walls.append(time.perf_counter() - began)
    progs = tr.programs()
    return {"layers": layers, "optimizer": optimizer, "whole": above >= 10 ** 9, "stage_nodes": stage_nodes,
            "compile s": round(compile_s, 2), "setup and 12 steps s": round(setup, 1),
            **{f"{k} s": round(v, 1) for k, v in sorted(parts.items())},
            "step ms (median of 20)": round(1e3 * float(np.median(walls)), 1),
            "sessions": {k: len(getattr(p, "programs", [p])) for k, p in progs.items()},
            "load": round(os.getloadavg()[0], 2)}


def interleaved(layers: int, optimizer: str, above: int, stage_nodes: int, rounds: int = 40) -> dict:
    """Both trainers in one process, their steps alternating: the whole graph's and the
    stages' step times (median, min, max in ms) and the largest loss difference."""
    import warnings

    import numpy as np

    import kfac_compiler as kc
    from bench_step import deep_mlp
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime import program as RP

    warnings.simplefilter("ignore")
    plan = kc.compile(deep_mlp(layers, 32), loss="softmax_cross_entropy", emit=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32)).astype(np.float32)
    y = rng.integers(0, 32, 512).astype(np.int64)
    trainers = {}
    for label, threshold in (("whole", 10 ** 9), ("stages", above)):
        RP.STAGED_ABOVE_NODES, RP.STAGE_NODES = threshold, stage_nodes
        trainers[label] = Trainer(plan, optimizer=optimizer, batch_size=32, seed=0)
    walls: dict[str, list[float]] = {k: [] for k in trainers}
    losses: dict[str, list[float]] = {k: [] for k in trainers}
    for i in range(12 + rounds):
        j = i % 16
        batch = ({"input": x[32 * j:32 * (j + 1)]}, y[32 * j:32 * (j + 1)])
        for label, tr in trainers.items():
            began = time.perf_counter()
            losses[label].append(tr.step(*batch)["loss"])
            if i >= 12:
                walls[label].append(1e3 * (time.perf_counter() - began))
    return {"layers": layers, "interleaved step ms": {k: [round(float(np.median(v)), 1), round(min(v), 1),
                                                          round(max(v), 1)] for k, v in walls.items()},
            "largest loss difference": max(abs(a - b) for a, b in zip(losses["whole"], losses["stages"])),
            "load": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layers", type=int, nargs="*")
    ap.add_argument("--optimizer", default="kfac")
    ap.add_argument("--stage-nodes", type=int, default=None, help="default: runtime/program.py's STAGE_NODES")
    ap.add_argument("--whole", action="store_true", help="also the whole graph in one session (before the stages)")
    ap.add_argument("--steps-below", type=int, default=1500)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, layers, opt, above, nodes = args.child
        work = one if what == "setup" else interleaved
        print(json.dumps(work(int(layers), opt, int(above), int(nodes))))
        return
    from kfac_compiler.runtime import program as RP

    nodes = args.stage_nodes or RP.STAGE_NODES
    rows = []
    for layers in args.layers:
        runs = [("setup", above) for above in ([10 ** 9] if args.whole else []) + [RP.STAGED_ABOVE_NODES]]
        if args.whole and layers < args.steps_below:
            runs.append(("steps", RP.STAGED_ABOVE_NODES))
        for what, above in runs:
            out = subprocess.run([sys.executable, __file__, "--child", what, str(layers), args.optimizer, str(above),
                                  str(nodes)], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
