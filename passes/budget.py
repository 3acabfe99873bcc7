"""Pass 5: cost-aware choice, so that K-FAC on a real-sized model costs a bounded multiple of
its forward and backward pass.

Every block knows its work (blocks/base.py): `apply_flops` (the preconditioning multiply,
paid on every step), `stats_flops(m)` (one statistics update on m examples) and
`inverse_flops(method)` (one refresh), and its layer's `forward_flops(N)`. At the reference
batch N (config `budget.batch_size`, default REFERENCE_BATCH or train's --batch-size; statistics on m = min(64, N) examples) the model's
forward + backward costs `base = 3 sum forward_flops(N)` and the curvature work per step is

    work = sum apply + (sum stats(m) + sampled backward) / stats_period + sum inverse / inverse_period.

`budget.overhead` (B, default 1) bounds work / base in three shares, so that no single kind of
work is starved to pay for another:
  1. preconditioning (cannot be amortized): while sum apply > B/2 base, the full factor
     at least `budget.min_dim` wide whose diagonal saves the most apply FLOPs is kept as its
     diagonal (kron -> kron_in_diag / kron_out_diag -> kron_both_diag; kron_indep ->
     kron_indep_in_diag / kron_indep_out_diag -> kron_indep_both_diag);
  2. statistics: the smallest period in STATS_PERIODS with sum stats / period <= B/4 base;
  3. inverses: the smallest period in INVERSE_PERIODS with sum inverse / period <= B/4 base.
Before these, memory, with one kind of step down (`_step_down`): a Kronecker block's widest
full factor kept as its diagonal; another block's menu entry with the largest state below its
own (e.g. a `full` block to `diagonal`). A block whose training state (its factors and
inverse state at the plan's damping split, each in two buffers) does not fit `budget.memory_gb` (default: this machine's physical memory)
steps down until it fits; where the user chose the approximation, or no step is left,
compiling stops with one line naming the layer, the bytes and the approximation that fits (a
37 GB factor used to compile and then fail in numpy's allocation at training). Then the whole
model's curvature state must fit too: while the blocks' states together exceed the budget,
the one step down that saves the most bytes is taken, on layers whose approximation the user
did not choose; if none is left, one line names the total and the largest block.
Factors narrower than `budget.min_dim` (512) are never approximated, and the periods keep their
defaults (1, 10) while every factor is that narrow: on such models a step's time goes to
per-node costs, not FLOPs, and full K-FAC every step wins (the digits zoo, docs/runtime.md).
A choice the user made (config `layers`, `approximations`, links, explicit periods) is kept.
Every change is recorded as a plan note and the predicted costs in `plan.costs`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kfac_compiler.blocks.base import FisherBlock
from kfac_compiler.errors import ConfigError, KfacError, human_bytes
from kfac_compiler.ir import Layer

STATS_PERIODS = (1, 2, 5, 10, 20, 50)
INVERSE_PERIODS = (10, 20, 50, 100, 200)
REFERENCE_BATCH = 32  # budget.batch_size when neither the config nor `train --batch-size` gives one
STATS_BATCH = 64  # the K-FAC default stats_batch_size (optimizers/kfac/settings.py)
DEFAULT_PERIODS = (1, 10)  # statistics, inverses: the schedule while everything is small
BUFFERS = 2  # every state slot, factor and inverse alike, is double-buffered (runtime/state.py)

# one diagonal step down per factor: approximation -> {factor: approximation without it full}
DIAGONAL_STEPS: dict[str, dict[str, str]] = {
    "kron": {"A": "kron_in_diag", "G": "kron_out_diag"},
    "kron_indep": {"A": "kron_indep_in_diag", "G": "kron_indep_out_diag"},
    "kron_in_diag": {"G": "kron_both_diag"},
    "kron_out_diag": {"A": "kron_both_diag"},
    "kron_indep_in_diag": {"G": "kron_indep_both_diag"},
    "kron_indep_out_diag": {"A": "kron_indep_both_diag"},
}


@dataclass
class BlockCost:
    """One block's work at the reference batch, in FLOPs (apply: per step; stats: per update;
    inverse: per refresh) and its factors' bytes."""

    forward: int
    apply: int
    stats: int
    inverse: int
    factor_bytes: int

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class BudgetResult:
    layers: list[Layer]
    stats_period: int
    inverse_period: int
    costs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def block_cost(block: FisherBlock, batch: int, method: str) -> BlockCost:
    m = min(STATS_BATCH, batch)
    nbytes = sum(4 * _elements(s.shape) for s in block.factor_specs())
    return BlockCost(int(block.forward_flops(batch)), int(block.apply_flops()), int(block.stats_flops(m)),
                     int(block.inverse_flops(method)), int(nbytes))


def _elements(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _widths(block: FisherBlock) -> list[int]:
    """The widths of a block's factors (the last axis of each, full or diagonal)."""
    return [int(s.shape[-1]) for s in block.factor_specs() if s.shape]


def _full_factors(block: FisherBlock) -> dict[str, int]:
    """{"A"/"G": width} of a Kronecker block's full factors."""
    out = {}
    for key, diag, n in (("A", "a_diag", "nA"), ("G", "g_diag", "nG")):
        if hasattr(block, n) and not getattr(block, diag, True):
            out[key] = int(getattr(block, n))
    return out


def fit_budget(
    layers: list[Layer],
    make: Callable[[Layer], FisherBlock],
    pinned: set[str],
    *,
    overhead: float,
    batch_size: int,
    min_dim: int,
    stats_period: int | None,
    inverse_period: int | None,
    method: str,
    allowed: Callable[[Layer, str], bool],
    memory_bytes: int | None = None,
    menu: Callable[[Layer], Iterable[str]] = lambda layer: (),
    backward_passes: int = 1,
) -> BudgetResult:
    """Approximations and periods within the budget (module docstring). `make` builds a
    layer's block, `pinned` names the layers whose approximation the user chose, `allowed`
    says whether an approximation is on a layer's menu; a period given (not None) is kept;
    `memory_bytes`: the memory a block's training state, and all blocks' together, must fit in
    (None: unchecked); `menu`: a layer's approximations, for memory steps of non-Kronecker blocks;
    `backward_passes`: the estimator's backward passes per statistics update (estimator_passes)."""
    layers = list(layers)
    notes: list[str] = []
    if memory_bytes is not None:
        def step(layer: Layer) -> Layer | None:
            return _step_down(layer, make, allowed, menu)

        layers = [_fit_memory(l, make, l.name in pinned, memory_bytes, step, notes) for l in layers]
        layers = _fit_total_memory(layers, make, pinned, memory_bytes, step, notes)
    blocks = {l.name: make(l) for l in layers}
    costs = {n: block_cost(b, batch_size, method) for n, b in blocks.items()}
    forward = sum(c.forward for c in costs.values())  # one forward pass at the reference batch
    base = 3 * forward
    big = any(n >= min_dim for b in blocks.values() for n in _widths(b))
    on = overhead > 0 and base > 0
    index = {l.name: i for i, l in enumerate(layers)}

    # 1. preconditioning: diagonalize the widest-saving full factors above min_dim
    while on and sum(c.apply for c in costs.values()) > overhead / 2 * base:
        best = None
        for l in layers:
            if l.name in pinned:
                continue
            for factor, n in _full_factors(blocks[l.name]).items():
                target = DIAGONAL_STEPS.get(l.approximation or "", {}).get(factor)
                if n < min_dim or target is None or not allowed(l, target):
                    continue
                saving = costs[l.name].apply - make(dataclasses.replace(l, approximation=target)).apply_flops()
                if best is None or saving > best[0]:
                    best = (saving, l, factor, target, n)
        if best is None:
            break
        _, layer, factor, target, n = best
        new = dataclasses.replace(layer, approximation=target)
        layers[index[layer.name]] = new
        blocks[layer.name] = make(new)
        old_apply = costs[layer.name].apply
        costs[layer.name] = block_cost(blocks[layer.name], batch_size, method)
        notes.append(
            f"layer {layer.name!r}: {factor} ({n} wide) kept as its diagonal ({layer.approximation} -> {target}): "
            f"the block's preconditioning with it full costs {old_apply / base:.2f}x the model's forward+backward at batch "
            f"{batch_size} (budget.overhead {overhead:g}; pin it with config layers to keep it full)"
        )

    # a statistics update also runs the estimator's backward passes: about twice a forward on m
    # examples each (the blocks' own statistics are priced for one seed)
    m = min(STATS_BATCH, batch_size)
    sampled_backward = 2 * backward_passes * sum(b.forward_flops(m) for b in blocks.values())
    stats_total = sum(c.stats for c in costs.values()) + sampled_backward
    inverse_total = sum(c.inverse for c in costs.values())
    chosen_s, chosen_r = DEFAULT_PERIODS
    if on and big:
        chosen_s = _smallest(STATS_PERIODS, stats_total, overhead / 4 * base)
        chosen_r = _smallest(INVERSE_PERIODS, inverse_total, overhead / 4 * base)
    s = stats_period if stats_period is not None else chosen_s
    r = inverse_period if inverse_period is not None else chosen_r
    for what, given, chosen, default, total in (
            ("stats.update_period", stats_period, s, DEFAULT_PERIODS[0], stats_total),
            ("inverse.update_period", inverse_period, r, DEFAULT_PERIODS[1], inverse_total)):
        if given is None and chosen != default:
            share = total / chosen / base if base else 0.0
            if share <= overhead / 4 * (1 + 1e-9):
                why = f" to keep the amortized curvature work within budget.overhead {overhead:g} at batch {batch_size}"
            else:  # even the longest period leaves more than the allowance: say so, not "within"
                why = (f", the longest on offer: it still costs {share:.2f}x the forward+backward at batch {batch_size}, "
                       f"above the {overhead / 4:g}x budget.overhead {overhead:g} allows it")
            notes.append(f"{what} = {chosen} (default {default}){why}; set it in the config to override")
    apply_total = sum(c.apply for c in costs.values())
    work = apply_total + stats_total / s + inverse_total / r
    summary = {
        "batch_size": batch_size,
        "stats_batch_size": min(STATS_BATCH, batch_size),
        "overhead_budget": overhead,
        "min_dim": min_dim,
        "forward_backward_flops": base,
        "apply_flops": apply_total,
        "stats_flops_per_update": stats_total,
        "sampled_backward_flops": sampled_backward,
        "statistics_backward_passes": backward_passes,
        # K-FAC's quadratic model: two forward-mode JVPs (about two forwards each) on the whole
        # batch, its default qmodel_batch_size (optimizers/kfac/settings.py)
        "qmodel_flops": 4 * forward,
        "inverse_flops_per_refresh": inverse_total,
        "inverse_method": method,  # the method the layers' "inverse" FLOPs are for
        "stats_period": s,
        "inverse_period": r,
        "curvature_flops_per_step": work,
        "overhead": work / base if base else None,
        "factor_bytes": sum(c.factor_bytes for c in costs.values()),
        "layers": {n: c.to_json() for n, c in costs.items()},
    }
    return BudgetResult(layers, s, r, summary, notes)


def estimator_passes(mode: str, num_samples: int, output_shape: Iterable | None, stats_batch: int,
                     batch_size: int) -> int:
    """Backward passes a statistics update runs (passes/estimator.py): the sampled modes one per
    sample, the exact modes one per output coordinate of an example, the empirical mode none
    when its statistics reuse the step's own backward (their rows are the whole batch), else
    one. (They had been priced as one whatever the mode: 8 samples cost 3x that.)"""
    if mode == "empirical":
        return 0 if stats_batch >= batch_size else 1
    if mode.startswith("exact"):
        dims = list(output_shape or [])[1:]
        return max(1, _elements(d if isinstance(d, int) and d > 0 else 1 for d in dims))
    return max(1, int(num_samples))


def _state_bytes(block: FisherBlock) -> int:
    """The bytes of the block's factors and inverse state (at its damping split: EKFAC's and
    exact damping's eigenbases outweigh the factors), float32, each double-buffered."""
    specs = [*block.factor_specs(), *block.inverse_specs()]
    return BUFFERS * sum(4 * _elements(s.shape) for s in specs)


def _fit_memory(layer: Layer, make: Callable[[Layer], FisherBlock], pinned: bool, memory: int,
                step: Callable[[Layer], Layer | None], notes: list[str]) -> Layer:
    """`layer` stepped down (`step`: the whole-model check's steps, a Kronecker block's widest
    full factor to its diagonal, another block's next smaller menu entry) until its block's
    training state fits `memory` bytes; a ConfigError where the user chose its approximation
    or no step is left (naming the approximation that fits, if one does)."""
    need = _state_bytes(make(layer))
    if need <= memory:
        return layer
    chosen, current = layer.approximation, layer
    while current is not None and _state_bytes(make(current)) > memory:
        current = step(current)
    what = (f"layer {layer.name!r}: {chosen} keeps {human_bytes(need)} of factors, inverses and their buffers, more than "
            f"the {human_bytes(memory)} of memory the budget allows (budget.memory_gb)")
    if pinned or current is None:
        fix = f"use {current.approximation} (its state: {human_bytes(_state_bytes(make(current)))})" if current else \
              "choose a diagonal approximation or exclude the layer's parameters"
        raise ConfigError(f"{what}; {fix}")
    notes.append(f"{what}: approximated as {current.approximation} ({human_bytes(_state_bytes(make(current)))})")
    return current


def _step_down(layer: Layer, make: Callable[[Layer], FisherBlock], allowed: Callable[[Layer, str], bool],
               menu: Callable[[Layer], Iterable[str]]) -> Layer | None:
    """`layer` one memory step down, or None: a Kronecker block keeps its widest full factor as
    its diagonal (DIAGONAL_STEPS); another block takes the approximation on its menu whose
    state is the largest below its own (e.g. `full` -> `diagonal`), the mildest step there is."""
    block = make(layer)
    kron = [(n, DIAGONAL_STEPS.get(layer.approximation or "", {}).get(f)) for f, n in _full_factors(block).items()]
    kron = [(n, t) for n, t in kron if t is not None and allowed(layer, t)]
    if kron:
        return dataclasses.replace(layer, approximation=max(kron, key=lambda s: s[0])[1])
    own, smaller = _state_bytes(block), []
    for name in menu(layer):
        if name == layer.approximation or not allowed(layer, name):
            continue
        other = dataclasses.replace(layer, approximation=name)
        try:
            state = _state_bytes(make(other))
        except (KfacError, ValueError):  # not buildable for this layer's shapes
            continue
        if state < own:
            smaller.append((state, other))
    return max(smaller, key=lambda s: s[0])[1] if smaller else None


def _fit_total_memory(layers: list[Layer], make: Callable[[Layer], FisherBlock], pinned: set[str], memory: int,
                      step: Callable[[Layer], Layer | None], notes: list[str]) -> list[Layer]:
    """`layers` with the steps down (`step`) that save the most bytes taken one at a time until
    the blocks' training states together fit `memory` bytes; a ConfigError where no layer the
    user left to the compiler has a step left (each block alone fits: `_fit_memory` ran first)."""
    layers = list(layers)
    state = {l.name: _state_bytes(make(l)) for l in layers}
    total = sum(state.values())
    moves: dict[str, tuple[Layer, int] | None] = {}  # a layer's step down and the bytes it saves
    while total > memory:
        best: tuple[int, int, Layer] | None = None
        for i, layer in enumerate(layers):
            if layer.name in pinned:
                continue
            if layer.name not in moves:
                new = step(layer)
                moves[layer.name] = None if new is None else (new, state[layer.name] - _state_bytes(make(new)))
            move = moves[layer.name]
            if move is not None and move[1] > 0 and (best is None or move[1] > best[0]):
                best = (move[1], i, move[0])
        if best is None:
            largest = max(layers, key=lambda l: state[l.name])
            raise ConfigError(
                f"the model's curvature keeps {human_bytes(total)} of factors, inverses and their buffers, more than the "
                f"{human_bytes(memory)} of memory the budget allows (budget.memory_gb), and no layer left to the compiler "
                f"has a smaller approximation; the largest is layer {largest.name!r} ({largest.approximation}, "
                f"{human_bytes(state[largest.name])}): choose diagonal approximations or exclude parameters")
        saving, i, new = best
        old = layers[i]
        layers[i] = new
        moves.pop(old.name)
        notes.append(
            f"layer {old.name!r}: approximated as {new.approximation} instead of {old.approximation} "
            f"({human_bytes(state[old.name])} -> {human_bytes(state[old.name] - saving)}) so that the model's curvature "
            f"state ({human_bytes(total)} before this step) fits the {human_bytes(memory)} of memory the budget allows "
            f"(budget.memory_gb)")
        state[old.name] -= saving
        total -= saving
    return layers


def _smallest(periods: tuple[int, ...], total: int, allowance: float) -> int:
    for p in periods:
        if total / p <= allowance:
            return p
    return periods[-1]


__all__ = ["BlockCost", "BudgetResult", "DIAGONAL_STEPS", "estimator_passes", "INVERSE_PERIODS", "REFERENCE_BATCH", "STATS_PERIODS", "block_cost",
           "fit_budget"]
