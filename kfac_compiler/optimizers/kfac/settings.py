"""K-FAC's settings (knobs, defaults, validation) and its host-side schedules: the
zero-debiased moving-average coefficient, Levenberg-Marquardt damping, the reduction ratio."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kfac_compiler.contract import estimation_mode
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import groups
from kfac_compiler.optimizers.kfac.refresh import check_groups
from kfac_compiler.optimizers.settings import (
    OptimizerConfig,
    RecipeOptions,
    check_int,
    check_number,
    check_positive,
    check_unit,
    plan_schedule,
)
from kfac_compiler.requests import MAX_NUM_SAMPLES, NUM_SAMPLES_WHY

if TYPE_CHECKING:
    from kfac_compiler.plan import Plan


MOMENTUM_TYPES = ("regular", "adam", "qmodel", "qmodel_fixedmu")  # TF K-FAC's momentum_type
QMODEL_TYPES = ("qmodel", "qmodel_fixedmu")  # the quadratic model chooses the learning rate


@dataclass
class KfacConfig(OptimizerConfig, RecipeOptions):
    """K-FAC (Martens & Grosse 2015) with kfac-jax's adaptive step and damping.

    momentum_type (TF K-FAC's; default "qmodel" unless learning_rate/momentum are given, then
    "regular"): "qmodel": alpha and mu minimize the damped 2x2 quadratic model built from exact
    curvature (GGN) products in the `kfac_step` graph, on the whole batch (qmodel_batch_size
    None, the default: near convergence a 64-example sub-batch can miss the few examples that
    carry the curvature along P and overshoot 20x, docs/runtime.md) or its first
    qmodel_batch_size examples (the statistics' sub-batch when equal); "qmodel_fixedmu": mu is the
    momentum knob, alpha the model's minimizer for it; "regular": update = -lr P + mu v (v the
    last update); "adam": m <- mu m + g, update = -lr (F + damping)^-1 m. use_qmodel (kfac-jax)
    is True for the two qmodel types. learning_rate, momentum and damping take schedules
    (optimizers/schedules.py; a damping schedule needs adapt_damping off). damping: initial
    value, adapted by Levenberg-Marquardt every damping_adaptation_interval steps
    (adapt_damping, default with the qmodel).
    qmodel_curvature_scale c (qmodel): the model's curvature times c, so that alpha and mu are
    ~1/c of the batch's greedy step; adapt_curvature_scale (default with the qmodel): c is the
    starting value of the plateau rule (plateau.py), which doubles c, up to
    max_curvature_scale (None: max(4, c)), when the median batch loss of
    curvature_scale_window applied steps is not below the best window median so far by
    curvature_scale_plateau (relative), and halves it again, down to the starting value, when
    it is below it by 5 times that or more (with gradient accumulation, the cycle's mean loss).
    curvature_scale_early_window: the windows that start in the rule's first
    2 * curvature_scale_window applied steps are this long (default 5; None: the window) and
    judge the fall since the first window, so that a 30-step run's plateau is seen.
    max_predicted_decrease k (qmodel): where the model predicts a decrease larger than k times
    the objective's distance to the loss's lower bound (0 for every registered loss), the
    update is scaled by their ratio; None: off.
    loss_spike_factor f (the spike guard): a step that follows an update applied without the
    loss after it (not an adaptation step) is withheld when its batch loss exceeds f times the
    largest batch loss of the last loss_spike_window applied steps; the host then evaluates
    that batch without the last update, and undoes the update (damping times
    damping_rejection_factor) when the batch's loss is within the limit without it and the
    update raised it by more than the update's predicted change (rho < -1, reject_increase's
    test, on a fresh batch); else the step runs again without the limit. None: off.
    inverse_groups: "auto" or k >= 1 groups of
    blocks whose inverses are refreshed after different steps of the period (refresh.py).
    param_groups: layers trained by a first-order rule (Adam, SGD) in K-FAC's step, held out of
    its curvature (optimizers/groups.py; normalized to JSON here, resolved against the plan by
    the policy).
    clip_norm c (RecipeOptions): the gradient is scaled to a global norm of at most c before it
    is preconditioned, and the quadratic model chooses alpha and mu with that gradient (with the
    raw one it would scale alpha by 1/s and undo the clipping); its predicted change, which rho,
    the decrease cap and the rejection test compare with the loss, uses the raw gradient.
    decoupled_weight_decay w: theta <- (1 - alpha w) theta + update, alpha the step's learning
    rate (the quadratic model's, or lr after KL clipping; docs/runtime.md says why).
    multi_tensor: the step's per-parameter chains (the gradient's clipping and l2 term, the dot
    products, the update, the new parameters, the velocity) emitted once over every K-FAC
    parameter's concatenation, the velocity one flat slot (as SGD's and Adam's knob); None: the
    device's default (kfac_compiler.requests.MULTI_TENSOR_DEFAULT: off on both).
    static_steps: the host picks one If-free step graph per step kind the schedule runs
    (statistics or not, loss_after or not), each made on first use for the batch's shapes
    (runtime/static_shapes.py: no shape arithmetic at step time), instead of one graph with
    Ifs on hp/update_stats and hp/loss_after; the trajectory is the same bit for bit, at the
    cost of up to four step sessions (docs/runtime.md, "Static step graphs").
    """

    name: ClassVar[str] = "kfac"
    schedulable: ClassVar[tuple[str, ...]] = ("learning_rate", "momentum", "damping")
    momentum: float | None = None
    momentum_type: str | None = None
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
    inverse_groups: int | str = "auto"  # refresh the blocks in groups, one per step (refresh.py)
    stats_batch_size: int | None = 64
    qmodel_batch_size: int | None = None
    max_momentum: float = 1.0
    qmodel_curvature_scale: float = 1.0  # the quadratic model's C times c: ~1/c of the greedy step (docs/runtime.md)
    adapt_curvature_scale: bool | None = None  # the plateau rule for c (plateau.py); None: on with the qmodel
    curvature_scale_window: int = 20  # applied steps per window of the plateau rule
    curvature_scale_early_window: int | None = 5  # windows starting in the first 2 windows' steps; None: the window
    curvature_scale_plateau: float = 0.02  # a window median less than this below the best doubles c
    max_curvature_scale: float | None = None  # None: max(4, qmodel_curvature_scale)
    max_predicted_decrease: float | None = 1.0
    reject_increase: bool = True
    loss_spike_factor: float | None = 3.0  # 10 until benchmarks/results/2026-11-29-damping-ablation.md
    loss_spike_window: int = 10
    precon_power: float = -1.0  # kfac-jax's name: the step preconditions with (F + damping)^precon_power
    param_groups: list[Any] | None = None  # first-order groups: [{"kind"/"params"/"layers": ..., "optimizer": "adam", ...}]
    multi_tensor: bool | None = None  # the step over the parameters' concatenation (None: the device's default)
    static_steps: bool = False  # If-free step kinds with static shapes, chosen by the host

    DEFAULT_DAMPING: ClassVar[float] = 1e-3

    def resolve(self, plan: Plan | None) -> None:
        self.momentum_type = kind = self._momentum_type()
        self.use_qmodel = kind in QMODEL_TYPES
        if kind == "qmodel" and (self.learning_rate is not None or self.momentum is not None):
            raise ConfigError(
                "K-FAC with use_qmodel=True chooses learning rate and momentum itself; "
                "drop learning_rate/momentum or pass use_qmodel=False"
            )
        if kind == "qmodel_fixedmu" and self.learning_rate is not None:
            raise ConfigError("K-FAC with momentum_type='qmodel_fixedmu' chooses the learning rate itself; "
                              "drop learning_rate or use momentum_type='regular' or 'adam'")
        if not self.use_qmodel and self.learning_rate is None:
            raise ConfigError(f"K-FAC with momentum_type={kind!r} (use_qmodel=False) needs a learning_rate (e.g. 0.01)")
        if kind != "qmodel" and self.momentum is None:
            self.momentum = 0.9
        if self.use_qmodel and self.norm_constraint is not None:
            raise ConfigError("norm_constraint (KL clipping) only applies with momentum_type 'regular' or 'adam' "
                              "(use_qmodel=False)")
        if self.scheduled("damping"):
            if self.adapt_damping:
                raise ConfigError("a damping schedule sets the damping of every step: it needs adapt_damping=False "
                                  "(Levenberg-Marquardt adaptation off)")
            self.adapt_damping = False
        if self.adapt_damping is None:
            self.adapt_damping = bool(self.use_qmodel)
        if self.adapt_curvature_scale and not self.use_qmodel:
            raise ConfigError("adapt_curvature_scale adapts the quadratic model's curvature: it needs the qmodel "
                              "(momentum_type 'qmodel' or 'qmodel_fixedmu'); drop it")
        if self.adapt_curvature_scale is None:
            self.adapt_curvature_scale = bool(self.use_qmodel)
        if self.max_curvature_scale is None:
            self.max_curvature_scale = max(4.0, check_number("qmodel_curvature_scale", self.qmodel_curvature_scale))
        plan_cfg = plan_schedule(plan)
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

    @classmethod
    def resumed_knobs(cls, stored: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint stores momentum_type and use_qmodel both (resolve derives one from the
        other): an override of either, or a learning_rate/momentum the stored qmodel type
        refuses, drops the stored pair so the override decides the type, as on a fresh run;
        and the stored learning_rate/momentum/norm_constraint the new qmodel type refuses go
        too (it chooses them itself). adapt_damping and adapt_curvature_scale, which a fresh run
        derives from the type (on with the qmodel), are derived again for the new type unless given."""
        if "param_groups" in given and not groups.same_selection(stored.get("param_groups"),
                                                                  groups.normalize(given["param_groups"])):
            raise ConfigError("param_groups: a resumed run trains the groups of its checkpoint (their names, "
                              "optimizers and selections; the state slots are theirs): only their options may change")
        stored = dict(stored)
        kind = stored.get("momentum_type")
        refused = {"qmodel": ("learning_rate", "momentum"), "qmodel_fixedmu": ("learning_rate",)}
        if ({"momentum_type", "use_qmodel"} & given.keys()
                or any(k in given and given[k] is not None for k in refused.get(kind, ()))):
            stored.pop("momentum_type", None)
            stored.pop("use_qmodel", None)
            stored.pop("adapt_damping", None)
            stored.pop("adapt_curvature_scale", None)
        merged = {**stored, **given}
        new = merged.get("momentum_type")
        if new is None and given.get("use_qmodel") is True:
            new = "qmodel"
        for k in (*refused.get(new, ()), *(("norm_constraint",) if new in QMODEL_TYPES else ())):
            if k not in given:
                merged.pop(k, None)
        return merged

    def _momentum_type(self) -> str:
        """momentum_type from itself or from use_qmodel (kfac-jax) and whether a learning rate
        or momentum is given; a contradiction of the two is refused."""
        kind = self.momentum_type
        if kind is None:
            fixed = self.learning_rate is not None or self.momentum is not None
            qmodel = (not fixed) if self.use_qmodel is None else self.use_qmodel
            return "qmodel" if qmodel else "regular"
        if kind not in MOMENTUM_TYPES:
            raise ConfigError(f"unknown momentum_type {kind!r}; choose one of {', '.join(MOMENTUM_TYPES)}")
        if self.use_qmodel is not None and self.use_qmodel != (kind in QMODEL_TYPES):
            raise ConfigError(f"use_qmodel={self.use_qmodel} contradicts momentum_type={kind!r}; drop use_qmodel "
                              "(momentum_type says it)")
        return kind

    def validate(self) -> None:
        super().validate()
        self.check_recipes()
        if self.momentum is not None:
            check_unit("momentum", self.initial("momentum"))
        damping = self.initial("damping")
        check_positive("damping", damping)
        check_positive("min_damping", self.min_damping)
        check_positive("max_damping", self.max_damping)
        if self.min_damping > self.max_damping:
            raise ConfigError("min_damping must not exceed max_damping")
        if not self.min_damping <= damping <= self.max_damping:
            raise ConfigError(
                f"damping {damping:g} is outside [min_damping {self.min_damping:g}, max_damping {self.max_damping:g}]; "
                "set min_damping/max_damping too"
            )
        check_int("damping_adaptation_interval", self.damping_adaptation_interval, 1)
        check_unit("damping_adaptation_decay", self.damping_adaptation_decay, closed_low=False)
        check_positive("damping_rejection_factor", self.damping_rejection_factor)
        if self.norm_constraint is not None:
            check_positive("norm_constraint", self.norm_constraint)
        check_unit("cov_ema_decay", self.cov_ema_decay)
        check_int("cov_update_period", self.cov_update_period, 1)
        check_int("inv_update_period", self.inv_update_period, 1)
        check_int("burn_in_steps", self.burn_in_steps, 0)
        check_groups(self.inverse_groups)
        check_int("num_samples", self.num_samples, 1, MAX_NUM_SAMPLES, NUM_SAMPLES_WHY)
        check_positive("max_momentum", self.max_momentum)
        check_positive("qmodel_curvature_scale", self.qmodel_curvature_scale)
        check_int("curvature_scale_window", self.curvature_scale_window, 2)
        if self.curvature_scale_early_window is not None:
            check_int("curvature_scale_early_window", self.curvature_scale_early_window, 2)
        check_unit("curvature_scale_plateau", self.curvature_scale_plateau, closed_low=False)
        check_positive("max_curvature_scale", self.max_curvature_scale)
        if self.adapt_curvature_scale and self.max_curvature_scale < self.qmodel_curvature_scale:
            raise ConfigError(f"max_curvature_scale {self.max_curvature_scale:g} is below qmodel_curvature_scale "
                              f"{self.qmodel_curvature_scale:g}, where the plateau rule starts; raise it")
        if self.max_predicted_decrease is not None:
            check_positive("max_predicted_decrease", self.max_predicted_decrease)
        if self.loss_spike_factor is not None and not 1 < check_number("loss_spike_factor", self.loss_spike_factor):
            raise ConfigError(f"optimizer option 'loss_spike_factor' must be > 1 or None (off), got "
                              f"{self.loss_spike_factor!r}")
        check_int("loss_spike_window", self.loss_spike_window, 1)
        for name in ("stats_batch_size", "qmodel_batch_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if not (isinstance(self.precon_power, (int, float)) and not isinstance(self.precon_power, bool)
                and math.isfinite(self.precon_power) and self.precon_power < 0):
            raise ConfigError(f"precon_power must be a negative number (kfac-jax's default -1), got {self.precon_power!r}")
        self.mode = estimation_mode(self.mode)
        self.param_groups = groups.normalize(self.param_groups)

    @property
    def omega(self) -> float:
        """Damping multiplier of one adaptation (kfac-jax: decay ** interval)."""
        return self.damping_adaptation_decay ** self.damping_adaptation_interval


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


LOSS_RESOLUTION = 16 * float(np.finfo(np.float32).eps)  # a few ulps of the float32 batch loss


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
    # an update below float32's resolution (the damping at max_damping after a run of rejected
    # steps: parameters + update rounds to the parameters, or the loss to the same value)
    # measures nothing: 0 / tiny would raise the damping for ever; it counts as agreement, so
    # that the damping comes down
    actual = loss_new - loss_old
    resolution = LOSS_RESOLUTION * max(abs(loss_old), abs(loss_new))
    if actual == 0 or (abs(change) <= resolution and abs(actual) <= resolution):
        return 1.0
    if change >= 0:
        # the model predicts no decrease: rho is meaningless; treat as "model untrustworthy"
        return float("nan") if loss_new > loss_old else 1.0
    return actual / change
