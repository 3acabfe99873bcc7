"""A prototype for issue 36 item 2 (2026-11-30-relative-cap.md): the quadratic model's decrease
cap k relative to the run's recent predicted decreases, k_t = min(max_predicted_decrease,
M x the median of -qmodel_change / loss over the last W applied steps), patched into the
K-FAC policy's hyper-parameters from the host (the graph's hp/max_predicted_decrease); then
another benchmark script runs under the patch.

    RELCAP=M,W python benchmarks/results/2026-11-30-relative-cap.py SCRIPT [ARGS ...]
    RELCAP=2,10 python benchmarks/results/2026-11-30-relative-cap.py \\
        benchmarks/results/2026-11-30-knob-seeds.py mlp_classifier 128 \\
        0.0001657731190789491,5.846880958415568e-05 8 400 '{"k1": {}}'
    RELCAP=2,10 python benchmarks/results/2026-11-30-relative-cap.py \\
        benchmarks/results/2026-11-30-budget-overhead.py steps OUT.json resnet18 0,1,2 o1+max_predicted_decrease=1.0

With OUTLIER_CAP=F,K,W the cap is K only on a batch whose loss (one extra forward pass before
the step: the prototype's cost) exceeds F x the median of the last W applied batch losses.
With GUARD_MEDIAN=F the spike guard's limit is F x the MEDIAN batch loss of its window
instead of loss_spike_factor x the largest (the guard's other rules unchanged). Without either
variable the script runs unpatched.
"""
from __future__ import annotations

import os
import runpy
import statistics
import sys
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from kfac_compiler.optimizers import kfac as K  # noqa: E402
from kfac_compiler.optimizers.kfac import graph as G  # noqa: E402


def patch(m: float, window: int) -> None:
    hyper_parameters, step = K.Kfac._hyper_parameters, K.Kfac.step

    def patched_hyper_parameters(self, adapt, k):
        hp = hyper_parameters(self, adapt, k)
        fractions = getattr(self, "_fractions", ())
        if len(fractions) >= window and G.MAX_PREDICTED_DECREASE in hp:
            hp[G.MAX_PREDICTED_DECREASE] = min(hp[G.MAX_PREDICTED_DECREASE], m * statistics.median(fractions))
        return hp

    def patched_step(self, data):
        out = step(self, data)
        if not hasattr(self, "_fractions"):
            self._fractions = deque(maxlen=window)
        change, loss = out.get("qmodel_change", float("nan")), out.get("loss", 0.0)
        if not out.get("rejected") and loss > 0 and change == change:
            self._fractions.append(-change / loss)
        return out

    K.Kfac._hyper_parameters, K.Kfac.step = patched_hyper_parameters, patched_step


def patch_guard(factor: float) -> None:
    def loss_limit(self):
        if self.config.loss_spike_factor is None or not self.unchecked_update or not self.recent_losses:
            return float("inf")
        return factor * statistics.median(self.recent_losses)

    K.Kfac.loss_limit = loss_limit


def patch_outlier_cap(factor: float, k: float, window: int) -> None:
    from kfac_compiler import contract as C

    hyper_parameters, step = K.Kfac._hyper_parameters, K.Kfac.step

    def patched_step(self, data):
        if not hasattr(self, "_losses"):
            self._losses = deque(maxlen=window)
        self._outlier = False
        if len(self._losses) >= window:
            tr = self.trainer
            loss = float(tr.program(C.LOSS_GRAPH).run(tr.store, data, results=False, channel="eval")[C.LOSS])
            self._outlier = loss > factor * statistics.median(self._losses)
        out = step(self, data)
        if not out.get("rejected"):
            self._losses.append(out["loss"])
        return out

    def patched_hyper_parameters(self, adapt, step_index):
        hp = hyper_parameters(self, adapt, step_index)
        if getattr(self, "_outlier", False) and G.MAX_PREDICTED_DECREASE in hp:
            hp[G.MAX_PREDICTED_DECREASE] = k
        return hp

    K.Kfac._hyper_parameters, K.Kfac.step = patched_hyper_parameters, patched_step


if __name__ == "__main__":
    if os.environ.get("RELCAP"):
        m, w = os.environ["RELCAP"].split(",")
        patch(float(m), int(w))
    if os.environ.get("OUTLIER_CAP"):
        f, k, w = os.environ["OUTLIER_CAP"].split(",")
        patch_outlier_cap(float(f), float(k), int(w))
    if os.environ.get("GUARD_MEDIAN"):
        patch_guard(float(os.environ["GUARD_MEDIAN"]))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
