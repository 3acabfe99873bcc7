"""Refreshing the damped inverses: the emitted `inverse_update` subgraph for the blocks it
covers, the blocks' numpy twins on the host for the rest (host methods such as "cholesky" or
"eigh", exact damping, the RNN series blocks), and host Cholesky for every emitted block
whose inverse failed its check (linalg.FALLBACK_METHOD: "schur" beyond its accuracy bound,
a singular matrix for "inverse_op"). Shared by Trainer and Curvature.

The blocks may be split into groups, each with its own `inverse_update(layers=...)` program,
so that a caller can refresh one group at a time (K-FAC spreads a big refresh over the steps
of its period: optimizers/kfac/refresh.py)."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler import linalg
from kfac_compiler.host_blocks import host_blocks
from kfac_compiler.plan import Plan
from kfac_compiler.runtime.program import ContractError, Program, SubgraphIO
from kfac_compiler.runtime.state import StateStore


class InverseRefresher:
    """Knows which inverse slots `reader` (a step or precondition program) needs, which of
    them the emitted programs write, and recomputes all of them (or one group's) on demand.

    `emitted`: one inverse_update program, or one per group of `groups` (lists of layer
    names that partition the layers `reader` needs inverses of; program j writes only
    layers of group j, the group's other layers are refreshed on the host)."""

    def __init__(self, plan: Plan, emitted: SubgraphIO | Sequence[SubgraphIO | None], reader: Program, method: str,
                 groups: Sequence[Sequence[str]] | None = None, layers: Collection[str] | None = None,
                 power: float = -1.0) -> None:
        # power != -1 (K-FAC's precon_power): the slots hold (F + damping)^power's state, the
        # emitted programs are power_update ones, the host computes numpy_power_state
        self.plan, self.method, self.power = plan, method, float(power)
        # None: a group without an emitted program (no block of it is this refresher's)
        self.programs = [emitted] if isinstance(emitted, SubgraphIO) else list(emitted)
        # A failed block keeps its inverse in the store (it is not written), so the previous
        # inverse is downloaded only for a warm start (saves ~1 MB of copies per refresh)
        self.warm = linalg.concrete_method(method) in linalg.WARM_STARTED_METHODS
        needed = C.layer_slots(reader.state_inputs, C.INVERSE)
        if layers is not None:  # a data-parallel rank refreshes the blocks it owns
            needed = {layer: slots for layer, slots in needed.items() if layer in layers}
        if groups is None:
            groups = [list(needed)]
        self.groups = [list(g) for g in groups]
        self._check_groups(needed)
        self.host_layers: dict[str, list[str]] = {}
        self.emitted_layers: dict[str, list[str]] = {}
        self._group_host: list[list[str]] = []
        self._group_emitted: list[list[str]] = []
        for group, prog in zip(self.groups, self.programs):
            written = set(prog.written_slots) if prog is not None else set()
            host, emitted_here = [], []
            for layer in group:
                slots = list(needed[layer].values())
                if all(s in written for s in slots):
                    self.emitted_layers[layer] = slots
                    emitted_here.append(layer)
                else:
                    self.host_layers[layer] = slots
                    host.append(layer)
            self._group_host.append(host)
            self._group_emitted.append(emitted_here)
        self.blocks = host_blocks(plan, list(self.host_layers)) if self.host_layers else {}
        if self.host_layers:
            linalg.prepare_host_inverses()  # one-time imports and library scans: not in a step
        self.fallbacks: list[str] = []  # the emitted blocks the last refresh redid on the host
        self.failed: list[str] = []  # the blocks the last refresh could not update (they kept their state)

    def _check_groups(self, needed: dict[str, dict[str, str]]) -> None:
        """The groups partition the layers the reader needs; program j writes group j only."""
        seen = [layer for g in self.groups for layer in g]
        if sorted(seen) != sorted(needed) or len(self.groups) != len(self.programs):
            raise ContractError("inverse refresh groups must partition the layers the reader needs, "
                                "with one inverse_update program per group")
        for group, prog in zip(self.groups, self.programs):
            mine = {s for layer in group for s in needed[layer].values()}
            stray = sorted(set(prog.written_slots if prog is not None else ()) - mine)
            if stray:
                raise ContractError(f"inverse_update program writes {stray[0]!r} outside its group")

    @property
    def emitted(self) -> SubgraphIO:
        """The inverse_update program when there is one group (the whole refresh)."""
        if len(self.programs) != 1:
            raise AttributeError("the refresh has several groups: see .programs")
        return self.programs[0]

    def __call__(self, store: StateStore, damping: float, group: int | None = None) -> bool:
        """Refresh every inverse (or group `group`'s) for `damping`; False if a block failed
        (it keeps its previous inverse). An emitted block that failed is redone by host
        Cholesky first."""
        self.fallbacks, self.failed = [], []
        ok = True
        for j in range(len(self.groups)) if group is None else [group]:
            ok = self._refresh_group(store, damping, j) and ok
        return ok

    def _refresh_group(self, store: StateStore, damping: float, j: int) -> bool:
        ok = True
        prog, host, fallbacks = self.programs[j], self._group_host[j], []
        if prog is not None and prog.written_slots:  # nothing to run when every block of the group is on the host
            out = prog.run(store, hp={C.DAMPING: float(damping)})
            if out.get(C.INVERSE_OK, 1.0) < 0.5:
                fallbacks = [layer for layer in self._group_emitted[j] if out.get(C.inverse_ok(layer), 0.0) < 0.5]
        self.fallbacks += fallbacks
        if not (host or fallbacks):
            return ok
        with linalg.one_blas_thread():  # one thread-limit switch for all blocks
            for layer in host:
                ok = self._refresh_host_block(store, damping, layer, self.host_layers[layer], self.method) and ok
            for layer in fallbacks:
                slots = self.emitted_layers[layer]
                fallback = linalg.FALLBACK_METHOD if self.power == -1 else "eigh"
                ok = self._refresh_host_block(store, damping, layer, slots, fallback, float64=True) and ok
        return ok

    def _block(self, layer: str) -> Any:
        if layer not in self.blocks:
            linalg.prepare_host_inverses()
            self.blocks.update(host_blocks(self.plan, [layer]))
        return self.blocks[layer]

    def _refresh_host_block(self, store: StateStore, damping: float, layer: str, slots: list[str],
                            method: str, float64: bool = False) -> bool:
        """`float64`: in double precision (a fallback redoes a block beyond the emitted method's
        accuracy, cond >~ 1e5: float32 Cholesky's error grows like cond eps, 32-38% at 1e8)."""
        # no copies: the block copies what it damps, and nothing writes the slots meanwhile
        factors = {f: store.read_only(s) for f, s in C.layer_slots(store.slots(), C.FACTOR).get(layer, {}).items()}
        if float64:
            factors = {f: v.astype(np.float64) for f, v in factors.items()}
        items = {C.parse_slot(s).item: s for s in slots}
        warm = self.warm and method == self.method
        previous = {i: store.to_numpy(s) for i, s in items.items()} if warm else None
        state, block_ok = self._block(layer).numpy_power_state(factors, float(damping), self.power, method=method,
                                                               previous=previous)
        # judged in the slots' dtype: a power finite in float64 can overflow float32 (precon_power
        # -50 wrote inf into G_inv and reported it ok)
        with np.errstate(over="ignore"):
            values = {i: np.asarray(state[i], dtype=store.spec(slot)[1]) for i, slot in items.items()} if block_ok else {}
        block_ok = bool(block_ok) and all(np.all(np.isfinite(v)) for v in values.values())
        if not block_ok:
            self.failed.append(layer)
            return False
        for i, slot in items.items():
            store.set(slot, values[i])
        return True
