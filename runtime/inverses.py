"""Refreshing the damped inverses: the emitted `inverse_update` subgraph for the blocks it
covers, the blocks' numpy twins on the host for the rest (host methods such as "cholesky" or
"eigh", exact damping, the RNN series blocks), and host Cholesky for every emitted block
whose inverse failed its check (linalg.FALLBACK_METHOD: "schur" beyond its accuracy bound,
a singular matrix for "inverse_op"). Shared by Trainer and Curvature."""
from __future__ import annotations

from typing import Any

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler import linalg
from kfac_compiler.contract import plan_blocks
from kfac_compiler.plan import Plan
from kfac_compiler.runtime.program import Program
from kfac_compiler.runtime.state import StateStore


class InverseRefresher:
    """Knows which inverse slots `reader` (a step or precondition program) needs that
    `emitted` (inverse_update) does not write, and recomputes all of them on demand."""

    def __init__(self, plan: Plan, emitted: Program, reader: Program, method: str) -> None:
        self.plan, self.emitted, self.method = plan, emitted, method
        # A failed block keeps its inverse in the store (it is not written), so the previous
        # inverse is downloaded only for a warm start (saves ~1 MB of copies per refresh)
        self.warm = linalg.concrete_method(method) in linalg.WARM_STARTED_METHODS
        written = set(emitted.written_slots)
        self.host_layers: dict[str, list[str]] = {}
        self.emitted_layers: dict[str, list[str]] = {}
        for layer, slots in C.layer_slots(reader.state_inputs, C.INVERSE).items():
            for slot in slots.values():
                group = self.emitted_layers if slot in written else self.host_layers
                group.setdefault(layer, []).append(slot)
        self.blocks = plan_blocks(plan, list(self.host_layers)) if self.host_layers else {}
        if self.host_layers:
            linalg.prepare_host_inverses()  # one-time imports and library scans: not in a step
        self.fallbacks: list[str] = []  # the emitted blocks the last refresh redid on the host

    def __call__(self, store: StateStore, damping: float) -> bool:
        """Refresh every inverse for `damping`; False if a block failed (it keeps its previous
        inverse). An emitted block that failed is redone by host Cholesky first."""
        ok = True
        self.fallbacks = []
        if self.emitted.written_slots:  # nothing to run when every block is on the host
            out = self.emitted.run(store, hp={C.DAMPING: float(damping)})
            if out.get(C.INVERSE_OK, 1.0) < 0.5:
                self.fallbacks = [layer for layer in self.emitted_layers
                                  if out.get(C.inverse_ok(layer), 0.0) < 0.5]
        if not (self.host_layers or self.fallbacks):
            return ok
        with linalg.one_blas_thread():  # one thread-limit switch for all blocks
            for layer, slots in self.host_layers.items():
                ok = self._refresh_host_block(store, damping, layer, slots, self.method) and ok
            for layer in self.fallbacks:
                slots = self.emitted_layers[layer]
                ok = self._refresh_host_block(store, damping, layer, slots, linalg.FALLBACK_METHOD) and ok
        return ok

    def _block(self, layer: str) -> Any:
        if layer not in self.blocks:
            linalg.prepare_host_inverses()
            self.blocks.update(plan_blocks(self.plan, [layer]))
        return self.blocks[layer]

    def _refresh_host_block(self, store: StateStore, damping: float, layer: str, slots: list[str],
                            method: str) -> bool:
        # no copies: the block copies what it damps, and nothing writes the slots meanwhile
        factors = {f: store.read_only(s) for f, s in C.layer_slots(store.slots(), C.FACTOR).get(layer, {}).items()}
        items = {C.parse_slot(s).item: s for s in slots}
        warm = self.warm and method == self.method
        previous = {i: store.to_numpy(s) for i, s in items.items()} if warm else None
        state, block_ok = self._block(layer).numpy_inverse(factors, float(damping), method=method,
                                                           previous=previous)
        if block_ok:
            for i, slot in items.items():
                store.set(slot, np.asarray(state[i]))
        return bool(block_ok)
