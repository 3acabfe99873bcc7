"""A lower-level API for users who own their training loop.

    from kfac_compiler.runtime import Curvature, gradients
    loss, grads = gradients(plan, {"input": x}, y)            # {param: dL/dparam}
    curv = Curvature(plan, device="cpu")
    curv.estimate({"input": x}, y, mode="empirical")          # one batch's factors
    # -> {"fc1": {"A": [65, 65], "G": [128, 128]}, ...}  ({"diag": ...} for diagonal blocks)
    curv.update({"input": x}, y)                              # moving averages (zero-debiased)
    curv.update_inverses(damping=1e-3)
    step = curv.precondition(grads)                           # (F + damping)^-1 g, per param
    curv.multiply("fc1", {"fc1.weight": v, "fc1.bias": u}, damping=1e-3)   # (F + damping) v
    curv.multiply_inverse("fc1", {...})

The parameters default to the plan's model initializers; `set_parameters` changes them (e.g.
to your own training loop's current weights).
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler.contract import ESTIMATION_MODES, plan_blocks
from kfac_compiler.errors import ConfigError
from kfac_compiler.linalg import concrete_method
from kfac_compiler.plan import Plan
from kfac_compiler.parsing import check_float, check_int
from kfac_compiler.runtime.data import BatchChecker, draw_noise, parameter_vectors
from kfac_compiler.runtime.device import get_device
from kfac_compiler.runtime.inverses import InverseRefresher
from kfac_compiler.optimizers import ema_coefficient
from kfac_compiler.runtime.program import Program, cached_program
from kfac_compiler.runtime.state import StateStore


def _group_stats(results: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """{layer: {factor: array}} of a statistics run's stat/<layer>/<f> results."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, value in results.items():
        parsed = C.parse_stat(name)
        if parsed is not None:
            out.setdefault(parsed[0], {})[parsed[1]] = value
    return out


class Curvature:
    """Curvature estimates of `plan` (factors, moving averages, damped inverses) on `device`."""

    def __init__(self, plan: Plan, device: str = "cpu", mode: str | None = None, num_samples: int | None = None,
                 ema_decay: float | None = None, inverse_method: str | None = None, seed: int = 0,
                 threads: int | None = None) -> None:
        self.plan = plan
        self.device = get_device(device)
        self.threads = None if threads is None else check_int(threads, "threads", low=1)
        self.mode = mode or plan.estimator.mode
        self.num_samples = check_int(num_samples or plan.estimator.num_samples, "num_samples", low=1)
        self.ema_decay = check_float(ema_decay if ema_decay is not None else plan.schedule.ema_decay, "ema_decay")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")
        self.inverse_method = concrete_method(inverse_method or plan.inverse.method, self.device.name)
        self._check_mode(self.mode)
        self.rng = np.random.default_rng(check_int(seed, "seed", low=0))
        self.store = StateStore(self.device)
        self.params = list(plan.trainable)
        for p, v in plan.parameter_values().items():
            self.store.add(p, v)
        self.ema_weight = 0.0
        self.damping: float | None = None
        self._programs: dict[tuple, Program] = {}
        self._blocks: dict[str, Any] | None = None
        self._inverses: InverseRefresher | None = None
        self._check_batch = BatchChecker(plan)
        self.input_specs = self._check_batch.input_specs

    @staticmethod
    def _check_mode(mode: str) -> None:
        if mode not in ESTIMATION_MODES:
            raise ConfigError(f"unknown estimation mode {mode!r}; choose one of {', '.join(ESTIMATION_MODES)}")

    def program(self, name: str, **options: Any) -> Program:
        return cached_program(self._programs, self.store, self.plan, self.device, self.threads, name, **options)

    # ---------------------------------------------------------------- parameters
    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        self.store.set_parameters(self.params, values)

    def parameters(self) -> dict[str, np.ndarray]:
        return {p: self.store.to_numpy(p) for p in self.params}

    # ---------------------------------------------------------------- estimates
    def gradients(self, inputs: Mapping[str, Any], targets: Any, weights: Any = None) -> tuple[float, dict[str, np.ndarray]]:
        data = self._check_batch(inputs, targets, weights)
        out = self.program("gradients", weighted=weights is not None).run(self.store, data, results=True)
        return out[C.LOSS], {p: out[C.grad(p)] for p in self.params}

    def estimate(self, inputs: Mapping[str, Any], targets: Any, mode: str | None = None,
                 num_samples: int | None = None, weights: Any = None) -> dict[str, dict[str, np.ndarray]]:
        """One batch's curvature factors per layer (no moving average); `weights`: optional
        per-example loss weights or mask (the output factors G become sum_n w_n ...)."""
        mode = mode or self.mode
        self._check_mode(mode)
        num_samples = self.num_samples if num_samples is None else check_int(num_samples, "num_samples", low=1)
        prog = self.program("statistics", mode=mode, num_samples=num_samples,
                            weighted=weights is not None)
        data = self._check_batch(inputs, targets, weights)
        data.update(draw_noise(self.rng, prog.info, prog.data_inputs, data[C.TARGETS], prog.name))
        out = prog.run(self.store, data, results=True)
        self.last_loss = out[C.LOSS]
        return _group_stats(out)

    def update(self, inputs: Mapping[str, Any], targets: Any) -> float:
        """Fold one batch into the zero-debiased moving averages; returns the batch loss."""
        prog = self.program("update_statistics", mode=self.mode, num_samples=self.num_samples)
        data = self._check_batch(inputs, targets)
        data.update(draw_noise(self.rng, prog.info, prog.data_inputs, data[C.TARGETS], prog.name))
        coeff, w = ema_coefficient(self.ema_weight, self.ema_decay)
        out = prog.run(self.store, data, hp={C.EMA_COEFF: coeff})
        if out.get(C.FINITE, 1.0) > 0.5:
            self.ema_weight = w
        return out[C.LOSS]

    def factors(self) -> dict[str, dict[str, np.ndarray]]:
        """The current moving averages per layer."""
        self.program("update_statistics", mode=self.mode, num_samples=self.num_samples)
        return self._layer_state(C.FACTOR)

    def inverses(self) -> dict[str, dict[str, np.ndarray]]:
        return self._layer_state(C.INVERSE)

    def _layer_state(self, kind: str) -> dict[str, dict[str, np.ndarray]]:
        return {layer: {item: self.store.to_numpy(s) for item, s in slots.items()}
                for layer, slots in C.layer_slots(self.store.slots(), kind).items()}

    def update_inverses(self, damping: float) -> bool:
        """Recompute the damped inverses of the moving averages; False if a block failed (it
        keeps its previous inverse)."""
        damping = check_float(damping, "damping", positive=True)
        if self._inverses is None:
            self._inverses = InverseRefresher(self.plan, self.program("inverse_update", method=self.inverse_method),
                                              self.program("precondition"), self.inverse_method)
        ok = self._inverses(self.store, float(damping))
        self.damping = float(damping)
        return ok

    def precondition(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """(F + damping)^-1 g with the inverses of the last update_inverses()."""
        if self.damping is None:
            raise ConfigError("call update_inverses(damping) before precondition()")
        vectors = parameter_vectors(self._shapes(self.params), grads, "precondition")
        prog = self.program("precondition")
        data = {C.vec(p): v for p, v in vectors.items()}
        out = prog.run(self.store, data, results=True)
        return {p: out[C.precond(p)] for p in self.params}

    # ---------------------------------------------------------------- per block (host)
    def blocks(self) -> dict[str, Any]:
        if self._blocks is None:
            self._blocks = plan_blocks(self.plan)
        return self._blocks

    def _block(self, layer: str):
        blocks = self.blocks()
        if layer not in blocks:
            raise ConfigError(f"unknown layer {layer!r}; the plan's layers are {list(blocks)}")
        return blocks[layer]

    def _shapes(self, params) -> dict[str, tuple[int, ...]]:
        return {p: self.store.spec(p)[0] for p in params}

    def _layer_vectors(self, layer: str, vectors: Any, what: str) -> dict[str, np.ndarray]:
        return parameter_vectors(self._shapes(self._block(layer).layer.params), vectors, f"{what}({layer!r})")

    def _damping(self, damping: float | None) -> float:
        """The damping a product uses: `damping`, else the last update_inverses'; 0 before it."""
        if damping is None:
            return float(self.damping or 0.0)
        d = check_float(damping, "damping")
        if d < 0:
            raise ConfigError(f"damping must be >= 0, got {damping!r}")
        return d

    def multiply(self, layer: str, vectors: Mapping[str, np.ndarray], damping: float | None = None) -> dict[str, np.ndarray]:
        """(F_layer + damping) v with the layer's moving-average factors (numpy twin)."""
        v = self._layer_vectors(layer, vectors, "multiply")
        return self._block(layer).numpy_multiply(v, self.factors().get(layer, {}), self._damping(damping))

    def multiply_all(self, vectors: Mapping[str, np.ndarray], damping: float | None = None,
                     exp: int = 1) -> dict[str, np.ndarray]:
        """(F + damping)^exp v for every parameter (integer exp), in the `multiply` subgraph
        on the device, from the moving-average factors."""
        v = parameter_vectors(self._shapes(self.params), vectors, "multiply_all")
        d = self._damping(damping)
        prog = self.program("multiply", exp=check_int(exp, "exp"))
        out = prog.run(self.store, {C.vec(p): a for p, a in v.items()}, hp={C.DAMPING: d}, results=True)
        return {p: out[C.product(p)] for p in self.params}

    def multiply_matpower(self, layer: str, vectors: Mapping[str, np.ndarray], exp: float,
                          damping: float | None = None) -> dict[str, np.ndarray]:
        """(F_layer + damping)^exp v for any real exp (TF K-FAC's exps), via the block's
        host-side eigendecomposition (numpy twin)."""
        v = self._layer_vectors(layer, vectors, "multiply_matpower")
        return self._block(layer).numpy_multiply_matpower(v, self.factors().get(layer, {}), self._damping(damping),
                                                          check_float(exp, "exp"))

    def multiply_inverse(self, layer: str, vectors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """(F_layer + damping)^-1 v with the layer's current inverse state (numpy twin)."""
        if self.damping is None:
            raise ConfigError("call update_inverses(damping) before multiply_inverse()")
        v = self._layer_vectors(layer, vectors, "multiply_inverse")
        return self._block(layer).numpy_multiply_inverse(v, self.inverses().get(layer, {}))


# --------------------------------------------------------------------------- gradients()
_GRAD_CACHE: dict[int, tuple[Any, Curvature]] = {}


def gradients(plan: Plan, inputs: Mapping[str, Any], targets: Any, params: Mapping[str, np.ndarray] | None = None,
              device: str = "cpu", weights: Any = None) -> tuple[float, dict[str, np.ndarray]]:
    """(mean loss, {initializer name: gradient}) at the plan's weights (or `params`);
    `weights`: optional per-example loss weights or mask."""
    entry = _GRAD_CACHE.get(id(plan))
    curv = None
    if entry is not None and entry[0]() is plan and entry[1].device.name == get_device(device).name:
        curv = entry[1]
    if curv is None:
        curv = Curvature(plan, device=device)
        try:
            ref = weakref.ref(plan)
            weakref.finalize(plan, _GRAD_CACHE.pop, id(plan), None)
            _GRAD_CACHE[id(plan)] = (ref, curv)
        except TypeError:
            pass
    values = plan.parameter_values()
    values.update(params or {})  # parameters not given keep the plan's values
    curv.set_parameters(values)
    return curv.gradients(inputs, targets, weights)
