"""Which blocks' inverses K-FAC refreshes after which step.

A refresh of every block at once costs what its largest factors cost: on ResNet-18 (conv A
factors up to 4609 wide, ~470 GFLOP by `schur`) about 5 s on one core, after a step of 1 s.
So the blocks can be partitioned into groups balanced by predicted cost (the blocks'
`inverse_flops`), and one group is refreshed after each of the first few steps of the
period: group j after step k when k % period == j. Every block is still
refreshed once per inv_update_period steps, the first step refreshes all of them, and the
schedule is a function of the step count, so a checkpoint (which stores the step count and
the knobs) resumes it where it stopped.

"auto" (the default): one group (every block after every period-th step, as before) while
the whole refresh is cheap, SPREAD_FLOPS or less; beyond that as few groups as reach the
smallest possible largest group, max(largest block, SPREAD_FLOPS), at most one per step of
the period (docs/runtime.md, "Spread refreshes").
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from kfac_compiler.errors import ConfigError

# A refresh up to this many FLOPs runs at once: ~0.2 s of schur on one core of the reference
# machine (~100 GFLOP/s). Spreading costs nodes: every group inverts its own stacks, a Schur
# tree per size class, where one refresh stacks every block of a class into one tree. At
# 1e9 (~10 ms, chosen for a group's session switch of ~0.3 ms) the GPT export's 16-GFLOP
# refresh ran in 10 groups, 5,855 nodes per period (586 per step amortized, ~1/4 of its
# steady step's executed nodes), in one group 1,638; the digits ResNet-18's 10-GFLOP one in
# 5 groups 2,962, in one 1,786 (benchmarks/results/2026-11-29-step-nodes-lean.md). The
# flops are the same, so below this a spread only trades total work for a smaller largest
# step. The zoo's refreshes are 0.01-0.1 GFLOP; ImageNet-sized ResNet-18's ~470 (spread
# into 4 groups, its 131-GFLOP blocks each alone).
SPREAD_FLOPS = 2e10
# On the CPU a refresh program with a factor at least this wide runs on ONNX Runtime's
# default thread pool (no spinning), a narrower one on one thread. schur on two threads
# against one (benchmarks/bench_inverse.py scale, quiet machine): 0.91-1.06x up to n = 1153,
# 0.58x at 2305, 0.51x at 4609; the zoo's refresh (~1300 small nodes) lost on two
# non-spinning threads (1.4-1.8x: a wake-up per node). In the trainer, right after a step,
# ResNet-18's 4609-wide groups took 0.64x the time on two threads.
MULTI_THREAD_WIDTH = 2048
AUTO = "auto"


def check_groups(value: int | str) -> int | str:
    """The knob's value: "auto" or an int >= 1."""
    if value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"inverse_groups must be 'auto' or an integer >= 1, got {value!r}")
    return value


def refresh_threads(width: int, device: str) -> int | None:
    """Intra-op threads of a refresh program whose widest factor has `width` rows: 1 on the
    CPU below MULTI_THREAD_WIDTH, else None (the trainer's setting, ORT's default pool)."""
    return 1 if device == "cpu" and width < MULTI_THREAD_WIDTH else None


def widest_factor(specs) -> int:
    """Rows of the widest square matrix among a block's inverse_specs() (0 when none)."""
    return max((int(s.shape[-1]) for s in specs if len(s.shape) >= 2 and s.shape[-1] == s.shape[-2]), default=0)


def group_count(costs: Mapping[str, float], period: int, groups: int | str = AUTO) -> int:
    """How many groups the blocks with these refresh costs are split into: the knob when it
    is a number (at most one group per block and per step of the period), else "auto"."""
    cap = max(1, min(int(period), len(costs)))
    if groups != AUTO:
        return min(int(groups), cap)
    total = float(sum(costs.values()))
    if total <= SPREAD_FLOPS:
        return 1
    floor = max(max(costs.values()), SPREAD_FLOPS)
    return min(cap, math.ceil(total / floor))


def balanced_groups(costs: Mapping[str, float], count: int) -> list[list[str]]:
    """`count` groups of the layers, balanced by cost: longest processing time first (each
    block, dearest first, joins the cheapest group so far; ties go to the lower index), so
    the dearest group costs at most 4/3 of the optimum. Within a group the layers keep their
    order in `costs`. Deterministic: a resumed run gets the same groups."""
    order = {layer: i for i, layer in enumerate(costs)}
    loads = [0.0] * count
    members: list[list[str]] = [[] for _ in range(count)]
    for layer in sorted(costs, key=lambda l: (-costs[l], order[l])):
        j = min(range(count), key=lambda i: (loads[i], i))
        loads[j] += float(costs[layer])
        members[j].append(layer)
    return [sorted(m, key=order.__getitem__) for m in members if m]


def inverse_owners(costs: Mapping[str, float], ranks: int) -> dict[str, int]:
    """layer -> the rank of a data-parallel run that computes its inverse: the blocks balanced
    over the ranks by refresh cost (balanced_groups), every block rank 0's in one process.
    Deterministic, so every rank (and `inspect --ranks`) computes the same assignment."""
    if ranks <= 1:
        return {layer: 0 for layer in costs}
    return {layer: rank for rank, group in enumerate(balanced_groups(costs, ranks)) for layer in group}


def due_group(step: int, period: int, count: int) -> int | None:
    """The group refreshed after step `step` (None: no refresh): group j after the steps k
    with k % period == j (count <= period), so group 0 keeps the steps a single refresh had
    (k % period == 0). Consecutive steps, not spread evenly over the period: the blocks'
    inverses then differ in age by at most count - 1 steps and the preconditioner stays
    close to one taken at a single time (the digits classifier, batch 128, seeds 0-7,
    groups of period 10 at steps 0, 3, 6: one seed missed the target in 400 steps, the
    others 150-285; at steps 0, 1, 2: 185-245, one group: 160-345)."""
    phase = step % period
    return phase if phase < count else None
