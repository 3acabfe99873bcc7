"""The declarative pattern library: which ONNX subgraphs are which layer kinds.

A `Pattern` is a small graph of `PNode`s (an ONNX op with an optional attribute predicate,
or PARAM: a trainable parameter initializer) and `PEdge`s (producer -> consumer input slot;
several slots for commutative ops such as Add and Mul). It names which PARAM node is the
weight and which the bias, where the layer input is read (a node's input slot, or None: "the
one input of that node that the pattern does not cover") and which node's first output is
the layer output (after the bias). `where(binding)` checks shapes; `attrs(binding)` fills
LayerMatch.attrs (see kfac_compiler.ir) and may raise NoMatch(reason) to reject a match.

Patterns are matched with networkx.algorithms.isomorphism.MultiDiGraphMatcher
(subgraph monomorphisms) on GraphView.to_networkx() by kfac_compiler.passes.match_layers.
Variants are enumerated (one Pattern each): Gemm transB 0/1 with or without bias C,
MatMul / MatMul+Add / Transpose(W)+MatMul (tied heads) / with Add, Conv 1-d/2-d/3-d with or
without bias (plain, grouped, depthwise), Gather embedding, LayerNormalization,
BatchNormalization (inference and training form), InstanceNormalization, GroupNormalization,
Mul+Add scale-and-shift and parameters broadcast over the batch (Add, Gather + Add, Expand).

Register your own with `register_pattern(Pattern(...))`; see docs/frontend.md.

Modules: core.py (the machinery, the registry, predicates), builtin.py (the library).
"""
from kfac_compiler.patterns.builtin import (  # registers the library
    BUILTIN_PATTERN_NAMES,
    bias_broadcast_matches,
    broadcast_axes,
)
from kfac_compiler.patterns.core import (
    PARAM,
    Binding,
    NoMatch,
    Pattern,
    PEdge,
    PNode,
    all_of,
    attr_eq,
    num_inputs,
    param_rank,
    patterns,
    register_pattern,
    unregister_pattern,
)

__all__ = [
    "PARAM", "Binding", "NoMatch", "PEdge", "PNode", "Pattern", "all_of", "attr_eq", "bias_broadcast_matches",
    "broadcast_axes",
    "num_inputs", "param_rank", "patterns", "register_pattern", "unregister_pattern", "BUILTIN_PATTERN_NAMES",
]
