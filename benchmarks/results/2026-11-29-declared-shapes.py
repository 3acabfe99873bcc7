"""Declared shapes in the emitted step graphs (backend/shapes.py): ONNX Runtime session setup
with and without them (2026-11-29-declared-shapes.md).

    python benchmarks/results/2026-11-29-declared-shapes.py on|off WORKLOAD [--only REGEX] [--reuse on|off]

WORKLOAD: lstm (the byte LM of 2026-11-29-lstm-lean.py, T = 64, batch 32), resnet
(bench_step.py's ResNet-18 export, batch 32) or mlp<L> (setup-scaling's deep MLP, width 32).
Emits the sessions a default K-FAC and Adam Trainer build (Trainer(sessions=False)) and times
each InferenceSession with the runtime's options (runtime/device.py: one thread, memory reuse
below LARGE_GRAPH_NODES; --reuse forces it), one JSON line per session. `off` patches
DeclaredShapes.declare to a no-op: the graphs as emitted before (the same nodes, no
value_info). Alternate on/off processes: the machine's load moves between them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), os.path.join(HERE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plan_of(workload: str):
    import kfac_compiler as kc

    if workload == "lstm":
        return _load("2026-11-29-fwdbwd-profile").lstm(64)[0]
    if workload == "resnet":
        from bench_step import resnet_export
        work = tempfile.mkdtemp()
        return kc.compile(resnet_export(work)[0], loss="softmax_cross_entropy", output="logits", emit=False)
    if workload.startswith("mlp"):
        from bench_step import deep_mlp
        return kc.compile(deep_mlp(int(workload[3:]), 32), loss="softmax_cross_entropy", emit=False)
    raise SystemExit(f"unknown workload {workload!r}: lstm, resnet or mlp<L>")


def main() -> None:
    import onnxruntime as ort

    from kfac_compiler.backend.shapes import DeclaredShapes
    from kfac_compiler.runtime.device import get_device, memory_options, session_options

    declare, workload = sys.argv[1] == "on", sys.argv[2]
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    reuse = sys.argv[sys.argv.index("--reuse") + 1] == "on" if "--reuse" in sys.argv else None
    if not declare:
        DeclaredShapes.declare = lambda self, model, like: 0  # type: ignore[method-assign]
    scaling = _load("2026-11-29-setup-scaling")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_of(workload)
        graphs = scaling.sessions(plan, "kfac") + scaling.sessions(plan, "adam")
    for label, name, model in graphs:
        if only and not re.search(only, label):
            continue
        nodes = len(model.graph.node)
        so = session_options(threads=1)
        memory_options(so, get_device("cpu"), name, nodes)
        if reuse is not None:
            so.enable_mem_reuse = reuse
        data = model.SerializeToString()
        began = time.perf_counter()
        ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        print(json.dumps({"workload": workload, "declared": declare, "session": label, "nodes": nodes,
                          "value_info": len(model.graph.value_info), "reuse": so.enable_mem_reuse,
                          "seconds": round(time.perf_counter() - began, 2),
                          "load": open("/proc/loadavg").read().split()[:3]}), flush=True)


if __name__ == "__main__":
    main()
