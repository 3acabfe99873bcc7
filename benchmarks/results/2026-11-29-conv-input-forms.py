"""Issue 40 item 5: a conv's input gradient as ConvTranspose(g, W) or as a Conv of g with the
flipped, channel-transposed kernel (pads (k-1) - pads), single ops on ORT's CPU provider, 2
threads, medians of 30 runs; checks the two agree. Shapes: ResNet-18's 3x3 "same" convs on
the digits' small maps, 56x56 and 28x28, and LeNet-5's 5x5 "valid" conv2.

    python benchmarks/results/2026-11-29-conv-input-forms.py
"""
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h


def sess(node, inputs, out):
    g = h.make_graph([node], "g", [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs], [h.make_tensor_value_info(out, T.FLOAT, None)])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
def bench(s, feeds, reps=30):
    for _ in range(3): s.run(None, feeds)
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); s.run(None, feeds); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3
rng = np.random.default_rng(0)
for N, C, S in [(32, 64, 8), (32, 128, 4), (32, 256, 2), (32, 512, 1), (128, 16, 8), (128, 32, 8), (32, 64, 56), (32, 64, 28)]:
    g = rng.standard_normal((N, C, S, S), dtype=np.float32); W = rng.standard_normal((C, C, 3, 3), dtype=np.float32)
    ct = sess(h.make_node("ConvTranspose", ["g", "W"], ["dx"], pads=[1, 1, 1, 1]), [("g", g.shape), ("W", W.shape)], "dx")
    cv = sess(h.make_node("Conv", ["g", "W"], ["dx"], pads=[1, 1, 1, 1]), [("g", g.shape), ("W", W.shape)], "dx")
    Wf = np.ascontiguousarray(W.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
    a = ct.run(None, {"g": g, "W": W})[0]; b = cv.run(None, {"g": g, "W": Wf})[0]
    assert np.allclose(a, b, atol=1e-3), abs(a - b).max()
    r = [bench(ct, {"g": g, "W": W}), bench(cv, {"g": g, "W": Wf})]
    print(f"N{N} C{C} S{S}: ConvTranspose {r[0]:.2f} ms, flipped Conv {r[1]:.2f} ms")
print("lenet conv2")
g = rng.standard_normal((128, 16, 8, 8), dtype=np.float32); W = rng.standard_normal((16, 6, 5, 5), dtype=np.float32)
ct = sess(h.make_node("ConvTranspose", ["g", "W"], ["dx"]), [("g", g.shape), ("W", W.shape)], "dx")
cv = sess(h.make_node("Conv", ["g", "W"], ["dx"], pads=[4, 4, 4, 4]), [("g", g.shape), ("W", (6, 16, 5, 5))], "dx")
Wf = np.ascontiguousarray(W.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
a = ct.run(None, {"g": g, "W": W})[0]; b = cv.run(None, {"g": g, "W": Wf})[0]
assert np.allclose(a, b, atol=1e-3)
print(f"ConvTranspose {bench(ct, {'g': g, 'W': W}):.2f} ms, flipped Conv {bench(cv, {'g': g, 'W': Wf}):.2f} ms")
