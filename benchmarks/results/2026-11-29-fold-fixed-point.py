"""Nodes of each real-export fixture's canonical model, and how many one more round of
shape inference + static-dim and constant folding would still remove (0 at a fixed point).

    python benchmarks/results/2026-11-29-fold-fixed-point.py [fixture ...]
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

from kfac_compiler.passes.canonicalize import canonicalize, fold_constants, fold_static_dims, infer_shapes
from kfac_compiler.passes.load import load_model

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "real"


def main(names: list[str]) -> None:
    cases = names or sorted(json.loads((FIXTURES / "manifest.json").read_text()))
    print("| fixture | canonical nodes | after one more round | left foldable | canonicalize s |")
    print("|---|---|---|---|---|")
    for case in cases:
        path = FIXTURES / f"{case}.onnx"
        if not path.exists():
            continue
        model = load_model(str(path), "logits")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            canon = canonicalize(model, "logits")
            took = time.perf_counter() - t0
            again = infer_shapes(canon, keep_going=True)
            fold_static_dims(again)
            fold_constants(again, "logits")
        a, b = len(canon.graph.node), len(again.graph.node)
        print(f"| {case} | {a:,} | {b:,} | {a - b:,} | {took:.2f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
