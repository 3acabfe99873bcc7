"""Issue 38 item 4: compile and session setup of deep MLPs against the layers
(2026-11-29-setup-scaling.md).

    python benchmarks/results/2026-11-29-setup-scaling.py [--levels] [--emitters-order] [--split]
        [--optimizers kfac,adam] [--width 32] [--out FILE.json] LAYERS...

Per size: the front end (kfac_compiler.compile with emit=False), the emission of the
sessions a default K-FAC (batch 32) and Adam Trainer build (Trainer(sessions=False)), and per
session its nodes and ONNX Runtime's InferenceSession creation with the runtime's options
(runtime/device.py: ORT_ENABLE_ALL, memory reuse off from MEM_REUSE_MAX_NODES and for sessions not run every step, one thread).
--levels: also each optimization level (the runtime's reuse rule) and ORT_ENABLE_ALL with
reuse forced on (below --reuse-on-below nodes). --emitters-order: also the graphs in the order the emitters append nodes
(backend.schedule's generation order patched out). --split: ORT's verbose log of the
runtime's session, in a child process, split into graph transformers, allocation planner
and the rest, with the five slowest transformers. The log-log slope between consecutive
sizes is printed per column.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")

CHILD = r"""
import sys, onnxruntime as ort
from kfac_compiler.runtime.device import get_device, memory_options, session_options
path, name, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
so = session_options(threads=1)
memory_options(so, get_device("cpu"), name, nodes)
so.log_severity_level = 0
ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
"""


def create_seconds(data: bytes, name: str, nodes: int, level: str | None = None, reuse: bool | None = None) -> float:
    import onnxruntime as ort

    from kfac_compiler.runtime.device import get_device, memory_options, session_options

    so = session_options(threads=1)
    memory_options(so, get_device("cpu"), name, nodes)
    if level is not None:
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if reuse is not None:
        so.enable_mem_reuse = reuse
    began = time.perf_counter()
    ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return time.perf_counter() - began


def split_log(path: str, name: str, nodes: int) -> dict:
    """ORT's verbose log of one session creation: seconds in graph transformers (each
    "Applying graph transformer X" to the next line, summed per X), in the allocation
    planner ("Use DeviceBasedPartition" to "Saving initialized tensors") and in total."""
    out = subprocess.run([sys.executable, "-c", CHILD, path, name, str(nodes)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2])})
    stamps = []
    for line in (out.stdout + out.stderr).splitlines():
        m = re.match(r"\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d\.\d+) \[\w:onnxruntime:[^\]]*\] (.*)", line)
        if m:
            stamps.append((3600 * int(m[1]) + 60 * int(m[2]) + float(m[3]), m[4]))
    per: Counter[str] = Counter()
    planner = 0.0
    for (t, msg), (t2, _) in zip(stamps, stamps[1:]):
        a = re.match(r"Applying graph transformer (\S+)", msg)
        if a:
            per[a[1]] += t2 - t
        if "Use DeviceBasedPartition" in msg:
            planner += t2 - t
    total = stamps[-1][0] - stamps[0][0] if stamps else float("nan")
    return {"total": total, "transformers": sum(per.values()), "planner": planner,
            "slowest": dict(per.most_common(5)), "passes": sum(1 for _, m in stamps if "Applying graph transformer" in m)}


def sessions(plan, optimizer: str) -> list:
    """(request label, model) of the sessions a default Trainer builds, emitted."""
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.subgraphs import subgraph

    tr = Trainer(plan, optimizer=optimizer, device="cpu", batch_size=32, sessions=False)
    out = []
    for k, req in enumerate(tr.requests()):
        model, _, _ = subgraph(plan, req)
        out.append((f"{optimizer}:{req.name}#{k}", req.name, model))
    return out


def measure(layers: int, args) -> dict:
    import warnings

    import kfac_compiler as kc
    from bench_step import deep_mlp
    from kfac_compiler.backend import emission

    row: dict = {"layers": layers}
    model = deep_mlp(layers, args.width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        began = time.perf_counter()
        plan = kc.compile(model, loss="softmax_cross_entropy", emit=False)
        row["front end s"] = time.perf_counter() - began
        graphs = []
        for opt in args.optimizers.split(","):
            began = time.perf_counter()
            graphs += sessions(plan, opt)
            row[f"emit {opt} s"] = time.perf_counter() - began
        old = []
        if args.emitters_order:
            kept = emission.order_by_generation
            emission.order_by_generation = lambda graph: None
            try:
                plan2 = kc.compile(model, loss="softmax_cross_entropy", emit=False)
                for opt in args.optimizers.split(","):
                    old += sessions(plan2, opt)
            finally:
                emission.order_by_generation = kept
    row["sessions"] = {}
    with tempfile.TemporaryDirectory() as d:
        for k, (label, name, m) in enumerate(graphs):
            if args.only and not re.search(args.only, label):
                continue
            data, nodes = m.SerializeToString(), len(m.graph.node)
            s: dict = {"nodes": nodes, "runtime s": create_seconds(data, name, nodes)}
            if args.levels:
                for level in LEVELS:
                    s[level] = create_seconds(data, name, nodes, level)
                if nodes < args.reuse_on_below:  # quadratic: minutes beyond
                    s["ALL, reuse on"] = create_seconds(data, name, nodes, reuse=True)
            if old:
                s["emitters' order s"] = create_seconds(old[k][2].SerializeToString(), name, nodes)
            if args.split:
                path = os.path.join(d, "m.onnx")
                with open(path, "wb") as f:
                    f.write(data)
                s["split"] = split_log(path, name, nodes)
            row["sessions"][label] = s
            print(f"  {layers} layers {label}: " + ", ".join(
                f"{k2} {v:.2f}" if isinstance(v, float) else f"{k2} {v}" for k2, v in s.items() if k2 != "split")
                + (f"; split {json.dumps(s['split'])}" if "split" in s else ""), flush=True)
    return row


def slopes(rows: list[dict]) -> None:
    """log-log slope of each column against the layers, between consecutive sizes."""
    def columns(row):
        out = {k: v for k, v in row.items() if isinstance(v, float)}
        for label, s in row["sessions"].items():
            out.update({f"{label} {k}": v for k, v in s.items() if isinstance(v, float)})
            if "split" in s:
                out.update({f"{label} {k}": s["split"][k] for k in ("transformers", "planner", "total")})
        return out
    for a, b in zip(rows, rows[1:]):
        ca, cb = columns(a), columns(b)
        r = math.log(b["layers"] / a["layers"])
        print(f"slope {a['layers']} -> {b['layers']} layers: " + ", ".join(
            f"{k} {math.log(cb[k] / ca[k]) / r:.2f}" for k in ca if k in cb and ca[k] > 0 and cb[k] > 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layers", type=int, nargs="+")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--optimizers", default="kfac,adam")
    p.add_argument("--levels", action="store_true")
    p.add_argument("--emitters-order", action="store_true")
    p.add_argument("--split", action="store_true")
    p.add_argument("--reuse-on-below", type=int, default=20_000,
                   help="--levels: time ORT_ENABLE_ALL with reuse forced on for graphs of fewer nodes")
    p.add_argument("--only", help="time only the sessions whose label (e.g. kfac:kfac_step#1) matches this regex")
    p.add_argument("--out")
    args = p.parse_args()
    print("load", open("/proc/loadavg").read().strip(), time.strftime("%H:%M:%S"), flush=True)
    rows = []
    for layers in args.layers:
        row = measure(layers, args)
        print(f"{layers} layers: front end {row['front end s']:.2f} s, "
              + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.startswith("emit")), flush=True)
        rows.append(row)
        print("load", open("/proc/loadavg").read().strip(), time.strftime("%H:%M:%S"), flush=True)
    slopes(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
