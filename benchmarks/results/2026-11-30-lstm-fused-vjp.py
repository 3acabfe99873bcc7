"""Would a fused LSTM with its own VJP make our LSTM step as fast as torch's? (issue 40 item 5,
for 2026-11-30-lstm-fused-vjp.md)

    python benchmarks/results/2026-11-30-lstm-fused-vjp.py step THREADS
    python benchmarks/results/2026-11-30-lstm-fused-vjp.py gemm THREADS

`step`: one LSTM layer (T 64, batch 32, input 64, hidden 256; torch.nn.LSTM's initial
weights) under 0.5 sum (Y - target)^2 / N, four ways, interleaved blocks of 10 steps (7
rounds; median, min-max): our compiler's unrolled SGD step (`Trainer`, lr 1e-3, momentum 0);
two hand-written ONNX graphs (step_graph) with a short VJP (the derivative factors batched over
all steps, 7 nodes a step backward: Gemm, Add, Mul, Mul, Add, Concat, Mul; the weight gradients
as single Gemms; the SGD update), one on ONNX Runtime's fused `LSTM` kernel with the gates
recomputed from its Y, one on our unrolled forward with its gates kept, each checked against
torch autograd first; and torch (forward, backward; its LSTM is oneDNN's fused cell). Then
ONNX Runtime's profile of each hand-written graph. `gemm`: the step's GEMM shapes, one ONNX Runtime Gemm against torch.mm.
Needs torch.
"""
from __future__ import annotations

import collections
import io
import json
import os
import sys
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

T, N, I, H = 64, 32, 64, 256
G = 4 * H


def onnx_gate_order(w: np.ndarray) -> np.ndarray:
    """torch's gate rows i, f, g, o -> ONNX's i, o, f, c."""
    i, f, g, o = np.split(w, 4, axis=0)
    return np.concatenate([i, o, f, g], 0)


class Graph:
    """A tiny ONNX graph builder: nodes with fresh names, initializers."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value) -> str:
        self.inits.append(nh.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: list[str] | None = None, **attrs):
        k = len(self.nodes)
        outs = outputs or [f"t{k}"]
        self.nodes.append(oh.make_node(op_type, inputs, outs, name=f"n{k}", **attrs))
        return outs[0] if len(outs) == 1 else outs


def step_graph(W: np.ndarray, R: np.ndarray, bw: np.ndarray, br: np.ndarray, forward: str) -> onnx.ModelProto:
    """A hand-written SGD step of the layer; outputs loss, gW, gR, gB, new_*. forward "fused":
    ONNX Runtime's LSTM kernel, the gates recomputed from its Y in one Gemm and the cell states
    by their recurrence (2 nodes a step); "unrolled": our compiler's per-step forward (Gemm,
    Add, Split, Sigmoid, Tanh, Split, Mul, Mul, Add, Tanh, Mul), its gates kept. Then the same
    short VJP: the derivative factors batched over all steps, 7 nodes a step backward."""
    g = Graph()
    g.const("W", W[None]), g.const("R", R[None]), g.const("B", np.concatenate([bw, br])[None])
    g.const("W2", W), g.const("R2", R), g.const("bsum", bw + br)
    g.const("invN", np.float32(1.0 / N)), g.const("one", np.float32(1.0)), g.const("lr", np.float32(1e-3))
    g.const("zeros_h", np.zeros((1, N, H), np.float32)), g.const("half_invN", np.float32(0.5 / N))
    g.const("zeros_nh", np.zeros((N, H), np.float32))
    for name, shape in (("sTN_I", [T * N, I]), ("sTN_H", [T * N, H]), ("sTNH", [T, N, H]), ("sTNG", [T, N, G]),
                        ("sNH", [N, H]), ("sNG", [N, G]), ("sp3", [3 * H, H]), ("sp_last", [T - 1, 1]),
                        ("ax0", [0]), ("ax1", [1])):
        g.const(name, np.array(shape, np.int64))

    def steps(x: str, shape: str, prefix: str) -> list[str]:
        """[T*N, c] -> T tensors [N, c]."""
        parts = g.op("Split", [g.op("Reshape", [x, shape])], [f"{prefix}{t}" for t in range(T)], axis=0, num_outputs=T)
        return [g.op("Reshape", [p, "sNG" if shape == "sTNG" else "sNH"]) for p in parts]

    xf = g.op("Reshape", ["X", "sTN_I"])
    if forward == "fused":
        g.op("LSTM", ["X", "W", "R", "B"], ["Y", "", ""], hidden_size=H)
        hs3 = g.op("Squeeze", ["Y", "ax1"])                                    # [T, N, H]
        h_first, _ = g.op("Split", [hs3, "sp_last"], ["h_first", "h_last"], axis=0)
        hs = g.op("Reshape", [hs3, "sTN_H"])
        hp = g.op("Reshape", [g.op("Concat", ["zeros_h", h_first], axis=0), "sTN_H"])  # h_{t-1}
        z = g.op("Gemm", [hp, "R2", g.op("Gemm", [xf, "W2", "bsum"], transB=1)], transB=1)
        zs, zc = g.op("Split", [z, "sp3"], ["zs", "zc"], axis=1)
        s, gc = g.op("Sigmoid", [zs]), g.op("Tanh", [zc])
        i_, o_, f_ = g.op("Split", [s], ["i_", "o_", "f_"], axis=1, num_outputs=3)
        fs, us = steps(f_, "sTNH", "f"), steps(g.op("Mul", [i_, gc]), "sTNH", "u")
        cs, c_prev = [], "zeros_nh"
        for t in range(T):  # c_t = f_t c_{t-1} + i_t g_t
            c_prev = g.op("Add", [g.op("Mul", [fs[t], c_prev]), us[t]])
            cs.append(c_prev)
        tc = g.op("Tanh", [g.op("Concat", cs, axis=0)])
    else:
        xws = g.op("Split", [g.op("Gemm", [xf, "W2", "bsum"], transB=1)], [f"xw{t}" for t in range(T)],
                   axis=0, num_outputs=T)
        h, c_prev, hl, cs, ss, gs, tcs, fs = "zeros_nh", "zeros_nh", [], [], [], [], [], []
        for t in range(T):
            zs_t, zc_t = g.op("Split", [g.op("Add", [xws[t], g.op("Gemm", [h, "R2"], transB=1)]), "sp3"],
                              [f"zs{t}", f"zc{t}"], axis=1)
            s_t, g_t = g.op("Sigmoid", [zs_t]), g.op("Tanh", [zc_t])
            i_t, o_t, f_t = g.op("Split", [s_t], [f"i{t}", f"o{t}", f"f{t}"], axis=1, num_outputs=3)
            c_prev = g.op("Add", [g.op("Mul", [f_t, c_prev]), g.op("Mul", [i_t, g_t])])
            tc_t = g.op("Tanh", [c_prev])
            h = g.op("Mul", [o_t, tc_t])
            for lst, v in ((hl, h), (cs, c_prev), (ss, s_t), (gs, g_t), (tcs, tc_t), (fs, f_t)):
                lst.append(v)
        hs = g.op("Concat", hl, axis=0)                                        # [T*N, H]
        hp = g.op("Concat", ["zeros_nh"] + hl[:-1], axis=0)
        s, gc, tc = g.op("Concat", ss, axis=0), g.op("Concat", gs, axis=0), g.op("Concat", tcs, axis=0)
        i_, o_, _ = g.op("Split", [s], ["i_", "o_", "f_"], axis=1, num_outputs=3)
    c_before = g.op("Concat", ["zeros_nh"] + cs[:-1], axis=0)
    si, so, sf = g.op("Split", [g.op("Mul", [s, g.op("Sub", ["one", s])])], ["si", "so", "sf"], axis=1, num_outputs=3)
    gd = g.op("Sub", ["one", g.op("Mul", [gc, gc])])
    # dz_t = [dc, dh, dc, dc] * A4_t, A4 = [g i', tanh(c) o', c_{t-1} f', i g']
    a4 = g.op("Concat", [g.op("Mul", [gc, si]), g.op("Mul", [tc, so]), g.op("Mul", [c_before, sf]),
                         g.op("Mul", [i_, gd])], axis=1)
    e = g.op("Mul", [o_, g.op("Sub", ["one", g.op("Mul", [tc, tc])])])   # dc from dh: o tanh'(c)
    a4s, es = steps(a4, "sTNG", "a"), steps(e, "sTNH", "e")
    dys = g.op("Split", [g.op("Mul", [g.op("Sub", [hs, "Yt2"]), "invN"])], [f"dy{t}" for t in range(T)],
               axis=0, num_outputs=T)
    dzs: list[str] = [""] * T
    dz_next = dc_next = None
    for t in reversed(range(T)):
        dh = dys[t] if dz_next is None else g.op("Add", [g.op("Gemm", [dz_next, "R2"]), dys[t]])
        dc = g.op("Mul", [dh, es[t]])
        if dc_next is not None:
            dc = g.op("Add", [dc, g.op("Mul", [dc_next, fs[t + 1]])])
        dzs[t] = dz_next = g.op("Mul", [g.op("Concat", [dc, dh, dc, dc], axis=1), a4s[t]])
        dc_next = dc
    dz_all = g.op("Concat", dzs, axis=0)
    g.op("Gemm", [dz_all, xf], ["gW"], transA=1)
    g.op("Gemm", [dz_all, hp], ["gR"], transA=1)
    g.op("ReduceSum", [dz_all, "ax0"], ["gB"], keepdims=0)
    g.op("Mul", [g.op("ReduceSumSquare", [g.op("Sub", [hs, "Yt2"])], keepdims=0), "half_invN"], ["loss"])
    for p, grad in (("W2", "gW"), ("R2", "gR"), ("bsum", "gB")):
        g.op("Sub", [p, g.op("Mul", ["lr", grad])], [f"new_{p}"])
    g.nodes.insert(0, oh.make_node("Reshape", ["Yt", "sTN_H"], ["Yt2"], name="Yt2"))
    graph = oh.make_graph(
        g.nodes, f"{forward}_lstm_step",
        [oh.make_tensor_value_info("X", TensorProto.FLOAT, [T, N, I]),
         oh.make_tensor_value_info("Yt", TensorProto.FLOAT, [T, N, H])],
        [oh.make_tensor_value_info(x, TensorProto.FLOAT, None)
         for x in ("loss", "gW", "gR", "gB", "new_W2", "new_R2", "new_bsum")], g.inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)


def export_layer(lstm: torch.nn.LSTM, x: torch.Tensor) -> bytes:
    """The layer's output sequence as an ONNX model (torch's TorchScript exporter): input, y."""
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = lstm

        def forward(self, x):
            return self.rnn(x)[0]
    buf = io.BytesIO()
    torch.onnx.export(Layer(), (x,), buf, input_names=["input"], output_names=["y"], dynamo=False)
    return buf.getvalue()


def session(model: onnx.ModelProto, threads: int, profile: bool = False) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level, so.enable_profiling = threads, 3, profile
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def cmd_step(threads: int) -> None:
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    lstm = torch.nn.LSTM(I, H)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((T, N, I)).astype(np.float32)
    Yt = (rng.standard_normal((T, N, H)) * 0.1).astype(np.float32)
    xt, yt = torch.from_numpy(X), torch.from_numpy(Yt)

    def torch_step() -> None:
        lstm.zero_grad(set_to_none=True)
        y, _ = lstm(xt)
        (0.5 * ((y - yt) ** 2).sum() / N).backward()

    def w(t: torch.Tensor) -> np.ndarray:
        return onnx_gate_order(t.detach().numpy())
    weights = (w(lstm.weight_ih_l0), w(lstm.weight_hh_l0), w(lstm.bias_ih_l0), w(lstm.bias_hh_l0))
    models = {kind: step_graph(*weights, forward=kind) for kind in ("fused", "unrolled")}
    sessions = {kind: session(m, threads) for kind, m in models.items()}
    torch_step()
    want = {"gW": w(lstm.weight_ih_l0.grad), "gR": w(lstm.weight_hh_l0.grad), "gB": w(lstm.bias_ih_l0.grad)}
    for kind, sess in sessions.items():
        got = dict(zip(["gW", "gR", "gB"], sess.run(["gW", "gR", "gB"], {"X": X, "Yt": Yt})))
        errs = {k: float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()) for k in want}
        print(f"hand-written graph, {kind} forward: {len(models[kind].graph.node)} nodes; gradients against torch "
              "autograd, max relative " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert max(errs.values()) < 1e-4, errs

    plan = kc.compile(onnx.load_from_string(export_layer(lstm, xt)), loss="squared_error", output="y", emit=False)
    tr = Trainer(plan, optimizer="sgd", batch_size=N, momentum=0.0, learning_rate=1e-3, threads=threads)
    outs, feeds = ["loss", "new_W2", "new_R2", "new_bsum"], {"X": X, "Yt": Yt}
    fns = {"ours, unrolled (Trainer, SGD)": lambda: tr.step({"input": X}, Yt),
           "fused LSTM + short VJP (hand-written)": lambda: sessions["fused"].run(outs, feeds),
           "unrolled + short VJP (hand-written)": lambda: sessions["unrolled"].run(outs, feeds),
           "torch": torch_step}
    for f in fns.values():
        for _ in range(5):
            f()
    res: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(7):
        for k, f in fns.items():
            time.sleep(0.05)
            t0 = time.perf_counter()
            for _ in range(10):
                f()
            res[k].append((time.perf_counter() - t0) * 100)
    ref = float(np.median(res["torch"]))
    for k, v in res.items():
        print(f"{k:40s} median {np.median(v):6.2f} ms ({min(v):.2f}-{max(v):.2f}), {np.median(v) / ref:.2f}x torch's")
    for kind, model in models.items():
        prof = session(model, threads, profile=True)
        for _ in range(20):
            prof.run(outs, feeds)
        with open(prof.end_profiling()) as f:
            events = json.load(f)
        us: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                us[e["args"]["op_name"]] += e["dur"]
                count[e["args"]["op_name"]] += 1
        print(f"hand-written graph, {kind} forward, ONNX Runtime's profile: {sum(us.values()) / 20e3:.1f} ms of "
              "kernels a run; " + ", ".join(f"{k} {v / 20e3:.2f} ms ({count[k] // 20})" for k, v in us.most_common(8)))


def cmd_gemm(threads: int) -> None:
    torch.set_num_threads(threads)

    def median_time(f, reps: int) -> float:
        for _ in range(20):
            f()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            ts.append((time.perf_counter() - t0) / reps)
        return float(np.median(ts))
    for m, k, n, trans_a, reps in ((32, 256, 1024, 0, 500), (32, 1024, 256, 0, 500),
                                   (1024, 2048, 256, 1, 30), (2048, 256, 1024, 0, 30)):
        a_shape = [k, m] if trans_a else [m, k]
        graph = oh.make_graph([oh.make_node("Gemm", ["A", "B"], ["Y"], transA=trans_a)], "gemm",
                              [oh.make_tensor_value_info("A", TensorProto.FLOAT, a_shape),
                               oh.make_tensor_value_info("B", TensorProto.FLOAT, [k, n])],
                              [oh.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])])
        sess = session(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9), threads)
        a = np.random.rand(*a_shape).astype(np.float32)
        b = np.random.rand(k, n).astype(np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ta = ta.t() if trans_a else ta
        o = median_time(lambda s=sess, f={"A": a, "B": b}: s.run(None, f), reps)
        t = median_time(lambda x=ta, y=tb: torch.mm(x, y), reps)
        flops = 2 * m * k * n
        print(f"[{m} x {k}] x [{k} x {n}]{' (transA)' if trans_a else ''}: ONNX Runtime {o * 1e6:8.1f} us "
              f"({flops / o / 1e9:5.1f} GFLOP/s), torch.mm {t * 1e6:8.1f} us ({flops / t / 1e9:5.1f}), ratio {o / t:.2f}")


if __name__ == "__main__":
    {"step": cmd_step, "gemm": cmd_gemm}[sys.argv[1]](int(sys.argv[2]) if len(sys.argv) > 2 else 2)
