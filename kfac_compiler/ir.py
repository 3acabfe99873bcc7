"""The compiler's intermediate structures, passed from one pass to the next.

    Graph (onnx.ModelProto, canonical) --match--> LayerMatch list --link--> Layer list
    --choose blocks--> Layer list with `approximation` set --emit--> Plan

All are frozen dataclasses so that passes cannot mutate their input; use
`dataclasses.replace` to derive a new value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Layer kinds the pattern library knows (the generic fallback claims everything else).
LAYER_KINDS = (
    "fully_connected",
    "conv",
    "weight_norm_conv",  # a Conv whose weight is g v / ||v|| computed at run time (torch's weight_norm)
    "depthwise_conv",
    "conv_transpose",
    "embedding",
    "scale_and_shift",
    "broadcast",  # a parameter broadcast over the batch (position table, class token, lone bias)
    "tied_embedding",  # made by linking (an embedding table also read by the output head), no pattern
    "generic",
)


@dataclass(frozen=True)
class LayerUse:
    """One application of a layer's parameters in the graph.

    `input` is the tensor holding the layer input activations a (fully connected: [..., in];
    conv: [N, C_in, *spatial]; embedding: the integer indices; scale_and_shift: the tensor
    being scaled) and `output` the pre-activation output s, *after* the bias is added
    (fully connected: [..., out]; conv: [N, C_out, *spatial_out]). The curvature factors are
    built from a (forward value of `input`) and the cotangent of `output`.
    """

    nodes: tuple[str, ...]
    input: str
    output: str


@dataclass(frozen=True)
class LayerMatch:
    """A pattern match: one use of a weight (and optional bias) by one layer kind.

    `attrs` carries what the curvature blocks need to read the weight as the K-FAC matrix
    [W | b] (rows: outputs, columns: inputs then bias):
      fully_connected: weight_layout "in_out" (x @ W, Gemm transB=0) or "out_in" (Gemm
        transB=1); alpha (scales a), beta (the homogeneous coordinate's value for the bias).
      conv / depthwise_conv: kernel_shape, strides, pads (begin..., end...), dilations,
        group; weight [C_out, C_in/group, *kernel].
      embedding: vocab, dim (weight [vocab, dim], read as "in_out" with one-hot inputs).
      scale_and_shift: axes the scale broadcasts over, and `scale_input` (the normalized
        tensor that the scale multiplies, equal to `use.input`).
      broadcast: `scale_axes` (the output axes along which the tensor broadcast over the
        batch varies: the parameter, or its Gather), `output_rank`, and `indexed` for a Gather
        with batch-less indices (then `use.input` is the indices; else the data the parameter
        is added to, or the parameter an Expand broadcasts).
      weight_norm_conv: the conv's, `weight` is v, plus `weight_norm` {"g": the gain, "axes":
        the norm's axes} and `extra_params` (g,): parameters of the layer after weight and bias.
    """

    kind: str
    pattern: str
    weight: str
    bias: str | None
    use: LayerUse
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Layer:
    """A set of linked parameters with one Fisher block.

    `params` are initializer names, weight first, then the bias (if any), then
    `attrs["extra_params"]` (a weight norm's g). `uses` has one entry per application
    (a multi-use layer, e.g. an unrolled RNN weight, has several). `approximation` is the
    Fisher block kind (see kfac_compiler.blocks), set by the block-choice pass.
    """

    name: str
    kind: str
    params: tuple[str, ...]
    uses: tuple[LayerUse, ...]
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    approximation: str | None = None
    pattern: str = ""
    notes: tuple[str, ...] = ()

    @property
    def weight(self) -> str:
        return self.params[0]

    @property
    def bias(self) -> str | None:
        if len(self.params) < 2 or self.kind == "generic" or self.params[1] in self.attrs.get("extra_params", ()):
            return None
        return self.params[1]

    @property
    def num_uses(self) -> int:
        return len(self.uses)


@dataclass(frozen=True)
class FactorSpec:
    """One curvature factor (or diagonal) kept by a block, as stored in the plan."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    role: str = ""  # "A", "G", "diag", "full", ...
    init: str = ""  # initial value of an inverse-state slot: "" / "identity" or "zeros"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * 4 if self.dtype == "float32" else n * 8
