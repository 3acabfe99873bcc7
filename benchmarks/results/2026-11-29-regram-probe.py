"""P ranks against one process, quantity by quantity and step by step (2026-11-29-regram.md).

    python benchmarks/results/2026-11-29-regram-probe.py run MODE OUT.npz CONFIG_JSON
        MODE one | ulp | ulpdown (one process; every initial parameter one float32 ulp up /
        down) | ranks (under mpirun -n P: rank 0 writes OUT)
    python benchmarks/results/2026-11-29-regram-probe.py cmp A.npz B.npz [SUBSTRINGS]
        per step, max |a - b| / max |b| of every metric and slot (parameters, factors,
        inverses, velocities) whose name holds one of the comma-separated SUBSTRINGS
    python benchmarks/results/2026-11-29-regram-probe.py same A.npz B.npz
        the names whose values differ at all (NaN equal to NaN; timings left out)
    python benchmarks/results/2026-11-29-regram-probe.py kink CONFIG_JSON STEP A.npz [B.npz ...]
        the smallest |pre-activation| of fc1 and fc2 (mlp_classifier) on step STEP's batch
        with A's parameters after step STEP - 1, and how many change sign in B, ... against A

CONFIG: model (zoo), batch, steps, knobs; "cli": the train command's data (the whole digits
set, make_data(None, seed=0)) instead of tests/mpi_worker.py's 256 rows; "dup": on P ranks
every rank gets the whole batch (the global batch is P copies), so every all-reduce averages
equal values (exact on 2 ranks and with Open MPI's recursive doubling on 4)."""
from __future__ import annotations

import json
import sys

import numpy as np


def run(config: dict, comm, ulp: int = 0) -> tuple[int, dict[str, np.ndarray]]:
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.comm import launched_ranks
    from kfac_compiler.runtime.data import batch_indices

    e = ZOO[config["model"]]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name)
    batch = int(config["batch"])
    dup = launched_ranks() if config.get("dup") and comm is not None else 1
    t = Trainer(plan, optimizer=config.get("optimizer", "kfac"), seed=0, batch_size=batch * dup, comm=comm,
                **config.get("knobs", {}))
    if ulp:
        t.set_parameters({p: np.nextafter(v, np.float32(np.inf * ulp)) for p, v in t.parameters().items()})
    x, y = e.make_data(None, seed=0) if config.get("cli") else e.make_data(n=256)
    out: dict[str, np.ndarray] = {}
    for step in range(int(config["steps"])):
        idx = np.tile(batch_indices(len(y), batch, step, 0), dup)
        m = t.step({k: v[idx] for k, v in x.items()}, y[idx])
        out.update({f"s{step}|metric|{k}": np.float64(v) for k, v in m.items() if isinstance(v, (int, float))})
        out.update({f"s{step}|{s}": t.store.to_numpy(s) for s in t.store.slots()})
    return t.rank, out


def load(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k.replace("#", "/"): z[k].astype(np.float64) for k in z.files}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    d, m = float(np.abs(a - b).max()), float(np.abs(b).max())
    return d / m if m else d


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "run":
        mode, path, config = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
        rank, out = run(config, "auto" if mode == "ranks" else None, {"ulp": 1, "ulpdown": -1}.get(mode, 0))
        if rank == 0:
            np.savez(path, **{k.replace("/", "#"): v for k, v in out.items()})
    elif what == "cmp":
        a, b = load(sys.argv[2]), load(sys.argv[3])
        show = sys.argv[4].split(",") if len(sys.argv) > 4 else None
        for s in sorted({int(k.split("|")[0][1:]) for k in b}):
            keys = sorted(k.split("|", 1)[1] for k in b if k.startswith(f"s{s}|"))
            cells = [f"{k.replace('metric|', '')}={rel(a[f's{s}|{k}'], b[f's{s}|{k}']):.1e}" for k in keys
                     if (show is None or any(f in k for f in show)) and f"s{s}|{k}" in a]
            print(f"step {s + 1}: " + "  ".join(cells))
    elif what == "same":
        a, b = load(sys.argv[2]), load(sys.argv[3])
        differ = sorted(k for k in b if k in a and not k.endswith(("step_time", "host_time"))
                        and not np.array_equal(a[k], b[k], equal_nan=True))
        print(f"{len(b)} values, {len(differ)} differ: {differ[:20]}")
    elif what == "kink":
        from kfac_compiler.models import ZOO
        from kfac_compiler.runtime.data import batch_indices

        config, step = json.loads(sys.argv[2]), int(sys.argv[3])
        x, y = ZOO[config["model"]].make_data(None, seed=0) if config.get("cli") else ZOO[config["model"]].make_data(n=256)
        h = np.asarray(x["input"][batch_indices(len(y), int(config["batch"]), step - 1, 0)], np.float64)
        ref = None
        for path in sys.argv[4:]:
            d = load(path)
            w = [d[f"s{step - 2}|{k}"] for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
            z1 = h @ w[0].T + w[1]
            z2 = np.maximum(z1, 0) @ w[2].T + w[3]
            flips = "" if ref is None else (f", sign changes against the first: fc1 {int((np.sign(z1) != np.sign(ref[0])).sum())}"
                                            f", fc2 {int((np.sign(z2) != np.sign(ref[1])).sum())}")
            ref = ref or (z1, z2)
            print(f"{path}: min |z| fc1 {np.abs(z1).min():.1e}, fc2 {np.abs(z2).min():.1e}{flips}")
