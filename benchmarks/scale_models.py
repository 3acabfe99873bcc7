"""The models of the scale benchmark (bench_scale.py), built the same way by the parent (which
exports them) and by the torch peers' worker processes (which load the parent's weights).

Each entry: a builder (torch module, inputs [N, ...], targets), the default batch, the
kfac-pytorch layers to skip, and a note for the results table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# GPT-2's vocabulary size: the large-vocabulary LM's output layer and tied embedding.
GPT2_VOCAB = 50257


@dataclass(frozen=True)
class ScaleModel:
    build: Callable[[], tuple]  # () -> (module, inputs array, targets array)
    batch: int
    note: str
    kfac_pytorch_skip: tuple[str, ...] = field(default=())


def _resnet18():
    from kfac_compiler.models import torch_exports as te

    inputs, y = te.digits_images()
    return te.resnet18(), inputs["input"], y


def _mobilenet_v2():
    from kfac_compiler.models import torch_exports as te

    inputs, y = te.digits_images()
    return te.mobilenet_v2(), inputs["input"], y


def _gpt_large_vocab():
    from kfac_compiler.models import torch_exports as te

    inputs, y = te.digits_sequences(vocab=GPT2_VOCAB)
    return te.gpt(vocab=GPT2_VOCAB, d_model=64, n_layer=2, n_head=2), inputs["input"], y


MODELS: dict[str, ScaleModel] = {
    "resnet18": ScaleModel(_resnet18, 32, "torchvision's ResNet-18 (twin), 10 classes, digits as 32x32 RGB"),
    "mobilenet_v2": ScaleModel(_mobilenet_v2, 32, "torchvision's MobileNetV2 (twin), 10 classes, digits as 32x32 RGB"),
    # batch 8: at 32 sequences of 64 tokens one [N, 64, 50257] float32 logits tensor is 412 MB
    # and our K-FAC step's peak passed 14 GB on the 23 GB reference machine
    "gpt_large_vocab": ScaleModel(
        _gpt_large_vocab, 8,
        f"GPT-2-style LM, vocab {GPT2_VOCAB} (tied head), width 64, 2 layers, 2 heads; digits pixel "
        "sequences spelled with 17 fixed random tokens of the vocabulary (te.digits_sequences(vocab=...))",
        kfac_pytorch_skip=("head",)),  # its [V, V] output factor would be 10 GB
}


def build(name: str):
    """(module, inputs, targets) of model `name`; SystemExit naming the choices otherwise."""
    if name not in MODELS:
        raise SystemExit(f"bench_scale: unknown model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name].build()
