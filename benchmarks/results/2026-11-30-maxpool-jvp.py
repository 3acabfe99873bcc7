"""The tiled MaxPool's jvp on its mask against the Indices form (for 2026-11-30-maxpool-jvp.md)

    python benchmarks/results/2026-11-30-maxpool-jvp.py lenet5|small_cnn THREADS [OPTIMIZER]

Two Trainers of one plan in one process (K-FAC by default, batch 128): one emitted with the
MaxPool rule's jvp as shipped (tiled windows: the tangent averaged over each window's tied
maxima, on the vjp's mask), one with the jvp it replaced put back in the registry (the tangent
gathered at the Indices of a re-emitted MaxPool); 10 interleaved rounds of 20 steps on the
same batches (benchmarks/harness.py: interleave, the order rotated each round), a 50 ms pause
before each; median (min-max) ms per step, inverse refreshes
included. LeNet-5 on random 28x28 images (the step's cost does not depend on the data); the
small CNN on its zoo data.
"""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/

import harness  # noqa: E402


def indices_jvp(b, view, node, ts):
    """The jvp before 2026-11-30: the tangent gathered at the (re-emitted) MaxPool's Indices."""
    from kfac_compiler.oprules import pooling
    t = ts[0]
    if t is None:
        return [None] * len(node.output)
    idx = pooling._pool_indices(b, view, node)
    return [b.op("Gather", [b.reshape(t, [-1]), idx], axis=0)] + [None] * (len(node.output) - 1)


def main(model: str, threads: int, optimizer: str) -> None:
    import kfac_compiler as kc
    from kfac_compiler.oprules import RULES
    from kfac_compiler.runtime import Trainer
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    if model == "lenet5":
        from models.cnn import build_lenet5

        def build():
            return build_lenet5(seed=0), "softmax_cross_entropy"
        X = rng.standard_normal((1024, 1, 28, 28)).astype(np.float32)
        Y = rng.integers(0, 10, 1024)
    else:
        from kfac_compiler.models import ZOO
        entry = ZOO[model]

        def build():
            return entry.build(seed=0), entry.loss
        inputs, Y = entry.make_data(None, seed=0)
        X = inputs["input"]

    def trainer() -> Trainer:
        onnx_model, loss = build()
        plan = kc.compile(onnx_model, loss=loss, output="logits", emit=False)
        return Trainer(plan, optimizer=optimizer, batch_size=128, threads=threads)
    rule = RULES[("", "MaxPool")][0]
    shipped = trainer()
    saved, rule.jvp_fn = rule.jvp_fn, indices_jvp
    before = trainer()
    rule.jvp_fn = saved
    batches = [rng.integers(0, len(Y), 128) for _ in range(20)]

    def run(tr: Trainer) -> None:
        for idx in batches:
            tr.step({"input": X[idx]}, Y[idx])
    runs = {"mask jvp (shipped)": shipped, "indices jvp (before)": before}
    res = harness.interleaved_ms({k: (lambda tr=tr: run(tr)) for k, tr in runs.items()}, len(batches), 10)
    for k, v in res.items():
        print(f"{model} {optimizer} {threads} threads, {k:22s} {np.median(v):7.2f} ms ({min(v):.2f}-{max(v):.2f})")
    ratio = np.median(res["mask jvp (shipped)"]) / np.median(res["indices jvp (before)"])
    print(f"ratio {ratio:.3f} (load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "kfac")
