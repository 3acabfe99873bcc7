"""The fault census: run every case of faults.cases and print, per category, how many end clean.

    python benchmarks/fault_census.py [--fast] [--only NAME ...] [-v] [--fuzz N]

-v lists every case with its verdict; --fuzz N adds the fuzz rows (N mutations of each kind,
from fixed seeds; 0 leaves them out).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter

from faults.cases import CASES, CATEGORIES, TOPICS, Case
from faults.harness import Verdict


def run_case(c: Case) -> Verdict:
    """One case in a fresh folder; an exception the case did not expect counts as a traceback."""
    d = tempfile.mkdtemp(prefix=f"kfac-fault-{c.name[:40]}-")
    case_dir = os.path.join(d, "case")  # the case's events log may go next to it
    os.makedirs(case_dir)
    try:
        return c.run(case_dir)
    except BaseException as e:  # noqa: BLE001 - reported as the case's outcome
        if type(e).__name__ == "Skipped":  # mpi_util.require_mpi without the MPI extra: not run, not clean
            return Verdict("unclear", f"not run: {e}")
        if not isinstance(e, Exception):
            raise
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        return Verdict("traceback", f"{type(e).__name__} escaped ({where}): {str(e).splitlines()[0][:200] if str(e) else ''}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def table(rows: list[tuple[str, int, int]], head: tuple[str, str, str]) -> str:
    w = max(len(head[0]), *(len(r[0]) for r in rows))
    lines = [f"| {head[0]:<{w}} | {head[1]} | {head[2]} |", f"| {'-' * w} | {'-' * len(head[1])} | {'-' * len(head[2])} |"]
    lines += [f"| {name:<{w}} | {n:>{len(head[1])}} | {k:>{len(head[2])}} |" for name, n, k in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fault_census", allow_abbrev=False)
    ap.add_argument("--fast", action="store_true", help="only the cases of the default test run")
    ap.add_argument("--only", nargs="*", default=None, help="case names")
    ap.add_argument("--fuzz", type=int, default=0, help="mutations of each fuzz kind (0: none)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if (not args.fast or c.fast) and (args.only is None or c.name in args.only)]
    t0 = time.perf_counter()
    results: list[tuple[Case, Verdict]] = []
    for c in cases:
        v = run_case(c)
        results.append((c, v))
        if args.verbose:
            print(f"{c.category:<11} {c.name:<55} {v}", flush=True)
    counts = Counter(c.category for c, _ in results)
    clean = Counter(c.category for c, v in results if v.clean)
    rows = [(f"{k}: {CATEGORIES[k]}", counts[k], clean[k]) for k in CATEGORIES if counts[k]]
    rows.append(("all", len(results), sum(clean.values())))
    print()
    print(table(rows, ("category", "cases", "clean")))
    topics = Counter(c.topic for c, _ in results if c.topic)
    if topics:
        done = Counter(c.topic for c, v in results if c.topic and v.clean)
        print()
        print(table([(f"{t}: {TOPICS[t]}", topics[t], done[t]) for t in TOPICS if topics[t]],
                    ("issue 39 topic", "cases", "clean")))
    mechs = sorted({v.mechanism for _, v in results if v.mechanism})
    if mechs:
        print(f"\nfault mechanisms: {', '.join(mechs)}")
    if args.fuzz:
        from faults.fuzz import fuzz_census

        print()
        print(table(fuzz_census(args.fuzz), ("fuzz kind", "mutations", "clean")))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
