"""What a data-parallel run shares between its ranks besides the step's reductions: the
factors' moving averages (averaged where they are read) and the inverse work (each block's
inverse computed by one owner rank and broadcast).

Each rank folds its own examples' factor statistics into its own moving averages; the
average is linear in the statistics, so the ranks' mean of their moving averages IS the moving
average of the whole batches' statistics. The factors of a refresh group are therefore
all-reduced right before that group's inverses are refreshed (once per inv_update_period
steps) rather than on every statistics step: the same factors, inv_update_period /
cov_update_period times fewer bytes (docs/distributed.md).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler.plan import Plan
from kfac_compiler.runtime.comm import Communicator, mpi
from kfac_compiler.runtime.device import physical_cores
from kfac_compiler.runtime.inverses import InverseRefresher
from kfac_compiler.runtime.program import Program, SubgraphIO
from kfac_compiler.runtime.state import StateStore


def cpu_share(comm: Communicator) -> int:
    """ONNX Runtime threads per rank: the machine's physical cores over the ranks on it (ranks
    sharing a node would otherwise each spin a pool as wide as the machine)."""
    local = comm.comm.Split_type(mpi().COMM_TYPE_SHARED).Get_size()
    return max(1, physical_cores() // max(1, int(local)))


def mean_factors(store: StateStore, comm: Communicator, layers: Collection[str] | None = None) -> None:
    """Replace the factor slots of `layers` (all when None) by their mean over the ranks."""
    slots = [s for layer, items in sorted(C.layer_slots(store.slots(), C.FACTOR).items())
             if layers is None or layer in layers for s in items.values()]
    for slot, mean in zip(slots, comm.mean([store.read_only(s) for s in slots], "factors")):
        store.set(slot, mean)


class SharedRefresher:
    """An InverseRefresher whose work is split over the ranks: per refresh group, the group's
    factors are averaged over the ranks, each rank refreshes the blocks it owns, and each
    owner broadcasts its blocks' inverses. Same call and attributes as InverseRefresher."""

    def __init__(self, plan: Plan, emitted: SubgraphIO | Sequence[SubgraphIO | None], reader: Program, method: str,
                 groups: Sequence[Sequence[str]] | None, owners: Mapping[str, int] | None, comm: Communicator,
                 power: float = -1.0) -> None:
        self.comm = comm
        self.slots = C.layer_slots(reader.state_inputs, C.INVERSE)
        self.groups = [list(g) for g in groups] if groups is not None else [list(self.slots)]
        # without an assignment (an optimizer plugin that makes none) rank 0 refreshes every block
        self.owners = dict(owners) if owners is not None else {layer: 0 for layer in self.slots}
        mine = {layer for layer in self.slots if self.owners[layer] == comm.rank}
        local_groups = [[layer for layer in g if layer in mine] for g in self.groups]
        programs = [emitted] if isinstance(emitted, SubgraphIO) else list(emitted)
        programs = [p if g else None for p, g in zip(programs, local_groups)]  # groups this rank owns none of
        self.local = InverseRefresher(plan, programs, reader, method, local_groups, layers=mine, power=power)
        self.fallbacks: list[str] = []

    @property
    def programs(self) -> list[SubgraphIO | None]:
        return self.local.programs

    def __call__(self, store: StateStore, damping: float, group: int | None = None) -> bool:
        """Refresh every group (or group `group`) on every rank; False if a block failed on
        any rank. Collective."""
        ok, fallbacks = True, []
        for j in range(len(self.groups)) if group is None else [group]:
            layers = self.groups[j]
            mean_factors(store, self.comm, layers)
            ok = self.local(store, damping, j) and ok
            fallbacks += self.local.fallbacks
            self._broadcast(store, layers)
        self.fallbacks = [name for names in self.comm.gather(fallbacks) for name in names]
        return self.comm.minimum(1.0 if ok else 0.0) > 0.5

    def _broadcast(self, store: StateStore, layers: Sequence[str]) -> None:
        """Every inverse of `layers` from its owner to the other ranks (one broadcast per owner)."""
        for owner in range(self.comm.size):
            slots = [s for layer in layers if self.owners[layer] == owner for s in self.slots[layer].values()]
            if not slots:
                continue
            if owner == self.comm.rank:
                arrays = [store.read_only(s) for s in slots]
            else:
                arrays = [np.empty(*store.spec(s)) for s in slots]
            received = self.comm.broadcast(arrays, owner, "inverses")
            if owner != self.comm.rank:
                for slot, value in zip(slots, received):
                    store.set(slot, value)
