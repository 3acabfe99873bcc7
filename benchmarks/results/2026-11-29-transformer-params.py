"""Where default K-FAC's steps go on the zoo's transformer_block (issue 36): each parameter's
share of sum |u|^2 over steps 100-199, its rms step and its norm at step 200, for
2026-11-29-transformer-steps.md.

    python benchmarks/results/2026-11-29-transformer-params.py '{}'
    python benchmarks/results/2026-11-29-transformer-params.py '{"min_damping": 1e-8}'

The argument: K-FAC options. Batches as bench_to_target.py zoo's (batch 128, seed 0).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import harness  # noqa: E402

harness.import_paths()

from bench_to_target import zoo_case  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices  # noqa: E402


def main() -> None:
    knobs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    plan, x, y = zoo_case("transformer_block")
    tr = Trainer(plan, optimizer="kfac", batch_size=128, **knobs)
    moved: dict[str, float] = {}
    prev = tr.parameters()
    for k in range(200):
        idx = batch_indices(len(y), 128, k, 0)
        tr.step({"input": x[idx]}, y[idx])
        cur = tr.parameters()
        if k >= 100:
            for p in cur:
                moved[p] = moved.get(p, 0.0) + float(np.sum((cur[p] - prev[p]) ** 2))
        prev = {p: v.copy() for p, v in cur.items()}
    total = sum(moved.values())
    for p, v in sorted(moved.items(), key=lambda t: -t[1]):
        print(f"{p:20s} share {v / total:.3f} rms step {np.sqrt(v / 100):.3f} |theta| {np.linalg.norm(cur[p]):.2f}")


if __name__ == "__main__":
    main()
