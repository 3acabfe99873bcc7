"""The `kfac_step` graph, as three stages with explicit reduction points.

    local          the loss and gradients of this batch, and this batch's factor statistics
                   folded into the moving averages (on statistics steps)
      -- reduce: the gradients, the loss and the factor statistics (means over the batch)
    precondition   P = (F + damping)^-1 g from the inverses, the dot products of g, P and the
                   velocity v, and the quadratic model's terms: curvature products along P and
                   v from forward-mode JVPs on the (sub-)batch, with its gradient terms
      -- reduce: the quadratic model's terms (means over the batch)
    update         (alpha, mu) from the 2x2 model (or the fixed learning rate and momentum),
                   the update alpha P + mu v, new parameters and velocity, the same batch's
                   loss at the new parameters for damping adaptation (and rejection), the
                   metrics
      -- reduce: the loss at the new parameters, before the rejection test reads it

Each reduction point is an `em.reduce_mean(point, values)` call where the values are made:
one process runs the stages fused in one graph and the call returns the values; everything a
stage reads from an earlier one is a mean over the examples, so a data-parallel step
all-reduces (averages) them there, as STAGES lists, and every rank computes the same update
and the same accept/reject decision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import groups
from kfac_compiler.optimizers.base import (
    GRADIENTS_POINT,
    LOSS_POINT,
    Gram,
    local_loss_and_grads,
    reduced_loss_and_grads,
)
from kfac_compiler.optimizers.first_order import clip_scale, regularized_chunks
from kfac_compiler.optimizers.groups import GroupSpec
from kfac_compiler.optimizers.kfac.curvature import curvature_dots
from kfac_compiler.optimizers.kfac.settings import MOMENTUM_TYPES, QMODEL_TYPES
from kfac_compiler.optimizers.multi_tensor import Chunks, Layout
from kfac_compiler.requests import SubgraphKind, SubgraphOptions

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.backend.forward import ForwardPass

FLOAT = TensorProto.FLOAT

# kfac_step's own hyper-parameters and metrics (the policy binds and reads these names; the
# shared ones, C.DAMPING, C.L2, ..., are the contract's)
NORM_CONSTRAINT = C.hp("norm_constraint")      # KL clipping (without the quadratic model)
MAX_MOMENTUM = C.hp("max_momentum")            # |mu| cap of the quadratic model
MAX_PREDICTED_DECREASE = C.hp("max_predicted_decrease")
WANT_LOSS_AFTER = C.hp("loss_after")           # > 0: report LOSS_AFTER this step
REJECT_INCREASE = C.hp("reject_increase")      # > 0: reject a step that raises the objective
LOSS_LIMIT = C.hp("loss_limit")                # the step is withheld when its loss exceeds this
ALPHA, MU = C.metric("alpha"), C.metric("mu")  # the step's update is -alpha P + mu v
QMODEL_CHANGE = C.metric("qmodel_change")      # the quadratic model's predicted change
UPDATE_SCALE = C.metric("update_scale")
LOSS_AFTER = C.metric("loss_after")            # the batch's loss at the new parameters
DECOUPLED_DECAY = C.hp("decoupled_weight_decay")  # w: theta <- (1 - alpha w) theta + update
CURVATURE_SCALE = C.hp("qmodel_curvature_scale")  # c: the quadratic model's C times c (plateau.py)


@dataclass(frozen=True)
class Stage:
    """One stage of the step and the reduction points (Emission.reduce_mean) at its end: what
    a data-parallel run averages over the ranks before the next stage reads it."""

    name: str
    computes: str
    reduces: tuple[str, ...]


MODEL_POINT, LOSS_AFTER_POINT = "quadratic model terms", "loss after the update"
STAGES = (
    Stage("local", "loss, gradients and this batch's factor statistics",
          (LOSS_POINT, GRADIENTS_POINT, C.STATISTICS_TERMS_POINT, C.FACTOR_STATISTICS_POINT,
           C.STATE_STATISTICS_POINT)),
    Stage("precondition", "P = (F + damping)^-1 g, dot products, the quadratic model's terms", (MODEL_POINT,)),
    Stage("update", "(alpha, mu), the update, new parameters and velocity, the loss after it, metrics",
          (LOSS_AFTER_POINT,)),
)


@dataclass
class Local:
    """What the local stage hands on: the loss, the raw gradients of every parameter (a
    parameter group's included: the groups' rules read theirs), `vectors` over K-FAC's own
    parameters in the step Layout's chunks ("raw", "g" the gradient clipped and with weight
    decay, "t" theta) and the finiteness terms gathered so far. With clipping, `scale` (s, the
    gradient's factor) and `raw_sq` (|raw|^2, its norm before clipping); with accumulation,
    `batch_grads`: this micro-batch's own raw gradient (local), which the quadratic model's
    linear terms use."""

    loss: str
    raw_grads: dict[str, str]
    vectors: dict[str, Chunks]
    ok_terms: list[str]
    scale: str | None = None
    raw_sq: str | None = None
    batch_grads: dict[str, str] | None = None


@dataclass
class QuadraticModel:
    """m(a, mu) = a b1 + mu b2 + 1/2 [a mu] C [a mu]^T with C = [[c11, c12], [c12, c22]]
    (damped GGN products along P and v on the model's batch); b1, b2 the gradient terms on
    that batch, whole_b1, whole_b2 those of the whole batch (the change damping adaptation
    compares with)."""

    c11: str
    c12: str
    c22: str
    b1: str
    b2: str
    whole_b1: str
    whole_b2: str


@dataclass
class Preconditioned:
    """The vectors in the step Layout's chunks (Local.vectors', "P" of g, or of m with adam
    momentum, "v" the last update, "m" adam momentum's new gradient sum, "k" with
    accumulation), their dot products and the model."""

    vectors: dict[str, Chunks]
    dots: Gram
    model: QuadraticModel | None
    linear: tuple[str, str] | None = None  # (o.P, o.v), o the objective's gradient the predicted change uses


@dataclass(frozen=True)
class KfacStepOptions(SubgraphOptions):
    """The options of `kfac_step` (docs/runtime_contract.md). with_stats: the step folds this
    batch's factor statistics into the moving averages on its first stats_batch examples
    (None: all), inside an If on hp/update_stats with stats_if; qmodel: (a, mu) from the 2x2
    quadratic model, whose curvature products run on the first qmodel_batch examples, else
    from hp/learning_rate and hp/momentum; momentum_type (TF K-FAC's; None: "qmodel" with
    qmodel, else "regular"); l2: weight decay; loss_after: metric/loss_after, the batch's loss
    at the new parameters when hp/loss_after > 0 (inside an If on it; loss_after_if False: on
    every run of this graph, which then has no hp/loss_after: the If-free adaptation step the
    host picks, KfacConfig.static_steps); precon_power: the power the inverse slots
    hold (adam momentum's predicted change is quadratic only at -1); loss_limit: the step is
    withheld (metric/finite 0) when the batch's loss exceeds hp/loss_limit (the spike guard:
    the host then tests the last update on this batch, docs/runtime.md "Safeguards"); clip:
    the gradient scaled to a global norm of at most hp/clip_norm; decay: decoupled weight
    decay, theta <- (1 - alpha hp/decoupled_weight_decay) theta + update; accumulate: the
    batch is an accumulation cycle's last micro-batch, the gradient the cycle's mean
    (optimizers/accumulate.py), while the loss, the quadratic model and loss_after are this
    micro-batch's; multi_tensor: the gradient's clipping and l2 term, the update, the new
    parameters and the velocity once over the concatenation of every K-FAC parameter
    (optimizers/multi_tensor.py; velocity/* and grad_velocity/* one flat slot each; None:
    the device's default, filled by resolve), the preconditioning and the quadratic model's
    JVPs per parameter as before; curvature_scale: the quadratic model's GGN
    products times hp/qmodel_curvature_scale (KfacConfig.qmodel_curvature_scale, which the
    host may adapt between steps: optimizers/kfac/plateau.py)."""

    resolved: ClassVar[tuple[str, ...]] = SubgraphOptions.resolved + ("mode", "num_samples", "multi_tensor")

    with_stats: bool = True
    stats_if: bool = False
    qmodel: bool = True
    mode: str | None = None
    num_samples: int | None = None
    l2: bool = False
    stats_batch: int | None = None
    loss_after: bool = False
    loss_after_if: bool = True
    qmodel_batch: int | None = None
    momentum_type: str | None = None
    precon_power: float = -1.0
    loss_limit: bool = False
    # first-order parameter groups ((name, optimizer, params, flags), ...; optimizers/groups.py):
    # held out of the curvature, updated by their optimizer's rule in this graph
    groups: tuple[GroupSpec, ...] = ()
    clip: bool = False
    decay: bool = False
    accumulate: bool = False
    multi_tensor: bool | None = None
    curvature_scale: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.curvature_scale, bool):  # a float until the plateau rule made c an hp
            raise ConfigError(f"kfac_step's option curvature_scale is a bool (read hp/qmodel_curvature_scale), got "
                            f"{self.curvature_scale!r}: set c through the hp, KfacConfig.qmodel_curvature_scale")


def emit_kfac_step(em: Emission, o: KfacStepOptions) -> None:
    """One K-FAC step. The update is a * P + mu * v with P = (F + damping)^-1 g the
    preconditioned gradient and v the previous update (velocity); a, mu come from the 2x2
    quadratic model (qmodel) or from hp/learning_rate, hp/momentum (a = -lr), whose curvature
    products run on the first qmodel_batch examples (None: all). momentum_type
    "qmodel_fixedmu" takes mu = hp/momentum and a from the model; "adam" accumulates
    m <- mu m + g in `grad_velocity/<p>` and preconditions m instead of g (the update
    -lr (F + damping)^-1 m, no mu v term). loss_after's loss is NaN when hp/loss_after is 0."""
    qmodel, l2 = o.qmodel, o.l2
    mode = o.mode or em.parts.mode
    num_samples = o.num_samples or em.parts.num_samples
    kind = o.momentum_type or ("qmodel" if qmodel else "regular")
    if kind not in MOMENTUM_TYPES or (kind in QMODEL_TYPES) != bool(qmodel):
        raise ValueError(f"kfac_step: momentum_type {kind!r} does not go with qmodel={qmodel}")
    groups.hold(em, o.groups)
    lay = Layout(em, bool(o.multi_tensor))  # K-FAC's own parameters (the groups' keep their layout)
    local = local_stage(em, lay, o.with_stats, o.stats_if, mode, num_samples, l2, o.stats_batch, clip=o.clip,
                        accumulate=o.accumulate)
    local.ok_terms += groups.emit_updates(em, o.groups, local.raw_grads)
    pre = precondition_stage(em, lay, local, qmodel, l2, o.qmodel_batch, adam=kind == "adam",
                             curvature_scale=o.curvature_scale)
    update_stage(em, lay, local, pre, l2, o.loss_after, fixed_mu=kind == "qmodel_fixedmu", power=o.precon_power,
                 loss_limit=o.loss_limit, decay=o.decay, loss_after_if=o.loss_after_if)


# --------------------------------------------------------------------------- stage 1: local
def local_stage(em: Emission, lay: Layout, with_stats: bool, stats_if: bool, mode: str, num_samples: int,
                l2: bool, stats_batch: int | None, clip: bool = False, accumulate: bool = False) -> Local:
    """Loss, gradients (clipped with `clip`, + l2 theta, in `lay`'s chunks: once over the
    concatenation in the multi-tensor layout), and with_stats the factors' moving-average
    updates from this batch's statistics on its first stats_batch examples (inside an If on
    hp/update_stats with stats_if). With `accumulate` the gradients are the accumulation
    cycle's mean (the loss and statistics this micro-batch's)."""
    b = em.b
    reuse = with_stats and mode == "empirical" and stats_batch is None
    loss, own, cots = local_loss_and_grads(em, em.layer_cotangent_targets() if reuse else [])
    loss, raw_grads = reduced_loss_and_grads(em, loss, own, accumulate)
    scale = raw_sq = None
    vectors = {"raw": lay.pack(raw_grads), "t": lay.pack({p: p for p in lay.params})}
    g = vectors["raw"]
    if clip:  # torch's clip_grad_norm_, on the (reduced, accumulated) gradient before l2's term
        raw_sq = lay.sum_squares(g)
        scale = clip_scale(em, raw_sq)
        g = lay.map(lambda x: {"g": b.mul(x, scale)}, x=g)["g"]
    vectors["g"] = regularized_chunks(em, lay, g, vectors["t"], l2)
    ok_terms = [loss]
    if with_stats:
        em.factor_updates(em.sub_batch_pass(stats_batch), cots, mode, num_samples, ok_terms, conditional=stats_if)
    return Local(loss, raw_grads, vectors, ok_terms, scale, raw_sq, own if accumulate else None)


# --------------------------------------------------------------------------- stage 2: precondition
def precondition_stage(em: Emission, lay: Layout, local: Local, qmodel: bool, l2: bool,
                       qmodel_batch: int | None, adam: bool = False, curvature_scale: bool = False) -> Preconditioned:
    """P, the velocity, their dot products with g, and with qmodel the quadratic model's
    terms on the first qmodel_batch examples (equal to stats_batch, the forward clone is
    shared). With `adam` (TF K-FAC's momentum_type) P preconditions m <- hp/momentum m + g
    (the objective's gradient, l2 included; state grad_velocity) instead. The velocity and m
    are `lay`'s state slots and the dot products one stacked Gram of its chunks (Layout.stack);
    P is per block, so per parameter (packed once), as are the JVPs' tangents."""
    b, vectors = em.b, dict(local.vectors)
    if adam:
        mu = em.hp(C.MOMENTUM)
        vectors["m"] = lay.map(lambda m, g: {"m": b.add(b.mul(mu, m), g)},
                               m=lay.state(em, C.GRAD_VELOCITY), g=vectors["g"])["m"]
    precond = em.precondition(lay.unpack(vectors["m" if adam else "g"]))
    vectors["P"] = lay.pack(precond)
    vectors["v"] = lay.state(em, C.VELOCITY)
    if local.batch_grads is not None:
        vectors["k"] = lay.pack(local.batch_grads)  # this micro-batch's own gradient
    # every product of g, P and v is read (the model, the update's norm, the metrics), and
    # of those that the options add: one stacked Gram for all of them
    stacked = ["g", "P", "v"] + [k for k, on in (("m", adam), ("k", local.batch_grads is not None),
                                                 ("raw", local.scale is not None or l2), ("t", l2)) if on]
    dots = Gram(em, vectors, lay, stacked=stacked)
    if local.raw_sq is not None:
        dots.known("raw", "raw", local.raw_sq)
    linear = predicted_linear_terms(em, local, dots, l2)
    model = None
    if qmodel:
        damping = em.hp(C.DAMPING)
        if l2:
            damping = b.add(damping, em.hp(C.L2))
        model = em.reduce_mean(MODEL_POINT, quadratic_model(em, em.sub_batch_pass(qmodel_batch), precond,
                                                             lay.unpack(vectors["v"]), dots, damping, l2, linear,
                                                             local.scale,
                                                             "k" if local.batch_grads is not None else None,
                                                             curvature_scale))
    elif local.batch_grads is not None:  # local dot products: every rank then predicts the same change
        linear = em.reduce_mean(MODEL_POINT, linear)
    return Preconditioned(vectors, dots, model, linear)


def predicted_linear_terms(em: Emission, local: Local, dots: Gram, l2: bool) -> tuple[str, str]:
    """(o.P, o.v), o the gradient of the objective whose change the step predicts (the change
    rho, the decrease cap and the rejection test compare with the batch's loss): the batch's
    gradient (+ l2 theta) before clipping (with clipping the model of the clipped gradient
    would predict s times less decrease than the loss sees: rho ~ (2 - s) / s); with
    accumulation this micro-batch's own, the batch loss_after runs on."""
    if local.batch_grads is None and local.scale is None:
        return dots("g", "P"), dots("g", "v")
    key = "k" if local.batch_grads is not None else "raw"
    if not l2:
        return dots(key, "P"), dots(key, "v")
    b, l2_coeff = em.b, em.hp(C.L2)
    along_p, along_v = (b.add(dots(key, x), b.mul(l2_coeff, dots("t", x))) for x in ("P", "v"))
    return along_p, along_v


def quadratic_model(em: Emission, fwd: ForwardPass, precond: dict, velocity: dict, dots: Gram, damping: str,
                    l2: bool, linear: tuple[str, str] | None = None, scale: str | None = None,
                    own: str | None = None, curvature_scale: bool = False) -> QuadraticModel:
    """The damped model's terms with C the exact GGN (products from forward-mode JVPs), as in
    kfac-jax, on the batch `fwd` covers.

    On a sub-batch S the model is the sub-batch's own: C and g both from S, with
    g_S.u = sum_{n in S} (J_n u).dl_n/dz / |S| from the same JVPs (free). Mixing the whole
    batch's g with C_S overshoots wherever S under-represents the curvature along P. So is the
    last micro-batch of an accumulation cycle (`own`: the Gram's key of its gradient): its
    model takes its own gradient. With clipping (`scale` s) the model's linear terms take the
    clipped gradient s g (+ l2 theta), so that (alpha, mu) are those of the clipped gradient's
    model (the update is s times the unclipped one; the raw gradient would rescale alpha by
    1/s and undo the clipping); `linear` (whole_b1, whole_b2) are the terms of the predicted
    change (predicted_linear_terms). With `curvature_scale` c = hp/qmodel_curvature_scale
    multiplies C (not the damping): with c > 1 the model's minimizer is ~1/c of the batch's
    greedy step, a shorter step that averages minibatch noise over steps
    (KfacConfig.qmodel_curvature_scale; a host input, so that the plateau rule can change it)."""
    b, n = em.b, fwd.n
    # C = 1/N sum_n w_n J_n^T F_n J_n (w: a weighted loss's example weights)
    curvature, j_p, j_v = curvature_dots(em, fwd, precond, velocity)
    if curvature_scale:
        c = em.hp(CURVATURE_SCALE)
        curvature = {ij: b.mul(dot, c) for ij, dot in curvature.items()}

    def mean_dot(u: str, w: str) -> str:
        return b.div(b.reduce_sum(b.mul(u, w), None), n)

    c11 = b.add(b.div(curvature[(0, 0)], n), b.mul(damping, dots("P", "P")))
    c12 = b.add(b.div(curvature[(0, 1)], n), b.mul(damping, dots("P", "v")))
    c22 = b.add(b.div(curvature[(1, 1)], n), b.mul(damping, dots("v", "v")))
    whole_b1, whole_b2 = linear or (dots("g", "P"), dots("g", "v"))
    if fwd is em.full and own is None:
        b1, b2 = dots("g", "P"), dots("g", "v")  # whole_b1, whole_b2 unless the gradient is clipped
    else:
        if fwd is em.full:  # accumulation: the micro-batch's own gradient
            b1, b2 = dots(cast(str, own), "P"), dots(cast(str, own), "v")
        else:  # fwd.data_grad carries the example weights of a weighted loss
            b1, b2 = mean_dot(j_p, fwd.data_grad), mean_dot(j_v, fwd.data_grad)
        if scale is not None:
            b1, b2 = b.mul(scale, b1), b.mul(scale, b2)
        if l2:
            b1 = b.add(b1, b.mul(em.hp(C.L2), dots("t", "P")))
            b2 = b.add(b2, b.mul(em.hp(C.L2), dots("t", "v")))
    return QuadraticModel(c11, c12, c22, b1, b2, whole_b1, whole_b2)


# --------------------------------------------------------------------------- stage 3: update
def update_stage(em: Emission, lay: Layout, local: Local, pre: Preconditioned, l2: bool, loss_after: bool,
                 fixed_mu: bool = False, power: float = -1.0, loss_limit: bool = False, decay: bool = False,
                 loss_after_if: bool = True) -> None:
    """(a, mu), the update, the new parameters and velocity, loss_after (in an If with
    `loss_after_if`) and the metrics.
    With `loss_limit` a batch loss above hp/loss_limit withholds the step (the spike guard).
    With `decay` the new parameters are (1 - alpha w) theta + update (decoupled weight decay,
    w = hp/decoupled_weight_decay, alpha = -a the step's learning rate, at least 0; alpha w
    at most 1), outside the preconditioner and the quadratic model; the velocity and
    update_norm are the update's, and loss_after is taken at theta + update.

    The predicted change without the quadratic model is TF K-FAC's
    _compute_approx_qmodel_change, u.g + u.(F + damping) u / 2 with F the approximate Fisher,
    where the Gram has its terms: adam's u = a P with P = (F + damping)^-1 m gives
    u.(F + damping) u = a^2 m.P (power -1 only). regular's mu v term needs (F + damping) v,
    which no graph computes: its prediction stays first-order, g.u."""
    b, dots, loss = em.b, pre.dots, local.loss
    reported_mu = None  # the momentum the metrics report where it is not the update's mu
    if pre.model is not None:
        gap = None  # the objective's distance to the loss's lower bound, where one is known
        if em.parts.loss.lower_bound is not None:
            gap = b.sub(loss, b.const(float(em.parts.loss.lower_bound)))
            if l2:  # the objective the model describes includes l2 |theta|^2 / 2
                gap = b.add(gap, b.mul(b.mul(b.const(0.5), em.hp(C.L2)), dots("t", "t")))
        solve = solve_fixed_mu if fixed_mu else solve_quadratic_model
        a, mu, change = solve(em, pre.model, gap)
    elif "m" in pre.vectors:  # adam momentum: -lr (F + damping)^-1 m, clipped by m.F^-1 m
        lr, reported_mu, mu = em.hp(C.LEARNING_RATE), em.hp(C.MOMENTUM), b.const(0.0)
        a = b.neg(b.mul(lr, norm_constraint(em, lr, dots("m", "P"))))
    else:
        lr, mu = em.hp(C.LEARNING_RATE), em.hp(C.MOMENTUM)
        a = b.neg(b.mul(lr, norm_constraint(em, lr, dots("g", "P"))))
    # |a P + mu v|^2 and g . update from the Gram entries
    update_sq = b.add(
        b.add(b.mul(b.mul(a, a), dots("P", "P")), b.mul(b.mul(b.const(2.0), b.mul(a, mu)), dots("P", "v"))),
        b.mul(b.mul(mu, mu), dots("v", "v")),
    )
    if pre.model is None:
        linear = pre.linear or (dots("g", "P"), dots("g", "v"))
        change = b.add(b.mul(a, linear[0]), b.mul(mu, linear[1]))  # g.u
        if "m" in pre.vectors and power == -1:  # + a^2 m.P / 2 (mu = 0 for adam)
            change = b.add(change, b.mul(b.const(0.5), b.mul(b.mul(a, a), dots("m", "P"))))
    ok_terms = local.ok_terms + [update_sq, a, mu]
    ok_flags: list[str] = []
    shrink = None  # the decay's fraction alpha w, at most 1 (alpha is unbounded: 1 - alpha w < 0 flipped theta)
    if decay:
        shrink = b.op("Min", [b.mul(b.op("Max", [b.neg(a), b.const(0.0)]), em.hp(DECOUPLED_DECAY)), b.const(1.0)])
    new_params, undecayed = apply_update(em, lay, pre.vectors, a, mu, shrink, dots)
    if loss_limit:  # NaN fails the test too (as it fails the finiteness one)
        ok_flags.append(b.op("LessOrEqual", [loss, em.hp(LOSS_LIMIT)]))
    if loss_after:
        ok_flags.append(_loss_after(em, local, dots, undecayed, a, mu, update_sq, change, l2,
                                    conditional=loss_after_if))
    em.metric(C.LOSS, loss)
    em.metric(C.UPDATE_NORM, b.op("Sqrt", [update_sq]))
    raw = l2 or local.scale is not None  # the norm before l2's term and the clipping
    em.metric(C.GRAD_NORM, b.op("Sqrt", [dots("raw", "raw") if raw else dots("g", "g")]))
    em.metric(ALPHA, b.neg(a))
    em.metric(MU, reported_mu or mu)
    em.metric(QMODEL_CHANGE, change)
    ok = em.finite(ok_terms)
    for flag in ok_flags:
        ok = b.op("And", [ok, flag])
    em.metric(C.FINITE, b.cast(ok, FLOAT))


def apply_update(em: Emission, lay: Layout, vectors: dict[str, Chunks], a: str, mu: str,
                 shrink: str | None, dots: Gram | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The update a P + mu v in `lay`'s chunks, written to the velocity slots, the new
    parameters theta + update (with decoupled decay (1 - shrink) theta + update) to the
    parameters' state outputs, adam's m to the grad_velocity slots; returns the new
    parameters and theta + update (the same without decay: the point damping adaptation
    judges the model at). In the per-parameter layout the update is one MatMul of (a, mu)
    with the rows the Gram `dots` stacked (Gram.combine) and a split, instead of two Muls
    and an Add per parameter (issue 40: 3 of the 4 nodes per parameter the update ran)."""
    b = em.b
    update = None if lay.multi_tensor or dots is None else dots.combine({"P": a, "v": mu})
    if update is None:
        update = lay.map(lambda p, v: {"u": b.add(b.mul(a, p), b.mul(mu, v))}, p=vectors["P"], v=vectors["v"])["u"]
    def plus_update(theta: Chunks) -> dict[str, str]:
        return lay.unpack(lay.map(lambda t, u: {"p": b.add(t, u)}, t=theta, u=update)["p"])

    undecayed = plus_update(vectors["t"])
    new_params = undecayed
    if shrink is not None:
        keep = b.sub(b.const(1.0), shrink)
        new_params = plus_update(lay.map(lambda t: {"t": b.mul(keep, t)}, t=vectors["t"])["t"])
    for p, t in new_params.items():
        em.state_output(p, t)
    lay.write_state(em, C.VELOCITY, update)
    if "m" in vectors:
        lay.write_state(em, C.GRAD_VELOCITY, vectors["m"])
    return new_params, undecayed


def _loss_after(em: Emission, local: Local, dots: Gram, new_params: dict[str, str], a: str, mu: str,
                update_sq: str, change: str, l2: bool, conditional: bool = True) -> str:
    """metric/loss_after: the objective at theta + update (`new_params`; without decoupled
    decay, which the model does not describe) on the same batch, for Levenberg-Marquardt damping, inside an If on hp/loss_after > 0 so that only the
    damping-adaptation steps pay for the forward pass. With l2 it includes the regularizer's
    change l2 (theta.u + |u|^2 / 2), so that loss_after - loss is the change of the objective
    the quadratic model describes. Returns the flag that rejects the step: with
    hp/reject_increase > 0, a step that raises the batch objective by more than |predicted
    change| (rho < -1) is not applied (|.|: a sub-batch model can predict a small increase of
    the whole batch's objective, and a step that then lowers it is fine). When the forward
    pass ran, a non-finite loss after the update rejects the step whatever reject_increase
    says (NaN is also the placeholder of the steps without the forward pass). Judged with
    the decay, every adaptation step of a run whose decay raised the loss more than the
    shrinking update's predicted decrease was rejected, the damping grew to max_damping and
    the decay alone went on: a classifier's loss went back to chance. Without `conditional`
    the forward pass runs unconditionally and hp/loss_after is not read (the If-free step
    kind the host runs on adaptation steps only): the same nodes, so the same values."""
    b = em.b
    weights = C.EXAMPLE_WEIGHTS if em.parts.weighted else None

    def objective_after() -> list[str]:
        _, rename = em.clone_forward("kfac/after/", new_params)
        after = em.parts.loss.emit_loss(b, rename(em.output), em.full.y, weights)
        if l2:
            theta_u = b.add(b.mul(a, dots("t", "P")), b.mul(mu, dots("t", "v")))
            reg = b.add(theta_u, b.mul(b.const(0.5), update_sq))
            after = b.add(after, b.mul(em.hp(C.L2), reg))
        return [after]

    if conditional:
        wanted: str | None = b.op("Greater", [em.hp(WANT_LOSS_AFTER), b.const(0.0)])
        (after,) = b.conditional(wanted, objective_after, [b.const(float("nan"))], [[]], hint="loss_after")
    else:
        wanted, (after,) = None, objective_after()
    after = em.reduce_mean(LOSS_AFTER_POINT, after)  # every rank then takes the same decision
    em.metric(LOSS_AFTER, after)
    increase = b.op("And", [b.op("Greater", [em.hp(REJECT_INCREASE), b.const(0.0)]),
                            b.op("Greater", [b.sub(after, local.loss), b.op("Abs", [change])])])
    # a non-finite loss at the new parameters rejects the step, the first one included
    after_ok = em.finite([after]) if wanted is None else b.op("Or", [b.op("Not", [wanted]), em.finite([after])])
    return b.op("And", [b.op("Not", [increase]), after_ok])


def solve_quadratic_model(em: Emission, m: QuadraticModel, gap: str | None) -> tuple[str, str, str]:
    """(a, mu, change): the minimizer of the model with |mu| <= hp/max_momentum, and the
    model's value there with the whole batch's gradient (the prediction damping adaptation
    compares with the whole batch's loss change). With `gap` (the objective's distance to
    the loss's lower bound) a, mu are scaled down where that change would undercut the bound
    (decrease_scale)."""
    b = em.b
    c11, c12, c22, b1, b2 = m.c11, m.c12, m.c22, m.b1, m.b2
    det = b.sub(b.mul(c11, c22), b.mul(c12, c12))
    # 2-D solve unless v = 0 (first step) or the system is numerically rank one in float32
    two_d = b.op("And", [
        b.op("Greater", [c22, b.const(0.0)]),
        b.op("Greater", [det, b.mul(b.const(1e-6), b.mul(c11, c22))]),
    ])
    safe_det = b.op("Where", [two_d, det, b.const(1.0)])
    a2 = b.neg(b.div(b.sub(b.mul(c22, b1), b.mul(c12, b2)), safe_det))
    mu2 = b.neg(b.div(b.sub(b.mul(c11, b2), b.mul(c12, b1)), safe_det))
    a1 = b.neg(b.div(b1, b.op("Max", [c11, b.const(1e-30)])))
    a = b.op("Where", [two_d, a2, a1])
    mu = b.op("Where", [two_d, mu2, b.const(0.0)])
    # |mu| <= hp/max_momentum, with a re-solved for the clipped mu: where the batch's
    # curvature along v is tiny the model's optimum has |mu| >> 1 and training diverges
    limit = em.hp(MAX_MOMENTUM)
    mu_c = b.op("Min", [b.op("Max", [mu, b.neg(limit)]), limit])
    a_c = b.neg(b.div(b.add(b1, b.mul(mu_c, c12)), b.op("Max", [c11, b.const(1e-30)])))
    a = b.op("Where", [b.op("Equal", [mu, mu_c]), a, a_c])
    mu = mu_c

    def model(a: str, mu: str, b1: str, b2: str) -> str:
        return model_value(em, m, a, mu, (b1, b2))

    # Fall back to the momentum-free step when it is no worse: in exact arithmetic the
    # (clipped) 2-D solution never is, but with v almost parallel to P the float32 solve can
    # pick the wrong sign of mu and predict an increase
    two, one = model(a, mu, b1, b2), model(a1, b.const(0.0), b1, b2)
    keep = b.op("LessOrEqual", [two, one])
    a = b.op("Where", [keep, a, a1])
    mu = b.op("Where", [keep, mu, b.const(0.0)])
    if (m.whole_b1, m.whole_b2) == (b1, b2):  # the model on the whole batch: its value at the pick, bitwise
        change = b.op("Where", [keep, two, one])
    else:
        change = model(a, mu, m.whole_b1, m.whole_b2)
    if gap is None:
        return a, mu, change
    scale = decrease_scale(em, change, gap)
    a, mu = b.mul(scale, a), b.mul(scale, mu)
    return a, mu, model(a, mu, m.whole_b1, m.whole_b2)


def solve_fixed_mu(em: Emission, m: QuadraticModel, gap: str | None) -> tuple[str, str, str]:
    """TF K-FAC's qmodel_fixedmu: mu = hp/momentum, a = -(b1 + mu c12) / c11, the minimizer of
    the model along a for that mu (with v = 0, c12 = 0: the momentum-free step); the change
    and the decrease cap as solve_quadratic_model's."""
    b = em.b
    mu = em.hp(C.MOMENTUM)
    a = b.neg(b.div(b.add(m.b1, b.mul(mu, m.c12)), b.op("Max", [m.c11, b.const(1e-30)])))
    change = model_value(em, m, a, mu)
    if gap is None:
        return a, mu, change
    scale = decrease_scale(em, change, gap)
    a, mu = b.mul(scale, a), b.mul(scale, mu)
    return a, mu, model_value(em, m, a, mu)


def model_value(em: Emission, m: QuadraticModel, a: str, mu: str, linear: tuple[str, str] | None = None) -> str:
    """m(a, mu) = a b1 + mu b2 + 1/2 [a mu] C [a mu]^T with the gradient terms `linear`
    (default: the whole batch's, the change damping adaptation compares with)."""
    b = em.b
    b1, b2 = linear or (m.whole_b1, m.whole_b2)
    quad = b.add(b.add(b.mul(b.mul(a, a), m.c11), b.mul(b.mul(b.const(2.0), b.mul(a, mu)), m.c12)),
                 b.mul(b.mul(mu, mu), m.c22))
    return b.add(b.add(b.mul(a, b1), b.mul(mu, b2)), b.mul(b.const(0.5), quad))


def decrease_scale(em: Emission, change: str, gap: str) -> str:
    """s = min(1, k gap / -change), k = hp/max_predicted_decrease (<= 0: off): the update is
    scaled by the ratio of the decrease allowed (the fraction k of the objective's distance
    to the loss's lower bound, `gap`) to the decrease predicted. A model that predicts a
    decrease below the bound is extrapolating past its validity (docs/runtime.md,
    "Safeguards")."""
    b = em.b
    k = em.hp(MAX_PREDICTED_DECREASE)
    limit = b.mul(k, gap)
    capped = b.op("And", [b.op("Greater", [k, b.const(0.0)]), b.op("Less", [change, b.neg(limit)])])
    s = b.op("Where", [capped, b.div(limit, b.neg(change)), b.const(1.0)])
    em.metric(UPDATE_SCALE, s)
    return s


def norm_constraint(em: Emission, lr: str, g_dot_precond: str) -> str:
    """KL clipping (TF K-FAC): scale so lr^2 g.F^-1 g <= c; c <= 0 disables."""
    b = em.b
    c = em.hp(NORM_CONSTRAINT)
    sq = b.mul(b.mul(lr, lr), b.op("Abs", [g_dot_precond]))
    ratio = b.op("Sqrt", [b.div(c, b.op("Max", [sq, b.const(1e-30)]))])
    clipped = b.op("Min", [ratio, b.const(1.0)])
    return b.op("Where", [b.op("Greater", [c, b.const(0.0)]), clipped, b.const(1.0)])


KFAC_STEP = SubgraphKind("kfac_step", KfacStepOptions, every_step=True, emit=emit_kfac_step)
