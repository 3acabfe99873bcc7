"""EKFAC: eigenvalue-corrected K-FAC (George, Laurent, Bouthillier, Ballas & Vincent 2018,
arXiv 1806.03884) for fully connected and conv layers, single or multi-use.

K-FAC's A (x) G has the eigenbasis U = U_A (x) U_G (A = U_A diag(s_A) U_A^T, G likewise)
and the eigenvalues s_G s_A^T. EKFAC keeps that basis but re-estimates the eigenvalues as
the per-coordinate second moments of the per-example gradients in it,

    S[i, j] = E_n[(U_G^T g_n U_A)_{ij}^2],   g_n = sum over positions and uses of delta a~^T

(the diagonal of U^T F U for the per-example Fisher F, which minimizes ||F - U diag(s) U^T||_F
over s: never further from F than K-FAC, whose s_G s_A^T is another diagonal in the same
basis). Then (F + damping)^-1 g = U_G [(U_G^T g U_A) / (S + damping)] U_A^T.

State and schedule:
  factors A, G        the Kronecker factors, pooled over uses (kron / kron_indep's).
  inverse state       A_Q, G_Q (host eigh at every inverse refresh, like kron's exact
                      damping: blocks/kron.py), S [*group, out, in+1] and `damping`, the
                      damping of the refresh (a scalar: like every inverse, the
                      preconditioner uses the damping of its last refresh).
  S                   re-estimated on every statistics step inside the step graph from the
                      current A_Q, G_Q (state_statistics: a moving average with the factors'
                      coefficient, in the inverse state) and read at its new value by the
                      same step's preconditioner.
  at a refresh        S restarts at s_G s_A^T, K-FAC's eigenvalues in the new basis, and
                      the moving average goes on from there (as Thrandis/EKFAC-pytorch's
                      _compute_kfe): the old S is a diagonal in the old basis, which has no
                      diagonal image in the new one, and s_G s_A^T is the best estimate the
                      factors' long average holds of the new basis' second moments (exact
                      when the gradients' covariance is Kronecker).

From the factors alone (emit_multiply, numpy_matpower: Curvature.multiply) the block is the
curvature a refresh would give, K-FAC's A (x) G + damping with exact damping; from its state,
any real power (S + damping)^p in the eigenbasis (an elementwise Pow).

Statistic: the inputs and output gradients are projected first (a' = U_A^T a~,
d' = U_G^T delta), then g'_n = sum_t d'_nt a'_nt^T: one matmul (D'^2)^T (A'^2) / N for a
single-use fully connected layer with one position per example, a batched matmul otherwise.
Cost per statistics step: 2 N T (nA^2 + nG^2) for the projections + 2 N T nA nG for the
per-example gradients (T > 1); per step: four matmuls as kron's exact damping.

Data-parallel runs: S's batch statistic passes its own reduction point
(C.STATE_STATISTICS_POINT, backend/factors.py), so every rank's step reads the average over
all ranks' examples, as one process's does. Statistics inside the If of periodic statistics
(cov_update_period > 1) cannot be cut there: runtime/staged.py refuses the block then.
"""
from __future__ import annotations

import numpy as np

from kfac_compiler.blocks.conv import ConvKronBase
from kfac_compiler.blocks.fully_connected import FullyConnectedKronBase
from kfac_compiler.blocks.ops import emit_dim
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec


class EkfacMixin:
    """The eigenvalue correction over a Kronecker block with exact damping (its host eigh,
    its eigenbasis multiply); subclasses project one batch's per-example gradients."""

    name = "ekfac"
    uses = "any"
    menu_rank = 20  # an alternative, after the built-in ones
    state_statistics = ("S",)

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        # the plan's damping split (pi or exact, for the Kronecker blocks) does not apply: EKFAC
        # damps its own eigenvalues, S + damping
        options.pop("damping_mode", None)
        super().__init__(layer, param_shapes, input_shapes, damping_mode="exact", **options)

    def check_power(self, exp: float) -> None:
        """The step re-estimates S in its state and divides by S + damping: a precon_power
        state would be overwritten by the next statistics step, so only -1 is offered (other
        powers of the state: Curvature.multiply_matpower / emit_power with exp)."""
        if exp != -1:
            raise ConfigError(
                f"layer {self.layer.name!r}: the 'ekfac' block preconditions with (S + damping)^-1 only "
                f"(precon_power {exp:g}); use precon_power=-1 or another approximation for this layer"
            )

    def np_cholesky_parts(self, factors, damping, inverse=False):
        """Refused with EKFAC's own reason: KronBlock's refusal for exact damping suggests
        damping_mode 'pi', which EKFAC (always exact) does not offer."""
        raise ConfigError(
            f"layer {self.layer.name!r}: the 'ekfac' block has no Kronecker Cholesky factor (it damps its "
            "eigenvalues exactly, S + damping); use Curvature.multiply_matpower(layer, v, 0.5) for a symmetric "
            "square root, or approximation 'kron' for this layer"
        )

    # ---- plan records
    def inverse_specs(self) -> list[FactorSpec]:
        basis = [s for s in super().inverse_specs() if s.name != "D_inv"]
        return basis + [FactorSpec("S", self.mat_shape, role="S", init="zeros"),
                        FactorSpec("damping", (), role="damping")]  # identity init: 1, P = g until a refresh

    def stats_flops(self, batch: int) -> int:
        rows = batch * self.positions_per_example() * getattr(self, "group", 1)
        return super().stats_flops(batch) + 2 * rows * (self.nA * self.nA + self.nG * self.nG + self.nA * self.nG)

    # ---- the inverse state: eigenbases, S restarted at K-FAC's eigenvalues
    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        A, G = np.asarray(factors["A"]), np.asarray(factors["G"])
        dtype = np.result_type(A.dtype, G.dtype)
        ok = bool(np.isfinite(A).all() and np.isfinite(G).all() and float(damping) > 0)
        if ok:
            try:
                sa, Ua, sg, Ug = self._np_eigenbases(A, G)
                state = {"A_Q": Ua, "G_Q": Ug, "S": sg[..., :, None] * sa[..., None, :], "damping": float(damping)}
            except np.linalg.LinAlgError:
                ok = False
        if not ok:
            state = dict(previous) if previous is not None else {
                "A_Q": np.broadcast_to(np.eye(self.nA), (*self.batch, self.nA, self.nA)),
                "G_Q": np.broadcast_to(np.eye(self.nG), (*self.batch, self.nG, self.nG)),
                "S": np.zeros(self.mat_shape),
                "damping": 1.0,
            }
        return {k: np.asarray(v, dtype=dtype) for k, v in state.items()}, ok

    # ---- the power hook: U_G [(U_G^T X U_A) * (S + damping)^exp] U_A^T from the state; from
    # the factors alone, the curvature a refresh would give (S = s_G s_A^T): kron's exact damping
    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None):
        if state is None or "S" not in state:
            return super().emit_power(b, vectors, exp, factors=factors, damping=damping, state=state)
        damped = b.add(state["S"], state["damping"])
        scale = b.op("Reciprocal", [damped]) if exp in (-1, None) else b.op("Pow", [damped, b.const(float(exp))])
        return super().emit_power(b, vectors, -1, state={"A_Q": state["A_Q"], "G_Q": state["G_Q"], "D_inv": scale})

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None):
        if state is None or "S" not in state:
            return super().numpy_power(vectors, exp, factors=factors, damping=damping, state=state)
        damped = np.asarray(state["S"], np.float64) + float(np.asarray(state["damping"]))
        scale = 1.0 / damped if exp in (-1, None) else damped ** float(exp)
        return super().numpy_power(vectors, -1, state={"A_Q": state["A_Q"], "G_Q": state["G_Q"], "D_inv": scale})

    # ---- S from one batch: project, then the per-example gradients' squares
    def emit_statistics(self, b, inputs, cotangents, state=None, masked=False, examples=None):
        """A, G and S in the eigenbases of `state` (None: the identity, where S is the diagonal
        Fisher; the back end always passes the inverse slots)."""
        out = super().emit_statistics(b, inputs, cotangents, masked, examples)
        A_Q, G_Q = (state["A_Q"], state["G_Q"]) if state is not None else (None, None)
        out["S"] = self._emit_second_moments(b, inputs, cotangents, A_Q, G_Q)
        return out

    def numpy_statistics(self, inputs, cotangents, state=None, masked=False):
        out = super().numpy_statistics(inputs, cotangents, masked)
        eye = (np.eye(self.nA), np.eye(self.nG))
        A_Q, G_Q = (state["A_Q"], state["G_Q"]) if state is not None else eye
        g = self._np_projected_gradients(inputs, cotangents, np.asarray(A_Q, np.float64), np.asarray(G_Q, np.float64))
        out["S"] = sum((gs * gs).sum(0) for gs in g) / g[0].shape[0]
        return out


def _project(b, rows, Q):
    """rows [..., n] in the basis Q (rows @ Q = (Q^T row) per row); Q None: the identity."""
    return rows if Q is None else b.matmul(rows, Q)


@register_block
class FullyConnectedEkfac(EkfacMixin, FullyConnectedKronBase):
    """EKFAC for a fully connected layer (uses pooled into A and G, summed per example in S)."""

    example_rows = "movable"

    def _one_position(self) -> bool:
        shapes = self.input_shapes or [self.layer.attrs.get("input_shape")] * len(self.layer.uses)
        moved = self.layer.attrs.get("example_axes")  # merged rows reach the block as [N, T, in]
        return len(shapes) == 1 and shapes[0] is not None and len(shapes[0]) == 2 and not moved

    def _emit_second_moments(self, b, inputs, cotangents, A_Q, G_Q):
        total = None
        if self._one_position():  # g'_n = d'_n a'_n^T: S = (D'^2)^T (A'^2) / N, one matmul
            X = _project(b, self._emit_rows(b, inputs[0]), A_Q)  # [N, nA]
            X2 = b.mul(X, X)
            for d in cotangents[0]:
                D = _project(b, b.reshape(d, [-1, self.n_out]), G_Q)
                sq = b.op("Gemm", [b.mul(D, D), X2], transA=1)
                total = sq if total is None else b.add(total, sq)
            return b.div(total, emit_dim(b, X, 0))
        return self._emit_gradient_moments(b, inputs, cotangents, A_Q, G_Q)  # the diagonal block's, projected

    def _np_projected_gradients(self, inputs, cotangents, A_Q, G_Q):
        X = np.concatenate([self._np_seq(x) for x in inputs], axis=1) @ A_Q
        out = []
        for s in range(len(cotangents[0])):
            D = np.concatenate([np.asarray(cotangents[u][s], np.float64).reshape(X.shape[0], -1, self.n_out)
                                for u in range(len(inputs))], axis=1) @ G_Q
            out.append(np.einsum("nto,nti->noi", D, X))
        return out


@register_block
class ConvEkfac(EkfacMixin, ConvKronBase):
    """EKFAC for a conv layer (KFC's factors, per group when group > 1)."""

    example_rows = "leading"

    def _emit_second_moments(self, b, inputs, cotangents, A_Q, G_Q):
        return self._emit_gradient_moments(b, inputs, cotangents, self.mat_shape, A_Q, G_Q)  # diagonal's, projected

    def _np_projected_gradients(self, inputs, cotangents, A_Q, G_Q):
        A_Q = np.broadcast_to(A_Q, (*self.batch, self.nA, self.nA)).reshape(self.group, self.nA, self.nA)
        G_Q = np.broadcast_to(G_Q, (*self.batch, self.nG, self.nG)).reshape(self.group, self.nG, self.nG)
        P = np.einsum("gkj,ngkt->ngjt", A_Q, np.concatenate([self.np_patches(x) for x in inputs], axis=3))
        out = []
        for s in range(len(cotangents[0])):
            D = np.concatenate([self._np_delta(cotangents[u][s]) for u in range(len(inputs))], axis=3)
            g = np.einsum("gop,ngot,ngkt->ngpk", G_Q, D, P)
            out.append(g.reshape(g.shape[0], *self.mat_shape))
        return out
