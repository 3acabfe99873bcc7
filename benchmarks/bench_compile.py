"""Time the compiler front end (load -> Plan with factor specs).

    python benchmarks/bench_compile.py [--runs 7] [--layers 200] [--width 64]

Models: a generated deep MLP (Gemm transB=1 + Relu per layer) and the zoo's
transformer_block, both compiled from .onnx files. Prints the median and the best of
several runs. Target: well under 1 s each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.frontend import compile_frontend
from kfac_compiler.models import save_model


def deep_mlp(layers: int = 200, width: int = 64, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "input"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"), numpy_helper.from_array(np.zeros(width, np.float32), f"fc{i}.bias")]
        out = "logits" if i == layers - 1 else f"fc{i}/Gemm:0"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [out], name=f"fc{i}/Gemm", transB=1))
        x = out
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [x], [f"fc{i}/Relu:0"], name=f"fc{i}/Relu"))
            x = f"fc{i}/Relu:0"
    g = helper.make_graph(
        nodes, "deep_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", width])],
        initializer=inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def bench(path: str, loss: str, runs: int) -> tuple[list[float], object]:
    times, plan = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(runs):
            t0 = time.perf_counter()
            plan = compile_frontend(path, loss)
            times.append(time.perf_counter() - t0)
    return times, plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        mlp = os.path.join(d, "deep_mlp.onnx")
        onnx.save(deep_mlp(args.layers, args.width), mlp)
        tr = save_model("transformer_block", os.path.join(d, "transformer_block.onnx"))
        rows = []
        for name, path, loss in [
            (f"mlp_{args.layers}_layers", mlp, "softmax_cross_entropy"),
            ("transformer_block", tr, "softmax_cross_entropy"),
        ]:
            times, plan = bench(path, loss, args.runs)
            rows.append((name, len(plan.model.graph.node), len(plan.layers), statistics.median(times), min(times)))
    print(f"{'model':<22} {'nodes':>6} {'layers':>7} {'median ms':>10} {'best ms':>9}")
    for name, nodes, layers, med, best in rows:
        print(f"{name:<22} {nodes:>6} {layers:>7} {med * 1e3:>10.1f} {best * 1e3:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
