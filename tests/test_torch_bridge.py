"""The torch bridge (kfac_compiler.torch): export with a parameter manifest, the compiler's
trainable set equal to the module's parameters, and trained values loaded back into the module
so that torch's own forward (the independent truth) equals ONNX Runtime on the trained export."""
from __future__ import annotations

import copy
import io
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch (optional extra `torch`)")
pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

import kfac_compiler  # noqa: E402
from kfac_compiler import torch as kt  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

pytestmark = pytest.mark.slow  # torch exports and third-party models: CI runs these (`pytest` without -m)

N = 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class CNN(nn.Module):
    """Conv + BatchNorm (training mode: batch statistics, running statistics updated)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class GroupNormNet(nn.Module):
    """GroupNorm(1, C): exported as an InstanceNormalization over one group with a folded
    one-element scale and bias, then the module's per-channel affine."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.fc = nn.Conv2d(3, 4, 3), nn.GroupNorm(1, 4), nn.Linear(4 * 4 * 4, 5)
        with torch.no_grad():
            self.gn.weight.add_(0.1 * torch.randn(4))
            self.gn.bias.add_(0.1 * torch.randn(4))

    def forward(self, x):
        return self.fc(torch.relu(self.gn(self.conv(x))).flatten(1))


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.emb, self.ln = nn.Embedding(vocab, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.ln(self.emb(x)))


class RNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.fc(h[:, -1])


class GPTBlock(nn.Module):
    """Token embedding + a registered sinusoidal position buffer and rotary cos/sin buffers
    (the constants rule would train them), one pre-LN causal attention block, a one-element
    learnt temperature (the rule would freeze it as a lifted literal), a head."""

    def __init__(self, vocab=13, d=8, t=6):
        super().__init__()
        self.emb, self.ln1, self.ln2 = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, vocab)
        self.temperature = nn.Parameter(torch.tensor(0.7))
        pos = torch.arange(t)[:, None] / torch.pow(100.0, torch.arange(d)[None] / d)
        self.register_buffer("pos", torch.where(torch.arange(d)[None] % 2 == 0, torch.sin(pos), torch.cos(pos)))
        self.register_buffer("mask", torch.triu(torch.full((t, t), -1e4), 1))
        angle = torch.arange(t)[:, None] * torch.pow(10.0, -torch.arange(d // 2)[None] / (d // 2))
        self.register_buffer("cos", torch.cos(angle))
        self.register_buffer("sin", torch.sin(angle))

    def rotate(self, z):
        a, b = z[..., 0::2], z[..., 1::2]
        return torch.cat([a * self.cos - b * self.sin, a * self.sin + b * self.cos], -1)

    def forward(self, x):
        h = self.emb(x) + self.pos
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        q, k = self.rotate(q), self.rotate(k)
        att = torch.softmax(q @ k.transpose(1, 2) * (self.temperature / math.sqrt(q.shape[-1])) + self.mask, -1)
        h = h + self.proj(att @ v)
        return self.head(self.ln2(h))


def _data(family, rng, n=N):
    if family == "mlp":
        return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 5, n)
    if family in ("cnn", "groupnorm"):
        return rng.standard_normal((n, 3, 6, 6)).astype(np.float32), rng.integers(0, 5, n)
    if family == "tied":
        return rng.integers(0, 11, (n, 5)), rng.integers(0, 11, (n, 5))
    if family == "lstm":
        return rng.standard_normal((n, 7, 4)).astype(np.float32), rng.integers(0, 3, n)
    return rng.integers(0, 13, (n, 6)), rng.integers(0, 13, (n, 6))


FAMILIES = {"mlp": MLP, "cnn": CNN, "groupnorm": GroupNormNet, "tied": TiedLM, "lstm": RNN, "gpt": GPTBlock}


def _round_trip(family, exporter, tmp_path, optimizer="sgd", steps=3):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    module = FAMILIES[family]()
    module.eval()
    if family == "cnn":
        module.bn.train()
    x, y = _data(family, rng)
    path = tmp_path / f"{family}-{exporter}.onnx"
    if exporter == FOLDED:
        _export_folded(module, x, path)
    else:
        kt.export(module, (x,), path, exporter=exporter)
    manifest = kt.read_manifest(path)
    plan = kfac_compiler.compile(str(path), loss="softmax_cross_entropy", output="logits", emit=False)
    trained_torch = {p for names in kt.plan_parameters(plan).values() for p in names}
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    kw = {"learning_rate": 0.1} if optimizer == "sgd" else {}
    trainer = Trainer(plan, optimizer=optimizer, **kw)
    for _ in range(steps):
        trainer.step({"input": x}, y)
    trained = tmp_path / "trained.onnx"
    trainer.export(trained)
    written = kt.load_trained(module, str(trained))
    sess = ort.InferenceSession(str(trained), providers=["CPUExecutionProvider"])
    x2, _ = _data(family, np.random.default_rng(1), n=5)  # another batch size: the batch axis is dynamic
    onnx_out = sess.run([plan.output], {"input": x2})[0]
    with torch.no_grad():
        torch_out = copy.deepcopy(module)(torch.from_numpy(x2)).numpy()  # a copy: BatchNorm's statistics stay
    return dict(module=module, manifest=manifest, plan=plan, trained_torch=trained_torch, before=before,
                written=written, err=float(np.abs(onnx_out - torch_out).max()), trainer=trainer, trained=trained,
                path=path)


# the TorchScript exporter with constant folding on and its merge of equal initializers (not
# what kt.export does): folded transposes, packed recurrent weights in ONNX gate order and
# merged LayerNorm gains, mapped by value (copies, blocks, merged)
FOLDED = "torchscript-folded"


def _export_folded(module, x, path):
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(x),), buf, dynamo=False, input_names=["input"],
                          output_names=["logits"], opset_version=17, dynamic_axes={"input": {0: "N"}},
                          do_constant_folding=True, training=torch.onnx.TrainingMode.PRESERVE)
    model = onnx.load_from_string(buf.getvalue())
    kt.set_manifest(model, kt.build_manifest(module, model, FOLDED))
    onnx.save(model, str(path))


CASES = [(f, e) for f in FAMILIES for e in (*kt.EXPORTERS, FOLDED)]


@pytest.mark.parametrize("family,exporter", [(f, e) for f in FAMILIES for e in kt.EXPORTERS])
def test_the_export_runs_as_the_module(family, exporter, tmp_path):
    """The exported file itself (before any compiling) computes the module's forward in ONNX
    Runtime: training-mode BatchNorm with its three outputs, at another batch size. ONNX
    Runtime's graph optimizations are off: they share equal initializers (a fresh BatchNorm's
    weight and running variance, all ones; its bias and running mean, all zeros), and its
    training-mode BatchNormalization then computes with the statistics it updates (0.09 off
    here with them on; docs/torch.md)."""
    torch.manual_seed(0)
    module = FAMILIES[family]().eval()
    if family == "cnn":
        module.bn.train()
    x, _ = _data(family, np.random.default_rng(0))
    kt.export(module, (x,), tmp_path / "m.onnx", exporter=exporter)
    x2, _ = _data(family, np.random.default_rng(1), n=5)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"]).run(
        ["logits"], {"input": x2})[0]
    with torch.no_grad():
        want = copy.deepcopy(module)(torch.from_numpy(x2)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family,exporter", CASES)
def test_round_trip(family, exporter, tmp_path):
    r = _round_trip(family, exporter, tmp_path)
    module = r["module"]
    params = dict(module.named_parameters())
    # exactly the module's parameters train
    # (a folding export can fold a parameter into a constant: GPTBlock's temperature / sqrt(d))
    unmapped = set(r["manifest"]["unmapped"])
    assert not unmapped or exporter == FOLDED
    assert r["trained_torch"] == set(params) - unmapped, (r["trained_torch"] ^ set(params), r["plan"].frozen_reasons)
    if exporter != FOLDED:  # one initializer per parameter: the exporter merged none
        mapped = [p for names in kt.plan_parameters(r["plan"]).values() for p in names]
        assert sorted(mapped) == sorted(params)
    # training changed them and they were written back
    assert set(r["written"]) >= set(params) - unmapped
    changed = [n for n in params if not torch.equal(params[n].detach(), r["before"][n])]
    assert changed, "no parameter changed in training"
    # torch's forward equals ONNX Runtime on the trained export
    assert r["err"] < 1e-4, r["err"]
    # which is the exported file's own graph (Trainer.export's default): its nodes and initializers
    source, trained = onnx.load(r["path"]).graph, onnx.load(r["trained"]).graph
    assert [(n.name, n.op_type) for n in trained.node] == [(n.name, n.op_type) for n in source.node]
    assert [i.name for i in trained.initializer] == [i.name for i in source.initializer]
    # buffers other than BatchNorm's running statistics are not trained
    state = module.state_dict()
    for name, _ in module.named_buffers():
        if not name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.equal(state[name], r["before"][name]), name
            assert any(reason.startswith(f"torch buffer {name}") for reason in r["plan"].frozen_reasons.values())


def test_batchnorm_running_statistics_are_loaded(tmp_path):
    r = _round_trip("cnn", "dynamo", tmp_path)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(r["trained"])).graph.initializer}
    holder = {e["torch"]: i for i, e in r["manifest"]["initializers"].items() if e["role"] == "buffer"}
    for stat in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_array_equal(r["module"].state_dict()[stat].numpy(), inits[holder[stat]])
        assert not torch.equal(r["module"].state_dict()[stat], r["before"][stat]), stat


@pytest.mark.parametrize("exporter", kt.EXPORTERS)
def test_running_statistics_after_one_step_are_torchs(exporter, tmp_path):
    """One training step updates BatchNorm's running statistics from the step's batch (before
    the update): torch's own training-mode forward on that batch is the truth. The mean is
    torch's; the variance is ONNX's biased batch variance where torch keeps the unbiased one
    (a known difference, docs/torch.md): equal once Bessel's correction is taken out."""
    torch.manual_seed(0)
    m = CNN().eval()
    m.bn.train()
    x, y = _data("cnn", np.random.default_rng(0))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    kt.export(m, (x,), tmp_path / "c.onnx", exporter=exporter)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items()), "export changed the module"
    ref = copy.deepcopy(m)
    with torch.no_grad():
        h = ref.conv(torch.from_numpy(x))
        ref.bn(h)
    plan = kfac_compiler.compile(str(tmp_path / "c.onnx"), loss="softmax_cross_entropy", output="logits", emit=False)
    trainer = Trainer(plan, optimizer="sgd", learning_rate=0.1)
    trainer.step({"input": x}, y)
    kt.load_trained(m, trainer)
    got, want = m.state_dict(), ref.state_dict()
    np.testing.assert_allclose(got["bn.running_mean"].numpy(), want["bn.running_mean"].numpy(), atol=1e-6)
    n = h.numel() // h.shape[1]
    bessel = 0.1 * h.var(dim=(0, 2, 3), unbiased=True) / n  # momentum * (unbiased - biased variance)
    np.testing.assert_allclose(got["bn.running_var"].numpy(), (want["bn.running_var"] - bessel).numpy(), atol=1e-6)


def test_manifest_records_ties_buffers_and_the_learnt_scalar(tmp_path):
    torch.manual_seed(0)
    m = GPTBlock().eval()
    x, _ = _data("gpt", np.random.default_rng(0))
    model = kt.export(m, (x,), tmp_path / "gpt.onnx")
    man = kt.read_manifest(model)
    roles = {e.get("torch"): e["role"] for e in man["initializers"].values() if "torch" in e}
    assert roles["temperature"] == "parameter"
    assert all(roles[b] == "buffer" for b in ("pos", "mask", "cos", "sin"))
    plan = kfac_compiler.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    by_torch = {e["torch"]: i for i, e in man["initializers"].items() if "torch" in e and "copy_of" not in e}
    assert by_torch["temperature"] in plan.trainable
    assert all(by_torch[b] in plan.frozen for b in ("pos", "cos", "sin"))
    # without the manifest the constants rule decides: the position table trains, the rotary
    # cos/sin tables are constants (rule 6: cos^2 + sin^2 = 1), the temperature is frozen
    del model.metadata_props[:]
    rule = kfac_compiler.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    assert by_torch["pos"] in rule.trainable and by_torch["temperature"] in rule.frozen
    assert all(by_torch[b] in rule.frozen for b in ("cos", "sin"))


def test_lstm_weights_get_structured_blocks(tmp_path):
    """kt.export (torch.export without its optimizer) writes the LSTM's W, R and B as Slice +
    Concat of torch's own tensors at run time; the front end folds them (passes/fold_params.py),
    so the weights are fully connected layers holding exactly torch's LSTM parameters: the
    input weight one use over all 7 steps' rows (kron), the recurrent one a use per step
    (test_round_trip[lstm-dynamo] checks the trained values written back in torch's order)."""
    torch.manual_seed(0)
    x, _ = _data("lstm", np.random.default_rng(0))
    model = kt.export(RNN().eval(), (x,), tmp_path / "rnn.onnx")
    plan = kfac_compiler.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    torch_names = kt.plan_parameters(plan)
    blocks = {t: (layer.kind, layer.approximation, layer.num_uses) for layer in plan.layers for p in layer.params
              for t in torch_names[p]}
    assert blocks == {"lstm.weight_ih_l0": ("fully_connected", "kron", 1),
                      "lstm.bias_ih_l0": ("fully_connected", "kron", 1),
                      "lstm.weight_hh_l0": ("fully_connected", "kron_indep", 7),
                      "lstm.bias_hh_l0": ("fully_connected", "kron_indep", 7),
                      "fc.weight": ("fully_connected", "kron", 1), "fc.bias": ("fully_connected", "kron", 1)}


def test_tied_module_is_one_parameter(tmp_path):
    torch.manual_seed(0)
    m = TiedLM().eval()
    x, _ = _data("tied", np.random.default_rng(0))
    man = kt.build_manifest(m, kt.export(m, (x,), tmp_path / "t.onnx", exporter="torchscript"))
    assert man["ties"] == {"head.weight": "emb.weight"}


def test_selectors_apply_on_top_of_the_manifest(tmp_path):
    torch.manual_seed(0)
    m = MLP().eval()
    x, _ = _data("mlp", np.random.default_rng(0))
    model = kt.export(m, (x,), tmp_path / "m.onnx")
    plan = kfac_compiler.compile(model, loss="softmax_cross_entropy", output="logits", emit=False,
                                 exclude=["fc1\\..*"])
    assert set(plan.trainable) == {"fc2.weight", "fc2.bias"}
    assert plan.frozen_reasons["fc1.weight"].startswith("excluded by config")


@pytest.mark.parametrize("exporter", kt.EXPORTERS)
def test_parameters_torch_does_not_train_are_frozen(exporter, tmp_path):
    """A parameter with requires_grad=False (fc1, frozen as torch users freeze a layer) is
    frozen by the manifest, with the reason; after SGD steps load_trained writes the trained
    fc2 back and leaves fc1 as it was, as torch's optimizers would (it was trained before)."""
    torch.manual_seed(0)
    m = MLP().eval()
    m.fc1.requires_grad_(False)
    x, y = _data("mlp", np.random.default_rng(0))
    model = kt.export(m, (x,), tmp_path / "m.onnx", exporter=exporter)
    plan = kfac_compiler.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    assert set(plan.trainable) == {"fc2.weight", "fc2.bias"}
    assert plan.frozen_reasons["fc1.weight"] == "torch parameter fc1.weight has requires_grad=False"
    before = {k: v.clone() for k, v in m.state_dict().items()}
    trainer = Trainer(plan, optimizer="sgd", learning_rate=0.5, seed=0)
    for _ in range(3):
        trainer.step({"input": x}, y)
    written = kt.load_trained(m, trainer)
    assert sorted(written) == ["fc2.bias", "fc2.weight"]
    assert torch.equal(m.fc1.weight, before["fc1.weight"]) and torch.equal(m.fc1.bias, before["fc1.bias"])
    assert not torch.equal(m.fc2.weight, before["fc2.weight"])
    np.testing.assert_array_equal(m.fc2.weight.detach().numpy(), trainer.parameters()["fc2.weight"])


def test_a_cumulative_batchnorm_in_training_mode_is_refused(tmp_path):
    """BatchNorm(momentum=None) averages every batch's statistics (1/num_batches_tracked), which
    ONNX's BatchNormalization (a fixed momentum) cannot express: the TorchScript exporter wrote
    momentum 0.5 and the running mean came back 0.05 off torch's. Refused in training mode, in
    one line naming the module; in eval mode (constant running statistics) it exports."""
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 3)).train()
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for exporter in kt.EXPORTERS:
        with pytest.raises(kt.BridgeError, match="BatchNorm '1' has momentum=None"):
            kt.export(net, (x,), tmp_path / f"bn-{exporter}.onnx", exporter=exporter)
    kt.export(net.eval(), (x,), tmp_path / "bn-eval.onnx", exporter="torchscript")


class TwoHeads(nn.Module):
    """A classifier with an auxiliary regression head, and a LayerNorm of an untaken branch
    whose values equal the used one's (fresh LayerNorms are all ones and zeros)."""

    def __init__(self):
        super().__init__()
        self.body, self.ln, self.ln_aux = nn.Linear(6, 16), nn.LayerNorm(16), nn.LayerNorm(16)
        self.cls, self.reg = nn.Linear(16, 5), nn.Linear(16, 2)

    def forward(self, x):
        h = self.ln(torch.tanh(self.body(x)))
        return self.cls(h), self.reg(h)


@pytest.mark.parametrize("exporter", kt.EXPORTERS)
def test_parameters_outside_the_compiled_output_are_named_and_left(exporter, tmp_path):
    """Compiled for `logits` alone, the regression head is not trained and the unused
    LayerNorm is in no initializer: the plan's notes name both (coverage had read 100% of the
    parameters that were left), and load_trained from the Trainer writes the trained ones and
    leaves these as the module has them. It had refused the round trip (no trained value for
    reg.*), and the manifest had called ln_aux 'merged' into ln, writing ln's trained values
    into it."""
    torch.manual_seed(0)
    m = TwoHeads().eval()
    x, y = _data("mlp", np.random.default_rng(0))
    model = kt.export(m, (x,), tmp_path / "m.onnx", exporter=exporter)
    assert sorted(kt.read_manifest(model)["unmapped"]) == ["ln_aux.bias", "ln_aux.weight"]
    plan = kfac_compiler.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    notes = " ".join(plan.notes)
    assert "torch parameters reg.bias, reg.weight (2) are not on the path to output 'logits'" in notes
    assert "torch parameters ln_aux.weight, ln_aux.bias (2) are in no initializer of the export" in notes
    before = {k: v.clone() for k, v in m.state_dict().items()}
    trainer = Trainer(plan, optimizer="sgd", learning_rate=0.5, seed=0)
    for _ in range(3):
        trainer.step({"input": x}, y)
    written = kt.load_trained(m, trainer)
    assert sorted(written) == ["body.bias", "body.weight", "cls.bias", "cls.weight", "ln.bias", "ln.weight"]
    for k in ("reg.weight", "reg.bias", "ln_aux.weight", "ln_aux.bias"):
        assert torch.equal(m.state_dict()[k], before[k]), k
    np.testing.assert_array_equal(m.ln.weight.detach().numpy(), trainer.parameters()["ln.weight"])
    assert not torch.equal(m.ln.weight, before["ln.weight"])


def test_embedding_options_onnx_cannot_carry_are_refused_or_warned(tmp_path):
    """max_norm (the export's forward renormalized the module's weight in place; TorchScript
    then dropped the option: torch and the trained file 8.7 apart) and scale_grad_by_freq
    (gradients 4.7-6.3 relative off torch's) are refused before anything runs, the module
    untouched; padding_idx, whose row torch keeps at a zero gradient and the Gather does not,
    is a warning naming the module and row. A TorchScript exporter's own failure is one
    BridgeError line, as the dynamo exporter's."""
    x = np.array([[0, 1, 2], [3, 1, 0]], np.int64)
    for option in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Embedding(5, 4, **option), nn.Flatten(), nn.Linear(12, 3))
        before = net[0].weight.detach().clone()
        for exporter in kt.EXPORTERS:
            with pytest.raises(kt.BridgeError, match=f"Embedding '0' has {next(iter(option))}=.*export it without"):
                kt.export(net, (x,), tmp_path / "e.onnx", exporter=exporter)
        assert torch.equal(net[0].weight, before) and not (tmp_path / "e.onnx").exists()
    net = nn.Sequential(nn.Embedding(5, 4, padding_idx=1), nn.Flatten(), nn.Linear(12, 3))
    with pytest.warns(UserWarning, match=r"Embedding padding_idx: 0 \(row 1\): torch keeps that row's gradient 0"):
        kt.export(net, (x,), tmp_path / "p.onnx")
    pool = nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d((3, 3)))  # 4x4 to 3x3: no TorchScript symbolic
    with pytest.raises(kt.BridgeError, match=r"^the torchscript exporter failed: \w+: .*adaptive_avg_pool2d") as e:
        kt.export(pool, (np.zeros((2, 1, 6, 6), np.float32),), tmp_path / "a.onnx", exporter="torchscript")
    assert "\n" not in str(e.value)


def test_an_rnn_zero_state_made_by_expand_is_placed_on_its_batch_axis(tmp_path):
    """torch.export writes nn.RNN's zero initial state as an Expand of zeros to [1, N, H]: the
    recurrent weight's first use read rows whose example axis the layout rules could not
    place (no data input), and its diagonal block failed at run time (a Concat of 5 and 1
    rows). The state's batch axis is where its inferred shape holds the inputs' batch symbol
    now; the diagonal is 1/N sum_n g_n^2 of torch's per-example gradients (empirical mode)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = nn.RNN(2, 3, batch_first=True), nn.Linear(3, 4)

        def forward(self, x):
            return self.fc(self.rnn(x)[0][:, -1])

    net = Net().eval()
    x = np.random.default_rng(0).normal(size=(5, 3, 2)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 4, 5)
    kt.export(net, (x,), tmp_path / "rnn.onnx", exporter="dynamo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kfac_compiler.compile(str(tmp_path / "rnn.onnx"), loss="softmax_cross_entropy", output="logits",
                                     emit=False, layers={"rnn.weight_hh_l0": "diagonal"})
    layer = next(l for l in plan.layers if l.name == "rnn.weight_hh_l0")
    assert layer.approximation == "diagonal" and all(o is not None for _, o in layer.attrs["example_axes"])
    from kfac_compiler.runtime import Curvature

    got = Curvature(plan).estimate({"input": x}, y, mode="empirical")[layer.name]["diag"]
    per_example = []
    for n in range(5):
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x[n:n + 1])), torch.tensor(y[n:n + 1])).backward()
        per_example.append(torch.cat([net.rnn.weight_hh_l0.grad, net.rnn.bias_hh_l0.grad[:, None]], 1).double())
    want = (sum(g ** 2 for g in per_example) / 5).numpy()
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("family", ["lstm", "tied"])
def test_load_from_a_trainer_or_its_arrays(family, tmp_path):
    """The same values land in the module from the Trainer, its trained file and a dict of its
    arrays with the exported file's manifest (recurrent pieces folded back need the model: a
    dict of the canonical parameters maps where the names are the export's)."""
    r = _round_trip(family, FOLDED if family == "lstm" else "dynamo", tmp_path, steps=2)
    from_file = {k: v.clone() for k, v in r["module"].state_dict().items()}
    other = FAMILIES[family]()
    kt.load_trained(other, r["trainer"])
    for k, v in other.state_dict().items():
        assert torch.equal(v, from_file[k]), k
    if family == "tied":
        third = FAMILIES[family]()
        kt.load_trained(third, r["trainer"].parameters(), manifest=tmp_path / f"{family}-dynamo.onnx")
        for k, v in third.state_dict().items():
            assert torch.equal(v, from_file[k]), k


def test_loading_a_parameters_dict_says_the_running_statistics_stay(tmp_path):
    """Trainer.parameters() holds no running statistics: loaded from it with the file's
    manifest, a training-mode BatchNorm keeps its own and load_trained says so (one warning
    naming them); from the Trainer it writes them, without a warning."""
    r = _round_trip("cnn", "dynamo", tmp_path, steps=2)
    fresh = FAMILIES["cnn"]()
    fresh.eval()
    fresh.bn.train()
    with pytest.warns(UserWarning, match="no value for the running statistics bn.running_mean, bn.running_var"):
        kt.load_trained(fresh, r["trainer"].parameters(), manifest=r["path"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kt.load_trained(fresh, r["trainer"])
    assert torch.equal(fresh.bn.running_mean, r["module"].bn.running_mean)


def test_load_errors_name_what_cannot_be_mapped(tmp_path):
    torch.manual_seed(0)
    m = MLP().eval()
    x, _ = _data("mlp", np.random.default_rng(0))
    kt.export(m, (x,), tmp_path / "m.onnx")
    with pytest.raises(kt.BridgeError, match="fc2.bias"):
        kt.load_trained(m, {"fc1.weight": np.zeros((16, 6), np.float32)}, manifest=tmp_path / "m.onnx")
    with pytest.raises(kt.BridgeError, match="no torch manifest"):
        kt.load_trained(m, {"nope": np.zeros(3)})


def test_importing_kfac_compiler_does_not_import_torch():
    code = "import sys, kfac_compiler, kfac_compiler.frontend; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
