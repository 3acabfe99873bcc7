"""The model of the best held-out evaluation (early stopping's "restore the best weights"):
`fit(keep_best=True)` and `kfac-compiler train --keep-best` keep it, checkpoints carry it.

A model that fits a small training set fast (K-FAC, or Adam at a high learning rate) passes
its best held-out loss and then overfits; the user wants that best model, and a run that is
interrupted and resumed must not lose it (the checkpoint holds it beside the last state).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kfac_compiler.runtime.trainer import Trainer


class BestModel:
    """The trained values at the lowest held-out loss offered so far, and that evaluation's
    step and metrics."""

    def __init__(self, step: int | None = None, loss: float = float("inf"),
                 metrics: Mapping[str, float] | None = None,
                 values: dict[str, np.ndarray] | None = None) -> None:
        self.step = step
        self.loss = loss
        self.metrics = dict(metrics or {})
        self.values = values

    def offer(self, trainer: Trainer, step: int, loss: float, metrics: Mapping[str, float]) -> None:
        """The evaluation of the trainer's current model: kept if its loss is the lowest yet
        (NaN never is)."""
        if loss < self.loss:
            self.step, self.loss, self.metrics = step, loss, dict(metrics)
            self.values = trainer.trained_values()

    def restore(self, trainer: Trainer) -> None:
        """Put the kept model into the trainer (its optimizer state stays)."""
        if self.values is not None:
            trainer.set_trained_values(self.values)

    def export(self, trainer: Trainer, path: str, graph: str = "auto") -> None:
        """Write the kept model with Trainer.export, leaving the trainer's own as it was
        (steps may have followed the kept evaluation: an interrupted run)."""
        last = None if self.values is None else trainer.trained_values()
        self.restore(trainer)
        try:
            trainer.export(path, graph=graph)
        finally:
            if last is not None:
                trainer.set_trained_values(last)
