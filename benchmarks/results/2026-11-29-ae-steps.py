"""Steps to a digits target with the installed kfac_compiler's K-FAC defaults: bench_to_target
digits' batches (batch_indices, seed 0) and its evaluation (all 1797 digits every 5 steps),
written so that it also runs against an older checkout's API (2026-11-25's 985c3ac):

    python benchmarks/results/2026-11-29-ae-steps.py NAME TARGET [KNOBS_JSON]    # run from /tmp
"""
from __future__ import annotations

import json
import sys

import kfac_compiler as kc
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.data import batch_indices


def main(name: str, target: float, knobs: dict, max_steps: int = 300) -> None:
    bs = {"digits_autoencoder": 256, "mlp_classifier": 128}[name]
    e = ZOO[name]
    try:
        plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
    except TypeError:  # an API without emit=
        plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits")
    inputs, y = e.make_data(None, seed=0)
    x = inputs["input"]
    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=bs, **knobs)
    loss = float("nan")
    for k in range(1, max_steps + 1):
        idx = batch_indices(len(y), bs, k - 1, 0)
        tr.step({"input": x[idx]}, y[idx])
        if k % 5 == 0:
            loss = tr.evaluate({"input": x}, y, batch_size=2048)["loss"]
            if loss <= target:
                print(f"{name}: target {target} reached after {k} steps (loss {loss:.5f})")
                return
    print(f"{name}: not within {max_steps} steps (loss {loss:.5f})")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
