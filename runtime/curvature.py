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

TF K-FAC's estimator surface (docs/runtime.md, "The lower-level API"): multiply_matpower /
multiply_all (exps), compute_cholesky / compute_cholesky_inverse with multiply_cholesky /
multiply_cholesky_inverse, compute_params_stats. Safeguards: a batch whose statistics are
not finite is skipped (`report["skipped_updates"]`), a block whose inverse fails keeps its
previous one (`report["failed_blocks"]`), every damping given (inverses and products alike)
is floored relative to the factors' scale (`damping_floor`), and precondition refuses
non-finite gradients and results.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler import linalg
from kfac_compiler.contract import estimation_mode
from kfac_compiler.errors import ConfigError, DataError, DivergedError
from kfac_compiler.host_blocks import host_blocks
from kfac_compiler.linalg import concrete_method
from kfac_compiler.optimizers import ema_coefficient
from kfac_compiler.parsing import check_bool, check_float, check_int
from kfac_compiler.plan import Plan
from kfac_compiler.requests import MAX_NUM_SAMPLES, NUM_SAMPLES_WHY, Request
from kfac_compiler.runtime.data import BatchChecker, draw_noise, parameter_vectors
from kfac_compiler.runtime.device import get_device
from kfac_compiler.runtime.inverses import InverseRefresher
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
                 threads: int | None = None, damping_floor: float = 1e-6) -> None:
        if not isinstance(plan, Plan):
            raise ConfigError(f"Curvature takes a compiled plan (kfac_compiler.compile or load_plan), got "
                              f"{type(plan).__name__}")
        self.plan = plan
        # every damping given (update_inverses, multiply*, compute_cholesky*) becomes
        # max(damping, damping_floor * s), s the largest block scale
        # (block_scales): every damped Kronecker factor keeps its smallest eigenvalue at least
        # sqrt(damping_floor) times its mean one (cond <= n / sqrt(damping_floor)); 0 turns it off
        self.damping_floor = check_float(damping_floor, "damping_floor")
        if self.damping_floor < 0:
            raise ConfigError(f"damping_floor must be >= 0, got {damping_floor!r}")
        self.device = get_device(device)
        self.threads = None if threads is None else check_int(threads, "threads", low=1)
        self.mode = estimation_mode(plan.estimator.mode if mode is None else mode)
        self.num_samples = _sample_count(plan.estimator.num_samples if num_samples is None else num_samples)
        self.ema_decay = check_float(ema_decay if ema_decay is not None else plan.schedule.ema_decay, "ema_decay")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")
        self.inverse_method = concrete_method(plan.inverse.method if inverse_method is None else inverse_method,
                                              self.device.name)
        self.rng = np.random.default_rng(check_int(seed, "seed", low=0))
        self.store = StateStore(self.device)
        self.params = list(plan.trainable)
        for p, v in plan.parameter_values().items():
            self.store.add(p, v)
        self.ema_weight = 0.0
        self.damping: float | None = None
        self._programs: dict[Request, Program] = {}
        self._blocks: dict[str, Any] | None = None
        self._inverses: InverseRefresher | None = None
        self._check_batch = BatchChecker(plan)
        self.input_specs = self._check_batch.input_specs
        self._cholesky: dict[str, dict[str, dict[str, np.ndarray]]] = {}  # kind -> layer -> {part: L}
        # what the safeguards did: skipped updates, blocks that kept their state, damping used
        self.report: dict[str, Any] = {"skipped_updates": 0, "last_update_ok": None, "failed_blocks": [],
                                       "damping_used": None, "damping_floored": False,
                                       "product_damping_used": None}

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
        out = self.program(C.GRADIENTS, weighted=C.EXAMPLE_WEIGHTS in data).run(self.store, data, results=True)
        return out[C.LOSS], {p: out[C.grad(p)] for p in self.params}

    def estimate(self, inputs: Mapping[str, Any], targets: Any, mode: str | None = None,
                 num_samples: int | None = None, weights: Any = None) -> dict[str, dict[str, np.ndarray]]:
        """One batch's curvature factors per layer (no moving average); `weights`: optional
        loss weights or mask, per example or per position (Trainer.step's): the output
        factors G become 1/N sum w ..., and masked positions leave the input factors A."""
        mode = estimation_mode(mode or self.mode)
        num_samples = self.num_samples if num_samples is None else _sample_count(num_samples)
        data = self._check_batch(inputs, targets, weights)
        prog = self.program(C.STATISTICS, mode=mode, num_samples=num_samples,
                            weighted=C.EXAMPLE_WEIGHTS in data)
        data.update(draw_noise(self.rng, prog.info, prog.data_inputs, data[C.TARGETS], prog.name))
        out = prog.run(self.store, data, results=True)
        self.last_loss = out[C.LOSS]
        return _group_stats(out)

    def update(self, inputs: Mapping[str, Any], targets: Any, weights: Any = None) -> float:
        """Fold one batch into the zero-debiased moving averages; returns the batch loss.
        `weights` as estimate's."""
        data = self._check_batch(inputs, targets, weights)
        prog = self.program(C.UPDATE_STATISTICS, mode=self.mode, num_samples=self.num_samples,
                            weighted=C.EXAMPLE_WEIGHTS in data)
        data.update(draw_noise(self.rng, prog.info, prog.data_inputs, data[C.TARGETS], prog.name))
        coeff, w = ema_coefficient(self.ema_weight, self.ema_decay)
        out = prog.run(self.store, data, hp={C.EMA_COEFF: coeff})
        ok = out.get(C.FINITE, 1.0) > 0.5  # not ok: the graph kept the averages (state not flipped)
        if ok:
            self.ema_weight = w
        else:
            self.report["skipped_updates"] += 1
        self.report["last_update_ok"] = bool(ok)
        return out[C.LOSS]

    def factors(self) -> dict[str, dict[str, np.ndarray]]:
        """The current moving averages per layer."""
        self.program(C.UPDATE_STATISTICS, mode=self.mode, num_samples=self.num_samples)
        return self._layer_state(C.FACTOR)

    def inverses(self) -> dict[str, dict[str, np.ndarray]]:
        return self._layer_state(C.INVERSE)

    def _layer_state(self, kind: str) -> dict[str, dict[str, np.ndarray]]:
        return {layer: {item: self.store.to_numpy(s) for item, s in slots.items()}
                for layer, slots in C.layer_slots(self.store.slots(), kind).items()}

    def block_scales(self) -> dict[str, float]:
        """Each block's curvature scale: the mean eigenvalue of its undamped approximation
        (Kronecker: (tr A / dim A)(tr G / dim G); diagonal: the mean; full: tr / dim), the
        largest over conv groups and a direct sum's blocks (the block's np_scale); blocks with
        non-finite factors are left out."""
        factors = {layer: {f: self.store.read_only(s) for f, s in slots.items()}
                   for layer, slots in C.layer_slots(self.store.slots(), C.FACTOR).items()}
        out = {}
        for layer, block in self.blocks().items():
            if not hasattr(block, "np_scale") or layer not in factors:
                continue
            scale = block.np_scale(factors[layer])  # the block owns its structure's scale
            if np.isfinite(scale):
                out[layer] = scale
        return out

    def floored_damping(self, damping: float) -> float:
        """max(damping, damping_floor * the largest block scale) (see __init__)."""
        scales = self.block_scales() if self.damping_floor > 0 else {}
        return max(float(damping), self.damping_floor * max(scales.values(), default=0.0))

    def update_inverses(self, damping: float) -> bool:
        """Recompute the damped inverses of the moving averages with the floored damping
        (`report["damping_used"]`); False if a block failed: it keeps its previous inverse and
        `report["failed_blocks"]` names it."""
        damping = check_float(damping, "damping", positive=True)
        self._require_averages("update_inverses")
        if self._inverses is None:
            self._inverses = InverseRefresher(self.plan, self.program(C.INVERSE_UPDATE, method=self.inverse_method),
                                              self.program(C.PRECONDITION), self.inverse_method)
        used = self.floored_damping(damping)
        ok = self._inverses(self.store, used)
        self.damping = used
        self.report.update(failed_blocks=list(self._inverses.failed), damping_used=used,
                           damping_floored=used > float(damping))
        return ok

    def precondition(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """(F + damping)^-1 g with the inverses of the last update_inverses()."""
        if self.damping is None:
            raise ConfigError("call update_inverses(damping) before precondition()")
        vectors = _finite(parameter_vectors(self._shapes(self.params), grads, "precondition"), "precondition")
        prog = self.program(C.PRECONDITION)
        data = {C.vec(p): v for p, v in vectors.items()}
        out = prog.run(self.store, data, results=True)
        result = {p: out[C.precond(p)] for p in self.params}
        self._check_result(result, "precondition")
        return result

    def _check_result(self, vectors: Mapping[str, np.ndarray], what: str,
                      remedy: str = "raise the damping or lower the learning rate") -> None:
        """DivergedError naming the first layer whose product is not finite."""
        for layer, block in self.blocks().items():
            for p in block.layer.params:
                if p in vectors and not np.all(np.isfinite(vectors[p])):
                    raise DivergedError(
                        f"{what}: the product of layer {layer!r} is not finite (its factors or state overflow "
                        f"float32): {remedy}"
                    )

    def _require_averages(self, what: str) -> None:
        """ConfigError unless a batch has been folded into the moving averages: before one
        they are zeros, and a product or inverse of them is the damping alone, not curvature."""
        if self.ema_weight == 0.0:
            skipped = self.report["skipped_updates"]
            why = (f"every update so far ({skipped}) was skipped for non-finite statistics" if skipped
                   else "no batch has been folded into the moving averages")
            raise ConfigError(f"{what}: {why}; call update(inputs, targets) first")

    # ---------------------------------------------------------------- per block (host)
    def blocks(self) -> dict[str, Any]:
        if self._blocks is None:
            self._blocks = host_blocks(self.plan)
        return self._blocks

    def _block(self, layer: str):
        blocks = self.blocks()
        if layer not in blocks:
            raise ConfigError(f"unknown layer {layer!r}; the plan's layers are {list(blocks)}")
        return blocks[layer]

    def _shapes(self, params) -> dict[str, tuple[int, ...]]:
        return {p: self.store.spec(p)[0] for p in params}

    def _layer_vectors(self, layer: str, vectors: Any, what: str) -> dict[str, np.ndarray]:
        return _finite(parameter_vectors(self._shapes(self._block(layer).layer.params), vectors, f"{what}({layer!r})"),
                       f"{what}({layer!r})")

    def _damping(self, damping: float | None) -> float:
        """The damping a product uses: `damping` floored like update_inverses' (so that
        multiply_all(v, d, -1) is precondition(v) after update_inverses(d)), recorded in
        `report["product_damping_used"]`; None: the last update_inverses' (already floored), 0
        before it."""
        if damping is None:
            used = float(self.damping or 0.0)
        else:
            d = check_float(damping, "damping")
            if d < 0:
                raise ConfigError(f"damping must be >= 0, got {damping!r}")
            used = self.floored_damping(d)
        self.report["product_damping_used"] = used
        return used

    def multiply(self, layer: str, vectors: Mapping[str, np.ndarray], damping: float | None = None) -> dict[str, np.ndarray]:
        """(F_layer + damping) v with the layer's moving-average factors (numpy twin)."""
        v = self._layer_vectors(layer, vectors, "multiply")
        self._require_averages("multiply")
        return self._block(layer).numpy_multiply(v, self.factors().get(layer, {}), self._damping(damping),
                                                 self._layer_params(layer))

    def multiply_all(self, vectors: Mapping[str, np.ndarray], damping: float | None = None,
                     exp: float = 1) -> dict[str, np.ndarray]:
        """(F + damping)^exp v for every parameter, in the `multiply` subgraph on the device,
        from the moving-average factors: integer and half-integer exps (TF K-FAC's exps;
        -1/2, 1/2, -3/2 by an emitted matrix square root). A layer whose emitted square root
        failed its check is redone on the host (multiply_matpower); other exps, and |exp| above
        MAX_DEVICE_EXP (the graph chains |exp| - 1 products): ConfigError naming
        multiply_matpower. A product that overflows float32: DivergedError naming the layer."""
        exp = check_float(exp, "exp")
        if not linalg.is_half_integer(exp) or abs(exp) > MAX_DEVICE_EXP:
            why = (f"|exp| {abs(exp):g} is above {MAX_DEVICE_EXP} (the graph chains |exp| - 1 products)"
                   if linalg.is_half_integer(exp) else f"exp {exp:g} is neither an integer nor a half-integer")
            raise ConfigError(f"multiply_all: {why}; use multiply_matpower(layer, vectors, exp) "
                              "(host eigendecomposition in float64)")
        v = _finite(parameter_vectors(self._shapes(self.params), vectors, "multiply_all"), "multiply_all")
        self._require_averages("multiply_all")
        d = self._damping(damping)
        prog = self.program(C.MULTIPLY, exp=int(exp) if exp.is_integer() else exp)
        out = prog.run(self.store, {C.vec(p): a for p, a in v.items()}, hp={C.DAMPING: d}, results=True)
        result = {p: out[C.product(p)] for p in self.params}
        if not exp.is_integer():  # the host fallback for a square root beyond its accuracy bound
            for layer, block in self.blocks().items():
                mine = block.layer.params
                if not all(np.all(np.isfinite(result[p])) for p in mine):
                    host = self.multiply_matpower(layer, {p: v[p] for p in mine}, exp, d)
                    result.update({p: np.asarray(host[p], np.float32) for p in mine})
        self._check_result(result, f"multiply_all(exp={exp:g})",
                           "use multiply_matpower(layer, vectors, exp) (float64 on the host) or a larger damping")
        return result

    def multiply_matpower(self, layer: str, vectors: Mapping[str, np.ndarray], exp: float,
                          damping: float | None = None) -> dict[str, np.ndarray]:
        """(F_layer + damping)^exp v for any real exp (TF K-FAC's exps), via the block's
        host-side eigendecomposition (numpy twin)."""
        v = self._layer_vectors(layer, vectors, "multiply_matpower")
        self._require_averages("multiply_matpower")
        return self._block(layer).numpy_multiply_matpower(v, self.factors().get(layer, {}), self._damping(damping),
                                                          check_float(exp, "exp"), self._layer_params(layer))

    # ---------------------------------------------------------------- Cholesky (TF K-FAC's names)
    def compute_cholesky(self, damping: float | None = None) -> None:
        """L with F + damping = L L^T per block, from the moving averages (host, float64):
        a Kronecker block's L = L_A (x) L_G of its pi-split damped factors, a diagonal
        block's sqrt(diag + damping), a full block's numpy Cholesky. For
        multiply_cholesky."""
        self._cholesky["L"] = self._cholesky_parts(damping, inverse=False)

    def compute_cholesky_inverse(self, damping: float | None = None) -> None:
        """L^-1 per block (see compute_cholesky), for multiply_cholesky_inverse."""
        self._cholesky["L_inv"] = self._cholesky_parts(damping, inverse=True)

    def _cholesky_parts(self, damping: float | None, inverse: bool) -> dict[str, dict[str, np.ndarray]]:
        self._require_averages("compute_cholesky_inverse" if inverse else "compute_cholesky")
        d = self._damping(damping)
        factors = self.factors()
        out = {}
        for layer, block in self.blocks().items():
            if not hasattr(block, "np_cholesky_parts"):
                raise ConfigError(f"layer {layer!r}: the {block.name!r} block has no Cholesky factor; "
                                  "use multiply_matpower(layer, v, 0.5) for a symmetric square root")
            out[layer] = block.np_cholesky_parts(factors.get(layer, {}), d, inverse)
        return out

    def multiply_cholesky(self, vectors: Mapping[str, np.ndarray], transpose: bool = False) -> dict[str, np.ndarray]:
        """L v (L^T v with transpose) for every parameter, L from compute_cholesky."""
        return self._multiply_cholesky("L", vectors, transpose, "multiply_cholesky")

    def multiply_cholesky_inverse(self, vectors: Mapping[str, np.ndarray],
                                  transpose: bool = False) -> dict[str, np.ndarray]:
        """L^-1 v (L^-T v with transpose; L^-T L^-1 = (F + damping)^-1), from
        compute_cholesky_inverse."""
        return self._multiply_cholesky("L_inv", vectors, transpose, "multiply_cholesky_inverse")

    def _multiply_cholesky(self, kind: str, vectors, transpose: bool, what: str) -> dict[str, np.ndarray]:
        if kind not in self._cholesky:
            call = "compute_cholesky" if kind == "L" else "compute_cholesky_inverse"
            raise ConfigError(f"call {call}() before {what}()")
        v = _finite(parameter_vectors(self._shapes(self.params), vectors, what), what)
        flip = check_bool(transpose, f"{what}: transpose")  # "no" is not True
        out: dict[str, np.ndarray] = {}
        for layer, block in self.blocks().items():
            mine = {p: v[p] for p in block.layer.params}
            out.update(block.np_multiply_cholesky(mine, self._cholesky[kind][layer], flip))
        return out

    def compute_params_stats(self, inputs: Mapping[str, Any], targets: Any,
                             weights: Any = None) -> dict[str, np.ndarray]:
        """TF K-FAC's params_stats: the first-order version of the Fisher statistics, the
        parameters' mean gradient at the estimator's targets (TF: 'When estimation_mode is
        empirical, this will correspond to the standard parameter gradient on the loss').
        Defined here for mode "empirical"; the sampled modes raise ConfigError."""
        if self.mode != "empirical":
            raise ConfigError(f"compute_params_stats: defined for mode 'empirical' (the batch gradient); this "
                              f"Curvature estimates with mode {self.mode!r}")
        return self.gradients(inputs, targets, weights)[1]

    def multiply_inverse(self, layer: str, vectors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """(F_layer + damping)^-1 v with the layer's current inverse state (numpy twin)."""
        if self.damping is None:
            raise ConfigError("call update_inverses(damping) before multiply_inverse()")
        v = self._layer_vectors(layer, vectors, "multiply_inverse")
        return self._block(layer).numpy_multiply_inverse(v, self.inverses().get(layer, {}), self._layer_params(layer))

    def _layer_params(self, layer: str) -> dict[str, np.ndarray] | None:
        """The layer's current parameter values, for blocks whose products read them (reads_params)."""
        block = self._block(layer)
        return {p: self.store.to_numpy(p) for p in block.layer.params} if block.reads_params else None


# multiply_all's largest |exp| on the device: TF K-FAC's exps are -1, 1, 2 and the half-integers
# between; a larger power chains |exp| - 1 products in float32 (exp=40 overflows), where the
# host's float64 eigendecomposition (multiply_matpower) costs one eigh whatever the exp
MAX_DEVICE_EXP = 8


def _sample_count(value: Any) -> int:
    """A num_samples given to Curvature or estimate: an integer in [1, MAX_NUM_SAMPLES]."""
    n = check_int(value, "num_samples", low=1)
    if n > MAX_NUM_SAMPLES:
        raise ConfigError(f"num_samples must be at most {MAX_NUM_SAMPLES} ({NUM_SAMPLES_WHY}), got {value!r}")
    return n


def _finite(vectors: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """`vectors`, or DataError naming the first parameter whose vector holds NaN/Inf."""
    for p, a in vectors.items():
        if not np.all(np.isfinite(a)):
            raise DataError(f"{what}: the vector for {p!r} holds {int(np.sum(~np.isfinite(a)))} NaN/Inf value(s) "
                            "(a diverged loss? lower the learning rate)")
    return vectors


# --------------------------------------------------------------------------- gradients()
_GRAD_CACHE: dict[int, tuple[Any, Curvature]] = {}


def gradients(plan: Plan, inputs: Mapping[str, Any], targets: Any, params: Mapping[str, np.ndarray] | None = None,
              device: str = "cpu", weights: Any = None) -> tuple[float, dict[str, np.ndarray]]:
    """(mean loss, {initializer name: gradient}) at the plan's weights (or `params`);
    `weights`: optional per-example loss weights or mask."""
    if not isinstance(plan, Plan):
        raise ConfigError(f"gradients: expected a compiled plan (kfac_compiler.compile or load_plan), got "
                          f"{type(plan).__name__}")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"gradients: params must be a dict {{parameter name: array}}, got {type(params).__name__}")
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
