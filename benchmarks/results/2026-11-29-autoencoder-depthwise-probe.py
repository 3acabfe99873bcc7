"""Which layers' moves cost a real export its 30-step held-out loss: one run of `optimizer`
(K-FAC with knobs, or Adam lr 1e-3) on bench_to_target.held_out_run's batch stream (batch 32; seed
0, or another seed of the digits' order and of the Trainer),
then, per block family (layer kind / block), the held-out loss with that family's parameters
put back to their initial values, minus the loss after the run (negative: the family's moves
raised the loss), and the family's relative move |theta_30 - theta_0| / |theta_0|.
One JSON line on stdout:

    python benchmarks/results/2026-11-29-autoencoder-depthwise-probe.py CASE [KNOBS_JSON [CONFIG_JSON|null [OPTIMIZER [SEED]]]]

e.g. `mobilenet_v3-ts '{}' '{"approximations": {"depthwise_conv": "kron"}}'`, or
`mobilenet_v3-ts '{"param_groups": [{"kind": "depthwise_conv", "optimizer": "adam", "learning_rate": 1e-3}]}'`.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_to_target as b  # noqa: E402
from kfac_compiler.models.real_data import batch  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402


def norm(vs: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in vs)))


def main(case: str, knobs: dict, config: dict | None, optimizer: str = "kfac", seed: int = 0, steps: int = 30,
         bs: int = 32) -> dict:
    fixtures = b.ROOT / "tests/fixtures/real"
    entry = json.loads((fixtures / "manifest.json").read_text())[case]
    plan = b._compile_quiet(fixtures / f"{case}.onnx", config=config)
    x, y = batch(entry["kind"], None, seed=seed)
    ex, ey = x[-b.HELD_OUT:], y[-b.HELD_OUT:]
    if optimizer == "adam":
        knobs = {"learning_rate": 1e-3, **knobs}
    tr = Trainer(plan, optimizer=optimizer, device="cpu", seed=seed, batch_size=bs, **knobs)
    p0 = {k: v.copy() for k, v in tr.parameters().items()}
    loss0 = tr.evaluate({"input": ex}, ey)["loss"]
    for s in range(steps):  # held_out_run's batches
        lo = (s * bs) % (len(y) - b.HELD_OUT - bs)
        tr.step({"input": x[lo:lo + bs]}, y[lo:lo + bs])
    p1 = {k: v.copy() for k, v in tr.parameters().items()}
    loss = tr.evaluate({"input": ex}, ey)["loss"]
    families: dict[str, list[str]] = defaultdict(list)
    for layer in plan.layers:
        families[f"{layer.kind}/{layer.approximation}"] += [p for p in layer.params if p in p0]
    revert, moved = {}, {}
    for fam, ps in families.items():
        tr.set_parameters({**p1, **{p: p0[p] for p in ps}})
        revert[fam] = round(tr.evaluate({"input": ex}, ey)["loss"] - loss, 4)
        moved[fam] = round(norm([p1[p] - p0[p] for p in ps]) / max(norm([p0[p] for p in ps]), 1e-12), 3)
    tr.set_parameters(p1)
    return {"case": case, "seed": seed, "optimizer": optimizer, "knobs": knobs, "config": config, "loss0": loss0, "loss": loss,
            "revert": revert, "rel_move": moved}


if __name__ == "__main__":
    a = sys.argv
    print(json.dumps(main(a[1], json.loads(a[2]) if len(a) > 2 else {},
                          json.loads(a[3]) if len(a) > 3 and a[3] != "null" else None,
                          a[4] if len(a) > 4 else "kfac", int(a[5]) if len(a) > 5 else 0)))
