"""Benchmark ONNX Runtime's memory options for the runtime's sessions (runtime/device.py,
memory_options) on the scale benchmark's models (benchmarks/scale_models.py), CPU.

  peak RSS: a Trainer per (optimizer, setting) in a fresh process: compile, build, --steps
            steps; its peak RSS (VmHWM) and the RSS at the end. Settings:
              current   CPU arena only for the every-step sessions, no memory pattern
              legacy    ORT's defaults: arena and memory pattern for every session
  step time: two Trainers in one process (memory pattern on / off, arena as `current`), steps
            interleaved with the order alternating per round; medians after 3 warm-up rounds.

    python benchmarks/bench_session_memory.py [--models resnet18,gpt_large_vocab]
        [--optimizers kfac,adam] [--steps 23] [--rounds 23] [--config JSON] [--out FILE.md]

--config is passed to kfac_compiler.compile (e.g. '{"budget": {"overhead": 0}}' for full
Kronecker factors everywhere).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def _setup(name: str, workdir: str, config: dict | None):
    import kfac_compiler as kc
    from kfac_compiler.models import torch_exports as te
    from scale_models import MODELS, build

    net, x, y = build(name)
    path = os.path.join(workdir, f"{name}.onnx")
    if not os.path.exists(path):
        te.export(net, path, x[:2])
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", config=config)
    return plan, x, y, MODELS[name].batch


def _legacy(options, device, name) -> None:
    options.enable_cpu_mem_arena = True
    options.enable_mem_pattern = True


def worker(name: str, opt: str, setting: str, steps: int, workdir: str, config: dict | None) -> dict:
    """One Trainer in this process; its peak RSS."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime import device as D

    if setting == "legacy":
        D.memory_options = _legacy
    plan, x, y, bs = _setup(name, workdir, config)
    tr = Trainer(plan, optimizer=opt, device="cpu", batch_size=bs, seed=0)
    for k in range(steps):
        idx = (np.arange(bs) + k * bs) % len(y)
        tr.step({"input": x[idx]}, y[idx])
    # VmHWM, not ru_maxrss: the latter starts from the forking parent's RSS
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {"peak_mb": int(status["VmHWM"].split()[0]) / 1024, "end_mb": int(status["VmRSS"].split()[0]) / 1024}


def step_times(name: str, opt: str, rounds: int, workdir: str, config: dict | None) -> dict:
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime import device as D

    plan, x, y, bs = _setup(name, workdir, config)
    current = D.memory_options
    trainers = {}
    for label, pattern in (("pattern", True), ("no pattern", False)):
        def options(so, device, n, pattern=pattern):
            current(so, device, n)
            so.enable_mem_pattern = pattern
        D.memory_options = options
        trainers[label] = Trainer(plan, optimizer=opt, device="cpu", batch_size=bs, seed=0)
    D.memory_options = current
    times = {k: [] for k in trainers}
    for r in range(rounds):
        idx = (np.arange(bs) + r * bs) % len(y)
        for k in (list(trainers) if r % 2 == 0 else list(trainers)[::-1]):
            t0 = time.perf_counter()
            trainers[k].step({"input": x[idx]}, y[idx])
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v[3:])) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,gpt_large_vocab")
    ap.add_argument("--optimizers", default="kfac,adam")
    ap.add_argument("--steps", type=int, default=23)
    ap.add_argument("--rounds", type=int, default=23)
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # model optimizer setting
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    config = json.loads(args.config) if args.config else None
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.workdir, config)))
        return
    import onnxruntime as ort

    workdir = tempfile.mkdtemp(prefix="bench_session_memory-")
    lines = [f"# bench_session_memory, {time.strftime('%Y-%m-%d')}: onnxruntime {ort.__version__}, CPU "
             f"({os.cpu_count()} cores)", "", "`python benchmarks/bench_session_memory.py " + " ".join(sys.argv[1:]) + "`",
             "", "| model | optimizer | peak RSS MB legacy / current (ratio) | RSS at the end MB legacy / current "
             "| step ms pattern / no pattern (ratio) |", "|---|---|---|---|---|"]
    for name in args.models.split(","):
        for opt in args.optimizers.split(","):
            mem = {}
            for setting in ("legacy", "current"):
                cmd = [sys.executable, __file__, "--worker", name, opt, setting, "--steps", str(args.steps),
                       "--workdir", workdir] + (["--config", args.config] if args.config else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                mem[setting] = json.loads(out.strip().splitlines()[-1])
            t = step_times(name, opt, args.rounds, workdir, config)
            lines.append(f"| {name} | {opt} | {mem['legacy']['peak_mb']:.0f} / {mem['current']['peak_mb']:.0f} "
                         f"({mem['current']['peak_mb'] / mem['legacy']['peak_mb']:.2f}x) | {mem['legacy']['end_mb']:.0f} / "
                         f"{mem['current']['end_mb']:.0f} | {t['pattern']:.0f} / {t['no pattern']:.0f} "
                         f"({t['no pattern'] / t['pattern']:.3f}x) |")
            print(lines[-1], flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    lines.append(f"\n1-minute load average at the end: {os.getloadavg()[0]:.1f}\n")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
