"""Real-sized models exported from PyTorch, for the GPU tests and benchmarks (optional: needs
torch; nothing in kfac_compiler imports this module).

    from kfac_compiler.models.torch_exports import resnet18, gpt, export, digits_images, digits_sequences
    net = resnet18()                               # torchvision's ResNet-18 (10 classes)
    export(net, "resnet18.onnx", digits_images(8)[0]["input"])
    plan = kfac_compiler.compile("resnet18.onnx", loss="softmax_cross_entropy", output="logits")

* `resnet18`: torchvision.models.resnet18 when torchvision is installed, else a module-for-
  module twin (same layers and names). Exported in eval mode, so each
  BatchNormalization is a scale-and-shift layer over fixed running statistics, which
  `export` folds into the convolutions (the exporter's constant folding): what the compiler
  sees is 20 convolutions with biases and the dense head, 11.2M parameters.
* `gpt`: a GPT-2-style causal language model (token and position embeddings, pre-LN blocks of
  multi-head causal self-attention and a GELU MLP, a final LayerNorm, the output head tied to
  the token embedding).
* data from scikit-learn's digits: 32x32 RGB images (`digits_images`, the 8x8 digits scaled up
  by pixel repetition and copied to three channels) and pixel-intensity token sequences
  (`digits_sequences`: the 64 pixels of an image, values 0..16, as next-token targets).

Parameters initialised to a constant (zero biases, unit LayerNorm and BatchNorm gains) get
noise of 1e-3 before the export: the exporters merge equal initializers into one tensor, which
the compiler would then train as one shared parameter (see `_distinct`).

Both exports use the TorchScript exporter (`dynamo=False`) at opset 17, with a dynamic batch
dimension named N.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from kfac_compiler.models.data import MAX_PIXEL, digits

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("kfac_compiler.models.torch_exports needs torch (pip install torch)") from e


def _distinct(module: nn.Module, seed: int) -> nn.Module:
    """Add N(0, 1e-3) noise to every parameter and BatchNorm statistic whose elements are all
    equal: at initialisation all biases are zero and all norm gains one, and the exporters
    de-duplicate equal initializers, so a fresh export would tie what the model never tied."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(module.parameters()) + [b for n, b in module.named_buffers() if n.endswith(("running_mean", "running_var"))]
        for t in tensors:
            if t.is_floating_point() and t.numel() > 1 and bool((t == t.reshape(-1)[0]).all()):
                t.add_(1e-3 * torch.randn(t.shape, generator=g))
    return module


# ------------------------------------------------------------------------------ ResNet-18
class _BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class _ResNet18(nn.Module):
    """torchvision.models.resnet18's layers, names and initialisation."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._layer(64, 1)
        self.layer2 = self._layer(128, 2)
        self.layer3 = self._layer(256, 2)
        self.layer4 = self._layer(512, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _layer(self, planes: int, stride: int) -> nn.Sequential:
        down = None
        if stride != 1 or self.inplanes != planes:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        blocks = [_BasicBlock(self.inplanes, planes, stride, down), _BasicBlock(planes, planes)]
        self.inplanes = planes
        return nn.Sequential(*blocks)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, seed: int = 0) -> nn.Module:
    """ResNet-18 with `num_classes` outputs (torchvision's when installed, else the twin)."""
    torch.manual_seed(seed)
    try:
        from torchvision.models import resnet18 as tv_resnet18
    except ImportError:
        return _distinct(_ResNet18(num_classes), seed)
    return _distinct(tv_resnet18(num_classes=num_classes), seed)


# ------------------------------------------------------------------------------ GPT
class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.register_buffer("mask", torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        n, t, d = x.shape
        h = self.n_head
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.reshape(n, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(n, t, d)
        x = x + self.proj(y)
        return x + self.fc_out(nn.functional.gelu(self.fc(self.ln_2(x))))


class _GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layer: int, n_head: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*[_Block(d_model, n_head, seq_len) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(self.positions[:t])
        return self.head(self.ln_f(self.blocks(x)))


def gpt(vocab: int = 17, seq_len: int = 64, d_model: int = 256, n_layer: int = 4, n_head: int = 4,
        seed: int = 0) -> nn.Module:
    """A GPT-2-style causal LM (default: 4 layers of width 256, 3.2M parameters)."""
    torch.manual_seed(seed)
    return _distinct(_GPT(vocab, seq_len, d_model, n_layer, n_head), seed)


# ------------------------------------------------------------------------------ export, data
def export(module: nn.Module, path: str, example: np.ndarray) -> str:
    """torch.onnx.export in eval mode (TorchScript exporter, opset 17, batch dimension N)."""
    module = module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = dict(input_names=["input"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}}, do_constant_folding=True)
        try:
            torch.onnx.export(module, (torch.from_numpy(example),), path, dynamo=False, **kwargs)
        except TypeError:  # a torch without the dynamo switch
            torch.onnx.export(module, (torch.from_numpy(example),), path, **kwargs)
    return path


def digits_images(n: int | None = None, seed: int = 0, size: int = 32) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({"input": [n,3,size,size] float32 in [0,1]}, int64 labels): digits scaled up by pixel
    repetition (size a multiple of 8) and copied to three channels."""
    pixels, labels = digits(n, seed)  # the zoo's selection and scaling
    images = pixels.reshape(-1, 8, 8)
    x = np.repeat(np.repeat(images, size // 8, axis=1), size // 8, axis=2)
    return {"input": np.ascontiguousarray(np.broadcast_to(x[:, None], (len(x), 3, size, size)))}, labels


def digits_sequences(n: int | None = None, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({"input": [n,64] int64 tokens}, [n,64] int64 next tokens): an image's pixels (0..16)
    in reading order; the target of position t is pixel t+1, the last one's is 0."""
    pixels, _ = digits(n, seed)  # the zoo's selection, scaled to [0, 1]
    tokens = np.rint(pixels * MAX_PIXEL).astype(np.int64)
    targets = np.concatenate([tokens[:, 1:], np.zeros((len(tokens), 1), np.int64)], axis=1)
    return {"input": tokens}, targets
