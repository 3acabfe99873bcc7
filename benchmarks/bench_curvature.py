"""Time the curvature subgraphs of every zoo model on ONNX Runtime (CPU by default).

For each model: the emitted `gradients` graph (forward + backward, the baseline), the
`update_statistics` graph (forward + backward seeds + factor statistics + moving averages),
and one inverse update per method: `inverse_op` and `newton_schulz` (emitted ONNX graphs),
`eigh` (host numpy, float64, through each block's numpy twin, including the copies).
Medians over --repeats runs after warm-up, from one run of this script.

    python benchmarks/bench_curvature.py [--repeats 30] [--models mlp_classifier,...] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import numpy_helper

import kfac_compiler as kc
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.models import ZOO, get_model

BATCH = {"digits_autoencoder": 256}


def _feeds(sess, plan, info, x, y, rng):
    inits = {t.name: numpy_helper.to_array(t) for t in plan.model.graph.initializer}
    feeds = dict(x)
    n = len(y)
    for i in sess.get_inputs():
        name = i.name
        if name in feeds:
            continue
        if name == "targets":
            feeds[name] = y
        elif name.startswith("noise/"):
            shape = [n if not isinstance(d, int) else d for d in i.shape]
            feeds[name] = rng.uniform(1e-6, 1 - 1e-6, size=shape).astype(np.float32)
        elif name.startswith("hp/"):
            feeds[name] = np.array(1e-2 if name == "hp/damping" else 0.5, np.float32)
        elif name in inits:
            feeds[name] = inits[name]
        else:
            spec = info.state_specs[name]
            shape = list(spec.shape)
            if name.startswith("factor/"):
                a = rng.normal(size=shape[:-1] + [max(2 * shape[-1], 8)]).astype(np.float32) if len(shape) >= 2 and shape[-1] == shape[-2] else None
                feeds[name] = (a @ np.swapaxes(a, -1, -2) / a.shape[-1]).astype(np.float32) if a is not None else np.abs(rng.normal(size=shape)).astype(np.float32)
            elif spec.init == "identity" and len(shape) >= 2 and shape[-1] == shape[-2]:
                feeds[name] = np.broadcast_to(np.eye(shape[-1], dtype=np.float32), shape).copy()
            else:
                feeds[name] = np.ones(shape, np.float32)
    return feeds


def _median_ms(fn, repeats):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    providers = ["CPUExecutionProvider"] if args.device == "cpu" else [("CUDAExecutionProvider", {"use_tf32": 0}), "CPUExecutionProvider"]
    rng = np.random.default_rng(0)
    print(f"device={args.device} ort={ort.__version__} repeats={args.repeats}")
    header = f"{'model':<20}{'batch':>6}{'grads ms':>10}{'stats ms':>10}{'stats/grads':>12}{'inv_op ms':>11}{'newton ms':>11}{'eigh ms':>9}"
    print(header)
    for name in args.models.split(","):
        entry = ZOO[name]
        plan = kc.compile(get_model(name), loss=entry.loss, output="logits", emit=False)
        n = BATCH.get(name, 128)
        x, y = entry.make_data(n)
        row = {}
        for sg, opts in [("gradients", {}), ("update_statistics", {}),
                         ("inverse_update", {"method": "inverse_op"}), ("inverse_update", {"method": "newton_schulz"})]:
            model, info = emit_subgraph(plan, sg, **opts)
            sess = ort.InferenceSession(model.SerializeToString(), providers=providers)
            if args.device == "cuda":
                assert "CUDAExecutionProvider" in sess.get_providers(), "CUDA EP not available"
            feeds = _feeds(sess, plan, info, x, y, rng)
            row[(sg, opts.get("method"))] = _median_ms(lambda sess=sess, feeds=feeds: sess.run(None, feeds), args.repeats)
        # host eigh: every block's numpy twin on its factors (float64), incl. host copies
        from kfac_compiler.blocks import plan_blocks

        blocks = plan_blocks(plan)
        model, info = emit_subgraph(plan, "update_statistics")
        factors = {}
        feeds = _feeds(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), plan, info, x, y, rng)
        for layer, block in blocks.items():
            factors[layer] = {s.name: feeds[f"factor/{layer}/{s.name}"] for s in block.factor_specs()}

        def host_eigh(blocks=blocks, factors=factors):
            for layer, block in blocks.items():
                block.numpy_inverse(factors[layer], 1e-2, "eigh")

        row["eigh"] = _median_ms(host_eigh, max(5, args.repeats // 3))
        g, s = row[("gradients", None)], row[("update_statistics", None)]
        print(f"{name:<20}{n:>6}{g:>10.3f}{s:>10.3f}{s / g:>12.2f}{row[('inverse_update', 'inverse_op')]:>11.3f}"
              f"{row[('inverse_update', 'newton_schulz')]:>11.3f}{row['eigh']:>9.3f}")


if __name__ == "__main__":
    main()
