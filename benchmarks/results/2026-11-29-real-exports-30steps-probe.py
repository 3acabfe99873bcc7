"""Per-step K-FAC metrics (batch loss, damping, alpha, mu, rho, rejected) of one real-export
fixture on bench_to_target.held_out_run's batch stream (batch 32, seed 0), to see why a
30-step held-out loss ends where it does:

    python benchmarks/results/2026-11-29-real-exports-30steps-probe.py CASE [KNOBS_JSON [CONFIG_JSON]]
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_to_target as b  # noqa: E402
from kfac_compiler.models.real_data import batch  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

KEYS = ("loss", "damping", "learning_rate", "momentum", "update_norm", "grad_norm", "rho", "rejected", "new_loss")


def main(case: str, knobs: dict, config: dict | None, steps: int = 30, bs: int = 32) -> None:
    """Prints the plan's blocks, the held-out loss before, each step's metrics, and after."""
    fixtures = b.ROOT / "tests/fixtures/real"
    entry = json.loads((fixtures / "manifest.json").read_text())[case]
    plan = b._compile_quiet(fixtures / f"{case}.onnx", config=config)
    print(dict(Counter(f"{layer.kind}/{layer.approximation}" for layer in plan.layers)))
    x, y = batch(entry["kind"], None, seed=0)
    ex, ey = x[-b.HELD_OUT:], y[-b.HELD_OUT:]
    tr = Trainer(plan, optimizer="kfac", device="cpu", seed=0, batch_size=bs, **knobs)
    print("held-out loss at 0", tr.evaluate({"input": ex}, ey)["loss"])
    for s in range(steps):
        lo = (s * bs) % (len(y) - b.HELD_OUT - bs)
        m = tr.step({"input": x[lo:lo + bs]}, y[lo:lo + bs])
        print(s, " ".join(f"{k}={m[k]:.4g}" for k in KEYS if k in m))
    print(f"held-out loss at {steps}", tr.evaluate({"input": ex}, ey)["loss"])


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {},
         json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
