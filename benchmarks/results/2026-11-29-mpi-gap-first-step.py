"""Two ranks against one process after the first step, before any amplification (the
"masked rows with accumulation" section of 2026-11-29-mpi-gap.md):

    python benchmarks/results/2026-11-29-mpi-gap-first-step.py CONFIG_JSON

CONFIG: a tests/mpi_worker.py configuration (zoo model, batch, ignore_index, knobs); the run
is one step of it. Prints, per factor, the relative gap between the ranks' and one process's
factor, and for its damped inverse: the condition number, the gap between the exact float64
inverses of the two factors, between the two stored float32 inverses, and between each stored
inverse and the float64 inverse of its own factor (the damping is read off the stored inverse).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def state_after_one_step(config: dict, comm) -> tuple[int, dict[str, np.ndarray]]:
    """(rank, every factor and inverse slot) after the first step of `config` (tests/mpi_worker.py's
    model, data and masking)."""
    import kfac_compiler as kc
    from kfac_compiler import contract as C
    from kfac_compiler.models import ZOO
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    entry = ZOO[config["model"]]
    ignore = config.get("ignore_index")
    plan = kc.compile(entry.build(seed=0), loss=entry.loss, output=entry.output_name,
                      loss_options={} if ignore is None else {"ignore_index": int(ignore)})
    knobs = config.get("knobs", {})
    batch = int(config["batch"])
    trainer = Trainer(plan, optimizer="kfac", seed=0, batch_size=batch // knobs.get("accumulate", 1), comm=comm,
                      **knobs)
    inputs, targets = entry.make_data(n=256)
    if ignore is not None:
        rows = np.arange(len(targets))
        targets = np.where((rows % 3 == 0) | (rows < 40), int(ignore), targets)
    for part in np.split(batch_indices(256, batch, 0, 0), trainer.config.accumulate):
        trainer.step({k: v[part] for k, v in inputs.items()}, targets[part])
    return trainer.rank, {s: trainer.store.to_numpy(s) for s in trainer.store.slots()
                          if C.parse_slot(s).kind in (C.FACTOR, C.INVERSE)}


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        rank, state = state_after_one_step(json.loads(sys.argv[3]), "auto")
        if rank == 0:
            np.savez(sys.argv[2], **{k.replace("/", "|"): v for k, v in state.items()})
        sys.exit(0)
    from kfac_compiler import contract as C
    from mpi_util import rank_command

    config = json.loads(sys.argv[1])
    out = os.path.join(tempfile.mkdtemp(), "ranks.npz")
    p = subprocess.run(rank_command(2, [sys.executable, os.path.abspath(__file__), "--worker", out, json.dumps(config)]),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with np.load(out) as z:
        ranks = {k.replace("|", "/"): z[k].astype(np.float64) for k in z.files}
    one = {k: v.astype(np.float64) for k, v in state_after_one_step(config, None)[1].items()}

    def rel(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.abs(x - y).max() / np.abs(y).max())

    for slot in sorted(s for s in one if C.parse_slot(s).kind == C.FACTOR):
        name = C.parse_slot(slot)
        inv = C.inverse(name.owner, f"{name.item}_inv")
        a_r, a_1, i_r, i_1 = ranks[slot], one[slot], ranks[inv], one[inv]
        eye = np.eye(len(a_1))
        damping = float(np.mean(np.diag(np.linalg.inv(i_1) - a_1)))
        e_r, e_1 = np.linalg.inv(a_r + damping * eye), np.linalg.inv(a_1 + damping * eye)
        ev = np.linalg.eigvalsh(a_1 + damping * eye)
        print(f"{slot}: n {len(a_1)}, condition {ev[-1] / ev[0]:.1e}; factors {rel(a_r, a_1):.1e}; "
              f"float64 inverses {rel(e_r, e_1):.1e}; stored inverses {rel(i_r, i_1):.1e}; "
              f"stored vs float64, one process {rel(i_1, e_1):.1e}, ranks {rel(i_r, e_r):.1e}")
