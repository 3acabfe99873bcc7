"""Benchmark the conv blocks' patch extraction (im2col inside ONNX) on ONNX Runtime (CPU).

For each conv shape of ResNet-18 on 32x32 inputs (kfac_compiler.models.torch_exports.resnet18)
and each way of extracting patches (ConvMixin._emit_patches, option "patches"):

  identity    Conv with a dense identity kernel [g K, C_in/g, *k] (a constant of the graph:
              85 MB for a 512-channel 3x3 conv; C_in times the FLOPs of a copy); the
              compiler's path until 2026-11-24, kept here (IdentityPatches) as the baseline
  depthwise   Conv with group = C_in and a one-hot kernel [C_in kk, 1, *k] tiled at run time
              (the default)
  slices      Pad + one strided Slice per kernel offset + Concat (float64 graphs)
time the patch tensor alone ("patches") and the whole kron statistics A and G ("stats", the
GramStatistic operands multiplied out), at --batch, in interleaved rounds (one session per
shape and method, built once); prints medians (ms) per shape, the totals weighted by how
many convs of each shape ResNet-18 has, and the ratio to "identity". Also prints the bytes of
each graph's initializers.

    python benchmarks/bench_patches.py [--batch 32] [--rounds 7] [--reps 5] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kfac_compiler.blocks import make_block  # noqa: E402
from kfac_compiler.blocks._parts import emit_statistic  # noqa: E402
from kfac_compiler.builder import GraphBuilder, value_info  # noqa: E402
from kfac_compiler.ir import Layer, LayerUse  # noqa: E402

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
METHODS = ("identity", "depthwise", "slices")


class IdentityPatches:
    """The former patch extraction: a Conv with the dense identity kernel E [g K, C_in/g, *k],
    E[j K + c kk + m, c, m] = 1, and the layer's own group (swapped into a block's
    _emit_patches_depthwise)."""

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


def block_for(C_in, C_out, k, s, p, method):
    attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=[p] * 4, dilations=[1, 1], group=1)
    layer = Layer("conv", "conv", ("W",), (LayerUse(("n",), "x", "y"),), attrs=attrs, approximation="kron")
    blk = make_block(layer, {"W": (C_out, C_in, k, k)}, patches=method)
    if method == "identity":
        blk._emit_patches_depthwise = IdentityPatches(blk)
    return blk


def session(C_in, sp, C_out, k, s, p, method, what, batch):
    blk = block_for(C_in, C_out, k, s, p, method)
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
    init_bytes = sum(t.ByteSize() for t in model.graph.initializer)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    return sess, feeds, init_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"# bench_patches: batch {args.batch}, {args.rounds} interleaved rounds x {args.reps} runs, "
             f"onnxruntime {ort.__version__}, CPU ({os.cpu_count()} cores)", ""]
    totals = {(w, m): 0.0 for w in ("patches", "stats") for m in METHODS}
    bytes_total = {m: 0 for m in METHODS}
    for what in ("patches", "stats"):
        lines += [f"## {what} (median ms per run)", "", "| n | C_in x H | C_out, k, s | " + " | ".join(METHODS) + " |",
                  "|---|---|---|" + "---|" * len(METHODS)]
        for count, C_in, sp, C_out, k, s, p in RESNET18_CONVS:
            sess = {m: session(C_in, sp, C_out, k, s, p, m, what, args.batch) for m in METHODS}
            times = {m: [] for m in METHODS}
            for _ in range(args.rounds):
                for m in METHODS:
                    ss, feeds, _ = sess[m]
                    t = time.perf_counter()
                    for _ in range(args.reps):
                        ss.run(None, feeds)
                    times[m].append((time.perf_counter() - t) / args.reps * 1e3)
            med = {m: float(np.median(times[m])) for m in METHODS}
            for m in METHODS:
                totals[(what, m)] += count * med[m]
                if what == "patches":
                    bytes_total[m] += count * sess[m][2]
            lines.append(f"| {count} | {C_in} x {sp} | {C_out}, {k}, {s} | " + " | ".join(f"{med[m]:.3f}" for m in METHODS) + " |")
            print(lines[-1], flush=True)
        lines += ["", "weighted total (ms): " + ", ".join(
            f"{m} {totals[(what, m)]:.2f} ({totals[(what, m)] / totals[(what, 'identity')]:.2f}x identity)" for m in METHODS), ""]
        print(lines[-2], flush=True)
    lines += ["initializer bytes of the patch graphs, weighted: " + ", ".join(f"{m} {bytes_total[m] / 1e6:.3f} MB" for m in METHODS), ""]
    print(lines[-2])
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
