"""The back end's own subgraphs: the loss, gradients, factor statistics and their moving
averages, inverse refreshes, preconditioning and curvature products (the optimizers'
training steps are emitted by their plugins, kfac_compiler.optimizers)."""
from __future__ import annotations

from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler import linalg
from kfac_compiler.backend.factors import inverse_init
from kfac_compiler.backend.emission import WEIGHTS, Emission
from kfac_compiler.backend.registry import subgraph
from kfac_compiler.blocks._parts import emit_statistic
from kfac_compiler.errors import PlanError

FLOAT = TensorProto.FLOAT


@subgraph("loss")
def loss(em: Emission) -> None:
    y = em.targets()
    em.example_weights()
    em.metric(C.LOSS, em.parts.loss.emit_loss(em.b, em.output, y, WEIGHTS if em.parts.weighted else None))
    em.result(C.MODEL_OUTPUT, em.output)


@subgraph("gradients")
def gradients(em: Emission) -> None:
    loss, _, grads, _ = em.loss_and_grads()
    em.metric(C.LOSS, loss)
    for p in em.parts.params:
        em.result(C.grad(p), grads[p])


@subgraph("statistics")
def statistics(em: Emission, mode: str | None = None, num_samples: int | None = None,
                stats_batch: int | None = None) -> None:
    mode = mode or em.parts.mode
    num_samples = num_samples or em.parts.num_samples
    targets = em.layer_cotangent_targets() if mode == "empirical" and stats_batch is None else []
    loss, n, _, cots = em.loss_and_grads(targets)
    em.metric(C.LOSS, loss)
    stats = em.batch_statistics(em.sub_batch_pass(stats_batch), mode, num_samples, cots)
    for layer, factors in stats.items():
        for fname, stat in factors.items():
            em.result(C.stat(layer, fname), emit_statistic(em.b, stat))


@subgraph("update_statistics")
def update_statistics(em: Emission, mode: str | None = None, num_samples: int | None = None,
                       stats_batch: int | None = None) -> None:
    """Moving-average factor update only (first step, burn-in, before an inverse refresh)."""
    mode = mode or em.parts.mode
    num_samples = num_samples or em.parts.num_samples
    reuse = mode == "empirical" and stats_batch is None
    loss, n, _, cots = em.loss_and_grads(em.layer_cotangent_targets() if reuse else [])
    ok_terms = [loss]
    em.factor_updates(em.sub_batch_pass(stats_batch), cots, mode, num_samples, ok_terms)
    em.metric(C.LOSS, loss)
    em.metric(C.FINITE, em.b.cast(em.finite(ok_terms), FLOAT))


@subgraph("inverse_update")
def inverse_update(em: Emission, method: str | None = None, layers: tuple[str, ...] | None = None) -> None:
    """The damped inverses of every emitted block, or (`layers`, a tuple of layer names) of
    those blocks only: a refresh spread over several steps runs one such program per group
    of blocks (optimizers/kfac/refresh.py)."""
    _emit_block_states(em, linalg.concrete_method(method or em.parts.inverse_method), layers, -1)


@subgraph("power_update")
def power_update(em: Emission, power: float = -0.5, method: str | None = None,
                 layers: tuple[str, ...] | None = None) -> None:
    """inverse_update for a preconditioner power other than -1 (K-FAC's precon_power): the
    inverse slots of every block that emits (F + damping)^power (integer and half-integer
    powers, blocks.PartsBlock.emit_power_state) hold that power's state; the runtime computes
    the other blocks' on the host (numpy_power_state)."""
    _emit_block_states(em, linalg.concrete_method(method or em.parts.inverse_method), layers, float(power))


def _emit_block_states(em: Emission, method: str, layers: tuple[str, ...] | None, power: float) -> None:
    """The inverse slots' state of (F + damping)^power for the blocks that emit it."""
    b = em.b
    damping = em.hp(C.DAMPING)
    if layers is not None:
        unknown = sorted(set(layers) - {layer.name for layer in em.parts.layers})
        if unknown:
            raise PlanError(f"inverse_update: the plan has no layer {unknown[0]!r}")
    oks = []
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
        # The block keeps `previous` where a factor or its inverse is not finite (new.ok false).
        new = block.emit_power_state(b, factors, damping, power, method, previous)  # -1: emit_inverse
        oks.append(b.cast(new.ok, FLOAT))
        em.metric(C.inverse_ok(layer.name), oks[-1])  # the runtime redoes failed blocks on the host
        for s in block.inverse_specs():
            em.state_output(previous[s.name], new[s.name])
    all_ok = b.op("Min", oks) if len(oks) > 1 else (oks[0] if oks else b.const(1.0))
    em.metric(C.INVERSE_OK, all_ok)


@subgraph("precondition")
def precondition(em: Emission) -> None:
    vecs = {p: em.data_input(C.vec(p), FLOAT, list(em.view.shapes[p])) for p in em.parts.params}
    out = em.precondition(vecs)
    for p in em.parts.params:
        em.result(C.precond(p), out[p])


@subgraph("multiply")
def multiply(em: Emission, exp: float = 1) -> None:
    """(F + damping)^exp v for every block, from the moving-average factors: the block
    multiply for exp = 1, an integer or half-integer matrix power otherwise (a product whose
    emitted square root failed its check is NaN; other powers need eigendecompositions:
    Curvature.multiply_matpower does them on the host)."""
    damping = em.hp(C.DAMPING)
    vecs = {p: em.data_input(C.vec(p), FLOAT, list(em.view.shapes[p])) for p in em.parts.params}
    for layer in em.parts.layers:
        block = em.blocks[layer.name]
        factors = {s.name: em.state_input(C.factor(layer.name, s.name), s.shape, "zeros") for s in block.factor_specs()}
        mine = {p: vecs[p] for p in layer.params}
        if exp == 1:
            out = block.emit_multiply(em.b, mine, factors, damping)
        else:
            out = block.emit_multiply_matpower(em.b, mine, factors, damping, exp)
        for p in layer.params:
            em.result(C.product(p), out[p])
