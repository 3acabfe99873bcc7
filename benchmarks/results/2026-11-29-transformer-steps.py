"""Ablation of default K-FAC on the zoo's transformer_block (issue 36): steps to tuned Adam's
500-step loss and the final loss, per knob and per block family, with the step metrics'
trajectories, for 2026-11-29-transformer-steps.md.

    python benchmarks/results/2026-11-29-transformer-steps.py OUT.jsonl 'LABEL' '{"knobs": {...}, "approx": {...}}' ...

Workload: bench_to_target.py zoo's (the zoo model at seed 0, all 1,797 digit rows as 8-token
sequences, batch 128, batch_indices(1797, 128, k, 0), the full-data loss every 5 steps, 500
steps); TARGET is tuned Adam's 500-step loss there (lr 1e-2: 11.9837, /tmp/xfmr-adam.json).
"knobs": K-FAC options; "approx": the compile config's `approximations` (per kind, menu key or
layer name via "layers"); "model" (default transformer_block), "steps" (500), "batch" (128;
the data set's size: every step on all of it), "optimizer" (kfac). One JSON line
per run: the curve, the steps to the target, and per step damping, alpha, mu, rho,
update_scale, |u| and the batch loss.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import harness  # noqa: E402

harness.import_paths()

from bench_to_target import zoo_case  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices  # noqa: E402

TARGETS = {"transformer_block": 11.983743667602539}
FIELDS = ("loss", "qmodel_change", "damping", "curvature_scale", "learning_rate", "momentum", "rho", "update_scale", "update_norm", "rejected", "spike")


def run(spec: dict) -> dict:
    """One K-FAC run of spec: its curve, steps to the target and the per-step metrics."""
    model = spec.get("model", "transformer_block")
    config = spec.get("config") or ({"approximations": spec["approx"]} if spec.get("approx") else None)
    plan, x, y = zoo_case(model, config=config)
    bs = int(spec.get("batch", 128))
    tr = Trainer(plan, optimizer=spec.get("optimizer", "kfac"), batch_size=bs, **spec.get("knobs", {}))
    steps, target = int(spec.get("steps", 500)), TARGETS.get(model, -math.inf)
    out: dict = {"curve": [], "hit": None, "metrics": {f: [] for f in FIELDS}}
    for k in range(steps):
        idx = batch_indices(len(y), bs, k, 0) if bs < len(y) else slice(None)
        m = tr.step({"input": x[idx]}, y[idx])
        for f in FIELDS:
            v = m.get(f)
            out["metrics"][f].append(None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v))
        if (k + 1) % 5 == 0:
            loss = float(tr.evaluate({"input": x}, y, batch_size=2048)["loss"])
            out["curve"].append((k + 1, loss))
            if out["hit"] is None and loss <= target:
                out["hit"] = k + 1
            if not math.isfinite(loss):
                break
    out["final"] = out["curve"][-1][1]
    out["best"] = min(v for _, v in out["curve"])
    return out


def main() -> None:
    path, pairs = sys.argv[1], sys.argv[2:]
    for label, spec_text in zip(pairs[::2], pairs[1::2]):
        spec = json.loads(spec_text)
        r = run(spec)
        with open(path, "a") as f:
            f.write(json.dumps({"label": label, "spec": spec, **r}) + "\n")
        print(f"{label}: steps {r['hit'] or '-'} final {r['final']:.4f} best {r['best']:.4f}", flush=True)


if __name__ == "__main__":
    main()
