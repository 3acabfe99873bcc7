"""ONNX Runtime session setup against the number of nodes (performance_log.md, 2026-11-29).

    python benchmarks/results/2026-11-29-ort-setup.py deep LEVEL LAYERS...   # the deep MLP's kfac_step
    python benchmarks/results/2026-11-29-ort-setup.py tree N...              # a synthetic chain + tree of Adds

LEVEL: ORT_ENABLE_ALL or ORT_DISABLE_ALL; each line gives the setup with memory reuse on and off.
"""
import sys
import time

import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, __file__.rsplit("/results/", 1)[0])


def setup_seconds(data: bytes, level, **options) -> float:
    so = ort.SessionOptions()
    so.graph_optimization_level, so.intra_op_num_threads = level, 1
    for k, v in options.items():
        setattr(so, k, v)
    t = time.perf_counter()
    ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return time.perf_counter() - t


def chain_and_tree(n: int):
    """n Relu nodes in a chain, then a balanced tree of Adds over their outputs."""
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"]) for i in range(n)]
    level, k = [f"t{i}" for i in range(n)], 0
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            nodes.append(helper.make_node("Add", [level[i], level[i + 1]], [f"s{k}"]))
            nxt.append(f"s{k}")
            k += 1
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info(level[0], TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


if sys.argv[1] == "deep":
    import kfac_compiler as kc
    from bench_step import deep_mlp
    from kfac_compiler.backend.registry import emit_subgraph

    level = getattr(ort.GraphOptimizationLevel, sys.argv[2])
    for layers in map(int, sys.argv[3:]):
        plan = kc.compile(deep_mlp(layers, 16), loss="softmax_cross_entropy", emit=False)
        model, _ = emit_subgraph(plan, "kfac_step")
        data = model.SerializeToString()
        print(f"{layers} layers ({len(model.graph.node)} nodes) {sys.argv[2]}: reuse on "
              f"{setup_seconds(data, level):.2f} s, off {setup_seconds(data, level, enable_mem_reuse=False):.2f} s")
else:
    for n in map(int, sys.argv[2:]):
        data = chain_and_tree(n).SerializeToString()
        print(f"chain + tree of {n}: {setup_seconds(data, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):.2f} s")
