"""The torch bridge on models over 2 GiB (kfac_compiler.torch with kfac_compiler/onnx_files.py):
`export` has the exporter write external data and writes path + path.data, `load_trained`
reads a Trainer's store and maps a file's values tensor by tensor.

A real > 2 GiB module would need several times its size in memory here (the module, the
exporter's tensors, the trainer's double-buffered parameters and state), more than CI has, so
these tests lower the thresholds (onnx_files.LAZY_EXTERNAL_BYTES, which also decides when
`export` goes through external data, and LIGHT_VALUE_BYTES, the size of a value that goes to the
data file) and run the same paths on a small module. The truth: the module's own tensors, the
trainer's store, and torch's forward against ONNX Runtime on the trained file."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch (optional extra `torch`)")
pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

import kfac_compiler  # noqa: E402
from kfac_compiler import onnx_files  # noqa: E402
from kfac_compiler import torch as kt  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

pytestmark = pytest.mark.slow  # torch exports: CI runs these

RNG = np.random.default_rng(3)
X = RNG.standard_normal((96, 12)).astype(np.float32)
Y = RNG.integers(0, 5, 96)


class Net(nn.Module):
    """An MLP with a training-mode BatchNorm (running statistics the trainer updates)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2, self.fc3 = nn.Linear(12, 64), nn.BatchNorm1d(64), nn.Linear(64, 48), \
            nn.Linear(48, 5)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.bn(self.fc1(x))))))


@pytest.fixture
def lazy(monkeypatch):
    """Over 4 KiB is 'large' (the real thresholds: 1 GiB, values over 1 MiB to the data file)."""
    monkeypatch.setattr(onnx_files, "LAZY_EXTERNAL_BYTES", 4096)
    monkeypatch.setattr(onnx_files, "LIGHT_VALUE_BYTES", 1024)


def state(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items() if v.is_floating_point()}


@pytest.mark.parametrize("exporter", kt.EXPORTERS)
def test_export_writes_the_values_beside_the_file(lazy, tmp_path, exporter):
    torch.manual_seed(0)
    net = Net()
    before = state(net)
    model = kt.export(net, (X[:8],), tmp_path / "net.onnx", exporter=exporter)
    assert sorted(os.listdir(tmp_path)) == ["net.onnx", "net.onnx.data"]  # the exporter's folder is gone
    inits = {t.name: t for t in model.graph.initializer}
    assert onnx_files.on_disk(inits["fc2.weight"])  # the returned model's values stay in net.onnx.data
    weights = sum(before[f"{fc}.weight"].nbytes for fc in ("fc1", "fc2"))  # each over 1 KiB
    assert os.path.getsize(tmp_path / "net.onnx.data") >= weights
    full = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "net.onnx").graph.initializer}
    manifest = kt.read_manifest(tmp_path / "net.onnx")
    assert manifest is not None and manifest["unmapped"] == []
    by_torch = {e["torch"]: init for init, e in manifest["initializers"].items() if "torch" in e}
    assert set(by_torch) == set(before) - {"bn.num_batches_tracked"}
    for name, init in by_torch.items():
        value = full[init].T if manifest["initializers"][init].get("transposed") else full[init]
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    for name, value in state(net).items():  # the export left the module as it was
        np.testing.assert_array_equal(value, before[name], err_msg=name)


@pytest.mark.parametrize("exporter", kt.EXPORTERS)
def test_a_large_export_trains_and_loads_back(lazy, tmp_path, exporter):
    torch.manual_seed(1)
    net = Net()
    start = state(net)
    path = tmp_path / "net.onnx"
    kt.export(net, (X[:8],), path, exporter=exporter)
    plan = kfac_compiler.compile(path, loss="softmax_cross_entropy")
    inits = {t.name: t for t in plan.model.graph.initializer}
    assert onnx_files.on_disk(inits["fc1.weight"]) and onnx_files.on_disk(inits["fc2.weight"])  # not read in
    trainer = Trainer(plan, batch_size=32)  # K-FAC
    for k in range(3):
        trainer.step({"input": X[32 * k:32 * (k + 1)]}, Y[32 * k:32 * (k + 1)])
    trained = trainer.trained_values()
    names = kt.plan_parameters(plan)

    from_trainer = copy.deepcopy(net)
    written = kt.load_trained(from_trainer, trainer)
    assert {"bn.running_mean", "bn.running_var"} <= set(written)
    got = state(from_trainer)
    for init, torch_names in names.items():
        for name in torch_names:
            np.testing.assert_array_equal(got[name], trained[init], err_msg=name)
    for stat in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_array_equal(got[stat], trained[stat], err_msg=stat)
    assert not np.array_equal(got["fc2.weight"], start["fc2.weight"])  # it trained

    out = tmp_path / "out" / "trained.onnx"
    out.parent.mkdir()
    trainer.export(out)
    assert sorted(os.listdir(out.parent)) == ["trained.onnx", "trained.onnx.data"]
    values, _ = kt._source_values(str(out))
    assert isinstance(values["fc2.weight"], np.memmap)  # mapped: read as it is written into the module
    from_file = copy.deepcopy(net)
    kt.load_trained(from_file, str(out))
    for name, value in state(from_file).items():
        np.testing.assert_array_equal(value, got[name] if name in got and name != "bn.num_batches_tracked"
                                      else start[name], err_msg=name)

    opts = ort.SessionOptions()  # a training-mode BatchNorm: see docs/torch.md on ORT's sharing
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((5, 12)).astype(np.float32)
    ours = sess.run(["logits"], {"input": x})[0]
    with torch.no_grad():
        theirs = copy.deepcopy(from_file)(torch.from_numpy(x)).numpy()
    assert np.abs(ours - theirs).max() < 1e-5


def test_a_file_whose_data_lies_outside_its_folder_is_one_line(lazy, tmp_path):
    torch.manual_seed(2)
    net = Net()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    kt.export(net, (X[:8],), tmp_path / "a" / "net.onnx")
    os.replace(tmp_path / "a" / "net.onnx.data", tmp_path / "b" / "net.onnx.data")
    m = onnx.load(tmp_path / "a" / "net.onnx", load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../b/net.onnx.data"
    onnx.save(m, tmp_path / "a" / "net.onnx")
    before = state(net)
    with pytest.raises(kt.BridgeError) as e:
        kt.load_trained(net, str(tmp_path / "a" / "net.onnx"))
    msg = str(e.value)
    assert "\n" not in msg and "outside its folder" in msg and "../b/net.onnx.data" in msg
    for name, value in state(net).items():  # nothing written
        np.testing.assert_array_equal(value, before[name], err_msg=name)
