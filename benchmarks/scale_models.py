"""The models of the scale benchmark (bench_scale.py), built the same way by the parent (which
exports them) and by the torch peers' worker processes (which load the parent's weights).

Each entry: a builder (torch module, inputs [N, ...], targets), the default batch, the
layers kfac-pytorch must skip (regular expressions on module names, from the module), and a
note for the results table.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

# GPT-2's vocabulary size: the large-vocabulary LM's output layer and tied embedding.
GPT2_VOCAB = 50257


@dataclass(frozen=True)
class ScaleModel:
    build: Callable[[], tuple]  # () -> (module, inputs array, targets array)
    batch: int
    note: str
    kfac_pytorch_skip: Callable[[object], list[str]] = field(default=lambda net: [])


def _depthwise(net) -> list[str]:
    """kfac-pytorch treats a grouped Conv2d as a dense one (an A factor in_channels * k * k
    wide: 8640 for MobileNetV2's widest depthwise conv, against a [960, 9] gradient, so its
    preconditioning fails on the shapes): skip them, their weights then get its SGD only."""
    from torch import nn

    return [f"^{re.escape(n)}$" for n, m in net.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1]


def _resnet18():
    from kfac_compiler.models import torch_exports as te

    inputs, y = te.digits_images()
    return te.resnet18(), inputs["input"], y


def _calibrated(net, x, examples: int = 512, batch: int = 64):
    """The module with its BatchNorm running statistics set to the batch statistics of the
    first `examples` inputs. The export freezes BatchNorm on its running statistics; a fresh
    MobileNetV2's (mean 0, variance 1) leave its depthwise convolutions' small fan-out
    initialisation unnormalized, the output is constant, and Adam (ours and torch's) stayed
    at the loss ln 10 for 100 steps."""
    import torch

    bns = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the calibration batches
    net.train()
    with torch.no_grad():
        for s in range(0, min(examples, len(x)), batch):
            net(torch.from_numpy(x[s:s + batch]))
    for m in bns:
        m.momentum = 0.1
    return net.eval()


def _mobilenet_v2():
    from kfac_compiler.models import torch_exports as te

    inputs, y = te.digits_images()
    return _calibrated(te.mobilenet_v2(), inputs["input"]), inputs["input"], y


def _gpt_large_vocab():
    from kfac_compiler.models import torch_exports as te

    inputs, y = te.digits_sequences(vocab=GPT2_VOCAB)
    return te.gpt(vocab=GPT2_VOCAB, d_model=64, n_layer=2, n_head=2), inputs["input"], y


MODELS: dict[str, ScaleModel] = {
    "resnet18": ScaleModel(_resnet18, 32, "torchvision's ResNet-18 (twin), 10 classes, digits as 32x32 RGB"),
    "mobilenet_v2": ScaleModel(_mobilenet_v2, 32, "torchvision's MobileNetV2 (twin), 10 classes, digits as 32x32 RGB; "
                               "BatchNorm statistics calibrated on 512 images before the export",
                               kfac_pytorch_skip=_depthwise),
    # batch 8: at 32 sequences of 64 tokens one [N, 64, 50257] float32 logits tensor is 412 MB
    # and our K-FAC step's peak passed 14 GB on the 23 GB reference machine
    "gpt_large_vocab": ScaleModel(
        _gpt_large_vocab, 8,
        f"GPT-2-style LM, vocab {GPT2_VOCAB} (tied head), width 64, 2 layers, 2 heads; digits pixel "
        "sequences spelled with 17 fixed random tokens of the vocabulary (te.digits_sequences(vocab=...))",
        kfac_pytorch_skip=lambda net: ["^head$"]),  # its [V, V] output factor would be 10 GB
}


def build(name: str):
    """(module, inputs, targets) of model `name`; SystemExit naming the choices otherwise."""
    if name not in MODELS:
        raise SystemExit(f"bench_scale: unknown model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name].build()
