"""Measurements for 2026-11-29-frontend-gaps.md (issue 38 item 2: weight norm, Swin-ts, folded shapes).

    python benchmarks/results/2026-11-29-frontend-gaps.py wnorm [pinned]  # wav2vec2-dynamo_noopt: K-FAC with/without the block
    python benchmarks/results/2026-11-29-frontend-gaps.py symbolic  # which fixtures need the symbolic shapes, its cost

`wnorm`: 20 default K-FAC steps on the fixture's batch of 8 (as tests/test_real_exports.py's
train check), the weight_norm_conv patterns registered (now) or unregistered (before: g, v and
the bias generic diagonal), seeds 0-2; the loss after each is deterministic given the seed.
`symbolic`: per fixture, whether a structured layer's use is left unplaced by ONNX's shapes
(then passes/batch_axis.symbolic_view runs) and that call's wall time (median of 3; noisy on
a shared machine).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

import kfac_compiler as kc

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "real"
# `wnorm pinned`: the periods pinned (statistics every step, inverses every 10) so that the two
# plans differ in the positional conv's block only (unpinned, the budget gives the plan with
# the generic 512-wide diagonal of v statistics every 10 steps)
CONFIG = {"stats": {"update_period": 1}, "inverse": {"update_period": 10}} if sys.argv[2:] == ["pinned"] else None


def wnorm() -> None:
    from kfac_compiler.patterns import patterns, register_pattern, unregister_pattern
    from kfac_compiler.runtime import Trainer

    case = "wav2vec2-dynamo_noopt"
    d = np.load(FIXTURES / f"{case}.npz")
    inputs, targets = {"input": d["input"]}, d["targets"]
    wn = [p for p in patterns() if p.kind == "weight_norm_conv"]
    for label in ("after", "before"):
        if label == "before":
            for p in wn:
                unregister_pattern(p.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = kc.compile(str(FIXTURES / f"{case}.onnx"), loss="softmax_cross_entropy", output="logits",
                              config=CONFIG)
        t = plan.totals()
        kinds = sorted({(l.kind, l.approximation) for l in plan.layers if "pos_conv" in l.name})
        for seed in range(3):
            tr = Trainer(plan, optimizer="kfac", device="cpu", seed=seed)
            losses = [tr.evaluate(inputs, targets)["loss"]]
            for _ in range(20):
                tr.step(inputs, targets)
                losses.append(tr.evaluate(inputs, targets)["loss"])
            print(json.dumps({"label": label, "seed": seed, "coverage": t["structured_elements"] / t["param_elements"],
                              "pos_conv_blocks": kinds, "loss_0": losses[0], "loss_5": losses[5],
                              "loss_10": losses[10], "loss_20": losses[20]}))
    for p in wn:
        register_pattern(p)


def symbolic() -> None:
    from kfac_compiler.graph import GraphView
    from kfac_compiler.passes.batch_axis import example_layouts, symbolic_view

    for path in sorted(FIXTURES.glob("*.onnx")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = kc.compile(str(path), loss="softmax_cross_entropy", output="logits", emit=False)
        view = GraphView(plan.model)
        lay = example_layouts(view)
        needed = [l.name for l in plan.layers if l.kind != "generic" and any(lay.get(u.output) is None for u in l.uses)]
        if not needed:
            continue
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            symbolic_view(view)
            times.append(time.perf_counter() - t0)
        notes = [n for n in plan.notes if "could not be traced" in n]
        print(json.dumps({"fixture": path.stem, "nodes": len(plan.model.graph.node), "unplaced_layers": len(needed),
                          "symbolic_s_median": round(statistics.median(times), 3),
                          "symbolic_s_range": [round(min(times), 3), round(max(times), 3)],
                          "untraced_notes": len(notes)}))


if __name__ == "__main__":
    {"wnorm": wnorm, "symbolic": symbolic}[sys.argv[1]]()
