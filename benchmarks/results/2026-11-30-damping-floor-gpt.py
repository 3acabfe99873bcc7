"""Damping floors for the byte-level GPT (issue 36 item 2), for 2026-11-30-damping-floor-gpt.md:
a fixed floor, a floor relative to the exact curvature along P, and a floor raised by the
plateau rule once c is at its cap. The two adaptive floors are host-side patches defined
here (measured, not added to the library).

    python benchmarks/results/2026-11-30-damping-floor-gpt.py gpt OUT.json SEED APPROX [STEPS]
    python benchmarks/results/2026-11-30-damping-floor-gpt.py zoo-rq

`gpt`: 2026-11-30-tied-sum.py's GPT (2 x 128, tied head, context 64, 256 bytes; its data and
batches), default K-FAC with `approximations: {tied_embedding: APPROX}`, every step's metrics
(and the held-out loss per byte every 50 steps) to OUT.json. Env: KFAC_KNOBS (K-FAC options as
JSON, e.g. '{"min_damping": 0.01, "damping": 0.01}'); RF_R > 0: the relative floor
max(min_damping, RF_R x the median of the last RF_W (10) steps' rq); PF_K > 0: the plateau
floor (a window the plateau rule finds slow while c is at its cap multiplies the floor by PF_K,
up to PF_MAX (0.1); a recovering window divides it, down to min_damping); MC_CAP > 0: the
momentum cap (max_momentum) is MC_CAP while the plateau rule holds c above its starting value,
1 otherwise.

`rq` (the exact GGN's Rayleigh quotient along P, (P.C P / N) / P.P, undamped, before the
curvature scale) is not a metric of the library: RF_R and `zoo-rq` need this two-line patch
of kfac_compiler/optimizers/kfac (applied on 6e991ee for the results):

    graph.py, quadratic_model, after `curvature, j_p, j_v = curvature_dots(...)`:
        em.metric(C.metric("rq"), b.div(b.div(curvature[(0, 0)], n), dots("P", "P")))
    __init__.py, Kfac.step's metrics dict:
        "rq": out.get("metric/rq", float("nan")),

`zoo-rq`: rq at step 0, its median over steps 1-19 and 20-99 on the digits and zoo workloads
(default K-FAC, bench_to_target's batches). Deterministic; needs torch.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import sys
import time
from collections import deque

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from kfac_compiler.optimizers.kfac import Kfac, plateau  # noqa: E402

RF_R, RF_W = float(os.environ.get("RF_R", "0")), int(os.environ.get("RF_W", "10"))
PF_K, PF_MAX = float(os.environ.get("PF_K", "0")), float(os.environ.get("PF_MAX", "0.1"))
MC_CAP = float(os.environ.get("MC_CAP", "0"))


_step, _observe = Kfac.step, plateau.CurvatureScaleRule.observe


def patched_step(self: Kfac, data):
    """Kfac.step with the relative floor and the momentum cap applied before it and the rq
    history kept after."""
    base = self.__dict__.setdefault("base_floor", self.config.min_damping)
    history = self.__dict__.setdefault("rq_history", deque(maxlen=RF_W))
    if RF_R > 0 and history:
        floor = max(base, RF_R * float(np.median(history)))
        self.config.min_damping = floor
        self.damping = min(max(self.damping, floor), self.config.max_damping)
    self.curvature_scale.owner = self
    if MC_CAP > 0:
        rule = self.curvature_scale
        self.config.max_momentum = MC_CAP if rule.scale > rule.initial else 1.0
    m = _step(self, data)
    rq = m.get("rq", float("nan"))
    if RF_R > 0 and not math.isfinite(rq):
        raise SystemExit("RF_R needs the rq metric: apply the patch in this script's docstring")
    if math.isfinite(rq) and not m.get("rejected"):
        history.append(rq)
    m["floor"], m["mu_cap"] = self.config.min_damping, self.config.max_momentum
    return m


def patched_observe(self: plateau.CurvatureScaleRule, loss: float) -> None:
    """The plateau rule, then the plateau floor at the end of a window (PF_K > 0)."""
    scale, best = self.scale, self.best
    _observe(self, loss)
    kfac = getattr(self, "owner", None)
    window_ended = self.adapt and math.isfinite(loss) and not self.losses
    if PF_K <= 0 or kfac is None or not window_ended or best is None or self.best is None:
        return
    fall = (best - self.best) / abs(best) if best else 0.0
    base = kfac.__dict__.setdefault("base_floor", kfac.config.min_damping)
    if scale >= self.max_scale and fall < self.plateau:
        kfac.config.min_damping = min(kfac.config.min_damping * PF_K, PF_MAX)
        kfac.damping = max(kfac.damping, kfac.config.min_damping)
    elif fall >= plateau.RECOVERY * self.plateau:
        kfac.config.min_damping = max(kfac.config.min_damping / PF_K, base)


Kfac.step = patched_step
plateau.CurvatureScaleRule.observe = patched_observe


def gpt_run(out: str, seed: int, approx: str, steps: int) -> None:
    ts = importlib.import_module("2026-11-30-tied-sum")
    train, held = ts.spikes.windows()
    tr, rows, t0 = ts.trainer(approx, seed, train), [], time.time()
    for s in range(steps):
        idx = ts.batch_indices(len(train), ts.BS, s, seed)
        m = tr.step({"input": train[idx, :-1]}, train[idx, 1:])
        row = {k: float(np.asarray(v).ravel()[0]) for k, v in m.items() if np.asarray(v).size == 1}
        if (s + 1) % 50 == 0:
            row["held"] = float(tr.evaluate({"input": held[:, :-1]}, held[:, 1:])["loss"]) / ts.T
            print(s + 1, f"held {row['held']:.3f} damping {row['damping']:.3g} floor {row['floor']:.3g}", flush=True)
        rows.append(row)
    with open(out, "w") as f:
        json.dump(rows, f)
    print(f"{time.time() - t0:.0f} s")


def zoo_rq() -> None:
    import bench_to_target as bt
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices
    for name, bs in (("digits_autoencoder", 256), ("mlp_classifier", 128), ("small_cnn", 128),
                     ("depthwise_cnn", 128), ("transformer_block", 128)):
        plan, x, y = bt.zoo_case(name)
        tr = Trainer(plan, optimizer="kfac", batch_size=bs, seed=0)
        rq = []
        for k in range(100):
            idx = batch_indices(len(y), bs, k, 0)
            rq.append(tr.step({"input": x[idx]}, y[idx]).get("rq", float("nan")))
        if not math.isfinite(rq[0]):
            raise SystemExit("zoo-rq needs the rq metric: apply the patch in this script's docstring")
        print(f"{name}: rq step 0 {rq[0]:.3g}, median 1-19 {statistics.median(rq[1:20]):.3g}, "
              f"20-99 {statistics.median(rq[20:]):.3g}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "zoo-rq":
        zoo_rq()
    else:
        gpt_run(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 600)
