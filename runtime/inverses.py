"""Refreshing the damped inverses: the emitted `inverse_update` subgraph for the blocks it
covers, the blocks' numpy twins on the host for the rest (host methods such as "cholesky" or
"eigh", exact damping, the RNN series blocks). Shared by Trainer and Curvature."""
from __future__ import annotations

from typing import Any

import numpy as np

from kfac_compiler import linalg
from kfac_compiler.runtime.program import Program, plan_blocks
from kfac_compiler.runtime.state import StateStore


class InverseRefresher:
    """Knows which inverse slots `reader` (a step or precondition program) needs that
    `emitted` (inverse_update) does not write, and recomputes all of them on demand."""

    def __init__(self, plan: Any, emitted: Program, reader: Program, method: str) -> None:
        self.emitted, self.method = emitted, method
        # A failed block keeps its inverse in the store (it is not written), so the previous
        # inverse is downloaded only for a warm start (saves ~1 MB of copies per refresh)
        self.warm = linalg.concrete_method(method) in linalg.WARM_STARTED_METHODS
        written = set(emitted.written_slots)
        self.host_layers: dict[str, list[str]] = {}
        for slot in reader.state_inputs:
            if slot.startswith("inverse/") and slot not in written:
                layer = slot[len("inverse/"):].rpartition("/")[0]
                self.host_layers.setdefault(layer, []).append(slot)
        self.blocks = plan_blocks(plan, list(self.host_layers)) if self.host_layers else {}
        if self.host_layers:
            linalg.prepare_host_inverses()  # one-time imports and library scans: not in a step

    def __call__(self, store: StateStore, damping: float) -> bool:
        """Refresh every inverse for `damping`; False if a block failed (it keeps its previous
        inverse)."""
        ok = True
        if self.emitted.written_slots:  # nothing to run when every block is on the host
            out = self.emitted.run(store, hp={"hp/damping": float(damping)})
            ok = out.get("metric/inverse_ok", 1.0) > 0.5
        with linalg.one_blas_thread():  # one thread-limit switch for all blocks
            for layer, slots in self.host_layers.items():
                ok = self._refresh_host_block(store, damping, layer, slots) and ok
        return ok

    def _refresh_host_block(self, store: StateStore, damping: float, layer: str, slots: list[str]) -> bool:
        fprefix, iprefix = f"factor/{layer}/", f"inverse/{layer}/"
        # no copies: the block copies what it damps, and nothing writes the slots meanwhile
        factors = {s[len(fprefix):]: store.read_only(s) for s in store.slots() if s.startswith(fprefix)}
        previous = {s[len(iprefix):]: store.to_numpy(s) for s in slots} if self.warm else None
        state, block_ok = self.blocks[layer].numpy_inverse(factors, float(damping), method=self.method,
                                                          previous=previous)
        if block_ok:
            for slot in slots:
                store.set(slot, np.asarray(state[slot[len(iprefix):]]))
        return bool(block_ok)
