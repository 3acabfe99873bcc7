"""Optimizer configurations (knobs, defaults, validation) and the host-side schedules.

The numerical work happens in the emitted subgraphs (`kfac_step`, `sgd_step`, `adam_step`,
...); the host only keeps a few scalars: the damping and its Levenberg-Marquardt adaptation,
the moving-average weight of the factors, Adam's bias correction, the step counters.

Knob names follow TensorFlow K-FAC / kfac-jax. See docs/runtime.md for the rationale of every
default.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kfac_compiler.errors import ConfigError

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan
from kfac_compiler.contract import ESTIMATION_MODES

OPTIMIZERS = ("kfac", "sgd", "adam")

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
    name: ClassVar[str] = ""
    learning_rate: float | None = None
    l2_reg: float = 0.0

    @classmethod
    def from_knobs(cls, plan: Any = None, **knobs: Any) -> "OptimizerConfig":
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

    def resolve(self, plan: Any) -> None:
        """Fill defaults that depend on the plan or on other knobs."""

    def validate(self) -> None:
        _nonneg("l2_reg", self.l2_reg)
        if self.learning_rate is not None:
            _positive("learning_rate", self.learning_rate)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ConfigError(f"optimizer option {name!r} must be a finite number, got {v!r}")
    return float(v)


def _positive(name: str, v: Any) -> None:
    if _num(name, v) <= 0:
        raise ConfigError(f"optimizer option {name!r} must be > 0, got {v!r}")


def _nonneg(name: str, v: Any) -> None:
    if _num(name, v) < 0:
        raise ConfigError(f"optimizer option {name!r} must be >= 0, got {v!r}")


def _unit(name: str, v: Any, closed_low: bool = True) -> None:
    x = _num(name, v)
    if not ((0 <= x if closed_low else 0 < x) and x < 1):
        raise ConfigError(f"optimizer option {name!r} must be in [0, 1), got {v!r}")


def _int(name: str, v: Any, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"optimizer option {name!r} must be an integer >= {low}, got {v!r}")


@dataclass
class SgdConfig(OptimizerConfig):
    """SGD with heavy-ball momentum: v <- mu v - lr (g + l2 w); w <- w + v."""

    name: ClassVar[str] = "sgd"
    momentum: float | None = None

    def resolve(self, plan: Any) -> None:
        if self.learning_rate is None:
            self.learning_rate = 0.1
        if self.momentum is None:
            self.momentum = 0.9

    def validate(self) -> None:
        super().validate()
        _unit("momentum", self.momentum)


@dataclass
class AdamConfig(OptimizerConfig):
    """Adam (Kingma & Ba); the host passes the bias-corrected learning rate each step."""

    name: ClassVar[str] = "adam"
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    momentum: float | None = None  # accepted for a uniform API: an alias of beta1 when given

    def resolve(self, plan: Any) -> None:
        if self.learning_rate is None:
            self.learning_rate = 1e-3
        if self.momentum is not None:
            self.beta1 = float(self.momentum)
        self.momentum = self.beta1

    def validate(self) -> None:
        super().validate()
        _unit("beta1", self.beta1)
        _unit("beta2", self.beta2)
        _positive("epsilon", self.epsilon)

    def lr_at(self, t: int) -> float:
        """Bias-corrected learning rate for the t-th applied step (t >= 1)."""
        return self.learning_rate * math.sqrt(1.0 - self.beta2**t) / (1.0 - self.beta1**t)


@dataclass
class KfacConfig(OptimizerConfig):
    """K-FAC (Martens & Grosse 2015) with kfac-jax's adaptive step and damping.

    use_qmodel (default: True unless learning_rate/momentum are fixed): alpha and mu minimize
    the damped 2x2 quadratic model built from exact curvature (GGN) products in the
    `kfac_step` graph, on the batch's first qmodel_batch_size examples (the statistics'
    sub-batch; None: the whole batch). damping: initial value, adapted by Levenberg-Marquardt
    every damping_adaptation_interval steps (adapt_damping, default with the qmodel).
    max_predicted_decrease k (qmodel): where the model predicts a decrease larger than k times
    the objective's distance to the loss's lower bound (0 for every registered loss), the
    update is scaled by their ratio; None: off.
    """

    name: ClassVar[str] = "kfac"
    momentum: float | None = None
    use_qmodel: bool | None = None
    damping: float | None = None
    adapt_damping: bool | None = None
    damping_adaptation_interval: int = 5
    damping_adaptation_decay: float = 0.95
    min_damping: float = 3e-4
    max_damping: float = 1e8
    damping_rejection_factor: float = 10.0
    include_damping_in_quad_change: bool = False
    norm_constraint: float | None = None
    cov_ema_decay: float | None = None
    cov_update_period: int | None = None
    inv_update_period: int | None = None
    burn_in_steps: int = 0
    mode: str | None = None
    num_samples: int | None = None
    inverse_method: str | None = None
    stats_batch_size: int | None = 64
    qmodel_batch_size: int | None = 64
    max_momentum: float = 1.0
    max_predicted_decrease: float | None = 1.0
    reject_increase: bool = True

    DEFAULT_DAMPING: ClassVar[float] = 1e-3

    def resolve(self, plan: Any) -> None:
        fixed = self.learning_rate is not None or self.momentum is not None
        if self.use_qmodel is None:
            self.use_qmodel = not fixed
        elif self.use_qmodel and fixed:
            raise ConfigError(
                "K-FAC with use_qmodel=True chooses learning rate and momentum itself; "
                "drop learning_rate/momentum or pass use_qmodel=False"
            )
        if not self.use_qmodel:
            if self.learning_rate is None:
                raise ConfigError("K-FAC with use_qmodel=False needs a learning_rate (e.g. 0.01)")
            if self.momentum is None:
                self.momentum = 0.9
        elif self.norm_constraint is not None:
            raise ConfigError("norm_constraint (KL clipping) only applies with use_qmodel=False")
        if self.adapt_damping is None:
            self.adapt_damping = bool(self.use_qmodel)
        plan_cfg = _plan_schedule(plan)
        if self.damping is None:
            self.damping = plan_cfg.get("damping", self.DEFAULT_DAMPING)
        if self.cov_ema_decay is None:
            self.cov_ema_decay = plan_cfg.get("ema_decay", 0.9)
        if self.cov_update_period is None:
            self.cov_update_period = int(plan_cfg.get("cov_update_period", 1))
        if self.inv_update_period is None:
            self.inv_update_period = int(plan_cfg.get("inv_update_period", 10))
        if self.mode is None:
            self.mode = plan_cfg.get("mode", "gradients")
        if self.num_samples is None:
            self.num_samples = int(plan_cfg.get("num_samples", 1))
        if self.inverse_method is None:
            self.inverse_method = plan_cfg.get("inverse_method", "auto")

    def validate(self) -> None:
        super().validate()
        if self.momentum is not None:
            _unit("momentum", self.momentum)
        _positive("damping", self.damping)
        _positive("min_damping", self.min_damping)
        _positive("max_damping", self.max_damping)
        if self.min_damping > self.max_damping:
            raise ConfigError("min_damping must not exceed max_damping")
        if not self.min_damping <= self.damping <= self.max_damping:
            raise ConfigError(
                f"damping {self.damping:g} is outside [min_damping {self.min_damping:g}, max_damping {self.max_damping:g}]; "
                "set min_damping/max_damping too"
            )
        _int("damping_adaptation_interval", self.damping_adaptation_interval, 1)
        _unit("damping_adaptation_decay", self.damping_adaptation_decay, closed_low=False)
        _positive("damping_rejection_factor", self.damping_rejection_factor)
        if self.norm_constraint is not None:
            _positive("norm_constraint", self.norm_constraint)
        _unit("cov_ema_decay", self.cov_ema_decay)
        _int("cov_update_period", self.cov_update_period, 1)
        _int("inv_update_period", self.inv_update_period, 1)
        _int("burn_in_steps", self.burn_in_steps, 0)
        _int("num_samples", self.num_samples, 1)
        _positive("max_momentum", self.max_momentum)
        if self.max_predicted_decrease is not None:
            _positive("max_predicted_decrease", self.max_predicted_decrease)
        for name in ("stats_batch_size", "qmodel_batch_size"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 1)
        if self.mode not in ESTIMATION_MODES:
            raise ConfigError(f"unknown estimation mode {self.mode!r}; choose one of {', '.join(ESTIMATION_MODES)}")

    @property
    def omega(self) -> float:
        """Damping multiplier of one adaptation (kfac-jax: decay ** interval)."""
        return self.damping_adaptation_decay ** self.damping_adaptation_interval


def _plan_schedule(plan: "Plan | None") -> dict[str, Any]:
    """Defaults the plan carries (compile config): damping, ema decay, periods, estimator."""
    if plan is None:
        return {}
    sched = plan.schedule
    return {"mode": plan.estimator.mode, "num_samples": plan.estimator.num_samples,
            "inverse_method": sched.inverse.method, "inv_update_period": sched.inverse.update_period,
            "cov_update_period": sched.stats.update_period, "damping": sched.damping, "ema_decay": sched.ema_decay}


def make_config(optimizer: str, plan: Any = None, **knobs: Any) -> OptimizerConfig:
    classes = {"kfac": KfacConfig, "sgd": SgdConfig, "adam": AdamConfig}
    cls = classes.get(optimizer)
    if cls is None:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    return cls.from_knobs(plan, **knobs)


# --------------------------------------------------------------------------- host schedules
def ema_coefficient(weight: float, decay: float) -> tuple[float, float]:
    """Zero-debiased moving average: (c_t, w_t) with w_t = decay w_{t-1} + (1 - decay),
    c_t = (1 - decay) / w_t (so the first batch gets c = 1)."""
    w = decay * weight + (1.0 - decay)
    return (1.0 - decay) / w, w


def lm_adapt(damping: float, rho: float, cfg: KfacConfig) -> float:
    """Levenberg-Marquardt: rho > 3/4 -> damping * omega, rho < 1/4 (or NaN) -> damping / omega."""
    omega = cfg.omega
    if not math.isfinite(rho) or rho < 0.25:
        damping = damping / omega
    elif rho > 0.75:
        damping = damping * omega
    return min(max(damping, cfg.min_damping), cfg.max_damping)


def reduction_ratio(loss_old: float, loss_new: float, qmodel_change: float, update_norm: float,
                    damping: float, include_damping: bool) -> float:
    """rho = (loss_new - loss_old) / predicted change.

    The graph's metric/qmodel_change is the value of the DAMPED quadratic model at the chosen
    update. Like kfac-jax (include_damping_in_quad_change=False) we take out the damping's
    contribution 1/2 * damping * ||update||^2 by default, which is Martens & Grosse's rho.
    """
    change = qmodel_change
    if not include_damping:
        change = qmodel_change - 0.5 * damping * update_norm * update_norm
    if not (math.isfinite(change) and math.isfinite(loss_new) and math.isfinite(loss_old)):
        return float("nan")
    if change >= 0:
        # the model predicts no decrease: rho is meaningless; treat as "model untrustworthy"
        return float("nan") if loss_new > loss_old else 1.0
    return (loss_new - loss_old) / change


__all__ = [
    "AdamConfig", "KfacConfig", "OPTIMIZERS", "OptimizerConfig", "SgdConfig", "ema_coefficient",
    "lm_adapt", "make_config", "reduction_ratio",
]
