"""`fit`: the API's training loop with held-out evaluation.

The CLI's `train` has its own loop (metrics file, checkpoints, ranks, signals); an API user who
wants "train on these batches, evaluate on this held-out set every N steps, stop when I say"
gets it here instead of rewriting it, with the CLI's conventions: the held-out metrics are the
evaluation's under an `eval_` prefix, evaluated every `eval_every` steps (default: a 20th of
the run) and after the last step. The evaluation runs on its own non-spinning session channel
(`Trainer.evaluate`), so it does not slow the training step that follows it. With
`keep_best` the trainer ends with the model of the best evaluation (early stopping's
"restore the best weights"): a model that fits a small training set fast (K-FAC, or Adam at
a high learning rate) passes its best held-out loss and then overfits.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kfac_compiler.errors import ConfigError
from kfac_compiler.parsing import check_int
from kfac_compiler.runtime.best_model import BestModel
from kfac_compiler.runtime.data import batch_indices

if TYPE_CHECKING:
    from kfac_compiler.runtime.trainer import Trainer

EVAL_PREFIX = "eval_"
Batch = tuple[Mapping[str, Any], Any] | tuple[Mapping[str, Any], Any, Any]


@dataclass
class History:
    """What `fit` recorded: every step's metrics (with "step"), every evaluation's held-out
    metrics (with "step", the step after which it ran), and the step after which `patience`
    stopped the loop (None when it did not)."""

    steps: list[dict[str, float]] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)
    stopped_early: int | None = None

    @property
    def losses(self) -> list[float]:
        """The training batches' losses, step by step."""
        return [m["loss"] for m in self.steps]

    def best(self) -> dict[str, float] | None:
        """The evaluation with the lowest held-out loss (None without evaluations)."""
        return min(self.evaluations, key=lambda m: m[EVAL_PREFIX + "loss"], default=None)


def fit(trainer: Trainer, batches: Iterable[Batch], steps: int | None = None,
        validation: Batch | None = None, eval_every: int | None = None,
        eval_batch_size: int = 1024,
        callback: Callable[[int, dict[str, float]], bool | None] | None = None,
        keep_best: bool = False, patience: int | None = None) -> History:
    """Step `trainer` on `batches` ((inputs, targets) or (inputs, targets, weights) each) until
    they run out or `steps` steps were taken; evaluate `validation` ((inputs, targets), or
    (inputs, targets, weights): Trainer.evaluate's) after every step whose number (from 0, the
    trainer's count) + 1 is a multiple of `eval_every` (default: a 20th of the trainer's steps
    so far plus `steps`), and after the last. `callback(step, metrics)` sees each step's
    metrics (the held-out ones merged in under `eval_` where an evaluation ran) and stops the
    loop by returning False. Steps are numbered from the trainer's `step_count`, so a resumed trainer
    continues its numbering. With the knob `accumulate=k` each batch is one step's, run as k
    equal micro-batches (the CLI's --accumulate). `keep_best`: after the loop the trainer
    holds the parameters (and BatchNorm running statistics) of the evaluation with the lowest
    held-out loss, History.best() (or an earlier one: trainer.best_model from a restored
    checkpoint or an earlier fit, which it continues), instead of the last step's; its
    optimizer state and step count stay the last step's. `patience` N: early stopping, the
    loop ends after the N-th evaluation in a row that did not lower the lowest held-out loss
    (History.stopped_early says after which step); with keep_best the trainer then holds the
    best evaluation's model. In a data-parallel run the held-out loss compared is the mean
    over the ranks, so every rank keeps the same model and stops at the same step."""
    if steps is not None:
        check_int(steps, "fit: steps", low=0)
    if eval_every is not None:
        check_int(eval_every, "fit: eval_every", low=1)
    if eval_every is not None and validation is None:
        raise ConfigError("fit: eval_every needs validation=(inputs, targets) to evaluate on")
    if keep_best and validation is None:
        raise ConfigError("fit: keep_best needs validation=(inputs, targets): the best model is the one with the "
                          "lowest held-out loss")
    if patience is not None:
        check_int(patience, "fit: patience", low=1)
        if validation is None:
            raise ConfigError("fit: patience needs validation=(inputs, targets): it stops when the held-out loss "
                              "stops falling")
    if validation is not None and (not isinstance(validation, tuple) or len(validation) not in (2, 3)):
        raise ConfigError("fit: validation must be a tuple (inputs, targets) or (inputs, targets, weights)")
    # the default: a 20th of the run's length, counted from its start (a resumed fit given the
    # steps left keeps the uninterrupted run's interval)
    every = eval_every or (max(1, (trainer.step_count + steps) // 20) if steps else None)
    history = History()
    best = None
    if keep_best:  # a restored checkpoint's (or an earlier fit's) best model is the one to beat
        best = trainer.best_model = trainer.best_model or BestModel()
    stopper = None if patience is None else EarlyStop(patience, best.loss if best is not None else float("inf"))
    for taken, batch in enumerate(batches):
        if steps is not None and taken >= steps:
            break
        if not isinstance(batch, tuple) or len(batch) not in (2, 3):
            raise ConfigError(f"fit: batch {taken} must be a tuple (inputs, targets) or (inputs, targets, weights)")
        step = trainer.step_count
        metrics = _step(trainer, batch, taken)
        metrics["step"] = float(step)
        last = steps is not None and taken + 1 == steps
        stop = False
        # on the trainer's own count: a resumed fit evaluates at the steps the uninterrupted one does
        if validation is not None and (last or (every is not None and (step + 1) % every == 0)):
            held, compared = _evaluate(trainer, validation, eval_batch_size, step, history, best, stopper)
            metrics.update(held)
            stop = stopper is not None and stopper.stop(compared)
        history.steps.append(metrics)
        if callback is not None and callback(step, metrics) is False:
            break
        if stop:
            history.stopped_early = step
            break
    if validation is not None and history.steps and EVAL_PREFIX + "loss" not in history.steps[-1]:
        # the batches ran out, or the callback stopped: evaluate the final parameters
        history.steps[-1].update(_evaluate(trainer, validation, eval_batch_size, int(history.steps[-1]["step"]), history,
                                           best, None)[0])
    if best is not None:
        best.restore(trainer)
    return history


@dataclass
class EarlyStop:
    """Early stopping on the held-out loss (fit's `patience`, train's --patience): stop once
    `patience` evaluations in a row did not lower the lowest loss seen, `best` (a NaN loss
    lowers nothing). A resumed run starts from its kept model's loss, when it has one."""

    patience: int
    best: float = float("inf")
    waited: int = 0

    def stop(self, loss: float) -> bool:
        """Whether to stop after an evaluation of held-out loss `loss`."""
        if loss < self.best:
            self.best, self.waited = loss, 0
        else:
            self.waited += 1
        return self.waited >= self.patience

    def line(self, step: int) -> str:
        """What the CLI says when it stopped after step `step`."""
        return (f"stopped early after step {step}: the held-out loss did not fall below {self.best:.6g} in "
                f"{self.patience} evaluation{'s' if self.patience > 1 else ''}")


def _step(trainer: Trainer, batch: Batch, taken: int) -> dict[str, float]:
    """One optimizer step on `batch`: with accumulate=k its rows as k equal micro-batches, one
    Trainer.step each; the last call's metrics are the update's."""
    k = trainer.config.accumulate
    if k == 1:
        return dict(trainer.step(*batch))
    targets = batch[1]
    n = len(np.asarray(next(iter(targets.values())) if isinstance(targets, Mapping) else targets))
    if n % k:
        raise ConfigError(f"fit: batch {taken} has {n} rows, which do not split into accumulate={k} equal "
                          "micro-batches; give batches of a multiple of it")
    for part in np.split(np.arange(n), k):
        metrics = trainer.step(*(_rows(v, part) for v in batch))
    return dict(metrics)


def _rows(value: Any, part: np.ndarray) -> Any:
    """Rows `part` of an array, of each array of a dict (inputs, several heads' targets), or None."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {k: np.asarray(v)[part] for k, v in value.items()}
    return np.asarray(value)[part]


def batches(inputs: Mapping[str, Any], targets: Any, batch_size: int, seed: int = 0,
            start: int = 0, weights: Any = None) -> Iterator[Batch]:
    """Endless (inputs, targets) batches: the CLI's, epochs of a seeded permutation with the last
    partial batch dropped; batch s is a pure function of (s, seed), so a resumed run passes
    `start=trainer.step_count` and sees the batches an uninterrupted one would. With `weights`
    (loss weights or a mask, one row per example: Trainer.step's) (inputs, targets, weights)."""
    check_int(batch_size, "batches: batch_size", low=1)
    y = np.asarray(targets)
    n = y.shape[0]
    arrays = {k: np.asarray(v) for k, v in inputs.items()}
    w = None if weights is None else np.asarray(weights)
    s = check_int(start, "batches: start", low=0)
    while True:
        idx = batch_indices(n, batch_size, s, seed)
        yield ({k: v[idx] for k, v in arrays.items()}, y[idx]) if w is None else \
            ({k: v[idx] for k, v in arrays.items()}, y[idx], w[idx])
        s += 1


def _evaluate(trainer: Trainer, validation: Batch, batch_size: int, step: int, history: History,
              best: BestModel | None, stopper: EarlyStop | None) -> tuple[dict[str, float], float]:
    """(the held-out metrics, the loss that keep_best and patience compare: its mean over the
    ranks, so that every rank chooses alike; NaN when neither asks)."""
    inputs, targets, *weights = validation
    held = {EVAL_PREFIX + k: v for k, v in trainer.evaluate(inputs, targets, batch_size=batch_size,
                                                            weights=weights[0] if weights else None).items()}
    history.evaluations.append({"step": float(step), **held})
    compared = float("nan")
    if best is not None or stopper is not None:  # one collective, one choice on every rank
        compared = trainer.mean_over_ranks(held[EVAL_PREFIX + "loss"])
    if best is not None:
        best.offer(trainer, step, compared, held)
    return held, compared
