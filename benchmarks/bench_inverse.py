"""Damped inverses: each method's time and accuracy, from the zoo's small factors to
ResNet-18's largest, and per step of K-FAC on an exported model (the measurements behind
inverse_method "auto", kfac_compiler.linalg.concrete_method).

    python benchmarks/bench_inverse.py SUBCOMMAND [options] [--out DIR]

  methods  the zoo's factor sizes: every method's time per inverse update and relative
           error against float64 numpy, and all zoo factors in one batched graph
  scale    large factors (256..4609 wide, ResNet-18's conv A factors): time per method and
           thread count in interleaved rounds, residuals per condition number
  model    K-FAC with each inverse method on ResNet-18 or the GPT export (torch): session
           build, first steps, steady steps and refreshes alone (default device cuda)

Writes <out>/<date>-inverse-<subcommand>.md (and .json; `--out -` prints only).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

harness.import_paths()

# Kronecker factor sizes of the model zoo (models/README.md): (A = in+1, G = out) per layer
#   mlp_classifier       fc1 (65, 128)  fc2 (129, 128)  fc3 (129, 10)
#   digits_autoencoder   enc1 (65, 256) enc2 (257, 128) enc3 (129, 32)
#                        dec1 (33, 128) dec2 (129, 256) dec3 (257, 64)
#   small_cnn            conv1 (1*9+1=10, 8)  conv2 (8*9+1=73, 16)  fc (17, 10)
#   depthwise_cnn        conv1 (9, 8) (no bias)  pwconv (9, 16)  fc (257, 10)
#   unrolled_rnn         W_x (9, 32)  W_h (32 or 33, 32)  out (33, 10)
#   transformer_block    q/k/v/proj (17, 16)  mlp.fc1 (17, 64)  mlp.fc2 (65, 16)  tok_emb G 16
ZOO_SIZES = [8, 9, 10, 16, 17, 32, 33, 64, 65, 73, 128, 129, 256, 257]
METHODS = ["inverse_op", "inverse_op_nocheck", "schur", "ns_cold", "ns_warm6", "cholesky", "eigh"]
APPLY_ROWS = 512  # G side of ResNet-18's widest blocks: the gradient matrix is [512, n]


def session(build, inputs, options=None):
    """An ORT CPU session of the graph build(b) makes from float inputs [(name, shape)]."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from kfac_compiler.builder import GraphBuilder, value_info

    b = GraphBuilder(17, taken=[k for k, _ in inputs])
    outs = build(b)
    model = b.make_model("bench", [value_info(k, TensorProto.FLOAT, list(s)) for k, s in inputs],
                         [helper.make_empty_tensor_value_info(o) for o in outs])
    if options is None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def clock(fn, repeats: int) -> float:
    return harness.median(harness.timed(fn, repeats, warmup=1))


# ============================================================================== methods
def covariance(n: int, cond: float, rng) -> np.ndarray:
    """A population second moment with eigenvalues log-spaced in [1/cond, 1]."""
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = np.logspace(-np.log10(cond), 0, n)
    return (Q * s) @ Q.T


def ema_pair(n: int, cond: float, rng, batch: int = 128, decay: float = 0.95):
    """(M_old, M): a damped moving-average factor before and after one update with a batch
    estimate (batch rows drawn from the same distribution), damping = 1/cond."""
    C = covariance(n, cond, rng)
    L = np.linalg.cholesky(C + 1e-12 * np.eye(n))

    def batch_estimate():
        X = rng.standard_normal((batch, n)) @ L.T
        return X.T @ X / batch

    old = C.copy()
    for _ in range(5):
        old = decay * old + (1 - decay) * batch_estimate()
    new = decay * old + (1 - decay) * batch_estimate()
    d = np.eye(n) / cond
    return (old + d).astype(np.float32), (new + d).astype(np.float32)


def rel(X, ref) -> float:
    return float(np.linalg.norm(np.asarray(X, np.float64) - ref) / np.linalg.norm(ref))


def bench_size(n: int, cond: float, repeats: int, rng) -> dict:
    """Per method (time, relative error against float64 numpy, ok) for one n x n factor:
    inverse_op (com.microsoft Inverse + residual check; _nocheck: finite check only), schur,
    Newton-Schulz cold (NS_ITERATIONS from I/||M||_F) and warm (6 iterations from the inverse
    before one moving-average step), host cholesky (float32) and eigh (float64)."""
    from kfac_compiler import linalg

    M_old, M = ema_pair(n, cond, rng)
    prev = np.linalg.inv(M_old.astype(np.float64)).astype(np.float32)
    ref = np.linalg.inv(M.astype(np.float64))
    graphs = {
        "inverse_op": (lambda b: list(linalg.emit_inverse(b, "M", n, "inverse_op")), {"M": M}),
        "inverse_op_nocheck": (lambda b: list(linalg.emit_inverse(b, "M", n, "inverse_op", check="finite")), {"M": M}),
        "schur": (lambda b: list(linalg.emit_inverse(b, "M", n, "schur")), {"M": M}),
        "ns_cold": (lambda b: list(linalg.emit_newton_schulz(b, "M", n)), {"M": M}),
        "ns_warm6": (lambda b: list(linalg.emit_newton_schulz(b, "M", n, "P", iterations=6)), {"M": M, "P": prev}),
    }
    row = {"n": n}
    for name, (build, feeds) in graphs.items():
        s = session(build, [(k, (n, n)) for k in feeds])
        X, ok = s.run(None, feeds)
        row[name] = (clock(lambda s=s, feeds=feeds: s.run(None, feeds), repeats), rel(X, ref), bool(ok))
    for method in linalg.HOST_METHODS:
        X, ok = linalg.np_inverse(M, method)
        row[method] = (clock(lambda method=method: linalg.np_inverse(M, method)[0].astype(np.float32), repeats),
                       rel(X.astype(np.float32), ref), bool(ok))
    return row


def bench_batched(sizes, cond, repeats, rng) -> dict:
    """All zoo factors in one emitted graph (stacked per size) against one graph per factor."""
    from kfac_compiler import linalg

    mats = {f"m{i}": covariance(n, cond, rng).astype(np.float32) for i, n in enumerate(sizes)}
    inputs = [(k, v.shape) for k, v in mats.items()]
    out = {}
    for method in linalg.EMITTED_METHODS:
        def build(b, method=method):
            reqs = [linalg.InverseRequest(k, v.shape[-1]) for k, v in mats.items()]
            return [x for pair in linalg.emit_inverse_batch(b, reqs, method) for x in pair]

        s = session(build, inputs)
        out[f"{method}_batched"] = clock(lambda s=s: s.run(None, mats), repeats)
        sessions = [session(lambda b, k=k, n=v.shape[-1], method=method: list(linalg.emit_inverse(b, k, n, method)),
                            [(k, v.shape)]) for k, v in mats.items()]
        out[f"{method}_separate"] = clock(
            lambda sessions=sessions: [ss.run(None, {k: mats[k]}) for ss, k in zip(sessions, mats)], repeats)
    out["eigh_host_all"] = clock(lambda: linalg.np_inverse_batch(list(mats.values()), "eigh"), repeats)
    out["cholesky_host_all"] = clock(lambda: linalg.np_inverse_batch(list(mats.values()), "cholesky"), repeats)
    return out


def cmd_methods(args, say, run):
    """Each damped-inverse method on the zoo's factor sizes (and 65, 129, 257): the time of one
    inverse update of a damped SPD float32 factor (condition number --cond) and its error."""
    import onnxruntime as ort

    from kfac_compiler import linalg

    rng = np.random.default_rng(0)
    sizes = args.sizes or sorted(set([65, 129, 257] + ZOO_SIZES))
    say(f"onnxruntime {ort.__version__} CPU; NS_ITERATIONS={linalg.NS_ITERATIONS}; zoo factor sizes: {ZOO_SIZES}")
    results = {"sizes": sizes, "per_size": {}, "batched": {}}
    for cond in args.cond:
        say()
        say(f"condition number {cond:g}: median ms per inverse update of {args.repeats} (relative Frobenius error "
            "vs float64, ok)")
        say()
        rows = [bench_size(n, cond, args.repeats, rng) for n in sizes]
        say(harness.table(["n", *METHODS], [[r["n"], *(f"{r[m][0] * 1e3:.3f} ({r[m][1]:.1e}"
                                                        f"{'' if r[m][2] else ', NOT ok'})" for m in METHODS)]
                                            for r in rows]))
        results["per_size"][str(cond)] = rows
        zoo = [n for n in ZOO_SIZES if n in sizes] or sizes
        bt = bench_batched(zoo, cond, args.repeats, rng)
        results["batched"][str(cond)] = bt
        say()
        say(f"all {len(zoo)} zoo sizes at once [ms]: " + ", ".join(f"{k}={v * 1e3:.2f}" for k, v in bt.items()))
    return results


# ============================================================================== scale
def gram_factor(n: int, rng: np.random.Generator, power: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """(F, eigenvalues of F): a rank-deficient Gram of n/2 correlated rows, float64."""
    m = max(n // 2, 1)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = np.arange(1, n + 1, dtype=np.float64) ** -power
    X = (rng.standard_normal((m, n)) * np.sqrt(s)) @ Q.T
    F = X.T @ X / m
    F = 0.5 * (F + F.T)
    return F, np.linalg.eigvalsh(F)


def damped(F: np.ndarray, ev: np.ndarray, cond: float) -> tuple[np.ndarray, float]:
    """(float32 F + d I with cond(F + d I) = cond, d / mean eigenvalue)."""
    lo, top = max(ev[0], 0.0), ev[-1]
    d = (top - cond * lo) / (cond - 1.0)
    return (F + d * np.eye(F.shape[0])).astype(np.float32), float(d / ev.mean())


def residual(M32: np.ndarray, X: np.ndarray) -> float:
    """||M X - I||_F / sqrt(n) in float64 (linalg's RESIDUAL_TOL definition)."""
    M = M32.astype(np.float64)
    R = M @ np.asarray(X, np.float64)
    R[np.diag_indices_from(R)] -= 1.0
    return float(np.linalg.norm(R) / np.sqrt(M.shape[0]))


def _emitted(method: str, n: int, threads: int) -> Callable:
    from kfac_compiler import linalg
    from kfac_compiler.runtime.device import session_options

    check = "finite" if method == "inverse_op" else None
    s = session(lambda b: list(linalg.emit_inverse(b, "M", n, method, check=check)), [("M", (n, n))],
                session_options(threads, spin=False))

    def go(M):
        X, ok = s.run(None, {"M": M})
        return X, bool(ok)
    return go


def _cholesky(threads: int) -> Callable:
    from kfac_compiler import linalg

    def go(M):
        X, ok = linalg.np_cholesky_inverse_batch(M, blas_threads=threads)
        return X, bool(ok)
    return go


def _eigh64(M):
    from kfac_compiler import linalg

    X, ok = linalg.np_inverse(M, "eigh")
    return X.astype(np.float32), bool(ok)


def _eigh32(threads: int) -> Callable:
    from scipy.linalg import eigh
    from threadpoolctl import threadpool_limits

    def go(M):
        with threadpool_limits(threads, user_api="blas"):
            s, U = eigh(M, driver="evd", check_finite=False)
            X = (U / s) @ U.T
        return X, bool((s > 0).all())
    return go


def _redamp(n: int, M: np.ndarray, rng) -> tuple[Callable, Callable]:
    """Re-damping from a stored float32 eigendecomposition (s, U): U diag(1/(s + d)) U^T, one
    GEMM; and the apply-time alternative's extra cost per step (kfac-pytorch / EKFAC: one more
    [512, n] x [n, n] GEMM)."""
    from scipy.linalg import eigh
    from threadpoolctl import threadpool_limits

    s, U = eigh(M, driver="evd", check_finite=False)
    Y = rng.standard_normal((APPLY_ROWS, n)).astype(np.float32)
    d = np.float32(0.5 * s.min())

    def rescale(_M):
        with threadpool_limits(1, user_api="blas"):
            return (U / (s + d)) @ U.T, True

    def apply_extra(_M):  # the one GEMM an eigenbasis apply adds over Y @ A_inv
        with threadpool_limits(1, user_api="blas"):
            return Y @ U, True
    return rescale, apply_extra


def bench_scale_n(n: int, args, rng) -> dict:
    F, ev = gram_factor(n, rng)
    mats = {c: damped(F, ev, c) for c in args.conds}
    base = mats[args.conds[0]][0]
    fns: dict[str, Callable] = {}
    for t in (1, 2):
        fns[f"schur/{t}"] = _emitted("schur", n, t)
    for t in (1, 2):
        fns[f"cholesky/{t}"] = _cholesky(t)
    if n <= args.ns_max:
        for t in (1, 2):
            fns[f"newton_schulz/{t}"] = _emitted("newton_schulz", n, t)
    if n <= args.op_max:
        fns["inverse_op/1"] = _emitted("inverse_op", n, 1)
    if n <= args.eigh64_max:
        fns["eigh64/1"] = _eigh64
    for t in (1, 2):
        fns[f"eigh32/{t}"] = _eigh32(t)
    rescale, apply_extra = _redamp(n, base, np.random.default_rng(1))
    timed = {**fns, "redamp_rescale/1": rescale, "apply_extra/1": apply_extra}
    acc = {}
    for name, fn in fns.items():  # accuracy (and the warm-up of the timing below)
        for c, (M, _) in mats.items():
            X, ok = fn(M)
            acc[(name, c)] = (residual(M, X), ok)
    res = harness.interleave({k: (lambda fn=fn: harness.timed(lambda: fn(base), 1, warmup=0)) for k, fn in timed.items()},
                             args.rounds, rotate=False)
    ref = harness.flat(res["schur/1"])
    return {"n": n, "rel_damping": {c: mats[c][1] for c in args.conds},
            "time": {k: harness.median(harness.flat(v)) for k, v in res.items()},
            "ratio": {k: harness.median(np.asarray(harness.flat(v)) / ref) for k, v in res.items()},
            "acc": acc}


def cmd_scale(args, say, run):
    """Damped inverses of LARGE factors on the CPU (F = X^T X / m, m = n/2 correlated rows,
    damping d = top eigenvalue / (cond - 1)): schur (emitted, the CPU's "auto"), newton_schulz,
    inverse_op (LU, finite check only), host cholesky (float32), eigh64 (float64 numpy), eigh32
    (scipy syevd), re-damping from a stored eigendecomposition and the apply-time alternative's
    extra GEMM. Emitted sessions use the runtime's refresh options (no spinning). Timings:
    interleaved rounds on the first condition number, medians and the median per-round ratio
    to schur on one thread; accuracy: one call per method and condition number."""
    import onnxruntime as ort

    from kfac_compiler import linalg

    linalg.prepare_host_inverses()
    rng = np.random.default_rng(0)
    rows = []
    for n in args.sizes:
        t0 = time.perf_counter()
        rows.append(bench_scale_n(n, args, rng))
        print(f"n = {n} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    names = list(rows[0]["time"])
    for r in rows[1:]:
        names += [k for k in r["time"] if k not in names]
    say(f"onnxruntime {ort.__version__}, CPU")
    say()
    say("## Time per inverse [ms] (median; x schur/1 per-round median ratio)")
    say()
    say(harness.table(["method/threads", *(f"n = {r['n']}" for r in rows)],
                      [[k, *(f"{r['time'][k] * 1e3:.1f} ({r['ratio'][k]:.2f}x)" if k in r["time"] else "-" for r in rows)]
                       for k in names]))
    say()
    say("## Relative residual ||(F + d I) X - I||_F / sqrt(n) (NOT ok: the method's own check failed)")
    say()
    for c in args.conds:
        say(f"cond {c:g}, d / mean eigenvalue: " + ", ".join(f"n={r['n']}: {r['rel_damping'][c]:.1e}" for r in rows))
    say()
    acc_names = sorted({k for r in rows for (k, _) in r["acc"]}, key=names.index)
    table = []
    for k in acc_names:
        if not k.endswith("/1") and k.replace("/2", "/1") in acc_names:
            continue  # the same arithmetic on two threads
        for c in args.conds:
            cells = []
            for r in rows:
                if (k, c) in r["acc"]:
                    res, ok = r["acc"][(k, c)]
                    cells.append(f"{res:.1e}{'' if ok else ' NOT ok'}")
                else:
                    cells.append("-")
            table.append([k.split("/")[0], f"{c:g}", *cells])
    say(harness.table(["method", "cond", *(f"n = {r['n']}" for r in rows)], table))
    for r in rows:
        r["acc"] = {f"{k} cond {c:g}": v for (k, c), v in r["acc"].items()}
    return rows


# ============================================================================== model
def cmd_model(args, say, run):
    """For Adam and then K-FAC with each method: session build time, the first steps' wall
    times with each session's last run time (the first runs include cuDNN's algorithm
    search), the median and mean of steps 3-11 (default schedule: a refresh every 10 steps),
    and three refreshes of every inverse on their own, with the blocks that fell back to host
    Cholesky. Needs torch (the export)."""
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.data import batch_indices
    from kfac_compiler.runtime.device import get_device

    harness.require("torch", "the exported models (kfac_compiler.models.torch_exports)")
    from kfac_compiler.models import torch_exports as te

    warnings.simplefilter("ignore")
    device = get_device(args.device).name
    net, (inputs, y) = ((te.resnet18(), te.digits_images()) if args.model == "resnet18"
                        else (te.gpt(), te.digits_sequences()))
    x = inputs["input"]
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_inverse-model")
    os.makedirs(work, exist_ok=True)
    path = te.export(net, os.path.join(work, f"{args.model}.onnx"), x[:2])
    plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False)
    t0 = time.time()
    say(f"{args.model} on {device}, batch {args.batch}, {args.steps} steps (the first 3 not in the medians)")

    def log(*a):
        say(f"[{time.time() - t0:6.1f}s] " + " ".join(str(v) for v in a))

    out = {}
    for opt in ["adam"] + args.methods.split(","):
        knobs = {} if opt == "adam" else {"inverse_method": opt}
        t = time.time()
        tr = Trainer(plan, optimizer="adam" if opt == "adam" else "kfac", device=device, batch_size=args.batch, **knobs)
        log(opt, "build", round(time.time() - t, 2), "s")
        walls = []
        for k in range(args.steps):
            idx = batch_indices(len(y), args.batch, k, 0)
            m = tr.step({"input": x[idx]}, y[idx])
            walls.append(m["step_time"])
            if k < 3 or m.get("inverse", 0):
                progs = {n: round(p.last_seconds * 1e3, 1) for n, p in tr.programs().items()}
                log(opt, "step", k, f"wall {1e3 * m['step_time']:.1f} ms", f"loss {m['loss']:.4f}",
                    "inv" if m.get("inverse", 0) else "", "fallbacks", m.get("inverse_fallbacks"), progs)
        steady = harness.spread(walls[3:]).scaled(1e3)
        log(opt, f"steps 3-{args.steps - 1}: median (min-max) {steady.format('.2f', ' ms')}, "
            f"mean {1e3 * np.mean(walls[3:]):.2f} ms")
        out[opt] = {"steps_ms": steady.as_dict(), "mean_ms": 1e3 * float(np.mean(walls[3:]))}
        if opt != "adam":
            ts = harness.timed(tr.policy.refresh_inverses, args.refreshes, warmup=0)
            log(opt, "refresh alone ms", [round(1e3 * v, 1) for v in ts], "fallbacks",
                tr.policy.refresher.fallbacks[:5], len(tr.policy.refresher.fallbacks))
            out[opt]["refresh_ms"] = [1e3 * v for v in ts]
        del tr
    return out


# ============================================================================== main
def parser() -> argparse.ArgumentParser:
    ap, add = harness.command_parser(__doc__)

    p = add("methods", cmd_methods, "every method on the zoo's factor sizes: time and error")
    p.add_argument("--cond", type=float, nargs="*", default=[1e3, 1e5])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sizes", type=int, nargs="*", help="factor sizes (default: 65, 129, 257 and the zoo's)")

    p = add("scale", cmd_scale, "large factors: time per method and threads, residuals per condition number")
    p.add_argument("--sizes", type=int, nargs="*", default=[256, 512, 1153, 2305, 4609])
    p.add_argument("--conds", type=float, nargs="*", default=[1e3, 1e4, 1e5, 1e6])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ns-max", type=int, default=1153, help="largest n for newton_schulz (61x schur's FLOPs)")
    p.add_argument("--op-max", type=int, default=2305, help="largest n for inverse_op")
    p.add_argument("--eigh64-max", type=int, default=2305, help="largest n for the float64 eigh")

    p = add("model", cmd_model, "K-FAC's steps and refreshes with each inverse method on an export (torch)")
    p.add_argument("model", choices=("resnet18", "gpt"))
    p.add_argument("methods", nargs="?", default="schur,newton_schulz,inverse_op")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda", "auto"))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--refreshes", type=int, default=3)
    return ap


if __name__ == "__main__":
    sys.exit(harness.main(parser(), "inverse"))
