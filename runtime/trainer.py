"""Trainer: K-FAC (and SGD / Adam baselines) on a compiled plan, with ONNX Runtime.

    from kfac_compiler.runtime import Trainer
    trainer = Trainer(plan, optimizer="kfac", device="cpu", seed=0)
    for inputs, targets in batches:
        metrics = trainer.step(inputs, targets)       # {"loss": ..., "damping": ..., ...}
    trainer.evaluate(inputs, targets)                 # {"loss": ..., "accuracy": ...}
    trainer.export("trained.onnx")                    # the model with the trained weights

All state (parameters, velocities, Kronecker factors, inverses, Adam moments) stays on the
device as double-buffered OrtValues (runtime/state.py); a step writes the batch into
pre-allocated inputs, runs one or a few subgraphs and reads back a handful of scalars.

One K-FAC step k (see docs/runtime.md):
  * every step runs ONE fused graph, `kfac_step`: its factor statistics run on every step
    (cov_update_period 1) or sit in an If on hp/update_stats (1 when k % cov_update_period
    == 0), and on every damping_adaptation_interval-th step only (an If on hp/loss_after) it
    also reports the same batch's loss at the new parameters (metric/loss_after) for
    Levenberg-Marquardt damping;
  * the first step runs `update_statistics` and `inverse_update` (+ host-side blocks) before
    it, and then the step without statistics (`with_stats=False`, or hp/update_stats = 0),
    so it is preconditioned by its own batch;
  * after step k with k % inv_update_period == 0 the damped inverses are refreshed;
  * a step whose loss/update is not finite is discarded (the runtime does not flip the state
    buffers); the host multiplies the damping by damping_rejection_factor (10) and reports
    `rejected: 1`.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping

import numpy as np
import onnx

from kfac_compiler.errors import CheckpointError, ConfigError, DataError, PlanError
from kfac_compiler.linalg import concrete_method
from kfac_compiler.runtime.data import BatchChecker, draw_noise, noise_shape
from kfac_compiler.runtime.device import get_device
from kfac_compiler.runtime.inverses import InverseRefresher
from kfac_compiler.runtime.optimizers import (
    AdamConfig,
    KfacConfig,
    SgdConfig,
    ema_coefficient,
    lm_adapt,
    make_config,
    reduction_ratio,
)
from kfac_compiler.runtime.program import Program, cached_program
from kfac_compiler.runtime.state import StateStore

class Trainer:
    """Train `plan` with `optimizer` ("kfac", "adam", "sgd") on `device` ("cpu", "cuda", "auto").

    Knobs (keyword arguments) per optimizer: see kfac_compiler.runtime.optimizers and
    docs/runtime.md. `threads` sets ONNX Runtime's intra-op thread count (default: all cores).
    `batch_size` (optional): the training batch size, so that every session the steps use is
    built here and not during the first step (any batch size still works).
    """

    def __init__(self, plan: Any, optimizer: str = "kfac", device: str = "cpu",
                 learning_rate: float | None = None, momentum: float | None = None, seed: int = 0,
                 threads: int | None = None, batch_size: int | None = None, **knobs: Any) -> None:
        if isinstance(plan, (str, os.PathLike)):
            from kfac_compiler.plan import load_plan

            if os.path.isfile(plan) and os.fspath(plan).endswith(".onnx"):
                raise PlanError(f"{os.fspath(plan)!r} is an ONNX model, not a plan: compile it first "
                                "(kfac_compiler.compile or `kfac-compiler compile`)")
            plan = load_plan(plan)
        if learning_rate is not None:
            knobs["learning_rate"] = learning_rate
        if momentum is not None:
            knobs["momentum"] = momentum
        self.plan = plan
        self.optimizer = optimizer
        self.config = make_config(optimizer, plan, **knobs)
        self.device = get_device(device)
        self.threads = threads
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)
        self.store = StateStore(self.device)
        self.params = list(plan.trainable)
        self.loss_kind = plan.loss.kind
        self._check_batch = BatchChecker(plan)
        self.input_specs = self._check_batch.input_specs
        # host-side state (all of it goes into checkpoints)
        self.step_count = 0        # optimizer steps taken (rejected ones included)
        self.applied_steps = 0     # steps whose update was applied (Adam's t)
        self.burn_in_count = 0
        self.ema_weight = 0.0
        self.inverses_ready = False
        self.damping = float(self.config.damping) if isinstance(self.config, KfacConfig) else 0.0
        # "auto" -> schur on CPU and CUDA (kfac_compiler.linalg.concrete_method)
        self.inverse_method = (concrete_method(self.config.inverse_method, self.device.name)
                               if isinstance(self.config, KfacConfig) else None)
        self._programs: dict[tuple, Program] = {}
        self._step_programs: dict[tuple, Program] = {}  # _step_program's memo
        self._weighted = False  # whether the current step's loss has per-example weights
        # rows of the current batch (chooses the sub-batch slices); the batch_size hint lets
        # the sessions for it be built here rather than in the first step
        self._batch_size = int(batch_size or 0)
        for p, value in plan.parameter_values().items():
            self.store.add(p, value)
        self._build_programs()

    # ------------------------------------------------------------------ programs
    def program(self, name: str, **options: Any) -> Program:
        """The Program for subgraph `name` (created on first use; its state slots initialized)."""
        return cached_program(self._programs, self.store, self.plan, self.device, self._threads_for(name), name,
                              **options)

    def _threads_for(self, name: str) -> int | None:
        """An emitted inverse refresh runs between two runs of the step session, whose
        spinning workers hold the other cores: on the CPU it gets one thread (digits
        autoencoder, 2 cores, inverse_method="schur": 1.9-2.1 ms per refresh, with two
        threads 2.4-2.9 ms)."""
        if name == "inverse_update" and self.device.name == "cpu":
            return 1
        return self.threads

    def _sub_batch(self, m: int | None) -> int | None:
        """m when the current batch is larger, else None: slicing a batch that is not larger
        would only add a second forward pass."""
        return m if m is not None and self._batch_size > m else None

    def _stats_batch(self) -> int | None:
        return self._sub_batch(self.config.stats_batch_size)

    def _kfac_options(self) -> dict[str, Any]:
        cfg = self.config
        return {"qmodel": bool(cfg.use_qmodel), "mode": cfg.mode, "num_samples": cfg.num_samples,
                "l2": cfg.l2_reg > 0, "stats_batch": self._stats_batch(),
                "qmodel_batch": self._sub_batch(cfg.qmodel_batch_size) if cfg.use_qmodel else None,
                "loss_after": bool(cfg.adapt_damping), "weighted": self._weighted}

    def _build_programs(self) -> None:
        """Create every session this optimizer's steps use, so that all state exists up front
        (checkpoints, parameters()) and the first step is not slowed by session creation."""
        cfg = self.config
        if isinstance(cfg, KfacConfig):
            step = self._step_program()
            if not self._stats_conditional:
                self._step_program(first=True)
            self.program("update_statistics", mode=cfg.mode, num_samples=cfg.num_samples, stats_batch=self._stats_batch(),
                         weighted=self._weighted)
            self._inverses = InverseRefresher(
                self.plan, self.program("inverse_update", method=self.inverse_method),
                step, self.inverse_method)
        elif isinstance(cfg, SgdConfig):
            self.program("sgd_step", l2=self.config.l2_reg > 0, weighted=self._weighted)
        else:
            self.program("adam_step", l2=self.config.l2_reg > 0, weighted=self._weighted)

    @property
    def _stats_conditional(self) -> bool:
        """With cov_update_period > 1 the step's statistics sit in an If on hp/update_stats, so
        that the steps without them (and the first step) share its session; with statistics
        on every step they run unconditionally (the If measured 2-4% dearer per step there),
        and the first step has a statistics-free variant."""
        return self.config.cov_update_period > 1

    def _step_program(self, first: bool = False) -> Program:
        """The fused K-FAC step (see _stats_conditional). Memoized on what its options depend
        on: the general lookup (options dict, sorted key) cost ~20 us of host time per step."""
        key = (first, self._weighted, self._batch_size)
        prog = self._step_programs.get(key)
        if prog is None:
            if self._stats_conditional:
                prog = self.program("kfac_step", with_stats=True, stats_if=True, **self._kfac_options())
            else:
                prog = self.program("kfac_step", with_stats=not first, **self._kfac_options())
            self._step_programs[key] = prog
        return prog

    def programs(self) -> dict[str, Program]:
        out = {}
        for (name, opts), prog in self._programs.items():
            label = name + "".join(f"[{k}={v}]" for k, v in opts if k in ("with_stats",))
            out[label] = prog
        return out

    def session_seconds(self) -> float:
        return sum(p.session_seconds for p in self._programs.values())

    # ------------------------------------------------------------------ data
    def _prepare(self, inputs: Mapping[str, Any], targets: Any) -> dict[str, np.ndarray]:
        return self._check_batch(inputs, targets)

    def _noise(self, prog: Program, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return draw_noise(self.rng, prog.info, prog.data_inputs, data["targets"], prog.name)

    def _noise_placeholders(self, prog: Program, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Buffers for the noise inputs of a step that skips its statistics (the If does not
        read them) where none was written yet, e.g. right after a checkpoint load: zeros, so
        that the trainer's random stream stays that of an uninterrupted run."""
        missing = [n for n in prog.data_inputs if n.startswith("noise/") and not self.store.has_data(n)]
        if not missing:
            return {}
        shape = noise_shape(prog.info, data["targets"], prog.name)
        return {n: np.zeros(shape, np.float32) for n in missing}

    # ------------------------------------------------------------------ steps
    def step(self, inputs: Mapping[str, Any], targets: Any, weights: Any = None) -> dict[str, float]:
        """One optimizer step on a batch; returns host-float metrics. `weights`: optional
        per-example loss weights or a 0/1 mask (L = 1/N sum_n w_n l_n)."""
        data = self._check_batch(inputs, targets, weights)
        self._weighted = weights is not None
        self._batch_size = int(data["targets"].shape[0])
        t0 = time.perf_counter()
        s0 = self.session_seconds()
        if isinstance(self.config, KfacConfig):
            metrics = self._kfac_step(data)
        elif isinstance(self.config, SgdConfig):
            metrics = self._sgd_step(data)
        else:
            metrics = self._adam_step(data)
        wall = time.perf_counter() - t0
        metrics["step_time"] = wall
        metrics["host_time"] = max(wall - (self.session_seconds() - s0), 0.0)
        return metrics

    def _set_common_hp(self) -> None:
        self.store.set_hp("hp/l2", self.config.l2_reg)

    def _sgd_step(self, data):
        cfg = self.config
        self._set_common_hp()
        hp = {"hp/learning_rate": cfg.learning_rate, "hp/momentum": cfg.momentum}
        out = self.program("sgd_step", l2=self.config.l2_reg > 0, weighted=self._weighted).run(self.store, data, hp=hp)
        return self._baseline_metrics(out, cfg.learning_rate, cfg.momentum)

    def _adam_step(self, data):
        cfg: AdamConfig = self.config
        self._set_common_hp()
        lr_t = cfg.lr_at(self.applied_steps + 1)
        hp = {"hp/learning_rate": lr_t, "hp/beta1": cfg.beta1, "hp/beta2": cfg.beta2, "hp/epsilon": cfg.epsilon}
        out = self.program("adam_step", l2=self.config.l2_reg > 0, weighted=self._weighted).run(self.store, data, hp=hp)
        return self._baseline_metrics(out, cfg.learning_rate, cfg.beta1)

    def _baseline_metrics(self, out, lr, mom):
        ok = out.get("metric/finite", 1.0) > 0.5
        m = {
            "step": float(self.step_count),
            "loss": out["loss"],
            "learning_rate": float(lr),
            "momentum": float(mom),
            "update_norm": out.get("metric/update_norm", float("nan")) if ok else 0.0,
            "grad_norm": out.get("metric/grad_norm", float("nan")),
            "rejected": 0.0 if ok else 1.0,
        }
        self.step_count += 1
        if ok:
            self.applied_steps += 1
        return m

    def _run_statistics(self, data: Mapping[str, np.ndarray] | None, batch_data) -> tuple[dict, bool]:
        """update_statistics on the batch (already in the store when data is None)."""
        cfg: KfacConfig = self.config
        prog = self.program("update_statistics", mode=cfg.mode, num_samples=cfg.num_samples,
                            stats_batch=self._stats_batch(), weighted=self._weighted)
        coeff, w_new = ema_coefficient(self.ema_weight, cfg.cov_ema_decay)
        feed = dict(data or {})
        feed.update(self._noise(prog, batch_data))
        out = prog.run(self.store, feed, hp={"hp/ema_coeff": coeff})
        ok = out.get("metric/finite", 1.0) > 0.5
        if ok:
            self.ema_weight = w_new
        return out, ok

    def _refresh_inverses(self) -> float:
        """Recompute every damped inverse from the current factors; returns inverse_ok."""
        cfg: KfacConfig = self.config
        damping = self.damping + cfg.l2_reg
        ok = self._inverses(self.store, damping)
        self.inverses_ready = True
        return 1.0 if ok else 0.0

    def burn_in(self, inputs: Mapping[str, Any], targets: Any) -> dict[str, float]:
        """A statistics-only step (no parameter update): the factors absorb the batch."""
        if not isinstance(self.config, KfacConfig):
            raise ConfigError(f"burn-in only applies to K-FAC, not {self.optimizer!r}")
        data = self._prepare(inputs, targets)
        self._weighted = False
        self._batch_size = int(data["targets"].shape[0])
        out, ok = self._run_statistics(data, data)
        self.burn_in_count += 1
        return {"step": float(self.step_count), "loss": out["loss"], "burn_in": 1.0, "rejected": 0.0 if ok else 1.0}

    def _kfac_step(self, data: dict[str, np.ndarray]) -> dict[str, float]:
        cfg: KfacConfig = self.config
        if self.burn_in_count < cfg.burn_in_steps:
            out, ok = self._run_statistics(data, data)
            self.burn_in_count += 1
            return {"step": float(self.step_count), "loss": out["loss"], "burn_in": 1.0,
                    "rejected": 0.0 if ok else 1.0, "damping": self.damping}
        k = self.step_count
        stats = (k % cfg.cov_update_period == 0) or self.ema_weight == 0.0
        first = not self.inverses_ready
        self._set_common_hp()
        damping = self.damping
        adapt = bool(cfg.adapt_damping) and k % cfg.damping_adaptation_interval == 0
        hp = {"hp/damping": damping}
        if cfg.adapt_damping:
            hp["hp/loss_after"] = 1.0 if adapt else 0.0  # the graph's If: forward at the new params
            hp["hp/reject_increase"] = 1.0 if cfg.reject_increase else 0.0
        if cfg.use_qmodel:
            hp["hp/max_momentum"] = cfg.max_momentum
            hp["hp/max_predicted_decrease"] = cfg.max_predicted_decrease or 0.0  # 0: off
        else:
            hp["hp/learning_rate"] = cfg.learning_rate
            hp["hp/momentum"] = cfg.momentum
            hp["hp/norm_constraint"] = cfg.norm_constraint or 0.0
        feed: dict[str, np.ndarray] = dict(data)
        inverse_ok = float("nan")
        w_new = None
        prog = self._step_program(first)
        if first:
            # the very first step is preconditioned by its own batch: statistics, inverses, step
            self._run_statistics(data, data)
            feed = self._noise_placeholders(prog, data)  # the batch is already in the store
            inverse_ok = self._refresh_inverses()
        elif stats:
            coeff, w_new = ema_coefficient(self.ema_weight, cfg.cov_ema_decay)
            hp["hp/ema_coeff"] = coeff
            feed.update(self._noise(prog, data))
        else:
            feed.update(self._noise_placeholders(prog, data))
        if self._stats_conditional:
            if w_new is None and not self.store.has_hp("hp/ema_coeff"):  # bound, but the If skips its reader
                hp["hp/ema_coeff"] = 0.0
            hp["hp/update_stats"] = 0.0 if w_new is None else 1.0
        out = prog.run(self.store, feed, hp=hp)
        ok = out.get("metric/finite", 1.0) > 0.5
        metrics = {
            "step": float(k),
            "loss": out["loss"],
            "damping": damping,
            "learning_rate": out.get("metric/alpha", float("nan")),
            "momentum": out.get("metric/mu", float("nan")),
            "update_norm": out.get("metric/update_norm", float("nan")),
            "grad_norm": out.get("metric/grad_norm", float("nan")),
            "qmodel_change": out.get("metric/qmodel_change", float("nan")),
            "update_scale": out.get("metric/update_scale", float("nan")),
            "rho": float("nan"),
            "rejected": 0.0,
            "stats": 1.0 if (stats or first) else 0.0,
            "inverse": 1.0 if first else 0.0,
            "inverse_ok": inverse_ok,
            "inverse_fallbacks": float(len(self._inverses.fallbacks)) if first else float("nan"),
        }
        self.step_count += 1
        if adapt:  # reported for rejected steps too (a step raising the objective is rejected)
            new_loss = out["metric/loss_after"]
            # without the qmodel the graph's change is first order: no damping term to remove
            metrics["rho"] = reduction_ratio(out["loss"], new_loss, metrics["qmodel_change"], metrics["update_norm"],
                                             damping, cfg.include_damping_in_quad_change or not cfg.use_qmodel)
            metrics["new_loss"] = new_loss
        if not ok:
            metrics["rejected"] = 1.0
            metrics["update_norm"] = 0.0
            self.damping = min(max(damping * cfg.damping_rejection_factor, cfg.min_damping), cfg.max_damping)
        else:
            self.applied_steps += 1
            if w_new is not None:
                self.ema_weight = w_new
            if adapt:
                self.damping = lm_adapt(damping, metrics["rho"], cfg)
        if not first and k % cfg.inv_update_period == 0:
            # refreshed right after the step, from factors that include this batch, with the
            # damping just adapted; used from the next step on (one session switch per period)
            metrics["inverse"] = 1.0
            metrics["inverse_ok"] = self._refresh_inverses()
            metrics["inverse_fallbacks"] = float(len(self._inverses.fallbacks))
        return metrics

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, inputs: Mapping[str, Any], targets: Any, batch_size: int | None = None) -> dict[str, float]:
        """Mean loss (and accuracy for softmax cross-entropy) at the current parameters."""
        if batch_size is not None and int(batch_size) < 1:
            raise ConfigError(f"evaluate: batch_size must be >= 1, got {batch_size}")
        data = self._prepare(inputs, targets)
        prog = self.program("loss")
        n = data["targets"].shape[0]
        bs = n if not batch_size else int(batch_size)
        want_acc = self.loss_kind == "softmax_cross_entropy"
        result = prog.results[0] if prog.results else None
        total, correct = 0.0, 0
        for s in range(0, n, bs):
            chunk = {k: v[s:s + bs] for k, v in data.items()}
            out = prog.run(self.store, chunk, results=[result] if (want_acc and result) else False, channel="eval")
            m = chunk["targets"].shape[0]
            total += out["loss"] * m
            if want_acc and result:
                logits = out[result]
                correct += int(np.sum(np.argmax(logits, axis=-1) == chunk["targets"]))
        metrics = {"loss": total / n}
        if want_acc and result:
            metrics["accuracy"] = correct / (n * int(np.prod(data["targets"].shape[1:], dtype=np.int64)))
        return metrics

    def predict(self, inputs: Mapping[str, Any]) -> np.ndarray:
        """The model output at the current parameters (runs the plan's model with them)."""
        import onnxruntime as ort

        specs = self._check_batch.input_specs
        missing = [n for n in specs if n not in inputs]
        unknown = [n for n in inputs if n not in specs]
        if missing or unknown:
            raise DataError(f"predict: inputs must be exactly the model's {list(specs)} "
                            f"(missing {missing}, unknown {unknown})")
        sess = ort.InferenceSession(self.exported_model().SerializeToString(), providers=["CPUExecutionProvider"])
        out_name = getattr(self.plan, "output", None) or sess.get_outputs()[0].name
        return sess.run([out_name], {k: np.asarray(v) for k, v in inputs.items()})[0]

    # ------------------------------------------------------------------ parameters
    def parameters(self) -> dict[str, np.ndarray]:
        return {p: self.store.to_numpy(p) for p in self.params}

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        self.store.set_parameters(self.params, values)

    def state(self) -> dict[str, np.ndarray]:
        """Every device state slot, copied to the host."""
        return self.store.state_dict()

    @property
    def learning_rate(self) -> float | None:
        return self.config.learning_rate

    def exported_model(self) -> onnx.ModelProto:
        from onnx import numpy_helper

        model = onnx.ModelProto()
        model.CopyFrom(self.plan.model)
        values = self.parameters()
        for i, t in enumerate(model.graph.initializer):
            if t.name in values:
                new = numpy_helper.from_array(values[t.name].astype(numpy_helper.to_array(t).dtype), t.name)
                model.graph.initializer[i].CopyFrom(new)
        return model

    def export(self, path: str | os.PathLike) -> str:
        """Write the plan's model with the trained weights as initializers (atomic)."""
        from kfac_compiler.runtime.checkpoint import atomic_write_bytes

        path = os.fspath(path)
        atomic_write_bytes(path, self.exported_model().SerializeToString())
        return path

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | os.PathLike) -> str:
        from kfac_compiler.runtime.checkpoint import save_checkpoint

        return save_checkpoint(self, path)

    def restore(self, path: str | os.PathLike) -> "Trainer":
        from kfac_compiler.runtime.checkpoint import restore_checkpoint

        restore_checkpoint(self, path)
        return self

    @classmethod
    def load_checkpoint(cls, path: str | os.PathLike, plan: Any, device: str = "cpu", batch_size: int | None = None,
                        **overrides: Any) -> "Trainer":
        """A new Trainer for `plan` with the optimizer, knobs and state stored in `path`."""
        from kfac_compiler.runtime.checkpoint import read_meta

        meta = read_meta(path)
        knobs = dict(meta.get("knobs", {}))
        knobs.update(overrides)
        threads = knobs.pop("threads", None)
        seed = knobs.pop("seed", meta.get("seed", 0))
        try:
            trainer = cls(plan, optimizer=meta["optimizer"], device=device, seed=seed, threads=threads,
                          batch_size=batch_size, **knobs)
        except KeyError as e:
            raise CheckpointError(f"checkpoint {os.fspath(path)!r} lacks {e}") from None
        trainer.restore(path)
        return trainer

    def host_state(self) -> dict[str, Any]:
        return {
            "step_count": self.step_count,
            "applied_steps": self.applied_steps,
            "burn_in_count": self.burn_in_count,
            "ema_weight": self.ema_weight,
            "inverses_ready": self.inverses_ready,
            "damping": self.damping,
        }

    def set_host_state(self, st: Mapping[str, Any]) -> None:
        self.step_count = int(st["step_count"])
        self.applied_steps = int(st["applied_steps"])
        self.burn_in_count = int(st["burn_in_count"])
        self.ema_weight = float(st["ema_weight"])
        self.inverses_ready = bool(st["inverses_ready"])
        self.damping = float(st["damping"])

    def __repr__(self) -> str:
        return (f"Trainer(optimizer={self.optimizer!r}, device={self.device.name!r}, "
                f"params={len(self.params)}, step={self.step_count}, damping={self.damping:.3g})")

