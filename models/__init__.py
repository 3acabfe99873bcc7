"""Model zoo: small ONNX models (built with onnx.helper) for the 8x8 digits data.

Every model has graph input ``"input"`` (dynamic batch dim ``"N"``) and graph
output ``"logits"`` (pre-activation; the loss is applied by the compiler).
See ``models/README.md`` for architectures and parameter lists.

>>> from kfac_compiler.models import ZOO, get_model
>>> model = get_model("mlp_classifier", seed=0)
>>> inputs, targets = ZOO["mlp_classifier"].make_data(n=32)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from kfac_compiler.losses import LOSSES  # the registry: a zoo entry may name any registered loss

from . import data
from .autoencoder import build_digits_autoencoder
from .cnn import build_depthwise_cnn, build_small_cnn
from .mlp import build_mlp_classifier
from .rnn import build_unrolled_rnn
from .transformer import build_transformer_block

MakeData = Callable[..., tuple[dict[str, np.ndarray], np.ndarray]]


@dataclass(frozen=True)
class ZooEntry:
    """A zoo model: builder, loss name and data factory."""

    name: str
    build: Callable[..., onnx.ModelProto]
    loss: str
    description: str
    make_data: MakeData
    input_name: str = "input"
    output_name: str = "logits"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; expected one of {tuple(LOSSES)}")


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry(
            name="mlp_classifier",
            build=build_mlp_classifier,
            loss="softmax_cross_entropy",
            description="64-128-128-10 ReLU MLP, Gemm(transB=1) layers with bias; input [N,64].",
            make_data=data.make_flat_classification,
        ),
        ZooEntry(
            name="digits_autoencoder",
            build=build_digits_autoencoder,
            loss="sigmoid_cross_entropy",
            description="64-256-128-32-128-256-64 tanh autoencoder, MatMul+Add layers; reconstructs pixels.",
            make_data=data.make_reconstruction,
        ),
        ZooEntry(
            name="small_cnn",
            build=build_small_cnn,
            loss="softmax_cross_entropy",
            description="Conv(1->8)-ReLU-MaxPool-Conv(8->16)-ReLU-GAP-Gemm(16->10); input [N,1,8,8].",
            make_data=data.make_image_classification,
        ),
        ZooEntry(
            name="depthwise_cnn",
            build=build_depthwise_cnn,
            loss="softmax_cross_entropy",
            description="Conv+BN-ReLU, depthwise 3x3, pointwise 1x1, AvgPool, Gemm(256->10); input [N,1,8,8].",
            make_data=data.make_image_classification,
        ),
        ZooEntry(
            name="unrolled_rnn",
            build=build_unrolled_rnn,
            loss="softmax_cross_entropy",
            description="Tanh RNN (H=32) unrolled over the 8 image rows with shared W_x/W_h/b; input [N,8,8].",
            make_data=data.make_sequence_classification,
        ),
        ZooEntry(
            name="transformer_block",
            build=build_transformer_block,
            loss="softmax_cross_entropy",
            description="1-block causal LM (D=16, V=17, T=8) over row pixel tokens, tied embedding head.",
            make_data=data.make_row_tokens,
        ),
    ]
}


def list_models() -> list[str]:
    """Names of all zoo models, in registry order."""
    return list(ZOO)


def get_entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; available: {list_models()}") from None


def get_model(name: str, **kw) -> onnx.ModelProto:
    """Build zoo model ``name``; ``kw`` (seed, size kwargs) go to its builder."""
    return get_entry(name).build(**kw)


def save_model(name: str, path: str | os.PathLike, **kw) -> str:
    """Build zoo model ``name`` and save it to ``path``; returns the path as str."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    onnx.save(get_model(name, **kw), path)
    return path


__all__ = [
    "LOSSES", "ZOO", "ZooEntry", "get_entry", "get_model", "list_models", "save_model",
    "build_mlp_classifier", "build_digits_autoencoder", "build_small_cnn",
    "build_depthwise_cnn", "build_unrolled_rnn", "build_transformer_block", "data",
]
