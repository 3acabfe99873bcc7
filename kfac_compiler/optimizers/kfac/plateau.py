"""The plateau rule for the quadratic model's curvature scale c (KfacConfig.adapt_curvature_scale).

The quadratic model picks the step that is best for the batch. Where the loss can go to ~0
(the data is fitted) that greedy step is right; at a minibatch-noise floor (token LMs and
transformers at small batches) it fits each batch's noise, and a step ~1/c as long, which
averages the noise over steps, makes progress where the greedy one stalls
(benchmarks/results/2026-11-29-transformer-step-scale.md). The floor shows itself as a
batch loss that stops falling, so, as ReduceLROnPlateau does for a learning rate: every
`window` applied steps the median batch loss of the window is compared with the previous
window's; when it fell by less than `plateau` (relative) c doubles, up to `max_scale`; when
it fell by more than RECOVERY times that, the floor has moved and c halves again, down to
the configured starting value. The median, not the mean: a spike the guard lets through
moves a mean by orders of magnitude, a median not at all.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

RECOVERY = 5.0  # a window that falls by RECOVERY * plateau or more halves c


class CurvatureScaleRule:
    """c and the rule's window of batch losses (checkpointed with the optimizer's host state, so
    that a resumed run takes the uninterrupted run's decisions)."""

    def __init__(self, initial: float, window: int, plateau: float, max_scale: float, adapt: bool) -> None:
        self.initial, self.window, self.plateau, self.max_scale, self.adapt = (
            float(initial), int(window), float(plateau), float(max_scale), bool(adapt))
        self.scale = float(initial)
        self.losses: list[float] = []  # the current window's batch losses
        self.previous: float | None = None  # the previous window's median

    def observe(self, loss: float) -> None:
        """Count an applied step's batch loss; at the end of a window, adapt c."""
        if not self.adapt or not math.isfinite(loss):
            return
        self.losses.append(float(loss))
        if len(self.losses) < self.window:
            return
        median = statistics.median(self.losses)
        self.losses = []
        previous, self.previous = self.previous, median
        if previous is None:
            return
        fall = (previous - median) / abs(previous) if previous != 0 else 0.0
        if fall < self.plateau:
            self.scale = min(2.0 * self.scale, self.max_scale)
        elif fall >= RECOVERY * self.plateau:
            self.scale = max(0.5 * self.scale, self.initial)

    def host_state(self) -> dict[str, Any]:
        return {"curvature_scale": self.scale, "plateau_losses": list(self.losses),
                "plateau_previous": self.previous}

    def set_host_state(self, state: Mapping[str, Any]) -> None:
        """Restore host_state(); ValueError for values no run produces. A checkpoint without them
        (older ones) restarts the rule at the configured c."""
        scale = float(state.get("curvature_scale", self.initial))
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"host.curvature_scale must be a finite number > 0, got {scale}")
        losses = [float(x) for x in state.get("plateau_losses", [])]
        previous = state.get("plateau_previous")
        if not all(math.isfinite(x) for x in losses):
            raise ValueError(f"host.plateau_losses must be finite numbers, got {losses}")
        if previous is not None and not math.isfinite(float(previous)):
            raise ValueError(f"host.plateau_previous must be a finite number or null, got {previous}")
        self.scale, self.losses = scale, losses[len(losses) - self.window + 1:] if len(losses) >= self.window else losses
        self.previous = None if previous is None else float(previous)

    def restart(self) -> None:
        """Back to the configured c with an empty window (a resumed run that sets c anew)."""
        self.scale, self.losses, self.previous = self.initial, [], None
