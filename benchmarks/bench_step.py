"""What one training step costs: per-step times, their breakdown, node counts and memory, on
the zoo, ResNet-18 and the GPT export (the time to a loss is bench_to_target.py's).

    python benchmarks/bench_step.py SUBCOMMAND [options] [--out DIR]

  zoo        K-FAC vs SGD vs Adam step times on the digits autoencoder and classifier
             (interleaved rounds), the host overhead, and a breakdown of the fused K-FAC step
  resnet     ResNet-18 (torch export) step time of K-FAC, Adam and SGD, and the plan's size
  spread     ResNet-18 step times with the inverse refresh in one program vs spread groups
  backward   forward+backward against forward alone per zoo model (gradient graphs, ORT CPU)
  curvature  the curvature subgraphs of every zoo model: gradients, statistics, inverses
  conv       our conv Adam step against torch.optim.Adam (small CNN, ResNet-18), the
             per-process stability and what ORT's Conv kernel costs (needs torch)
  patches    the conv blocks' patch extraction (im2col in ONNX) on ResNet-18's conv shapes
  memory     peak RSS and step time of ORT's memory options for the runtime's sessions
  compile    the compiler front end on a generated deep MLP and the zoo's transformer block
  nodes      nodes per step of SGD, Adam (per-parameter and multi-tensor updates) and K-FAC
             on the zoo, ResNet-18 and the GPT export: in the emitted graphs, and executed
             per steady step in ONNX Runtime's profile (CPU; K-FAC over one inverse period)
  kinds      K-FAC's static_steps (one If-free, static-shape graph per step kind) against
             the If form: executed nodes, Shape arithmetic, step sessions, capture blockers

Every subcommand writes <out>/<date>-step-<subcommand>.md (and .json) with the date,
machine, commit and load (benchmarks/harness.py); `--out -` prints only. This VM's speed
drifts by +-30% within minutes: compare ratios from interleaved rounds, not absolute times.
GPU node counts (launches) are bench_gpu.py --launches; `nodes` counts them on the CPU (the
same graphs; ORT's CPU and CUDA graph optimizations differ a little).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

harness.import_paths()

ZOO_MODELS = (("digits_autoencoder", 256), ("mlp_classifier", 128))
OPTIMIZERS = ("kfac", "sgd", "adam")


def ms(x: float) -> str:
    return f"{1e3 * x:8.3f}"


# ============================================================================== zoo
def zoo_step_times(plan, x, y, bs, rounds, block, device, threads=None):
    """Per-step wall times of K-FAC, SGD and Adam from interleaved rounds: each round runs
    `block` steps of every optimizer in turn, after a 50 ms pause (idle ONNX Runtime workers
    of the previous trainer stop spinning) and 2 unrecorded wake-up steps. Returns ({optimizer:
    {"step", "mean", "host", "session", "trainer"}}, per-round K-FAC/SGD mean ratios)."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    trainers = {o: Trainer(plan, optimizer=o, device=device, threads=threads, batch_size=bs) for o in OPTIMIZERS}
    count = dict.fromkeys(OPTIMIZERS, 0)
    hosts = {o: [] for o in OPTIMIZERS}
    sess = {o: [] for o in OPTIMIZERS}

    def steps(o, n, record):
        tr, walls = trainers[o], []
        for _ in range(n):
            idx = batch_indices(len(y), bs, count[o], 0)
            count[o] += 1
            s0 = tr.session_seconds()
            m = tr.step({"input": x[idx]}, y[idx])
            if record:
                walls.append(m["step_time"])
                hosts[o].append(m["host_time"])
                sess[o].append(tr.session_seconds() - s0)
        return walls

    for o in OPTIMIZERS:
        steps(o, 20, False)  # the first runs of every session

    def block_of(o):
        def run():
            steps(o, 2, False)
            return steps(o, block, True)
        return run

    res = harness.interleave({o: block_of(o) for o in OPTIMIZERS}, rounds, gap=0.05, rotate=False)
    out = {o: {"step": harness.median(harness.flat(res[o])), "mean": statistics.fmean(harness.flat(res[o])),
               "host": harness.median(hosts[o]), "session": harness.median(sess[o]), "trainer": trainers[o]}
           for o in OPTIMIZERS}
    return out, harness.round_ratios(res, "kfac", "sgd")


def kfac_breakdown(tr, x, y, bs, reps):
    """Marginal costs from variants of the fused K-FAC step (the trainer's own sessions and
    state, one batch, medians of `reps` runs each): isolated runs of the unfused subgraphs
    would run on non-spinning sessions and overstate their cost."""
    from kfac_compiler.optimizers import ema_coefficient
    from kfac_compiler.runtime.data import batch_indices, draw_noise

    cfg = tr.config
    idx = batch_indices(len(y), bs, 0, 0)
    data = {"input": x[idx], "targets": y[idx]}
    store = tr.store
    opts = tr.policy.step_options()
    full_p = tr.program("kfac_step", options=dataclasses.replace(opts, with_stats=True, stats_if=False))
    nostats_p = tr.program("kfac_step", options=dataclasses.replace(opts, with_stats=False, stats_if=False))
    plain_p = tr.program("kfac_step", options=dataclasses.replace(
        opts, with_stats=False, stats_if=False, qmodel=False, momentum_type="regular", qmodel_batch=None,
        loss_after=False))
    noise = draw_noise(np.random.default_rng(0), full_p.info, full_p.data_inputs, data["targets"])
    for k, v in {**data, **noise}.items():
        store.write_data(k, v)
    hp = {"hp/ema_coeff": ema_coefficient(0.5, cfg.cov_ema_decay)[0], "hp/update_stats": 1.0,
          "hp/damping": tr.damping, "hp/l2": cfg.l2_reg,
          "hp/loss_after": 0.0, "hp/reject_increase": 0.0, "hp/loss_limit": float("inf"),
          "hp/max_momentum": cfg.max_momentum,
          "hp/max_predicted_decrease": cfg.max_predicted_decrease or 0.0,
          "hp/learning_rate": 1e-4, "hp/momentum": 0.0, "hp/norm_constraint": 0.0}
    for k, v in hp.items():
        store.set_hp(k, v)
    snap = tr.state()  # the runs mutate parameters, factors and inverses: restored below

    def t(fn):
        time.sleep(0.05)  # a pause between measurements: the previous session's spinning workers go idle
        return harness.median(harness.timed(fn, reps))

    t_full = t(lambda: full_p.run(store))
    t_nostats = t(lambda: nostats_p.run(store))
    t_plain = t(lambda: plain_p.run(store))
    store.set_hp("hp/loss_after", 1.0)
    t_adapt = t(lambda: full_p.run(store))
    store.set_hp("hp/loss_after", 0.0)
    t_inv = t(tr.policy.refresh_inverses)  # the emitted part and any host-side blocks
    for k, v in snap.items():
        store.set(k, v)
    return {
        "fwd+bwd+precondition+update": t_plain,
        "statistics": t_full - t_nostats,
        "quadratic model": t_nostats - t_plain,
        "LM forward/step": (t_adapt - t_full) / cfg.damping_adaptation_interval,
        "inverse (raw)": t_inv,
        "inverse/step": t_inv / cfg.inv_update_period,
        "fused kfac_step": t_full,
    }


def cmd_zoo(args, say, run):
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO

    rounds, block, reps = (args.rounds, args.block, args.reps) if not args.quick else (3, 10, 20)
    results = {}
    for name, bs in ZOO_MODELS:
        if args.models and name not in args.models.split(","):
            continue
        e = ZOO[name]
        t0 = time.perf_counter()
        plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
        inputs, y = e.make_data(None, seed=0)
        x = inputs["input"]
        r = {"batch": bs, "compile_s": time.perf_counter() - t0}
        say(f"\n== {name} (batch {bs}, {len(y)} examples, device {args.device}) ==")
        per, ratios = zoo_step_times(plan, x, y, bs, rounds, block, args.device, args.threads)
        say(f"{'optimizer':10s} {'median':>8s} {'mean':>8s} {'session':>8s} {'host':>8s}  (ms per step, {rounds} "
            f"interleaved rounds of {block} steps; mean includes K-FAC's inverse refreshes)")
        for opt, t in per.items():
            say(f"{opt:10s} {ms(t['step'])} {ms(t['mean'])} {ms(t['session'])} {ms(t['host'])}")
            r[opt] = {"step_ms": 1e3 * t["step"], "mean_step_ms": 1e3 * t["mean"], "host_ms": 1e3 * t["host"],
                      "session_ms": 1e3 * t["session"]}
        q1, q3 = np.percentile(ratios, [25, 75])
        r["kfac_over_sgd"] = {"median_step": per["kfac"]["step"] / per["sgd"]["step"],
                              "mean_step": per["kfac"]["mean"] / per["sgd"]["mean"],
                              "per_round_mean": harness.spread(ratios).as_dict(), "quartiles": [q1, q3]}
        say(f"K-FAC / SGD step: median {r['kfac_over_sgd']['median_step']:.2f}x, mean "
            f"{r['kfac_over_sgd']['mean_step']:.2f}x; per-round mean ratio: {harness.spread(ratios).format('.2f', 'x')}"
            f", quartiles {q1:.2f}-{q3:.2f}")
        tr = per["kfac"]["trainer"]
        bd = kfac_breakdown(tr, x, y, bs, reps)
        r["kfac_breakdown_ms"] = {k: 1e3 * v for k, v in bd.items()}
        say(f"K-FAC breakdown (inv_update_period {tr.config.inv_update_period}):")
        for k, v in bd.items():
            say(f"  {k:28s} {ms(v)} ms")
        say(f"  {'host overhead':28s} {ms(per['kfac']['host'])} ms (step wall - session time)")
        results[name] = r
    return results


# ============================================================================== resnet
def resnet_export(workdir: str):
    """(ResNet-18 ONNX path, torch module, inputs, targets) on the digits as 32x32 RGB."""
    te = _torch_exports("ResNet-18")
    net, (inputs, y) = te.resnet18(), te.digits_images()
    path = os.path.join(workdir, "resnet18.onnx")
    if not os.path.exists(path):
        te.export(net, path, inputs["input"][:2])
    return path, net, inputs["input"], y


def _torch_exports(what: str):
    harness.require("torch", f"{what} (kfac_compiler.models.torch_exports)")
    from kfac_compiler.models import torch_exports as te

    return te


def cmd_resnet(args, say, run):
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    knobs = harness.parse_knobs(args.knob)
    bs = args.batch
    with tempfile.TemporaryDirectory() as work:
        path, _, x, y = resnet_export(work)
        plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", budget={"batch_size": bs})
        out = plan.save(os.path.join(work, "plan"))
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        model_size = os.path.getsize(path)
    say(f"model {model_size / 1e6:.1f} MB, plan directory {size / 1e6:.1f} MB ({size / model_size:.2f}x)")
    c = plan.costs
    say(f"predicted: curvature {c['overhead']:.2f}x the forward+backward, statistics every {c['stats_period']}, "
        f"inverses every {c['inverse_period']} steps; {sum(lay.approximation != 'kron' for lay in plan.layers)} "
        "layers with a diagonal factor")
    trainers = {"kfac": Trainer(plan, optimizer="kfac", device="cpu", batch_size=bs, seed=0, **knobs),
                "adam": Trainer(plan, optimizer="adam", device="cpu", batch_size=bs, seed=0),
                "sgd": Trainer(plan, optimizer="sgd", device="cpu", batch_size=bs, seed=0)}
    count = dict.fromkeys(trainers, 0)

    def steps(o, n):
        walls = []
        for _ in range(n):
            s = count[o]
            count[o] += 1
            idx = np.arange(s * bs, (s + 1) * bs) % len(y)
            walls.append(trainers[o].step({"input": x[idx]}, y[idx])["step_time"])
        return walls

    for o in trainers:
        steps(o, 3)  # the first steps (sessions' first runs) are not timed
    res = harness.interleave({o: (lambda o=o: steps(o, args.block)) for o in trainers}, args.rounds, rotate=False)
    data = {"model_mb": model_size / 1e6, "plan_mb": size / 1e6, "knobs": knobs}
    for o in trainers:
        w = harness.flat(res[o])
        data[o] = {"median_ms": 1e3 * harness.median(w), "mean_ms": 1e3 * float(np.mean(w)), "max_ms": 1e3 * max(w)}
        say(f"{o:5s} step median {data[o]['median_ms']:8.1f} ms  mean {data[o]['mean_ms']:8.1f} ms  "
            f"max {data[o]['max_ms']:8.1f} ms")
    for o in ("adam", "sgd"):
        say(f"K-FAC / {o}: mean {data['kfac']['mean_ms'] / data[o]['mean_ms']:.2f}x, "
            f"median {data['kfac']['median_ms'] / data[o]['median_ms']:.2f}x")
    return data


# ============================================================================== spread
def cmd_spread(args, say, run):
    """Per round and config a fresh trainer (one at a time: a ResNet-18 K-FAC trainer holds
    ~5 GB) runs steps 0..steps on the same batches; steps 1..steps are recorded."""
    import gc

    import kfac_compiler as kc
    from kfac_compiler.blocks import plan_blocks
    from kfac_compiler.optimizers.kfac import refresh as R
    from kfac_compiler.runtime import Trainer

    work = os.path.join(tempfile.gettempdir(), "bench_step-spread")
    os.makedirs(work, exist_ok=True)
    path, _, x, y = resnet_export(work)
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits")
    batch, steps = args.batch, args.steps
    # "before": the refresh as it was, one program on one ORT thread (refresh_threads patched)
    configs = {"before: 1 group, 1 thread": (dict(inverse_groups=1), 1),
               "1 group, threads by size": (dict(inverse_groups=1), None),
               "after: auto": ({}, None)}
    blocks = plan_blocks(plan)

    def batch_at(k):
        idx = np.random.default_rng([0, k]).choice(len(y), batch, replace=False)
        return {"input": x[idx]}, y[idx]

    times = {k: [] for k in configs}
    losses = {k: [] for k in configs}
    refresh = {k: [] for k in configs}
    cpu = {k: [] for k in configs}  # process CPU seconds per step: steadier than wall time
    refresh_cpu = {k: [] for k in configs}
    first, desc, ratios = {}, {}, []
    names = list(configs)
    for r in range(args.rounds):
        means = {}
        for name, (kw, refresh_threads) in configs.items():
            rule = R.refresh_threads
            if refresh_threads is not None:
                R.refresh_threads = lambda cost, device, n=refresh_threads: n
            try:
                tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=batch, seed=0, threads=args.threads, **kw)
            finally:
                R.refresh_threads = rule
            groups = tr.policy.refresher.groups
            gf = [sum(blocks[lay].inverse_flops(tr.inverse_method) for lay in g) / 1e9 for g in groups]
            desc[name] = (f"* {name}: {len(groups)} group(s), period {tr.policy.config.inv_update_period}: "
                          + ", ".join(f"{len(g)} blocks {f:.0f} GFLOP" for g, f in zip(groups, gf)))
            first.setdefault(name, []).append(tr.step(*batch_at(0))["step_time"])
            round_times = []
            for k in range(1, steps + 1):
                c0 = time.process_time()
                m = tr.step(*batch_at(k))
                cpu[name].append(time.process_time() - c0)
                round_times.append(m["step_time"])
                if r == 0:
                    losses[name].append(m["loss"])
                if m["inverse"]:
                    refresh[name].append(m["step_time"])
                    refresh_cpu[name].append(cpu[name][-1])
            times[name] += round_times
            means[name] = float(np.mean(round_times))
            del tr
            gc.collect()
        ratios.append(means[names[-1]] / means[names[0]])
        print(f"round {r}: " + ", ".join(f"{k} mean {v:.3f} s" for k, v in means.items()), file=sys.stderr, flush=True)

    def stats(ts):
        ts = np.asarray(ts)
        return {"mean": ts.mean(), "median": harness.median(ts), "p90": np.percentile(ts, 90), "max": ts.max()}

    for line in desc.values():
        say(line)
    say()
    say(f"ResNet-18, batch {batch}, ORT threads {args.threads or 'default'}, {args.rounds} rounds, each config's "
        f"fresh trainer in turn, steps 1..{steps} recorded; step 0 (sessions' first runs, full refresh): "
        + ", ".join(f"{k} {harness.median(v):.2f} s" for k, v in first.items()))
    say()
    rows = []
    for name in configs:
        st = stats(times[name])
        picks = [losses[name][i - 1] for i in (1, 10, 20) if i <= len(losses[name])]
        rows.append([name, f"{st['mean']:.3f}", f"{st['median']:.3f}", f"{st['p90']:.3f}", f"{st['max']:.3f}",
                     " ".join(f"{t:.2f}" for t in refresh[name]), " ".join(f"{v:.3f}" for v in picks)])
    say(harness.table(["config", "mean step [s]", "median", "p90", "max", "refresh steps [s]",
                       "batch loss at steps 1, 10, 20"], rows))
    say()
    say("Process CPU time per step [s] (the same steps):")
    say()
    rows = []
    for name in configs:
        st = stats(cpu[name])
        rows.append([name, f"{st['mean']:.3f}", f"{st['median']:.3f}", f"{st['p90']:.3f}", f"{st['max']:.3f}",
                     " ".join(f"{t:.2f}" for t in refresh_cpu[name])])
    say(harness.table(["config", "mean", "median", "p90", "max", "refresh steps"], rows))
    c0, c1 = stats(cpu[names[0]]), stats(cpu[names[-1]])
    s0, s1 = stats(times[names[0]]), stats(times[names[-1]])
    say()
    say(f"CPU time, max step after / before: {c1['max'] / c0['max']:.3f}; mean: {c1['mean'] / c0['mean']:.3f}")
    say("per-round mean step, after / before (first and last config): " + ", ".join(f"{r:.3f}" for r in ratios)
        + f" (median {harness.median(ratios):.3f})")
    say(f"max step after / before: {s1['max'] / s0['max']:.3f}; mean: {s1['mean'] / s0['mean']:.3f}")
    return {"times": times, "cpu": cpu, "refresh": refresh, "losses": losses, "ratios": ratios, "groups": desc}


# ============================================================================== backward
def cmd_backward(args, say, run):
    """Median wall time of the forward model and of gradient_model (forward + seed input + all
    "grad/<param>" outputs) per zoo model, once per intra-op thread setting (on a shared or
    busy machine the single-thread figures are the stable ones)."""
    import onnxruntime as ort
    from onnx import TensorProto

    from kfac_compiler.models import ZOO, get_model
    from kfac_compiler.passes.autodiff import gradient_model

    def session(model, threads):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    rows = []
    names = args.models.split(",") if args.models else list(ZOO)
    for threads in [int(t) for t in str(args.threads).split(",")]:
        label = f"{threads} thread{'s' if threads != 1 else ''}" if threads else "ORT default threads"
        say(f"ONNX Runtime {ort.__version__} CPU ({label}), batch {args.batch}, median (min-max) of {args.runs} runs")
        say()
        table = []
        for name in names:
            model = get_model(name)
            params = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]
            x, _ = ZOO[name].make_data(n=args.batch, seed=0)
            fwd = session(model, threads)
            (out,) = fwd.run(["logits"], x)
            gm = gradient_model(model, "logits", params)
            bwd = session(gm, threads)
            feeds = {**x, "logits_grad": np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)}
            t_f = harness.spread(harness.timed(lambda fwd=fwd, x=x: fwd.run(None, x), args.runs, warmup=3)).scaled(1e3)
            t_b = harness.spread(harness.timed(lambda bwd=bwd, feeds=feeds: bwd.run(None, feeds), args.runs,
                                               warmup=3)).scaled(1e3)
            r = {"model": name, "threads": threads, "batch": args.batch, "forward_ms": t_f.as_dict(),
                 "fwd_bwd_ms": t_b.as_dict(), "ratio": t_b.median / t_f.median,
                 "forward_nodes": len(model.graph.node), "backward_nodes": len(gm.graph.node) - len(model.graph.node)}
            rows.append(r)
            table.append([name, t_f.format(), t_b.format(), f"{r['ratio']:.2f}", r["forward_nodes"],
                          r["backward_nodes"]])
            print(table[-1], file=sys.stderr, flush=True)
        say(harness.table(["model", "fwd ms", "fwd+bwd ms", "ratio", "fwd nodes", "bwd nodes"], table))
        say()
    return rows


# ============================================================================== curvature
def _curvature_feeds(sess, plan, info, x, y, rng):
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in plan.model.graph.initializer}
    feeds = dict(x)
    n = len(y)
    for i in sess.get_inputs():
        name = i.name
        if name in feeds:
            continue
        if name == "targets":
            feeds[name] = y
        elif name.startswith("noise/"):
            shape = [n if not isinstance(d, int) else d for d in i.shape]
            feeds[name] = rng.uniform(1e-6, 1 - 1e-6, size=shape).astype(np.float32)
        elif name.startswith("hp/"):
            feeds[name] = np.array(1e-2 if name == "hp/damping" else 0.5, np.float32)
        elif name in inits:
            feeds[name] = inits[name]
        else:
            shape = list(info.state_specs[name].shape)
            square = len(shape) >= 2 and shape[-1] == shape[-2]
            if name.startswith("factor/"):
                if square:
                    a = rng.normal(size=shape[:-1] + [max(2 * shape[-1], 8)]).astype(np.float32)
                    feeds[name] = (a @ np.swapaxes(a, -1, -2) / a.shape[-1]).astype(np.float32)
                else:
                    feeds[name] = np.abs(rng.normal(size=shape)).astype(np.float32)
            elif info.state_specs[name].init == "identity" and square:
                feeds[name] = np.broadcast_to(np.eye(shape[-1], dtype=np.float32), shape).copy()
            else:
                feeds[name] = np.ones(shape, np.float32)
    return feeds


def cmd_curvature(args, say, run):
    """The emitted `gradients` graph (the baseline), `update_statistics` (forward + backward
    seeds + factor statistics + moving averages), one inverse update per emitted method, and
    host `eigh` through each block's numpy twin (float64, copies included); medians."""
    import onnxruntime as ort

    import kfac_compiler as kc
    from kfac_compiler.backend import emit_subgraph
    from kfac_compiler.blocks import plan_blocks
    from kfac_compiler.models import ZOO, get_model

    providers = (["CPUExecutionProvider"] if args.device == "cpu"
                 else [("CUDAExecutionProvider", {"use_tf32": 0}), "CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    say(f"device={args.device} ort={ort.__version__} repeats={args.repeats}; median ms")
    say()
    rows, table = [], []
    for name in (args.models.split(",") if args.models else list(ZOO)):
        entry = ZOO[name]
        plan = kc.compile(get_model(name), loss=entry.loss, output="logits", emit=False)
        n = 256 if name == "digits_autoencoder" else 128
        x, y = entry.make_data(n)
        row = {"model": name, "batch": n}
        for key, sg, opts in [("gradients", "gradients", {}), ("stats", "update_statistics", {}),
                              ("inverse_op", "inverse_update", {"method": "inverse_op"}),
                              ("newton_schulz", "inverse_update", {"method": "newton_schulz"})]:
            model, info = emit_subgraph(plan, sg, **opts)
            sess = ort.InferenceSession(model.SerializeToString(), providers=providers)
            if args.device == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
                raise SystemExit("skipped: the CUDA execution provider is not available")
            feeds = _curvature_feeds(sess, plan, info, x, y, rng)
            row[key] = 1e3 * harness.median(harness.timed(lambda sess=sess, feeds=feeds: sess.run(None, feeds),
                                                          args.repeats, warmup=3))
        model, info = emit_subgraph(plan, "update_statistics")
        feeds = _curvature_feeds(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]),
                                 plan, info, x, y, rng)
        blocks = plan_blocks(plan)
        factors = {layer: {s.name: feeds[f"factor/{layer}/{s.name}"] for s in block.factor_specs()}
                   for layer, block in blocks.items()}

        def host_eigh(blocks=blocks, factors=factors):
            for layer, block in blocks.items():
                block.numpy_inverse(factors[layer], 1e-2, "eigh")

        row["eigh"] = 1e3 * harness.median(harness.timed(host_eigh, max(5, args.repeats // 3), warmup=3))
        rows.append(row)
        table.append([name, n, f"{row['gradients']:.3f}", f"{row['stats']:.3f}", f"{row['stats'] / row['gradients']:.2f}",
                      f"{row['inverse_op']:.3f}", f"{row['newton_schulz']:.3f}", f"{row['eigh']:.3f}"])
        print(table[-1], file=sys.stderr, flush=True)
    say(harness.table(["model", "batch", "grads", "stats", "stats/grads", "inverse_op", "newton_schulz", "eigh"], table))
    return rows


# ============================================================================== conv
CONV_BATCH, CONV_RESNET_BATCH = 128, 32
CONV_CONFIGS = ("ours", "ours_ort_default_pool", "ours_1_thread", "torch")


def small_cnn_twin(channels):
    """(onnx model, torch twin with the same weights, inputs [N,1,8,8], labels)."""
    from kfac_compiler.models import ZOO, build_small_cnn
    from torch_peers import small_cnn_twin as twin

    model = build_small_cnn(seed=0, channels=channels)
    inputs, y = ZOO["small_cnn"].make_data(None, seed=0)
    return model, twin(model, channels), inputs["input"], y


class OursAdam:
    """Our Adam step on fixed batches: wall time of Trainer.step and time inside the session."""

    def __init__(self, model, x, y, bs, threads=None, gather=True):
        import kfac_compiler as kc
        from kfac_compiler.runtime import Trainer

        # conv_gather=False: the Slice/Conv/ConvTranspose forms only (a compile option, in every graph's key)
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


class TorchAdam:
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


def conv_interleaved(steppers: dict, rounds: int, steps: int, gap: float) -> dict:
    """Rounds of `steps` steps of each stepper, the order rotating; medians, p90 and the
    ratios to torch's (overall and the median of the per-round ones)."""
    inside = {n: [] for n in steppers}

    def block(n):
        def go():
            walls = []
            for _ in range(steps):
                out = steppers[n].step()
                walls.append(out[1])
                if len(out) > 2:
                    inside[n].append(out[2])
            return walls
        return go

    res = harness.interleave({n: block(n) for n in steppers}, rounds, gap=gap)
    out = {}
    for n in steppers:
        walls = harness.flat(res[n])
        out[n] = {"ms": 1e3 * harness.median(walls), "p90_ms": 1e3 * float(np.percentile(walls, 90))}
        if inside[n]:
            out[n]["session_ms"] = 1e3 * harness.median(inside[n])
        if n != "torch" and "torch" in steppers:
            ratios = harness.round_ratios(res, n, "torch", stat=statistics.median)
            out[n].update(ratio=harness.median(walls) / harness.median(harness.flat(res["torch"])),
                          round_ratio=harness.median(ratios), round_range=(min(ratios), max(ratios)))
            if inside[n]:
                out[n]["session_ratio"] = harness.median(inside[n]) / harness.median(harness.flat(res["torch"]))
    return out


def _warm(steppers: dict, n: int) -> dict:
    """The first-step losses (all start from the same weights and batch), then n-1 more steps each."""
    losses = {name: st.step()[0] for name, st in steppers.items()}
    for st in steppers.values():
        for _ in range(n - 1):
            st.step()
    return losses


def conv_steps(args, resnet: bool) -> dict:
    """Our Adam step (and with --ab the Slice forms) against torch's on the small CNN or
    ResNet-18, interleaved; the first-step losses' largest difference to torch's."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        if resnet:
            model, net, x, y = resnet_export(d)
            bs, rounds, steps, warm = CONV_RESNET_BATCH, args.resnet_rounds, args.resnet_steps, 3
        else:
            model, net, x, y = small_cnn_twin(args.channels)
            bs, rounds, steps, warm = CONV_BATCH, args.rounds, args.steps, 6
        steppers = {"ours": OursAdam(model, x, y, bs, args.threads)}
        if args.ab:
            steppers["ours_slice_forms"] = OursAdam(model, x, y, bs, args.threads, gather=False)
    steppers["torch"] = TorchAdam(net, x, y, bs)
    losses = _warm(steppers, warm)
    res = conv_interleaved(steppers, rounds, steps, args.gap)
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


def conv_child(args) -> dict:
    """One fresh process (conv --child CONFIG): the median small-CNN step of one configuration."""
    import torch

    from kfac_compiler.runtime import device as runtime_device

    if args.threads:
        torch.set_num_threads(args.threads)
    model, twin, x, y = small_cnn_twin(args.channels)
    if args.child == "torch":
        stepper = TorchAdam(twin, x, y, CONV_BATCH)
    else:
        if args.child == "ours_ort_default_pool":
            runtime_device.session_options = legacy_session_options
        stepper = OursAdam(model, x, y, CONV_BATCH, 1 if args.child == "ours_1_thread" else args.threads)
    for _ in range(10):
        stepper.step()
    walls = [stepper.step()[1] for _ in range(args.steps * args.rounds)]
    return {"median_ms": 1e3 * harness.median(walls), "p90_ms": 1e3 * float(np.percentile(walls, 90))}


def conv_processes(args) -> dict:
    base = [sys.executable, os.path.abspath(__file__), "conv", "--channels", ",".join(map(str, args.channels)),
            "--steps", str(args.steps), "--rounds", str(args.rounds)]
    if args.threads:
        base += ["--threads", str(args.threads)]
    rows = {c: [] for c in CONV_CONFIGS}
    for p in range(args.processes):
        for c in CONV_CONFIGS:
            out = subprocess.run(base + ["--child", c], capture_output=True, text=True, check=True).stdout
            rows[c].append(json.loads(out.strip().splitlines()[-1]))
        print(f"  round {p + 1}: " + ", ".join(f"{c} {rows[c][-1]['median_ms']:.3f}" for c in CONV_CONFIGS),
              file=sys.stderr, flush=True)
    spread = {c: max(r["median_ms"] for r in v) / min(r["median_ms"] for r in v) for c, v in rows.items()}
    return {"rows": rows, "spread": spread}


def conv_bound(args) -> list:
    """ORT's Conv forward (runtime and constant weight) against torch's conv2d, one thread
    and default threads, on the small CNN's conv shapes."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    c1, c2 = args.channels
    shapes = [("conv1", (CONV_BATCH, 1, 8, 8), (c1, 1, 3, 3)), ("conv2", (CONV_BATCH, c1, 4, 4), (c2, c1, 3, 3))]
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
                m = helper.make_model(helper.make_graph([node], "conv", inputs, out, inits),
                                      opset_imports=[helper.make_opsetid("", 17)])
                m.ir_version = 8
                so = ort.SessionOptions()
                so.log_severity_level = 3
                if threads:
                    so.intra_op_num_threads = threads
                sessions[kind] = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            xt, wt = torch.from_numpy(x), torch.from_numpy(w)
            fns = {"ort_runtime_w": lambda s=sessions["runtime"], x=x, w=w: s.run(None, {"x": x, "w": w}),
                   "ort_constant_w": lambda s=sessions["constant"], x=x: s.run(None, {"x": x}),
                   "torch": lambda xt=xt, wt=wt: torch.conv2d(xt, wt, padding=1)}
            with torch.no_grad():
                res = harness.interleave({k: (lambda f=f: harness.timed(f, args.steps, warmup=0)) for k, f in fns.items()},
                                         args.rounds, gap=args.gap / 4, rotate=False, warmup=1)
            row = {"conv": name, "x": xs, "w": ws, "threads": threads or "default"}
            row.update({k: 1e6 * harness.median(harness.flat(v)) for k, v in res.items()})
            rows.append(row)
            print(f"  {name} {xs} threads={row['threads']}: " + ", ".join(f"{k} {row[k]:.0f} us" for k in fns),
                  file=sys.stderr, flush=True)
    return rows


def _conv_step_rows(label: str, res: dict) -> list[list]:
    out = []
    for n, r in res.items():
        if not isinstance(r, dict):
            continue
        if n == "torch":
            out.append([label, "torch", f"{r['ms']:.3f}", "", "1", "", f"{r['p90_ms']:.3f}"])
            continue
        out.append([label, n, f"{r['ms']:.3f}", f"{r.get('session_ms', float('nan')):.3f}",
                    f"**{r['ratio']:.2f}x** (session {r.get('session_ratio', float('nan')):.2f}x)",
                    f"{r['round_ratio']:.2f}x ({r['round_range'][0]:.2f}-{r['round_range'][1]:.2f})",
                    f"{r['p90_ms']:.3f}"])
    out.append([label, "first-step loss, max difference to torch's", f"{res['first_loss_diff']:.1e}", "", "", "", ""])
    return out


def cmd_conv(args, say, run):
    harness.require("torch", "the conv benchmark's torch.optim.Adam reference")
    args.channels = tuple(int(c) for c in args.channels.split(","))
    if args.child:
        print(json.dumps(conv_child(args)))
        return None
    import onnxruntime as ort
    import torch

    from kfac_compiler.runtime import device as runtime_device

    res = {}
    if not args.skip_small:
        res["small"] = conv_steps(args, resnet=False)
    if args.resnet:
        res["resnet"] = conv_steps(args, resnet=True)
    if args.processes:
        res["processes"] = conv_processes(args)
    if args.bound:
        res["bound"] = conv_bound(args)
    say(f"onnxruntime {ort.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads); ORT threads: "
        f"{args.threads or runtime_device.physical_cores()}.")
    say()
    if "small" in res or "resnet" in res:
        say("Adam step, median ms (p90); ratios to torch's median, and the median (range) of the per-round ratios:")
        say()
        rows = []
        if "small" in res:
            rows += _conv_step_rows(f"small CNN {args.channels}, batch {CONV_BATCH}", res["small"])
        if "resnet" in res:
            rows += _conv_step_rows(f"ResNet-18, batch {CONV_RESNET_BATCH}", res["resnet"])
        say(harness.table(["model", "step", "median ms", "in session ms", "/ torch", "per round", "p90 ms"], rows))
    if "processes" in res:
        p = res["processes"]
        say()
        say(f"Fresh processes (small CNN, median ms of {args.rounds * args.steps} steps each, rounds in order):")
        say()
        rows = [[i + 1, *(f"{p['rows'][c][i]['median_ms']:.3f}" for c in CONV_CONFIGS)] for i in range(args.processes)]
        rows.append(["max/min", *(f"{p['spread'][c]:.2f}" for c in CONV_CONFIGS)])
        say(harness.table(["round", *CONV_CONFIGS], rows))
    if "bound" in res:
        say()
        say("ONNX Runtime's Conv forward against torch's conv2d (median us):")
        say()
        say(harness.table(["conv", "x", "w", "threads", "ORT, runtime weight", "ORT, constant weight (NCHWc)", "torch"],
                          [[r["conv"], r["x"], r["w"], r["threads"], f"{r['ort_runtime_w']:.0f}",
                            f"{r['ort_constant_w']:.0f}", f"{r['torch']:.0f}"] for r in res["bound"]]))
    return res


# ============================================================================== startup
STARTUP_CHILD_INTERNALS = ("backend", "blocks", "oprules", "passes", "patterns", "frontend")


def startup_child(plan_dir: str, model: str, batch: int) -> dict:
    """In a fresh process: load the plan, build a default K-FAC Trainer, take one step."""
    t0 = time.perf_counter()
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    if model == "resnet18":
        te = _torch_exports("ResNet-18")
        inputs, y = te.digits_images()
        x = {"input": inputs["input"][:batch]}
    else:
        from kfac_compiler.models import ZOO

        inputs, y = ZOO[model].make_data(n=batch)
        x = {k: v[:batch] for k, v in inputs.items()}
    plan = kc.load_plan(plan_dir)
    t1 = time.perf_counter()
    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=batch, seed=0)
    t2 = time.perf_counter()
    tr.step(x, y[:batch])
    t3 = time.perf_counter()
    emitted = []
    if "kfac_compiler.backend.service" in sys.modules:
        from kfac_compiler.backend.service import emitted as emitted_for

        emitted = sorted(req.name for req in emitted_for(plan))
    internal = sorted(m for m in sys.modules if m.startswith(tuple(f"kfac_compiler.{p}" for p in STARTUP_CHILD_INTERNALS)))
    return {"load_s": t1 - t0, "trainer_s": t2 - t1, "first_step_s": t3 - t2, "to_first_step_s": t3 - t1,
            "emitted": emitted, "internal_modules": len(internal)}


def cmd_startup(args, say, run):
    """From Trainer(...) to the end of the first step of a default K-FAC run on a saved plan
    compiled for the run's batch (fresh process each round, interleaved over the models), with
    the subgraphs the run emitted and the compiler modules it loaded (none: every graph was
    stored)."""
    import subprocess

    import kfac_compiler as kc

    if args.child:
        print(json.dumps(startup_child(args.child[0], args.child[1], args.batch)))
        return None
    work = tempfile.mkdtemp(prefix="bench_step-startup-")
    plans = {}
    for model in args.models.split(","):
        if model == "resnet18":
            source = resnet_export(work)[0]
            loss, output = "softmax_cross_entropy", "logits"
        else:
            from kfac_compiler.models import ZOO, get_model

            source, loss, output = get_model(model, seed=0), ZOO[model].loss, ZOO[model].output_name
        t = time.perf_counter()
        plan = kc.compile(source, loss=loss, output=output, budget={"batch_size": args.batch})
        compile_s = time.perf_counter() - t
        plans[model] = (plan.save(os.path.join(work, model)), compile_s, len(plan.subgraphs))

    def child(model: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "startup", "--batch", str(args.batch), "--child",
                              plans[model][0], model], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    runs: dict[str, list[dict]] = {m: [] for m in plans}
    for _ in range(args.rounds):
        for model in plans:
            runs[model].append(child(model))
    rows, data = [], {}
    for model, rs in runs.items():
        spread = {k: harness.spread([r[k] for r in rs]) for k in ("trainer_s", "first_step_s", "to_first_step_s")}
        data[model] = {"compile_s": plans[model][1], "stored_subgraphs": plans[model][2], "runs": rs,
                       **{k: v.as_dict() for k, v in spread.items()}}
        rows.append([model, f"{plans[model][1]:.2f}", plans[model][2], spread["trainer_s"].format(".2f", " s"),
                     spread["first_step_s"].format(".2f", " s"), spread["to_first_step_s"].format(".2f", " s"),
                     ", ".join(rs[-1]["emitted"]) or "none", rs[-1]["internal_modules"]])
    say(f"Default K-FAC at batch {args.batch} on a plan compiled for it; medians (min-max) of {args.rounds} "
        "fresh processes:")
    say()
    say(harness.table(["model", "compile s", "stored graphs", "Trainer(...)", "first step", "to first step",
                       "emitted at run time", "compiler modules loaded"], rows))
    return data


# ============================================================================== patches
# (count, C_in, spatial, C_out, kernel, stride, pad) of ResNet-18's convs on 32x32 inputs
RESNET18_CONVS = [
    (1, 3, 32, 64, 7, 2, 3),
    (4, 64, 8, 64, 3, 1, 1),
    (1, 64, 8, 128, 1, 2, 0),
    (1, 64, 8, 128, 3, 2, 1),
    (3, 128, 4, 128, 3, 1, 1),
    (1, 128, 4, 256, 1, 2, 0),
    (1, 128, 4, 256, 3, 2, 1),
    (3, 256, 2, 256, 3, 1, 1),
    (1, 256, 2, 512, 1, 2, 0),
    (1, 256, 2, 512, 3, 2, 1),
    (3, 512, 1, 512, 3, 1, 1),
]
PATCH_METHODS = ("identity", "depthwise", "slices")


class IdentityPatches:
    """The former patch extraction (the compiler's path until 2026-11-24, the baseline): a
    Conv with the dense identity kernel E [g K, C_in/g, *k], E[j K + c kk + m, c, m] = 1, and
    the layer's own group (swapped into a block's _emit_patches_depthwise)."""

    def __init__(self, blk) -> None:
        self.blk = blk

    def __call__(self, b, x):
        blk = self.blk
        kk = int(np.prod(blk.kernel))
        E = np.zeros((blk.group, blk.Cg, kk, blk.Cg, kk))
        for c in range(blk.Cg):
            E[:, c, :, c, :] = np.eye(kk)
        E = b.const(E.reshape(blk.group * blk.K, blk.Cg, *blk.kernel), hint="identity_kernel")
        return b.op("Conv", [x, E], kernel_shape=list(blk.kernel), strides=list(blk.strides), pads=list(blk.pads),
                    dilations=list(blk.dilations), group=blk.group)


def _patch_session(C_in, sp, C_out, k, s, p, method, what, batch):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from kfac_compiler.blocks import make_block
    from kfac_compiler.blocks._parts import emit_statistic
    from kfac_compiler.builder import GraphBuilder, value_info
    from kfac_compiler.ir import Layer, LayerUse

    attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=[p] * 4, dilations=[1, 1], group=1)
    layer = Layer("conv", "conv", ("W",), (LayerUse(("n",), "x", "y"),), attrs=attrs, approximation="kron")
    blk = make_block(layer, {"W": (C_out, C_in, k, k)}, patches=method)
    if method == "identity":
        blk._emit_patches_depthwise = IdentityPatches(blk)
    out_sp = blk._out_sizes([sp, sp])
    b = GraphBuilder(17, taken={"x", "d"}, float_type=TensorProto.FLOAT)
    if what == "patches":
        outs = [blk._emit_patches(b, "x")]
    else:
        outs = [emit_statistic(b, v) for v in blk.emit_statistics(b, ["x"], [["d"]]).values()]
    inputs = [value_info("x", TensorProto.FLOAT, [batch, C_in, sp, sp])]
    feeds = {"x": np.random.default_rng(0).standard_normal((batch, C_in, sp, sp)).astype(np.float32)}
    if what == "stats":
        inputs.append(value_info("d", TensorProto.FLOAT, [batch, C_out, *out_sp]))
        feeds["d"] = np.random.default_rng(1).standard_normal((batch, C_out, *out_sp)).astype(np.float32)
    model = b.make_model("bench", inputs, [helper.make_empty_tensor_value_info(o) for o in outs])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    return sess, feeds, sum(t.ByteSize() for t in model.graph.initializer)


def cmd_patches(args, say, run):
    """For each conv shape of ResNet-18 on 32x32 inputs and each way of extracting patches
    (ConvMixin._emit_patches, option "patches": `identity` the dense identity-kernel Conv, the
    baseline; `depthwise` a group = C_in Conv with a one-hot kernel, the default; `slices`
    Pad + strided Slices + Concat), the patch tensor alone and the whole kron statistics,
    interleaved; totals weighted by how many convs of each shape ResNet-18 has."""
    convs = RESNET18_CONVS[:args.shapes] if args.shapes else RESNET18_CONVS
    say(f"batch {args.batch}, {args.rounds} interleaved rounds x {args.reps} runs")
    say()
    totals = {(w, m): 0.0 for w in ("patches", "stats") for m in PATCH_METHODS}
    bytes_total = dict.fromkeys(PATCH_METHODS, 0)
    data = {}
    for what in ("patches", "stats"):
        say(f"## {what} (median ms per run)")
        say()
        rows = []
        for count, C_in, sp, C_out, k, s, p in convs:
            sess = {m: _patch_session(C_in, sp, C_out, k, s, p, m, what, args.batch) for m in PATCH_METHODS}

            def runs(m, sess=sess):
                ss, feeds, _ = sess[m]
                return lambda: harness.median(harness.timed(lambda: ss.run(None, feeds), args.reps, warmup=0))

            res = harness.interleave({m: runs(m) for m in PATCH_METHODS}, args.rounds, rotate=False)
            med = {m: 1e3 * harness.median(harness.flat(res[m])) for m in PATCH_METHODS}
            data[f"{what} {C_in}x{sp} -> {C_out}, {k}, {s}"] = med
            for m in PATCH_METHODS:
                totals[(what, m)] += count * med[m]
                if what == "patches":
                    bytes_total[m] += count * sess[m][2]
            rows.append([count, f"{C_in} x {sp}", f"{C_out}, {k}, {s}", *(f"{med[m]:.3f}" for m in PATCH_METHODS)])
            print(rows[-1], file=sys.stderr, flush=True)
        say(harness.table(["n", "C_in x H", "C_out, k, s", *PATCH_METHODS], rows))
        say()
        say("weighted total (ms): " + ", ".join(
            f"{m} {totals[(what, m)]:.2f} ({totals[(what, m)] / totals[(what, 'identity')]:.2f}x identity)"
            for m in PATCH_METHODS))
        say()
    say("initializer bytes of the patch graphs, weighted: "
        + ", ".join(f"{m} {bytes_total[m] / 1e6:.3f} MB" for m in PATCH_METHODS))
    return {"per_shape_ms": data, "totals_ms": {f"{w} {m}": v for (w, m), v in totals.items()},
            "init_bytes": bytes_total}


# ============================================================================== memory
def _memory_setup(name: str, workdir: str, config: dict | None):
    import kfac_compiler as kc
    from scale_models import MODELS, build

    te = _torch_exports(name)
    net, x, y = build(name)
    path = os.path.join(workdir, f"{name}.onnx")
    if not os.path.exists(path):
        te.export(net, path, x[:2])
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", config=config)
    return plan, x, y, MODELS[name].batch


def _legacy_memory(options, device, name, nodes=None) -> None:
    options.enable_cpu_mem_arena = True
    options.enable_mem_pattern = True


def memory_worker(name, opt, setting, steps, workdir, config) -> dict:
    """One Trainer in this process; its peak RSS (VmHWM, not ru_maxrss: the latter starts
    from the forking parent's RSS)."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime import device as D

    if setting == "legacy":
        D.memory_options = _legacy_memory
    plan, x, y, bs = _memory_setup(name, workdir, config)
    tr = Trainer(plan, optimizer=opt, device="cpu", batch_size=bs, seed=0)
    for k in range(steps):
        idx = (np.arange(bs) + k * bs) % len(y)
        tr.step({"input": x[idx]}, y[idx])
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {"peak_mb": int(status["VmHWM"].split()[0]) / 1024, "end_mb": int(status["VmRSS"].split()[0]) / 1024}


def memory_step_times(name, opt, rounds, workdir, config) -> dict:
    """Two Trainers in one process (memory pattern on / off), steps interleaved with the order
    alternating per round; medians after 3 warm-up rounds."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime import device as D

    plan, x, y, bs = _memory_setup(name, workdir, config)
    current = D.memory_options
    trainers = {}
    for label, pattern in (("pattern", True), ("no pattern", False)):
        def options(so, device, n, nodes=None, pattern=pattern):
            current(so, device, n, nodes)
            so.enable_mem_pattern = pattern
        D.memory_options = options
        trainers[label] = Trainer(plan, optimizer=opt, device="cpu", batch_size=bs, seed=0)
    D.memory_options = current
    count = dict.fromkeys(trainers, 0)

    def one(label):
        def go():
            idx = (np.arange(bs) + count[label] * bs) % len(y)
            count[label] += 1
            t0 = time.perf_counter()
            trainers[label].step({"input": x[idx]}, y[idx])
            return time.perf_counter() - t0
        return go

    res = harness.interleave({label: one(label) for label in trainers}, rounds)  # the order alternates
    return {label: 1e3 * harness.median(harness.flat(v[3:])) for label, v in res.items()}


def cmd_memory(args, say, run):
    """Peak RSS of a Trainer per (optimizer, setting) in a fresh process (`current`: the CPU
    arena only for the every-step sessions, no memory pattern; `legacy`: ORT's defaults), and
    the step time with the memory pattern on / off (scale_models.py's models; needs torch)."""
    warnings.simplefilter("ignore")
    config = json.loads(args.config) if args.config else None
    if args.worker:
        print(json.dumps(memory_worker(*args.worker, args.steps, args.workdir, config)))
        return None
    harness.require("torch", "the memory benchmark's models (scale_models.py)")
    workdir = tempfile.mkdtemp(prefix="bench_step-memory-")
    rows = []
    try:
        for name in args.models.split(","):
            for opt in args.optimizers.split(","):
                mem = {}
                for setting in ("legacy", "current"):
                    cmd = [sys.executable, os.path.abspath(__file__), "memory", "--worker", name, opt, setting,
                           "--steps", str(args.steps), "--workdir", workdir, "--out", "-"]
                    cmd += ["--config", args.config] if args.config else []
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                    mem[setting] = json.loads(out.strip().splitlines()[-1])
                t = memory_step_times(name, opt, args.rounds, workdir, config)
                rows.append({"model": name, "optimizer": opt, **mem, "step_ms": t})
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    say(harness.table(
        ["model", "optimizer", "peak RSS MB legacy / current (ratio)", "RSS at the end MB legacy / current",
         "step ms pattern / no pattern (ratio)"],
        [[r["model"], r["optimizer"],
          f"{r['legacy']['peak_mb']:.0f} / {r['current']['peak_mb']:.0f} "
          f"({r['current']['peak_mb'] / r['legacy']['peak_mb']:.2f}x)",
          f"{r['legacy']['end_mb']:.0f} / {r['current']['end_mb']:.0f}",
          f"{r['step_ms']['pattern']:.0f} / {r['step_ms']['no pattern']:.0f} "
          f"({r['step_ms']['no pattern'] / r['step_ms']['pattern']:.3f}x)"] for r in rows]))
    return rows


# ============================================================================== compile
def deep_mlp(layers: int = 200, width: int = 64, seed: int = 0):
    """A generated MLP of `layers` Gemm (transB=1) + Relu layers."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "input"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"fc{i}.bias")]
        out = "logits" if i == layers - 1 else f"fc{i}/Gemm:0"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [out], name=f"fc{i}/Gemm", transB=1))
        x = out
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [x], [f"fc{i}/Relu:0"], name=f"fc{i}/Relu"))
            x = f"fc{i}/Relu:0"
    g = helper.make_graph(nodes, "deep_mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", width])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def cmd_compile(args, say, run):
    """The front end (load -> Plan with factor specs) on .onnx files; target: well under 1 s."""
    import onnx

    from kfac_compiler.frontend import compile_frontend
    from kfac_compiler.models import save_model

    rows = []
    with tempfile.TemporaryDirectory() as d:
        mlp = os.path.join(d, "deep_mlp.onnx")
        onnx.save(deep_mlp(args.layers, args.width), mlp)
        tr = save_model("transformer_block", os.path.join(d, "transformer_block.onnx"))
        for name, path in [(f"mlp_{args.layers}_layers", mlp), ("transformer_block", tr)]:
            plan = None

            def go(path=path):
                nonlocal plan
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = compile_frontend(path, "softmax_cross_entropy")

            t = harness.spread(harness.timed(go, args.runs, warmup=0)).scaled(1e3)
            rows.append({"model": name, "nodes": len(plan.model.graph.node), "layers": len(plan.layers), "ms": t})
    say(harness.table(["model", "nodes", "layers", "ms, median (min-max)"],
                      [[r["model"], r["nodes"], r["layers"], r["ms"].format(".1f")] for r in rows]))
    return [{**r, "ms": r["ms"].as_dict()} for r in rows]


# ============================================================================== nodes
def _nodes_case(name: str, work: str):
    """(plan, images or tokens, targets) of a zoo model, resnet18 or gpt (torch exports)."""
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO

    if name in ("resnet18", "gpt"):
        te = _torch_exports(name)
        net, (inputs, y) = (te.resnet18(), te.digits_images()) if name == "resnet18" else (te.gpt(), te.digits_sequences())
        path = te.export(net, os.path.join(work, f"{name}.onnx"), inputs["input"][:2])
        return kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False), inputs["input"], y
    e = ZOO[name]
    inputs, y = e.make_data(None, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unrolled RNN's tied bias
        plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    return plan, inputs[e.input_name], y


def graph_nodes(plan, name: str, **options) -> tuple[int, int]:
    """(nodes, nodes other than Reshape and Identity) of the emitted subgraph `name` for the
    CPU, If branches included (ONNX Runtime removes the Identity nodes and runs Reshape as an
    alias of its input: no kernel)."""
    from kfac_compiler.backend.service import emit_for
    from kfac_compiler.builder import subgraphs
    from kfac_compiler.runtime.subgraphs import resolved_request

    model, _ = emit_for(plan, resolved_request(plan, "cpu", name, **options))
    total = other = 0

    def walk(graph):
        nonlocal total, other
        for node in graph.node:
            total += 1
            other += node.op_type not in ("Reshape", "Identity")
            for g in subgraphs(node):
                walk(g)

    walk(model.graph)
    return total, other


def kfac_graph_nodes(plan, bs: int, multi: bool) -> tuple[int, int]:
    """graph_nodes of the steady kfac_step a default K-FAC trainer at batch `bs` requests."""
    from kfac_compiler.runtime import Trainer

    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=bs, sessions=False, multi_tensor=multi)
    options = tr.policy.step_options().to_json()
    return graph_nodes(plan, "kfac_step", **{k: v for k, v in options.items() if v is not None})


def kfac_parts(plan, bs: int, multi: bool) -> dict[str, int]:
    """Where the default steady kfac_step's emitted nodes (other than Reshape/Identity) go, by
    removing one piece at a time from its options: the statistics (with_stats), the loss
    after the update (loss_after's If and the spike guard's test), the quadratic model (its
    JVPs and terms; without it the fixed-learning-rate step), and what is left over the
    forward+backward (preconditioning, dot products, update). Also the `precondition`
    subgraph alone (P from vec/<p>: the per-block products) and the refresh: every
    inverse_update graph's nodes over inv_update_period (amortized per step)."""
    from kfac_compiler.runtime import Trainer

    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=bs, sessions=False, multi_tensor=multi)
    base = {k: v for k, v in tr.policy.step_options().to_json().items() if v is not None}
    steps = [("step", base)]
    for label, change in (("statistics", dict(with_stats=False, stats_if=False)),
                          ("loss after", dict(loss_after=False, loss_limit=False)),
                          ("quadratic model", dict(qmodel=False, momentum_type="regular"))):
        steps.append((label, {**steps[-1][1], **change}))
    counts = {label: graph_nodes(plan, "kfac_step", **o)[1] for label, o in steps}
    out = {"step": counts["step"]}
    for (label, _), (prev, _) in zip(steps[1:], steps):
        out[label] = counts[prev] - counts[label]
    out["rest over fwd+bwd"] = counts["quadratic model"] - graph_nodes(plan, "gradients")[1]
    out["precondition graph"] = graph_nodes(plan, "precondition")[1]
    refresh = [r for r in tr.requests() if r.name in ("inverse_update", "power_update")]
    period = tr.config.inv_update_period
    out["refresh per step"] = round(sum(graph_nodes(plan, r.name, **{k: v for k, v in r.options.to_json().items()
                                                                      if v is not None})[1] for r in refresh) / period)
    return out



def ort_graph_nodes(plan, name: str, **options) -> tuple[int, int]:
    """(nodes, of which Reshape) of subgraph `name` as ONNX Runtime's CPU session holds it
    after its graph optimizations (the runtime's session options; If branches included):
    what one run of it executes, without running it."""
    import onnx
    import onnxruntime as ort

    from kfac_compiler.backend.service import emit_for
    from kfac_compiler.builder import subgraphs
    from kfac_compiler.runtime.device import session_options
    from kfac_compiler.runtime.subgraphs import resolved_request

    model, _ = emit_for(plan, resolved_request(plan, "cpu", name, **options))
    with tempfile.TemporaryDirectory() as d:
        so = session_options(1)
        so.optimized_model_filepath = os.path.join(d, "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(so.optimized_model_filepath)
    total = reshapes = 0

    def walk(graph):
        nonlocal total, reshapes
        for node in graph.node:
            total += 1
            reshapes += node.op_type == "Reshape"
            for g in subgraphs(node):
                walk(g)

    walk(optimized.graph)
    return total, reshapes


def profiled_run(plan, opt: str, x, y, bs: int, n: int, knobs: dict):
    """(the trainer, ONNX Runtime's profile of each of its sessions) after `n` steps of a
    fresh CPU trainer on one intra-op thread."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices
    from kfac_compiler.runtime.device import PROFILE_ENV
    from kfac_compiler.runtime.ort_profile import read_profile

    os.environ[PROFILE_ENV] = os.path.join(tempfile.mkdtemp(), "prof")
    try:
        tr = Trainer(plan, optimizer=opt, device="cpu", batch_size=bs, seed=0, threads=1, **knobs)
        for k in range(n):
            idx = batch_indices(len(y), bs, k, 0)
            tr.step({"input": x[idx]}, y[idx])
    finally:
        del os.environ[PROFILE_ENV]
    return tr, [read_profile(prog.session.end_profiling()) for prog in tr.programs().values()]


def profiled_nodes(plan, opt: str, x, y, bs: int, steps: int, knobs: dict) -> tuple[float, float, int]:
    """(node executions, of which Reshape) per steady step of a fresh CPU trainer, from ONNX
    Runtime's profile of the sessions it runs every step and the rest (K-FAC's refreshes):
    the difference of a run of 2 steps and one of 2 + `steps` (a K-FAC step count that spans
    one inverse period). Also the period."""

    def run(n: int) -> tuple[int, int]:
        _, profs = profiled_run(plan, opt, x, y, bs, n, knobs)
        return sum(sum(p.nodes.values()) for p in profs), sum(p.cpu_nodes.get("Reshape", 0) for p in profs)

    short, long = run(2), run(2 + steps)
    return (long[0] - short[0]) / steps, (long[1] - short[1]) / steps, steps


def layout_step_times(plan, x, y, bs: int, rounds: int, block: int, threads: int | None) -> dict:
    """SGD's and Adam's step times, per-parameter against multi-tensor updates, from
    interleaved rounds of `block` steps each (50 ms pause before each block): {optimizer:
    {"per-param": ms, "multi": ms, "ratio": per-round multi / per-param spread}}."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    trainers = {(o, m): Trainer(plan, optimizer=o, device="cpu", batch_size=bs, seed=0, threads=threads,
                                multi_tensor=m) for o in ("sgd", "adam") for m in (False, True)}
    count = dict.fromkeys(trainers, 0)

    def block_of(key):
        def go():
            tr, walls = trainers[key], []
            for _ in range(block):
                idx = batch_indices(len(y), bs, count[key], 0)
                count[key] += 1
                t0 = time.perf_counter()
                tr.step({"input": x[idx]}, y[idx])
                walls.append(time.perf_counter() - t0)
            return walls
        return go

    res = harness.interleave({f"{o}[{m}]": block_of((o, m)) for o, m in trainers}, rounds, gap=0.05, warmup=1)
    out = {}
    for o in ("sgd", "adam"):
        per, multi = f"{o}[False]", f"{o}[True]"
        out[o] = {"per-param_ms": 1e3 * statistics.median(harness.flat(res[per])),
                  "multi_ms": 1e3 * statistics.median(harness.flat(res[multi])),
                  "ratio": harness.spread(harness.round_ratios(res, multi, per, statistics.median)).as_dict()}
    return out


def cmd_nodes(args, say, run):
    """Nodes per step (issue 40): in the emitted graphs (the forward+backward's `gradients`
    graph, SGD's, Adam's and K-FAC's steps per parameter and multi-tensor; K-FAC's the default
    steady step's request) and, with --profile, executed per steady step in ONNX Runtime's CPU
    profile (K-FAC's default schedule over one inverse period, its refreshes amortized)."""
    from kfac_compiler.optimizers import make_config

    names = args.models.split(",")
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            plan, x, y = _nodes_case(name, work)
            r: dict = {"params": len(plan.trainable), "graph": {"fwd+bwd": graph_nodes(plan, "gradients")}}
            for opt in ("sgd", "adam", "kfac"):
                for multi in (False, True):
                    label = f"{opt}[{'multi' if multi else 'per-param'}]"
                    if opt == "kfac":
                        r["graph"][label] = kfac_graph_nodes(plan, min(args.batch, len(y)), multi)
                    else:
                        r["graph"][label] = graph_nodes(plan, f"{opt}_step", multi_tensor=multi)
            if args.kfac_parts:
                r["kfac_parts"] = {label: kfac_parts(plan, min(args.batch, len(y)), multi)
                                   for label, multi in (("per-param", False), ("multi", True))}
                for label, parts in r["kfac_parts"].items():
                    say(f"{name} kfac[{label}] emitted nodes other than Reshape/Identity: "
                        + ", ".join(f"{k} {v}" for k, v in parts.items()))
            if args.profile:
                r["executed"] = {"fwd+bwd": ort_graph_nodes(plan, "gradients")}
                bs = min(args.batch, len(y))
                period = make_config("kfac", plan).inv_update_period
                for label, opt, knobs, steps in (("sgd[per-param]", "sgd", {"multi_tensor": False}, 2),
                                                 ("sgd[multi]", "sgd", {"multi_tensor": True}, 2),
                                                 ("adam[per-param]", "adam", {"multi_tensor": False}, 2),
                                                 ("adam[multi]", "adam", {"multi_tensor": True}, 2),
                                                 ("kfac[per-param]", "kfac", {"multi_tensor": False}, period),
                                                 ("kfac[multi]", "kfac", {"multi_tensor": True}, period)):
                    if opt == "kfac" and args.no_kfac:
                        continue
                    r["executed"][label] = profiled_nodes(plan, opt, x, y, bs, steps, knobs)
            if args.time_rounds:
                bs = min(args.batch, len(y))
                r["times"] = t = layout_step_times(plan, x, y, bs, args.time_rounds, args.block, args.threads)
                for o, v in t.items():
                    q = v["ratio"]
                    say(f"{name} {o} step (batch {bs}, {args.time_rounds} interleaved rounds of {args.block}): "
                        f"per-parameter {v['per-param_ms']:.3f} ms, multi-tensor {v['multi_ms']:.3f} ms; "
                        f"per-round multi/per-param {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})")
            out[name] = r
            g, e = r["graph"], r.get("executed", {})
            fb, efb = g["fwd+bwd"], e.get("fwd+bwd")
            for label in ("sgd[per-param]", "sgd[multi]", "adam[per-param]", "adam[multi]", "kfac[per-param]",
                          "kfac[multi]"):
                ex = e.get(label)
                graph = g.get(label)
                rows.append([name, r["params"], label,
                             f"{graph[0]} ({graph[1]})" if graph else "",
                             f"+{graph[0] - fb[0]} (+{graph[1] - fb[1]})" if graph else "",
                             f"{ex[0]:.0f} ({ex[0] - ex[1]:.0f})" if ex else "",
                             f"+{ex[0] - efb[0]:.0f} (+{ex[0] - ex[1] - efb[0] + efb[1]:.0f})" if ex and efb else ""])
            say(f"{name}: {r['params']} parameters, forward+backward graph {fb[0]} nodes ({fb[1]} other than "
                "Reshape/Identity)" + (f", {efb[0]} in ORT's optimized CPU graph ({efb[1]} Reshape)" if efb else ""))
    say()
    say(harness.table(["model", "params", "step", "graph nodes (non-Reshape/Identity)", "over fwd+bwd",
                       "executed per step, ORT CPU (non-Reshape)", "over fwd+bwd"], rows))
    return out


# ============================================================================== kinds
def shape_arithmetic(graph) -> tuple[int, int]:
    """(Shape/Size nodes, nodes computing only from their outputs and constants) in an ONNX
    graph (If/Loop bodies included): the shape arithmetic a run executes."""
    from kfac_compiler.builder import subgraphs

    shapes = derived_nodes = 0
    derived: set[str] = set()

    def walk(g, consts):
        nonlocal shapes, derived_nodes
        consts = consts | {t.name for t in g.initializer}
        for node in g.node:
            ins = [i for i in node.input if i]
            if node.op_type in ("Shape", "Size"):
                shapes += 1
                derived.update(node.output)
            elif ins and any(i in derived for i in ins) and all(i in derived or i in consts for i in ins):
                derived_nodes += 1
                derived.update(node.output)
            elif node.op_type == "Constant":
                consts |= set(node.output)
            for sub in subgraphs(node):
                walk(sub, consts)

    walk(graph, set())
    return shapes, derived_nodes


def ort_optimized(model):
    """`model` as ONNX Runtime's CPU session holds it after its graph optimizations."""
    import onnx
    import onnxruntime as ort

    from kfac_compiler.runtime.device import session_options

    with tempfile.TemporaryDirectory() as d:
        so = session_options(1)
        so.optimized_model_filepath = os.path.join(d, "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(so.optimized_model_filepath)


def kinds_profile(plan, x, y, bs: int, steps: int, static: bool) -> dict:
    """Per steady step of a default CPU K-FAC trainer (its schedule over `steps` steps after
    2, as profiled_nodes): node executions, of which Shape and If, from ORT's profile; and the
    kfac_step sessions the whole run made."""

    def run(n: int):
        tr, profs = profiled_run(plan, "kfac", x, y, bs, n, {"static_steps": static})
        sessions = sum(prog.name == "kfac_step" for prog in tr.programs().values())
        return (sum(sum(p.nodes.values()) for p in profs), sum(p.cpu_nodes.get("Shape", 0) for p in profs),
                sum(p.cpu_nodes.get("If", 0) for p in profs), sessions)

    short, long = run(2), run(2 + steps)
    return {"executed": (long[0] - short[0]) / steps, "shape": (long[1] - short[1]) / steps,
            "if": (long[2] - short[2]) / steps, "step_sessions": long[3]}


def cmd_kinds(args, say, run):
    """K-FAC's static_steps (issue 40 item 3) against the If form, on the default schedule:
    executed nodes per steady step (ORT CPU profile, refreshes amortized over one inverse
    period), of which Shape and If; the shape arithmetic left in ORT's optimized graph of the
    steady step (the schedule's most frequent kind); the kfac_step sessions a run makes; and
    capture_blockers' count (static: for each kind the schedule uses, its Loops unrolled as
    Trainer(cuda_graphs=True) unrolls them)."""
    from kfac_compiler.optimizers import make_config
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.capture import capture_blockers, unroll_static_loops
    from kfac_compiler.runtime.static_shapes import with_static_dims
    from kfac_compiler.runtime.subgraphs import resolved_request, subgraph

    rows, out = [], {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            plan, x, y = _nodes_case(name, work)
            bs = min(args.batch, len(y))
            cfg = make_config("kfac", plan)
            period = cfg.inv_update_period
            shapes = {"input": x[:bs].shape, "targets": y[:bs].shape}
            r: dict = {"schedule": {"cov_update_period": cfg.cov_update_period, "inv_update_period": period,
                                    "damping_adaptation_interval": cfg.damping_adaptation_interval}}
            cov, interval = cfg.cov_update_period, cfg.damping_adaptation_interval
            # the kinds (statistics, loss after) of steps 1.. over both periods; the first step's (no, yes)
            used = [(k % cov == 0, k % interval == 0) for k in range(1, cov * interval + 1)]
            steady = max(set(used), key=used.count)
            kinds = sorted({*used, (False, True)})
            for static in (False, True):
                tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=bs, sessions=False,
                             static_steps=static)

                def graph(stats: bool, adapt: bool, tr=tr, static=static, plan=plan, shapes=shapes):
                    o = tr.policy.step_options(first=not stats if static else False, adapt=adapt).to_json()
                    m = subgraph(plan, resolved_request(plan, "cpu", "kfac_step",
                                                        **{k: v for k, v in o.items() if v is not None}))[0]
                    return with_static_dims(m, shapes) if static else m

                label = "static" if static else "If form"
                blockers = {kind: len(capture_blockers(unroll_static_loops(graph(*kind)) if static else graph(*kind)))
                            for kind in (kinds if static else kinds[:1])}
                res = {"graph_shape_arithmetic": shape_arithmetic(ort_optimized(graph(*steady)).graph),
                       "steady_kind": list(steady), "capture_blockers": {str(k): v for k, v in blockers.items()}}
                if args.profile:
                    res.update(kinds_profile(plan, x, y, bs, period, static))
                r[label] = res
                text = ", ".join(f"{'stats' if k[0] else 'no stats'}{' + loss after' if k[1] else ''}: {v}"
                                 for k, v in blockers.items()) if static else str(next(iter(blockers.values())))
                rows.append([name, label, f"{res.get('executed', float('nan')):.0f}",
                             f"{res.get('shape', float('nan')):.1f}", f"{res.get('if', float('nan')):.1f}",
                             "{} + {}".format(*res["graph_shape_arithmetic"]), res.get("step_sessions", ""), text])
            say(f"{name}: schedule {r['schedule']}, batch {bs}")
            out[name] = r
    say(harness.table(["model", "step graphs", "executed per step", "of which Shape", "of which If",
                       "steady graph in ORT: Shape + derived", "kfac_step sessions",
                       "capture blockers (static: per kind used)"], rows))
    return out


# ============================================================================== main
def _zoo_names() -> list[str]:
    from kfac_compiler.models import ZOO

    return list(ZOO)


def parser() -> argparse.ArgumentParser:
    ap, add = harness.command_parser(__doc__)

    p = add("zoo", cmd_zoo, "K-FAC / SGD / Adam step times and the K-FAC breakdown on the digits models")
    p.add_argument("--models", help="comma-separated (default: digits_autoencoder,mlp_classifier)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: the runtime's)")
    # 30 rounds: the per-round ratios' quartiles span +-10% on this VM
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block", type=int, default=20, help="steps per optimizer per round")
    p.add_argument("--reps", type=int, default=50, help="runs per breakdown variant")
    p.add_argument("--quick", action="store_true", help="3 rounds of 10, 20 reps")

    p = add("resnet", cmd_resnet, "ResNet-18 step time of K-FAC, Adam and SGD, and the plan's size (torch)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=10, help="steps per optimizer per round")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--knob", action="append", default=[], help="K-FAC option KEY=VALUE (repeatable)")

    p = add("spread", cmd_spread, "ResNet-18 step times: the inverse refresh in one program vs spread groups")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="recorded steps per round (after step 0)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, help="the trainers' ORT threads (default: the runtime's)")

    p = add("backward", cmd_backward, "forward+backward against forward alone per zoo model")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--threads", default="1,0", help="comma-separated ORT intra-op thread counts (0: ORT's default)")
    p.add_argument("--models", help="comma-separated zoo names (default: all)")

    p = add("curvature", cmd_curvature, "the curvature subgraphs of every zoo model")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--models", help="comma-separated zoo names (default: all)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))

    p = add("conv", cmd_conv, "our conv Adam step against torch's; process stability; ORT's Conv kernel")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--channels", default="8,16", help="the small CNN's two conv widths (the zoo's: 8,16)")
    p.add_argument("--threads", type=int, help="intra-op threads for both (default: each's own)")
    p.add_argument("--gap", type=float, default=0.1, help="seconds of pause before each block")
    p.add_argument("--ab", action="store_true", help="also our step without the Gather forms of Conv")
    p.add_argument("--resnet", action="store_true", help="also ResNet-18 at batch 32")
    p.add_argument("--resnet-rounds", type=int, default=5)
    p.add_argument("--resnet-steps", type=int, default=5)
    p.add_argument("--processes", type=int, default=0, help="rounds of fresh processes for the stability check")
    p.add_argument("--bound", action="store_true", help="ORT's Conv kernel against torch's conv2d")
    p.add_argument("--skip-small", action="store_true")
    p.add_argument("--child", choices=CONV_CONFIGS, help=argparse.SUPPRESS)

    p = add("patches", cmd_patches, "the conv blocks' patch extraction on ResNet-18's conv shapes")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", type=int, help="only the first N of ResNet-18's conv shapes")

    p = add("memory", cmd_memory, "peak RSS and step time of ORT's memory options (torch)")
    p.add_argument("--models", default="resnet18,gpt_large_vocab")
    p.add_argument("--optimizers", default="kfac,adam")
    p.add_argument("--steps", type=int, default=23)
    p.add_argument("--rounds", type=int, default=23)
    p.add_argument("--config", help="JSON passed to kfac_compiler.compile, e.g. '{\"budget\": {\"overhead\": 0}}'")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # model optimizer setting
    p.add_argument("--workdir", help=argparse.SUPPRESS)

    p = add("startup", cmd_startup, "a saved plan from Trainer(...) to its first step: time, emissions, modules")
    p.add_argument("--models", default="mlp_classifier,resnet18", help="zoo names and/or resnet18 (torch)")
    p.add_argument("--batch", type=int, default=32, help="the training batch (the plan is compiled for it)")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per model, interleaved")
    p.add_argument("--child", nargs=2, metavar=("PLAN", "MODEL"), help=argparse.SUPPRESS)
    p = add("kinds", cmd_kinds, "K-FAC static_steps (If-free, static-shape step kinds) against the If form")
    p.add_argument("--models", default="resnet18,gpt", help="comma-separated zoo names, resnet18, gpt (torch)")
    p.add_argument("--profile", action="store_true", help="also node executions from ORT's CPU profile")
    p.add_argument("--batch", type=int, default=32)

    p = add("nodes", cmd_nodes, "nodes per step of SGD, Adam and K-FAC (per-parameter, multi-tensor)")
    p.add_argument("--models", default=",".join([*_zoo_names(), "resnet18", "gpt"]),
                   help="comma-separated zoo names, resnet18, gpt (torch)")
    p.add_argument("--profile", action="store_true", help="also node executions from ORT's CPU profile")
    p.add_argument("--no-kfac", action="store_true", help="profile SGD and Adam only")
    p.add_argument("--kfac-parts", action="store_true",
                   help="also where K-FAC's emitted step nodes go (statistics, loss after, quadratic model, rest)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--time-rounds", type=int, default=0,
                   help="also SGD's and Adam's step times, per-parameter vs multi-tensor, in N interleaved rounds")
    p.add_argument("--block", type=int, default=20, help="steps per block of --time-rounds")
    p.add_argument("--threads", type=int, help="the timed trainers' ORT threads (default: the runtime's)")

    p = add("compile", cmd_compile, "the compiler front end's time")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--width", type=int, default=64)
    return ap


if __name__ == "__main__":
    sys.exit(harness.main(parser(), "step"))
