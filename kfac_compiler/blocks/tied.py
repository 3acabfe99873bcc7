"""Tied embeddings: one table E [V, D] read by a lookup Gather(E, ids) and, transposed, by
the output head logits = h E^T (MatMul(h, Transpose(E)) or Gemm(h, E, transB=1)).

The matrix is the embedding's: M = E^T [D, V] (rows D, columns V; vec column-major, so
L (x) R acts as vec(X) -> vec(R X L) with L [V, V] on the columns, R [D, D] on the rows).
Each use contributes a Kronecker term on vec(M) (docs/conventions.md, "Tied embeddings"):

  lookup  A_V (x) G_D   A_V[v] = 1/(N T_l) #{index == v}  [V] (diagonal), G_D = 1/N sum delta_l delta_l^T
  head    G_V (x) A_D   A_D = 1/(N T_h) sum a a^T (a = alpha h) [D, D], G_V = 1/N sum delta_h delta_h^T [V, V]

(uses of one kind are pooled as the embedding / fully connected blocks pool theirs; the
cross term between the two uses' gradients is dropped). These four are the factors kept as
moving averages. The block's curvature is ONE Kronecker product L (x) R ~ K = L_1 (x) R_1 +
L_2 (x) R_2 (L_1 = diag A_V, R_1 = G_D, L_2 = G_V, R_2 = A_D) made from them at inverse /
multiply time; option `combine`:

  "frobenius" (default): the nearest Kronecker product argmin ||K - L (x) R||_F, closed form:
      L = c_1 L_1 + c_2 L_2, c the Perron eigenvector of M = Gb Ga (2 x 2 Gram matrices
      Ga_ij = <L_i, L_j>_F, Gb_ij = <R_i, R_j>_F); R = d_1 R_1 + d_2 R_2, d = Ga c / (c^T Ga c).
      Exact whenever K is a Kronecker product (a use contributing nothing, G_D ~ A_D, ...).
  "trace": L = sqrt(r_1/l_1) L_1 + sqrt(r_2/l_2) L_2, R = sqrt(l_1/r_1) R_1 + sqrt(l_2/r_2) R_2
      (l_i = tr L_i, r_i = tr R_i): K plus PSD cross terms of least trace, 2 sqrt(tr K_1 tr K_2).

A term with a zero trace (a use that contributes nothing) is dropped. L and R are then damped
and inverted like the Kronecker blocks' A and G ("pi" split; "exact" damping on the host).

  kron_tied             L full [V, V] (G_V full)
  kron_tied_vocab_diag  L diagonal [V] (G_V kept as its diagonal; for large vocabularies)
  diagonal              diag F = 1/N sum_{n,s} g_n^2 with the per-example gradient
                        g_n = sum_lookups onehot^T delta_l + sum_heads delta_h^T a  (all uses)
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from kfac_compiler import linalg
from kfac_compiler.blocks._parts import Part, PartsBlock
from kfac_compiler.blocks.gram import GramStatistic
from kfac_compiler.blocks.kron import KronBlock
from kfac_compiler.blocks.ops import (
    emit_concat,
    emit_dim,
    emit_examples,
    emit_live,
    emit_live_count,
    emit_token_counts,
    np_live,
    np_token_counts,
    prod,
)
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.blocks.views import MatrixView
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec
from kfac_compiler.linalg.methods import PI_EPS

# the stored factors: lookup A_V, G_D; head A_D, G_V
TIED_FACTORS = ("A_V", "G_D", "A_D", "G_V")
COMBINE = ("frobenius", "trace")
NKP_TIE = 1e-6  # relative size of the eigenvector below which M is taken as a multiple of I
# the diagonal block's per-example gradients are formed this many elements ([chunk, V, D]) at a
# time (at least one example): 16 MB in float32
CHUNK_ELEMENTS = 1 << 22


def np_tied_coefficients(traces_l, traces_r) -> tuple[list[float], list[float]]:
    """combine="trace": (c_i, d_i) with L = sum c_i L_i, R = sum d_i R_i: c_i = sqrt(r_i/l_i),
    d_i = sqrt(l_i/r_i) (l_i = tr L_i, r_i = tr R_i), both 0 for a term whose traces are not
    both positive and finite."""
    cs, ds = [], []
    for l, r in zip(traces_l, traces_r):
        good = np.isfinite(l) and np.isfinite(r) and l > PI_EPS and r > PI_EPS
        cs.append(float(np.sqrt(r / l)) if good else 0.0)
        ds.append(float(np.sqrt(l / r)) if good else 0.0)
    return cs, ds


def np_nkp_coefficients(Ga, Gb) -> tuple[list[float], list[float]]:
    """combine="frobenius": the nearest Kronecker product (Frobenius) to L_1 (x) R_1 + L_2 (x) R_2
    is (c_1 L_1 + c_2 L_2) (x) (d_1 R_1 + d_2 R_2) with c the Perron eigenvector of M = Gb Ga
    (Ga[i, j] = <L_i, L_j>_F, Gb[i, j] = <R_i, R_j>_F, 2 x 2, non-negative for PSD factors)
    and d = Ga c / (c^T Ga c). Ga, Gb are scaled by their traces first (c and d do not change).
    Returns zeros when both terms vanish."""
    Ga, Gb = np.asarray(Ga, np.float64), np.asarray(Gb, np.float64)
    ta, tb = np.trace(Ga), np.trace(Gb)
    if not (np.isfinite(ta) and np.isfinite(tb) and ta > PI_EPS and tb > PI_EPS):
        return [0.0, 0.0], [0.0, 0.0]
    Ga, Gb = Ga / ta, Gb / tb
    M = Gb @ Ga
    lam = (M[0, 0] + M[1, 1]) / 2 + np.sqrt(((M[0, 0] - M[1, 1]) / 2) ** 2 + M[0, 1] * M[1, 0])
    c = np.array([M[0, 1] + lam - M[1, 1], M[1, 0] + lam - M[0, 0]])
    if c.sum() <= NKP_TIE * lam:  # M = m I: every c is optimal
        c = np.ones(2)
    q = c @ Ga @ c
    if not q > PI_EPS:
        return [0.0, 0.0], [0.0, 0.0]
    return [float(x) for x in c], [float(x) for x in Ga @ c / q]


class TiedMixin:
    """Shapes, use partition and the per-use statistics of a tied embedding layer."""

    def _tied_setup(self) -> None:
        layer = self.layer
        w = layer.weight
        wshape = tuple(int(d) for d in self.param_shapes[w])
        vocab = int(layer.attrs.get("vocab") or wshape[0])
        dim = int(layer.attrs.get("dim") or wshape[1])
        if wshape != (vocab, dim):
            raise ConfigError(f"layer {layer.name!r}: tied embedding {w!r} has shape {wshape}, attrs say {(vocab, dim)}")
        self.vocab, self.dim = vocab, dim
        kinds = tuple(layer.attrs.get("use_kinds") or ())
        if len(kinds) != len(layer.uses):
            raise ConfigError(f"layer {layer.name!r}: attrs use_kinds {kinds} do not name its {len(layer.uses)} uses")
        alphas = tuple(layer.attrs.get("alphas") or (1.0,) * len(kinds))
        self.lookups = [u for u, k in enumerate(kinds) if k == "embedding"]
        self.heads = [u for u, k in enumerate(kinds) if k == "fully_connected"]
        if not self.lookups or not self.heads or len(self.lookups) + len(self.heads) != len(kinds):
            raise ConfigError(
                f"layer {layer.name!r}: a tied embedding needs lookup (embedding) and head (fully_connected) uses, "
                f"got {kinds}"
            )
        self.alphas = [float(a) for a in alphas]
        self.view = MatrixView(w, wshape, (dim, vocab), transpose=True)

    def _rows_per_example(self, uses) -> int:
        shapes = self.input_shapes or [self.layer.attrs.get("input_shape")] * len(self.layer.uses)
        total = 0
        for u in uses:
            shp = list(shapes[u] or []) if u < len(shapes) else []
            dims = shp[1:] if self.layer.attrs["use_kinds"][u] == "embedding" else shp[1:-1]
            total += prod(d if isinstance(d, int) and d > 0 else 1 for d in dims)
        return max(total, 1)

    def forward_flops(self, batch: int) -> int:
        """The lookups' gathers and the heads' [rows, D] x [D, V] products."""
        lookups, heads = self._rows_per_example(self.lookups), self._rows_per_example(self.heads)
        return 2 * batch * (lookups * self.dim + heads * self.dim * self.vocab)

    # ---- ONNX pieces
    def _emit_indices(self, b, inputs):
        return emit_concat(b, [b.reshape(inputs[u], [-1]) for u in self.lookups], axis=0)

    def _emit_head_rows(self, b, inputs):
        return emit_concat(b, [b.scale(b.reshape(inputs[u], [-1, self.dim]), self.alphas[u]) for u in self.heads], axis=0)

    def _emit_delta_rows(self, b, cotangents, uses, width):
        return emit_concat(b, [b.reshape(d, [-1, width]) for u in uses for d in cotangents[u]], axis=0)

    # ---- numpy pieces
    def _np_indices(self, inputs):
        return np.concatenate([np.asarray(inputs[u]).reshape(-1) for u in self.lookups]) % self.vocab

    def _np_head_rows(self, inputs):
        return np.concatenate([self.alphas[u] * np.asarray(inputs[u], np.float64).reshape(-1, self.dim) for u in self.heads])

    def _np_delta_rows(self, cotangents, uses, width):
        return np.concatenate([np.asarray(d, np.float64).reshape(-1, width) for u in uses for d in cotangents[u]])


class TiedKronBase(TiedMixin, KronBlock):
    """One Kronecker product L (x) R from the lookup and head terms (module docstring).
    Parts (what is damped and inverted): "A" = L [V, V] (or [V]), "G" = R [D, D]."""

    layer_kinds = ("tied_embedding",)
    masks_rows = True
    divides_by_examples = True
    vocab_diag: bool = False

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._tied_setup()
        self.a_diag = self.vocab_diag
        self.nA, self.nG = self.vocab, self.dim
        self.combine = options.get("combine", "frobenius")
        if self.combine not in COMBINE:
            raise ConfigError(f"layer {layer.name!r}: combine {self.combine!r} is not one of {', '.join(COMBINE)}")
        self._setup_exact_check()

    # ---- plan records: the four per-use factors are the moving averages
    def factor_specs(self) -> list[FactorSpec]:
        V, D = self.vocab, self.dim
        return [
            FactorSpec("A_V", (V,), role="A_V"),
            FactorSpec("G_D", (D, D), role="G_D"),
            FactorSpec("A_D", (D, D), role="A_D"),
            FactorSpec("G_V", (V,) if self.vocab_diag else (V, V), role="G_V"),
        ]

    def stats_flops(self, batch: int) -> int:
        rl, rh = batch * self._rows_per_example(self.lookups), batch * self._rows_per_example(self.heads)
        return 2 * rl * (self.dim**2 + 1) + 2 * rh * (self.dim**2 + (self.vocab if self.vocab_diag else self.vocab**2))

    # ---- statistics
    def emit_statistics(self, b, inputs, cotangents, masked=False, examples=None):
        V, D = self.vocab, self.dim
        n = emit_examples(b, examples, cotangents)
        idx = self._emit_indices(b, inputs)
        X = self._emit_head_rows(b, inputs)
        live_ids = live_rows = None
        if masked:  # the lookups and head rows some seed's cotangent depends on
            live_ids = b.reshape(self._emit_live(b, cotangents, self.lookups, D), [-1])
            live_rows = self._emit_live(b, cotangents, self.heads, V)
            X = b.mul(X, live_rows)
        counts, rows = emit_token_counts(b, idx, V, live_ids, masked)
        A_V = b.div(counts, rows)
        G_D = GramStatistic(self._emit_delta_rows(b, cotangents, self.lookups, D), n)
        A_D = GramStatistic(X, emit_dim(b, X, 0) if live_rows is None else emit_live_count(b, live_rows, masked))
        Dh = self._emit_delta_rows(b, cotangents, self.heads, V)
        G_V = b.div(b.reduce_sum(b.mul(Dh, Dh), [0]), n) if self.vocab_diag else GramStatistic(Dh, n)
        return {"A_V": A_V, "G_D": G_D, "A_D": A_D, "G_V": G_V}

    def _emit_live(self, b, cotangents, uses, width):
        """[rows of `uses`, 1]: ops.emit_live per row of each use, in _emit_delta_rows' order."""
        return emit_concat(b, [emit_live(b, [b.reshape(d, [-1, width]) for d in cotangents[u]], [1]) for u in uses],
                           axis=0)

    def numpy_statistics(self, inputs, cotangents, masked=False):
        V, D = self.vocab, self.dim
        n = np.shape(cotangents[0][0])[0]
        idx = self._np_indices(inputs)
        Dl = self._np_delta_rows(cotangents, self.lookups, D)
        X = self._np_head_rows(inputs)
        Dh = self._np_delta_rows(cotangents, self.heads, V)
        live_ids = rows = None
        if masked:
            live_ids = np.concatenate([np_live([np.reshape(d, (-1, D)) for d in cotangents[u]], [1]) for u in self.lookups])
            live_rows = np.concatenate([np_live([np.reshape(d, (-1, V)) for d in cotangents[u]], [1]) for u in self.heads])
            X, rows = X * live_rows, max(float(live_rows.sum()), 1.0)
        return {
            "A_V": np_token_counts(idx, V, live_ids),
            "G_D": Dl.T @ Dl / n,
            "A_D": X.T @ X / (rows or len(X)),
            "G_V": (Dh * Dh).sum(0) / n if self.vocab_diag else Dh.T @ Dh / n,
        }

    # ---- the combination L (x) R (idempotent: factors already combined pass through)
    def np_combined(self, factors: dict) -> dict:
        """{"A": L, "G": R} from the four per-use factors (float64)."""
        if "A_V" not in factors:
            return factors
        A_V = np.asarray(factors["A_V"], np.float64)
        G_D = np.asarray(factors["G_D"], np.float64)
        A_D = np.asarray(factors["A_D"], np.float64)
        G_V = np.asarray(factors["G_V"], np.float64)
        if self.combine == "trace":
            tr_gv = G_V.sum() if self.vocab_diag else np.trace(G_V)
            (c1, c2), (d1, d2) = np_tied_coefficients([A_V.sum(), tr_gv], [np.trace(G_D), np.trace(A_D)])
        else:
            gv_diag = G_V if self.vocab_diag else np.diag(G_V)
            Ga = [[A_V @ A_V, A_V @ gv_diag], [A_V @ gv_diag, (G_V * G_V).sum()]]
            Gb = [[(G_D * G_D).sum(), (G_D * A_D).sum()], [(G_D * A_D).sum(), (A_D * A_D).sum()]]
            (c1, c2), (d1, d2) = np_nkp_coefficients(Ga, Gb)
        L = c1 * A_V + c2 * G_V if self.vocab_diag else c1 * np.diag(A_V) + c2 * G_V
        dtype = np.result_type(*[np.asarray(factors[k]).dtype for k in TIED_FACTORS])
        return {"A": np.asarray(L, dtype), "G": np.asarray(d1 * G_D + d2 * A_D, dtype)}

    def emit_combined(self, b, factors: dict) -> dict:
        """The ONNX twin of np_combined."""
        if "A_V" not in factors:
            return factors
        V, D = self.vocab, self.dim
        eps, big = b.const(PI_EPS), b.const(np.finfo(np.float32).max)
        zero, one = b.const(0.0), b.const(1.0)

        def trace(M, n, diag):
            return b.reduce_sum(M, None, keepdims=False) if diag else b.reduce_sum(b.mul(M, linalg.emit_eye(b, n)), None, keepdims=False)

        def coeffs(l, r):
            good = b.op("And", [b.op("Greater", [l, eps]), b.op("Greater", [r, eps])])
            good = b.op("And", [good, b.op("And", [b.op("Less", [l, big]), b.op("Less", [r, big])])])
            ratio = b.op("Sqrt", [b.div(b.op("Where", [good, r, one]), b.op("Where", [good, l, one]))])
            return b.op("Where", [good, ratio, zero]), b.op("Where", [good, b.op("Reciprocal", [ratio]), zero])

        if self.combine == "trace":
            c1, d1 = coeffs(trace(factors["A_V"], V, True), trace(factors["G_D"], D, False))
            c2, d2 = coeffs(trace(factors["G_V"], V, self.vocab_diag), trace(factors["A_D"], D, False))
        else:
            (c1, c2), (d1, d2) = self._emit_nkp(b, factors)
        lookup_L = b.mul(factors["A_V"], c1)
        if not self.vocab_diag:
            lookup_L = b.mul(b.unsqueeze(lookup_L, [-1]), linalg.emit_eye(b, V))  # diag(c1 A_V)
        L = b.add(lookup_L, b.mul(factors["G_V"], c2))
        R = b.add(b.mul(factors["G_D"], d1), b.mul(factors["A_D"], d2))
        return {"A": L, "G": R}

    def _emit_nkp(self, b, f):
        """ONNX twin of np_nkp_coefficients on the factors' Frobenius inner products."""
        V = self.vocab
        eps, big, zero, one = b.const(PI_EPS), b.const(np.finfo(np.float32).max), b.const(0.0), b.const(1.0)

        def dot(x, y):
            return b.reduce_sum(b.mul(x, y), None, keepdims=False)

        gv_diag = f["G_V"] if self.vocab_diag else b.reduce_sum(b.mul(f["G_V"], linalg.emit_eye(b, V)), [1])
        a11, a12, a22 = dot(f["A_V"], f["A_V"]), dot(f["A_V"], gv_diag), dot(f["G_V"], f["G_V"])
        b11, b12, b22 = dot(f["G_D"], f["G_D"]), dot(f["G_D"], f["A_D"]), dot(f["A_D"], f["A_D"])
        ta, tb = b.add(a11, a22), b.add(b11, b22)
        good = b.op("And", [b.op("Greater", [ta, eps]), b.op("Greater", [tb, eps])])
        good = b.op("And", [good, b.op("And", [b.op("Less", [ta, big]), b.op("Less", [tb, big])])])
        ta, tb = b.op("Where", [good, ta, one]), b.op("Where", [good, tb, one])
        a11, a12, a22 = (b.div(x, ta) for x in (a11, a12, a22))
        b11, b12, b22 = (b.div(x, tb) for x in (b11, b12, b22))
        m11, m12 = b.add(b.mul(b11, a11), b.mul(b12, a12)), b.add(b.mul(b11, a12), b.mul(b12, a22))
        m21, m22 = b.add(b.mul(b12, a11), b.mul(b22, a12)), b.add(b.mul(b12, a12), b.mul(b22, a22))
        half = b.const(0.5)
        disc = b.add(b.op("Pow", [b.mul(b.sub(m11, m22), half), b.const(2.0)]), b.mul(m12, m21))
        lam = b.add(b.mul(b.add(m11, m22), half), b.op("Sqrt", [disc]))
        c1, c2 = b.sub(b.add(m12, lam), m22), b.sub(b.add(m21, lam), m11)
        tie = b.op("LessOrEqual", [b.add(c1, c2), b.mul(lam, b.const(NKP_TIE))])
        c1, c2 = b.op("Where", [tie, one, c1]), b.op("Where", [tie, one, c2])
        ga_c1, ga_c2 = b.add(b.mul(a11, c1), b.mul(a12, c2)), b.add(b.mul(a12, c1), b.mul(a22, c2))
        q = b.add(b.mul(c1, ga_c1), b.mul(c2, ga_c2))
        good = b.op("And", [good, b.op("Greater", [q, eps])])
        q = b.op("Where", [good, q, one])
        return (
            tuple(b.op("Where", [good, c, zero]) for c in (c1, c2)),
            tuple(b.op("Where", [good, b.div(g, q), zero]) for g in (ga_c1, ga_c2)),
        )

    # ---- every path that reads the factors goes through the combination
    def _emit_damped(self, b, factors, damping):
        return super()._emit_damped(b, self.emit_combined(b, factors), damping)

    def _np_damped(self, factors, damping):
        return super()._np_damped(self.np_combined(factors), damping)

    def np_scale(self, factors):
        return super().np_scale(self.np_combined(factors))

    def _np_inverse_finish(self, factors, damped, results, previous):
        return super()._np_inverse_finish(self.np_combined(factors), damped, results, previous)

    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        return super().numpy_inverse(self.np_combined(factors), damping, method, previous)

    def numpy_matpower(self, factors, damping, exp):
        return super().numpy_matpower(self.np_combined(factors), damping, exp)

    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None):
        if factors is not None:
            factors = self.emit_combined(b, factors)
        return super().emit_power(b, vectors, exp, factors=factors, damping=damping, state=state)

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None):
        if factors is not None:
            factors = self.np_combined(factors)
        return super().numpy_power(vectors, exp, factors=factors, damping=damping, state=state)


@register_block
class TiedEmbeddingKron(TiedKronBase):
    """Tied embedding + output head: one Kronecker product L [V, V] (x) R [D, D] approximating
    the sum of the lookup's and the head's K-FAC terms."""

    name = "kron_tied"
    menu_rank = 2


@register_block
class TiedEmbeddingKronVocabDiag(TiedKronBase):
    """kron_tied with the vocabulary factor L kept diagonal (G_V's diagonal): O(V) memory."""

    name = "kron_tied_vocab_diag"
    menu_rank = 1
    vocab_diag = True


@register_block
class TiedEmbeddingDiagonal(TiedMixin, PartsBlock):
    """Diagonal Fisher of the table from per-example gradients of all its uses:
    diag = 1/N sum_{n,s} g_n^2, g_n = sum_lookups onehot(ids_n)^T delta_l + sum_heads
    delta_h^T a_n, on the matrix M = E^T [D, V]."""

    name = "diagonal"
    layer_kinds = ("tied_embedding",)
    menu_rank = 0  # the default: the Kronecker variants oscillated on two of four exports (docs/frontend.md)

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self._tied_setup()

    def parts(self):
        return [Part("diag", (self.dim, self.vocab), "diag")]

    def stats_flops(self, batch: int) -> int:
        rows = batch * (self._rows_per_example(self.lookups) + self._rows_per_example(self.heads))
        return 2 * rows * self.vocab * self.dim + 2 * batch * self.vocab * self.dim

    def emit_statistics(self, b, inputs, cotangents):
        """The per-example gradients [c, V, D] of `chunk` examples at a time, in an ONNX Loop:
        sum_n g_n^2 has no exact form below that size (the head's term sum_n (delta_n^T a_n)^2
        contracts over position pairs, [N T^2, V]), so the loop bounds the statistic's memory
        by one chunk's instead of the batch's [N, V, D]."""
        V, D = self.vocab, self.dim
        chunk = max(1, CHUNK_ELEMENTS // (V * D))
        depth, values = b.const(np.asarray([V], np.int64)), b.const(np.asarray([0.0, 1.0]))
        # the examples are a lookup's rows; every use regrouped [n, rows per example, ...] (a
        # head on merged rows [N T, D] as its Reshape of [N, T, D] lays them out, as
        # numpy_statistics does): slicing the merged rows by example failed at run time
        first = cotangents[self.lookups[0]][0]
        n_int = b.shape(first, 0, 1)
        inputs = dict(enumerate(inputs))
        cotangents = [list(c) for c in cotangents]
        for u in self.lookups:
            inputs[u] = b.reshape(inputs[u], b.op("Concat", [n_int, b.ints([-1])], axis=0))
        for u in self.heads:
            inputs[u] = b.reshape(inputs[u], b.op("Concat", [n_int, b.ints([-1, D])], axis=0))
        for u in range(len(cotangents)):
            last = V if u in self.heads else D
            cotangents[u] = [b.reshape(c, b.op("Concat", [n_int, b.ints([-1, last])], axis=0)) for c in cotangents[u]]
        size = b.ints([chunk])
        trips = b.reshape(b.op("Div", [b.add(n_int, b.ints([chunk - 1])), size]), [])
        zeros = b.op("ConstantOfShape", [b.ints([V, D])], value=numpy_helper.from_array(np.zeros(1, b.np_float)))

        def body(i, state):
            start = b.mul(b.unsqueeze(i, [0]), size)
            end = b.add(start, size)
            axis = b.ints([0])

            def rows(x):
                return b.op("Slice", [x, start, end, axis])

            # int64 ids: ONNX Runtime has no OneHot kernel for int32 ones (a Keras Embedding's)
            onehots = [b.op("OneHot", [b.cast(b.reshape(rows(inputs[u]), [0, -1]), TensorProto.INT64), depth, values],
                            axis=-1) for u in self.lookups]
            acts = [b.scale(b.reshape(rows(inputs[u]), [0, -1, D]), self.alphas[u]) for u in self.heads]
            total = state[0]
            for s in range(len(cotangents[0])):
                terms = [b.matmul(b.transpose(oh, [0, 2, 1]), b.reshape(rows(cotangents[u][s]), [0, -1, D]))
                         for oh, u in zip(onehots, self.lookups)]
                terms += [b.matmul(b.transpose(b.reshape(rows(cotangents[u][s]), [0, -1, V]), [0, 2, 1]), a)
                          for a, u in zip(acts, self.heads)]
                g = terms[0]
                for t in terms[1:]:
                    g = b.add(g, t)  # [c, V, D] per-example gradients of E
                total = b.add(total, b.reduce_sum(b.mul(g, g), [0]))
            return [total]

        (total,) = b.loop(trips, [zeros], body, [[V, D]], hint="tied_diag")
        n = emit_dim(b, first, 0)
        return {"diag": b.transpose(b.div(total, n), [1, 0])}

    def numpy_statistics(self, inputs, cotangents):
        V, D = self.vocab, self.dim
        n = np.shape(cotangents[self.lookups[0]][0])[0]
        total = 0.0
        for s in range(len(cotangents[0])):
            g = np.zeros((n, V, D))
            for u in self.lookups:
                ids = np.asarray(inputs[u]).reshape(n, -1) % V
                d = np.asarray(cotangents[u][s], np.float64).reshape(n, ids.shape[1], D)
                for i in range(n):
                    np.add.at(g[i], ids[i], d[i])
            for u in self.heads:
                a = self.alphas[u] * np.asarray(inputs[u], np.float64).reshape(n, -1, D)
                d = np.asarray(cotangents[u][s], np.float64).reshape(n, -1, V)
                g += np.einsum("ntv,ntd->nvd", d, a)
            total = total + (g * g).sum(0)
        return {"diag": (total / n).T}

    def _emit_apply(self, b, vectors, mats):
        return self.view.emit_from(b, b.mul(self.view.emit_to(b, vectors), mats["diag"]))

    def _np_apply(self, vectors, mats):
        return self.view.np_from(self.view.np_to(vectors) * mats["diag"])
