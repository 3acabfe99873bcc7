"""The table of 2026-11-29-damping-ablation.md from the runs of 2026-11-29-damping-ablation.sh:
one row per configuration, each workload's deterministic figures (steps, losses, spikes).

    python benchmarks/results/2026-11-29-damping-ablation.py [/tmp/damp] [def md1e-3 ...]
"""
from __future__ import annotations

import glob
import json
import os
import sys


def results(folder: str, kind: str):
    """The results of <folder>/*-to-target-<kind>.json, None when that run is missing."""
    paths = glob.glob(os.path.join(folder, f"*-to-target-{kind}.json"))
    return json.load(open(paths[0]))["results"] if paths else None


def digits_cells(r) -> list[str]:
    if r is None:
        return ["?"] * 3
    ae, cl = r["digits_autoencoder"], r["mlp_classifier"]
    return [str(ae["adam1000"]["kfac_steps"] or "-"), str(cl["adam500"]["kfac_steps"] or "-"),
            str(cl["adam1000"]["kfac_steps"] or "-")]


def zoo_cells(r) -> list[str]:
    if r is None:
        return ["?"] * 3
    by = {z["model"]: z for z in r}
    out = []
    for m in ("small_cnn", "depthwise_cnn", "transformer_block"):
        z = by[m]
        best = min(v for _, v in z["kfac_curve"])
        out.append(f"{z['kfac_steps'] or '-'} ({z['kfac_final_loss']:.3g}; best {best:.3g})")
    return out


def mnist_cells(r) -> list[str]:
    if r is None:
        return ["?"]
    return ["; ".join(f"{x['kfac_steps'] or '-'}, {x['kfac']['best']:.4f} @ {x['kfac']['best_step']}, "
                      f"{x['kfac']['max_after_best']:.4f}, {x['kfac']['spike']}/{x['kfac']['rolled_back']}/"
                      f"{x['kfac']['rejected']}" for x in r)]


def gpt_cells(folder: str) -> list[str]:
    path = os.path.join(folder, "gpt.json")
    if not os.path.exists(path):
        return ["?"] * 2
    rows = json.load(open(path))
    held = {int(r["step"]) + 1: r["held"] for r in rows if "held" in r}
    losses = [r["loss"] for r in rows]
    ratios = [losses[s] / max(losses[s - 10:s]) for s in range(10, len(losses))]
    count = {k: int(sum(r.get(k, 0.0) == 1.0 for r in rows)) for k in ("spike", "rolled_back", "rejected")}
    best = min(held, key=held.__getitem__)
    after = max(v for k, v in held.items() if k >= best)
    return [" / ".join(f"{held[k]:.3f}" for k in (300, 400, 500, 600) if k in held)
            + f" (best {held[best]:.3f} @ {best}, max after it {after:.3f})",
            f"{max(ratios):.1f}x, {sum(x > 2 for x in ratios)}; {count['spike']}/{count['rolled_back']}/{count['rejected']}"]


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/damp"
    names = sys.argv[2:] or ["def", "md1e-3", "md3e-3", "md1e-2", "spike3"]
    print("| configuration | autoencoder -> Adam 1000 | classifier -> Adam 500 | classifier -> Adam 1000 | small_cnn "
          "| depthwise_cnn | transformer_block | LeNet-5 seed 0 | GPT held-out 300/400/500/600 | GPT spikes |")
    print("|" + "---|" * 10)
    for n in names:
        d = os.path.join(root, n)
        cells = digits_cells(results(d, "digits")) + zoo_cells(results(d, "zoo")) + mnist_cells(results(d, "mnist"))
        print(f"| {n} | " + " | ".join(cells + gpt_cells(d)) + " |")


if __name__ == "__main__":
    main()
