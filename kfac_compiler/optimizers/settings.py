"""What every optimizer's settings share: knob parsing with kfac-jax / TF K-FAC aliases,
validation helpers with one-line errors, and the defaults a plan carries."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kfac_compiler.errors import ConfigError

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
    "num_burnin_steps": "burn_in_steps",
    "use_adaptive_learning_rate": "use_qmodel",
    "estimation_mode": "mode",
    "use_adaptive_damping": "adapt_damping",
}


@dataclass
class OptimizerConfig:
    """Settings of one optimizer: a dataclass of knobs. from_knobs parses keyword arguments
    (aliases allowed, unknown names refused), `resolve` fills defaults that depend on the
    plan or on other knobs, `validate` checks ranges (one-line ConfigError)."""

    name: ClassVar[str] = ""
    learning_rate: float | None = None
    l2_reg: float = 0.0

    @classmethod
    def from_knobs(cls, plan: "Plan | None" = None, **knobs: Any) -> "OptimizerConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in knobs.items():
            key2 = ALIASES.get(key, key)
            if key2 not in fields:
                raise ConfigError(
                    f"optimizer {cls.name!r} has no option {key!r} (options: {', '.join(sorted(fields))})"
                )
            if key2 in kwargs:
                raise ConfigError(f"optimizer option {key2!r} given twice (as {key!r} and an alias)")
            kwargs[key2] = value
        cfg = cls(**kwargs)
        cfg.resolve(plan)
        cfg.validate()
        return cfg

    def resolve(self, plan: "Plan | None") -> None:
        """Fill defaults that depend on the plan or on other knobs."""

    def validate(self) -> None:
        check_nonnegative("l2_reg", self.l2_reg)
        if self.learning_rate is not None:
            check_positive("learning_rate", self.learning_rate)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        raise ConfigError(f"optimizer option {name!r} must be in [0, 1), got {v!r}")


def check_int(name: str, v: Any, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"optimizer option {name!r} must be an integer >= {low}, got {v!r}")


def plan_schedule(plan: "Plan | None") -> dict[str, Any]:
    """Defaults the plan carries (compile config): damping, ema decay, periods, estimator."""
    if plan is None:
        return {}
    sched = plan.schedule
    return {"mode": plan.estimator.mode, "num_samples": plan.estimator.num_samples,
            "inverse_method": sched.inverse.method, "inv_update_period": sched.inverse.update_period,
            "cov_update_period": sched.stats.update_period, "damping": sched.damping, "ema_decay": sched.ema_decay}
