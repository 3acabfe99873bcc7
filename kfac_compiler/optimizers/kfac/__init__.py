"""K-FAC as an optimizer plugin: its settings (config.py), the `kfac_step` graph in three
stages (graph.py) and, here, its host-side policy.

One step k (docs/runtime.md):
  * every step runs ONE fused graph, `kfac_step`: its factor statistics run on every step
    (cov_update_period 1) or sit in an If on hp/update_stats (1 when k % cov_update_period
    == 0), and on every damping_adaptation_interval-th step only (an If on hp/loss_after) it
    also reports the same batch's loss at the new parameters (metric/loss_after) for
    Levenberg-Marquardt damping;
  * the first step runs `update_statistics` and `inverse_update` (+ host-side blocks) before
    it, and then the step without statistics (`with_stats=False`, or hp/update_stats = 0),
    so it is preconditioned by its own batch;
  * after step k with k % inv_update_period == 0 the damped inverses are refreshed; with
    several refresh groups (inverse_groups, refresh.py) group j after the steps k with
    k % inv_update_period == j;
  * a step whose loss, update or (when computed) loss after the update is not finite is
    discarded (the runtime does not flip the state buffers); the host multiplies the damping
    by damping_rejection_factor (10) and reports `rejected: 1`;
  * a step applied without the loss after it (not an adaptation step) is checked by the next
    step's loss: when that is not finite but is finite without the update, the update is undone
    (the parameters before it, which their slots' third buffer keeps; velocity = 0) and the step reports
    `rolled_back: 1`, so no update whose loss is non-finite stays applied;
  * the spike guard (loss_spike_factor): the step after such an unchecked update is withheld
    in the graph when its (finite) loss exceeds loss_spike_factor times the largest loss of
    the last loss_spike_window applied steps (hp/loss_limit); the host then evaluates the
    batch without the last update: when it is within the limit there and the update raised it
    by more than the update's predicted change (rho < -1 on a fresh batch), the update is
    undone as above and the damping multiplied by damping_rejection_factor (`spike: 1`,
    `rolled_back: 1`, `rejected: 1`); else the batch itself is hard and the step runs again
    without the limit (`spike: 1`, `rolled_back: 0`).
"""
from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler.host_blocks import host_blocks, refresh_costs
from kfac_compiler.linalg import concrete_method
from kfac_compiler.optimizers.accumulate import AccumulateOptions
from kfac_compiler.optimizers.base import Optimizer, register_optimizer
from kfac_compiler.optimizers.first_order import CLIP_NORM
from kfac_compiler.optimizers.groups import Groups
from kfac_compiler.optimizers.kfac import graph as G
from kfac_compiler.optimizers.kfac import refresh as R
from kfac_compiler.optimizers.kfac.graph import KFAC_STEP, STAGES, KfacStepOptions, emit_kfac_step
from kfac_compiler.optimizers.kfac.plateau import CurvatureScaleRule
from kfac_compiler.optimizers.kfac.settings import KfacConfig, ema_coefficient, lm_adapt, reduction_ratio
from kfac_compiler.optimizers.multi_tensor import set_state_values, state_values
from kfac_compiler.requests import InverseOptions, PowerOptions, StatisticsOptions

__all__ = ["KFAC_STEP", "STAGES", "Kfac", "KfacConfig", "KfacStepOptions", "ema_coefficient", "emit_kfac_step",
           "lm_adapt", "reduction_ratio"]


@register_optimizer
class Kfac(Optimizer):
    name = "kfac"
    Config = KfacConfig
    subgraphs = (KFAC_STEP,)
    accumulates = True

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        cfg: KfacConfig = self.config
        self.burn_in_count = 0
        self.ema_weight = 0.0
        self.inverses_ready = False
        self.damping = float(cfg.initial("damping"))
        # "auto" -> schur on CPU and CUDA (kfac_compiler.linalg.concrete_method)
        self.inverse_method = concrete_method(cfg.inverse_method, trainer.device.name)
        self.refresher = None  # refreshes the damped inverses (the trainer's InverseRefresher), made by build()
        self._step_programs: dict[tuple, Any] = {}  # step_program's memo
        self._uneven_told: set[str] = set()  # _sub_batch's knobs whose rows do not divide, said once
        # one If-free step graph per step kind, with the batch's shapes fixed: static_steps, or
        # the trainer's cuda_graphs (a captured graph admits no If)
        self.static = bool(cfg.static_steps) or bool(trainer.cuda_graphs)
        self.unchecked_update = False  # the last applied update had no loss_after check
        # the spike guard's history: the batch losses of the last applied steps, and the
        # predicted change of the last applied update
        self.recent_losses: deque[float] = deque(maxlen=cfg.loss_spike_window)
        self.last_change = 0.0
        # the decoupled decay's fraction alpha w of the last applied update: theta was
        # (1 - alpha w) theta_prev + velocity, which a roll-back undoes
        self.last_decay = 0.0
        self.groups = Groups(trainer.plan, cfg.param_groups)  # first-order parameter groups (groups.py)
        self.curvature_scale = CurvatureScaleRule(cfg.qmodel_curvature_scale, cfg.curvature_scale_window,
                                                  cfg.curvature_scale_plateau, cast(float, cfg.max_curvature_scale),
                                                  bool(cfg.adapt_curvature_scale), cfg.curvature_scale_early_window)

    # ------------------------------------------------------------------ sessions
    def _sub_batch(self, knob: str, shares: int = 1) -> int | None:
        """The config's `knob` m when the current batch is larger, else None: slicing a batch
        that is not larger would only add a second forward pass. In a data-parallel run m is
        the global sub-batch: each rank takes ceil(m / ranks) of its rows; `shares`: the batch
        is one of that many (an accumulation cycle's micro-batches), each taking its part of m.
        Where the parts do not divide m the run takes more rows than m, those of one process
        with the rounded-up size: said once, since runs meant to compare then differ."""
        m = getattr(self.config, knob)
        if m is None:
            return None
        parts = self.trainer.ranks * shares
        each = -(-int(m) // parts)
        if self.trainer.batch_size <= each:
            return None
        if each * parts != m and knob not in self._uneven_told and self.trainer.rank == 0:
            self._uneven_told.add(knob)
            split = f"{self.trainer.ranks} ranks" if shares == 1 else (
                f"{shares} micro-batches" if self.trainer.ranks == 1 else
                f"{self.trainer.ranks} ranks x {shares} micro-batches")
            warnings.warn(f"{knob} {m} does not divide among {split}: each takes {each} rows, {each * parts} in "
                          f"all, the rows one process on whole batches takes with {knob} {each * parts}; a "
                          f"multiple of {parts} takes the same rows as one process with that size", stacklevel=2)
        return each

    def stats_batch(self) -> int | None:
        """The statistics' sub-batch: of an accumulation cycle's k micro-batches each takes
        ceil(m / k) rows, spread evenly, which are the whole batch's rows when k divides m."""
        return self._sub_batch("stats_batch_size", self.cycle.count)

    def step_options(self, first: bool = False, adapt: bool = True) -> KfacStepOptions:
        """The kfac_step this run's settings and batch need (`first`: the first step's, or
        without the If (stats_conditional) a step's that takes no statistics; `adapt`: with
        static_steps, whether it computes the loss after the update, else an If decides)."""
        cfg = self.config
        static = self.static
        # momentum_type only where qmodel does not imply it: one graph serves regular and qmodel
        kind = cfg.momentum_type if cfg.momentum_type in ("adam", "qmodel_fixedmu") else None
        stats = dict(with_stats=True, stats_if=True) if self.stats_conditional else dict(with_stats=not first)
        return KfacStepOptions(
            qmodel=bool(cfg.use_qmodel), momentum_type=kind, mode=cfg.mode, num_samples=cfg.num_samples,
            l2=cfg.l2_reg > 0, stats_batch=self.stats_batch(),
            qmodel_batch=self._sub_batch("qmodel_batch_size") if cfg.use_qmodel else None,
            loss_after=bool(cfg.adapt_damping) and (adapt or not static), loss_after_if=not static,
            weighted=self.trainer.weighted,
            # only where it changes the graph (adam's predicted change)
            precon_power=float(cfg.precon_power) if kind == "adam" else -1.0,
            loss_limit=cfg.loss_spike_factor is not None, groups=self.groups.spec,
            accumulate=self.cycle.count > 1, multi_tensor=cfg.multi_tensor,
            curvature_scale=self.scales_curvature, **cfg.recipe_options(), **stats)

    @property
    def scales_curvature(self) -> bool:
        """Whether the step reads hp/qmodel_curvature_scale: with the qmodel, when c is adapted or
        not 1 (c = 1 fixed: the graph without the three products)."""
        cfg = self.config
        return bool(cfg.use_qmodel) and (bool(cfg.adapt_curvature_scale) or cfg.qmodel_curvature_scale != 1.0)

    @property
    def stats_conditional(self) -> bool:
        """With cov_update_period > 1 the step's statistics sit in an If on hp/update_stats, so
        that the steps without them (and the first step) share its session; with statistics
        on every step they run unconditionally (the If costs a little on every step), and the
        first step has a statistics-free variant. A data-parallel run does without the If: its
        statistics' terms that are not linear in the batch (generic blocks, masked rows) and
        ekfac's S are averaged over the ranks at cuts inside the statistics, which no If
        admits, so its steps without statistics run the statistics-free variant instead (a
        second session; docs/distributed.md). static_steps does without it too, by the same
        statistics-free variant."""
        return self.config.cov_update_period > 1 and self.trainer.ranks == 1 and not self.static

    def step_program(self, first: bool = False, adapt: bool = True, data: Mapping[str, np.ndarray] | None = None):
        """The fused K-FAC step (see stats_conditional), memoized on what its options depend
        on (the general lookup sorts an options dict on every step). With static_steps one
        per step kind (`first`: without statistics; `adapt`: with the loss after the update)
        and shape of the batch `data`, all sharing the store's state buffers."""
        tr = self.trainer
        shapes = None
        if self.static:
            shapes = tr.batch_shapes(data) if data is not None else None
        else:
            adapt = True  # the If form: one graph for both
        key = (first, adapt, tr.weighted, tr.batch_size, shapes)
        prog = self._step_programs.get(key)
        if prog is None:
            # static_steps' kinds take turns: none spins, as a session's idle pool spinning after
            # its run steals the cores from the next kind's (a data-parallel run's variants are
            # staged, and stages never spin)
            prog = tr.program(KFAC_STEP.name, options=self.step_options(first, adapt), shapes=shapes,
                              spin=not self.static)
            self._step_programs[key] = prog
        return prog

    def statistics_program(self):
        cfg = self.config
        return self.trainer.program(C.UPDATE_STATISTICS, options=StatisticsOptions(
            mode=cfg.mode, num_samples=cfg.num_samples, stats_batch=self.stats_batch(), weighted=self.trainer.weighted,
            layers=self.groups.kfac_layers))

    def build(self) -> None:
        tr = self.trainer
        if tr.sessions:  # roll_back restores the parameters before an update exactly
            tr.store.keep_previous(self.flat_params())
        if self.static:  # the step sessions come per batch shape, on first use
            step = tr.declared(KFAC_STEP.name, options=self.step_options())
        else:
            step = self.step_program()
            if not self.stats_conditional:
                self.step_program(first=True)
        self.statistics_program()
        if self.cycle.count > 1:
            self.micro_program()
        method = self.inverse_method
        slots = C.layer_slots(step.state_inputs, C.INVERSE)
        layers = [layer.name for layer in tr.plan.layers if layer.name in slots]  # the plan's order, as inspect
        layers += [layer for layer in slots if layer not in layers]
        power = float(self.config.precon_power)
        if power != -1:  # a block without that power: one line at construction, not at the first refresh
            for block in host_blocks(tr.plan, layers).values():
                block.check_power(power)
        costs = refresh_costs(tr.plan, layers, method)
        count = R.group_count(costs, self.config.inv_update_period, self.config.inverse_groups)
        groups = R.balanced_groups(costs, count) if count > 1 else [layers]
        owners = R.inverse_owners(costs, tr.ranks)  # data-parallel: each block's inverse on one rank
        emitted = []
        for g in groups:
            g = [layer for layer in g if owners[layer] == tr.rank]
            if not g:
                emitted.append(None)
                continue
            # an emitted refresh runs between two runs of the step session, whose spinning
            # workers hold the other cores: on the CPU one without wide factors gets one thread
            width = max((R.widest_factor([step.info.state_specs[s] for s in slots[layer].values()]) for layer in g),
                        default=0)
            threads = R.refresh_threads(width, tr.device.name)
            # one program per group; the options tuple keys tr.program's memo
            subset = tuple(g) if len(g) < len(layers) or self.groups else None  # with groups: K-FAC's blocks only
            if power == -1:
                emitted.append(tr.program(C.INVERSE_UPDATE, threads=threads,
                                          options=InverseOptions(method=method, layers=subset)))
            else:
                emitted.append(tr.program(C.POWER_UPDATE, threads=threads,
                                          options=PowerOptions(method=method, layers=subset, power=power)))
        self.refresher = tr.inverse_refresher(emitted, step, method, groups, owners, power=power)

    # ------------------------------------------------------------------ steps
    def run_statistics(self, data: Mapping[str, np.ndarray] | None, batch_data,
                       micro: bool = True) -> tuple[dict, bool]:
        """update_statistics on the batch (already in the store when data is None); `micro`:
        the batch is a micro-batch of the accumulation cycle (the explicit burn_in's is whole).
        The moving-average weight advances with the cycle's last micro-batch."""
        prog = self.statistics_program()
        coeff, w_new = ema_coefficient(self.ema_weight, self.config.cov_ema_decay)
        if micro:
            coeff = self.cycle.coefficient(coeff)
        feed = dict(data or {})
        feed.update(self.trainer.draw_noise(prog, batch_data))
        out = prog.run(self.trainer.store, feed, hp={C.EMA_COEFF: coeff})
        if micro and not self.cycle.last:
            return out, out.get(C.FINITE, 1.0) > 0.5
        ok = out.get(C.FINITE, 1.0) > 0.5
        if ok:
            self.ema_weight = w_new
        return out, ok

    def refresh_inverses(self, group: int | None = None) -> float:
        """Recompute every damped inverse (or those of refresher group `group`) from the
        current factors; returns inverse_ok."""
        ok = self.refresher(self.trainer.store, self.damping + self.config.l2_reg, group)
        self.inverses_ready = True
        return 1.0 if ok else 0.0

    def due_group(self, step: int) -> int | None:
        """The refresher group whose inverses are refreshed after step `step`, None if none."""
        return R.due_group(step, self.config.inv_update_period, len(self.refresher.groups))

    def burn_in(self, data: dict[str, Any], micro: bool = False) -> dict[str, float]:
        """A statistics-only step (no parameter update): the factors absorb the batch (`micro`:
        an accumulation cycle's last micro-batch, from step())."""
        out, ok = self.run_statistics(data, data, micro)
        self.burn_in_count += 1
        # the batch's loss, the ranks' mean (each rank's own had been reported: metrics differed
        # between ranks and from one process's)
        return {"step": float(self.trainer.step_count), "loss": self.trainer.mean_over_ranks(out[C.LOSS]),
                "burn_in": 1.0, "rejected": 0.0 if ok else 1.0}

    def _hyper_parameters(self, adapt: bool, k: int) -> dict[str, float]:
        """Step k's hyper-parameters: the fixed or scheduled learning rate and momentum (the
        quadratic model chooses those it does not get), the damping, the switches."""
        cfg = self.config
        hp = {C.DAMPING: self.damping}
        if cfg.adapt_damping:
            hp[G.WANT_LOSS_AFTER] = 1.0 if adapt else 0.0  # the graph's If: forward at the new params
            hp[G.REJECT_INCREASE] = 1.0 if cfg.reject_increase else 0.0
        if self.scales_curvature:
            hp[G.CURVATURE_SCALE] = self.curvature_scale.scale
        if cfg.use_qmodel:
            hp[G.MAX_MOMENTUM] = cfg.max_momentum
            hp[G.MAX_PREDICTED_DECREASE] = cfg.max_predicted_decrease or 0.0  # 0: off
        else:
            hp[C.LEARNING_RATE] = cfg.at("learning_rate", k)
            hp[G.NORM_CONSTRAINT] = cfg.norm_constraint or 0.0
        if cfg.momentum_type != "qmodel":
            hp[C.MOMENTUM] = cfg.at("momentum", k)
        hp.update(self.groups.hyper_parameters(self.trainer.applied_steps + 1, k))
        if cfg.clip_norm is not None:
            hp[CLIP_NORM] = float(cfg.clip_norm)
        if cfg.decoupled_weight_decay > 0:
            hp[G.DECOUPLED_DECAY] = float(cfg.decoupled_weight_decay)
        return hp

    # ------------------------------------------------------------------ gradient accumulation
    def stats_due(self, k: int) -> bool:
        """Whether step k folds its batch's statistics into the moving averages."""
        return k % self.config.cov_update_period == 0 or self.ema_weight == 0.0

    def accumulate_options(self) -> AccumulateOptions:
        cfg = self.config
        return AccumulateOptions(weighted=self.trainer.weighted, mode=cfg.mode, num_samples=cfg.num_samples,
                                 stats_batch=self.stats_batch(),
                                 with_stats=self.stats_conditional or self.stats_due(self.trainer.step_count),
                                 stats_if=self.stats_conditional,
                                 layers=self.groups.kfac_layers)

    def micro_batch(self, data: dict[str, Any]) -> tuple[dict[str, float], bool]:
        """A micro-batch other than its cycle's last: its gradient summed and its statistics
        folded (micro_inputs); during burn-in its statistics only."""
        if self.burn_in_count < self.config.burn_in_steps:
            out, ok = self.run_statistics(data, data)
            return {"step": float(self.trainer.step_count), "loss": out[C.LOSS], "burn_in": 1.0}, ok
        return super().micro_batch(data)

    def micro_inputs(self, prog, data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """On the steps that take statistics, the micro-batch folds its own into the moving
        averages with the weight Accumulation.coefficient gives, so that after the cycle the
        factors are those of one step on the whole batch (and its noise is drawn, else
        placeholders keep the random stream an uninterrupted run's)."""
        tr = self.trainer
        stats = self.stats_due(tr.step_count)
        hp = {}
        if stats:
            hp[C.EMA_COEFF] = self.cycle.coefficient(ema_coefficient(self.ema_weight, self.config.cov_ema_decay)[0])
        if self.stats_conditional:
            if not stats and not tr.store.has_hp(C.EMA_COEFF):  # bound, but the If skips its reader
                hp[C.EMA_COEFF] = 0.0
            hp[C.UPDATE_STATS] = 1.0 if stats else 0.0
        return (tr.draw_noise(prog, data) if stats else tr.noise_placeholders(prog, data)), hp

    def loss_limit(self) -> float:
        """The spike guard's limit on this step's batch loss: loss_spike_factor times the
        largest loss of the last loss_spike_window applied steps after an unchecked update,
        else inf (no limit)."""
        factor = self.config.loss_spike_factor
        if factor is None or not self.unchecked_update or not self.recent_losses:
            return math.inf
        return float(factor) * max(self.recent_losses)

    def scheduled_damping(self, k: int) -> None:
        """With a damping schedule: step k's damping, within [min_damping, max_damping]."""
        cfg = self.config
        if cfg.scheduled("damping"):
            self.damping = min(max(cfg.at("damping", k), cfg.min_damping), cfg.max_damping)

    def step(self, data: dict[str, Any]) -> dict[str, float]:
        cfg: KfacConfig = self.config
        tr = self.trainer
        if self.burn_in_count < cfg.burn_in_steps:
            return {**self.burn_in(data, micro=True), "damping": self.damping}
        k = tr.step_count
        stats = self.stats_due(k)
        first = not self.inverses_ready
        tr.store.set_hp(C.L2, cfg.l2_reg)
        self.scheduled_damping(k)
        damping = self.damping
        adapt = bool(cfg.adapt_damping) and k % cfg.damping_adaptation_interval == 0
        hp = self._hyper_parameters(adapt, k)
        limit = self.loss_limit()
        if cfg.loss_spike_factor is not None:
            hp[G.LOSS_LIMIT] = limit
        feed: dict[str, np.ndarray] = dict(data)
        inverse_ok = float("nan")
        w_new = None
        prog = self.step_program(first or not stats, adapt, data)  # (with the Ifs, one program whatever first)
        if first:
            # the very first step is preconditioned by its own batch: statistics, inverses, step;
            # a batch whose statistics are refused (not finite) leaves the factors empty: no
            # inverses from them (they made steps of I / damping until the next refresh), and the
            # next step starts over
            _, stats_ok = self.run_statistics(data, data)
            feed = tr.noise_placeholders(prog, data)  # the batch is already in the store
            if stats_ok:
                inverse_ok = self.refresh_inverses()
        elif stats:
            coeff, w_new = ema_coefficient(self.ema_weight, cfg.cov_ema_decay)
            hp[C.EMA_COEFF] = self.cycle.coefficient(coeff)
            feed.update(tr.draw_noise(prog, data))
        else:
            feed.update(tr.noise_placeholders(prog, data))
        if self.stats_conditional:
            if w_new is None and not tr.store.has_hp(C.EMA_COEFF):  # bound, but the If skips its reader
                hp[C.EMA_COEFF] = 0.0
            hp[C.UPDATE_STATS] = 0.0 if w_new is None else 1.0
        out = prog.run(tr.store, feed, hp=hp)
        ok = out.get(C.FINITE, 1.0) > 0.5
        spike = not ok and math.isfinite(limit) and bool(np.isfinite(out[C.LOSS])) and out[C.LOSS] > limit
        undone = False
        if spike:
            # the update before this step is to blame when this batch's loss is within the
            # limit without it and it rose by more than the update's predicted change
            loss = float(out[C.LOSS])
            undone = self.roll_back(data, lambda before: before <= limit and loss - before > abs(self.last_change))
            if not undone:  # the batch itself is hard: this step again without the limit
                hp[G.LOSS_LIMIT] = math.inf
                out = prog.run(tr.store, feed, hp=hp)
                ok = out.get(C.FINITE, 1.0) > 0.5
        metrics = {
            "step": float(k),
            "loss": out[C.LOSS],
            "damping": damping,
            "curvature_scale": hp.get(G.CURVATURE_SCALE, float("nan")),
            "learning_rate": out.get(G.ALPHA, float("nan")),
            "momentum": out.get(G.MU, float("nan")),
            "update_norm": out.get(C.UPDATE_NORM, float("nan")),
            "grad_norm": out.get(C.GRAD_NORM, float("nan")),
            "qmodel_change": out.get(G.QMODEL_CHANGE, float("nan")),
            "update_scale": out.get(G.UPDATE_SCALE, float("nan")),
            "rho": float("nan"),
            "rejected": 0.0,
            "stats": 1.0 if (stats or first) else 0.0,
            "inverse": 1.0 if first and self.inverses_ready else 0.0,
            "inverse_group": -1.0 if first and self.inverses_ready else float("nan"),  # -1: every group
            "inverse_ok": inverse_ok,
            "inverse_fallbacks": float(len(self.refresher.fallbacks)) if first and self.inverses_ready else float("nan"),
            **C.loss_metrics(out),
            **self.groups.metrics(out, ok, k),
        }
        if spike:
            metrics["spike"] = 1.0
            metrics["rolled_back"] = 1.0 if undone else 0.0
        tr.step_count += 1
        if adapt:  # reported for rejected steps too (a step raising the objective is rejected)
            new_loss = out[G.LOSS_AFTER]
            # without the qmodel the graph's change is first order: no damping term to remove
            metrics["rho"] = reduction_ratio(out[C.LOSS], new_loss, metrics["qmodel_change"], metrics["update_norm"],
                                             damping, cfg.include_damping_in_quad_change or not cfg.use_qmodel)
            metrics["new_loss"] = new_loss
        if not ok:
            metrics["rejected"] = 1.0
            metrics["update_norm"] = 0.0
            self.damping = min(max(damping * cfg.damping_rejection_factor, cfg.min_damping), cfg.max_damping)
            if self.unchecked_update and not np.isfinite(metrics["loss"]):
                metrics["rolled_back"] = 1.0 if self.roll_back(data) else 0.0
        else:
            self.unchecked_update = not adapt
            self.last_decay = min(max(float(metrics["learning_rate"]), 0.0) * cfg.decoupled_weight_decay, 1.0)
            tr.applied_steps += 1
            self.groups.applied()
            self.recent_losses.append(float(metrics["loss"]))
            self.curvature_scale.observe(self.batch_loss(float(metrics["loss"])))
            if math.isfinite(metrics["qmodel_change"]):
                self.last_change = float(metrics["qmodel_change"])
            if w_new is not None:
                self.ema_weight = w_new
            if adapt:
                self.damping = lm_adapt(damping, metrics["rho"], cfg)
        self.scheduled_damping(tr.step_count)  # the inverses refreshed now serve the next step
        group = None if first else self.due_group(k)
        if group is not None:
            # refreshed right after the step, from factors that include this batch, with the
            # damping just adapted; used from the next step on (one session switch per period
            # and group)
            metrics["inverse"] = 1.0
            metrics["inverse_group"] = float(group)
            metrics["inverse_ok"] = self.refresh_inverses(group)
            metrics["inverse_fallbacks"] = float(len(self.refresher.fallbacks))
        return metrics

    def batch_loss(self, loss: float) -> float:
        """The whole batch's loss from the step's: with gradient accumulation the step's loss is
        its cycle's last micro-batch's, and the batch's is the cycle's mean (the plateau rule
        compares batch losses; a micro-batch's are noisier)."""
        return self.cycle.mean_with("loss", loss)

    def roll_back(self, data: dict[str, Any], keep: Callable[[float], bool] = math.isfinite) -> bool:
        """Undo the last applied update (the parameters before it, which their slots' third
        buffer keeps (StateStore.keep_previous): theta + u - u in float32 loses theta where the
        update is many times its size, as an update whose next loss overflows is; after a host
        write, (theta - velocity) / (1 - alpha w), the update and the decoupled decay; velocity = 0, and adam momentum's gradient sum = 0; a parameter
        group's by its rule, Groups.undo) when keep(the
        loss of this batch without it) holds (default: it is finite); else the batch itself is
        bad and the update stays. A host round trip and a forward pass: only after a divergence
        or a loss spike."""
        tr = self.trainer
        store = tr.store
        shapes = self.flat_shapes()
        theta = {p: store.to_numpy(p) for p in shapes}
        # velocity/<p> or the multi-tensor step's flat velocity/* (and adam momentum's grad_velocity)
        kept = {kind: state_values(store, kind, shapes) for kind in (C.VELOCITY, C.GRAD_VELOCITY)}
        velocity = cast(dict, kept[C.VELOCITY])
        exact = store.has_previous(shapes)  # the parameters before the update, in their third buffer
        if exact:
            store.step_back(shapes)
        else:  # a host write since (a checkpoint loaded after the update): undone by arithmetic
            keep_fraction = 1.0 - self.last_decay  # 0 (alpha w = 1 zeroed theta): the decay cannot be undone
            for p in shapes:
                before = theta[p].astype(np.float64) - velocity[p]
                store.set(p, (before / keep_fraction if keep_fraction > 0 else before).astype(theta[p].dtype))
        for kind, values in kept.items():
            if values is not None:
                set_state_values(store, kind, {p: np.zeros_like(v) for p, v in values.items()}, shapes)
        grouped = self.groups.undo(store)
        loss = tr.mean_over_ranks(tr.program(C.LOSS_GRAPH).run(store, data, results=False, channel="eval")[C.LOSS])
        if not keep(float(loss)):
            if exact:  # nothing wrote the spare since: the update's buffer is current again
                store.flip_all(shapes)
            else:
                for p in shapes:
                    store.set(p, theta[p])
            for kind, values in kept.items():
                if values is not None:
                    set_state_values(store, kind, values, shapes)
            for p, value in grouped.items():
                store.set(p, value)
            return False
        self.unchecked_update = False
        self.groups.undone()
        tr.applied_steps -= 1
        return True

    def summary_lines(self) -> list[str]:
        return self.groups.summary_lines()

    def flat_params(self) -> list[str]:
        """K-FAC's own parameters: a parameter group's keep their per-parameter state."""
        return list(self.groups.kfac_params)

    # ------------------------------------------------------------------ checkpoints
    def host_state(self) -> dict[str, Any]:
        return {"burn_in_count": self.burn_in_count, "ema_weight": self.ema_weight,
                "inverses_ready": self.inverses_ready, "damping": self.damping,
                "unchecked_update": self.unchecked_update, "recent_losses": list(self.recent_losses),
                "last_change": self.last_change, "last_decay": self.last_decay, **self.curvature_scale.host_state(), **self.groups.host_state()}

    def set_host_state(self, state: Mapping[str, Any]) -> None:
        """Restore host_state(); ValueError for values no run produces (a checkpoint names it)."""
        burn_in, ema_weight, damping = int(state["burn_in_count"]), float(state["ema_weight"]), float(state["damping"])
        if burn_in < 0:
            raise ValueError(f"host.burn_in_count must be >= 0, got {burn_in}")
        if not 0.0 <= ema_weight <= 1.0:
            raise ValueError(f"host.ema_weight must be in [0, 1], got {ema_weight}")
        if not (math.isfinite(damping) and damping > 0):
            raise ValueError(f"host.damping must be a finite number > 0, got {damping}")
        self.burn_in_count, self.ema_weight, self.damping = burn_in, ema_weight, damping
        self.unchecked_update = bool(state.get("unchecked_update", False))  # older checkpoints lack it
        recent = [float(x) for x in state.get("recent_losses", [])]  # the spike guard's; older ones lack them
        if not all(math.isfinite(x) for x in recent):
            raise ValueError(f"host.recent_losses must be finite numbers, got {recent}")
        self.recent_losses = deque(recent[-self.config.loss_spike_window:], maxlen=self.config.loss_spike_window)
        self.last_change = float(state.get("last_change", 0.0))
        self.last_decay = float(state.get("last_decay", 0.0))  # older checkpoints lack it
        if not 0.0 <= self.last_decay <= 1.0:
            raise ValueError(f"host.last_decay must be in [0, 1], got {self.last_decay}")
        self.inverses_ready = bool(state["inverses_ready"])
        self.curvature_scale.set_host_state(state)
        self.groups.set_host_state(state)

    def resumed(self, knobs) -> None:
        if "damping" in knobs:  # the adapted damping restarts from the value given (a schedule: its value)
            self.damping = float(self.config.at("damping", self.trainer.step_count))
        if knobs & {"qmodel_curvature_scale", "adapt_curvature_scale"}:  # c restarts from the value given
            self.curvature_scale.restart()
        if "precon_power" in knobs:  # the inverse slots hold the checkpoint's power: refresh first
            self.inverses_ready = False
