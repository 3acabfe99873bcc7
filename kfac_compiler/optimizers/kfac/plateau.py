"""The plateau rule for the quadratic model's curvature scale c (KfacConfig.adapt_curvature_scale).

The quadratic model picks the step that is best for the batch. Where the loss can go to ~0
(the data is fitted) that greedy step is right; at a minibatch-noise floor (token LMs and
transformers at small batches) it fits each batch's noise, and a step ~1/c as long, which
averages the noise over steps, makes progress where the greedy one stalls
(benchmarks/results/2026-11-29-transformer-step-scale.md). The floor shows itself as a
batch loss that stops falling, so, as ReduceLROnPlateau does for a learning rate: every
`window` applied steps the median batch loss of the window is compared with the best
(lowest) window median so far; when it is not below the best by `plateau` (relative) c
doubles, up to `max_scale`; when it is below the best by RECOVERY times that or more, the
floor has moved and c halves again, down to the configured starting value. The median, not
the mean: a spike the guard lets through moves a mean by orders of magnitude, a median not
at all. The best, not the previous window: window medians scatter by ~5% at a noise floor
(the GPT byte-LM), and a window that only recovers from a worse one is no progress.

`early_window`: windows of `window` steps cannot decide in a run's first 2 * `window` steps,
so a 30-step run never saw the rule. The windows that start there are `early_window` steps
long instead, and judge the fall since the first window at the long windows' rate: c doubles
when the median has fallen less than `plateau` * (steps since the first window) / `window`
below the first window's median. Against the best so far, as later windows are judged, 5-step
medians of a noisy falling loss (zoo depthwise_cnn, digits autoencoder) rise above the best by
chance and doubled c there, costing up to 30 steps; the fall since the first window does not
(benchmarks/results/2026-11-29-plateau-short-runs.md).
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

    def __init__(self, initial: float, window: int, plateau: float, max_scale: float, adapt: bool,
                 early_window: int | None = None) -> None:
        self.initial, self.window, self.plateau, self.max_scale, self.adapt = (
            float(initial), int(window), float(plateau), float(max_scale), bool(adapt))
        self.early_window = self.window if early_window is None else min(int(early_window), self.window)
        self.scale = float(initial)
        self.losses: list[float] = []  # the current window's batch losses
        self.best: float | None = None  # the lowest window median so far
        self.count = 0  # batch losses counted so far (which windows are early)
        self.first: float | None = None  # the first window's median: the early windows' reference

    def in_early_window(self) -> bool:
        """Whether the window in progress started in the first 2 * window counted steps."""
        return self.count - len(self.losses) < 2 * self.window

    def current_window(self) -> int:
        """The length of the window in progress."""
        return self.early_window if self.in_early_window() else self.window

    def observe(self, loss: float) -> None:
        """Count an applied step's batch loss; at the end of a window, adapt c."""
        if not self.adapt or not math.isfinite(loss):
            return
        self.losses.append(float(loss))
        self.count += 1
        if len(self.losses) < self.current_window():
            return
        early = self.in_early_window()
        median = statistics.median(self.losses)
        self.losses = []
        best = self.best
        self.best = median if best is None else min(best, median)
        if best is None:
            self.first = median
            return
        fall = (best - median) / abs(best) if best != 0 else 0.0
        if early and self.first is not None:  # the fall since the first window, at plateau per window
            since = (self.first - median) / abs(self.first) if self.first != 0 else 0.0
            slow = since < self.plateau * (self.count - self.early_window) / self.window
        else:
            slow = fall < self.plateau
        if slow:
            self.scale = min(2.0 * self.scale, self.max_scale)
        elif fall >= RECOVERY * self.plateau:
            self.scale = max(0.5 * self.scale, self.initial)

    def host_state(self) -> dict[str, Any]:
        # the best as a list of at most one number: a checkpoint's host entries keep one type
        return {"curvature_scale": self.scale, "plateau_losses": list(self.losses),
                "plateau_best": [] if self.best is None else [self.best], "plateau_count": self.count,
                "plateau_first": [] if self.first is None else [self.first]}

    def set_host_state(self, state: Mapping[str, Any]) -> None:
        """Restore host_state(); ValueError for values no run produces. A checkpoint without them
        (older ones) restarts the rule at the configured c; c is kept within [the configured c,
        max_scale] (a resume may lower the cap), and without adaptation it is the configured c.
        Without plateau_count (a checkpoint from before early windows) the early windows are
        over: the run goes on as the rule that wrote it would."""
        scale = float(state.get("curvature_scale", self.initial))
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"host.curvature_scale must be a finite number > 0, got {scale}")
        losses = [float(x) for x in state.get("plateau_losses", [])]
        best = [float(x) for x in state.get("plateau_best", [])]
        first = [float(x) for x in state.get("plateau_first", [])]
        if not all(math.isfinite(x) for x in losses):
            raise ValueError(f"host.plateau_losses must be finite numbers, got {losses}")
        for name, value in (("plateau_best", best), ("plateau_first", first)):
            if len(value) > 1 or not all(math.isfinite(x) for x in value):
                raise ValueError(f"host.{name} must be [] or [a finite number], got {value}")
        count = int(state.get("plateau_count", 2 * self.window + len(losses)))
        if count < len(losses):
            raise ValueError(f"host.plateau_count must be >= the window's {len(losses)} losses, got {count}")
        self.scale = min(max(scale, self.initial), self.max_scale) if self.adapt else self.initial
        self.losses, self.count = losses, count
        keep = self.current_window() - 1  # a shorter window than the checkpoint's: its last steps
        self.losses = losses[len(losses) - keep:] if len(losses) > keep else losses
        self.best = best[0] if best else None
        self.first = first[0] if first else None

    def restart(self) -> None:
        """Back to the configured c with an empty window (a resumed run that sets c anew)."""
        self.scale, self.losses, self.best, self.count, self.first = self.initial, [], None, 0, None
