"""The overlapping MaxPool run once in the training graphs (for 2026-12-01-maxpool-once.md)

    python benchmarks/results/2026-12-01-maxpool-once.py [OPTIMIZERS] [ROUNDS]

torchvision's ResNet-18 on the digits as 32x32 images (bench_step's export; its stem's 3x3
stride-2 MaxPool overlaps, so its gradient reads the Indices), batch 32, default threads. Per
optimizer (default: adam,kfac), two Trainers of two plans compiled from the same file in one
process: one emitted as shipped (backend/dedupe.EXTENSIBLE: the forward's MaxPool also yields
the Indices), one with EXTENSIBLE empty (the forward's pool and a second one with Indices, as
before 2026-12-01); ROUNDS (default 10) interleaved rounds of 20 steps on the same batches
(benchmarks/harness.py: interleave, the order rotated each round, 50 ms pauses), after a
warm-up round; median (min-max) ms per step, inverse refreshes included; MaxPool nodes in each
step graph; and the two trainers' parameters after the same steps (equal: the maxima and their
indices are the same numbers).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/

import bench_step  # noqa: E402
import harness  # noqa: E402


def _block(trainer, steps: dict[str, int], label: str, x, y):
    """20 steps of `trainer` on the batches after steps[label] (counted on)."""
    from kfac_compiler.runtime.data import batch_indices

    def run() -> None:
        for _ in range(20):
            idx = batch_indices(len(y), 32, steps[label], 0)
            trainer.step({"input": x[idx]}, y[idx])
            steps[label] += 1
    return run


def main(optimizers: list[str], rounds: int) -> None:
    import kfac_compiler as kc
    from kfac_compiler.backend import dedupe
    from kfac_compiler.backend.registry import emit_subgraph
    from kfac_compiler.runtime import Trainer
    warnings.simplefilter("ignore")
    work = tempfile.mkdtemp()
    _, x, y = bench_step._nodes_case("resnet18", work)
    path = os.path.join(work, "resnet18.onnx")
    shipped = dedupe.EXTENSIBLE
    for opt in optimizers:
        trainers = {}
        for label, extensible in (("once", shipped), ("twice", frozenset())):
            dedupe.EXTENSIBLE = extensible  # read when the Trainer's graphs are emitted
            plan = kc.compile(path, loss="softmax_cross_entropy", output="logits", emit=False)
            trainers[label] = Trainer(plan, optimizer=opt, device="cpu", batch_size=32, seed=0)
            trainers[label].step({"input": x[:32]}, y[:32])
            step_graph, _ = emit_subgraph(plan, f"{opt}_step")
            print(f"{opt} {label}: MaxPool nodes in its step graph (top level) "
                  f"{sum(n.op_type == 'MaxPool' for n in step_graph.graph.node)}")
        dedupe.EXTENSIBLE = shipped
        steps = {k: 1 for k in trainers}

        res = harness.interleaved_ms({k: _block(trainers[k], steps, k, x, y) for k in trainers}, 20, rounds)
        for label, ms in res.items():
            print(f"{opt} {label}: {statistics.median(ms):.2f} ms/step ({min(ms):.2f}-{max(ms):.2f})")
        ratio = statistics.median(res["once"]) / statistics.median(res["twice"])
        a, b = trainers["once"].parameters(), trainers["twice"].parameters()
        diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
        print(f"{opt}: once / twice {ratio:.3f}; largest parameter difference after {steps['once']} steps {diff:.3g}")


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["adam", "kfac"], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
