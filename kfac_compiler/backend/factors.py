"""Curvature inside an emitted subgraph: one batch's factor statistics (per the estimator
mode), their moving-average updates as state outputs, and preconditioning by the blocks'
inverse state."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

from kfac_compiler import contract as C
from kfac_compiler.blocks._parts import GramStatistic
from kfac_compiler.blocks.ops import LiveCount, emit_batch_major
from kfac_compiler.builder import GraphBuilder
from kfac_compiler.contract import NoiseSpec
from kfac_compiler.passes.autodiff import backward
from kfac_compiler.passes.batch_axis import movable_uses
from kfac_compiler.passes.estimator import emit_seeds, noise_shape, noise_spec

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.backend.forward import ForwardPass


class _StateStatistics(Protocol):
    def emit_statistics(self, b: GraphBuilder, inputs: list[str], cotangents: list[list[str]],
                        state: dict[str, str], **kw: Any) -> dict[str, str | GramStatistic]: ...


def inverse_init(spec) -> str:
    """Inverse state starts as the identity (a no-op preconditioner until the first update)
    unless the block's spec says otherwise."""
    return spec.init or "identity"


def layer_cotangent_targets(em: Emission) -> list[str]:
    """Tensors whose per-example cotangents the blocks need (layer outputs; generic params)."""
    names: list[str] = []
    for layer in em.parts.layers:
        if layer.kind == "generic":
            names += [p for p in layer.params if p not in names]
        else:
            names += [u.output for u in layer.uses if u.output not in names]
    return names


def batch_statistics(
    em: Emission, fwd: ForwardPass, mode: str, num_samples: int, data_cots: dict[str, str] | None = None,
    shared: LiveCount | None = None,
) -> dict[str, dict[str, str | GramStatistic]]:
    """One batch's factor estimates {layer: {factor: tensor}} for `mode` on pass `fwd`.
    `data_cots`: cotangents of the mean loss at the layer outputs from the full-batch
    backward, reused by the empirical mode when fwd is the full batch. `shared`: a reduction
    point (factor_updates') the terms that are not linear in the batch pass through before
    they are squared or divide, so that a data-parallel rank computes the global batch's
    statistic: the generic fallback's pseudo-example and a weighted loss's numbers of live
    rows (None: this process's batch alone, the lower-level API's statistics)."""
    b, loss, z, n = em.b, em.parts.loss, fwd.z, fwd.n
    spec = noise_spec(mode, num_samples, loss)
    z_shape = tuple(em.view.shape(em.output) or ())
    noise = []
    if spec.count:
        shape = list(noise_shape(mode, loss, z_shape))
        if fwd.rows is not None:  # a sub-batch pass (used only on larger batches): m rows
            shape[0] = fwd.rows
        em.info.noise = NoiseSpec(spec.count, shape, spec.distribution)
        noise = [em.data_input(C.noise(s), em.b.float_type, shape) for s in range(spec.count)]
    targets = [fwd.name(t) for t in layer_cotangent_targets(em)]
    if mode == "empirical" and fwd is em.full and data_cots is not None:
        per_seed = [{t: b.mul(data_cots[t], n) if data_cots[t] else None for t in targets}]
    else:
        seeds = emit_seeds(b, loss, z, z_shape, mode, num_samples, fwd.data_grad, noise)
        if fwd.seed_scale is not None and mode != "empirical":
            # Fisher of the weighted loss: sum_n w_n F_n, i.e. seeds scaled by sqrt(w_n)
            seeds = [b.mul(sd, fwd.seed_scale) for sd in seeds]
        per_seed = [backward(b, fwd.view, {z: s}, targets) for s in seeds]
    inv_sqrt_n = b.op("Reciprocal", [b.op("Sqrt", [n])])
    pseudo = _pseudo_example(em, inv_sqrt_n, shared)
    stats: dict[str, dict[str, str | GramStatistic]] = {}
    for layer in em.parts.layers:
        block = em.blocks[layer.name]
        if layer.kind == "generic":
            inputs = list(layer.params)
            cots = [[pseudo(d.get(p), p) for d in per_seed] for p in layer.params]
        else:
            inputs = [fwd.name(u.input) for u in layer.uses]
            outs = [fwd.name(u.output) for u in layer.uses]
            cots = [[d.get(o) or _zeros_like(em.b, o) for d in per_seed] for o in outs]
            if block.example_rows == "movable":
                inputs, cots = _batch_major(em, layer, inputs, cots)
        # a weighted loss: rows no weighted term depends on leave the activation statistics
        kw: dict[str, Any] = {"masked": shared or True} if fwd.weight is not None and block.masks_rows else {}
        if block.divides_by_examples:  # N, whatever axis of the layer's rows holds the examples
            kw["examples"] = n
        if block.state_statistics:  # statistics that read the inverse state (ekfac's eigenbases)
            stateful = cast(_StateStatistics, block)  # blocks with state_statistics take `state` (blocks/base.py)
            stats[layer.name] = stateful.emit_statistics(b, inputs, cots, state=inverse_inputs(em, layer.name, block),
                                                         **kw)
        else:
            stats[layer.name] = block.emit_statistics(b, inputs, cots, **kw)
    return stats


def _batch_major(em: Emission, layer, inputs: list[str], cots: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Each use's input and cotangents with the example axis leading where the use's rows are
    time-major or merged (passes/batch_axis.movable_uses): what a "movable" block's
    per-example statistics group by."""
    ranks = [(em.view.rank(u.input), em.view.rank(u.output)) for u in layer.uses]
    paired = em.blocks[layer.name].moves_inputs
    moves = movable_uses(layer, ranks, paired)
    b = em.b
    for u, move in enumerate(moves):
        if move is None:
            continue
        lay, r_in, r_out = move
        if paired:
            inputs[u] = emit_batch_major(b, inputs[u], r_in, lay.axis, lay.outer, lay.inner)
        cots[u] = [emit_batch_major(b, d, r_out, lay.axis, lay.outer, lay.inner) for d in cots[u]]
    return inputs, cots


def inverse_inputs(em: Emission, layer: str, block) -> dict[str, str]:
    """The block's `inverse/<layer>/<name>` state slots as inputs of the graph."""
    return {s.name: em.state_input(C.inverse(layer, s.name), s.shape, inverse_init(s)) for s in block.inverse_specs()}


def current_inverses(em: Emission, layer: str, block) -> dict[str, str]:
    """inverse_inputs, with the slots this graph updates earlier (a block's state_statistics,
    folded in by factor_updates) at their updated value."""
    slots = inverse_inputs(em, layer, block)
    written = set(em.info.state_outputs)
    return {name: C.new(slot) if C.new(slot) in written else slot for name, slot in slots.items()}


def _pseudo_example(em: Emission, inv_sqrt_n: str, shared: LiveCount | None):
    """The generic fallback's one pseudo-example per seed, (cotangent sum_n g_n, param) ->
    [1, *shape] u = sum_n g_n / sqrt(N): unbiased for sampled targets (E g_n = 0), but u u^T is
    not linear in the batch. With `shared`, rank r's u_r (its N/P rows) times sqrt(hp/ranks)
    passes through it first: the ranks' mean of sqrt(P) u_r is the global batch's u, which
    every rank then squares (in one process sqrt(1) u, bitwise u)."""
    b = em.b
    scale = None
    if shared is not None and any(layer.kind == "generic" for layer in em.parts.layers):
        scale = b.op("Sqrt", [em.hp(C.RANKS)])

    def pseudo(cot: str | None, p: str) -> str:
        u = b.mul(cot or em.zeros_like_param(p), inv_sqrt_n)
        if shared is not None and scale is not None:
            u = shared(b.mul(u, scale))
        return b.unsqueeze(u, [0])

    return pseudo


def _zeros_like(b: GraphBuilder, t: str) -> str:
    return b.op("Mul", [t, b.const(0.0)])


def factor_updates(em: Emission, fwd: ForwardPass, cots: dict, mode: str,
                    num_samples: int, cut: bool = True) -> tuple[list[tuple[str, str]], list[str]]:
    """The moving-average update (1 - c) F + c S of every factor slot F with this batch's
    statistic S, as (slot, new value) pairs, and finiteness terms. A GramStatistic
    S = X^T X / count becomes one Gemm(X * c / count, X, (1 - c) F, transA): its finiteness is
    that of |X|^2, which bounds every entry of X^T X. The statistics a block keeps in its
    inverse state pass a reduction point (`cut`; not inside an If, which a data-parallel step
    cannot cut: runtime/staged.py then refuses such blocks), as do the terms that are not
    linear in the batch (batch_statistics' `shared`; inside an If each rank's own)."""
    b = em.b
    coeff = em.hp(C.EMA_COEFF)
    keep = b.sub(b.const(1.0), coeff)

    def shared(term: str) -> str:
        return em.reduce_mean(C.STATISTICS_TERMS_POINT, term)

    stats = em.reduce_through_state(C.FACTOR_STATISTICS_POINT,
                                    batch_statistics(em, fwd, mode, num_samples, cots, shared if cut else None))
    stated = {name: {f: s for f, s in d.items() if f in em.blocks[name].state_statistics}
              for name, d in stats.items()}
    stated = {name: d for name, d in stated.items() if d}
    if cut and stated:
        for name, reduced in em.reduce_mean(C.STATE_STATISTICS_POINT, stated).items():
            stats[name] = {**stats[name], **reduced}
    updates, ok = [], []
    for layer in em.parts.layers:
        block = em.blocks[layer.name]
        specs = {s.name: s for s in block.factor_specs()}
        for fname, stat in stats[layer.name].items():
            if fname in block.state_statistics:  # a moving average kept in the inverse state
                slot = C.inverse(layer.name, fname)
            else:
                slot = em.state_input(C.factor(layer.name, fname), specs[fname].shape, "zeros")
            if isinstance(stat, GramStatistic) and stat.diag:
                sums = stat.emit_square_sums(b)
                updates.append((slot, b.add(b.mul(sums, b.div(coeff, stat.count)), b.mul(slot, keep))))
                ok.append(b.reduce_sum(sums, None))
            elif isinstance(stat, GramStatistic):
                scaled = b.mul(stat.rows, b.div(coeff, stat.count))
                gemm = [scaled, stat.rows, b.mul(slot, keep)]
                new = (b.op("Gemm", gemm, transB=1) if stat.cols  # rows holds X^T
                       else b.op("Gemm", gemm, transA=1))
                updates.append((slot, new))
                ok.append(b.reduce("ReduceSumSquare", stat.rows, None))
            else:
                updates.append((slot, b.add(slot, b.mul(coeff, b.sub(stat, slot)))))
                ok.append(b.reduce_sum(stat, None))
    return updates, ok


def write_factor_updates(em: Emission, fwd: ForwardPass, cots: dict, mode: str, num_samples: int,
                          ok: list[str]) -> None:
    """The factor updates as state outputs, on every run; their finiteness terms into `ok`."""
    updates, terms = factor_updates(em, fwd, cots, mode, num_samples)
    for slot, new in updates:
        em.state_output(slot, new)
    ok += terms


def conditional_factor_updates(em: Emission, fwd: ForwardPass, cots: dict, mode: str, num_samples: int,
                                ok: list[str]) -> None:
    """The factor updates inside an If on hp/update_stats > 0: the steps that skip the
    statistics (cov_update_period > 1, the first step) run the same session, whose factor
    outputs are then copies of its inputs. A second session for those steps would cost more:
    each session's idle workers spin on cores the other session needs."""
    b = em.b
    slots: list[str] = []

    def statistics() -> list[str]:
        updates, terms = factor_updates(em, fwd, cots, mode, num_samples, cut=False)
        slots.extend(slot for slot, _ in updates)
        return [new for _, new in updates] + [b.sum(terms)]

    wanted = b.op("Greater", [em.hp(C.UPDATE_STATS), b.const(0.0)])
    results = b.conditional(wanted, statistics, lambda: slots + [b.const(0.0)],
                            lambda: [em.info.state_specs[s].shape for s in slots] + [[]], hint="statistics")
    for slot, new in zip(slots, results):
        em.state_output(slot, new)
    ok.append(results[-1])


def precondition(em: Emission, grads: dict[str, str]) -> dict[str, str]:
    """(F + damping)^-1 g for every block, from the `inverse/<layer>/<name>` state slots (a
    slot this graph re-estimated before, ekfac's S, at its new value)."""
    out: dict[str, str] = {}
    for layer in em.parts.layers:
        block = em.blocks[layer.name]
        inverses = current_inverses(em, layer.name, block)
        # the parameters are state inputs named after themselves (blocks that read them: reads_params)
        out.update(block.emit_multiply_inverse(em.b, {p: grads[p] for p in layer.params}, inverses,
                                               params={p: p for p in layer.params}))
    return out
