"""P ranks against one process on one tests/mpi_worker.py configuration (the before/after
figures of 2026-11-29-mpi-gap.md):

    python benchmarks/results/2026-11-29-mpi-gap-cmp.py SRC CONFIG_JSON [RANKS]

RANKS 1 (as bench_mpi.py --gap --ranks 1): one process started with every parameter one
float32 ulp up (tests/mpi_worker.py's config key "ulp") against one process.

SRC: a checkout's root (its tests/mpi_worker.py and, with PYTHONPATH=SRC and the folders
runtime, models, passes linked into SRC/kfac_compiler, its package); prints the per-step
relative loss gaps, each parameter's largest difference relative to its largest value, and
the worst of each."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

src, config = sys.argv[1], json.loads(sys.argv[2])
ranks = int(sys.argv[3]) if len(sys.argv) > 3 else 2
sys.path.insert(0, src)
sys.path.insert(0, os.path.join(src, "tests"))
from mpi_util import rank_command  # noqa: E402
from mpi_worker import train  # noqa: E402

one = train(config, comm=None)
if ranks == 1:  # the reference scale: one process with every initial parameter one float32 ulp up
    r = [train({**config, "ulp": True}, comm=None)]
else:
    out = tempfile.mkdtemp()
    p = subprocess.run(rank_command(ranks, [sys.executable, os.path.join(src, "tests/mpi_worker.py"), out,
                                            json.dumps(config)]),
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=src), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = [json.load(open(f"{out}/rank{k}.json")) for k in range(ranks)]
a, b = np.array(r[0]["losses"]), np.array(one["losses"])
print("ranks agree:", all(x["losses"] == r[0]["losses"] for x in r))
print("loss gaps:", " ".join(f"{g:.1e}" for g in np.abs(a - b) / np.abs(b)))
pgs = {k: np.abs(np.array(r[0]["params"][k]) - np.array(v)).max() / np.abs(np.array(v)).max()
       for k, v in one["params"].items()}
print({k: f"{x:.1e}" for k, x in pgs.items()})
print(f"worst loss gap {np.max(np.abs(a - b) / np.abs(b)):.2e}  worst param gap (rel to max) {max(pgs.values()):.2e}")
