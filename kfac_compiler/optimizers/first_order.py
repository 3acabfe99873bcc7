"""What SGD and Adam share: the metrics their graphs report and their host-side step (one
session per step, hyper-parameters from the settings, no host state of their own)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler.optimizers.base import Optimizer
from kfac_compiler.optimizers.multi_tensor import Chunks, Layout
from kfac_compiler.optimizers.settings import OptimizerConfig, RecipeOptions

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.runtime.trainer import Trainer


CLIP_NORM, DECAY = C.hp("clip_norm"), C.hp("decay")  # a first-order step's clipping and decoupled decay


@dataclass
class FirstOrderConfig(OptimizerConfig, RecipeOptions):
    """What SGD's and Adam's settings share. `multi_tensor`: emit the update once over every
    parameter's concatenation (True) or per parameter (False); None: the device's default
    (kfac_compiler.requests.MULTI_TENSOR_DEFAULT: on for CUDA, where each node is a kernel
    launch). `clip_norm` and `decoupled_weight_decay` (RecipeOptions): here lr_eff is the step's
    learning rate before Adam's bias correction, torch's AdamW weight_decay; `l2_reg` adds
    l2_reg theta to the gradient instead."""

    multi_tensor: bool | None = None

    def validate(self) -> None:
        super().validate()
        self.check_recipes()

    def recipe_hyper_parameters(self, k: int) -> dict[str, float]:
        """hp/clip_norm and hp/decay (lr_k w) of step k, where used."""
        hp = {}
        if self.clip_norm is not None:
            hp[CLIP_NORM] = float(self.clip_norm)
        if self.decoupled_weight_decay > 0:
            hp[DECAY] = float(self.at("learning_rate", k)) * self.decoupled_weight_decay
        return hp


def clip_scale(em: Emission, sum_squares: str) -> str:
    """min(1, hp/clip_norm / ||g||) from ||g||^2: the factor global-norm clipping scales the
    gradient by (torch's clip_grad_norm_; K-FAC's step uses it too)."""
    b = em.b
    norm = b.op("Sqrt", [sum_squares])
    return b.op("Min", [b.const(1.0), b.div(em.hp(CLIP_NORM), b.op("Max", [norm, b.const(1e-30)]))])


def clipped(em: Emission, lay: Layout, grads: Chunks, clip: bool) -> Chunks:
    """The gradient scaled by clip_scale (only emitted with clipping)."""
    if not clip:
        return grads
    scale = clip_scale(em, lay.sum_squares(grads))
    return lay.map(lambda g: {"g": em.b.mul(g, scale)}, g=grads)["g"]


def decayed(em: Emission, lay: Layout, theta: Chunks, decay: bool) -> Chunks:
    """theta - hp/decay theta: decoupled weight decay (only emitted with it)."""
    if not decay:
        return theta
    b = em.b
    keep = b.sub(b.const(1.0), em.hp(DECAY))
    return lay.map(lambda p: {"p": b.mul(keep, p)}, p=theta)["p"]


def regularized_chunks(em: Emission, lay: Layout, grads: Chunks, theta: Chunks, l2: bool) -> Chunks:
    """g + l2 * theta in `lay`'s chunks (only emitted with weight decay)."""
    if not l2:
        return grads
    coeff = em.hp(C.L2)
    return lay.map(lambda g, p: {"g": em.b.add(g, em.b.mul(coeff, p))}, g=grads, p=theta)["g"]


def emit_baseline_metrics(em: Emission, loss: str, lay: Layout, steps: Chunks, raw: Chunks) -> None:
    """loss, metric/update_norm, metric/grad_norm and metric/finite of a first-order step
    (`steps`: the update, or its negative; `raw`: the gradients without weight decay, both in
    `lay`'s chunks)."""
    update_sq = lay.sum_squares(steps)
    em.metric(C.LOSS, loss)
    em.metric(C.UPDATE_NORM, em.b.op("Sqrt", [update_sq]))
    em.metric(C.GRAD_NORM, em.b.op("Sqrt", [lay.sum_squares(raw)]))
    em.metric(C.FINITE, em.b.cast(em.finite([loss, update_sq]), TensorProto.FLOAT))


class FirstOrderOptimizer(Optimizer):
    """A step is one run of `step_subgraph` with `hyper_parameters()`."""

    step_subgraph = ""
    accumulates = True

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self._step_programs: dict[bool, Any] = {}  # _program's memo

    def _program(self):
        """The step's session, memoized on the batch's weighting, the one option it takes from
        the batch (as K-FAC's step_program: the general lookup resolves a request per call)."""
        weighted = self.trainer.weighted
        if weighted not in self._step_programs:
            self._step_programs[weighted] = self.trainer.program(
                self.step_subgraph, l2=self.config.l2_reg > 0, weighted=weighted,
                multi_tensor=getattr(self.config, "multi_tensor", None), accumulate=self.cycle.count > 1,
                **self.config.recipe_options())
        return self._step_programs[weighted]

    def build(self) -> None:
        self._program()
        if self.cycle.count > 1:
            self.micro_program()

    def hyper_parameters(self, k: int) -> dict[str, float]:
        """Step k's hyper-parameters (schedules evaluated at k)."""
        raise NotImplementedError

    def step(self, data: dict[str, Any]) -> dict[str, float]:
        tr, cfg = self.trainer, self.config
        k = tr.step_count
        tr.store.set_hp(C.L2, cfg.l2_reg)
        out = self._program().run(tr.store, data, hp={**self.hyper_parameters(k), **cfg.recipe_hyper_parameters(k)})
        ok = out.get(C.FINITE, 1.0) > 0.5
        m = {
            "step": float(k),
            "loss": out[C.LOSS],
            "learning_rate": float(cfg.at("learning_rate", k)),  # Adam: before its bias correction
            "momentum": float(cfg.at("momentum", k)),
            "update_norm": out.get(C.UPDATE_NORM, float("nan")) if ok else 0.0,
            "grad_norm": out.get(C.GRAD_NORM, float("nan")),
            "rejected": 0.0 if ok else 1.0,
            **C.loss_metrics(out),
        }
        tr.step_count += 1
        if ok:
            tr.applied_steps += 1
        return m
