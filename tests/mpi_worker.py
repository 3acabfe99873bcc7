"""A training run for the data-parallel tests: `python tests/mpi_worker.py OUT CONFIG_JSON` on
every rank (under mpirun) writes OUT/rank<r>.json with its losses, parameters, communication
bytes, inverse owners and
factors after the first step; `train(config, comm=None)` is the same run in one process.

CONFIG: model (a zoo name), optimizer, steps, batch (global), knobs (dict), seed, optionally
approximations (the compile config's {layer kind: block}) and links (compile's: user-linked,
generic layers); knobs' accumulate k splits each batch into k micro-batches, one step() each; optionally ignore_index
(softmax cross-entropy's: the targets of every example whose index is a multiple of 3 or
below 40 are set to it, so that the ranks' shares hold different numbers of them); optionally
ulp (true: every initial parameter one float32 ulp up, np.nextafter: a rounding-sized start,
the reference scale of how far the optimizer carries rounding); optionally same_rows (true:
on P ranks every rank trains on the whole batch, the global batch being P copies of it: each
all-reduce then averages P equal values, exactly on 2 ranks and in Open MPI's recursive
doubling on 4, so what the ranks compute differently from one process, other than summation
order, shows as a difference at all)."""
from __future__ import annotations

import json
import os
import sys


def train(config: dict, comm="auto") -> dict:
    import numpy as np

    import kfac_compiler as kc
    from kfac_compiler import contract as C
    from kfac_compiler.models import ZOO
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    entry = ZOO[config["model"]]
    ignore = config.get("ignore_index")
    options = {} if ignore is None else {"ignore_index": int(ignore)}
    approximations = config.get("approximations")
    plan = kc.compile(entry.build(seed=0), loss=entry.loss, output=entry.output_name, loss_options=options,
                      config={"approximations": approximations} if approximations else None,
                      links=config.get("links", []))
    batch = int(config["batch"])
    from kfac_compiler.runtime.comm import launched_ranks
    copies = launched_ranks() if config.get("same_rows") and comm is not None else 1
    trainer = Trainer(plan, optimizer=config.get("optimizer", "kfac"), seed=int(config.get("seed", 0)),
                      batch_size=copies * batch // config.get("knobs", {}).get("accumulate", 1), comm=comm,
                      **config.get("knobs", {}))
    if config.get("ulp"):
        trainer.set_parameters({p: np.nextafter(v, np.float32(np.inf)) for p, v in trainer.parameters().items()})
    inputs, targets = entry.make_data(n=256)
    if ignore is not None:
        rows = np.arange(len(targets))
        targets = np.where(((rows % 3 == 0) | (rows < 40)).reshape(-1, *[1] * (targets.ndim - 1)), int(ignore), targets)
    losses, metrics, first_factors = [], [], {}
    for step in range(int(config["steps"])):
        idx = np.tile(batch_indices(256, batch, step, 0), copies)
        for part in np.split(idx, trainer.config.accumulate):
            m = trainer.step({k: v[part] for k, v in inputs.items()}, targets[part])
        losses.append(m["loss"])
        metrics.append({k: m[k] for k in ("damping", "rejected", "learning_rate", "momentum") if k in m})
        if step == 0:  # the first step's factors: before the steps can amplify any rounding
            first_factors = {s: trainer.store.to_numpy(s).tolist() for s in trainer.store.slots()
                             if C.parse_slot(s).kind == C.FACTOR}
    refresher = getattr(trainer.policy, "refresher", None)
    owned = sorted({C.parse_slot(s).owner for p in (refresher.programs if refresher else []) if p is not None
                    for s in p.written_slots})
    return {"rank": trainer.rank, "ranks": trainer.ranks, "losses": losses, "metrics": metrics,
            "params": {p: v.tolist() for p, v in trainer.parameters().items()},
            "sent": dict(trainer.comm.sent) if trainer.comm else {},
            "owners": getattr(refresher, "owners", None), "owned": owned, "first_factors": first_factors,
            "threads": trainer.threads}


if __name__ == "__main__":
    out, config = sys.argv[1], json.loads(sys.argv[2])
    result = train(config)
    with open(os.path.join(out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
