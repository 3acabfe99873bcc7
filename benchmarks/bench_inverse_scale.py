"""Damped inverses of LARGE factors on the CPU: time and accuracy per method and size.

The zoo's factors are at most 257 wide (benchmarks/bench_inverse.py); ResNet-18's conv A
factors are 577, 1153, 2305 and 4609 wide. For n in --sizes and each method, time one inverse
of a damped float32 factor and measure its relative residual ||(F + d I) X - I||_F / sqrt(n)
(float64; linalg's RESIDUAL_TOL definition) and whether the method calls it ok:

  schur            emitted recursive 2x2 blocks (the CPU's "auto"), ORT session, 1 / 2 threads
  newton_schulz    emitted, NS_ITERATIONS cold-start iterations, 1 / 2 threads (n <= --ns-max)
  inverse_op       emitted com.microsoft Inverse (LU), finite check only (n <= --op-max)
  cholesky         host LAPACK potrf + potrs in float32 (linalg.np_cholesky_inverse_batch),
                   1 / 2 BLAS threads
  eigh64           host linalg "eigh" (float64 numpy, casts and residual check included;
                   n <= --eigh64-max)
  eigh32           host float32 LAPACK syevd (scipy, driver "evd"), 1 / 2 BLAS threads
  redamp_rescale   from a stored eigendecomposition (s, U): U diag(1/(s + d)) U^T, one float32
                   GEMM (a damping change without a new decomposition)
  apply_extra      the apply-time alternative (kfac-pytorch / EKFAC): keep U and 1/(s + d) and
                   multiply a [512, n] gradient by U^T, scale, U instead of one X A^-1: the
                   extra cost per step of one more [512, n] x [n, n] GEMM

Emitted sessions use the runtime's options for the refresh (runtime.device.session_options,
no spinning). Test matrices: F = X^T X / m, m = n / 2 rows (rank deficient, as the big
EMA'd conv A factors are) drawn from N(0, C) with a power-law spectrum (correlated rows),
damping d = top eigenvalue / (cond - 1), so that cond(F + d I) = cond; d relative to the
mean eigenvalue is reported. Real ResNet-18 factors (20 K-FAC steps, batch 32, default
damping) have damped condition numbers 300-500 for A (d / mean 1-11) and 6-80 for G.

Timings come from --rounds interleaved rounds (one call per method per round) on the
cond = 1e3 matrix; reported: medians and the median of the per-round ratios to schur on one
thread. Accuracy: one call per method and condition number.

    python benchmarks/bench_inverse_scale.py [--sizes 256 512 1153 2305 4609]
        [--conds 1e3 1e4 1e5 1e6] [--rounds 3] [--out benchmarks/results/DATE-inverse_scale.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kfac_compiler import linalg  # noqa: E402
from kfac_compiler.builder import GraphBuilder, value_info  # noqa: E402
from kfac_compiler.runtime.device import session_options  # noqa: E402

APPLY_ROWS = 512  # G side of ResNet-18's widest blocks: the gradient matrix is [512, n]


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
    M = F + d * np.eye(F.shape[0])
    return M.astype(np.float32), float(d / ev.mean())


def residual(M32: np.ndarray, X: np.ndarray) -> float:
    """||M X - I||_F / sqrt(n) in float64."""
    M = M32.astype(np.float64)
    R = M @ np.asarray(X, np.float64)
    R[np.diag_indices_from(R)] -= 1.0
    return float(np.linalg.norm(R) / np.sqrt(M.shape[0]))


def ort_session(build: Callable, n: int, threads: int) -> ort.InferenceSession:
    b = GraphBuilder(17, taken=["M"])
    outs = build(b)
    model = b.make_model("bench", [value_info("M", TensorProto.FLOAT, [n, n])],
                         [helper.make_empty_tensor_value_info(o) for o in outs])
    return ort.InferenceSession(model.SerializeToString(), session_options(threads, spin=False),
                                providers=["CPUExecutionProvider"])


def emitted(method: str, n: int, threads: int) -> Callable[[np.ndarray], tuple[np.ndarray, bool]]:
    check = "finite" if method == "inverse_op" else None
    s = ort_session(lambda b: list(linalg.emit_inverse(b, "M", n, method, check=check)), n, threads)

    def run(M):
        X, ok = s.run(None, {"M": M})
        return X, bool(ok)
    return run


def cholesky(threads: int) -> Callable:
    def run(M):
        X, ok = linalg.np_cholesky_inverse_batch(M, blas_threads=threads)
        return X, bool(ok)
    return run


def eigh64(M):
    X, ok = linalg.np_inverse(M, "eigh")
    return X.astype(np.float32), bool(ok)


def eigh32(threads: int) -> Callable:
    from scipy.linalg import eigh

    def run(M):
        with threadpool_limits(threads, user_api="blas"):
            s, U = eigh(M, driver="evd", check_finite=False)
            X = (U / s) @ U.T
        return X, bool((s > 0).all())
    return run


def redamp(n: int, M: np.ndarray) -> tuple[Callable, Callable]:
    """Re-damping from a stored float32 eigendecomposition: (rescale, apply_extra)."""
    from scipy.linalg import eigh

    s, U = eigh(M, driver="evd", check_finite=False)
    Y = np.random.default_rng(1).standard_normal((APPLY_ROWS, n)).astype(np.float32)
    d = np.float32(0.5 * s.min())

    def rescale(_M):
        with threadpool_limits(1, user_api="blas"):
            return (U / (s + d)) @ U.T, True

    def apply_extra(_M):  # the one GEMM an eigenbasis apply adds over Y @ A_inv
        with threadpool_limits(1, user_api="blas"):
            return Y @ U, True
    return rescale, apply_extra


def methods_for(n: int, args) -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    for t in (1, 2):
        out[f"schur/{t}"] = emitted("schur", n, t)
    for t in (1, 2):
        out[f"cholesky/{t}"] = cholesky(t)
    if n <= args.ns_max:
        for t in (1, 2):
            out[f"newton_schulz/{t}"] = emitted("newton_schulz", n, t)
    if n <= args.op_max:
        out["inverse_op/1"] = emitted("inverse_op", n, 1)
    if n <= args.eigh64_max:
        out["eigh64/1"] = eigh64
    for t in (1, 2):
        out[f"eigh32/{t}"] = eigh32(t)
    return out


def bench_n(n: int, args, rng) -> dict:
    F, ev = gram_factor(n, rng)
    mats = {c: damped(F, ev, c) for c in args.conds}
    base = mats[args.conds[0]][0]
    fns = methods_for(n, args)
    rescale, apply_extra = redamp(n, base)
    timed = {**fns, "redamp_rescale/1": rescale, "apply_extra/1": apply_extra}
    acc = {}
    for name, fn in fns.items():  # accuracy (and the warm-up of the timing below)
        for c, (M, _) in mats.items():
            X, ok = fn(M)
            acc[(name, c)] = (residual(M, X), ok)
    times: dict[str, list[float]] = {k: [] for k in timed}
    for _ in range(args.rounds):
        for name, fn in timed.items():
            t0 = time.perf_counter()
            fn(base)
            times[name].append(time.perf_counter() - t0)
    ref = np.asarray(times["schur/1"])
    return {
        "n": n,
        "rel_damping": {c: mats[c][1] for c in args.conds},
        "time": {k: float(np.median(v)) for k, v in times.items()},
        "ratio": {k: float(np.median(np.asarray(v) / ref)) for k, v in times.items()},
        "acc": acc,
    }


def report(rows: list[dict], args, header: str) -> str:
    names = list(rows[0]["time"])
    for r in rows[1:]:
        names += [k for k in r["time"] if k not in names]
    lines = [header, "", "## Time per inverse [ms] (median; x schur/1 per-round median ratio)", ""]
    lines.append("| method/threads | " + " | ".join(f"n = {r['n']}" for r in rows) + " |")
    lines.append("|---|" + "---|" * len(rows))
    for k in names:
        cells = [f"{r['time'][k] * 1e3:.1f} ({r['ratio'][k]:.2f}x)" if k in r["time"] else "-" for r in rows]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "## Relative residual ||(F + d I) X - I||_F / sqrt(n) (NOT ok: the method's own check failed)", ""]
    for c in args.conds:
        lines.append(f"cond {c:g}, d / mean eigenvalue: " + ", ".join(f"n={r['n']}: {r['rel_damping'][c]:.1e}" for r in rows))
    lines.append("")
    acc_names = sorted({k for r in rows for (k, _) in r["acc"]}, key=names.index)
    lines.append("| method/threads | cond | " + " | ".join(f"n = {r['n']}" for r in rows) + " |")
    lines.append("|---|---|" + "---|" * len(rows))
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
            lines.append(f"| {k.split('/')[0]} | {c:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[256, 512, 1153, 2305, 4609])
    ap.add_argument("--conds", type=float, nargs="*", default=[1e3, 1e4, 1e5, 1e6])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ns-max", type=int, default=1153, help="largest n for newton_schulz (61x schur's FLOPs)")
    ap.add_argument("--op-max", type=int, default=2305, help="largest n for inverse_op")
    ap.add_argument("--eigh64-max", type=int, default=2305, help="largest n for the float64 eigh")
    ap.add_argument("--out", default=None, help="markdown results file (default: print only)")
    args = ap.parse_args(argv)
    linalg.prepare_host_inverses()
    rng = np.random.default_rng(0)
    header = (f"# bench_inverse_scale {datetime.date.today()} (onnxruntime {ort.__version__}, CPU, "
              f"{os.cpu_count()} cores)\n\n`python benchmarks/bench_inverse_scale.py "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}`")
    rows = []
    for n in args.sizes:
        t0 = time.perf_counter()
        rows.append(bench_n(n, args, rng))
        print(f"n = {n} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    text = report(rows, args, header)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return rows


if __name__ == "__main__":
    main()
