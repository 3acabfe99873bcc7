"""The spike trace of default K-FAC on a byte-level GPT (issue 36): per-step metrics and the
held-out loss every 50 steps, for 2026-11-28-gpt-spikes.md.

    python benchmarks/results/2026-11-28-gpt-spikes.py '{}' rows_default.json
    python benchmarks/results/2026-11-28-gpt-spikes.py '{"loss_spike_factor": 3.0}' rows_spike3.json

Model: kfac_compiler.models.torch_exports.gpt (2 layers of width 128, 4 heads, tied head, context
64, vocabulary 256) exported by kfac_compiler.torch.export; data: the bytes of the Python
standard library's json and email packages (the interpreter's own files), windows of 65 bytes
every 64, a seeded permutation, 256 windows held out; batch 32; 600 steps; knobs "seed" (default
0: the GPT's initialization, the batch order, the trainer's), "optimizer" (default kfac) and
"steps"; the others are the optimizer's. Needs torch.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

import kfac_compiler
import kfac_compiler.torch as kt
from kfac_compiler.models.torch_exports import gpt
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.data import batch_indices

T, BS = 64, 32


def windows() -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) windows of T + 1 bytes."""
    folders = [os.path.dirname(json.__file__), os.path.join(os.path.dirname(os.__file__), "email")]
    files = sorted(f for d in folders for f in glob.glob(os.path.join(d, "*.py")))
    text = b"".join(open(f, "rb").read() for f in files)
    data = np.frombuffer(text, np.uint8).astype(np.int64)
    w = np.lib.stride_tricks.sliding_window_view(data, T + 1)[::T]
    w = w[np.random.default_rng(0).permutation(len(w))]
    return w[256:], w[:256]


def main() -> None:
    knobs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    out = sys.argv[2] if len(sys.argv) > 2 else "rows.json"
    steps = int(knobs.pop("steps", 600))
    seed = int(knobs.pop("seed", 0))  # the GPT's initialization, the batch order and the trainer's
    optimizer = knobs.pop("optimizer", "kfac")
    train, held = windows()
    path = os.path.join(tempfile.mkdtemp(), "gpt.onnx")
    kt.export(gpt(vocab=256, seq_len=T, d_model=128, n_layer=2, n_head=4, seed=seed).eval(),
              (torch.from_numpy(train[:2, :-1]),), path)
    trainer = Trainer(kfac_compiler.compile(path, loss="softmax_cross_entropy"), optimizer=optimizer, seed=seed,
                      **knobs)
    rows, t0 = [], time.time()
    for s in range(steps):
        idx = batch_indices(len(train), BS, s, seed)
        m = trainer.step({"input": train[idx, :-1]}, train[idx, 1:])
        m["step"] = s
        if (s + 1) % 50 == 0:
            m["held"] = trainer.evaluate({"input": held[:, :-1]}, held[:, 1:])["loss"] / T
        rows.append({k: float(v) for k, v in m.items()})
    with open(out, "w") as f:
        json.dump(rows, f)
    print(f"{time.time() - t0:.0f} s; held-out loss per byte every 50 steps:",
          [round(r["held"], 3) for r in rows if "held" in r])


if __name__ == "__main__":
    main()
