"""The LSTM cell's short VJP built into the compiler, measured (issue 40 item 5; for
2026-11-30-lstm-composite-vjp.md)

    git apply benchmarks/results/2026-11-30-lstm-composite-vjp.patch    # for `ab` only
    python benchmarks/results/2026-11-30-lstm-composite-vjp.py ab THREADS sgd|adam|kfac
    python benchmarks/results/2026-11-30-lstm-composite-vjp.py profile THREADS
    python benchmarks/results/2026-11-30-lstm-composite-vjp.py gemm THREADS

One LSTM layer (T 64, batch 32, input 64, hidden 256; torch.nn.LSTM's initial weights, exported
by torch.onnx) under squared error, as in 2026-11-30-lstm-fused-vjp.py.

`ab`: two Trainers of the same plan in one process, one emitted with the patch's composite rule
(the cell differentiated as one, its derivative factors stacked over the 64 steps), one with
it removed from the registry (the ops' own rules); interleaved blocks of 10 steps, 8 rounds,
a 50 ms pause before each block; median (min-max) and the emitted step graph's node count.

`profile`: our emitted SGD step and the hand-written graph of 2026-11-30-lstm-fused-vjp.py
(unrolled forward + short VJP) as plain ONNX Runtime sessions with the same options, timed
interleaved, then ONNX Runtime's profile of each: kernel time by op and the Gemms by shape.

`gemm`: 64 dependent pairs of the recurrence's GEMMs ([32, 256] x [1024, 256]^T, then
[32, 1024] x [1024, 256]) with the weight a constant initializer, a graph input (a training
step's parameter), or a graph input used as the first operand (z^T = R h^T: the big matrix
as A), or a graph input transposed once (the forward Gemms without transB). Needs torch.
"""
from __future__ import annotations

import collections
import importlib
import json
import os
import re
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/

import harness  # noqa: E402

T, N, I, H = 64, 32, 64, 256
FUSED_VJP = importlib.import_module("2026-11-30-lstm-fused-vjp")  # the hand-written graphs, the export


def exported_layer() -> tuple[bytes, torch.nn.LSTM]:
    """(the ONNX export of a torch.nn.LSTM layer with seed 0's weights, the layer)."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(I, H)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FUSED_VJP.export_layer(lstm, torch.zeros(T, N, I)), lstm


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((T, N, I)).astype(np.float32),
            (rng.standard_normal((T, N, H)) * 0.1).astype(np.float32))


def interleaved(fns: dict, rounds: int = 8) -> dict[str, list[float]]:
    """ms per call: blocks of 10 calls after 3 warm-up calls each, the order rotated every round
    and a 50 ms pause before each block (benchmarks/harness.py: interleave)."""
    for f in fns.values():
        for _ in range(3):
            f()

    def block(f):
        return lambda: [f() for _ in range(10)]
    return harness.interleaved_ms({k: block(f) for k, f in fns.items()}, 10, rounds, warmup=0)


def report(res: dict[str, list[float]], extra: dict[str, str] | None = None) -> None:
    for k, v in res.items():
        print(f"{k:34s} median {np.median(v):7.2f} ms ({min(v):.2f}-{max(v):.2f}){(extra or {}).get(k, '')}")


def cmd_ab(threads: int, optimizer: str) -> None:
    import kfac_compiler as kc
    from kfac_compiler.backend.registry import emit_subgraph
    from kfac_compiler.runtime import Trainer
    try:
        composite = importlib.import_module("kfac_compiler.oprules.composite")
    except ImportError:
        sys.exit("ab: apply benchmarks/results/2026-11-30-lstm-composite-vjp.patch first (git apply)")
    model_bytes, _ = exported_layer()
    X, Yt = data()
    kind = {"sgd": "sgd_step", "adam": "adam_step", "kfac": "kfac_step"}[optimizer]

    def make() -> tuple[Trainer, int]:
        plan = kc.compile(onnx.load_from_string(model_bytes), loss="squared_error", output="y", emit=False)
        kw = dict(momentum=0.0, learning_rate=1e-3) if optimizer == "sgd" else {}
        tr = Trainer(plan, optimizer=optimizer, batch_size=N, threads=threads, **kw)
        return tr, len(emit_subgraph(plan, kind)[0].graph.node)
    on, n_on = make()
    saved = dict(composite.COMPOSITES)
    composite.COMPOSITES.clear()
    off, n_off = make()
    composite.COMPOSITES.update(saved)
    res = interleaved({"composite vjp": lambda: on.step({"input": X}, Yt),
                       "ops' rules": lambda: off.step({"input": X}, Yt)})
    report(res, {"composite vjp": f", {n_on} nodes", "ops' rules": f", {n_off} nodes"})
    ratio = np.median(res["composite vjp"]) / np.median(res["ops' rules"])
    print(f"ratio {ratio:.3f} ({threads} threads, {optimizer}, load {os.getloadavg()[0]:.2f})")


def plain_session(model: onnx.ModelProto, threads: int, profile: bool = False) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level, so.enable_profiling = threads, 3, profile
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def cmd_profile(threads: int) -> None:
    import kfac_compiler as kc
    from kfac_compiler.backend.registry import emit_subgraph
    model_bytes, lstm = exported_layer()
    X, Yt = data()
    plan = kc.compile(onnx.load_from_string(model_bytes), loss="squared_error", output="y", emit=False)
    ours = emit_subgraph(plan, "sgd_step")[0]
    w = [FUSED_VJP.onnx_gate_order(t.detach().numpy())
         for t in (lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0)]
    hand = FUSED_VJP.step_graph(*w, forward="unrolled")
    s_ours, s_hand = plain_session(ours, threads), plain_session(hand, threads)
    rng = np.random.default_rng(1)
    feeds: dict[str, np.ndarray] = {}
    for i in s_ours.get_inputs():
        if i.name in ("input", "targets"):
            feeds[i.name] = X if i.name == "input" else Yt
        elif i.name.startswith("hp/"):
            feeds[i.name] = np.array(1e-3 if "learning" in i.name else 0.0, np.float32)
        else:
            feeds[i.name] = (rng.standard_normal(i.shape) * 0.05).astype(np.float32)
    outs_ours = [o.name for o in s_ours.get_outputs()]
    outs_hand = ["loss", "new_W2", "new_R2", "new_bsum"]
    runs = {"ours (emitted sgd_step)": (ours, feeds, outs_ours, s_ours),
            "hand-written (weights constant)": (hand, {"X": X, "Yt": Yt}, outs_hand, s_hand)}
    res = interleaved({k: (lambda s=s, o=o, f=f: s.run(o, f)) for k, (_, f, o, s) in runs.items()})
    report(res, {k: f", {len(m.graph.node)} nodes" for k, (m, _, _, _) in runs.items()})
    for label, (model, f, o, _) in runs.items():
        prof = plain_session(model, threads, profile=True)
        for _ in range(20):
            prof.run(o, f)
        with open(prof.end_profiling()) as fh:
            events = [e for e in json.load(fh) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        by_op: collections.Counter = collections.Counter()
        gemms: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for e in events:
            by_op[e["args"]["op_name"]] += e["dur"]
            if e["args"]["op_name"] == "Gemm":
                shapes = re.sub(r"'float': ", "", str(e["args"].get("input_type_shape", "")))
                gemms[shapes] += e["dur"]
                count[shapes] += 1
        print(f"{label}: {sum(by_op.values()) / 20e3:.1f} ms of kernels a run; "
              + ", ".join(f"{k} {v / 20e3:.2f}" for k, v in by_op.most_common(6)))
        for k, v in gemms.most_common(4):
            print(f"    Gemm {k}: {v / 20e3:.2f} ms ({count[k] // 20} a run)")


def cmd_gemm(threads: int) -> None:
    rng = np.random.default_rng(0)
    R = rng.standard_normal((4 * H, H)).astype(np.float32)

    def session(kind: str) -> ort.InferenceSession:
        nodes, inits = [], []
        inputs = [oh.make_tensor_value_info("h", TensorProto.FLOAT, [N, H])]
        if kind == "constant":
            inits.append(nh.from_array(R, "R"))
        else:
            inputs.append(oh.make_tensor_value_info("R", TensorProto.FLOAT, [4 * H, H]))
        if kind == "input, transposed once":
            nodes.append(oh.make_node("Transpose", ["R"], ["RT"], perm=[1, 0]))
        x = "h"
        for i in range(T):
            if kind == "input, transposed once":
                nodes.append(oh.make_node("Gemm", [x, "RT"], [f"z{i}"]))                 # [N, 4H]
                nodes.append(oh.make_node("Gemm", [f"z{i}", "R"], [f"y{i}"]))           # [N, H]
            elif kind == "input as A":
                nodes.append(oh.make_node("Gemm", ["R", x], [f"z{i}"], transB=1))       # z^T [4H, N]
                nodes.append(oh.make_node("Gemm", [f"z{i}", "R"], [f"y{i}"], transA=1))  # [N, H]
            else:
                nodes.append(oh.make_node("Gemm", [x, "R"], [f"z{i}"], transB=1))       # [N, 4H]
                nodes.append(oh.make_node("Gemm", [f"z{i}", "R"], [f"y{i}"]))           # [N, H]
            nodes.append(oh.make_node("Tanh", [f"y{i}"], [f"t{i}"]))
            x = f"t{i}"
        graph = oh.make_graph(nodes, "g", inputs, [oh.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
        return plain_session(model, threads)
    h = (rng.standard_normal((N, H)) * 0.01).astype(np.float32)
    kinds = ("constant", "input", "input as A", "input, transposed once")
    sessions = {k: session(k) for k in kinds}
    feeds = {k: {"h": h} if k == "constant" else {"h": h, "R": R} for k in kinds}
    res = interleaved({k: (lambda k=k: sessions[k].run(None, feeds[k])) for k in kinds})
    print(f"128 GEMMs + 64 Tanh, {threads} threads:")
    report(res)


if __name__ == "__main__":
    cmd, threads = sys.argv[1], int(sys.argv[2])
    if cmd == "ab":
        cmd_ab(threads, sys.argv[3])
    elif cmd == "profile":
        cmd_profile(threads)
    else:
        cmd_gemm(threads)
