"""Time per step of K-FAC vs SGD vs Adam in the kfac_compiler runtime, with a breakdown, and
the steps/seconds K-FAC needs to reach tuned Adam's loss.

    python benchmarks/bench_step.py [--quick] [--device cpu|cuda|auto] [--json out.json]

Models: the zoo's digits_autoencoder (batch 256) and mlp_classifier (batch 128), trained on
all 1797 digits. For each:
  * median wall time per optimizer step (K-FAC with its default schedule, SGD, Adam), and
    the host overhead = step wall time - time inside ONNX Runtime sessions;
  * a K-FAC breakdown from isolated runs of its subgraphs on one batch (medians):
      fwd+bwd        the `gradients` subgraph (forward + backward)
      statistics     `update_statistics` minus fwd+bwd (factor estimation with sampled targets)
      inverse/step   `inverse_update` / inv_update_period (amortized)
      precondition   the `precondition` subgraph
      qmodel+update  fused `kfac_step(with_stats)` minus update_statistics minus precondition
                     (the quadratic model's two JVPs, the update and the forward pass at the
                     new parameters for damping adaptation)
  * time-to-target: Adam with lr in {1e-3, 3e-3, 1e-2} for N steps (1000; --quick 200); the
    best full-data loss is the target; K-FAC runs until its full-data loss (checked every 5
    steps, evaluation time excluded) reaches it: steps and seconds.
All numbers are medians from one run on this machine; they move with machine load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kfac_compiler as kc  # noqa: E402
from kfac_compiler.models import ZOO  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.data import batch_indices, draw_noise  # noqa: E402
from kfac_compiler.runtime.optimizers import ema_coefficient  # noqa: E402

MODELS = (("digits_autoencoder", 256), ("mlp_classifier", 128))
ADAM_LRS = (1e-3, 3e-3, 1e-2)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def ms(x):
    return f"{1e3 * x:8.3f}"


THREADS = None


def step_times(plan, x, y, bs, optimizer, steps, warmup, device, **kw):
    tr = Trainer(plan, optimizer=optimizer, device=device, threads=THREADS, batch_size=bs, **kw)
    n = len(y)
    walls, hosts, sess = [], [], []
    for s in range(warmup + steps):
        idx = batch_indices(n, bs, s, 0)
        s0 = tr.session_seconds()
        m = tr.step({"input": x[idx]}, y[idx])
        if s >= warmup:
            walls.append(m["step_time"])
            hosts.append(m["host_time"])
            sess.append(tr.session_seconds() - s0)
    return {"step": med(walls), "mean": statistics.fmean(walls), "host": med(hosts), "session": med(sess),
            "trainer": tr}


def timed(fn, reps):
    fn()
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return med(out)


def breakdown(tr: Trainer, x, y, bs, reps):
    """Isolated subgraph timings on one batch (the trainer's own programs and state)."""
    cfg = tr.config
    idx = batch_indices(len(y), bs, 0, 0)
    data = {"input": x[idx], "targets": y[idx]}
    store = tr.store
    grads_p = tr.program("gradients")
    stats_p = tr.program("update_statistics", mode=cfg.mode, num_samples=cfg.num_samples,
                         stats_batch=cfg.stats_batch_size)
    pre_p = tr.program("precondition")
    step_p = tr.program("kfac_step", with_stats=True, **tr._kfac_options())
    noise = draw_noise(np.random.default_rng(0), stats_p.info, stats_p.data_inputs, data["targets"])
    grads_p.run(store, data)  # writes the batch into the store
    store.set_hp("hp/ema_coeff", ema_coefficient(0.5, cfg.cov_ema_decay)[0])
    store.set_hp("hp/damping", tr.damping)
    store.set_hp("hp/l2", cfg.l2_reg)
    for k, v in noise.items():
        store.write_data(k, v)
    out = grads_p.run(store, results=True)
    vec = {f"vec/{p}": out[f"grad/{p}"] for p in tr.params}
    # Isolated runs mutate factors/inverses/params: snapshot and restore the trainer state.
    snap = tr.state()
    t_grad = timed(lambda: grads_p.run(store), reps)
    t_stats = timed(lambda: stats_p.run(store), reps)
    t_inv = timed(tr._refresh_inverses, reps)  # the emitted part and any host-side blocks
    t_pre = timed(lambda: pre_p.run(store, vec, results=True), reps)
    t_step = timed(lambda: step_p.run(store), reps)
    for k, v in snap.items():
        store.set(k, v)
    return {
        "fwd+bwd": t_grad,
        "statistics": max(t_stats - t_grad, 0.0),
        "inverse (raw)": t_inv,
        "inverse/step": t_inv / cfg.inv_update_period,
        "precondition": t_pre,
        "qmodel+update": max(t_step - t_stats - t_pre, 0.0),
        "fused kfac_step": t_step,
    }


def full_loss(tr, x, y):
    return tr.evaluate({"input": x}, y, batch_size=2048)["loss"]


def run_to_target(plan, x, y, bs, optimizer, steps, device, target=None, every=5, **kw):
    """Train; returns (final full-data loss, train seconds, steps to reach target, seconds to
    target). Seconds = the sum of step wall times (evaluation excluded)."""
    tr = Trainer(plan, optimizer=optimizer, device=device, threads=THREADS, batch_size=bs, **kw)
    n = len(y)
    secs, hit_steps, hit_secs = 0.0, None, None
    times = []
    for s in range(steps):
        idx = batch_indices(n, bs, s, 0)
        m = tr.step({"input": x[idx]}, y[idx])
        secs += m["step_time"]
        times.append(m["step_time"])
        if target is not None and hit_steps is None and (s + 1) % every == 0 and full_loss(tr, x, y) <= target:
            hit_steps, hit_secs = s + 1, secs
            break
    return full_loss(tr, x, y), secs, hit_steps, hit_secs, med(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (CI smoke run)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: ORT's)")
    ap.add_argument("--json", help="also write the results as JSON")
    args = ap.parse_args(argv)
    global THREADS
    THREADS = args.threads
    steps, warmup, reps = (30, 5, 10) if args.quick else (200, 20, 50)
    target_steps = 200 if args.quick else 1000
    results = {}
    for name, bs in MODELS:
        e = ZOO[name]
        t0 = time.perf_counter()
        plan = kc.compile(e.build(seed=0), loss=e.loss, output="logits", emit=False)
        compile_s = time.perf_counter() - t0
        inputs, y = e.make_data(None, seed=0)
        x = inputs["input"]
        r = {"batch": bs, "compile_s": compile_s}
        print(f"\n== {name} (batch {bs}, {len(y)} examples, device {args.device}) ==", flush=True)
        per = {}
        for opt, kw in (("kfac", {}), ("sgd", {}), ("adam", {})):
            t = step_times(plan, x, y, bs, opt, steps, warmup, args.device, **kw)
            per[opt] = t
            r[f"{opt}_step_ms"] = 1e3 * t["step"]
            r[f"{opt}_mean_step_ms"] = 1e3 * t["mean"]
            r[f"{opt}_host_ms"] = 1e3 * t["host"]
        print(f"{'optimizer':10s} {'median':>8s} {'mean':>8s} {'session':>8s} {'host':>8s}  (ms per step; mean "
              "includes K-FAC's inverse refreshes)")
        for opt, t in per.items():
            print(f"{opt:10s} {ms(t['step'])} {ms(t['mean'])} {ms(t['session'])} {ms(t['host'])}")
        r["kfac_over_sgd_median"] = per["kfac"]["step"] / per["sgd"]["step"]
        r["kfac_over_sgd_mean"] = per["kfac"]["mean"] / per["sgd"]["mean"]
        print(f"K-FAC / SGD step: median {r['kfac_over_sgd_median']:.2f}x, mean {r['kfac_over_sgd_mean']:.2f}x")
        bd = breakdown(per["kfac"]["trainer"], x, y, bs, reps)
        r["kfac_breakdown_ms"] = {k: 1e3 * v for k, v in bd.items()}
        print(f"K-FAC breakdown (inv_update_period {per['kfac']['trainer'].config.inv_update_period}):")
        for k, v in bd.items():
            print(f"  {k:16s} {ms(v)} ms")
        print(f"  {'host overhead':16s} {ms(per['kfac']['host'])} ms (step wall - session time)")
        # time to target
        adam = {}
        for lr in ADAM_LRS:
            loss, secs, _, _, t_med = run_to_target(plan, x, y, bs, "adam", target_steps, args.device, learning_rate=lr)
            adam[lr] = (loss, secs, t_med)
            print(f"adam lr={lr:g}: full-data loss after {target_steps} steps {loss:.5f} "
                  f"({secs:.2f} s, median step {ms(t_med).strip()} ms)", flush=True)
        best_lr = min(adam, key=lambda k: adam[k][0])
        target = adam[best_lr][0]
        loss, secs, hit, hit_s, k_med = run_to_target(plan, x, y, bs, "kfac", target_steps, args.device, target=target)
        r.update(adam_best_lr=best_lr, adam_target_loss=target, adam_seconds=adam[best_lr][1],
                 adam_seconds_median_based=target_steps * adam[best_lr][2],
                 kfac_steps_to_target=hit, kfac_seconds_to_target=hit_s, kfac_final_loss=loss,
                 kfac_seconds_median_based=None if hit is None else hit * k_med)
        if hit:
            print(f"K-FAC reaches tuned Adam's (lr {best_lr:g}) {target_steps}-step loss {target:.5f} after {hit} steps, "
                  f"{hit_s:.2f} s [steps x median step: {hit * k_med:.2f} s]; Adam: {target_steps} steps, "
                  f"{adam[best_lr][1]:.2f} s [{target_steps * adam[best_lr][2]:.2f} s]")
        else:
            print(f"K-FAC did not reach {target:.5f} in {target_steps} steps (final {loss:.5f})")
        results[name] = r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
