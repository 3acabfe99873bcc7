"""Held-out loss every 5 steps of default K-FAC on a real GPT export (tests/fixtures/real) with
a tied_embedding block, for 2026-11-29-tied-memory.md (issue 36, item 3: the oscillation).

    python benchmarks/results/2026-11-29-tied-stability.py FIXTURE BLOCK [KNOBS_JSON] [--trace]

Data: models/real_data.py's pixel tokens (all 1,797 rows; the last 256 held out; tokens
0..16 of the vocabulary of 32, so 15 tokens never occur), batch 32 in order, 60 steps, seed 0.
KNOBS_JSON: Trainer options (e.g. '{"damping": 0.01}'). --trace: the Kronecker variants'
combine="trace" (a block option without a config key; set here on the class).
"""
from __future__ import annotations

import json
import sys
import warnings

import numpy as np

import kfac_compiler as kc
import kfac_compiler.blocks.tied as tied
from kfac_compiler.models.real_data import batch
from kfac_compiler.runtime import Trainer


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--trace"]
    if "--trace" in sys.argv:
        init = tied.TiedKronBase.__init__

        def with_trace(self, *a, **options):
            options.setdefault("combine", "trace")
            init(self, *a, **options)

        tied.TiedKronBase.__init__ = with_trace
    case, block = args[0], args[1]
    knobs = json.loads(args[2]) if len(args) > 2 else {}
    warnings.simplefilter("ignore")
    plan = kc.compile(f"tests/fixtures/real/{case}.onnx", loss="softmax_cross_entropy",
                      config={"approximations": {"tied_embedding": block}})
    x, y = batch("tokens", None, 0)
    (hx, hy), x, y = (x[-256:], y[-256:]), x[:-256], y[:-256]
    trainer = Trainer(plan, optimizer="kfac", seed=0, **knobs)
    held, losses = [], []
    for s in range(60):
        i = (np.arange(32) + 32 * s) % len(x)
        losses.append(round(float(trainer.step({"input": x[i]}, y[i])["loss"]), 2))
        if s % 5 == 4:
            held.append(round(trainer.evaluate({"input": hx}, hy)["loss"], 2))
    print(json.dumps({"fixture": case, "block": block, "knobs": knobs, "trace": "--trace" in sys.argv,
                      "held_every_5": held, "batch_losses_0_9": losses[:10]}))


if __name__ == "__main__":
    main()
