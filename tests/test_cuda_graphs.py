"""Trainer(cuda_graphs=True) on the CPU: the step graphs a CUDA run captures, with their
batch's shapes fixed and their metrics bound to buffers of their own, follow the uncaptured
steps bit for bit (the capture itself needs a GPU: tests/test_cuda.py); each set of bound
buffers is one graph id, an epoch's smaller last batch reuses no id of the full ones and
reallocates nothing; and split_wide_concats gives ONNX Runtime's captured Concat (at most 32
inputs) the same value."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

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
