"""The Fisher-block contract and its registry.

A block owns the curvature of one Layer (its linked parameters). It says which factors it
keeps (shapes, for the plan), emits the ONNX nodes that estimate them from one batch, emits
the nodes that refresh their damped inverses, and emits the nodes that multiply a gradient
by the block's curvature, its inverse or a matrix power.

Conventions (docs/conventions.md): N batch size, T weight-sharing positions of a use, R
uses. a~ is the layer input (conv: the receptive-field patch ordered like the flattened
weight (C_in/group, *kernel)) with a homogeneous coordinate appended LAST for the bias.
delta is the per-example loss gradient w.r.t. the layer output (N times the gradient of the
mean loss). A = 1/(N T R) sum a~ a~^T, G = 1/N sum delta delta^T, F_block ~ A (x) G for the
matrix [W | b] (rows outputs, columns inputs then bias).
"""
from __future__ import annotations

from typing import ClassVar

from kfac_compiler.builder import GraphBuilder
from kfac_compiler.ir import FactorSpec, Layer

BLOCKS: dict[str, type["FisherBlock"]] = {}


def register_block(cls: type["FisherBlock"]) -> type["FisherBlock"]:
    """Class decorator: make `cls` available under `cls.name` for its layer kinds."""
    BLOCKS[cls.name] = cls
    return cls


class FisherBlock:
    """Base class. Subclasses set `name` and `layer_kinds` and implement the emit_* methods.

    `param_shapes` maps each of the layer's parameter names to its initializer shape.
    Tensor names passed to and returned by the emit_* methods live in the graph that the
    GraphBuilder `b` appends to.
    """

    name: ClassVar[str] = ""
    layer_kinds: ClassVar[tuple[str, ...]] = ()

    def __init__(self, layer: Layer, param_shapes: dict[str, tuple[int, ...]]) -> None:
        self.layer = layer
        self.param_shapes = param_shapes

    # What the plan records -------------------------------------------------
    def factor_specs(self) -> list[FactorSpec]:
        """The factors kept as moving averages (names unique within the block)."""
        raise NotImplementedError

    def inverse_specs(self) -> list[FactorSpec]:
        """The state refreshed by the inverse update (damped inverses, eigenbases, ...)."""
        raise NotImplementedError

    def stats_flops(self, batch: int) -> int:
        """FLOPs of one statistics update for a batch of `batch` examples."""
        raise NotImplementedError

    def inverse_flops(self) -> int:
        """FLOPs of one inverse update."""
        raise NotImplementedError

    # What the emitted graphs compute ---------------------------------------
    def emit_statistics(
        self, b: GraphBuilder, inputs: list[str], cotangents: list[list[str]]
    ) -> dict[str, str]:
        """One batch's estimate of every factor.

        inputs[u]: forward value of layer.uses[u].input. cotangents[u][s]: per-example loss
        gradient delta w.r.t. layer.uses[u].output for seed s, already scaled so that the
        factor is the SUM over seeds (the estimator folds 1/num_samples in).
        Returns {factor name: tensor name} for every factor_specs() entry.
        """
        raise NotImplementedError

    def emit_inverse(self, b: GraphBuilder, factors: dict[str, str], damping: str, method: str) -> dict[str, str]:
        """Damped inverse state from the (moving-average) factors; damping is a scalar tensor."""
        raise NotImplementedError

    def emit_multiply_inverse(
        self, b: GraphBuilder, grads: dict[str, str], inverses: dict[str, str]
    ) -> dict[str, str]:
        """(F + damping)^-1 g for the block's parameters, g keyed by parameter name."""
        raise NotImplementedError

    def emit_multiply(
        self, b: GraphBuilder, vectors: dict[str, str], factors: dict[str, str], damping: str
    ) -> dict[str, str]:
        """(F + damping) v for the block's parameters."""
        raise NotImplementedError


def make_block(layer: Layer, param_shapes: dict[str, tuple[int, ...]]) -> FisherBlock:
    """The block object for a layer whose `approximation` is set."""
    from kfac_compiler.errors import ConfigError

    cls = BLOCKS.get(layer.approximation or "")
    if cls is None or layer.kind not in cls.layer_kinds:
        raise ConfigError(f"layer {layer.name!r}: no Fisher block {layer.approximation!r} for kind {layer.kind!r}")
    return cls(layer, param_shapes)
