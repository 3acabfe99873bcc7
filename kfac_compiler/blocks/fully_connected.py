"""Fully connected layers (MatMul, Gemm; inputs [N, ..., in], outputs [N, ..., out]).

Every leading axis after the batch axis is a weight-sharing position (tokens: T = product
of those axes). Multi-use layers (R = len(layer.uses) > 1) pool their uses.

  kron / kron_indep   A = 1/(N T R) sum_{n,t,r} a~ a~^T      [in+1, in+1]
                      G = 1/N sum_{n,t,r} delta delta^T      [out, out]
  kron_in_diag        diag(A) kept   ([in+1])
  kron_out_diag       diag(G) kept   ([out])
  kron_both_diag      both diagonals
  kron_indep_in_diag, kron_indep_out_diag, kron_indep_both_diag: TF K-FAC's names for the
                      last three on multi-use layers (kron_indep with diagonal factors)
  diagonal            diag F = 1/N sum_n (sum_{t,r} delta a~^T)^2   [out, in+1]

a~ = (alpha * a, beta): attrs alpha (Gemm alpha) scales the input, beta (Gemm beta, default 1)
is the homogeneous coordinate's value; no coordinate when the layer has no bias. The matrix
[W | b] is W^T for weight_layout "in_out" (stored [in, out]) and W for "out_in".
"""
from __future__ import annotations

import numpy as np

from kfac_compiler.blocks._parts import Part, PartsBlock
from kfac_compiler.blocks.gram import GramStatistic
from kfac_compiler.blocks.kron import KronBlock
from kfac_compiler.blocks.ops import (
    emit_append_const,
    emit_concat,
    emit_dim,
    emit_examples,
    emit_live,
    emit_live_count,
    np_live,
    prod,
)
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.blocks.views import MatrixView
from kfac_compiler.errors import ConfigError


class FullyConnectedMixin:
    """Layout, homogeneous coordinate and the row views of a fully connected layer."""

    def _fc_setup(self) -> None:
        layer, shapes = self.layer, self.param_shapes
        w = layer.weight
        wshape = tuple(shapes[w])
        if len(wshape) != 2:
            raise ConfigError(f"layer {layer.name!r}: weight {w!r} has shape {wshape}, expected 2-d")
        layout = layer.attrs.get("weight_layout", "in_out")
        if layout == "in_out":
            n_in, n_out = wshape
        elif layout == "out_in":
            n_out, n_in = wshape
        else:
            raise ConfigError(f"layer {layer.name!r}: weight_layout {layout!r} is not 'in_out' or 'out_in'")
        self.n_in, self.n_out = int(n_in), int(n_out)
        alpha, beta = layer.attrs.get("alpha"), layer.attrs.get("beta")
        self.alpha = 1.0 if alpha is None else float(alpha)
        self.beta = 1.0 if beta is None else float(beta)
        bias = layer.bias
        self.has_bias = bias is not None
        self.view = MatrixView(
            w, wshape, (self.n_out, self.n_in), layout == "in_out", bias, shapes[bias] if bias else None
        )
        self.nA = self.n_in + int(self.has_bias)
        self.nG = self.n_out

    def _positions(self) -> int:
        """T * R: weight-sharing positions per example (for FLOP estimates): every input axis
        but the example axis and the features, and the example axis's other factors (a
        time-major [T, N, D] use has T, a merged [T*N, D] one T; they had counted 1)."""
        total = 0
        shapes = self.input_shapes or [self.layer.attrs.get("input_shape")] * len(self.layer.uses)
        layouts = self.layer.attrs.get("example_axes") or ()
        for u, shp in enumerate(shapes):
            if shp is None:
                total += 1
                continue
            lay = layouts[u][0] if u < len(layouts) and layouts[u] and layouts[u][0] else (0, 1, 1)
            axis, outer, inner = lay
            dims = [d for k, d in enumerate(list(shp)[:-1]) if k != axis]
            total += outer * inner * prod(d if isinstance(d, int) and d > 0 else 1 for d in dims)
        return max(total, 1)

    def positions_per_example(self) -> int:
        return self._positions()

    # ---- ONNX
    def _emit_rows(self, b, x):
        """[N, ..., in] -> a~ rows [N*T, in(+1)]."""
        x = b.scale(b.reshape(x, [-1, self.n_in]), self.alpha)
        return emit_append_const(b, x, 2, 1, self.beta) if self.has_bias else x

    def _emit_seq(self, b, x):
        """[N, ..., in] -> a~ [N, T, in(+1)]."""
        x = b.scale(b.reshape(x, [0, -1, self.n_in]), self.alpha)
        return emit_append_const(b, x, 3, 2, self.beta) if self.has_bias else x

    def _emit_live_rows(self, b, cotangents):
        """[R*N*T, 1]: 1.0 for the rows (positions of each use, in _emit_rows' order) some
        seed's cotangent depends on (ops.emit_live)."""
        return emit_concat(b, [emit_live(b, [b.reshape(d, [-1, self.n_out]) for d in ds], [1]) for ds in cotangents],
                           axis=0)

    def _emit_masked_rows(self, b, inputs, cotangents, masked):
        """(a~ rows [R*N*T, in(+1)], their count): every row, or with `masked` the rows some
        seed depends on (the others zeroed) and their number (ops.emit_live_count)."""
        X = emit_concat(b, [self._emit_rows(b, x) for x in inputs], axis=0)
        if not masked:
            return X, emit_dim(b, X, 0)
        live = self._emit_live_rows(b, cotangents)
        return b.mul(X, live), emit_live_count(b, live, masked)

    def _np_masked_rows(self, inputs, cotangents, masked):
        """numpy twin of _emit_masked_rows."""
        X = np.concatenate([self._np_rows(x) for x in inputs])
        if not masked:
            return X, len(X)
        live = np.concatenate([np_live([np.reshape(d, (-1, self.n_out)) for d in ds], [1]) for ds in cotangents])
        return X * live, max(float(live.sum()), 1.0)

    def _emit_delta_rows(self, b, cotangents):
        """All uses and seeds stacked: [S*R*N*T, out]."""
        return emit_concat(b, [b.reshape(d, [-1, self.n_out]) for ds in cotangents for d in ds], axis=0)

    def _emit_gradient_moments(self, b, inputs, cotangents, A_Q=None, G_Q=None):
        """1/N sum_{n,s} (G_Q^T g_ns A_Q)^2 elementwise, g_ns = sum over positions and uses of
        delta a~^T (seed s's per-example gradient [out, in+1]) in the bases A_Q, G_Q (None:
        the identity): the diagonal block's statistic, and ekfac's S in its eigenbases."""
        X = emit_concat(b, [self._emit_seq(b, x) for x in inputs], axis=1)  # [N, TR, in+1]
        n = emit_dim(b, X, 0)
        if A_Q is not None:
            X = b.matmul(X, A_Q)  # a' = A_Q^T a~ per row
        total = None
        for s in range(len(cotangents[0])):
            D = emit_concat(b, [b.reshape(cotangents[u][s], [0, -1, self.n_out]) for u in range(len(inputs))], axis=1)
            if G_Q is not None:
                D = b.matmul(D, G_Q)
            g = b.matmul(b.transpose(D, [0, 2, 1]), X)  # [N, out, in+1] per-example gradients
            sq = b.reduce_sum(b.mul(g, g), [0])
            total = sq if total is None else b.add(total, sq)
        return b.div(total, n)

    # ---- numpy
    def _np_rows(self, x):
        x = self.alpha * np.asarray(x, np.float64).reshape(-1, self.n_in)
        return np.concatenate([x, np.full((x.shape[0], 1), self.beta)], 1) if self.has_bias else x

    def _np_seq(self, x):
        x = np.asarray(x, np.float64)
        x = self.alpha * x.reshape(x.shape[0], -1, self.n_in)
        return np.concatenate([x, np.full((*x.shape[:2], 1), self.beta)], 2) if self.has_bias else x


class FullyConnectedKronBase(FullyConnectedMixin, KronBlock):
    layer_kinds = ("fully_connected",)
    masks_rows = True
    divides_by_examples = True

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._fc_setup()
        self._setup_exact_check()

    def stats_flops(self, batch: int) -> int:
        rows = batch * self._positions()
        fa = rows * self.nA * (1 if self.a_diag else self.nA)
        fg = rows * self.nG * (1 if self.g_diag else self.nG)
        return 2 * (fa + fg)

    def emit_statistics(self, b, inputs, cotangents, masked=False, examples=None):
        X, rows = self._emit_masked_rows(b, inputs, cotangents, masked)
        D = self._emit_delta_rows(b, cotangents)
        n = emit_examples(b, examples, cotangents)
        A = GramStatistic(X, rows, diag=self.a_diag)
        G = GramStatistic(D, n, diag=self.g_diag)
        return {"A": A, "G": G}

    def numpy_statistics(self, inputs, cotangents, masked=False):
        X, rows = self._np_masked_rows(inputs, cotangents, masked)
        D = np.concatenate([np.asarray(d, np.float64).reshape(-1, self.n_out) for ds in cotangents for d in ds])
        n = np.shape(cotangents[0][0])[0]
        A = (X * X).sum(0) / rows if self.a_diag else X.T @ X / rows
        G = (D * D).sum(0) / n if self.g_diag else D.T @ D / n
        return {"A": A, "G": G}


@register_block
class FullyConnectedKron(FullyConnectedKronBase):
    """K-FAC for a fully connected layer: F ~ A (x) G (pooled over uses when R > 1)."""

    name = "kron"
    uses = "single"
    menu_rank = 0


@register_block
class FullyConnectedKronIndep(FullyConnectedKronBase):
    """Multi-use layer, uses treated as independent (Martens, Ba & Johnson 2018): the same
    pooled factors as "kron"."""

    name = "kron_indep"
    uses = "multi"
    menu_rank = 0


@register_block
class FullyConnectedKronInDiag(FullyConnectedKronBase):
    name = "kron_in_diag"
    uses = "any"
    menu_rank = 11
    a_diag = True


@register_block
class FullyConnectedKronOutDiag(FullyConnectedKronBase):
    name = "kron_out_diag"
    uses = "any"
    menu_rank = 12
    g_diag = True


@register_block
class FullyConnectedKronBothDiag(FullyConnectedKronBase):
    name = "kron_both_diag"
    uses = "any"
    menu_rank = 13
    a_diag = True
    g_diag = True


# TF K-FAC's names on the multi-use menu (FullyConnectedMultiIndepFB with
# diagonal_approx_for_input / _output): kron_indep with a diagonal factor. The same class as
# kron_*_diag (pooled factors, one diagonal), which stays on the menu under its own name.
@register_block
class FullyConnectedKronIndepInDiag(FullyConnectedKronInDiag):
    name = "kron_indep_in_diag"
    uses = "multi"
    menu_rank = 3


@register_block
class FullyConnectedKronIndepOutDiag(FullyConnectedKronOutDiag):
    name = "kron_indep_out_diag"
    uses = "multi"
    menu_rank = 4


@register_block
class FullyConnectedKronIndepBothDiag(FullyConnectedKronBothDiag):
    name = "kron_indep_both_diag"
    uses = "multi"
    menu_rank = 5


@register_block
class FullyConnectedDiagonal(FullyConnectedMixin, PartsBlock):
    """Diagonal Fisher from per-example gradients: diag = 1/N sum_n g_n^2, g_n = sum over
    positions and uses of delta a~^T ([out, in+1], the matrix layout [W | b])."""

    name = "diagonal"
    layer_kinds = ("fully_connected",)
    uses = "any"
    example_rows = "movable"
    menu_rank = 10  # after kron and the series blocks

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._fc_setup()

    def parts(self):
        return [Part("diag", (self.nG, self.nA), "diag")]

    def stats_flops(self, batch: int) -> int:
        return 2 * batch * self._positions() * self.nA * self.nG + 2 * batch * self.nA * self.nG

    def emit_statistics(self, b, inputs, cotangents):
        return {"diag": self._emit_gradient_moments(b, inputs, cotangents)}

    def numpy_statistics(self, inputs, cotangents):
        X = np.concatenate([self._np_seq(x) for x in inputs], axis=1)
        total = 0.0
        for s in range(len(cotangents[0])):
            D = np.concatenate(
                [np.asarray(cotangents[u][s], np.float64).reshape(X.shape[0], -1, self.n_out) for u in range(len(inputs))],
                axis=1,
            )
            g = np.einsum("nto,nti->noi", D, X)
            total = total + (g * g).sum(0)
        return {"diag": total / X.shape[0]}

    def _emit_apply(self, b, vectors, mats):
        return self.view.emit_from(b, b.mul(self.view.emit_to(b, vectors), mats["diag"]))

    def _np_apply(self, vectors, mats):
        return self.view.np_from(self.view.np_to(vectors) * mats["diag"])
