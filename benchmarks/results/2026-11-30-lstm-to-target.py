"""Issue 40's LSTM target: default K-FAC's time to torch AdamW's held-out loss on a byte LM,
against AdamW's own time (and our Adam's), for 2026-11-30-lstm-to-target.md.

    python benchmarks/results/2026-11-30-lstm-to-target.py steps OUT.json [SEEDS] [STEPS]
    python benchmarks/results/2026-11-30-lstm-to-target.py time OUT.json [ROUNDS] [BLOCK]
    python benchmarks/results/2026-11-30-lstm-to-target.py report OUT.json

Model: 2026-11-29-fwdbwd-profile.py's byte LM (Embedding(256, 64) -> LSTM(64 -> 256) over
T = 64 -> Linear(256, 256)), torch.onnx's TorchScript export with a dynamic batch; the same
initial weights for torch and for us. Data: 2026-11-28-gpt-spikes.py's windows (the bytes of
the interpreter's json and email packages, 65-byte windows, 256 held out); batch 32, the batch
order of runtime.data.batch_indices(seed). Loss: mean cross-entropy per byte (ours is summed
over the 64 positions: divided by T here).

`steps`: per seed, torch AdamW (lr 1e-3, 3e-3, 1e-2; weight decay 0.01) for STEPS steps
(default 1000), the target being the best lr's held-out loss at the end; then our default
K-FAC and our Adam (the tuned lr) until they reach it or STEPS; held-out loss every 25 steps.
Deterministic: runs anywhere. `time`: torch AdamW, our Adam and our K-FAC stepped in
interleaved blocks of BLOCK steps (default 10: one K-FAC inverse period) after a warm-up block,
ROUNDS rounds (default 5): ms per step per round; needs a quiet machine. `report`: steps x the
median ms per step, against AdamW's STEPS x its own.
"""
from __future__ import annotations

import importlib.util
import io
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices  # noqa: E402

T, BS, EVERY, LRS = 64, 32, 25, (1e-3, 3e-3, 1e-2)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), os.path.join(HERE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def windows() -> tuple[np.ndarray, np.ndarray]:
    return _module("2026-11-28-gpt-spikes").windows()


def fresh_net():
    """The torch LM at its fixed initial weights (torch.manual_seed(0) inside)."""
    net, _ = _module("2026-11-29-fwdbwd-profile").lstm_model(T)
    return net


def plan_of(net):
    import onnx
    buf = io.BytesIO()
    torch.onnx.export(net, (torch.zeros((BS, T), dtype=torch.int64),), buf, input_names=["tokens"],
                      output_names=["logits"], dynamo=False, dynamic_axes={"tokens": {0: "N"}, "logits": {0: "N"}})
    return kc.compile(onnx.load_from_string(buf.getvalue()), loss="softmax_cross_entropy", output="logits")


def torch_run(train, held, lr: float, steps: int, seed: int, target: float | None = None) -> list[float]:
    net = fresh_net()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    lossf = torch.nn.CrossEntropyLoss()
    hx, hy = torch.from_numpy(held[:, :-1]), torch.from_numpy(held[:, 1:])
    curve = []
    for s in range(steps):
        idx = batch_indices(len(train), BS, s, seed)
        x, y = torch.from_numpy(train[idx, :-1]), torch.from_numpy(train[idx, 1:])
        opt.zero_grad()
        lossf(net(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
        if (s + 1) % EVERY == 0:
            with torch.no_grad():
                curve.append(float(lossf(net(hx).reshape(-1, 256), hy.reshape(-1))))
    return curve


def ours_run(plan, train, held, steps: int, seed: int, target: float, **kw) -> list[float]:
    tr = Trainer(plan, device="cpu", batch_size=BS, seed=seed, **kw)
    curve = []
    for s in range(steps):
        idx = batch_indices(len(train), BS, s, seed)
        tr.step({"tokens": train[idx, :-1]}, train[idx, 1:])
        if (s + 1) % EVERY == 0:
            curve.append(float(tr.evaluate({"tokens": held[:, :-1]}, held[:, 1:])["loss"]) / T)
            print(kw.get("optimizer"), s + 1, f"{curve[-1]:.4f}", flush=True)
            if curve[-1] <= target:
                break
    return curve


def load(out: str) -> dict:
    return json.load(open(out)) if os.path.exists(out) else {}


def save(out: str, res: dict) -> None:
    with open(out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(out + ".tmp", out)


def cmd_steps(out: str, seeds: list[int], steps: int) -> None:
    train, held = windows()
    torch.set_num_threads(os.cpu_count() or 1)
    res = load(out)
    plan = plan_of(fresh_net())
    for seed in seeds:
        row = res.setdefault("steps", {}).setdefault(str(seed), {})
        for lr in LRS:
            row[f"adamw{lr:g}"] = torch_run(train, held, lr, steps, seed)
            print("adamw", lr, f"{row[f'adamw{lr:g}'][-1]:.4f}", flush=True)
        best = min(LRS, key=lambda lr: row[f"adamw{lr:g}"][-1])
        row["target"], row["adamw_lr"] = row[f"adamw{best:g}"][-1], best
        row["kfac"] = ours_run(plan, train, held, steps, seed, row["target"], optimizer="kfac")
        row["adam"] = ours_run(plan, train, held, steps, seed, row["target"], optimizer="adam", learning_rate=best)
        save(out, res)


def cmd_time(out: str, rounds: int, block: int) -> None:
    train, held = windows()
    res = load(out)
    lr = float(next(iter(res.get("steps", {}).values()), {}).get("adamw_lr", 3e-3))
    t0 = time.perf_counter()
    plan = plan_of(fresh_net())
    setup = {"compile_s": time.perf_counter() - t0}
    trainers = {}
    for name, kw in (("kfac", {"optimizer": "kfac"}), ("adam", {"optimizer": "adam", "learning_rate": lr})):
        t0 = time.perf_counter()
        trainers[name] = Trainer(plan, device="cpu", batch_size=BS, seed=0, **kw)
        setup[f"{name}_trainer_s"] = time.perf_counter() - t0
    net = fresh_net()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    lossf = torch.nn.CrossEntropyLoss()

    def torch_step(x, y):
        opt.zero_grad()
        lossf(net(torch.from_numpy(x)).reshape(-1, 256), torch.from_numpy(y).reshape(-1)).backward()
        opt.step()

    def ours_step(trainer):
        return lambda x, y: trainer.step({"tokens": x}, y)

    steppers = {"adamw_torch": torch_step, **{name: ours_step(tr) for name, tr in trainers.items()}}
    per_round: dict[str, list[float]] = {name: [] for name in steppers}
    load_before = os.getloadavg()
    for r in range(rounds + 1):
        for name, step in steppers.items():
            time.sleep(0.05)
            t0 = time.perf_counter()
            for s in range(r * block, (r + 1) * block):
                idx = batch_indices(len(train), BS, s, 0)
                step(train[idx, :-1], train[idx, 1:])
            if r:  # round 0 warms up
                per_round[name].append(1e3 * (time.perf_counter() - t0) / block)
    res["time"] = {"rounds": rounds, "block": block, "threads": torch.get_num_threads(), "setup": setup,
                   "load_before": load_before, "load_after": os.getloadavg(), "per_round_ms": per_round}
    save(out, res)
    for name, ms in per_round.items():
        print(f"{name}: {statistics.median(ms):.1f} ms/step ({min(ms):.1f}-{max(ms):.1f})")


def first_at(curve: list[float], target: float) -> int | None:
    return next(((i + 1) * EVERY for i, v in enumerate(curve) if v <= target), None)


def cmd_report(out: str) -> None:
    res = load(out)
    ms = {k: statistics.median(v) for k, v in res.get("time", {}).get("per_round_ms", {}).items()}
    print("| seed | AdamW lr, held-out at the end (target) | AdamW steps | our K-FAC steps | our Adam steps |")
    print("|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {"kfac": [], "adam": []}
    for seed, row in sorted(res.get("steps", {}).items()):
        n = len(row[f"adamw{row['adamw_lr']:g}"]) * EVERY
        hits = {k: first_at(row[k], row["target"]) for k in ("kfac", "adam")}
        print(f"| {seed} | {row['adamw_lr']:g}, {row['target']:.4f} | {n} | "
              + " | ".join(str(hits[k]) if hits[k] else f">{len(row[k]) * EVERY}" for k in ("kfac", "adam")) + " |")
        for k in ratios:
            if hits[k] and ms:
                ratios[k].append(hits[k] * ms[k] / (n * ms["adamw_torch"]))
    if ms:
        print("\nms/step (median of rounds):", {k: round(v, 1) for k, v in ms.items()})
        print("time to AdamW's loss / AdamW's time:", {k: [round(r, 2) for r in v] for k, v in ratios.items()})


if __name__ == "__main__":
    cmd, out = sys.argv[1], sys.argv[2]
    if cmd == "steps":
        cmd_steps(out, [int(s) for s in (sys.argv[3] if len(sys.argv) > 3 else "0").split(",")],
                  int(sys.argv[4]) if len(sys.argv) > 4 else 1000)
    elif cmd == "time":
        cmd_time(out, int(sys.argv[3]) if len(sys.argv) > 3 else 5, int(sys.argv[4]) if len(sys.argv) > 4 else 10)
    else:
        cmd_report(out)
