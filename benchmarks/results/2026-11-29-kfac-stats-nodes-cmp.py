"""Run the before/after update_statistics graphs (2026-11-29-kfac-stats-nodes-emit.py, saved
to /tmp/sn/st_before and /tmp/sn/st_after) on the same random feeds and print each output's
largest difference relative to its largest entry."""
import numpy as np
import onnx
import onnxruntime as ort


def run(path: str) -> dict:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(onnx.load(path).SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in s.get_inputs():
        shape = [d if isinstance(d, int) else 16 for d in i.shape]
        if "int" in i.type:
            feeds[i.name] = rng.integers(0, 2, shape).astype(np.int64)
        elif i.name.startswith("hp/"):
            feeds[i.name] = np.array(0.3 if "ema" in i.name else 1.0, np.float32)
        elif "noise" in i.name:
            feeds[i.name] = rng.uniform(0.01, 0.99, shape).astype(np.float32)
        else:
            feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


for name in ["small_cnn", "transformer_block"]:
    before, after = run(f"/tmp/sn/st_before/{name}.onnx"), run(f"/tmp/sn/st_after/{name}.onnx")
    worst = 0.0
    for k, v in before.items():
        err = float(np.max(np.abs(v - after[k])) / (np.max(np.abs(v)) + 1e-30))
        worst = max(worst, err)
        print(name, k, v.shape, f"{err:.2e}")
    print(name, "worst relative", f"{worst:.2e}", "outputs", len(before), len(after))
