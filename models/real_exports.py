"""Small random-weight exports of models nobody here wrote, from both torch exporters, with
torch autograd reference values (the fixtures of tests/test_real_exports.py).

    python -m kfac_compiler.models.real_exports --out tests/fixtures/real [--only gpt2 ...]

needs torch (and transformers for the Hugging Face families; onnxscript for the dynamo
exporter): `pip install -e '.[fixtures]'`. Nothing in kfac_compiler imports this module.

Families (`FAMILIES`; every one in eval form, seed 0, every parameter redrawn at random so
that no two initializers are equal and every initializer's values identify the torch
parameter elements it holds):

* resnet: the ResNet-18 twin's BasicBlock (models/torch_exports) in a ResNet of [1,1,1,1]
  blocks of widths 8/12/16/24 with BatchNorm (written when torchvision's wheel did not load
  with the torch build; the layers and names are torchvision's), 16x16 RGB digits;
* mobilenet_v2: inverted residual blocks (1x1 expand, 3x3 depthwise, 1x1 project) with
  BatchNorm and ReLU6; mobilenet_v3: the same with Hardswish and squeeze-excitation
  (avg-pool, 1x1 convs, ReLU, Hardsigmoid, Mul);
* gpt2, bert: transformers' GPT2LMHeadModel and BertForMaskedLM from a tiny config
  (2 layers, width 32, 2 heads, vocab 32, 8 positions; eager attention), logits [N, 8, 32];
* gpt: models/torch_exports.gpt at width 16, 2 layers, vocab 32, 8 positions (tied head);
* lstm, gru: Embedding(32, 16) -> nn.LSTM / nn.GRU (2 layers, hidden 16, batch_first) ->
  Linear(16, 32); bilstm: one bidirectional LSTM layer (then Linear(32, 32)), torch.export
  without its optimizer only (it concatenates both directions' weights at run time);
* groupnorm: timm's PoolFormer block at width 8 (GroupNorm(1, C) norms, AvgPool token
  mixer, 1x1-conv MLP) with a GroupNorm(4, C), 16x16 RGB digits: exporters write GroupNorm as
  InstanceNormalization with placeholder scale and shift between Reshapes.
* vit: torchvision's VisionTransformer (16x16 images, 4x4 patches, one layer of width 16:
  class token, position embeddings, nn.MultiheadAttention); swin: torchvision's
  SwinTransformer (2x2 patches of width 8, stages of 2 and 1 blocks in 4x4 windows: the
  shifted-window mask, relative position bias tables, patch merging); efficientnet:
  torchvision's EfficientNet from two MBConv settings (depthwise convs, squeeze-excitation,
  SiLU, BatchNorm, stochastic depth off);
* llama: transformers' LlamaForCausalLM (2 layers, width 16, 2 heads, 1 key/value head:
  rotary embeddings, RMSNorm, SiLU-gated MLP); wav2vec2: Wav2Vec2ForSequenceClassification
  (2-conv feature extractor with GroupNorm, the weight_norm'd positional conv, one layer of
  width 16, 10 classes) on "waveform" batches (the 16x16 digit read as 256 samples). Its
  weight_norm'd weight is referenced as `fused:<module>.weight` (g v / |v| and its gradient):
  TorchScript and torch.export's optimizer fold g and v into it.

Exporters (`EXPORTERS`): "ts" (torch.onnx.export(dynamo=False), opset 17), "dynamo"
(dynamo=True, the exporter's default opset, its optimizer on) and "dynamo_noopt"
(optimize=False); "dynamo23" (optimizer on, opset 23) for resnet, lstm and gpt2_sdpa (GPT-2 with
transformers' SDPA attention, exported as opset 23's Attention op; also by "dynamo" at the
default opset, where it is decomposed). The batch dimension is dynamic ("N") where the exporter accepts it. The
dynamo exports lose their per-node stack traces (`kfac_compiler.torch.strip_traces`), nothing else.

Per fixture `<family>-<exporter>.onnx` and `.npz`:

* `input`, `targets`: a batch (digits images / rows of digits pixel tokens with next-token
  targets), `loss`: torch's loss with the project's convention (docs/conventions.md: sum
  over every non-batch coordinate, mean over the batch);
* `ref_names` (the reference parameters: the torch parameters, then for eval-mode BatchNorm
  the conv weights and biases with the BatchNorm folded in, named `fused:<conv>.weight`),
  `ref_sizes`, `ref_values` and `ref_grads` (flat, concatenated in that order; the fused
  ones' gradients come from torch.nn.utils.fusion's fused twin of the model);
* `init_names`: the float initializers whose every element equals a reference parameter
  element (matched by value: every value is a distinct random float), `init_index_<i>`:
  for each element the index into the flat reference vector, so that the gradient of an
  initializer, summed into the reference elements it holds (a copy of a tied weight, a
  gate-reordered LSTM weight, a transposed Linear), is torch's gradient;
* `frozen_names`: the float initializers that hold no parameter (constants, BatchNorm
  running statistics, masks...), `unmatched_params`: torch parameters no initializer holds.

`<family>_init-<exporter>` (gpt2, resnet; `generate_default_init`): the same models at their
own initialisation, where the exporters merge equal initializers (zero biases, unit gains);
the .npz holds the batch, torch's loss and the trainable elements expected.

`manifest.json` lists each fixture with its status ("ok", or the export error), opset,
exporter and file sizes.
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import warnings

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover
    raise ImportError("kfac_compiler.models.real_exports needs torch (pip install -e '.[fixtures]')") from e

import onnx
from onnx import numpy_helper

from kfac_compiler.models import real_data
from kfac_compiler.models.real_data import SEQ, VOCAB

BATCH = 8
EXPORTERS = ("ts", "dynamo", "dynamo_noopt", "dynamo23")
# "dynamo23" (torch.export at opset 23: Attention for scaled_dot_product_attention) only for a
# few families, and gpt2_sdpa (transformers' SDPA attention) only through torch.export
FAMILY_EXPORTERS = {"gpt2_sdpa": ("dynamo", "dynamo23"), "bilstm": ("dynamo_noopt",)}
OPSET23_FAMILIES = ("resnet", "lstm", "gpt2_sdpa")


# ------------------------------------------------------------------------------ families
class _ResNet(nn.Module):
    """torchvision's ResNet layout (conv1/bn1/relu/maxpool/layer1..4/avgpool/fc) with
    BasicBlocks [1,1,1,1] of reduced widths."""

    def __init__(self, widths=(8, 12, 16, 24), num_classes=10):
        super().__init__()
        from kfac_compiler.models.torch_exports import _BasicBlock

        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes, layers = widths[0], []
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or inplanes != w:
                down = nn.Sequential(nn.Conv2d(inplanes, w, 1, stride, bias=False), nn.BatchNorm2d(w))
            layers.append(nn.Sequential(_BasicBlock(inplanes, w, stride, down)))
            inplanes = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _conv_bn(cin, cout, k=1, stride=1, groups=1, act=None):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class _SE(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1 = nn.Conv2d(c, max(c // r, 4), 1)
        self.fc2 = nn.Conv2d(max(c // r, 4), c, 1)

    def forward(self, x):
        s = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(s))))


class _InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand, act, se):
        super().__init__()
        hid = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers = [_conv_bn(cin, hid, 1, act=act), _conv_bn(hid, hid, 3, stride, groups=hid, act=act)]
        if se:
            layers.append(_SE(hid))
        layers.append(_conv_bn(hid, cout, 1))
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        y = self.conv(x)
        return x + y if self.use_res else y


class _MobileNet(nn.Module):
    def __init__(self, v3: bool, num_classes=10):
        super().__init__()
        act = nn.Hardswish if v3 else nn.ReLU6
        cfg = [(8, 8, 1), (8, 12, 2), (12, 12, 1), (12, 16, 2)]
        self.features = nn.Sequential(
            _conv_bn(3, 8, 3, 1, act=act),
            *[_InvertedResidual(ci, co, s, 3, act, se=v3 and i % 2 == 1) for i, (ci, co, s) in enumerate(cfg)],
            _conv_bn(16, 32, 1, act=act))
        self.classifier = nn.Sequential(nn.Linear(32, 24), act(), nn.Linear(24, num_classes)) if v3 \
            else nn.Linear(32, num_classes)

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


class _Logits(nn.Module):
    """A Hugging Face model as tokens (or `key`: its input's keyword) -> logits tensor."""

    def __init__(self, model, key: str = "input_ids"):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, input):  # noqa: A002 - the graph input's name
        return self.model(**{self.key: input}, return_dict=False)[0]


def _gpt2(attn: str = "eager"):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn, bos_token_id=0, eos_token_id=0)
    return _Logits(GPT2LMHeadModel(cfg))


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager",
                     pad_token_id=VOCAB - 1)  # no token of the data: padding_idx zeroes that row's
    # gradient in torch, which the ONNX graph cannot know
    return _Logits(BertForMaskedLM(cfg))


class _RNNLM(nn.Module):
    def __init__(self, cell, vocab=VOCAB, d=16, bidirectional=False, num_layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = cell(d, d, num_layers=num_layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(2 * d if bidirectional else d, vocab)

    def forward(self, input):  # noqa: A002
        return self.head(self.rnn(self.emb(input))[0])


class _PoolFormer(nn.Module):
    """timm's PoolFormer block at width 8: GroupNorm(1, C) norms (timm's PoolFormer and
    MobileViTv2 normalize so), the pooling token mixer (AvgPool - x) and a 1x1-conv MLP with
    GELU, then a GroupNorm(4, C) (statistics per group of channels) and a linear head."""

    def __init__(self, c=8, num_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, 2, 1)
        self.norm1 = nn.GroupNorm(1, c)
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.norm2 = nn.GroupNorm(1, c)
        self.fc1 = nn.Conv2d(c, 2 * c, 1)
        self.fc2 = nn.Conv2d(2 * c, c, 1)
        self.norm3 = nn.GroupNorm(4, c)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.stem(x)
        y = self.norm1(x)
        x = x + self.pool(y) - y
        x = x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm3(x).mean((2, 3)))


def _vit():
    """torchvision's VisionTransformer: 16x16 images in 4x4 patches, one encoder layer of width
    16 (class token, learnt position embeddings, nn.MultiheadAttention)."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=16, patch_size=4, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=10)


def _swin():
    """torchvision's SwinTransformer: 2x2 patches of width 8, a stage of two blocks on 8x8
    tokens in 4x4 windows (the second shifted: the attention mask path), patch merging, a
    stage of one block; relative position bias tables."""
    from torchvision.models import SwinTransformer

    return SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=[4, 4],
                           stochastic_depth_prob=0.0, num_classes=10)


def _llama():
    """transformers' LlamaForCausalLM, tiny: rotary position embeddings, RMSNorm, SiLU-gated MLP,
    grouped-query attention (2 heads, 1 key/value head), untied head; eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                      attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return _Logits(LlamaForCausalLM(cfg))


def _wav2vec2():
    """transformers' Wav2Vec2ForSequenceClassification, tiny: a 2-conv feature extractor (the
    first GroupNorm'd), feature projection, the weight-normed positional conv embedding, one
    encoder layer of width 16, mean pooling, projector and classifier; on 256-sample waveforms."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = Wav2Vec2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                         num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, num_labels=10,
                         classifier_proj_size=8, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                         feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
                         attn_implementation="eager")
    return _Logits(Wav2Vec2ForSequenceClassification(cfg), key="input_values")


def _efficientnet():
    """torchvision's EfficientNet from a tiny MBConv setting (expand 1 then 4, 3x3 depthwise,
    squeeze-excitation with SiLU and Sigmoid, BatchNorm, stochastic depth off)."""
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    setting = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(4, 3, 2, 8, 16, 1)]
    return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10)


def _gpt():
    from kfac_compiler.models.torch_exports import gpt

    return gpt(vocab=VOCAB, seq_len=SEQ, d_model=16, n_layer=2, n_head=2)


FAMILIES = {
    "resnet": (lambda: _ResNet(), "image"),
    "mobilenet_v2": (lambda: _MobileNet(False), "image"),
    "mobilenet_v3": (lambda: _MobileNet(True), "image"),
    "gpt2": (_gpt2, "tokens"),
    "gpt2_sdpa": (lambda: _gpt2("sdpa"), "tokens"),
    "bert": (_bert, "tokens"),
    "gpt": (_gpt, "tokens"),
    "lstm": (lambda: _RNNLM(nn.LSTM), "tokens"),
    "gru": (lambda: _RNNLM(nn.GRU), "tokens"),
    "bilstm": (lambda: _RNNLM(nn.LSTM, bidirectional=True, num_layers=1), "tokens"),
    "groupnorm": (lambda: _PoolFormer(), "image"),
    "vit": (_vit, "image"),
    "swin": (_swin, "image"),
    "llama": (_llama, "tokens"),
    "wav2vec2": (_wav2vec2, "waveform"),
    "efficientnet": (_efficientnet, "image"),
}


# ------------------------------------------------------------------------------ data
batch = real_data.batch  # (input, targets) for "image" / "tokens" (models/real_data.py)


def torch_loss(logits, targets):
    """softmax cross-entropy over the last axis, summed over the non-batch axes, mean over N."""
    lp = torch.log_softmax(logits, dim=-1)
    return -lp.gather(-1, targets.unsqueeze(-1)).sum() / logits.shape[0]


# ------------------------------------------------------------------------------ reference
def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Redraw every parameter (and BatchNorm statistic) at random: weights keep their scale,
    constants (zero biases, unit gains) get N(0, 0.1) noise around their value, running
    variances are in [0.5, 1.5]. No two elements are equal afterwards."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in module.named_parameters():
            std = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 0.0
            p.add_(max(std, 0.1) * 0.5 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        # float32 draws collide (tens of equal pairs among 1e5 values): nudge until distinct
        params = list(module.parameters())
        rng = np.random.default_rng(seed)
        for _ in range(20):
            flat = np.concatenate([p.detach().numpy().ravel() for p in params])
            _, first, counts = np.unique(flat, return_index=True, return_counts=True)
            dup = np.setdiff1d(np.arange(flat.size), first)
            if dup.size == 0:
                break
            flat[dup] *= 1 + 1e-4 * rng.standard_normal(dup.size).astype(np.float32)
            off = 0
            for p in params:
                p.copy_(torch.from_numpy(flat[off:off + p.numel()].reshape(p.shape)))
                off += p.numel()
    return module


def _fused_twin(module: nn.Module):
    """{conv name: (weight, bias)} of a deep copy with every Conv2d+BatchNorm2d pair (BN
    directly after the conv in a Sequential or as convN/bnN in a block) folded."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    twin = copy.deepcopy(module).eval()
    fused = {}
    mods = dict(twin.named_modules())
    for name, m in list(twin.named_modules()):
        if isinstance(m, nn.Sequential):
            kids = list(m.named_children())
            for (a, ca), (b, cb) in zip(kids, kids[1:]):
                if isinstance(ca, nn.Conv2d) and isinstance(cb, nn.BatchNorm2d):
                    setattr(m, a, fuse_conv_bn_eval(ca, cb))
                    setattr(m, b, nn.Identity())
                    fused[f"{name}.{a}" if name else a] = f"{name}.{b}" if name else b
        for a, b in (("conv1", "bn1"), ("conv2", "bn2")):
            ca, cb = getattr(m, a, None), getattr(m, b, None)
            if isinstance(ca, nn.Conv2d) and isinstance(cb, nn.BatchNorm2d):
                setattr(m, a, fuse_conv_bn_eval(ca, cb))
                setattr(m, b, nn.Identity())
                fused[f"{name}.{a}" if name else a] = f"{name}.{b}" if name else b
    del mods
    for p in twin.parameters():  # the folded bias of a bias-free conv comes without requires_grad
        p.requires_grad_(True)
    return twin, dict(sorted(fused.items()))


def _weight_normed(module: nn.Module) -> dict[str, torch.Tensor]:
    """{module name: its weight g v / |v|} for the modules whose weight is a weight_norm
    parametrization (TorchScript and torch.export's optimizer fold it into one tensor);
    call inside `parametrize.cached()` so that the forward uses these very tensors."""
    from torch.nn.utils import parametrize

    return {n: m.weight for n, m in module.named_modules() if parametrize.is_parametrized(m, "weight")}


def reference(module: nn.Module, x: np.ndarray, y: np.ndarray) -> dict:
    """Loss, and the reference parameters with their gradients (module's, then each
    weight_norm'd weight g v / |v| as `fused:<module>.weight`, then the fused twin's folded
    convs)."""
    from torch.nn.utils import parametrize

    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    module.zero_grad()
    with parametrize.cached():
        normed = _weight_normed(module)
        for w in normed.values():
            w.retain_grad()
        loss = torch_loss(module(xt), yt)
        loss.backward()
    names, values, grads = [], [], []
    for n, p in module.named_parameters():
        names.append(n)
        values.append(p.detach().numpy().ravel())
        # a parameter the eval forward does not use (Wav2Vec2's masked_spec_embed) has none
        grads.append((p.grad if p.grad is not None else torch.zeros_like(p)).numpy().ravel())
    for m, w in normed.items():  # weight_norm folded: the weight's gradient
        names.append(f"fused:{m}.weight")
        values.append(w.detach().numpy().ravel())
        grads.append(w.grad.numpy().ravel())
    ref_extra = []
    if any(isinstance(m, nn.BatchNorm2d) for m in module.modules()):
        twin, convs = _fused_twin(module)
        twin.zero_grad()
        tloss = torch_loss(twin(xt), yt)
        assert abs(tloss.item() - loss.item()) < 1e-4 * (1 + abs(loss.item())), (tloss.item(), loss.item())
        tparams = dict(twin.named_parameters())
        tloss.backward()
        ref_extra = [f"{c}|{bn}" for c, bn in convs.items()]
        for c in convs:
            for suffix in ("weight", "bias"):
                p = tparams[f"{c}.{suffix}"]
                names.append(f"fused:{c}.{suffix}")
                values.append(p.detach().numpy().ravel())
                grads.append(p.grad.numpy().ravel())
    extra = {"fused_pairs": np.array(ref_extra)} if ref_extra else {}
    extra.update({"weight_normed": np.array(list(normed))} if normed else {})
    return {**extra, "loss": np.float32(loss.item()), "ref_names": np.array(names),
            "ref_sizes": np.array([v.size for v in values], np.int64),
            "ref_values": np.concatenate(values).astype(np.float32),
            "ref_grads": np.concatenate(grads).astype(np.float32)}


def match_initializers(model: onnx.ModelProto, ref: dict) -> dict:
    """Which float initializers hold reference parameter elements (all of theirs), by value."""
    values = ref["ref_values"]
    owner = np.repeat(np.arange(len(ref["ref_sizes"])), ref["ref_sizes"])
    # exact matches against the torch parameters (distinct by construction); the fused
    # twin's tensors are matched whole below (they may repeat a torch parameter's value)
    is_torch = np.array([not str(n).startswith("fused:") for n in ref["ref_names"]])[owner]
    order = np.flatnonzero(is_torch)[np.argsort(values[is_torch], kind="stable")]
    sorted_vals = values[order]
    out = {"init_names": [], "frozen_names": []}
    covered = np.zeros(len(ref["ref_names"]), bool)
    for t in model.graph.initializer:
        arr = numpy_helper.to_array(t)
        if arr.dtype != np.float32:
            continue
        flat = arr.ravel()
        pos = np.searchsorted(sorted_vals, flat)
        pos = np.clip(pos, 0, len(sorted_vals) - 1)
        ok = flat.size > 0 and bool(np.all(sorted_vals[pos] == flat))
        if ok:
            # a unique match per element (values are distinct floats)
            dup = np.searchsorted(sorted_vals, flat, side="right") - pos
            ok = bool(np.all(dup == 1))
        if not ok:
            # folded by the exporter (BatchNorm into the conv): the fused twin's tensor of the
            # same size, equal up to the rounding of the folding
            off = np.concatenate([[0], np.cumsum(ref["ref_sizes"])])
            for i, name in enumerate(ref["ref_names"]):
                if str(name).startswith("fused:") and ref["ref_sizes"][i] == flat.size:
                    want = values[off[i]:off[i + 1]]
                    if np.allclose(flat, want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max())):
                        ok, idx = True, np.arange(off[i], off[i + 1])
                        break
        elif ok:
            idx = order[pos]
        if ok:
            out[f"init_index_{len(out['init_names'])}"] = idx.astype(np.int32)
            out["init_names"].append(t.name)
            covered[np.unique(owner[idx])] = True
        else:
            out["frozen_names"].append(t.name)
    # torch parameters no initializer holds (BatchNorm gains and shifts and bias-free convs
    # that the exporter folded are held by a fused twin's tensor: listed in `fused_params`)
    folded = set()
    for pair in ref.get("fused_pairs", []):
        conv, bn = str(pair).split("|")
        if covered[list(ref["ref_names"]).index(f"fused:{conv}.weight")]:
            folded |= {f"{conv}.weight", f"{conv}.bias", f"{bn}.weight", f"{bn}.bias"}
    for m in ref.get("weight_normed", []):
        if covered[list(ref["ref_names"]).index(f"fused:{m}.weight")]:
            folded |= {f"{m}.parametrizations.weight.original0", f"{m}.parametrizations.weight.original1"}
    out["unmatched_params"] = [n for n, c in zip(ref["ref_names"], covered)
                               if not c and not str(n).startswith("fused:") and str(n) not in folded]
    out["fused_params"] = [n for n, c in zip(ref["ref_names"], covered) if c and str(n).startswith("fused:")]
    out["init_names"] = np.array(out["init_names"], dtype=object).astype(str) if out["init_names"] else np.array([], "U1")
    out["frozen_names"] = np.array(out["frozen_names"]).astype(str) if out["frozen_names"] else np.array([], "U1")
    for key in ("unmatched_params", "fused_params"):
        out[key] = np.array(out[key]).astype(str) if out[key] else np.array([], "U1")
    return out


# ------------------------------------------------------------------------------ export
def export(module: nn.Module, x: np.ndarray, exporter: str) -> onnx.ModelProto:
    """The ONNX model of `module` from `exporter` (EXPORTERS), dynamic batch N if possible."""
    xt = torch.from_numpy(x)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            torch.onnx.export(module, (xt,), buf, dynamo=False, input_names=["input"], output_names=["logits"],
                              opset_version=17, dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
                              do_constant_folding=True)
            return onnx.load_from_string(buf.getvalue())
        optimize = exporter in ("dynamo", "dynamo23")
        opset = {"dynamo23": 23}.get(exporter)
        last = None
        for dyn in (({0: torch.export.Dim("N", min=2)},), None):
            try:
                prog = torch.onnx.export(module, (xt,), dynamo=True, input_names=["input"], output_names=["logits"],
                                         dynamic_shapes=dyn, optimize=optimize, verbose=False, opset_version=opset)
                from kfac_compiler.torch import strip_traces

                return strip_traces(prog.model_proto)
            except Exception as e:  # noqa: BLE001 - retried with a static batch
                last = e
        raise last


DEFAULT_INIT = ("gpt2", "resnet")  # also exported at their own initialisation: "<family>_init"


def generate_default_init(out: str, family: str, exporters, manifest: dict) -> None:
    """`family` at torch's / transformers' own initialisation (zero biases, unit LayerNorm and
    BatchNorm gains, unit running variances): the exporters merge equal initializers into
    one tensor. The .npz holds input, targets, loss and `expected_elements`: the trainable
    elements of the random-weight twin's export by the same exporter (every torch parameter
    its own tensor), which the compiler should train here too (merged tensors split again)."""
    make, kind = FAMILIES[family]
    torch.manual_seed(0)
    module = make().eval()
    x, y = batch(kind)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    with torch.no_grad():
        loss = torch_loss(module(xt), yt)
    for ex in exporters:
        key, twin = f"{family}_init-{ex}", os.path.join(out, f"{family}-{ex}.npz")
        entry = {"family": f"{family}_init", "twin": f"{family}-{ex}", "exporter": ex, "kind": kind, "default_init": True}
        if not os.path.exists(twin):
            entry["status"] = f"not generated: no random-weight twin {family}-{ex}"
            manifest[key] = entry
            continue
        with np.load(twin) as d:
            expected = int(sum(d[f"init_index_{i}"].size for i in range(len(d["init_names"]))))
        try:
            model = export(module, x, ex)
        except Exception as e:  # noqa: BLE001 - recorded
            entry["status"] = f"export failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            manifest[key] = entry
            continue
        onnx_path = os.path.join(out, key + ".onnx")
        onnx.save(model, onnx_path)
        floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        np.savez_compressed(os.path.join(out, key + ".npz"), input=x, targets=y, loss=np.float32(loss.item()),
                            expected_elements=np.int64(expected))
        opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None)
        entry.update(status="ok", opset=opset, onnx_bytes=os.path.getsize(onnx_path),
                     npz_bytes=os.path.getsize(os.path.join(out, key + ".npz")), expected_elements=expected,
                     float_initializers=len(floats), float_elements=int(sum(np.prod(t.dims) for t in floats)),
                     ops=sorted({n.op_type for n in model.graph.node}))
        manifest[key] = entry
        print(key, entry["onnx_bytes"], "bytes: float initializers", len(floats), "elements",
              entry["float_elements"], "twin's trainable elements", expected)


def generate(out: str, only=None, exporters=EXPORTERS) -> dict:
    os.makedirs(out, exist_ok=True)
    manifest_path = os.path.join(out, "manifest.json")
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    for family, (make, kind) in FAMILIES.items():
        if only and family not in only:
            continue
        torch.manual_seed(0)
        try:
            module = randomize(make().eval())
        except ImportError as e:
            for ex in exporters:
                manifest[f"{family}-{ex}"] = {"family": family, "exporter": ex, "status": f"not generated: {e}"}
            continue
        x, y = batch(kind)
        ref = reference(module, x, y)
        for ex in exporters:
            if ex not in FAMILY_EXPORTERS.get(family, EXPORTERS) or (ex == "dynamo23" and family not in OPSET23_FAMILIES):
                continue
            key = f"{family}-{ex}"
            entry = {"family": family, "exporter": ex, "kind": kind}
            try:
                model = export(module, x, ex)
            except Exception as e:  # noqa: BLE001 - recorded
                entry["status"] = f"export failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                manifest[key] = entry
                print(key, entry["status"])
                continue
            match = match_initializers(model, ref)
            onnx_path = os.path.join(out, key + ".onnx")
            onnx.save(model, onnx_path)
            np.savez_compressed(os.path.join(out, key + ".npz"), input=x, targets=y, **ref, **match)
            opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None)
            entry.update(status="ok", opset=opset, onnx_bytes=os.path.getsize(onnx_path),
                         npz_bytes=os.path.getsize(os.path.join(out, key + ".npz")),
                         params=int(sum(p.numel() for p in module.parameters())),
                         initializers=len(model.graph.initializer), trainable=len(match["init_names"]),
                         frozen=len(match["frozen_names"]), unmatched_params=[str(s) for s in match["unmatched_params"]],
                         fused=len(match["fused_params"]),
                         ops=sorted({n.op_type for n in model.graph.node}))
            manifest[key] = entry
            print(key, entry["onnx_bytes"], "bytes, opset", opset, "trainable", entry["trainable"], "frozen",
                  entry["frozen"], "fused", entry["fused"], "unmatched", entry["unmatched_params"][:8])
    for family in DEFAULT_INIT:
        exporters = tuple(e for e in exporters if e != "dynamo23")
        if not only or family in only or f"{family}_init" in only:
            generate_default_init(out, family, exporters, manifest)
    with open(manifest_path, "w") as f:
        json.dump(dict(sorted(manifest.items())), f, indent=1)
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/real")
    ap.add_argument("--only", nargs="*", help="families (default: all)")
    ap.add_argument("--exporters", nargs="*", default=list(EXPORTERS))
    args = ap.parse_args(argv)
    generate(args.out, args.only, tuple(args.exporters))


if __name__ == "__main__":
    main()
