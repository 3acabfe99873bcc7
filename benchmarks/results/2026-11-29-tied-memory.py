"""Peak RSS of a few training steps of a small GPT with GPT-2's 50,257-token tied embedding
(issue 36, item 3), for 2026-11-29-tied-memory.md.

    python benchmarks/results/2026-11-29-tied-memory.py CONFIG [STEPS [BATCH]]

CONFIG: "adam", or a tied_embedding approximation ("diagonal", "kron_tied_vocab_diag",
"kron_tied") under default K-FAC. Model: models.torch_exports.gpt, 2 layers of width 64,
2 heads, context 32, vocabulary 50,257, exported by kfac_compiler.torch.export; random tokens;
batch 8 (or BATCH). The export and compile run in a child process (torch's and the compiler's memory
stay out of the measurement); this process loads the plan and trains. Prints one JSON line:
peak RSS (VmHWM) after loading the plan and after the steps, the largest growth of RSS
within one run of each program (update_statistics, kfac_step, ...), and the losses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

V, T, D = 50257, 32, 64
BS = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[1] != "--compile" else 8


def hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def data(steps: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, V, (BS * steps, T + 1))


def compile_plan(config: str, out: str) -> None:
    import torch

    import kfac_compiler
    import kfac_compiler.torch as kt
    from kfac_compiler.models.torch_exports import gpt

    path = os.path.join(tempfile.mkdtemp(), "gpt.onnx")
    kt.export(gpt(vocab=V, seq_len=T, d_model=D, n_layer=2, n_head=2, seed=0).eval(),
              (torch.from_numpy(data(1)[:2, :-1]),), path)
    approx = {} if config == "adam" else {"approximations": {"tied_embedding": config}}
    kfac_compiler.compile(path, loss="softmax_cross_entropy", **approx).save(out)


def main() -> None:
    if sys.argv[1] == "--compile":
        compile_plan(sys.argv[2], sys.argv[3])
        return
    config = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    out = os.path.join(tempfile.mkdtemp(), "gpt.plan")
    subprocess.run([sys.executable, __file__, "--compile", config, out], check=True)
    import kfac_compiler
    import kfac_compiler.runtime.program as program
    from kfac_compiler.runtime import Trainer

    growth: dict[str, int] = {}
    peaks: list[float] = []
    run = program.Program.run

    def measured(self, *args, **kwargs):  # VmHWM reset to the RSS before each run (clear_refs 5)
        peak = hwm_mb()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = rss_mb()
        result = run(self, *args, **kwargs)
        growth[self.name] = max(growth.get(self.name, 0), round(hwm_mb() - before))
        peaks.append(max(peak, hwm_mb()))
        return result

    program.Program.run = measured
    plan = kfac_compiler.load_plan(out)
    blocks = [f"{layer.kind}:{layer.approximation}" for layer in plan.layers if layer.kind == "tied_embedding"]
    loaded = hwm_mb()
    trainer = Trainer(plan, optimizer="adam" if config == "adam" else "kfac", seed=0)
    xs, losses = data(steps), []
    for s in range(steps):
        m = trainer.step({"input": xs[s * BS:(s + 1) * BS, :-1]}, xs[s * BS:(s + 1) * BS, 1:])
        losses.append(round(float(m["loss"]), 4))
    print(json.dumps({"config": config, "loaded_mb": round(loaded), "peak_mb": round(max([hwm_mb(), *peaks])), "growth_mb": growth,
                      "losses": losses, "blocks": blocks}))


if __name__ == "__main__":
    main()
