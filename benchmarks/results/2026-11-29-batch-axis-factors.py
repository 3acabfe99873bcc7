"""One statistics update (empirical mode) of the ViT exports' attention projections on the
fixture's batch (N = 8 examples, T = 17 tokens): in_proj runs on time-major [T, N, D] rows,
out_proj on merged [T*N, D] rows. Prints each factor's Frobenius norm and its first diagonal
entry; run it on two commits and divide (the exports agree with each other on either: same
weights, same layouts). Usage: python 2026-11-29-batch-axis-factors.py [fc approximation]."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import numpy_helper

import kfac_compiler as kc
from kfac_compiler.backend import emit_subgraph

REAL = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "real"


def statistics(name: str, approx: str | None) -> dict[str, dict[str, np.ndarray]]:
    cfg = {"approximations": {"fully_connected": approx}} if approx else None
    plan = kc.compile(str(REAL / f"{name}.onnx"), loss="softmax_cross_entropy", output="logits", emit=False,
                      config=cfg)
    sub, _ = emit_subgraph(plan, "statistics", mode="empirical")
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    data = np.load(REAL / "vit-ts.npz")  # one batch for all three
    feeds = {"input": data["input"], "targets": data["targets"].astype(np.int64)}
    feeds.update({t.name: numpy_helper.to_array(t) for t in plan.model.graph.initializer if t.name in plan.trainable})
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    by_layer: dict[str, dict[str, np.ndarray]] = {}
    for layer in plan.layers:
        if layer.kind != "fully_connected":
            continue
        key = "out_proj" if "out_proj" in layer.name else "in_proj" if "self_attention" in "".join(
            layer.params) or layer.params[0].startswith("onnx::MatMul_257") or "in_proj" in layer.params[0] else None
        if key is None and plan.view().shape(layer.uses[0].input) and plan.view().shape(layer.uses[0].output)[-1] == 48:
            key = "in_proj"
        if key:
            prefix = f"stat/{layer.name}/"
            by_layer[key] = {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)}
    return by_layer


def main() -> None:
    approx = sys.argv[1] if len(sys.argv) > 1 else None
    for name in ("vit-ts", "vit-dynamo_noopt", "vit-dynamo"):
        got = statistics(name, approx)
        for layer in ("in_proj", "out_proj"):
            for f, v in sorted(got[layer].items()):
                print(f"{name:17s} {layer:8s} {f:5s} norm {np.linalg.norm(v):.6g}  first {v.reshape(-1)[0]:.6g}")


if __name__ == "__main__":
    main()
