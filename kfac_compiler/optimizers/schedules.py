"""Hyper-parameter schedules: a value as a function of the optimizer's step count (kfac-jax's
`learning_rate_schedule`, `momentum_schedule`, `damping_schedule`).

The API takes a number (a constant), a callable `f(step) -> float`, or the text below; the
command line takes the text. One grammar, parsed here for both:

    0.1                       constant
    0.1@0,0.01@1000           piecewise constant: 0.1 from step 0, 0.01 from step 1000 on
    exp:0.1,0.5,1000          0.1 * 0.5 ** (step / 1000)         (TF's exponential_decay)
    linear:0.1,0.001,5000     0.1 -> 0.001 linearly over 5000 steps, then 0.001
    cosine:0.1,0.001,5000     0.001 + (0.1 - 0.001) (1 + cos(pi min(step, 5000) / 5000)) / 2
    warmup:100:cosine:...     any of the above times (step + 1) / 100 for step < 100

A schedule is a function of the step count alone, so a resumed run continues it: the text is
stored with the checkpoint's knobs; a callable is not storable and is passed again.

Text is checked when parsed: a Schedule from text carries `values`, the values that bound
everything it can produce (V0 and V1, each piecewise value; exp's values keep V0's sign since
its RATE must be > 0), so the option's range check refuses a bad schedule at construction
rather than at the step where it goes out of range.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from kfac_compiler.errors import ConfigError

CALLABLE = "<callable>"  # what a checkpoint stores for a callable schedule (passed again on resuming)
GRAMMAR = "a number, V@STEP,V@STEP,..., exp:V0,RATE,STEPS, linear:V0,V1,STEPS or cosine:V0,V1,STEPS, optionally " \
          "prefixed by warmup:STEPS:"


class Schedule:
    """A value per step: `fn(step)`; `text` is its command-line spelling (None for a callable);
    `values`: the values bounding what the text can produce (empty for a callable), which the
    option's range check sees at construction."""

    def __init__(self, fn: Callable[[int], Any], text: str | None = None, values: tuple[float, ...] = ()) -> None:
        self.fn, self.text, self.values = fn, text, values

    def __call__(self, step: int) -> Any:
        return self.fn(step)

    def __repr__(self) -> str:
        return f"Schedule({self.text or getattr(self.fn, '__name__', 'callable')!r})"

    def to_json(self) -> str:
        return self.text if self.text is not None else CALLABLE


def _at(where: str) -> str:
    """The message's prefix naming the option (none where the caller names it, argparse)."""
    return f"{where}: " if where else ""


def _numbers(args: str, count: int, kind: str, where: str) -> list[float]:
    parts = args.split(",")
    where = _at(where) + (f"{kind}: " if kind else "")  # kind "": a constant
    if len(parts) != count:
        raise ConfigError(where + f"expects {count} comma-separated numbers, got {args!r}")
    out = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise ConfigError(where + f"{p.strip()!r} is not a number") from None
        if not math.isfinite(v):
            raise ConfigError(where + f"{p.strip()!r} is not a finite number")
        out.append(v)
    return out


def _steps(v: float, kind: str, where: str, low: int = 1) -> int:
    if v != int(v) or v < low:
        raise ConfigError(_at(where) + f"{kind}: the step count must be an integer >= {low}, got {v:g}")
    return int(v)


Body = tuple[Callable[[int], float], tuple[float, ...]]  # a schedule's function and its bounding values


def _piecewise(text: str, where: str) -> Body:
    points = []
    for item in text.split(","):
        value, sep, step = item.partition("@")
        if not sep:
            raise ConfigError(_at(where) + f"{item.strip()!r} is not VALUE@STEP (schedules: {GRAMMAR})")
        v, s = _numbers(f"{value},{step}", 2, "VALUE@STEP", where)
        points.append((_steps(s, "VALUE@STEP", where, low=0), v))
    starts = [s for s, _ in points]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ConfigError(_at(where) + f"the steps of {text!r} must start at @0 and increase")

    def piecewise(step: int) -> float:
        return next(v for s, v in reversed(points) if step >= s)

    return piecewise, tuple(v for _, v in points)


def _body(text: str, where: str) -> Body:
    kind, sep, args = text.partition(":")
    kind = kind.strip().lower()
    if not sep:
        if "@" in text:
            return _piecewise(text, where)
        (v,) = _numbers(text, 1, "", where) if is_number(text) else _bad(text, where)
        return (lambda step: v), (v,)
    if kind == "exp":
        v0, rate, n = _numbers(args, 3, kind, where)
        n = _steps(n, kind, where)
        if rate <= 0:  # a negative rate's fractional powers are complex, 0 jumps to 0 after step 0
            raise ConfigError(_at(where) + f"exp: the rate must be > 0, got {rate:g}")
        return (lambda step: v0 * rate ** (step / n)), (v0,)
    if kind == "linear":
        v0, v1, n = _numbers(args, 3, kind, where)
        n = _steps(n, kind, where)
        return (lambda step: v0 + (v1 - v0) * min(step, n) / n), (v0, v1)
    if kind == "cosine":
        v0, v1, n = _numbers(args, 3, kind, where)
        n = _steps(n, kind, where)
        return (lambda step: v1 + (v0 - v1) * (1.0 + math.cos(math.pi * min(step, n) / n)) / 2.0), (v0, v1)
    return _bad(text, where)


def is_number(text: str) -> bool:
    """Whether `text` spells a number (a constant, not a schedule)."""
    try:
        float(text)
        return True
    except ValueError:
        return False


def _bad(text: str, where: str):
    raise ConfigError(_at(where) + f"{text!r} is not a number or a schedule; use {GRAMMAR}")


def parse(text: str, where: str) -> float | Schedule:
    """A constant (float) or a Schedule from its text; a one-line ConfigError naming `where`."""
    text = text.strip()
    if is_number(text):
        (v,) = _numbers(text, 1, "", where)
        return v
    if text == CALLABLE:
        raise ConfigError(f"{where} was a Python callable, which a checkpoint cannot store; pass it again")
    body, warm = text, None
    if text.lower().startswith("warmup:"):
        n, sep, body = text[len("warmup:"):].partition(":")
        if not sep:
            raise ConfigError(_at(where) + f"warmup:STEPS: must be followed by a schedule, got {text!r}")
        (warm,) = _numbers(n, 1, "warmup", where)
        warm = _steps(warm, "warmup", where)
    fn, values = _body(body, where)
    if warm is not None:  # a factor in (0, 1]: the values stay between 0 and the schedule's
        inner, w = fn, warm
        fn = lambda step: inner(step) * min(1.0, (step + 1) / w)  # noqa: E731
    return Schedule(fn, text, values)


def as_value(value: Any, where: str) -> Any:
    """An API value of a schedulable option: a schedule's text is parsed, a callable becomes a
    Schedule; anything else (a number, or a number as a string, which the API refuses like for
    every knob) is returned for the option's own type check."""
    if isinstance(value, Schedule):
        return value
    if isinstance(value, str) and not is_number(value):
        return parse(value, where)
    if is_schedule_function(value):
        return Schedule(value)
    return value


def is_schedule_function(value: Any) -> bool:
    """Whether `value` is a user's function of the step (a callable that is neither a number
    nor a type)."""
    return callable(value) and not isinstance(value, (numbers.Number, type))


def value_at(value: Any, step: int, where: str) -> float:
    """The option's value at `step`: a constant as is, a schedule evaluated and checked to be a
    finite number (a one-line ConfigError naming the step otherwise)."""
    if not isinstance(value, Schedule):
        return value
    try:
        v = value(step)
    except Exception as e:  # a user's callable: its failure named in one line
        raise ConfigError(f"{where} schedule failed at step {step}: {type(e).__name__}: {e}") from None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise ConfigError(f"{where} schedule gives {v!r} at step {step}; it must give finite numbers")
    return float(v)
