"""Issue 40 item 5: the unrolled LSTM byte LM's Adam step (2026-11-29-fwdbwd-profile.py's
workload: Embedding(256, 64) -> LSTM(64 -> 256) over T steps -> Linear(256, 256), batch 32):
nodes by op and phase, and ONNX Runtime's session setup with and without memory reuse.

    python benchmarks/results/2026-11-29-lstm-lean.py nodes [T]
    python benchmarks/results/2026-11-29-lstm-lean.py setup ROUNDS [T]    # interleaved reuse on / off
    python benchmarks/results/2026-11-29-lstm-lean.py kernels REUSE STEPS [T]   # REUSE 1 / 0: one profiled Trainer
    python benchmarks/results/2026-11-29-lstm-lean.py declared [T]   # reuse on, the step graph's shapes declared or not

Run from the repository root; the kfac_compiler imported is the one next to this file.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location("fwdbwd_profile", os.path.join(os.path.dirname(__file__),
                                                                             "2026-11-29-fwdbwd-profile.py"))
prof = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prof)


def step_model(T: int):
    from kfac_compiler.backend.registry import emit_subgraph
    plan, feeds, y, _ = prof.lstm(T)
    model, _ = emit_subgraph(plan, "adam_step")
    return plan, model, feeds, y


def nodes(T: int) -> None:
    _, model, _, _ = step_model(T)
    phase = prof.phases(model)
    by_phase = collections.Counter(phase.values())
    ops = collections.Counter(n.op_type for n in model.graph.node)
    fwd_ops = collections.Counter(n.op_type for n in model.graph.node if phase[n.name] == "forward")
    bwd_ops = collections.Counter(n.op_type for n in model.graph.node if phase[n.name] == "backward")
    print(f"T={T}: adam_step nodes {len(model.graph.node)} ({len(model.graph.node) / T:.1f} per step); "
          + ", ".join(f"{k} {v}" for k, v in sorted(by_phase.items())))
    print("  ops:", ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    print("  forward:", ", ".join(f"{k} {v}" for k, v in fwd_ops.most_common(12)))
    print("  backward:", ", ".join(f"{k} {v}" for k, v in bwd_ops.most_common(12)))


def _session(model, reuse: bool):
    import onnxruntime as ort

    from kfac_compiler.runtime.device import session_options
    so = session_options(threads=1)
    so.enable_mem_reuse = reuse
    t0 = time.perf_counter()
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess, time.perf_counter() - t0


def setup(rounds: int, T: int) -> None:
    _, model, _, _ = step_model(T)
    res: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for reuse in (True, False):
            res[reuse].append(_session(model, reuse)[1])
    for reuse, v in res.items():
        print(f"T={T} nodes {len(model.graph.node)} session reuse={reuse}: median {np.median(v):.2f} s "
              f"(range {min(v):.2f}-{max(v):.2f}, {rounds} rounds); load {open('/proc/loadavg').read().split()[:3]}")


def kernels(reuse: bool, steps: int, T: int) -> None:
    """One Trainer's Adam steps under ORT's profiler, its step session planned with or without
    memory reuse (runtime/device.py's large-graph option forced): the session's setup, the
    kernel time per step (the sum of the node events) and the median model_run. Alternate
    processes of both to compare (the machine's load moves between them)."""
    import kfac_compiler.runtime.device as dev
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.device import PROFILE_ENV
    if not reuse:
        dev.LARGE_GRAPH_NODES = 1
    plan, feeds, y, bs = prof.lstm(T)
    os.environ[PROFILE_ENV] = os.path.join(tempfile.mkdtemp(), "prof")
    t0 = time.perf_counter()
    tr = Trainer(plan, optimizer="adam", device="cpu", batch_size=bs, seed=0, threads=1)
    tr.step(feeds, y)
    setup_s = time.perf_counter() - t0
    for _ in range(steps):
        tr.step(feeds, y)
    prog = tr.programs()["adam_step"]
    with open(prog.session.end_profiling()) as f:
        events = json.load(f)
    runs = [e["dur"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][1:]
    kern = sum(e["dur"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))
    print(f"T={T} reuse={reuse}: setup + first step {setup_s:.1f} s, kernels {kern / (steps + 1) / 1e3:.1f} ms/step, "
          f"model_run median {np.median(runs) / 1e3:.1f} ms (range {min(runs) / 1e3:.1f}-{max(runs) / 1e3:.1f}, "
          f"{steps} steps), loss {float(tr.evaluate(feeds, y)['loss']):.6f}; load "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])}")


def declared(T: int) -> None:
    """Experiment, not what the compiler emits: the session with memory reuse when the emitted
    step graph declares (value_info) no shapes (as emitted), the forward's (the canonical
    model's shape inference), or those and each total cotangent's (its primal's shape,
    recorded by wrapping passes/autodiff.py's _total). Tensors whose batch dim ORT cannot
    infer never match a freed buffer and lengthen the planner's free list."""
    import onnx
    import onnxruntime as ort

    import kfac_compiler.passes.autodiff as ad
    from kfac_compiler.runtime.device import session_options
    shapes: dict[str, tuple[int, list]] = {}
    current: dict = {}
    orig_backward, orig_total = ad.backward, ad._total

    def backward(b, view, seeds, wrt):
        current["view"] = view
        return orig_backward(b, view, seeds, wrt)

    def total(b, acc, name):
        out = orig_total(b, acc, name)
        view = current.get("view")
        if out is not None and view is not None and view.shape(name) is not None:
            shapes[out] = (view.dtypes.get(name) or onnx.TensorProto.FLOAT, list(view.shape(name)))
        return out
    ad.backward, ad._total = backward, total
    plan, model, _, _ = step_model(T)
    made = {o for n in model.graph.node for o in n.output}
    fwd = [v for v in plan.model.graph.value_info if v.name in made]
    cot = [onnx.helper.make_tensor_value_info(k, t, s) for k, (t, s) in shapes.items()
           if k in made and k not in {v.name for v in fwd}]
    print(f"T={T}: {len(model.graph.node)} nodes; forward shapes {len(fwd)}, cotangent shapes {len(cot)}")
    for tag, vis in (("none", []), ("forward", fwd), ("forward+cotangents", fwd + cot)):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        m.graph.value_info.extend(vis)
        so = session_options(threads=1)
        so.enable_mem_reuse = True
        t0 = time.perf_counter()
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        print(f"  declared {tag}: session {time.perf_counter() - t0:.2f} s; load "
              f"{' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)


def main():
    mode = sys.argv[1]
    a = [int(x) for x in sys.argv[2:]]
    if mode == "nodes":
        return nodes(a[0] if a else 64)
    if mode == "setup":
        return setup(a[0] if a else 3, a[1] if len(a) > 1 else 64)
    if mode == "kernels":
        return kernels(bool(a[0]), a[1] if len(a) > 1 else 10, a[2] if len(a) > 2 else 64)
    if mode == "declared":
        return declared(a[0] if a else 64)
    raise SystemExit(f"unknown mode {mode!r}: nodes, setup, kernels or declared")


if __name__ == "__main__":
    main()
