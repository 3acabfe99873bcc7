"""Per-step and per-refresh times of K-FAC with each inverse method on an exported model
(the measurement behind "auto" = "schur" on CUDA, kfac_compiler.linalg.concrete_method).

    python benchmarks/bench_gpu_inverse.py resnet18|gpt [schur,newton_schulz,inverse_op] [--device cuda]

For Adam and then K-FAC with each method: session build time, the first steps' wall times
with each session's last run time (the first runs include cuDNN's algorithm search), the
median and mean of steps 3-11 (batch 128, default schedule: a refresh every 10 steps), and
three refreshes of every inverse on their own, with the blocks that fell back to host
Cholesky. Lines are stamped with the seconds since start. Needs torch (the export).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=("resnet18", "gpt"))
    ap.add_argument("methods", nargs="?", default="schur,newton_schulz,inverse_op")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from kfac_compiler.models import torch_exports as te

    net, (inputs, y) = (te.resnet18(), te.digits_images()) if args.model == "resnet18" else (te.gpt(), te.digits_sequences())
    x = inputs["input"]
    path = te.export(net, os.path.join(os.environ.get("TMPDIR", "/tmp"), f"{args.model}.onnx"), x[:2])
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False)
    log(args.model, "compiled")
    bs = args.batch

    def batch(k):
        idx = batch_indices(len(y), bs, k, 0)
        return {"input": x[idx]}, y[idx]

    for opt in ["adam"] + args.methods.split(","):
        knobs = {} if opt == "adam" else {"inverse_method": opt}
        t = time.time()
        tr = Trainer(plan, optimizer="adam" if opt == "adam" else "kfac", device=args.device, batch_size=bs, **knobs)
        log(opt, "build", round(time.time() - t, 2), "s")
        walls = []
        for k in range(12):
            m = tr.step(*batch(k))
            walls.append(m["step_time"])
            if k < 3 or m.get("inverse", 0):
                progs = {n: round(p.last_seconds * 1e3, 1) for n, p in tr.programs().items()}
                log(opt, "step", k, f"wall {1e3 * m['step_time']:.1f} ms", f"loss {m['loss']:.4f}",
                    "inv" if m.get("inverse", 0) else "", "fallbacks", m.get("inverse_fallbacks"), progs)
        log(opt, f"steps 3-11 median {1e3 * np.median(walls[3:]):.2f} ms mean {1e3 * np.mean(walls[3:]):.2f} ms")
        if opt != "adam":
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                tr.policy.refresh_inverses()
                ts.append(time.perf_counter() - t)
            log(opt, "refresh alone ms", [round(1e3 * v, 1) for v in ts], "fallbacks",
                tr.policy.refresher.fallbacks[:5], len(tr.policy.refresher.fallbacks))
        del tr
    return 0


if __name__ == "__main__":
    sys.exit(main())
