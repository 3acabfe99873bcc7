"""What every optimizer's settings share: knob parsing with kfac-jax / TF K-FAC aliases,
validation helpers with one-line errors, and the defaults a plan carries."""
from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kfac_compiler import parsing
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import schedules

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan

# Knob aliases accepted for convenience (kfac-jax / TF K-FAC spellings).
ALIASES = {
    "initial_damping": "damping",
    "weight_decay": "l2_reg",
    "covariance_ema_decay": "cov_ema_decay",
    "ema_decay": "cov_ema_decay",
    "curvature_ema": "cov_ema_decay",
    "inverse_update_period": "inv_update_period",
    "covariance_update_period": "cov_update_period",
    "curvature_update_period": "cov_update_period",
    "cov_update_every": "cov_update_period",  # TF K-FAC's PeriodicInvCovUpdateKfacOpt
    "invert_every": "inv_update_period",
    "num_estimator_samples": "num_samples",
    "num_burnin_steps": "burn_in_steps",
    "use_adaptive_learning_rate": "use_qmodel",
    "estimation_mode": "mode",
    "use_adaptive_damping": "adapt_damping",
    "learning_rate_schedule": "learning_rate",
    "momentum_schedule": "momentum",
    "damping_schedule": "damping",
}


@dataclass
class OptimizerConfig:
    """Settings of one optimizer: a dataclass of knobs. from_knobs parses keyword arguments
    (aliases allowed, unknown names refused), `resolve` fills defaults that depend on the
    plan or on other knobs, `validate` checks ranges (one-line ConfigError).

    The options in `schedulable` also take a schedule (a callable of the step or its text,
    optimizers/schedules.py); `at(name, step)` gives the value a step uses, checked by the
    option's range check. None by default: a plugin reading `config.learning_rate` as a
    number opts in (and reads `at()`) before it is handed a Schedule."""

    name: ClassVar[str] = ""
    schedulable: ClassVar[tuple[str, ...]] = ()
    learning_rate: float | None = None
    l2_reg: float = 0.0
    # gradient accumulation: one update per `accumulate` calls of Trainer.step, each on a
    # micro-batch (optimizers/accumulate.py); 1: every call updates
    accumulate: int = 1

    @classmethod
    def from_knobs(cls, plan: Plan | None = None, **knobs: Any) -> OptimizerConfig:
        kwargs: dict[str, Any] = {}
        for key, value in knobs.items():
            key2 = cls.option_name(key)
            if key2 in kwargs:
                raise ConfigError(f"optimizer option {key2!r} given twice (as {key!r} and an alias)")
            if key2 in cls.schedulable:
                value = schedules.as_value(value, f"optimizer option {key2!r}")
            elif cls.looks_scheduled(key2, value):
                what = f"options {', '.join(cls.schedulable)} do" if cls.schedulable else "no option does"
                raise ConfigError(f"optimizer {cls.name!r} takes no schedule for option {key2!r} ({what}); "
                                  "pass a number")
            kwargs[key2] = value if isinstance(value, schedules.Schedule) else cls.check_type(key2, value)
        cfg = cls(**kwargs)
        cfg.resolve(plan)
        cfg.validate()
        return cfg

    @classmethod
    def looks_scheduled(cls, name: str, value: Any) -> bool:
        """Whether `value` is a schedule given to option `name`: a Schedule, or a callable or
        non-numeric text where the option is declared a number (a plugin's str or untyped
        option keeps its text and callables)."""
        if isinstance(value, schedules.Schedule):
            return True
        kinds = cls.option_types(name)
        if not (float in kinds or int in kinds) or str in kinds:
            return False
        if isinstance(value, str):
            return not schedules.is_number(value) and (":" in value or "@" in value)
        return schedules.is_schedule_function(value)

    @classmethod
    def option_name(cls, key: str) -> str:
        """The field a knob name (or its kfac-jax / TF K-FAC alias) sets; ConfigError if none."""
        key2 = ALIASES.get(key, key)
        fields = {f.name for f in dataclasses.fields(cls)}
        if key2 not in fields:
            raise ConfigError(f"optimizer {cls.name!r} has no option {key!r} (options: {', '.join(sorted(fields))})")
        return key2

    @classmethod
    def option_types(cls, name: str) -> tuple[type, ...]:
        """The types field `name` is declared with (`float | None` -> (float, NoneType)); ()
        where the declaration is not a plain type or a union of them."""
        owner = next((k for k in cls.__mro__ if name in vars(k).get("__annotations__", {})), cls)
        try:  # resolved where the field is declared: a plugin's unresolvable annotation spoils only its own
            hint = typing.get_type_hints(owner).get(name)
        except (NameError, TypeError, AttributeError):  # a plugin's annotation we cannot resolve
            return ()
        if isinstance(hint, type):
            return (hint,)
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            args = typing.get_args(hint)
            return args if all(isinstance(a, type) for a in args) else ()
        return ()

    @classmethod
    def check_type(cls, name: str, value: Any) -> Any:
        """`value` for option `name` as its declared type, strictly: a bool option takes
        True/False or 0/1 (never a string's truthiness), a number a finite int or float (a
        float option), a str option a string; None only where the option allows it."""
        kinds = cls.option_types(name)
        if not kinds:
            return value  # a plugin's own type: its validate() checks it
        where = f"optimizer option {name!r}"
        if value is None:
            if type(None) in kinds:
                return None
            raise ConfigError(f"{where} cannot be None")
        if bool in kinds:
            return parsing.check_bool(value, where)
        if int in kinds and not isinstance(value, bool) and isinstance(value, numbers.Integral):
            return int(value)
        if float in kinds and not isinstance(value, (bool, str)) and isinstance(value, numbers.Real):
            if not math.isfinite(float(value)):
                raise ConfigError(f"{where} must be a finite number, got {value!r}")
            return float(value)
        if str in kinds and isinstance(value, str):
            return value
        expected = " or ".join({bool: "True/False", int: "an integer", float: "a number", str: "a string",
                                type(None): "None"}.get(k, k.__name__) for k in kinds)
        raise ConfigError(f"{where} must be {expected}, got {value!r}")

    @classmethod
    def parse_option(cls, key: str, text: str, where: str | None = None) -> tuple[str, Any]:
        """(field name, value) of a knob given as text (the command line's --knob KEY=VALUE),
        parsed by the option's declared type: 'no' is False for a bool option, 'none' is None
        where allowed, numbers must be finite. `where` names it in errors (default --knob KEY)."""
        name = cls.option_name(key)
        kinds = cls.option_types(name)
        where = where or f"--knob {key}"
        low = text.strip().lower()
        if type(None) in kinds and low in ("none", "null"):
            return name, None
        if name in cls.schedulable:
            return name, schedules.parse(text, where)
        if bool in kinds:
            return name, parsing.parse_bool(text, where)
        if int in kinds and float not in kinds and str not in kinds:
            return name, parsing.parse_int(text, where)
        if int in kinds:
            try:
                return name, int(text.strip())
            except ValueError:
                pass  # a float or a string then
        if float in kinds:
            return name, parsing.parse_float(text, where)
        if str in kinds or not kinds:
            return name, text.strip()
        raise ConfigError(f"{where}: cannot parse {text!r}")

    @classmethod
    def resumed_knobs(cls, stored: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """The knobs a resumed run is built with: a checkpoint's `stored` knobs (resolved, so
        derived ones included) with the `given` overrides (canonical names) over them. An
        optimizer whose resolve() derives knobs from others drops the stored derived ones an
        override changes the grounds of (K-FAC: momentum_type / use_qmodel)."""
        return {**stored, **given}

    def resolve(self, plan: Plan | None) -> None:
        """Fill defaults that depend on the plan or on other knobs."""

    def validate(self) -> None:
        check_nonnegative("l2_reg", self.l2_reg)
        check_int("accumulate", self.accumulate, 1)
        self.check_schedules()
        if self.scheduled("learning_rate"):
            self.initial("learning_rate")  # at() checks a callable's step-0 value
        elif self.learning_rate is not None:
            check_positive("learning_rate", self.learning_rate)

    def range_check(self, name: str) -> Callable[[str, Any], None]:
        """The check a schedule's values pass (at() applies it to every step's, check_schedules
        to the bounds of a text). learning_rate and damping may reach 0 on a schedule (a decay
        to 0 ends a run gracefully; K-FAC clamps damping to [min_damping, max_damping]); a
        constant learning rate or damping must still be > 0 (validate)."""
        return check_nonnegative if name in ("learning_rate", "damping") else check_unit

    def check_schedules(self) -> None:
        """A schedule's text is checked at construction: every value bounding what it can
        produce (Schedule.values) passes the option's range check, one line naming the text."""
        for name in self.schedulable:
            value = getattr(self, name, None)
            if not isinstance(value, schedules.Schedule):
                continue
            for v in value.values:
                try:
                    self.range_check(name)(name, v)
                except ConfigError as e:
                    raise ConfigError(f"{e} (a value of its schedule {value.text!r})") from None

    def scheduled(self, name: str) -> bool:
        return isinstance(getattr(self, name, None), schedules.Schedule)

    def initial(self, name: str) -> Any:
        """The option's value at step 0 (itself when it is not a schedule)."""
        return self.at(name, 0)

    def at(self, name: str, step: int) -> Any:
        """The value option `name` takes at `step`: a constant as is, a schedule's value checked
        (finite, in the option's range) with a one-line ConfigError naming the step."""
        value = getattr(self, name)
        if not isinstance(value, schedules.Schedule):
            return value
        v = schedules.value_at(value, step, f"optimizer option {name!r}")
        try:
            self.range_check(name)(name, v)
        except ConfigError as e:
            raise ConfigError(f"{e} (its schedule at step {step})") from None
        return v

    def to_dict(self) -> dict[str, Any]:
        """The knobs as JSON values (a schedule as its text; a callable cannot be stored:
        schedules.CALLABLE, passed again on resuming)."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, schedules.Schedule):
                out[k] = v.to_json()
        return out


@dataclass
class RecipeOptions:
    """The everyday recipe options an optimizer's settings take by inheriting this (SGD's,
    Adam's and K-FAC's; each optimizer's step graph implements them): `clip_norm` c, the
    gradient (before l2_reg's term) scaled to a global norm of at most c, as torch's
    clip_grad_norm_ (None: off); `decoupled_weight_decay` w, each step shrinks the weights by
    lr_eff w theta outside the gradient and the preconditioner (AdamW's, Loshchilov & Hutter;
    lr_eff is each optimizer's step size, docs/runtime.md; 0: off). A mixin rather than a
    field of every OptimizerConfig: a plugin that does not implement them has no such option."""

    clip_norm: float | None = None
    decoupled_weight_decay: float = 0.0

    def check_recipes(self) -> None:
        if self.clip_norm is not None:
            check_positive("clip_norm", self.clip_norm)
        check_nonnegative("decoupled_weight_decay", self.decoupled_weight_decay)

    def recipe_options(self) -> dict[str, bool]:
        """The step graph's options for clipping and decay (their nodes only where used)."""
        return {"clip": self.clip_norm is not None, "decay": self.decoupled_weight_decay > 0}


def check_number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ConfigError(f"optimizer option {name!r} must be a finite number, got {v!r}")
    return float(v)


def check_positive(name: str, v: Any) -> None:
    if check_number(name, v) <= 0:
        raise ConfigError(f"optimizer option {name!r} must be > 0, got {v!r}")


def check_nonnegative(name: str, v: Any) -> None:
    if check_number(name, v) < 0:
        raise ConfigError(f"optimizer option {name!r} must be >= 0, got {v!r}")


def check_unit(name: str, v: Any, closed_low: bool = True) -> None:
    x = check_number(name, v)
    if not ((0 <= x if closed_low else 0 < x) and x < 1):
        raise ConfigError(f"optimizer option {name!r} must be in {'[' if closed_low else '('}0, 1), got {v!r}")


def check_int(name: str, v: Any, low: int, high: int | None = None, why: str = "") -> None:
    """An integer option in [low, high] (`why`: the reason for the ceiling, said with it)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"optimizer option {name!r} must be an integer >= {low}, got {v!r}")
    if high is not None and v > high:
        raise ConfigError(f"optimizer option {name!r} must be at most {high}{f' ({why})' if why else ''}, got {v!r}")


def plan_schedule(plan: Plan | None) -> dict[str, Any]:
    """Defaults the plan carries (compile config): damping, ema decay, periods, estimator."""
    if plan is None:
        return {}
    sched = plan.schedule
    values = {"mode": plan.estimator.mode, "num_samples": plan.estimator.num_samples,
              "inverse_method": sched.inverse.method, "inv_update_period": sched.inverse.update_period,
              "cov_update_period": sched.stats.update_period, "damping": sched.damping, "ema_decay": sched.ema_decay}
    return {k: v for k, v in values.items() if v is not None}  # unset in the plan: the optimizer's default
