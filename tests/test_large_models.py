"""Models too large for one protobuf (over 2 GiB): their external data stays on disk
(kfac_compiler/onnx_files.py: load_external, tensor_array, write_onnx).

Protobuf cannot hold a message over 2 GiB, so a ModelProto with such values inside cannot be
copied, checked or written: compiling one failed with an `EncodeError` after 27 s and 6.4 GB.
Over LAZY_EXTERNAL_BYTES (1 GiB) of external data stays in its file. The small tests lower that
threshold, so that a model of a few hundred KiB takes the same path; the values they check are
the arrays the test wrote, and the trained ones a run of the same model held in memory.
The slow test generates a 2.2 GB model (a sparse file) and runs the command line on it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler import onnx_files
from kfac_compiler.errors import ModelError, OutputError, one_line
from kfac_compiler.plan import load_plan
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.state import StateStore

V, D, CLASSES = 3000, 16, 5
RNG = np.random.default_rng(7)
EMB = (RNG.standard_normal((V, D)) * 0.5).astype(np.float32)
W = (RNG.standard_normal((D, CLASSES)) * 0.5).astype(np.float32)
IDS = RNG.integers(0, V, (96, 4))
TARGETS = RNG.integers(0, CLASSES, 96)


def external_tensor(name: str, dims: list[int], location: str, offset: int = 0) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(int(np.prod(dims)) * 4))):
        t.external_data.add(key=key, value=value)
    return t


def write_model(folder, emb_dims=(V, D), data_writer=None) -> str:
    """emb [V, D] -> Gather -> mean over 4 ids -> MatMul W: emb's values in `big.data`."""
    with open(os.path.join(folder, "big.data"), "wb") as f:
        (data_writer or (lambda f: f.write(EMB.tobytes())))(f)
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["e"]),
         helper.make_node("ReduceMean", ["e"], ["m"], axes=[1], keepdims=0),
         helper.make_node("MatMul", ["m", "W"], ["logits"])],
        "big", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        [external_tensor("emb", list(emb_dims), "big.data"), numpy_helper.from_array(W, "W")])
    path = os.path.join(folder, "big.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    return path


@pytest.fixture
def lazy(monkeypatch):
    """External data over 1 KiB stays on disk (the real threshold is 1 GiB)."""
    monkeypatch.setattr(onnx_files, "LAZY_EXTERNAL_BYTES", 1024)


def sgd_run(model, steps=3, **compile_kw):
    plan = kc.compile(model, loss="softmax_cross_entropy", **compile_kw)
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.5, batch_size=32)
    for k in range(steps):
        tr.step({"ids": IDS[32 * k:32 * (k + 1)]}, TARGETS[32 * k:32 * (k + 1)])
    return plan, tr


def test_values_stay_on_disk_and_train_as_in_memory(lazy, tmp_path):
    path = write_model(tmp_path)
    plan, tr = sgd_run(path)
    emb = next(t for t in plan.model.graph.initializer if t.name == "emb")
    assert onnx_files.on_disk(emb) and not emb.raw_data
    np.testing.assert_array_equal(plan.parameter_values()["emb"], EMB)
    onnx_files.LAZY_EXTERNAL_BYTES = 1 << 30  # the same model held in memory (monkeypatch restores it)
    _, eager = sgd_run(path)
    for name, value in eager.parameters().items():
        np.testing.assert_array_equal(tr.parameters()[name], value, err_msg=name)
    assert not np.array_equal(tr.parameters()["emb"], EMB)  # the table trained
    # predict runs its own session of the plan, whose frozen values stay on disk: as in memory
    np.testing.assert_array_equal(tr.predict({"ids": IDS[:8]}), eager.predict({"ids": IDS[:8]}))


def test_tensor_view_maps_what_tensor_array_reads(lazy, tmp_path):
    """A value left on disk is mapped (read page by page when used: the torch bridge writes a
    file's values into a module tensor by tensor), equal to what tensor_array reads; one in
    memory is the array itself."""
    m = onnx_files.load_onnx(write_model(tmp_path))
    emb, w = m.graph.initializer
    view = onnx_files.tensor_view(emb)
    assert isinstance(view, np.memmap) and view.flags.writeable  # copy-on-write: the file is never changed
    np.testing.assert_array_equal(view, onnx_files.tensor_array(emb))
    np.testing.assert_array_equal(view, EMB)
    view[0, 0] = 42.0
    np.testing.assert_array_equal(onnx_files.tensor_array(emb), EMB)
    assert not isinstance(onnx_files.tensor_view(w), np.memmap)
    np.testing.assert_array_equal(onnx_files.tensor_view(w), W)


@pytest.mark.parametrize("graph", ["auto", "plan"])
def test_export_writes_the_values_beside_the_model(lazy, tmp_path, graph):
    _, tr = sgd_run(write_model(tmp_path))
    out = tmp_path / "out" / "trained.onnx"
    out.parent.mkdir()
    tr.export(out, graph=graph)
    assert sorted(os.listdir(out.parent)) == ["trained.onnx", "trained.onnx.data"]
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    for name, value in tr.parameters().items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    logits = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"ids": IDS[:8]})[0]
    mean = tr.parameters()["emb"][IDS[:8]].mean(axis=1)
    np.testing.assert_allclose(logits, mean @ tr.parameters()["W"], rtol=1e-5, atol=1e-6)
    with pytest.raises(OutputError) as e:
        tr.exported_model(graph)
    assert "Trainer.export(path)" in one_line(e.value)


def test_export_of_a_source_with_external_data_does_not_read_what_it_replaces(monkeypatch, tmp_path):
    """A source whose external data is read in (under 1 GiB): the export does not read the
    values the trained ones replace (the table) and writes one protobuf with the trained values."""
    _, tr = sgd_run(write_model(tmp_path))
    read: list[str] = []
    load = onnx.external_data_helper.load_external_data_for_tensor
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor",
                        lambda t, folder: read.append(t.name) or load(t, folder))
    out = tmp_path / "out" / "trained.onnx"
    out.parent.mkdir()
    tr.export(out)
    assert read == [] and os.listdir(out.parent) == ["trained.onnx"]
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    for name, value in tr.parameters().items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not np.array_equal(got["emb"], EMB)


@pytest.mark.parametrize("graph", ["auto", "plan"])
def test_an_export_streams_its_large_values_into_one_valid_protobuf(tmp_path, graph):
    """Values over 1 MiB (a [600, 1024] table, 2.4 MB) are written from their arrays
    (onnx_files.write_with_values): onnx loads and checks the one file, its initializers are
    the trained values in the source's order, ONNX Runtime runs it."""
    rng = np.random.default_rng(3)
    table = (rng.standard_normal((600, 1024)) * 0.5).astype(np.float32)
    path = write_model(tmp_path, table.shape, lambda f: f.write(table.tobytes()))
    m = onnx.load(path, load_external_data=False)
    m.graph.initializer[1].CopyFrom(numpy_helper.from_array((rng.standard_normal((1024, CLASSES)) * 0.1)
                                                            .astype(np.float32), "W"))
    onnx.save(m, path)
    plan = kc.compile(path, loss="softmax_cross_entropy")
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.5, batch_size=32)
    for k in range(3):
        tr.step({"ids": IDS[32 * k:32 * (k + 1)] % 600}, TARGETS[32 * k:32 * (k + 1)])
    out = tmp_path / "out" / "trained.onnx"
    out.parent.mkdir()
    params = tr.parameters()
    from_array = numpy_helper.from_array
    with pytest.MonkeyPatch.context() as mp:  # from the state's own buffers, no copy, streamed
        mp.setattr(StateStore, "to_numpy", lambda self, slot: pytest.fail(f"{slot} copied"))
        mp.setattr(numpy_helper, "from_array", lambda a, name=None: from_array(a, name) if a.nbytes < 2 ** 20
                   else pytest.fail(f"{name} copied into a TensorProto"))
        tr.export(out, graph=graph)
    assert os.listdir(out.parent) == ["trained.onnx"]
    trained = onnx.load(out)
    onnx.checker.check_model(trained, full_check=True)
    got = {t.name: numpy_helper.to_array(t) for t in trained.graph.initializer}
    assert len(got) == len(trained.graph.initializer)  # each once
    source = onnx.load(path, load_external_data=False) if graph == "auto" else plan.model
    assert [t.name for t in trained.graph.initializer] == [t.name for t in source.graph.initializer]
    for name, value in params.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not np.array_equal(got["emb"], table)
    ids = IDS[:8] % 600
    logits = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    np.testing.assert_allclose(logits, params["emb"][ids].mean(axis=1) @ params["W"], rtol=1e-5, atol=1e-6)


def test_a_saved_plan_keeps_its_data_and_frozen_values_stay_on_disk(lazy, tmp_path):
    plan = kc.compile(write_model(tmp_path), loss="softmax_cross_entropy", exclude=["emb"])
    plan.save(tmp_path / "plan")
    files = os.listdir(tmp_path / "plan")
    assert {"model.onnx", "model.onnx.data", "plan.json"} <= set(files)
    assert [f for f in files if not f.endswith((".onnx", ".json"))] == ["model.onnx.data"]  # one copy, shared
    os.remove(tmp_path / "big.data")  # the plan needs nothing of its source's data
    loaded = load_plan(tmp_path / "plan", check_source=False)
    np.testing.assert_array_equal(onnx_files.tensor_array(
        next(t for t in loaded.model.graph.initializer if t.name == "emb")), EMB)
    np.testing.assert_array_equal(loaded.parameter_values()["W"], W)
    onnx_files.LAZY_EXTERNAL_BYTES = 1 << 30  # the same model held in memory (monkeypatch restores it)
    write_model(tmp_path)
    eager = kc.compile(tmp_path / "big.onnx", loss="softmax_cross_entropy", exclude=["emb"])
    trainers = [Trainer(p, batch_size=32) for p in (loaded, eager)]  # K-FAC
    for k in range(3):  # the loaded plan's step graphs read the frozen table from the plan's data file
        losses = [float(tr.step({"ids": IDS[32 * k:32 * (k + 1)]}, TARGETS[32 * k:32 * (k + 1)])["loss"])
                  for tr in trainers]
        assert losses[0] == losses[1]
    np.testing.assert_array_equal(trainers[0].parameters()["W"], trainers[1].parameters()["W"])
    assert not np.array_equal(trainers[0].parameters()["W"], W)


def test_external_data_shorter_than_its_dims_is_one_line(lazy, tmp_path):
    path = write_model(tmp_path, emb_dims=(V + 10, D))
    with pytest.raises(ModelError) as e:
        kc.compile(path, loss="softmax_cross_entropy")
    msg = one_line(e.value)
    assert "'emb'" in msg and f"{(V + 10) * D * 4} bytes" in msg and "big.data" in msg


@pytest.mark.slow
def test_a_model_over_2_gib_compiles_trains_and_exports_from_the_command_line(tmp_path):
    """2.2 GB: a [540000, 1024] table (a sparse file: the rows the ids use written, the rest
    zeros) frozen, a head trained; then compiled with the table trainable. Training the table
    itself needs about 7x its size (15.6 GB with SGD without momentum: parameters
    double-buffered, the velocity slot, the step's transients): more than CI has."""
    rows, width, used = 540_000, 1024, 1000
    rng = np.random.default_rng(0)

    def sparse(f):
        f.write((rng.standard_normal((used, width)) * 0.5).astype(np.float32).tobytes())
        f.truncate(rows * width * 4)

    path = write_model(tmp_path, (rows, width), sparse)
    head = (rng.standard_normal((width, CLASSES)) * 0.1).astype(np.float32)
    m = onnx.load(path, load_external_data=False)
    m.graph.initializer[1].CopyFrom(numpy_helper.from_array(head, "W"))
    onnx.save(m, path)
    assert os.path.getsize(tmp_path / "big.data") > 2 ** 31
    np.savez(tmp_path / "data.npz", ids=rng.integers(0, used, (256, 4)), targets=rng.integers(0, CLASSES, 256))
    cli = [sys.executable, "-m", "kfac_compiler.cli"]
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = subprocess.run([*cli, "compile", "big.onnx", "--loss", "softmax_cross_entropy", "--exclude", "emb",
                          "-q", "-o", "plan"], **run)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([*cli, "train", "plan", "--data", "data.npz", "--steps", "10", "--batch-size", "64",
                          "--save", "trained.onnx"], **run)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert os.path.getsize(tmp_path / "trained.onnx.data") == rows * width * 4
    trained = onnx.load(tmp_path / "trained.onnx", load_external_data=False)
    w = numpy_helper.to_array(next(t for t in trained.graph.initializer if t.name == "W"))
    assert not np.array_equal(w, head)
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 1, 2, 3]])
    emb = np.fromfile(tmp_path / "big.data", np.float32, count=4 * width).reshape(4, width)
    np.testing.assert_allclose(sess.run(None, {"ids": ids})[0], emb.mean(0, keepdims=True) @ w, rtol=1e-4, atol=1e-5)
    # the table trainable: compiled without reading it whole more than once (it has no peer a
    # tied copy could equal; a declared Trainer holds no values): 18 s and 2.8 GB, was 63 s and 8.8 GB
    out = subprocess.run([*cli, "compile", "big.onnx", "--loss", "softmax_cross_entropy", "-q", "-o", "plan2"], **run)
    assert out.returncode == 0, out.stderr
    assert "emb" in kc.load_plan(tmp_path / "plan2").trainable


def test_a_constant_nodes_external_value_is_read_in(lazy, tmp_path):
    """Only initializers stay on disk: a Constant node's external value (a logit offset here) is
    read into the node, so ONNX Runtime, which refuses the absolute paths of values left on disk,
    runs the graphs that hold it."""
    path = write_model(tmp_path)
    offset = np.arange(CLASSES, dtype=np.float32)
    (tmp_path / "offset.bin").write_bytes(offset.tobytes())
    m = onnx.load(path, load_external_data=False)
    m.graph.node[2].output[0] = "mm"
    value = external_tensor("offset", [CLASSES], "offset.bin")
    m.graph.node.extend([helper.make_node("Constant", [], ["c"], value=value),
                         helper.make_node("Add", ["mm", "c"], ["logits"])])
    onnx.save(m, path)
    plan = kc.compile(path, loss="softmax_cross_entropy")
    assert onnx_files.on_disk(next(t for t in plan.model.graph.initializer if t.name == "emb"))
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.5, batch_size=32)
    tr.step({"ids": IDS[:32]}, TARGETS[:32])
    out = tmp_path / "trained.onnx"
    tr.export(out, graph="plan")
    logits = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"ids": IDS[:4]})[0]
    p = tr.parameters()
    np.testing.assert_allclose(logits, p["emb"][IDS[:4]].mean(axis=1) @ p["W"] + offset, rtol=1e-5, atol=1e-5)
