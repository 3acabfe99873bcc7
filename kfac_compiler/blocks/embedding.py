"""Embedding lookups (Gather of a [vocab, dim] table by int64 indices of any shape [N, ...]).

The lookup is a fully connected layer with one-hot inputs and weight layout "in_out", so
the matrix [W] is W^T [dim, vocab] and A = E[onehot onehot^T] is diagonal:

  kron   A_diag[v] = 1/(N T) * #{(n, t): index[n, t] == v}     [vocab]  (no bias coordinate)
         G = 1/N sum_{n,t} delta delta^T                       [dim, dim]
         T = number of indices per example (product of the index tensor's non-batch axes);
         several uses are pooled (normalized by N * sum of their T).
"""
from __future__ import annotations

import numpy as np

from kfac_compiler.blocks.gram import GramStatistic
from kfac_compiler.blocks.kron import KronBlock
from kfac_compiler.blocks.ops import emit_concat, emit_examples, emit_live, emit_token_counts, np_live, np_token_counts
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.blocks.views import MatrixView
from kfac_compiler.errors import ConfigError


@register_block
class EmbeddingKron(KronBlock):
    """K-FAC for an embedding table with a diagonal input factor (index frequencies)."""

    name = "kron"
    layer_kinds = ("embedding",)
    menu_rank = 0
    a_diag = True
    masks_rows = True
    divides_by_examples = True

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        w = layer.weight
        wshape = tuple(int(d) for d in param_shapes[w])
        vocab = int(layer.attrs.get("vocab") or wshape[0])
        dim = int(layer.attrs.get("dim") or wshape[1])
        if wshape != (vocab, dim):
            raise ConfigError(f"layer {layer.name!r}: embedding {w!r} has shape {wshape}, attrs say {(vocab, dim)}")
        self.vocab, self.dim = vocab, dim
        self.nA, self.nG = vocab, dim
        self.view = MatrixView(w, wshape, (dim, vocab), transpose=True)
        self._setup_exact_check()

    def _positions(self) -> int:
        shapes = self.input_shapes or [self.layer.attrs.get("input_shape")] * len(self.layer.uses)
        total = 0
        for shp in shapes:
            t = 1
            for d in list(shp or [])[1:]:
                t *= d if isinstance(d, int) and d > 0 else 1
            total += t
        return max(total, 1)

    def forward_flops(self, batch: int) -> int:
        return 2 * batch * self._positions() * self.dim  # a gather (and a scatter-add backward)

    def stats_flops(self, batch: int) -> int:
        rows = batch * self._positions()
        return 2 * rows * self.dim * self.dim + 2 * rows

    def emit_statistics(self, b, inputs, cotangents, masked=False, examples=None):
        idx = emit_concat(b, [b.reshape(x, [-1]) for x in inputs], axis=0)
        live = None
        if masked:  # the lookups some seed's cotangent depends on
            live = emit_concat(b, [b.reshape(emit_live(b, [b.reshape(d, [-1, self.dim]) for d in ds], [1]), [-1])
                                   for ds in cotangents], axis=0)
        counts, rows = emit_token_counts(b, idx, self.vocab, live, masked)
        A = b.div(counts, rows)
        D = emit_concat(b, [b.reshape(d, [-1, self.dim]) for ds in cotangents for d in ds], axis=0)
        G = GramStatistic(D, emit_examples(b, examples, cotangents))
        return {"A": A, "G": G}

    def numpy_statistics(self, inputs, cotangents, masked=False):
        idx = np.concatenate([np.asarray(x).reshape(-1) for x in inputs]) % self.vocab
        live = None
        if masked:
            live = np.concatenate([np_live([np.reshape(d, (-1, self.dim)) for d in ds], [1]) for ds in cotangents])
        A = np_token_counts(idx, self.vocab, live)
        D = np.concatenate([np.asarray(d, np.float64).reshape(-1, self.dim) for ds in cotangents for d in ds])
        return {"A": A, "G": D.T @ D / np.shape(cotangents[0][0])[0]}
