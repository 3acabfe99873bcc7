"""The back end's own subgraphs: the loss, gradients, factor statistics and their moving
averages, inverse refreshes, preconditioning and curvature products (the optimizers'
training steps are emitted by their plugins, kfac_compiler.optimizers)."""
from __future__ import annotations

from typing import cast

from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler import linalg
from kfac_compiler.backend.emission import WEIGHTS, Emission
from kfac_compiler.backend.factors import inverse_init
from kfac_compiler.backend.registry import subgraph
from kfac_compiler.blocks._parts import PartsBlock, emit_inverses, emit_statistic
from kfac_compiler.blocks.base import InverseState
from kfac_compiler.errors import PlanError
from kfac_compiler.requests import (
    GradientsOptions,
    InverseOptions,
    LossOptions,
    MultiplyOptions,
    PowerOptions,
    PreconditionOptions,
    PredictOptions,
    StatisticsOptions,
)

FLOAT = TensorProto.FLOAT


@subgraph(C.LOSS_GRAPH)
def loss(em: Emission, o: LossOptions) -> None:
    y = em.targets()
    em.example_weights()
    em.metric(C.LOSS, em.parts.loss.emit_loss(em.b, em.output, y, WEIGHTS if em.parts.weighted else None))
    em.result(C.MODEL_OUTPUT, em.output)


@subgraph(C.PREDICT)
def predict(em: Emission, o: PredictOptions) -> None:
    """The model output alone: Trainer.predict's graph, its parameters bound from the state,
    so that one session serves every call (no model rebuilt with the values per call)."""
    em.result(C.MODEL_OUTPUT, em.output)


@subgraph(C.GRADIENTS)
def gradients(em: Emission, o: GradientsOptions) -> None:
    loss, _, grads, _ = em.loss_and_grads()
    em.metric(C.LOSS, loss)
    for p in em.parts.params:
        em.result(C.grad(p), grads[p])


@subgraph(C.STATISTICS)
def statistics(em: Emission, o: StatisticsOptions) -> None:
    em.keep_layers(o.layers)
    mode, num_samples, stats_batch = o.mode or em.parts.mode, o.num_samples or em.parts.num_samples, o.stats_batch
    targets = em.layer_cotangent_targets() if mode == "empirical" and stats_batch is None else []
    loss, n, _, cots = em.loss_and_grads(targets)
    em.metric(C.LOSS, loss)
    stats = em.batch_statistics(em.sub_batch_pass(stats_batch), mode, num_samples, cots)
    for layer, factors in stats.items():
        for fname, stat in factors.items():
            em.result(C.stat(layer, fname), emit_statistic(em.b, stat))


@subgraph(C.UPDATE_STATISTICS)
def update_statistics(em: Emission, o: StatisticsOptions) -> None:
    """Moving-average factor update only (first step, burn-in, before an inverse refresh)."""
    em.keep_layers(o.layers)
    mode, num_samples, stats_batch = o.mode or em.parts.mode, o.num_samples or em.parts.num_samples, o.stats_batch
    reuse = mode == "empirical" and stats_batch is None
    loss, n, _, cots = em.loss_and_grads(em.layer_cotangent_targets() if reuse else [])
    ok_terms = [loss]
    em.factor_updates(em.sub_batch_pass(stats_batch), cots, mode, num_samples, ok_terms)
    em.metric(C.LOSS, loss)
    em.metric(C.FINITE, em.b.cast(em.finite(ok_terms), FLOAT))


@subgraph(C.INVERSE_UPDATE)
def inverse_update(em: Emission, o: InverseOptions) -> None:
    """The damped inverses of every emitted block, or (`layers`, a tuple of layer names) of
    those blocks only: a refresh spread over several steps runs one such program per group
    of blocks (optimizers/kfac/refresh.py)."""
    _emit_block_states(em, linalg.concrete_method(o.method or em.parts.inverse_method), o.layers, -1)


@subgraph(C.POWER_UPDATE)
def power_update(em: Emission, o: PowerOptions) -> None:
    """inverse_update for a preconditioner power other than -1 (K-FAC's precon_power): the
    inverse slots of every block that emits (F + damping)^power (integer and half-integer
    powers, blocks.PartsBlock.emit_power_state) hold that power's state; the runtime computes
    the other blocks' on the host (numpy_power_state)."""
    _emit_block_states(em, linalg.concrete_method(o.method or em.parts.inverse_method), o.layers, float(o.power))


def _emit_block_states(em: Emission, method: str, layers: tuple[str, ...] | None, power: float) -> None:
    """The inverse slots' state of (F + damping)^power for the blocks that emit it."""
    b = em.b
    damping = em.hp(C.DAMPING)
    if layers is not None:
        unknown = sorted(set(layers) - {layer.name for layer in em.parts.layers})
        if unknown:
            raise PlanError(f"inverse_update: the plan has no layer {unknown[0]!r}")
    oks = []
    chosen = []
    for layer in em.parts.layers:
        if layers is not None and layer.name not in layers:
            continue
        block = em.blocks[layer.name]
        if not block.emits_power(power, method):  # -1: not inverse_is_host(method)
            continue
        factors = {
            s.name: em.state_input(C.factor(layer.name, s.name), s.shape, "zeros") for s in block.factor_specs()
        }
        previous = {
            s.name: em.state_input(C.inverse(layer.name, s.name), s.shape, inverse_init(s)) for s in block.inverse_specs()
        }
        chosen.append((layer, block, factors, previous))
    # The blocks whose inverse is the parts inverse share one stack per size class (one Schur
    # tree for all of them: blocks.emit_inverses); each keeps `previous` where a factor or its
    # inverse is not finite (new.ok false).
    stacked = [(layer.name, block, factors, previous) for layer, block, factors, previous in chosen
               if power == -1 and isinstance(block, PartsBlock) and block.emits_stacked_inverse(method)]
    # The stacks' sizes come from every such block of the plan, not only `layers`': a group's
    # or a data-parallel rank's program then pads each matrix as the whole refresh does, so a
    # block's inverse is the same to the bit whoever computes it (a 10-row factor inverted
    # alone on its owner rank and padded to 65 rows in one process differed by 6e-8:
    # benchmarks/results/2026-11-29-regram.md)
    sizes = [n for layer in em.parts.layers for block in [em.blocks[layer.name]]
             if isinstance(block, PartsBlock) and block.emits_stacked_inverse(method) for n in block.stacked_sizes()]
    states = dict(zip([name for name, *_ in stacked],
                      emit_inverses(b, [(blk, f, damping, prev) for _, blk, f, prev in stacked], method,
                                    sizes=sizes if power == -1 else ())
                      if stacked else []))  # none with a host method (eigh, cholesky): no emitted inverse
    for layer, block, factors, previous in chosen:
        new = (cast(InverseState, states[layer.name]) if layer.name in states
               else block.emit_power_state(b, factors, damping, power, method, previous))
        oks.append(b.cast(cast(str, new.ok), FLOAT))  # an emitted InverseState's ok is set
        em.metric(C.inverse_ok(layer.name), oks[-1])  # the runtime redoes failed blocks on the host
        for s in block.inverse_specs():
            em.state_output(previous[s.name], new[s.name])
    all_ok = b.op("Min", oks) if len(oks) > 1 else (oks[0] if oks else b.const(1.0))
    em.metric(C.INVERSE_OK, all_ok)


@subgraph(C.PRECONDITION)
def precondition(em: Emission, o: PreconditionOptions) -> None:
    vecs = {p: em.data_input(C.vec(p), FLOAT, list(em.view.static_shape(p))) for p in em.parts.params}
    out = em.precondition(vecs)
    for p in em.parts.params:
        em.result(C.precond(p), out[p])


@subgraph(C.MULTIPLY)
def multiply(em: Emission, o: MultiplyOptions) -> None:
    """(F + damping)^exp v for every block, from the moving-average factors: the block
    multiply for exp = 1, an integer or half-integer matrix power otherwise (a product whose
    emitted square root failed its check is NaN; other powers need eigendecompositions:
    Curvature.multiply_matpower does them on the host)."""
    damping = em.hp(C.DAMPING)
    vecs = {p: em.data_input(C.vec(p), FLOAT, list(em.view.static_shape(p))) for p in em.parts.params}
    for layer in em.parts.layers:
        block = em.blocks[layer.name]
        factors = {s.name: em.state_input(C.factor(layer.name, s.name), s.shape, "zeros") for s in block.factor_specs()}
        mine = {p: vecs[p] for p in layer.params}
        params = {p: p for p in layer.params}  # state inputs named after themselves
        if o.exp == 1:
            out = block.emit_multiply(em.b, mine, factors, damping, params)
        else:
            out = block.emit_multiply_matpower(em.b, mine, factors, damping, o.exp, params)
        for p in layer.params:
            em.result(C.product(p), out[p])
