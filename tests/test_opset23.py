"""Opset 23+ support: RMSNormalization as a scale_and_shift layer (pattern and block against
brute force), the whole pipeline at the highest supported opset, and torch's dynamo exports
at opsets 23-25 (RMSNormalization, Attention, Einsum, Resize, ConvTranspose) compiled and
differentiated against torch autograd."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.builder import MAX_OPSET
from test_blocks import assert_close, emitted_stats, ss_brute, ss_case

pytestmark = pytest.mark.slow  # torch exports and third-party models: CI runs these (`pytest` without -m)


def rms_ref(x, axis, eps):
    x = np.asarray(x, np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    return x / np.sqrt((x * x).mean(axes, keepdims=True) + eps)


@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_scale_and_shift_rms_norm_block(approx):
    norm = {"op": "RMSNormalization", "axis": -1, "epsilon": 1e-5}
    layer, blk, inputs, cots = ss_case(approx, normalization=norm, shift=False)
    out = emitted_stats(blk, inputs, cots, opset=23)
    F = ss_brute([rms_ref(x, -1, 1e-5) for x in inputs], cots, (1,), False)
    key = "full" if approx == "full" else "diag"
    assert_close(out[key], F if approx == "full" else np.diag(F), rtol=1e-3, atol=1e-4)
    assert_close(blk.numpy_statistics(inputs, cots)[key], F if approx == "full" else np.diag(F), 1e-10, 1e-10)


def _rms_model(opset=23):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 6)).astype(np.float32) * 0.4, "fc.weight"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(6)).astype(np.float32), "norm.weight"),
             numpy_helper.from_array(rng.standard_normal((6, 3)).astype(np.float32) * 0.4, "head.weight")]
    nodes = [helper.make_node("MatMul", ["input", "fc.weight"], ["h"], name="fc"),
             helper.make_node("RMSNormalization", ["h", "norm.weight"], ["n"], name="norm", axis=-1, epsilon=1e-6),
             helper.make_node("MatMul", ["n", "head.weight"], ["logits"], name="head")]
    g = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 6])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def test_rms_norm_pattern_and_training():
    import kfac_compiler as kc
    from kfac_compiler.runtime import Trainer

    plan = kc.compile(_rms_model(), loss="softmax_cross_entropy", output="logits")
    norm = [l for l in plan.layers if l.name == "norm"][0]
    assert (norm.kind, norm.pattern, norm.params, norm.approximation) == ("scale_and_shift", "rms_norm", ("norm.weight",), "full")
    assert norm.attrs["normalization"] == {"op": "RMSNormalization", "axis": 2, "epsilon": 1e-6}
    assert norm.attrs["scale_axes"] == (2,)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 4, 6)).astype(np.float32)
    y = rng.integers(0, 3, (32, 4)).astype(np.int64)
    tr = Trainer(plan, optimizer="kfac", device="cpu")
    losses = [float(tr.step({"input": x}, targets=y)["loss"]) for _ in range(6)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_zoo_trains_at_max_opset():
    """The zoo's CNN and transformer restamped at the highest supported opset train exactly
    as at opset 17 (the ops they use only gained types since)."""
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO, get_model
    from kfac_compiler.runtime import Trainer

    for name in ("small_cnn", "transformer_block"):
        e = ZOO[name]
        inputs, targets = e.make_data(n=32)
        losses = {}
        for opset in (17, MAX_OPSET):
            m = get_model(name, seed=0)
            for o in m.opset_import:
                if o.domain in ("", "ai.onnx"):
                    o.version = opset
            tr = Trainer(kc.compile(m, loss=e.loss, output=e.output_name), optimizer="kfac", device="cpu")
            losses[opset] = [float(tr.step(inputs, targets=targets)["loss"]) for _ in range(2)]
        np.testing.assert_allclose(losses[MAX_OPSET], losses[17], rtol=1e-5, err_msg=name)


# ------------------------------------------------------------- torch dynamo exports
def _torch_model():
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Linear(16, 5 * 8)
            self.norm = nn.RMSNorm(8, eps=1e-6)
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
            self.img = nn.Linear(16, 4 * 3 * 3)
            self.up = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
            self.out = nn.Linear(5 * 8 + 5 * 5 + 3 * 6 * 6, 4)

        def forward(self, x):
            n = x.shape[0]
            h = self.norm(self.tok(x).view(n, 5, 8))
            q = self.q(h).view(n, 5, 2, 4).transpose(1, 2)
            k = self.k(h).view(n, 5, 1, 4).transpose(1, 2)
            v = self.v(h).view(n, 5, 1, 4).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            a = a.transpose(1, 2).reshape(n, 5, 8)
            s = torch.einsum("btd,bsd->bts", a, h)
            z = self.up(torch.tanh(self.img(x)).view(n, 4, 3, 3))
            z = F.interpolate(F.interpolate(z, scale_factor=2, mode="bilinear"), scale_factor=0.5, mode="nearest")
            return self.out(torch.cat([a.reshape(n, -1), s.reshape(n, -1), z.reshape(n, -1)], 1))

    torch.manual_seed(0)
    return torch, Net().eval()


def _dynamo_export(torch, module, example, opset):
    import io

    pytest.importorskip("onnxscript")
    buf = io.BytesIO()
    torch.onnx.export(module, (example,), buf, dynamo=True, input_names=["input"], output_names=["logits"],
                      dynamic_shapes=({0: torch.export.Dim("N", min=2)},), opset_version=opset, verbose=False)
    return onnx.load_from_string(buf.getvalue())


@pytest.mark.parametrize("opset", [23, 24, 25])
def test_dynamo_export_against_torch_autograd(opset):
    """torch's dynamo exporter at opsets 23-25 emits RMSNormalization, Attention (GQA, causal),
    Einsum, ConvTranspose and Resize (linear, nearest): our gradients and tangents (ORT,
    float32) against torch autograd and torch.func.jvp, and the plan's layers."""
    import kfac_compiler as kc
    from kfac_compiler.oprules.check import run_ort
    from kfac_compiler.passes.autodiff import gradient_model, jvp_model
    from test_torch_autograd import _param_map

    torch, module = _torch_model()
    x = torch.randn(3, 16)
    model = _dynamo_export(torch, module, x, opset)
    ops = {n.op_type for n in model.graph.node}
    assert {"RMSNormalization", "Attention", "Einsum", "ConvTranspose", "Resize"} <= ops, ops
    assert model.opset_import[0].version == opset
    tparams = dict(module.named_parameters())
    pmap = _param_map(model, module)
    assert len(pmap) == len(tparams), sorted(set(tparams) - set(pmap))
    params = [pmap[p][0] for p in tparams]
    out = module(x)
    u = torch.randn_like(out)
    module.zero_grad()
    (out * u).sum().backward()
    res = run_ort(gradient_model(model, "logits", params), {"input": x.numpy(), "logits_grad": u.numpy()})
    np.testing.assert_allclose(res["logits"], out.detach().numpy(), rtol=1e-4, atol=1e-5)
    for p, (iname, tr) in pmap.items():
        want = tparams[p].grad.numpy()
        got = res[f"grad/{iname}"]
        np.testing.assert_allclose(got.T if tr else got, want, rtol=1e-3, atol=1e-4 * (1 + np.abs(want).max()), err_msg=p)
    names = list(tparams)
    tangents = {p: torch.randn_like(tparams[p]) for p in names}

    def f(*vals):
        return torch.func.functional_call(module, dict(zip(names, vals)), (x,))

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no forward-mode AD
        _, jv = torch.func.jvp(f, tuple(tparams[p].detach() for p in names), tuple(tangents[p] for p in names))
    feeds = {f"tangent/{pmap[p][0]}": (tangents[p].numpy().T if pmap[p][1] else tangents[p].numpy()) for p in names}
    got = run_ort(jvp_model(model, "logits", params), {"input": x.numpy(), **feeds})
    np.testing.assert_allclose(got["jvp/logits"], jv.detach().numpy(), rtol=1e-3, atol=1e-4 * (1 + float(jv.abs().max())))
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits")
    kinds = {l.pattern: l.kind for l in plan.layers}
    assert kinds.get("rms_norm") == "scale_and_shift" and kinds.get("conv_transpose2d_bias") == "conv_transpose", kinds


def test_every_rule_covers_the_highest_opset():
    """Rules match opset ranges [since, until]; ops re-versioned in 21-25 (Cast, Reshape,
    Transpose, Squeeze, Pad, ...) must keep their rules up to MAX_OPSET."""
    from kfac_compiler.oprules import RULES, find

    missing = [op for (domain, op), rules in RULES.items()
               if not domain and find(helper.make_node(op, [], []), MAX_OPSET) is None]
    assert not missing, missing
    for op in ("Cast", "CastLike", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Pad",
               "Shape", "Size", "Constant", "ConstantOfShape", "TopK", "Attention", "RMSNormalization",
               "RotaryEmbedding", "Swish", "Einsum", "Resize", "ConvTranspose"):
        assert find(helper.make_node(op, [], []), MAX_OPSET) is not None, op
