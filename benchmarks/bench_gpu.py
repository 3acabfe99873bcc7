"""K-FAC against Adam on real-sized exported models, on a GPU (or the CPU), side by side with
torch's Adam and kfac-pytorch on the same device.

    python benchmarks/bench_gpu.py [--device cuda] [--models resnet18,gpt] [--batch 128]
                                   [--steps 30] [--target-steps 300] [--peers] [--kfac-pytorch DIR]
                                   [--kfac-variant K=V,..] [--adam-variant K=V,..]
                                   [--residency] [--launches] [--out DIR]

Models (kfac_compiler.models.torch_exports, so torch is needed): torchvision's ResNet-18 on
the digits as 32x32 RGB images, and a GPT-2-style causal LM (4 layers, width 256) on the
digits' pixel sequences. For each model:
  * step time: median and mean wall time per step over `--steps` steps after 3 warm-up steps,
    for our K-FAC (its default schedule: the mean includes the inverse refresh every
    inv_update_period steps) and Adam, and with --peers torch's Adam and kfac-pytorch
    (KFACPreconditioner + SGD, its defaults but for the update periods, set to ours) on the
    same torch module, in eval mode for BatchNorm, so it computes the same function as the
    export;
  * residency (ours): per steady-state K-FAC step, bytes written to the device by the runtime
    (the batch, hp scalars) and read back (metrics), and from ONNX Runtime's profile the
    nodes that ran on the CPU provider, the Memcpy nodes with their bytes and the op types
    that took the most time;
  * launches (--launches): node executions per steady-state step of Adam and each K-FAC
    variant (over one inverse period) from ORT's profile; on a GPU these steps are launch-bound, so the ratio
    is the step-time ratio's floor until the node count falls;
  * time to target: Adam (ours, lr 1e-3) trains `--target-steps` steps; its loss on all 1797
    examples is the target; K-FAC (and with --peers torch Adam, kfac-pytorch) trains until
    its full-data loss (checked every 10 steps, evaluation excluded from the time) reaches
    it, or 3x Adam's steps pass.
All numbers come from one run on one machine; they go to <out>/<date>-gpu.md and .json (with
the date, machine, GPU, commit and load; benchmarks/harness.py; `--out -` prints only).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

harness.import_paths()

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.optimizers.base import make_config  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices  # noqa: E402
from kfac_compiler.runtime.device import PROFILE_ENV, get_device  # noqa: E402
from kfac_compiler.runtime.ort_profile import read_profile  # noqa: E402
from torch_peers import full_loss_torch, kfac_pytorch_path, torch_setup, torch_step  # noqa: E402

EVAL_EVERY = 10
OP_TIMES_SHOWN = 8  # --residency: the op types taking the most time per session
say = harness.Report()


# ------------------------------------------------------------------------------ models
def build(name: str, workdir: str):
    """(torch module, onnx path, inputs, targets)."""
    from kfac_compiler.models import torch_exports as te

    if name == "resnet18":
        net, (inputs, y) = te.resnet18(), te.digits_images()
    elif name == "gpt":
        net, (inputs, y) = te.gpt(), te.digits_sequences()
    else:
        raise SystemExit(f"bench_gpu: unknown model {name!r}; choose resnet18 or gpt")
    path = te.export(net, os.path.join(workdir, f"{name}.onnx"), inputs["input"][:2])
    return net, path, inputs["input"], y


def batches(n: int, bs: int, start: int = 0):
    step = start
    while True:
        yield batch_indices(n, bs, step, 0)
        step += 1


# ------------------------------------------------------------------------------ ours
def ours_trainer(plan, optimizer, device, bs, **knobs):
    return Trainer(plan, optimizer=optimizer, device=device, batch_size=bs, seed=0, **knobs)


def full_loss_ours(tr, x, y):
    return tr.evaluate({"input": x}, y, batch_size=512)["loss"]


def time_ours(tr, x, y, bs, steps, warmup=3):
    it = batches(len(y), bs)
    for _ in range(warmup):
        idx = next(it)
        tr.step({"input": x[idx]}, y[idx])
    walls = []
    for _ in range(steps):
        idx = next(it)
        walls.append(tr.step({"input": x[idx]}, y[idx])["step_time"])
    return walls


@contextlib.contextmanager
def profiling():
    """Every ORT session made inside the block records its profile (trainers make some at
    their first use, so the steps belong inside too); read them with session_profiles."""
    os.environ[PROFILE_ENV] = os.path.join(tempfile.mkdtemp(), "prof")
    try:
        yield
    finally:
        del os.environ[PROFILE_ENV]


def session_profiles(tr) -> dict:
    """{program label: ProfileSummary} of a trainer made and run inside profiling()."""
    return {name: read_profile(prog.session.end_profiling()) for name, prog in tr.programs().items()}


def residency(plan, x, y, bs, device, steps=6):
    """Bytes the runtime moves per steady-state K-FAC step and what ORT's profile shows."""
    with profiling():
        tr = ours_trainer(plan, "kfac", device, bs)
        it = batches(len(y), bs)
        for _ in range(3):
            idx = next(it)
            tr.step({"input": x[idx]}, y[idx])
        up0, bytes0 = tr.store.uploads, tr.store.upload_bytes
        data_bytes = 0
        for _ in range(steps):
            idx = next(it)
            batch = {"input": x[idx]}
            data_bytes += x[idx].nbytes + y[idx].nbytes
            tr.step(batch, y[idx])
    uploads = (tr.store.uploads - up0) / steps
    out = {"uploads_per_step": uploads, "batch_bytes_per_step": data_bytes / steps,
           "upload_bytes_per_step": (tr.store.upload_bytes - bytes0) / steps,
           "metrics_bytes_per_step": 4 * len(tr.policy.step_program().metrics), "sessions": {}}
    for name, prof in session_profiles(tr).items():
        runs = max(prof.runs, 1)
        top = sorted(prof.op_times.items(), key=lambda kv: -kv[1][1])[:OP_TIMES_SHOWN]
        out["sessions"][name] = {"runs": prof.runs, "nodes_by_provider": prof.nodes, "cpu_nodes": prof.cpu_nodes,
                                 "copies": {op: {"count": c, "bytes_per_run": b / runs}
                                            for op, (c, b) in prof.copies.items()},
                                 "op_ms_per_run": {f"{op}@{provider.replace('ExecutionProvider', '')}":
                                                   [n / runs, us / runs / 1e3] for (op, provider), (n, us) in top}}
    return out


def _profiled_nodes(plan, optimizer, x, y, bs, device, steps, knobs) -> dict[str, int]:
    """Node executions per session over the first `steps` steps of a fresh trainer."""
    with profiling():
        tr = ours_trainer(plan, optimizer, device, bs, **knobs)
        it = batches(len(y), bs)
        for _ in range(steps):
            idx = next(it)
            tr.step({"input": x[idx]}, y[idx])
    return {name: sum(prof.nodes.values()) for name, prof in session_profiles(tr).items()}


def launches(plan, x, y, bs, device, variants, warmup=3):
    """Node executions (kernel launches on a GPU) per steady-state step, by session, for Adam
    and each K-FAC variant: on the GPU both steps are launch-bound (docs/runtime.md), so their
    ratio bounds the step-time ratio from below. The steady steps span one inverse period
    (its refresh groups and statistics included); they are the difference of two profiled
    runs, warmup steps and warmup + period steps, as ORT's profile holds whole runs only."""
    out = {}
    for label, knobs in variants.items():
        opt = label.split("[")[0]
        options = {k: v for k, v in knobs.items() if k != "cuda_graphs"}  # a Trainer argument, not a knob
        steps = make_config("kfac", plan, **({} if opt == "adam" else options)).inv_update_period
        short = _profiled_nodes(plan, opt, x, y, bs, device, warmup, knobs)
        long = _profiled_nodes(plan, opt, x, y, bs, device, warmup + steps, knobs)
        per = {k: (v - short.get(k, 0)) / steps for k, v in long.items() if v != short.get(k, 0)}
        out[label] = {"steps": steps, "per_step": sum(per.values()), "by_session": per}
    for label in variants:
        out[label]["over_adam"] = out[label]["per_step"] / out["adam"]["per_step"]
    return out


# ------------------------------------------------------------------------------ torch peers
def time_torch(net, opt, pre, dev, x, y, bs, steps, warmup=3):
    import torch

    xt, yt = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
    it = batches(len(y), bs)
    walls = []
    for k in range(warmup + steps):
        idx = torch.from_numpy(next(it)).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch_step(net, opt, pre, xt[idx], yt[idx]).item()  # the host reads the loss, as ours does
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if k >= warmup:
            walls.append(time.perf_counter() - t0)
    return walls


# ------------------------------------------------------------------------------ to target
def to_target(step_fn, loss_fn, n, bs, max_steps, target=None) -> harness.TargetRun:
    """Train with step_fn(batch indices) until loss_fn() <= target (checked every EVAL_EVERY
    steps, evaluation not timed), or max_steps."""
    def step(k):
        step_fn(batch_indices(n, bs, k, 0))

    return harness.to_target(step, loss_fn, max_steps=max_steps, targets=[] if target is None else [target],
                             every=EVAL_EVERY)


def bench_model(name, args, workdir):
    import copy

    net, path, x, y = build(name, workdir)
    n, bs = len(y), args.batch
    t0 = time.perf_counter()
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False)
    res = {"model": name, "batch": bs, "params": int(sum(int(np.prod(s)) for s in plan_param_shapes(plan))),
           "compile_s": time.perf_counter() - t0, "device": args.device}
    say(f"== {name}: {res['params'] / 1e6:.1f}M parameters, batch {bs}, compiled in {res['compile_s']:.1f} s")

    # step times (ours)
    trainers = {}
    variants = {"kfac": {}, "adam": {}}
    for v in args.kfac_variant or ():
        variants[f"kfac[{v}]"] = harness.parse_knobs(v)
    for v in args.adam_variant or ():
        variants[f"adam[{v}]"] = harness.parse_knobs(v)
    for opt, knobs in list(variants.items()):
        t0 = time.perf_counter()
        try:
            trainers[opt] = ours_trainer(plan, opt.split("[")[0], args.device, bs, **knobs)
            build_s = time.perf_counter() - t0
            walls = time_ours(trainers[opt], x, y, bs, args.steps)
        except Exception as e:  # noqa: BLE001 - a variant that cannot run (e.g. a refused capture) is reported
            if opt in ("kfac", "adam"):
                raise
            res[f"ours_{opt}"] = {"error": f"{type(e).__name__}: {e}"}
            say(f"ours {opt}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            del variants[opt]
            continue
        res[f"ours_{opt}"] = {"median_ms": 1e3 * harness.median(walls), "mean_ms": 1e3 * float(np.mean(walls)), "build_s": build_s}
        say(f"ours {opt:12s} step median {1e3 * harness.median(walls):8.2f} ms  mean {1e3 * np.mean(walls):8.2f} ms"
              f"  (sessions built in {build_s:.1f} s)")
        if knobs.get("cuda_graphs"):  # which step sessions run as CUDA graphs (a refused one runs uncaptured)
            progs = trainers[opt].programs()
            res[f"ours_{opt}"]["captured"] = sorted(k for k, p in progs.items() if getattr(p, "capture", False))
            say(f"  captured: {res[f'ours_{opt}']['captured']}; not: "
                f"{sorted(k for k, p in progs.items() if not getattr(p, 'capture', False))}")
    cfg = trainers["kfac"].config
    periods = (cfg.cov_update_period, cfg.inv_update_period)
    res["kfac_over_adam_mean"] = res["ours_kfac"]["mean_ms"] / res["ours_adam"]["mean_ms"]
    say(f"ours K-FAC/Adam mean step {res['kfac_over_adam_mean']:.2f}x")
    del trainers

    if args.residency:
        r = residency(plan, x, y, bs, args.device)
        res["residency"] = r
        say(f"residency per K-FAC step: uploaded {r['upload_bytes_per_step']:.0f} B "
              f"(batch {r['batch_bytes_per_step']:.0f} B), read back {r['metrics_bytes_per_step']} B of metrics")
        for label, sess in r["sessions"].items():
            say(f"  {label}: runs {sess['runs']}, nodes by provider {sess['nodes_by_provider']}, "
                  f"CPU-provider ops {sorted(sess['cpu_nodes']) if args.device != 'cpu' else '-'}, "
                  f"Memcpy per run {sess['copies']}")
            say("    slowest ops (nodes, ms per run): " + ", ".join(
                f"{k} {n:.0f} {ms:.2f}" for k, (n, ms) in sess["op_ms_per_run"].items()))

    if args.launches:
        res["launches"] = launches(plan, x, y, bs, args.device, variants)
        for label, r in res["launches"].items():
            say(f"{label:12s} node executions per step (over {r['steps']} steady steps) {r['per_step']:6.0f}, "
                  f"{r['over_adam']:.2f}x Adam's: " + ", ".join(f"{k} {v:.0f}" for k, v in r["by_session"].items()))

    peers = ("adam", "kfac") if args.peers else ()
    if "kfac" in peers and not kfac_pytorch_path(args.kfac_pytorch):
        harness.skip("kfac-pytorch", "no --kfac-pytorch PATH or $KFAC_PYTORCH with its `kfac` package")
        peers = ("adam",)
    for opt in peers:
        try:
            tnet, topt, pre, dev = torch_setup(copy.deepcopy(net), args.device, opt, periods, kfac_path=args.kfac_pytorch)
            walls = time_torch(tnet, topt, pre, dev, x, y, bs, args.steps)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            res[f"torch_{opt}"] = {"error": f"{type(e).__name__}: {e}"}
            say(f"torch {opt}: {type(e).__name__}: {e}")
            continue
        res[f"torch_{opt}"] = {"median_ms": 1e3 * harness.median(walls), "mean_ms": 1e3 * float(np.mean(walls))}
        label = "kfac-pytorch" if opt == "kfac" else "torch adam"
        say(f"{label:12s} step median {1e3 * harness.median(walls):8.2f} ms  mean {1e3 * np.mean(walls):8.2f} ms")

    if args.target_steps:
        adam = ours_trainer(plan, "adam", args.device, bs, learning_rate=1e-3)
        r = to_target(lambda idx: adam.step({"input": x[idx]}, y[idx]), lambda: full_loss_ours(adam, x, y),
                      n, bs, args.target_steps)
        k, sec, target = r.steps, r.seconds, r.loss
        res["target"] = {"loss": target, "adam_steps": k, "adam_s": sec}
        say(f"target: ours Adam's loss after {k} steps = {target:.4f} ({sec:.2f} s)")
        adam_steady = k * res["ours_adam"]["mean_ms"]

        def report(key, label, steps, seconds, loss, mean_ms):
            # measured: the run's own seconds (its sessions' first runs included: cuDNN's
            # algorithm search, ORT's allocations); steady: steps x the mean step measured above
            row = {"steps": steps, "s": seconds, "loss": loss, "reached": loss <= target,
                   "time_ratio": seconds / sec, "steady_ratio": steps * mean_ms / adam_steady}
            res["target"][key] = row
            say(f"{label}: {steps} steps, {seconds:.2f} s, loss {loss:.4f}: {row['time_ratio']:.2f}x our Adam's "
                  f"time measured, {row['steady_ratio']:.2f}x as steps x mean step"
                  f"{'' if row['reached'] else ' (not reached)'}")

        for opt, knobs in variants.items():
            if opt == "adam":
                continue
            tr = ours_trainer(plan, opt.split("[")[0], args.device, bs, **knobs)
            r = to_target(lambda idx, tr=tr: tr.step({"input": x[idx]}, y[idx]),
                          lambda tr=tr: full_loss_ours(tr, x, y), n, bs, 3 * args.target_steps, target)
            report(f"ours_{opt}", f"ours {opt}", r.steps, r.seconds, r.loss, res[f"ours_{opt}"]["mean_ms"])
            del tr
        for opt in peers:
            if "error" in res.get(f"torch_{opt}", {}):
                continue
            import torch

            label = "kfac-pytorch" if opt == "kfac" else "torch adam"
            tnet, topt, pre, dev = torch_setup(copy.deepcopy(net), args.device, opt, periods, kfac_path=args.kfac_pytorch)
            xt, yt = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)

            def tstep(idx, tnet=tnet, topt=topt, pre=pre, dev=dev, xt=xt, yt=yt):
                i = torch.from_numpy(idx).to(dev)
                torch_step(tnet, topt, pre, xt[i], yt[i]).item()

            try:
                r = to_target(tstep, lambda tnet=tnet, dev=dev: full_loss_torch(tnet, dev, x, y),
                              n, bs, 3 * args.target_steps, target)
            except Exception as e:  # noqa: BLE001 - e.g. kfac-pytorch's eigh failing to converge
                res["target"][f"torch_{opt}"] = {"error": f"{type(e).__name__}: {e}"}
                say(f"{label}: {type(e).__name__}: {str(e).splitlines()[0]}")
                continue
            report(f"torch_{opt}", label, r.steps, r.seconds, r.loss, res[f"torch_{opt}"]["mean_ms"])
    return res


def plan_param_shapes(plan):
    from onnx import numpy_helper

    inits = {t.name: t for t in plan.model.graph.initializer}
    return [numpy_helper.to_array(inits[p]).shape for p in plan.trainable]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--models", default="resnet18,gpt")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per optimizer")
    ap.add_argument("--target-steps", type=int, default=300, help="Adam's steps for the target (0: skip)")
    ap.add_argument("--peers", action="store_true", help="also torch's Adam and kfac-pytorch")
    ap.add_argument("--kfac-pytorch", help="directory holding kfac-pytorch's `kfac` package (default: $KFAC_PYTORCH)")
    ap.add_argument("--residency", action="store_true", help="profile the bytes a K-FAC step moves")
    ap.add_argument("--launches", action="store_true",
                    help="count the node executions (GPU kernel launches) per steady step of Adam and K-FAC")
    ap.add_argument("--kfac-variant", action="append",
                    help="also K-FAC with these knobs (Trainer arguments too), e.g. inv_update_period=50 or "
                         "cuda_graphs=1 (repeatable)")
    ap.add_argument("--adam-variant", action="append",
                    help="also Adam with these knobs, e.g. cuda_graphs=1 (repeatable)")
    harness.add_out_argument(ap)
    args = ap.parse_args(argv)
    run = harness.Run("gpu", argv)
    args.device = get_device(args.device).name
    warnings.simplefilter("ignore")
    torch = harness.require("torch", "bench_gpu's models (kfac_compiler.models.torch_exports)")
    run.extra["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models.split(","):
            results.append(bench_model(name, args, workdir))
            run.write(say.text(), results, args.out, title="bench_gpu")  # after each model: a crash keeps the rest
    return 0


if __name__ == "__main__":
    sys.exit(main())
