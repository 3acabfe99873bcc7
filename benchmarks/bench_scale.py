"""K-FAC against Adam and SGD at scale: real-sized models in our runtime, side by side with
torch's Adam and kfac-pytorch on the same torch modules, in one run.

    python benchmarks/bench_scale.py [--models resnet18,mobilenet_v2,gpt_large_vocab]
        [--device cpu|cuda|auto] [--batch N] [--rounds 2] [--warmup 3] [--target-steps 20]
        [--target-max-s 120] [--eval-examples 512] [--kfac-pytorch DIR] [--no-peers]
        [--quick] [--out DIR]

Models (benchmarks/scale_models.py; torch exports them): ResNet-18 and MobileNetV2 on the
digits as 32x32 RGB images at batch 32, and a GPT-2-style LM with GPT-2's 50257-token
vocabulary on the digits' pixel sequences at batch 8. For each model:
  * plan size: the saved plan directory (kfac_compiler.compile's default subgraphs) against
    the exported model file; compile time and compile's peak RSS, in a process of its own;
  * every optimizer (ours: K-FAC with its defaults, Adam lr 1e-3, SGD with its defaults;
    torch's Adam lr 1e-3; kfac-pytorch: KFACPreconditioner + SGD lr 0.1, momentum 0.9, damping
    3e-3, our update periods) runs in its own fresh process (scale_worker.py), which loads the
    saved plan (kfac_compiler.load_plan) or the module's weights: its peak RSS (VmHWM) of the
    load and build, and of the steps, is its own; compile's is not in it;
  * step time: `--warmup` unrecorded steps, then `--rounds` interleaved rounds in which every
    optimizer runs a block of K-FAC's inv_update_period steps in turn (the machine drifts by
    +-30% within minutes; interleaving exposes all of them to the same drift). Every block
    holds exactly one inverse refresh, so K-FAC's mean step includes refreshes amortized, as
    does kfac-pytorch's (same periods). Medians, means, and the ratios to our Adam's mean
    step (with the median of the per-round ratios). An optimizer whose block took longer than
    `--round-max-s` sits out the later rounds;
  * time to target: our Adam trains `--target-steps` N steps from the initial weights; its
    loss on the first `--eval-examples` digits (0: all 1797) is the target. The others train
    from the same initial weights on the same batches until their loss reaches it (checked
    every 10 steps, evaluation not timed), or 3N steps, `--target-max-s` seconds of wall time,
    or a non-finite loss: steps, seconds and the ratio to Adam's seconds, measured and as
    steps x mean step.
A model or optimizer that fails (an error, a worker killed above `--max-rss-gb`, a timeout)
gets its one-line error in its cell; the run goes on. Figures come from one run on one
machine; the 1-minute load average at the end of each model is printed with it. The tables
go to <out>/<date>-scale.md and the figures to .json (with the date, machine, commit and load;
benchmarks/harness.py; `--out -` prints only). `--quick` is a smoke run of the LM unless
--models says otherwise (2.2-3.5 minutes on the loaded 2-core VM).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

harness.import_paths()

from scale_models import MODELS, build  # noqa: E402
from torch_peers import kfac_pytorch_path  # noqa: E402

WORKER = os.path.join(HERE, "scale_worker.py")
EVAL_EVERY = 10
PAUSE_S = 0.2  # between blocks: the previous worker's spinning threads go idle
COLUMNS = (("ours_kfac", "ours K-FAC"), ("ours_adam", "ours Adam"), ("ours_sgd", "ours SGD"),
           ("torch_adam", "torch Adam"), ("kfac_pytorch", "kfac-pytorch"))
STOPS = {"steps": "step cap", "time": "time cap", "diverged": "diverged", "reached": "reached"}
TARGET_RATIOS = {"step": 2.0, "memory": 2.0, "plan": 1.5}  # the CPU targets (ResNet-18)




def gpu_used_mb(pid: int) -> float | None:
    """GPU memory nvidia-smi attributes to `pid` (None without nvidia-smi or the process)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


# ------------------------------------------------------------------------------ workers
class Worker:
    """A scale_worker.py process: JSON commands in, "@@ "-prefixed JSON replies out; a watchdog
    kills it above max_rss_mb (the machine is shared) and samples its GPU memory."""

    def __init__(self, label: str, spec: dict, workdir: str, max_rss_mb: float, timeout_s: float, gpu: bool):
        self.label, self.timeout_s, self.max_rss_mb = label, timeout_s, max_rss_mb
        self.log_path = os.path.join(workdir, f"{label}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.replies: queue.Queue = queue.Queue()
        self.killed: str | None = None
        self.gpu_peak_mb: float | None = None
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, args=(gpu,), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.replies.put(json.loads(line[3:]))
        self.replies.put(None)

    def _watch(self, gpu: bool) -> None:
        status, last_gpu = f"/proc/{self.proc.pid}/status", 0.0
        while self.proc.poll() is None:
            try:
                with open(status) as f:
                    rss = next((int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:")), 0.0)
            except (OSError, StopIteration):
                rss = 0.0
            if rss > self.max_rss_mb:
                self.killed = f"killed: RSS {rss / 1024:.1f} GB above --max-rss-gb {self.max_rss_mb / 1024:.0f}"
                self.proc.kill()
                return
            if gpu and time.monotonic() - last_gpu > 1.0:
                last_gpu = time.monotonic()
                used = gpu_used_mb(self.proc.pid)
                if used is not None:
                    self.gpu_peak_mb = max(self.gpu_peak_mb or 0.0, used)
            time.sleep(0.1)

    def wait(self) -> dict:
        try:
            r = self.replies.get(timeout=self.timeout_s)
        except queue.Empty:
            self.proc.kill()
            return {"ok": False, "error": f"timeout: no reply within {self.timeout_s:.0f} s"}
        if r is None:
            self.proc.wait()
            return {"ok": False, "error": self.killed or f"worker exited ({self.proc.returncode}): {self.last_log_line()}"}
        return r

    def ask(self, **cmd) -> dict:
        if self.proc.poll() is not None:
            return {"ok": False, "error": self.killed or f"worker exited ({self.proc.returncode})"}
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        return self.wait()

    def last_log_line(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            lines = [l.strip() for l in f if l.strip()]
        return lines[-1][:300] if lines else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------ one model
def dir_mb(path: str) -> tuple[float, dict[str, float]]:
    files = {f: os.path.getsize(os.path.join(path, f)) / 2**20 for f in sorted(os.listdir(path))}
    return sum(files.values()), files


def prepare(name: str, args, workdir: str) -> dict:
    """Build and export the model; write its data, batch schedule and initial weights."""
    import torch

    from kfac_compiler.models import torch_exports as te
    from kfac_compiler.runtime.data import batch_indices

    net, x, y = build(name)
    bs = args.batch or MODELS[name].batch
    onnx_path = te.export(net, os.path.join(workdir, f"{name}.onnx"), x[:2])
    state = os.path.join(workdir, f"{name}.pt")
    torch.save(net.state_dict(), state)
    steps = max(args.warmup + args.rounds * 50, 3 * args.target_steps + 1)
    batches = np.stack([batch_indices(len(y), bs, k, 0) for k in range(steps)])
    n_eval = args.eval_examples or len(y)
    data = os.path.join(workdir, f"{name}.npz")
    np.savez(data, x=x, y=y, batches=batches, eval_idx=np.arange(min(n_eval, len(y))))
    params = sum(p.numel() for p in net.parameters())
    return {"onnx": onnx_path, "state": state, "data": data, "batch": bs, "params": int(params),
            "n_eval": int(min(n_eval, len(y))), "kfac_pytorch_skip": MODELS[name].kfac_pytorch_skip(net)}


def bench_model(name: str, args, workdir: str) -> dict:
    res: dict = {"model": name, "note": MODELS[name].note, "device": args.device, "cells": {}}
    t0 = time.perf_counter()
    try:
        prep = prepare(name, args, workdir)
    except Exception as e:  # noqa: BLE001 - the model's row says why
        res["error"] = f"export: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"== {name}: {res['error']}", flush=True)
        return res
    res.update(batch=prep["batch"], params=prep["params"], eval_examples=prep["n_eval"],
               model_mb=os.path.getsize(prep["onnx"]) / 2**20, export_s=time.perf_counter() - t0)
    print(f"== {name}: {prep['params'] / 1e6:.2f}M parameters (torch), batch {prep['batch']}, "
          f"model file {res['model_mb']:.1f} MB", flush=True)
    max_rss = args.max_rss_gb * 1024
    gpu = args.device == "cuda"

    plan_dir = os.path.join(workdir, f"{name}.plan")
    comp = Worker(f"{name}-compile", {"role": "compile", "onnx": prep["onnx"], "plan": plan_dir}, workdir, max_rss,
                  args.timeout, gpu)
    r = comp.wait()
    comp.close()
    if not r.get("ok"):
        res["error"] = f"compile: {r['error']}"
        print(f"   {res['error']}", flush=True)
        return res
    res["compile"] = {"s": r["compile_s"], "save_s": r["save_s"], "peak_mb": r["peak_mb"], "totals": r["totals"]}
    res["plan_mb"], res["plan_files_mb"] = dir_mb(plan_dir)
    res["plan_over_model"] = res["plan_mb"] / res["model_mb"]
    print(f"   compiled in {r['compile_s']:.1f} s (peak RSS {r['peak_mb']:.0f} MB); plan directory "
          f"{res['plan_mb']:.1f} MB = {res['plan_over_model']:.2f}x the model file "
          f"({', '.join(f'{f} {mb:.1f}' for f, mb in res['plan_files_mb'].items())})", flush=True)

    common = {"data": prep["data"], "batch": prep["batch"], "device": args.device, "workdir": workdir,
              "target": bool(args.target_steps), "eval_batch": prep["batch"]}
    specs = {f"ours_{o}": {"role": "ours", "optimizer": o, "plan": plan_dir, **common} for o in ("kfac", "adam", "sgd")}
    kfac_path = kfac_pytorch_path(args.kfac_pytorch)
    if args.peers:
        peer = {"role": "torch", "model": name, "state": prep["state"], "periods": [1, 10], **common}
        specs["torch_adam"] = {**peer, "optimizer": "adam"}
        if kfac_path:
            specs["kfac_pytorch"] = {**peer, "optimizer": "kfac", "kfac_pytorch": kfac_path,
                                     "skip": prep["kfac_pytorch_skip"]}
        else:
            res["cells"]["kfac_pytorch"] = {"error": "skipped: no --kfac-pytorch DIR (or $KFAC_PYTORCH)"}
    if prep["kfac_pytorch_skip"] and "kfac_pytorch" in specs:
        res["kfac_pytorch_skip"] = prep["kfac_pytorch_skip"]

    workers: dict[str, Worker] = {}

    def fail(key: str, error: str) -> None:
        res["cells"].setdefault(key, {})["error"] = error
        print(f"   {key}: {error}", flush=True)
        if key in workers:
            workers.pop(key).close()

    try:
        # build every worker in turn (not concurrently: 2 cores, and build times are reported)
        for key, spec in specs.items():
            if key == "kfac_pytorch" or key == "torch_adam":
                kfac = res["cells"].get("ours_kfac", {}).get("periods") or [1, 10]
                spec["periods"] = [kfac[0] or 1, kfac[1] or 10]
            w = Worker(key, spec, workdir, max_rss, args.timeout, gpu)
            workers[key] = w
            r = w.wait()
            if not r.get("ok"):
                fail(key, r["error"])
                continue
            res["cells"][key] = {"build_s": r["build_s"], "base_mb": r["base_mb"], "build_peak_mb": r["build_peak_mb"],
                                 "periods": r["periods"], "walls": [], "round_means": []}
            print(f"   {key}: built in {r['build_s']:.1f} s (RSS {r['base_mb']:.0f} MB before, peak "
                  f"{r['build_peak_mb']:.0f} MB)", flush=True)
        block = args.block or (res["cells"].get("ours_kfac", {}).get("periods") or [1, 10])[1] or 10
        res["block"] = block

        # step times: warm-up, then interleaved rounds of one block each
        # (a worker whose block took longer than --round-max-s sits out the later rounds:
        # kfac-pytorch's eigendecompositions of ResNet-18's 4608-wide factors take minutes here)
        start, slow = 0, set()
        for rnd in range(-1, args.rounds):
            n = args.warmup if rnd < 0 else block
            if n == 0:
                continue
            for key in list(workers):
                if key in slow:
                    continue
                time.sleep(PAUSE_S)
                t_block = time.perf_counter()
                r = workers[key].ask(cmd="steps", start=start, n=n)
                if not r.get("ok"):
                    fail(key, r["error"])
                    continue
                if rnd >= 0:
                    cell = res["cells"][key]
                    cell["walls"] += r["walls"]
                    cell["round_means"].append(float(np.mean(r["walls"])))
                    cell["last_loss"] = r["loss"]
                    if args.round_max_s and time.perf_counter() - t_block > args.round_max_s:
                        slow.add(key)
            start += n
        for key in list(workers):
            cell = res["cells"][key]
            r = workers[key].ask(cmd="memory")
            if not r.get("ok"):
                fail(key, r["error"])
                continue
            cell.update(median_ms=1e3 * harness.median(cell["walls"]), mean_ms=1e3 * float(np.mean(cell["walls"])),
                        steps_peak_mb=r["steps_peak_mb"], peak_mb=max(r["steps_peak_mb"], cell["build_peak_mb"]),
                        gpu_peak_mb=workers[key].gpu_peak_mb or r.get("gpu_peak_mb"))
            print(f"   {key}: step median {cell['median_ms']:.1f} ms, mean {cell['mean_ms']:.1f} ms; peak RSS "
                  f"{cell['peak_mb']:.0f} MB (build {cell['build_peak_mb']:.0f}, steps {cell['steps_peak_mb']:.0f})",
                  flush=True)
        ratios(res)

        # time to target
        if args.target_steps:
            target_phase(res, workers, args, fail)
    finally:
        for w in workers.values():
            w.close()
        res["s"] = time.perf_counter() - t0
        res["loadavg_end"] = os.getloadavg()[0]  # the machine's other load skews every figure
    return res


def ratios(res: dict) -> None:
    cells = res["cells"]
    adam = cells.get("ours_adam", {})
    for cell in cells.values():
        if "mean_ms" in cell and "mean_ms" in adam:
            cell["mean_over_adam"] = cell["mean_ms"] / adam["mean_ms"]
            cell["peak_over_adam"] = cell["peak_mb"] / adam["peak_mb"]
            per_round = [a / b for a, b in zip(cell["round_means"], adam["round_means"])]  # the rounds both ran
            cell["round_ratio_median"] = harness.median(per_round)


def target_phase(res: dict, workers: dict, args, fail) -> None:
    cells = res["cells"]
    if "ours_adam" not in workers:
        res["target"] = {"error": "no target: our Adam failed"}
        return
    r = workers["ours_adam"].ask(cmd="target", target=None, max_steps=args.target_steps, every=EVAL_EVERY)
    workers.pop("ours_adam").close()
    if not r.get("ok"):
        res["target"] = {"error": f"our Adam: {r['error']}"}
        return
    target, adam_s = r["loss"], r["s"]
    res["target"] = {"loss": target, "adam_steps": r["steps"], "adam_s": adam_s, "max_steps": 3 * args.target_steps,
                     "max_s": args.target_max_s}
    cells["ours_adam"]["target"] = {"steps": r["steps"], "s": adam_s, "loss": target, "reached": True, "stop": "steps",
                                    "walls": r["walls"], "curve": r["curve"],
                                    "time_ratio": 1.0, "steady_ratio": 1.0}
    print(f"   target: our Adam's loss after {r['steps']} steps = {target:.4f} ({adam_s:.2f} s)", flush=True)
    adam_steady = r["steps"] * cells["ours_adam"].get("mean_ms", float("nan"))
    for key in list(workers):
        r = workers[key].ask(cmd="target", target=target, max_steps=3 * args.target_steps, every=EVAL_EVERY,
                             max_s=args.target_max_s or None)
        workers.pop(key).close()
        if not r.get("ok"):
            fail(key, f"to target: {r['error']}")
            continue
        row = {"steps": r["steps"], "s": r["s"], "loss": r["loss"], "diverged": r["diverged"], "stop": r["stop"],
               "walls": r["walls"],
               "curve": r["curve"],
               "reached": bool(r["loss"] <= target), "time_ratio": r["s"] / adam_s,
               "steady_ratio": r["steps"] * cells[key].get("mean_ms", float("nan")) / adam_steady}
        cells[key]["target"] = row
        print(f"   {key}: {row['steps']} steps, {row['s']:.2f} s, loss {row['loss']:.4f}: "
              f"{row['time_ratio']:.2f}x our Adam's time ({row['steady_ratio']:.2f}x as steps x mean step)"
              f"{'' if row['reached'] else ' (not reached: ' + STOPS[row['stop']] + ')'}",
              flush=True)


# ------------------------------------------------------------------------------ report
def fmt(x, spec=".1f", suffix=""):
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:{spec}}{suffix}"


def markdown(res: dict) -> str:
    name = res["model"]
    out = [f"### {name}", "", res["note"] + ".", ""]
    if "error" in res and "compile" not in res:
        return "\n".join(out + [f"**failed**: {res['error']}", ""])
    comp = res["compile"]
    out += [f"{res['params'] / 1e6:.2f}M parameters, batch {res['batch']}, device {res['device']}; benchmarked in "
            f"{res.get('s', 0):.0f} s, 1-minute load average {res.get('loadavg_end', float('nan')):.1f} at the end. "
            f"Compile {comp['s']:.1f} s (+ {comp['save_s']:.1f} s to save), peak RSS {comp['peak_mb']:.0f} MB. "
            f"Plan directory {res['plan_mb']:.1f} MB against the model file's {res['model_mb']:.1f} MB: "
            f"**{res['plan_over_model']:.2f}x** ({', '.join(f'{f} {mb:.1f}' for f, mb in res['plan_files_mb'].items())}).",
            ""]
    cells = res["cells"]
    cols = [(k, label) for k, label in COLUMNS if k in cells]
    out.append("| | " + " | ".join(label for _, label in cols) + " |")
    out.append("| --- |" + " --- |" * len(cols))

    def row(title, fn):
        vals = []
        for k, _ in cols:
            c = cells[k]
            try:
                vals.append(fn(c))
            except (KeyError, TypeError):
                vals.append(c["error"] if "error" in c else "-")
        out.append(f"| {title} | " + " | ".join(vals) + " |")

    row("step median / mean, ms (rounds)",
        lambda c: f"{c['median_ms']:.1f} / {c['mean_ms']:.1f} ({len(c['round_means'])})")
    row("mean step / ours Adam's (per-round median)",
        lambda c: f"{c['mean_over_adam']:.2f}x ({c['round_ratio_median']:.2f}x)")
    row("peak RSS, MB: load+build / steps", lambda c: f"{c['build_peak_mb']:.0f} / {c['steps_peak_mb']:.0f}")
    row("peak RSS / ours Adam's", lambda c: f"{c['peak_over_adam']:.2f}x")
    if res["device"] == "cuda":
        row("GPU memory peak, MB", lambda c: fmt(c.get("gpu_peak_mb"), ".0f"))
    row("process RSS before the load, MB", lambda c: f"{c['base_mb']:.0f}")
    row("sessions / module built, s", lambda c: f"{c['build_s']:.1f}")
    tgt = res.get("target", {})
    if "loss" in tgt:
        def reach(c):
            t = c["target"]
            flag = "" if t["reached"] else f" (not reached: {STOPS[t['stop']]})"
            return f"{t['steps']}{flag}, loss {t['loss']:.4g}"

        row(f"to target: steps (cap {tgt['max_steps']} steps, {tgt['max_s']:.0f} s)", reach)
        row("to target: s (/ ours Adam's)", lambda c: f"{c['target']['s']:.1f} ({c['target']['time_ratio']:.2f}x)")
        row("to target: steps x mean step / ours Adam's", lambda c: f"{c['target']['steady_ratio']:.2f}x")
    out.append("")
    if "loss" in tgt:
        out.append(f"Target: our Adam's loss on {res['eval_examples']} examples after {tgt['adam_steps']} steps, "
                   f"{tgt['loss']:.4f}.")
    elif tgt:
        out.append(f"Time to target: {tgt['error']}.")
    if res.get("kfac_pytorch_skip"):
        names = [p.strip("^$").replace("\\", "") for p in res["kfac_pytorch_skip"]]  # the anchored, escaped names
        out.append(f"kfac-pytorch skips {len(names)} layer(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}):"
                   " trained by its SGD only.")
    k = cells.get("ours_kfac", {})
    if "mean_over_adam" in k:
        checks = [("mean K-FAC step / Adam's", k["mean_over_adam"], TARGET_RATIOS["step"]),
                  ("peak RSS / Adam's", k["peak_over_adam"], TARGET_RATIOS["memory"]),
                  ("plan directory / model file", res["plan_over_model"], TARGET_RATIOS["plan"])]
        out.append("Issue targets (stated for ResNet-18 at batch 32 on the CPU): " + "; ".join(
            f"{t} {v:.2f}x (<= {lim}x: {'met' if v <= lim else 'not met'})" for t, v, lim in checks) + ".")
    out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--batch", type=int, help="one batch size for every model (default: the model's)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    ap.add_argument("--block", type=int, help="steps per optimizer per round (default: K-FAC's inv_update_period)")
    ap.add_argument("--round-max-s", type=float, default=120.0,
                    help="an optimizer whose block takes longer sits out the later rounds (0: never)")
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded steps per optimizer first")
    ap.add_argument("--target-steps", type=int, default=20, help="our Adam's steps for the target (0: skip)")
    ap.add_argument("--target-max-s", type=float, default=120.0,
                    help="wall seconds an optimizer may train toward the target, evaluations included (0: no cap)")
    ap.add_argument("--eval-examples", type=int, default=512, help="examples the target loss is taken on (0: all)")
    ap.add_argument("--no-peers", dest="peers", action="store_false", help="skip torch's Adam and kfac-pytorch")
    ap.add_argument("--kfac-pytorch", help="directory holding kfac-pytorch's `kfac` package (default: $KFAC_PYTORCH)")
    ap.add_argument("--max-rss-gb", type=float, default=12.0, help="kill a worker whose RSS passes this")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a worker may take to answer")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 round, 1 warm-up step, target after 10 steps, 30 s cap, the LM only unless --models")
    harness.add_out_argument(ap)
    args = ap.parse_args(argv)
    run = harness.Run("scale", argv)
    if args.quick:
        args.rounds, args.warmup, args.target_steps, args.eval_examples, args.target_max_s = 1, 1, 10, 128, 30.0
        args.models = args.models or "gpt_large_vocab"
    args.models = args.models or ",".join(MODELS)
    warnings.simplefilter("ignore")
    torch = harness.require("torch", "bench_scale's models (scale_models.py exports them)")
    from kfac_compiler.runtime.device import get_device

    args.device = get_device(args.device).name
    results = {"kfac_pytorch": kfac_pytorch_path(args.kfac_pytorch), "results": []}
    run.extra["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_scale-") as workdir:
        for name in args.models.split(","):
            results["results"].append(bench_model(name.strip(), args, workdir))
            results["total_s"] = time.perf_counter() - t0
            text = "\n".join(markdown(r) for r in results["results"])
            run.write(text, results, args.out, title="bench_scale")  # after each model: a crash keeps the rest
    print("\n" + text)
    print(f"total {results['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
