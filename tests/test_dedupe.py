"""backend/dedupe.py: duplicate nodes merged within a graph and across an If's boundary, the
results unchanged (checked against numpy), pinned tensors and random ops left alone; and no
zoo training graph left computing one thing twice."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kfac_compiler.backend.dedupe import NONDETERMINISTIC, merge_duplicates
from kfac_compiler.builder import GraphBuilder, value_info


def _model(pinned_dup: bool = False):
    """x [3, 4] -> y = relu-mask(x) * x twice (a duplicate pair) and inside an If on c the
    same mask once more, plus x^T x; outputs (y, branch result)."""
    b = GraphBuilder(17, taken={"x", "c"})
    mask = b.cast(b.op("Greater", ["x", b.const(0.0)]), TensorProto.FLOAT)
    y1 = b.mul("x", mask)
    mask2 = b.cast(b.op("Greater", ["x", b.const(0.0)]), TensorProto.FLOAT)  # the same two nodes again
    y = b.add(y1, b.mul("x", mask2))

    def then():
        m = b.cast(b.op("Greater", ["x", b.const(0.0)]), TensorProto.FLOAT)  # and once more in the branch
        return [b.matmul(b.transpose(b.mul("x", m), [1, 0]), b.mul("x", m))]

    (z,) = b.conditional("c", then, [b.const(np.zeros((4, 4)))], [[4, 4]])
    outs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, None),
            helper.make_tensor_value_info(z, TensorProto.FLOAT, None)]
    if pinned_dup:
        outs.append(helper.make_tensor_value_info(mask2, TensorProto.FLOAT, None))
    inputs = [value_info("x", TensorProto.FLOAT, [3, 4]), value_info("c", TensorProto.BOOL, [])]
    return b.make_model("dedupe", inputs, outs)


def _count(graph, op: str) -> int:
    total = 0
    for node in graph.node:
        total += node.op_type == op
        for attr in node.attribute:
            if attr.type == attr.GRAPH:
                total += _count(attr.g, op)
    return total


def _run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "c": np.array(True)})


def test_duplicates_merge_across_the_if_and_results_stay():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    model = _model()
    assert _count(model.graph, "Greater") == 3 and _count(model.graph, "Mul") == 4
    rename = merge_duplicates(model.graph)
    assert _count(model.graph, "Greater") == 1 and _count(model.graph, "Cast") == 1
    assert _count(model.graph, "Mul") == 1  # every x * mask, the branch's two included, is the first one
    assert rename
    y, z = _run(model, x)
    relu = np.maximum(x, 0)
    np.testing.assert_allclose(y, 2 * relu, rtol=1e-6)
    np.testing.assert_allclose(z, relu.T @ relu, rtol=1e-5, atol=1e-6)


def test_pinned_and_random_nodes_stay():
    model = _model(pinned_dup=True)
    out = model.graph.output[2].name
    merge_duplicates(model.graph)
    assert any(out in n.output for n in model.graph.node)  # a graph output keeps its producer
    b = GraphBuilder(17, taken={"x"})
    r1 = b.op("RandomUniformLike", ["x"])
    r2 = b.op("RandomUniformLike", ["x"])
    m = b.make_model("random", [value_info("x", TensorProto.FLOAT, [2])],
                     [helper.make_tensor_value_info(b.sub(r1, r2), TensorProto.FLOAT, None)])
    merge_duplicates(m.graph)
    assert _count(m.graph, "RandomUniformLike") == 2


def _census_plan(name: str):
    """A zoo model's plan, or a committed real export's (tests/fixtures/real)."""
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO

    if name in ZOO:
        entry = ZOO[name]
        return kc.compile(entry.build(seed=0), loss=entry.loss, output="logits", emit=False)
    path = Path(__file__).parent / "fixtures" / "real" / f"{name}.onnx"
    return kc.compile(str(path), loss="softmax_cross_entropy", output="logits", emit=False)


def _pools(second: bool):
    """x [1, 1, 5, 5] -> a 3x3 stride-2 MaxPool y without Indices, (with `second`) the same
    pool asking for them, and inside an If on c the same pool's Indices as floats."""
    b = GraphBuilder(17, taken={"x", "c"})
    pool = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    y = b.op("MaxPool", ["x"], **pool)
    outs = [y]
    if second:
        y2, idx = b.op("MaxPool", ["x"], n_out=2, **pool)
        outs = [b.add(y, y2), b.cast(idx, TensorProto.FLOAT)]
    (z,) = b.conditional("c", lambda: [b.cast(b.op("MaxPool", ["x"], n_out=2, **pool)[1], TensorProto.FLOAT)],
                         [b.const(np.zeros((1, 1, 3, 3)))], [[1, 1, 3, 3]])
    return b.make_model("pools", [value_info("x", TensorProto.FLOAT, [1, 1, 5, 5]), value_info("c", TensorProto.BOOL, [])],
                        [helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in outs + [z]])


def test_a_max_pool_asking_for_indices_extends_the_first_in_its_graph_only():
    """A MaxPool without Indices, then one on the same input with them (a gradient's), in one
    graph: one node remains, yielding both (and a branch's pool reads it), the values those
    of numpy's window maxima. With the Indices asked for only inside an If, the outer node is
    not extended (it would pay for them on every run for a branch that may not run)."""
    x = np.random.default_rng(1).standard_normal((1, 1, 5, 5)).astype(np.float32)
    padded = np.pad(x[0, 0], 1, constant_values=-np.inf)
    maxima = np.array([[padded[2 * i:2 * i + 3, 2 * j:2 * j + 3].max() for j in range(3)] for i in range(3)])

    model = _pools(second=True)
    merge_duplicates(model.graph)
    (node,) = [n for n in _all_nodes(model.graph) if n.op_type == "MaxPool"]
    assert len(node.output) == 2 and node in model.graph.node
    both, idx, branch_idx = _run(model, x)
    np.testing.assert_array_equal(both[0, 0], 2 * maxima)
    np.testing.assert_array_equal(idx, branch_idx)
    np.testing.assert_array_equal(x.reshape(-1)[idx.reshape(-1).astype(np.int64)], maxima.reshape(-1))

    model = _pools(second=False)
    merge_duplicates(model.graph)
    assert [len(n.output) for n in model.graph.node if n.op_type == "MaxPool"] == [1]
    assert _count(model.graph, "MaxPool") == 2
    y, branch_idx = _run(model, x)
    np.testing.assert_array_equal(y[0, 0], maxima)
    np.testing.assert_array_equal(x.reshape(-1)[branch_idx.reshape(-1).astype(np.int64)], maxima.reshape(-1))


@pytest.mark.parametrize("name", ["small_cnn", "transformer_block", "unrolled_rnn"])
def test_no_emitted_training_graph_runs_one_computation_twice(name):
    """Issue 40: no node runs twice for one value. After the emission (and its dedupe), no two
    nodes of a zoo model's Adam or K-FAC step apply one op with the same attributes to the same
    inputs, whatever outputs they keep (a MaxPool with Indices beside the forward's MaxPool ran
    the window maxima twice; tiled windows' jvp now reads the vjp's mask)."""
    from kfac_compiler.backend.registry import emit_subgraph

    plan = _census_plan(name)
    for kind in ("adam_step", "kfac_step"):
        model, _ = emit_subgraph(plan, kind)
        first: dict[tuple, onnx.NodeProto] = {}
        same: dict[str, str] = {}  # an output -> the first node's output it repeats
        repeats = []
        for node in model.graph.node:
            attrs = tuple(sorted((a.name, str(helper.get_attribute_value(a))) for a in node.attribute))
            key = (node.op_type, node.domain, tuple(same.get(x, x) for x in node.input), attrs)
            if key in first and node.op_type not in NONDETERMINISTIC:
                repeats.append(f"{node.name} ({node.op_type}) repeats {first[key].name}")
                same.update(zip(node.output, first[key].output))
            else:
                first[key] = node
        assert not repeats, (kind, repeats[:5])


def test_an_overlapping_max_pool_runs_once_in_the_training_graphs():
    """torchvision ResNet's 3x3 stride-2 MaxPool overlaps, so its vjp and jvp read the Indices
    the forward's node leaves out: the forward's node yields them (backend/dedupe.EXTENSIBLE)
    instead of a second MaxPool computing the same maxima, in every step graph, the K-FAC
    step's statistics branch included. Its gradients against torch's:
    tests/test_real_exports.py::test_gradients_match_torch[resnet-ts]."""
    from kfac_compiler.backend.registry import emit_subgraph

    plan = _census_plan("resnet-ts")
    for kind in ("adam_step", "sgd_step", "kfac_step", "update_statistics"):
        model, _ = emit_subgraph(plan, kind)
        pools = [n for n in _all_nodes(model.graph) if n.op_type == "MaxPool"]
        assert len(pools) == 1 and len(pools[0].output) == 2, (kind, [list(n.output) for n in pools])
        np.testing.assert_equal(_count(model.graph, "MaxPool"), 1)


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == attr.GRAPH:
                yield from _all_nodes(attr.g)
