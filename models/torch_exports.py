"""Real-sized models exported from PyTorch, for the GPU tests and benchmarks (optional: needs
torch; nothing in kfac_compiler imports this module).

    from kfac_compiler.models.torch_exports import resnet18, mobilenet_v2, gpt, export, digits_images, digits_sequences
    net = resnet18()                               # torchvision's ResNet-18 (10 classes)
    export(net, "resnet18.onnx", digits_images(8)[0]["input"])
    plan = kfac_compiler.compile("resnet18.onnx", loss="softmax_cross_entropy", output="logits")

* `resnet18`: torchvision.models.resnet18 when torchvision is installed, else a module-for-
  module twin (same layers and names). Exported in eval mode, so each
  BatchNormalization is a scale-and-shift layer over fixed running statistics, which
  `export` folds into the convolutions (the exporter's constant folding): what the compiler
  sees is 20 convolutions with biases and the dense head, 11.2M parameters.
* `mobilenet_v2`: torchvision.models.mobilenet_v2 when installed, else a module-for-module twin
  (inverted residuals with depthwise convolutions and ReLU6; 2.2M parameters at 10 classes).
* `gpt`: a GPT-2-style causal language model (token and position embeddings, pre-LN blocks of
  multi-head causal self-attention and a GELU MLP, a final LayerNorm, the output head tied to
  the token embedding).
* data from scikit-learn's digits: 32x32 RGB images (`digits_images`, the 8x8 digits scaled up
  by pixel repetition and copied to three channels) and pixel-intensity token sequences
  (`digits_sequences`: the 64 pixels of an image, values 0..16, as next-token targets; with
  `vocab=50257` spelled with 17 fixed random tokens of a GPT-2-sized vocabulary).

Parameters initialised to a constant (zero biases, unit LayerNorm and BatchNorm gains) get
noise of 1e-3 before the export: the exporters merge equal initializers into one tensor, which
the compiler would then train as one shared parameter (see `_distinct`).

The exports use the TorchScript exporter (`dynamo=False`) at opset 17, with a dynamic batch
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


# ------------------------------------------------------------------------------ ResNet-18 and -50
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


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)  # v1.5: the stride here
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class _ResNet(nn.Module):
    """torchvision.models.ResNet's layers, names and initialisation: `block` (_BasicBlock or
    _Bottleneck) repeated `layers` times in the four stages."""

    def __init__(self, block: type, layers: tuple[int, int, int, int], num_classes: int = 10):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._layer(block, 64, layers[0], 1)
        self.layer2 = self._layer(block, 128, layers[1], 2)
        self.layer3 = self._layer(block, 256, layers[2], 2)
        self.layer4 = self._layer(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _layer(self, block: type, planes: int, count: int, stride: int) -> nn.Sequential:
        out = planes * block.expansion
        down = None
        if stride != 1 or self.inplanes != out:
            down = nn.Sequential(nn.Conv2d(self.inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
        blocks = [block(self.inplanes, planes, stride, down)]
        self.inplanes = out
        blocks += [block(out, planes) for _ in range(1, count)]
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
        return _distinct(_ResNet(_BasicBlock, (2, 2, 2, 2), num_classes), seed)
    return _distinct(tv_resnet18(num_classes=num_classes), seed)


def resnet50(num_classes: int = 1000, seed: int = 0) -> nn.Module:
    """ResNet-50 (v1.5) with `num_classes` outputs: torchvision's layers without torchvision
    (bottlenecks [3, 4, 6, 3], 25.6M parameters at 1000 classes)."""
    torch.manual_seed(seed)
    return _distinct(_ResNet(_Bottleneck, (3, 4, 6, 3), num_classes), seed)


# ------------------------------------------------------------------------------ MobileNetV2
def _make_divisible(v: float, divisor: int = 8) -> int:
    """torchvision's channel rounding (never down by more than 10%)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class _ConvBNReLU6(nn.Sequential):
    """torchvision's Conv2dNormActivation(..., activation_layer=nn.ReLU6): conv, bn, relu6."""

    def __init__(self, inp: int, oup: int, kernel_size: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(nn.Conv2d(inp, oup, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(oup), nn.ReLU6(inplace=True))


class _InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = [] if expand_ratio == 1 else [_ConvBNReLU6(inp, hidden, kernel_size=1)]
        layers += [_ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, oup, 1, 1, 0, bias=False), nn.BatchNorm2d(oup)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class _MobileNetV2(nn.Module):
    """torchvision.models.mobilenet_v2's layers, names and initialisation (width 1.0)."""

    SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
               (6, 320, 1, 1))  # expansion t, channels c, repeats n, first stride s

    def __init__(self, num_classes: int = 10, dropout: float = 0.2):
        super().__init__()
        inp, last = _make_divisible(32), _make_divisible(1280)
        features: list[nn.Module] = [_ConvBNReLU6(3, inp, stride=2)]
        for t, c, n, s in self.SETTING:
            out = _make_divisible(c)
            for i in range(n):
                features.append(_InvertedResidual(inp, out, s if i == 0 else 1, t))
                inp = out
        features.append(_ConvBNReLU6(inp, last, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(last, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 10, seed: int = 0) -> nn.Module:
    """MobileNetV2 with `num_classes` outputs (torchvision's when installed, else the twin):
    2.2M parameters at 10 classes, 3.5M at ImageNet's 1000."""
    torch.manual_seed(seed)
    try:
        from torchvision.models import mobilenet_v2 as tv_mobilenet_v2
    except ImportError:
        return _distinct(_MobileNetV2(num_classes), seed)
    return _distinct(tv_mobilenet_v2(num_classes=num_classes), seed)


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


def digits_sequences(n: int | None = None, seed: int = 0, vocab: int = MAX_PIXEL + 1
                     ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({"input": [n,64] int64 tokens}, [n,64] int64 next tokens): an image's pixels (0..16)
    in reading order; the target of position t is pixel t+1, the last one's is 0. With a
    larger `vocab`, the 17 pixel values are mapped into 0..vocab-1 by a fixed random injection
    (`vocab_injection`), so that a large-vocabulary LM gets a learnable task: the same
    sequences, spelled with 17 of its tokens."""
    pixels, _ = digits(n, seed)  # the zoo's selection, scaled to [0, 1]
    tokens = np.rint(pixels * MAX_PIXEL).astype(np.int64)
    targets = np.concatenate([tokens[:, 1:], np.zeros((len(tokens), 1), np.int64)], axis=1)
    if vocab != MAX_PIXEL + 1:
        spell = vocab_injection(vocab)
        tokens, targets = spell[tokens], spell[targets]
    return {"input": tokens}, targets


def vocab_injection(vocab: int) -> np.ndarray:
    """[17] distinct token ids in 0..vocab-1 (pixel value -> token), the same for every call."""
    if vocab < MAX_PIXEL + 1:
        raise ValueError(f"vocab must be at least {MAX_PIXEL + 1} (the pixel values), got {vocab}")
    return np.random.default_rng(0).choice(vocab, MAX_PIXEL + 1, replace=False).astype(np.int64)
