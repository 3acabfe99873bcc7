"""Our gradients of torch-exported ONNX models against torch autograd (skipped without torch).

Each model is exported with torch.onnx.export (TorchScript exporter at opset 17 and, when
onnxscript is installed, the torch.export-based exporter at opset 18; dynamic batch); for a random
cotangent u of the output, gradient_model's "grad/<param>" (ORT CPU, float32) must match
the .grad of torch's parameters after (model(x) * u).sum().backward(), and jvp_model's
output must match torch.func.jvp."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")
nn = torch.nn

from kfac_compiler.oprules.check import run_ort  # noqa: E402
from kfac_compiler.passes.autodiff import gradient_model, jvp_model  # noqa: E402

pytestmark = pytest.mark.slow  # torch exports and third-party models: CI runs these (`pytest` without -m)


class _Attn(nn.Module):
    def __init__(self, vocab=11, d=8, t=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, vocab)
        self.register_buffer("mask", torch.triu(torch.full((t, t), -1e4), diagonal=1))

    def forward(self, tok):
        x = self.emb(tok)
        h = self.ln(x)
        s = self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5 + self.mask
        x = x + torch.softmax(s, dim=-1) @ self.v(h)
        return self.out(torch.nn.functional.gelu(self.fc(x)))


def _models():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 3))
    cnn = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2), nn.ELU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(6, 5),
    )
    return [
        ("mlp", mlp, torch.randn(4, 6)),
        ("cnn", cnn, torch.randn(3, 2, 8, 8)),
        ("attn", _Attn(), torch.randint(0, 11, (3, 5))),
    ]


def _export(module, example, dynamo: bool) -> onnx.ModelProto:
    buf = io.BytesIO()
    module.eval()
    if dynamo:
        pytest.importorskip("onnxscript")
        torch.onnx.export(module, (example,), buf, dynamo=True, input_names=["input"], output_names=["logits"],
                          dynamic_shapes=({0: torch.export.Dim("N")},), opset_version=18, verbose=False)
    else:
        kwargs = dict(input_names=["input"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}})
        try:
            torch.onnx.export(module, (example,), buf, dynamo=False, **kwargs)
        except TypeError:  # older torch without the dynamo switch
            torch.onnx.export(module, (example,), buf, **kwargs)
    return onnx.load_from_string(buf.getvalue())


def _param_map(model, module):
    """torch parameter -> (initializer name, transposed?): by name, else by value (Linear
    weights on 3-D inputs are exported as a transposed MatMul constant)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {}
    for name, p in module.named_parameters():
        v = p.detach().numpy()
        if name in inits:
            out[name] = (name, False)
            continue
        for iname, arr in inits.items():
            if v.ndim == 2 and arr.shape == v.T.shape and np.array_equal(arr, v.T):
                out[name] = (iname, True)
                break
    return out


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("name,module,example", _models(), ids=lambda v: v if isinstance(v, str) else "")
def test_against_torch_autograd(name, module, example, dynamo):
    _check_against_torch(name, module, _export(module, example, dynamo), example)


class _Between(nn.Module):
    """Linear -> f -> Linear: f's gradient rule sits between two parameters' paths."""

    def __init__(self, f, d_in=6, d_mid=12, d_f=4, d_out=3):
        super().__init__()
        self.f = f
        self.fc1 = nn.Linear(d_in, d_mid)
        self.fc2 = nn.Linear(d_f, d_out)

    def forward(self, x):
        return self.fc2(self.f(self.fc1(x)))


def _op_models():
    """Tiny modules whose export holds one of the ops that got rules for issue 38."""
    torch.manual_seed(1)
    return [
        ("ReduceProd", _Between(lambda h: torch.prod(h.reshape(-1, 4, 3), dim=2)), torch.randn(5, 6)),
        ("Det", _Between(lambda h: torch.linalg.det(h[:, :9].reshape(-1, 3, 3)).unsqueeze(1), d_f=1),
         torch.randn(5, 6)),
        ("Mod", _Between(lambda h: torch.fmod(h, 0.7), d_mid=4), torch.randn(5, 6)),
        ("GridSample", _Between(_grid_sample, d_mid=20), torch.randn(5, 6)),
    ]


def _grid_sample(h):
    """A [1, 3, 4] image and a 2x2 grid (partly outside [-1, 1]), both from h: the image's
    and the grid's gradients both reach fc1."""
    img = h[:, :12].reshape(-1, 1, 3, 4)
    grid = 1.2 * torch.tanh(h[:, 12:20]).reshape(-1, 2, 2, 2)
    return nn.functional.grid_sample(img, grid, align_corners=False).reshape(-1, 4)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("op,module,example", _op_models(), ids=lambda v: v if isinstance(v, str) else "")
def test_issue38_ops_against_torch_autograd(op, module, example, dynamo):
    """torch.prod, torch.linalg.det, torch.fmod and F.grid_sample export as ReduceProd, Det,
    Mod and GridSample (both exporters); the compiled gradients and jvps of the parameters
    around them are torch's."""
    model = _export(module, example, dynamo)
    found = {n.op_type for n in model.graph.node} | {n.op_type for f in model.functions for n in f.node}
    assert op in found, f"{op} not in the export: {sorted(found)}"
    _check_against_torch(op, module, model, example)


def _check_against_torch(name, module, model, example):
    tparams = dict(module.named_parameters())
    pmap = _param_map(model, module)
    assert len(pmap) == len(tparams), f"{name}: unmatched {sorted(set(tparams) - set(pmap))}"
    params = [pmap[p][0] for p in tparams]
    out = module(example)
    u = torch.randn_like(out)
    module.zero_grad()
    (out * u).sum().backward()
    gm = gradient_model(model, "logits", params)
    res = run_ort(gm, {"input": example.numpy(), "logits_grad": u.detach().numpy()})
    np.testing.assert_allclose(res["logits"], out.detach().numpy(), rtol=1e-4, atol=1e-5)
    for p, (iname, tr) in pmap.items():
        want = tparams[p].grad.numpy()
        got = res[f"grad/{iname}"]
        np.testing.assert_allclose(got.T if tr else got, want, rtol=1e-3, atol=1e-4 * (1 + np.abs(want).max()),
                                   err_msg=f"{name} {p}")
    # forward mode against torch.func.jvp
    tangents = {p: torch.randn_like(tparams[p]) for p in tparams}
    base = {k: v.detach() for k, v in tparams.items()}
    names = list(tparams)

    def f(*vals):
        return torch.func.functional_call(module, dict(zip(names, vals)), (example,))

    primals, tans = tuple(base[p] for p in names), tuple(tangents[p] for p in names)
    try:
        _, jv = torch.func.jvp(f, primals, tans)
    except NotImplementedError:  # no forward AD in torch (grid_sampler_2d): the double-vjp jvp
        _, jv = torch.autograd.functional.jvp(f, primals, tans)
    jm = jvp_model(model, "logits", params)
    feeds = {f"tangent/{pmap[p][0]}": (tangents[p].numpy().T if pmap[p][1] else tangents[p].numpy())
             for p in names}
    got = run_ort(jm, {"input": example.numpy(), **feeds})
    np.testing.assert_allclose(got["jvp/logits"], jv.detach().numpy(), rtol=1e-3,
                               atol=1e-4 * (1 + float(jv.abs().max())), err_msg=name)
