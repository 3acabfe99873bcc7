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

from kfac_compiler.errors import UnsupportedOpError  # noqa: E402
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


def _export(module, example, dynamo: bool, opset: int = 18) -> onnx.ModelProto:
    """The module exported by TorchScript (opset 17) or dynamo (`opset`), dynamic batch."""
    buf = io.BytesIO()
    module.eval()
    if dynamo:
        pytest.importorskip("onnxscript")
        torch.onnx.export(module, (example,), buf, dynamo=True, input_names=["input"], output_names=["logits"],
                          dynamic_shapes=({0: torch.export.Dim("N")},), opset_version=opset, verbose=False)
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
    weights on 3-D inputs are exported as a transposed MatMul constant; a parameter fed
    straight to an op, as STFT's window, gets an exporter's name)."""
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
            if arr.shape == v.shape and np.array_equal(arr, v):
                out[name] = (iname, False)
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
        ("STFT", _Between(_Stft(), d_mid=16, d_f=30), torch.randn(5, 6)),
        ("DFT", _Between(_rfft, d_mid=12, d_f=14), torch.randn(5, 6)),
        ("DeformConv", _Between(_Deform(), d_mid=140, d_f=27), torch.randn(5, 6)),
        *[(f"RoiAlign-{'aligned' if al else 'unaligned'}-{'data' if data else 'const'}-rois",
           _Between(_RoiAlign(al, data), d_mid=44, d_f=8), torch.randn(5, 6))
          for al in (True, False) for data in (False, True)],
    ]


class _RoiAlign(nn.Module):
    """torchvision's roi_align (sampling_ratio 2 unless given, 2x2 bins, spatial_scale 0.8)
    of a [2, 4, 5] image from h: 4 constant boxes over images 0-4 (partly outside, one under
    a pixel), or one box per row on image 0 computed from h (data rois: torch gives them no
    gradient, and neither does the rule)."""

    def __init__(self, aligned: bool, data: bool, sampling_ratio: int = 2):
        super().__init__()
        self.aligned, self.data, self.sr = aligned, data, sampling_ratio
        self.register_buffer("rois", torch.tensor([[0, 0.3, 0.2, 4.1, 3.7], [3, -1.4, -0.8, 2.6, 2.9],
                                                   [4, 1.5, 2.0, 6.8, 5.5], [1, 2.2, 1.1, 2.6, 1.5]]))

    def forward(self, h):
        import torchvision

        img = h[:, :40].reshape(-1, 2, 4, 5)
        rois = self.rois
        if self.data:
            lo = 2.0 + 1.5 * torch.tanh(h[:, 40:42])
            rois = torch.cat([torch.zeros_like(h[:, :1]), lo, lo + 0.5 + 2.0 * torch.sigmoid(h[:, 42:44])], dim=1)
        y = torchvision.ops.roi_align(img, rois, (2, 2), spatial_scale=0.8, sampling_ratio=self.sr,
                                     aligned=self.aligned)
        return y.reshape(-1, 8)


# the ops whose function the TorchScript exporter (opset 17) cannot export
_TORCHSCRIPT_FAILS = {
    "DFT": "TorchScript cannot export torch.fft.rfft (aten::fft_rfft at opset 17)",
    "DeformConv": "TorchScript cannot export torchvision::deform_conv2d (unrecognized namespace)",
}
# DeformConv exists from opset 19: dynamo at opset 18 emits it anyway (an invalid model, see
# test_deformconv_dynamo_opset18_is_refused_one_line), so that case exports at 19
_DYNAMO_OPSET = {"DeformConv": 19}


def _rfft(h):
    """torch.fft.rfft of 12 samples: 7 bins, as [re, im] pairs (DFT, onesided, real input)."""
    return torch.view_as_real(torch.fft.rfft(h, dim=-1)).reshape(-1, 14)


class _Stft(nn.Module):
    """torch.stft (n_fft 8, hop 4, no centering) with a trained window: the window's
    gradient is STFT's second cotangent. return_complex=False is the form TorchScript
    exports (it refuses complex outputs); dynamo exports both the same way."""

    def __init__(self):
        super().__init__()
        self.window = nn.Parameter(torch.hann_window(8) + 0.1)

    def forward(self, h):
        s = torch.stft(h, 8, hop_length=4, window=self.window, center=False, return_complex=False)
        return s.reshape(-1, 30)


class _Deform(nn.Module):
    """torchvision's deform_conv2d of a [2, 4, 4] image with offsets and a mask, all from
    h, and its own weight and bias (a 2x2 kernel: 3 output channels of 3x3)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(0.5 * torch.randn(3, 2, 2, 2))
        self.bias = nn.Parameter(torch.randn(3))

    def forward(self, h):
        import torchvision

        img = h[:, :32].reshape(-1, 2, 4, 4)
        off = h[:, 32:104].reshape(-1, 8, 3, 3)
        mask = torch.sigmoid(h[:, 104:140]).reshape(-1, 4, 3, 3)
        return torchvision.ops.deform_conv2d(img, off, self.weight, self.bias, mask=mask).reshape(-1, 27)


def _grid_sample(h):
    """A [1, 3, 4] image and a 2x2 grid (partly outside [-1, 1]), both from h: the image's
    and the grid's gradients both reach fc1."""
    img = h[:, :12].reshape(-1, 1, 3, 4)
    grid = 1.2 * torch.tanh(h[:, 12:20]).reshape(-1, 2, 2, 2)
    return nn.functional.grid_sample(img, grid, align_corners=False).reshape(-1, 4)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("op,module,example", _op_models(), ids=lambda v: v if isinstance(v, str) else "")
def test_issue38_ops_against_torch_autograd(op, module, example, dynamo):
    """torch.prod, torch.linalg.det, torch.fmod, F.grid_sample, torch.stft, torch.fft.rfft
    and torchvision's deform_conv2d and roi_align export as ReduceProd, Det, Mod,
    GridSample, STFT, DFT, DeformConv and RoiAlign (rfft and deform_conv2d through dynamo
    only); the compiled gradients and jvps of the parameters around them are torch's."""
    case, op = op, op.split("-")[0]
    if op in _TORCHSCRIPT_FAILS and not dynamo:
        pytest.skip(_TORCHSCRIPT_FAILS[op])
    if op in ("DeformConv", "RoiAlign"):
        pytest.importorskip("torchvision")  # its import registers the ops' ONNX translations
    model = _export(module, example, dynamo, _DYNAMO_OPSET.get(op, 18))
    found = {n.op_type for n in model.graph.node} | {n.op_type for f in model.functions for n in f.node}
    assert op in found, f"{op} not in the export: {sorted(found)}"
    _check_against_torch(case, module, model, example)


def test_deformconv_dynamo_opset18_is_refused_one_line():
    """At opset 18 (DeformConv is opset 19) dynamo still emits DeformConv: ORT rejects the
    model, and the compiler refuses it in one line naming the node and the opsets it has."""
    pytest.importorskip("torchvision")
    module = _Between(_Deform(), d_mid=140, d_f=27)
    model = _export(module, torch.randn(5, 6), True, 18)
    assert any(n.op_type == "DeformConv" for n in model.graph.node)
    with pytest.raises(UnsupportedOpError) as ei:
        gradient_model(model, "logits", ["fc1.weight"])
    msg = str(ei.value)
    assert "\n" not in msg and "op DeformConv (domain ai.onnx, opset 18)" in msg and "opsets 19.." in msg


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_roi_align_default_sampling_ratio_is_refused_one_line(dynamo):
    """torchvision's default sampling_ratio (-1: adaptive) exports as RoiAlign's 0, a
    per-roi sample count: refused in one line that says to export with sampling_ratio > 0."""
    pytest.importorskip("torchvision")
    module = _Between(_RoiAlign(True, False, sampling_ratio=-1), d_mid=44, d_f=8)
    model = _export(module, torch.randn(5, 6), dynamo)
    with pytest.raises(UnsupportedOpError, match="sampling_ratio 0 .*export it with sampling_ratio > 0") as ei:
        gradient_model(model, "logits", ["fc1.weight"])
    assert "\n" not in str(ei.value)


# ops whose torch forward AD is wrong without an error: torchvision's deform_conv2d and
# roi_align have no jvp formula, yet torch.func.jvp returns tangents up to 1.8 (DeformConv) and
# 2.0 (RoiAlign, constant rois, float64) away from central differences that reach 5.8 and 4.7,
# and their double backward raises; the truth there is torch's reverse-mode Jacobian times the
# tangents (within 1e-10 of the differences with constant rois; with data rois it leaves out
# the rois' dependence on fc1, as torchvision's backward and the rule do)
_NO_FORWARD_AD = {"DeformConv", "RoiAlign"}


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
    if name.split("-")[0] in _NO_FORWARD_AD:  # the reverse-mode Jacobian times the tangents
        jac = torch.autograd.functional.jacobian(f, primals)
        jv = sum(torch.tensordot(j, t, dims=t.dim()) for j, t in zip(jac, tans))
    else:
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
