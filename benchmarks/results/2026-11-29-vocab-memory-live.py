"""Which logits-sized values a training step holds at its peak, for 2026-11-29-vocab-memory.md.

    python benchmarks/results/2026-11-29-vocab-memory-live.py PLAN OPTIMIZER [ORDER [HP=VALUE ...]]

PLAN: a plan folder (2026-11-29-tied-memory.py --compile CONFIG OUT makes one); OPTIMIZER:
"kfac" or "adam"; ORDER: ORT's execution order (DEFAULT or PRIORITY_BASED, the runtime's).
Takes the step graph the Trainer builds (batch 8), runs it once in ORT on random inputs with
profiling (hp/* inputs 1 unless given, e.g. hp/update_stats=0), and from the profile's node
order and output sizes prints the RSS growth of the run and the values of >= 40 MB alive at
the node where their sum peaks (an alias, Reshape / Unsqueeze, is listed with its source).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

BATCH, V, T = 8, 50257, 32


def step_model(plan_dir: str, optimizer: str) -> onnx.ModelProto:
    """The every-step program's model as the Trainer builds it."""
    import kfac_compiler
    import kfac_compiler.runtime.program as program
    from kfac_compiler.runtime import Trainer

    models: dict[str, onnx.ModelProto] = {}
    init = program.Program.__init__

    def keep(self, model, info, *args, **kwargs):
        init(self, model, info, *args, **kwargs)
        models[self.name] = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)

    program.Program.__init__ = keep
    trainer = Trainer(kfac_compiler.load_plan(plan_dir), optimizer=optimizer, seed=0)
    xs = np.random.default_rng(0).integers(0, V, (BATCH, T + 1))
    trainer.step({"input": xs[:, :-1]}, xs[:, 1:])
    program.Program.__init__ = init
    return models[f"{optimizer}_step"]


def feeds(model: onnx.ModelProto, hp: dict[str, float]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for vi in model.graph.input:
        dims = [d.dim_value or BATCH for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            out[vi.name] = rng.integers(0, 32, dims).astype(np.int64)
        elif vi.name.startswith("hp/"):
            out[vi.name] = np.full(dims, hp.get(vi.name, 1.0), np.float32)
        else:
            out[vi.name] = (rng.random(dims, dtype=np.float32) * 0.01 + (0.5 if "noise" in vi.name else 0)).astype(np.float32)
    return out


def rss(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def main() -> None:
    plan_dir, optimizer = sys.argv[1], sys.argv[2]
    order = sys.argv[3] if len(sys.argv) > 3 else "PRIORITY_BASED"
    hp = {k: float(v) for k, v in (a.split("=") for a in sys.argv[4:])}
    model = step_model(plan_dir, optimizer)
    work = tempfile.mkdtemp()
    so = ort.SessionOptions()
    so.execution_order = getattr(ort.ExecutionOrder, order)
    so.enable_mem_pattern = False
    so.intra_op_num_threads = 2
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(work, "profile")
    so.optimized_model_filepath = os.path.join(work, "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss("VmRSS")
    session.run(None, feeds(model, hp))
    growth = rss("VmHWM") - before
    with open(session.end_profiling()) as f:
        rows = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    nodes = {}

    def walk(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            nodes[n.name] = n
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(onnx.load(so.optimized_model_filepath).graph)
    made, size, last = {}, {}, {}
    for i, r in enumerate(rows):
        node = nodes.get(r["name"][: -len("_kernel_time")])
        if node is None:
            continue
        for name, shape in zip(node.output, r["args"].get("output_type_shape") or []):
            nbytes = int(np.prod(next(iter(shape.values())))) * 4
            if nbytes >= 40 * 2**20:
                made[name], size[name] = i, nbytes
        for name in node.input:
            last[name] = i
    outputs = {o.name for o in model.graph.output}
    spans = {t: (p, len(rows) if t in outputs else last.get(t, p)) for t, p in made.items()}
    peak, at = max((sum(size[t] for t, (p, e) in spans.items() if p <= i <= e), i) for i in range(len(rows)))
    print(f"{optimizer} step, {order}: RSS growth {growth:.0f} MB; values >= 40 MB alive at node {at} "
          f"({rows[at]['args'].get('op_name')}): {peak / 2**20:.0f} MB")
    for t, (p, e) in spans.items():
        if p <= at <= e:
            print(f"  {t}: {size[t] / 2**20:.0f} MB, made at node {p} ({rows[p]['args'].get('op_name')}), last read at {e}")


if __name__ == "__main__":
    main()
