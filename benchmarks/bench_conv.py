"""Conv training steps on the CPU against torch: the Adam step of the zoo's small CNN and of
ResNet-18 side by side with torch.optim.Adam on the same function, the per-process
stability of the step time, and what ONNX Runtime's own Conv kernel costs.

    python benchmarks/bench_conv.py [--rounds 10] [--steps 30] [--channels 8,16] [--threads N]
                                    [--ab] [--resnet] [--processes 6] [--bound] [--out FILE.md]

* small CNN (models/cnn.py, `--channels`; the zoo's are 8,16), batch 128 of the 1797 digits:
  our Adam step (`Trainer.step` wall time, and the time inside ONNX Runtime's run of the
  `adam_step` session, the bare program run) against torch's Adam step (torch.optim.Adam,
  lr 1e-3) on a torch twin holding the same weights (checked: the same first-step loss).
  `--rounds` interleaved rounds of `--steps` steps each, the order alternating per round, a
  pause between blocks so that the previous one's spinning workers (ONNX Runtime's and
  OpenMP's) are idle; medians over all steps and the median of the per-round ratios.
  `--ab`: also our step compiled without the Gather forms of Conv (oprules.conv.conv_gather compile option
  off: the Slice/Conv lowerings before them) in the same rounds: the before/after.
* `--resnet`: torchvision's ResNet-18 on the digits as 32x32 RGB images, batch 32, our Adam
  against torch's on the module in eval mode for BatchNorm (the function of the export).
* `--processes P`: P rounds of fresh processes, one per configuration and round, each reporting
  its median small-CNN step: ours (the runtime's session settings), ours with the session
  settings before the explicit thread count (ONNX Runtime's default pool, which pins its
  workers to cores), ours on one thread, and torch's; the spread max/min of the medians.
* `--bound`: ONNX Runtime's Conv forward with the weight as a runtime input (what a training
  step runs) and as a constant (its NCHWc kernels), against torch's conv2d, on the small
  CNN's shapes: what the Conv kernels allow.
Default threads unless `--threads`. One run on one machine; only its ratios carry over.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.models import ZOO, build_small_cnn  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime import device as runtime_device  # noqa: E402

BATCH, RESNET_BATCH = 128, 32


def med(xs) -> float:
    return statistics.median(xs) if len(xs) else float("nan")


# ------------------------------------------------------------------------------ models
def small_cnn(channels):
    """(onnx model, torch twin with the same weights, inputs [N,1,8,8], labels)."""
    import torch
    from onnx import numpy_helper

    model = build_small_cnn(seed=0, channels=channels)
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
    c1, c2 = channels

    class Twin(torch.nn.Module):  # Conv3x3-Relu-MaxPool2-Conv3x3-Relu-GAP-Gemm, as build_small_cnn
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, c1, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(c1, c2, 3, padding=1)
            self.fc = torch.nn.Linear(c2, 10)

        def forward(self, x):
            x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
            return self.fc(torch.relu(self.conv2(x)).mean((2, 3)))

    twin = Twin()
    twin.load_state_dict(weights)
    inputs, y = ZOO["small_cnn"].make_data(None, seed=0)
    return model, twin, inputs["input"], y


def resnet18(workdir: str):
    from kfac_compiler.models import torch_exports as te

    net, (inputs, y) = te.resnet18(), te.digits_images()
    path = te.export(net, os.path.join(workdir, "resnet18.onnx"), inputs["input"][:2])
    return path, net, inputs["input"], y


# ------------------------------------------------------------------------------ steppers
class Ours:
    """Our Adam step on fixed batches: wall time of Trainer.step and time inside the session."""

    def __init__(self, model, x, y, bs, threads=None, gather=True):
        plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False, conv_gather=gather)
        self.tr = Trainer(plan, optimizer="adam", device="cpu", batch_size=bs, seed=0, threads=threads)
        self.prog = self.tr.programs()[next(iter(self.tr.programs()))]
        self.batches = [({"input": np.ascontiguousarray(x[i:i + bs])}, y[i:i + bs].copy())
                        for i in range(0, len(y) - bs + 1, bs)]
        self.k = 0

    def step(self) -> tuple[float, float, float]:
        """(loss, step wall seconds, seconds inside ONNX Runtime)."""
        xb, yb = self.batches[self.k % len(self.batches)]
        self.k += 1
        m = self.tr.step(xb, yb)
        return m["loss"], m["step_time"], self.prog.last_seconds


class Torch:
    """torch.optim.Adam (lr 1e-3) on `net`; BatchNorm on its running statistics."""

    def __init__(self, net, x, y, bs):
        import torch

        self.torch = torch
        self.net = net.train()
        for m in net.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()
        self.opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        self.batches = [(torch.from_numpy(np.ascontiguousarray(x[i:i + bs])), torch.from_numpy(y[i:i + bs].copy()))
                        for i in range(0, len(y) - bs + 1, bs)]
        self.k = 0

    def step(self) -> tuple[float, float]:
        xb, yb = self.batches[self.k % len(self.batches)]
        self.k += 1
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(self.net(xb), yb)
        loss.backward()
        self.opt.step()
        value = loss.item()  # the host reads the loss, as ours does
        return value, time.perf_counter() - t0


def interleaved(steppers: dict, rounds: int, steps: int, gap: float, warmup: int = 5) -> dict:
    """Rounds of `steps` steps of each stepper (name -> Ours or Torch), the order rotating."""
    for st in steppers.values():
        for _ in range(warmup):
            st.step()
    names = list(steppers)
    walls = {n: [] for n in names}
    inside = {n: [] for n in names}
    per_round = []
    for r in range(rounds):
        rw = {}
        for n in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(gap)
            rw[n] = []
            for _ in range(steps):
                out = steppers[n].step()
                rw[n].append(out[1])
                if len(out) > 2:
                    inside[n].append(out[2])
            walls[n] += rw[n]
        per_round.append({n: med(v) for n, v in rw.items()})
    res = {}
    for n in names:
        res[n] = {"ms": 1e3 * med(walls[n]), "p90_ms": 1e3 * float(np.percentile(walls[n], 90))}
        if inside[n]:
            res[n]["session_ms"] = 1e3 * med(inside[n])
        if n != "torch" and "torch" in steppers:
            ratios = [pr[n] / pr["torch"] for pr in per_round]
            res[n].update(ratio=med(walls[n]) / med(walls["torch"]), round_ratio=med(ratios),
                          round_range=(min(ratios), max(ratios)))
            if inside[n]:
                res[n]["session_ratio"] = med(inside[n]) / med(walls["torch"])
    return res


def first_losses(steppers: dict) -> dict:
    """Each stepper's first-step loss (all start from the same weights and batch)."""
    return {n: st.step()[0] for n, st in steppers.items()}


# ------------------------------------------------------------------------------ parts
def run_small(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model, twin, x, y = small_cnn(args.channels)
    steppers = {"ours": Ours(model, x, y, BATCH, args.threads)}
    if args.ab:
        steppers["ours_slice_forms"] = Ours(model, x, y, BATCH, args.threads, gather=False)
    steppers["torch"] = Torch(twin, x, y, BATCH)
    losses = first_losses(steppers)
    res = interleaved(steppers, args.rounds, args.steps, args.gap)
    res["first_loss_diff"] = max(abs(v - losses["torch"]) for v in losses.values())
    return res


def run_resnet(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        path, net, x, y = resnet18(d)
        steppers = {"ours": Ours(path, x, y, RESNET_BATCH, args.threads)}
        if args.ab:
            steppers["ours_slice_forms"] = Ours(path, x, y, RESNET_BATCH, args.threads, gather=False)
    steppers["torch"] = Torch(net, x, y, RESNET_BATCH)
    losses = first_losses(steppers)
    res = interleaved(steppers, args.resnet_rounds, args.resnet_steps, args.gap, warmup=2)
    res["first_loss_diff"] = max(abs(v - losses["torch"]) for v in losses.values())
    return res


def legacy_session_options(threads=None, spin=True):
    """runtime.device.session_options before the explicit thread count: with `threads`
    unset, ONNX Runtime's default pool (one worker per physical core, each pinned)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = int(threads)
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


CONFIGS = ("ours", "ours_ort_default_pool", "ours_1_thread", "torch")


def child(args) -> dict:
    """One fresh process (--child CONFIG): the median small-CNN step of one configuration."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model, twin, x, y = small_cnn(args.channels)
    if args.child == "torch":
        stepper = Torch(twin, x, y, BATCH)
    else:
        if args.child == "ours_ort_default_pool":
            runtime_device.session_options = legacy_session_options
        stepper = Ours(model, x, y, BATCH, 1 if args.child == "ours_1_thread" else args.threads)
    for _ in range(10):
        stepper.step()
    walls = [stepper.step()[1] for _ in range(args.steps * args.rounds)]
    return {"median_ms": 1e3 * med(walls), "p90_ms": 1e3 * float(np.percentile(walls, 90))}


def run_processes(args) -> dict:
    base = [sys.executable, os.path.abspath(__file__), "--channels", ",".join(map(str, args.channels)),
            "--steps", str(args.steps), "--rounds", str(args.rounds)]
    if args.threads:
        base += ["--threads", str(args.threads)]
    rows = {c: [] for c in CONFIGS}
    for p in range(args.processes):
        for c in CONFIGS:
            out = subprocess.run(base + ["--child", c], capture_output=True, text=True, check=True).stdout
            rows[c].append(json.loads(out.strip().splitlines()[-1]))
        print(f"  round {p + 1}: " + ", ".join(f"{c} {rows[c][-1]['median_ms']:.3f}" for c in CONFIGS), flush=True)
    spread = {c: max(r["median_ms"] for r in v) / min(r["median_ms"] for r in v) for c, v in rows.items()}
    return {"rows": rows, "spread": spread}


def run_bound(args) -> list[dict]:
    """ORT's Conv forward (runtime and constant weight) against torch's conv2d, one thread
    and default threads, on the small CNN's conv shapes."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    c1, c2 = args.channels
    shapes = [("conv1", (BATCH, 1, 8, 8), (c1, 1, 3, 3)), ("conv2", (BATCH, c1, 4, 4), (c2, c1, 3, 3))]
    rng = np.random.default_rng(0)
    rows = []
    for threads in (1, None):
        torch.set_num_threads(threads or os.cpu_count())
        for name, xs, ws in shapes:
            x, w = rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)
            node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
            sessions = {}
            for kind in ("runtime", "constant"):
                inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)]
                inits = []
                if kind == "runtime":
                    inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, ws))
                else:
                    inits.append(numpy_helper.from_array(w, "w"))
                out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
                g = helper.make_graph([node], "conv", inputs, out, inits)
                m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
                m.ir_version = 8
                so = ort.SessionOptions()
                so.log_severity_level = 3
                if threads:
                    so.intra_op_num_threads = threads
                sessions[kind] = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            feeds = {"runtime": {"x": x, "w": w}, "constant": {"x": x}}
            xt, wt = torch.from_numpy(x), torch.from_numpy(w)
            fns = {"ort_runtime_w": lambda s=sessions, f=feeds: s["runtime"].run(None, f["runtime"]),
                   "ort_constant_w": lambda s=sessions, f=feeds: s["constant"].run(None, f["constant"]),
                   "torch": lambda xt=xt, wt=wt: torch.conv2d(xt, wt, padding=1)}
            ts = {k: [] for k in fns}
            with torch.no_grad():
                for f in fns.values():
                    for _ in range(20):
                        f()
                for _ in range(args.rounds):
                    for k, f in fns.items():
                        time.sleep(args.gap / 4)
                        for _ in range(args.steps):
                            t0 = time.perf_counter()
                            f()
                            ts[k].append(time.perf_counter() - t0)
            row = {"conv": name, "x": xs, "w": ws, "threads": threads or "default"}
            row.update({k: 1e6 * med(v) for k, v in ts.items()})
            rows.append(row)
            print(f"  {name} {xs} threads={row['threads']}: " + ", ".join(f"{k} {row[k]:.0f} us" for k in fns),
                  flush=True)
    return rows


# ------------------------------------------------------------------------------ report
def step_rows(label: str, res: dict) -> list[str]:
    out = []
    for n, r in res.items():
        if not isinstance(r, dict):
            continue
        if n == "torch":
            out.append(f"| {label} | torch | {r['ms']:.3f} | | 1 | | {r['p90_ms']:.3f} |")
            continue
        out.append(f"| {label} | {n} | {r['ms']:.3f} | {r.get('session_ms', float('nan')):.3f} | **{r['ratio']:.2f}x** "
                   f"(session {r['session_ratio']:.2f}x) | {r['round_ratio']:.2f}x ({r['round_range'][0]:.2f}-"
                   f"{r['round_range'][1]:.2f}) | {r['p90_ms']:.3f} |")
    out.append(f"| {label} | first-step loss, max difference to torch's | {res['first_loss_diff']:.1e} | | | | |")
    return out


def report(args, res: dict) -> str:
    import onnxruntime as ort
    import torch

    lines = [f"# bench_conv ({time.strftime('%Y-%m-%d')})", "",
             f"`python benchmarks/bench_conv.py {' '.join(sys.argv[1:])}` on {platform.machine()}, "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; onnxruntime {ort.__version__}, "
             f"torch {torch.__version__} ({torch.get_num_threads()} threads); ORT threads: "
             f"{args.threads or runtime_device.physical_cores()}.", ""]
    if "small" in res or "resnet" in res:
        lines += ["Adam step, median ms (p90); ratios to torch's median, and the median (range) of the per-round "
                  "ratios:", "",
                  "| model | step | median ms | in session ms | / torch | per round | p90 ms |",
                  "|---|---|---|---|---|---|---|"]
        if "small" in res:
            lines += step_rows(f"small CNN {args.channels}, batch {BATCH}", res["small"])
        if "resnet" in res:
            lines += step_rows(f"ResNet-18, batch {RESNET_BATCH}", res["resnet"])
    if "processes" in res:
        p = res["processes"]
        lines += ["", f"Fresh processes (small CNN, median ms of {args.rounds * args.steps} steps each, rounds in "
                  "order):", "",
                  "| round | " + " | ".join(CONFIGS) + " |", "|---|" + "---|" * len(CONFIGS)]
        for i in range(args.processes):
            lines.append(f"| {i + 1} | " + " | ".join(f"{p['rows'][c][i]['median_ms']:.3f}" for c in CONFIGS) + " |")
        lines.append("| max/min | " + " | ".join(f"{p['spread'][c]:.2f}" for c in CONFIGS) + " |")
    if "bound" in res:
        lines += ["", "ONNX Runtime's Conv forward against torch's conv2d (median us):", "",
                  "| conv | x | w | threads | ORT, runtime weight | ORT, constant weight (NCHWc) | torch |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["bound"]:
            lines.append(f"| {r['conv']} | {r['x']} | {r['w']} | {r['threads']} | {r['ort_runtime_w']:.0f} | "
                         f"{r['ort_constant_w']:.0f} | {r['torch']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30, help="steps per block")
    ap.add_argument("--channels", default="8,16", help="the small CNN's two conv widths (the zoo's: 8,16)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads for both (default: each's own)")
    ap.add_argument("--gap", type=float, default=0.1, help="seconds of pause before each block")
    ap.add_argument("--ab", action="store_true", help="also our step without the Gather forms of Conv")
    ap.add_argument("--resnet", action="store_true", help="also ResNet-18 at batch 32")
    ap.add_argument("--resnet-rounds", type=int, default=5)
    ap.add_argument("--resnet-steps", type=int, default=5)
    ap.add_argument("--processes", type=int, default=0, help="rounds of fresh processes for the stability check")
    ap.add_argument("--bound", action="store_true", help="ORT's Conv kernel against torch's conv2d")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--out", help="write the results as markdown")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.channels = tuple(int(c) for c in args.channels.split(","))
    if args.child:
        print(json.dumps(child(args)))
        return 0
    res = {}
    if not args.skip_small:
        res["small"] = run_small(args)
        print("small CNN:", json.dumps(res["small"]), flush=True)
    if args.resnet:
        res["resnet"] = run_resnet(args)
        print("ResNet-18:", json.dumps(res["resnet"]), flush=True)
    if args.processes:
        res["processes"] = run_processes(args)
    if args.bound:
        res["bound"] = run_bound(args)
    text = report(args, res)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
