"""What SGD and Adam share: their update rule's frame (gradient clipping, weight decay, the
new parameters), the metrics their graphs report and their host-side step (one session per
step, hyper-parameters from the settings, no host state of their own).

A first-order optimizer's rule also trains a parameter group inside another optimizer's step
(K-FAC's param_groups, optimizers/groups.py): the rule reads its hyper-parameters through a
name map (`hp`), its own step's names or the group's, and says how to undo its last update
on the host (`previous_parameters`)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler.optimizers.base import FirstOrderStepOptions, Optimizer, mean_loss_and_grads
from kfac_compiler.optimizers.multi_tensor import Chunks, Layout
from kfac_compiler.optimizers.settings import OptimizerConfig, RecipeOptions

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.runtime.trainer import Trainer


CLIP_NORM, DECAY = C.hp("clip_norm"), C.hp("decay")  # a first-order step's clipping and decoupled decay

# the graph input of a rule's hyper-parameter (C.LEARNING_RATE, ...): Emission.hp in the
# optimizer's own step, a group's own names inside another step (optimizers/groups.py)
HpNames = Callable[[str], str]
# a rule: (em, layout, hp) -> update(g, theta) -> {"p": new parameters, "step": the update
# (or its negative, for its norm), "state": {slot kind: new chunks}}, each in layout's chunks;
# declaring its hyper-parameters when made and reading its state slots when called
Rule = Callable[[Any, Layout, HpNames], Callable[[Chunks, Chunks], dict[str, Any]]]


@dataclass
class FirstOrderConfig(OptimizerConfig, RecipeOptions):
    """What SGD's and Adam's settings share. `multi_tensor`: emit the update once over every
    parameter's concatenation (True) or per parameter (False); None: the device's default
    (kfac_compiler.requests.MULTI_TENSOR_DEFAULT: off on the CPU and on CUDA, where ONNX
    Runtime's Concat of many tensors costs more than the launches it saves). `clip_norm` and
    `decoupled_weight_decay` (RecipeOptions): here lr_eff is the step's learning rate before
    Adam's bias correction, torch's AdamW weight_decay; `l2_reg` adds l2_reg theta to the
    gradient instead."""

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


def clip_scale(em: Emission, sum_squares: str, hp: HpNames | None = None) -> str:
    """min(1, hp/clip_norm / ||g||) from ||g||^2: the factor global-norm clipping scales the
    gradient by (torch's clip_grad_norm_; K-FAC's step uses it too)."""
    b, hp = em.b, hp or em.hp
    norm = b.op("Sqrt", [sum_squares])
    return b.op("Min", [b.const(1.0), b.div(hp(CLIP_NORM), b.op("Max", [norm, b.const(1e-30)]))])


def clipped(em: Emission, lay: Layout, grads: Chunks, clip: bool, hp: HpNames | None = None) -> Chunks:
    """The gradient scaled by clip_scale (only emitted with clipping)."""
    if not clip:
        return grads
    scale = clip_scale(em, lay.sum_squares(grads), hp)
    return lay.map(lambda g: {"g": em.b.mul(g, scale)}, g=grads)["g"]


def decayed(em: Emission, lay: Layout, theta: Chunks, decay: bool, hp: HpNames | None = None) -> Chunks:
    """theta - hp/decay theta: decoupled weight decay (only emitted with it)."""
    if not decay:
        return theta
    b = em.b
    keep = b.sub(b.const(1.0), (hp or em.hp)(DECAY))
    return lay.map(lambda p: {"p": b.mul(keep, p)}, p=theta)["p"]


def regularized_chunks(em: Emission, lay: Layout, grads: Chunks, theta: Chunks, l2: bool,
                       hp: HpNames | None = None) -> Chunks:
    """g + l2 * theta in `lay`'s chunks (only emitted with weight decay)."""
    if not l2:
        return grads
    coeff = (hp or em.hp)(C.L2)
    return lay.map(lambda g, p: {"g": em.b.add(g, em.b.mul(coeff, p))}, g=grads, p=theta)["g"]


def emit_rule(em: Emission, lay: Layout, raw: Mapping[str, str], o: FirstOrderStepOptions, rule: Rule,
              hp: HpNames) -> tuple[Chunks, Chunks]:
    """`rule` on `lay`'s parameters with gradients `raw` (clipped, plus l2 theta, as `o` says;
    the parameters decayed first with o.decay): writes the new parameters and the rule's state
    slots; returns (the update or its negative, the raw gradients), both in `lay`'s chunks."""
    update = rule(em, lay, hp)
    theta, g_raw = lay.pack({p: p for p in lay.params}), lay.pack(raw)
    g = regularized_chunks(em, lay, clipped(em, lay, g_raw, o.clip, hp), theta, o.l2, hp)
    new = update(g, decayed(em, lay, theta, o.decay, hp))
    for p, t in lay.unpack(new["p"]).items():
        em.state_output(p, t)
    for kind, chunks in new["state"].items():
        lay.write_state(em, kind, chunks)
    return new["step"], g_raw


def emit_first_order_step(em: Emission, o: FirstOrderStepOptions, rule: Rule) -> None:
    """An optimizer step that is `rule` on every parameter (per parameter or once over their
    concatenation: o.multi_tensor), with the baseline metrics."""
    loss, raw, _ = mean_loss_and_grads(em, accumulate=o.accumulate)
    lay = Layout(em, bool(o.multi_tensor))
    steps, g_raw = emit_rule(em, lay, raw, o, rule, em.hp)
    emit_baseline_metrics(em, loss, lay, steps, g_raw)


def emit_baseline_metrics(em: Emission, loss: str, lay: Layout, steps: Chunks, raw: Chunks) -> None:
    """loss, metric/update_norm, metric/grad_norm and metric/finite of a first-order step
    (`steps`: the update, or its negative; `raw`: the gradients without weight decay, both in
    `lay`'s chunks). The gradient's squared norm is checked too: a finite gradient whose square
    overflows float32 made Adam's v infinite and froze those coordinates for good while its
    update (m / inf = 0) stayed finite."""
    update_sq, grad_sq = lay.sum_squares(steps), lay.sum_squares(raw)
    em.metric(C.LOSS, loss)
    em.metric(C.UPDATE_NORM, em.b.op("Sqrt", [update_sq]))
    em.metric(C.GRAD_NORM, em.b.op("Sqrt", [grad_sq]))
    em.metric(C.FINITE, em.b.cast(em.finite([loss, update_sq, grad_sq]), TensorProto.FLOAT))


class FirstOrderOptimizer(Optimizer):
    """A step is one run of `step_subgraph` with `hyper_parameters()`. `rule` is the update
    (emit_rule's), `state_kinds` the slot kinds it keeps per parameter; both, with
    rule_hyper_parameters and previous_parameters, let the rule train a parameter group of
    another optimizer (optimizers/groups.py)."""

    step_subgraph = ""
    rule: ClassVar[Rule]
    state_kinds: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def rule_hyper_parameters(cls, cfg: Any, t: int, k: int) -> dict[str, float]:
        """The rule's hyper-parameters for its t-th applied update (t >= 1) at step count k
        (the schedules' clock), by their names in the optimizer's own step."""
        raise NotImplementedError

    @classmethod
    def previous_parameters(cls, theta: np.ndarray, state: Mapping[str, np.ndarray],
                            hp: Mapping[str, float]) -> np.ndarray:
        """The parameter before the last update, from its value `theta` after it, the rule's
        state slots after it ({kind: value}) and the hyper-parameters that update used (a
        roll back, float64 on the host)."""
        raise NotImplementedError
    accumulates = True

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self._step_programs: dict[tuple, Any] = {}  # _program's memo

    def _program(self, data: Mapping[str, Any] | None = None):
        """The step's session, memoized on the batch's weighting, the one option it takes from
        the batch (as K-FAC's step_program: the general lookup resolves a request per call),
        and with the trainer's cuda_graphs on the batch's shapes (one session per shape)."""
        tr = self.trainer
        shapes = tr.batch_shapes(data) if tr.cuda_graphs and data is not None else None
        key = (tr.weighted, shapes)
        prog = self._step_programs.get(key)
        if prog is None:
            prog = self._step_programs[key] = tr.program(
                self.step_subgraph, shapes=shapes, l2=self.config.l2_reg > 0, weighted=tr.weighted,
                multi_tensor=getattr(self.config, "multi_tensor", None), accumulate=self.cycle.count > 1,
                **self.config.recipe_options())
        return prog

    def build(self) -> None:
        if not self.trainer.cuda_graphs:  # with them the step's sessions come per batch shape, on first use
            self._program()
        if self.cycle.count > 1:
            self.micro_program()

    def hyper_parameters(self, k: int) -> dict[str, float]:
        """Step k's hyper-parameters (schedules evaluated at k)."""
        return self.rule_hyper_parameters(self.config, self.trainer.applied_steps + 1, k)

    def step(self, data: dict[str, Any]) -> dict[str, float]:
        tr, cfg = self.trainer, self.config
        k = tr.step_count
        tr.store.set_hp(C.L2, cfg.l2_reg)
        out = self._program(data).run(tr.store, data, hp={**self.hyper_parameters(k), **cfg.recipe_hyper_parameters(k)})
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
