"""Trainer(cuda_graphs=True) on the CPU: the step graphs a CUDA run captures, with their
batch's shapes fixed and their metrics bound to buffers of their own, follow the uncaptured
steps bit for bit (the capture itself needs a GPU: tests/test_cuda.py); each set of bound
buffers is one graph id, an epoch's smaller last batch reuses no id of the full ones and
reallocates nothing; and split_wide_concats gives ONNX Runtime's captured Concat (at most 32
inputs) the same value."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_same_run_bitwise, onnx_model, train_rows, zoo_case
from kfac_compiler.runtime.capture import split_wide_concats
from kfac_compiler.runtime.state import StateStore

ROWS = (32, 32, 16, 32, 32, 16, 32, 32)  # an epoch's last batch smaller, twice
SCHEDULE = dict(cov_update_period=2, damping_adaptation_interval=3)


@pytest.mark.parametrize("optimizer,reference", [
    pytest.param("kfac", {"static_steps": True, **SCHEDULE}, marks=pytest.mark.slow), ("adam", {}), ("sgd", {})])
def test_cuda_graph_steps_follow_the_uncaptured_ones_bit_for_bit(optimizer, reference):
    plan, inputs, y = zoo_case("mlp_classifier", 80)
    ref, ref_metrics = train_rows(plan, inputs, y, ROWS, optimizer, **reference)
    knobs = {k: v for k, v in reference.items() if k != "static_steps"}
    tr, metrics = train_rows(plan, inputs, y, ROWS, optimizer, cuda_graphs=True, **knobs)
    assert_same_run_bitwise(ref, ref_metrics, tr, metrics)
    captured = [(key, p) for key, p in tr._programs.items() if getattr(p, "capture", False)]
    assert captured and all(isinstance(key, tuple) for key, _ in captured)  # every one static-shaped
    assert {dict(key[1])["targets"][0] for key, _ in captured} == {32, 16}
    for key, prog in captured:
        # a graph per parity of the state buffers a session binds, whatever batches came between
        # (the full batch's buffers are kept while the smaller one runs): never one per step
        assert 1 <= len(prog._graph_ids) <= 2, (key, len(prog._graph_ids))


def test_a_smaller_batch_between_full_ones_reallocates_nothing():
    store = StateStore("cpu")
    full = store.write_data("x", np.ones((32, 4), np.float32))
    ptr = full.data_ptr()
    small = store.write_data("x", np.ones((16, 4), np.float32))
    again = store.write_data("x", np.full((32, 4), 2.0, np.float32))
    assert again is full and again.data_ptr() == ptr and small is not full
    assert store.write_data("x", np.ones((16, 4), np.float32)) is small
    np.testing.assert_array_equal(store.data("x").numpy(), np.ones((16, 4)))


@pytest.mark.parametrize("count,limit", [(7, 2), (70, 32), (33, 32), (32, 32)])
def test_wide_concats_become_a_tree_of_the_same_value(count, limit):
    rows = sum(i % 3 + 1 for i in range(count))
    node = helper.make_node("Concat", [f"x{i}" for i in range(count)], ["y"], axis=0, name="cat")
    model = onnx_model([node], {f"x{i}": [i % 3 + 1, 2] for i in range(count)}, {}, out_shape=[rows, 2])
    split = split_wide_concats(model, limit)
    if count <= limit:
        assert split is model
        return
    assert max(len(n.input) for n in split.graph.node) <= limit
    assert len(split.graph.node) > 1 and split.graph.output[0].name == "y"
    rng = np.random.default_rng(0)
    feed = {f"x{i}": rng.standard_normal((i % 3 + 1, 2)).astype(np.float32) for i in range(count)}
    want = np.concatenate([feed[f"x{i}"] for i in range(count)])
    (got,) = ort.InferenceSession(split.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "kfac"])
def test_train_cuda_graphs_and_its_resume_give_the_run_without_it(tmp_path, capsys, optimizer):
    """`kfac-compiler train --cuda-graphs` (on the CPU: the static graphs, uncaptured) writes
    the metrics of the run without it, and resumes from a checkpoint of either."""
    from kfac_compiler.cli import main

    common = ["mlp_classifier", "--optimizer", optimizer, "--batch-size", "64", "-q"]
    for name, extra in (("plain", []), ("graphs", ["--cuda-graphs"])):
        assert main(["train", *common, "--steps", "6", "--metrics", str(tmp_path / f"{name}.csv"), *extra]) == 0
    assert main(["train", *common, "--steps", "3", "--checkpoint", str(tmp_path / "ck")]) == 0
    assert main(["train", *common, "--steps", "6", "--resume", str(tmp_path / "ck"), "--cuda-graphs",
                 "--metrics", str(tmp_path / "resumed.csv")]) == 0
    capsys.readouterr()
    plain, graphs, resumed = ((tmp_path / f"{n}.csv").read_text().splitlines() for n in ("plain", "graphs", "resumed"))

    def losses(rows):
        col = rows[0].split(",").index("loss")
        return [row.split(",")[col] for row in rows[1:]]

    assert losses(graphs) == losses(plain)
    assert losses(resumed) == losses(plain)[3:]


def _chunked_sum_model() -> onnx.ModelProto:
    """y = the column sums of x [N, 4], in a Loop over chunks of 2 rows whose trip count
    ceil(N / 2) the graph computes from x's shape (as the tied statistics' loop does)."""
    def const(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value)))

    body = helper.make_graph(
        [const("chunk", np.asarray([2], np.int64)), const("zero_axis", np.asarray([0], np.int64)),
         helper.make_node("Unsqueeze", ["i", "zero_axis"], ["i1"]),
         helper.make_node("Mul", ["i1", "chunk"], ["start"]), helper.make_node("Add", ["start", "chunk"], ["end"]),
         helper.make_node("Slice", ["x", "start", "end", "zero_axis"], ["rows"]),
         helper.make_node("ReduceSum", ["rows", "zero_axis"], ["part"], keepdims=0),
         helper.make_node("Add", ["acc", "part"], ["acc_out"]),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("acc", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [4])])
    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["shape"], end=1), const("one", np.asarray([1], np.int64)),
         const("two", np.asarray([2], np.int64)), const("scalar", np.asarray([], np.int64)),
         const("zeros", np.zeros(4, np.float32)),
         helper.make_node("Add", ["shape", "one"], ["n1"]), helper.make_node("Div", ["n1", "two"], ["trips1"]),
         helper.make_node("Reshape", ["trips1", "scalar"], ["trips"]),
         helper.make_node("Loop", ["trips", "", "zeros"], ["y"], name="chunks", body=body)],
        "chunked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("rows", [7, 8, 1])
def test_a_loop_over_a_static_batch_unrolls_to_the_same_value(rows):
    from kfac_compiler.runtime.capture import capture_blockers, unroll_static_loops
    from kfac_compiler.runtime.static_shapes import with_static_dims

    model = _chunked_sum_model()
    assert unroll_static_loops(model) is model  # N unknown: the trip count is too
    static = with_static_dims(model, {"x": (rows, 4)})
    unrolled = unroll_static_loops(static)
    assert [n.op_type for n in unrolled.graph.node].count("Loop") == 0
    assert [n.name for n in unrolled.graph.node].count("chunks/unroll0/i") == 1
    assert capture_blockers(unrolled) == [] and capture_blockers(static) != []
    x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for m in (static, unrolled)]
    np.testing.assert_array_equal(runs[1], runs[0])
    np.testing.assert_allclose(runs[1], x.sum(axis=0), rtol=1e-6)


@pytest.mark.slow
def test_the_tied_embedding_s_statistics_loop_unrolls_for_capture_bit_for_bit():
    """The transformer block's tied `diagonal` block computes its statistics in a Loop over
    chunks of the batch (blocks/tied.py), which no CUDA graph captures: with cuda_graphs its
    statistics kind runs unrolled, the static_steps trajectory bit for bit, and nothing in
    that graph blocks capture any more."""
    from kfac_compiler.runtime.capture import capture_blockers, unroll_static_loops
    from kfac_compiler.runtime.static_shapes import with_static_dims
    from kfac_compiler.runtime.subgraphs import subgraph

    plan, inputs, y = zoo_case("transformer_block", 96)
    rows = (32,) * 5
    ref, ref_metrics = train_rows(plan, inputs, y, rows, static_steps=True, **SCHEDULE)
    tr, metrics = train_rows(plan, inputs, y, rows, cuda_graphs=True, **SCHEDULE)
    assert_same_run_bitwise(ref, ref_metrics, tr, metrics)
    (key,) = [k for k, p in tr._programs.items() if isinstance(k, tuple) and k[0].options.with_stats]
    static = with_static_dims(subgraph(plan, key[0])[0], dict(key[1]))
    assert any("control flow" in line for line in capture_blockers(static))
    assert capture_blockers(unroll_static_loops(static)) == []
