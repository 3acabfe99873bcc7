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
the reference scale of how far the optimizer carries rounding); optionally check_declared (true:
every cut step's stages, as run on this rank's last step, have their declared shapes checked
against the run-time ones by test_declared_shapes.check_declared: "declared" holds, per stage,
how many were declared and the symbols' values); optionally bare (true: the steps emitted
without declared shapes, as before backend/shapes.py); optionally weight_norm (a list of conv
weight initializers, each computed at run time as torch's weight_norm(dim=0) exports it,
w = v * (g / ||v||), from the trainable v (w's values) and g (||w|| per output channel): the
weight-normed conv block, blocks/weight_norm.py); optionally same_rows (true: on P ranks every
rank trains on the whole batch, the global batch being P copies of it: each all-reduce then
averages P equal values, exactly on 2 ranks and in Open MPI's recursive doubling on 4, so what
the ranks compute differently from one process, other than summation order, shows as a
difference at all)."""
from __future__ import annotations

import json
import os
import sys


def record_stage_feeds() -> dict:
    """{id(stage program): its inputs' values at its latest run} (host copies, taken before the
    run: the store's current state, the batch, the hyper-parameters, the carried tensors),
    recorded by a wrapper of Program.run around the stages' runs (calls with `carried`); the
    caller restores Program.run."""
    import numpy as np

    from kfac_compiler.runtime.program import Program

    feeds: dict = {}
    original = Program.run

    def run(self, store, data=None, hp=None, results=False, channel="train", carried=None, **kw):
        if carried is not None:
            got = {n: store.current(n).numpy() for n in self.state_inputs}
            got.update({n: store.data(n, channel).numpy() for n in self.data_inputs})
            got.update({n: store.hp(n).numpy() for n in self.hp_inputs})
            got.update({n: v.numpy() for n, v in carried.items()})
            feeds[id(self)] = {n: np.array(v, copy=True) for n, v in got.items()}
        return original(self, store, data, hp, results, channel, carried=carried, **kw)

    Program.run = run  # type: ignore[method-assign]
    return feeds


def check_stage_shapes(trainer, feeds: dict, rows: int) -> dict:
    """{"<k> <stage program>": {"declared": count, "symbols": {symbol: value}}} for every stage
    of the trainer's k-th program (a cut step) that declares shapes, each checked on the feeds of
    its latest run."""
    from test_declared_shapes import check_declared

    out = {}
    for k, prog in enumerate(trainer._programs.values()):
        for stage, sp in zip(getattr(prog, "stages", []), getattr(prog, "programs", [])):
            if len(stage.model.graph.value_info) and id(sp) in feeds:
                out[f"{k} {sp.name}"] = {"declared": len(stage.model.graph.value_info),
                                "symbols": check_declared(stage.model, feeds[id(sp)], rows)}
    return out


def weight_normed(model, weights: list[str]):
    """`model` (changed in place) with each weight of `weights` computed as torch's
    weight_norm(dim=0) exports it: w = v * (g / ReduceL2(v, all but axis 0)), v and g
    initializers named <weight>_v and <weight>_g, the same w at the start."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    nodes = []
    for w in weights:
        value = numpy_helper.to_array(inits[w])
        axes = list(range(1, value.ndim))
        g = np.sqrt((value.astype(np.float64) ** 2).sum(axis=tuple(axes), keepdims=True)).astype(np.float32)
        model.graph.initializer.remove(inits[w])
        model.graph.initializer.extend([numpy_helper.from_array(value, f"{w}_v"), numpy_helper.from_array(g, f"{w}_g")])
        nodes += [helper.make_node("ReduceL2", [f"{w}_v"], [f"{w}/norm"], axes=axes, keepdims=1),
                  helper.make_node("Div", [f"{w}_g", f"{w}/norm"], [f"{w}/gain"]),
                  helper.make_node("Mul", [f"{w}_v", f"{w}/gain"], [w])]
    rest = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes + rest)
    return model


def train(config: dict, comm="auto") -> dict:
    from kfac_compiler.backend.shapes import DeclaredShapes
    from kfac_compiler.runtime.program import Program

    declare, run = DeclaredShapes.declare, Program.run
    try:
        if config.get("bare"):
            DeclaredShapes.declare = lambda self, model, like: 0  # type: ignore[method-assign]
        return _train(config, comm)
    finally:  # as they were, for the test process's one-process runs
        DeclaredShapes.declare, Program.run = declare, run  # type: ignore[method-assign]


def _train(config: dict, comm) -> dict:
    import numpy as np

    import kfac_compiler as kc
    from kfac_compiler import contract as C
    from kfac_compiler.models import ZOO
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    feeds = record_stage_feeds() if config.get("check_declared") else {}
    entry = ZOO[config["model"]]
    ignore = config.get("ignore_index")
    options = {} if ignore is None else {"ignore_index": int(ignore)}
    approximations = config.get("approximations")
    plan = kc.compile(weight_normed(entry.build(seed=0), config.get("weight_norm", [])),
                      loss=entry.loss, output=entry.output_name, loss_options=options,
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
    declared = check_stage_shapes(trainer, feeds, batch // trainer.ranks) if config.get("check_declared") else {}
    refresher = getattr(trainer.policy, "refresher", None)
    owned = sorted({C.parse_slot(s).owner for p in (refresher.programs if refresher else []) if p is not None
                    for s in p.written_slots})
    return {"rank": trainer.rank, "ranks": trainer.ranks, "losses": losses, "metrics": metrics,
            "params": {p: v.tolist() for p, v in trainer.parameters().items()},
            "sent": dict(trainer.comm.sent) if trainer.comm else {},
            "owners": getattr(refresher, "owners", None), "owned": owned, "first_factors": first_factors,
            "threads": trainer.threads, "declared": declared}


if __name__ == "__main__":
    out, config = sys.argv[1], json.loads(sys.argv[2])
    result = train(config)
    with open(os.path.join(out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
