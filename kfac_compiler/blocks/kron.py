"""Kronecker-factored blocks: F ~ A (x) G for the matrix [W | b] (rows outputs, columns
inputs then bias); subclasses supply the statistics and the parameter <-> matrix view.

Factors: "A" [*batch, nA, nA] (or its diagonal [*batch, nA]), "G" [*batch, nG, nG] (or
[*batch, nG]); the batch axis holds conv groups (block diagonal over groups).

Damping (option damping_mode):
  "pi" (default): (A + pi sqrt(lam) I) (x) (G + sqrt(lam)/pi I), pi = sqrt((tr A/dim A) /
      (tr G/dim G)) per group; inverse state A_inv, G_inv; F^-1 vec(X) = vec(G_inv X A_inv).
  "exact": (A (x) G + lam I)^-1 via host eigh A = Ua Sa Ua^T, G = Ug Sg Ug^T; state
      A_Q, G_Q, D_inv = 1 / (sg sa^T + lam); F^-1 vec(X) = vec(Ug [(Ug^T X Ua) * D_inv] Ua^T).
"""
from __future__ import annotations

import numpy as np

from kfac_compiler import linalg
from kfac_compiler.blocks._parts import Part, PartsBlock
from kfac_compiler.blocks.ops import prod
from kfac_compiler.blocks.views import MatrixView
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec


class KronBlock(PartsBlock):
    """Base for the Kronecker-factored blocks (set self.view, self.a_diag, self.g_diag,
    self.batch, self.nA, self.nG in __init__)."""

    a_diag: bool = False
    g_diag: bool = False
    example_rows = "pooled"
    cholesky_right_parts = ("A",)  # vec(X) -> vec(G X A): A from the right

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self.damping_mode = options.get("damping_mode", "pi")
        if self.damping_mode not in ("pi", "exact"):
            raise ConfigError(f"layer {layer.name!r}: damping_mode {self.damping_mode!r} is not 'pi' or 'exact'")
        self.batch: tuple[int, ...] = ()
        self.view: MatrixView | None = None

    def _setup_exact_check(self):
        if self.damping_mode == "exact" and (self.a_diag or self.g_diag):
            raise ConfigError(f"layer {self.layer.name!r}: exact damping needs full factors, and block {self.name!r} "
                              "keeps a diagonal one; use damping_split 'pi', or an approximation with full factors where the layer's "
                              "menu has one")

    # ---- parts
    def parts(self) -> list[Part]:
        A = Part("A", (*self.batch, self.nA) if self.a_diag else (*self.batch, self.nA, self.nA), "diag" if self.a_diag else "full")
        G = Part("G", (*self.batch, self.nG) if self.g_diag else (*self.batch, self.nG, self.nG), "diag" if self.g_diag else "full")
        return [A, G]

    @property
    def mat_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.nG, self.nA)

    def inverse_specs(self) -> list[FactorSpec]:
        if self.damping_mode == "exact":
            return [
                FactorSpec("A_Q", (*self.batch, self.nA, self.nA), role="A_Q"),
                FactorSpec("G_Q", (*self.batch, self.nG, self.nG), role="G_Q"),
                FactorSpec("D_inv", self.mat_shape, role="D_inv"),
            ]
        return super().inverse_specs()

    def inverse_flops(self, method: str = linalg.DEFAULT_METHOD) -> int:
        if self.damping_mode == "exact":  # eigh on the host whatever the method
            return prod(self.batch or (1,)) * 10 * (self.nA**3 + self.nG**3)
        return super().inverse_flops(method)

    def apply_flops(self) -> int:
        """G X A on X [nG, nA] per group: a full A costs 2 nG nA^2, a full G 2 nG^2 nA. Exact
        damping works in the eigenbases: Q_G^T X Q_A, a scaling, and back, both factors twice."""
        fa = 2 * self.nG * self.nA**2 if not self.a_diag else self.nG * self.nA
        fg = 2 * self.nG**2 * self.nA if not self.g_diag else self.nG * self.nA
        rotations = 2 if self.damping_mode == "exact" else 1
        return prod(self.batch or (1,)) * (rotations * (fa + fg) + (self.nG * self.nA if rotations > 1 else 0))

    # ---- damping: the pi split
    def _emit_damped(self, b, factors, damping):
        A, G = factors["A"], factors["G"]
        dA, dG = linalg.emit_damping_split(b, A, self.nA, G, self.nG, damping, self.a_diag, self.g_diag)
        batched = bool(self.batch)
        return {
            "A": linalg.emit_add_diagonal(b, A, self.nA, dA, diag=self.a_diag, batched=batched),
            "G": linalg.emit_add_diagonal(b, G, self.nG, dG, diag=self.g_diag, batched=batched),
        }

    def _np_damped(self, factors, damping):
        # in the factors' precision: the host inverse (LAPACK potrf + potrs) then runs in float32
        A, G = np.asarray(factors["A"]), np.asarray(factors["G"])
        dA, dG = linalg.np_damping_split(A, G, damping, self.a_diag, self.g_diag)
        return {
            "A": linalg.np_add_diagonal(A, dA, diag=self.a_diag),
            "G": linalg.np_add_diagonal(G, dG, diag=self.g_diag),
        }

    # ---- apply: vec(X) -> vec(G X A)
    def _emit_apply(self, b, vectors, mats):
        if self.view.stored_transposed:
            # (G M A)^T = A M^T G for the symmetric A, G on M^T as stored: 2 fewer transposes
            # per layer and an axis-0 concatenation
            X = self.view.emit_to_transposed(b, vectors)
            X = b.mul(X, b.unsqueeze(mats["G"], [-2])) if self.g_diag else b.matmul(X, mats["G"])
            X = b.mul(b.unsqueeze(mats["A"], [-1]), X) if self.a_diag else b.matmul(mats["A"], X)
            return self.view.emit_from_transposed(b, X)
        X = self.view.emit_to(b, vectors)
        if self.g_diag:
            X = b.mul(b.unsqueeze(mats["G"], [-1]), X)
        else:
            X = b.matmul(mats["G"], X)
        if self.a_diag:
            X = b.mul(X, b.unsqueeze(mats["A"], [-2]))
        else:
            X = b.matmul(X, mats["A"])
        return self.view.emit_from(b, X)

    def _np_apply(self, vectors, mats):
        X = self.view.np_to(vectors).astype(np.float64)
        X = mats["G"][..., :, None] * X if self.g_diag else mats["G"] @ X
        X = X * mats["A"][..., None, :] if self.a_diag else X @ mats["A"]
        return self.view.np_from(X)

    # ---- exact damping (host eigh)
    @property
    def host_inverse_only(self) -> bool:
        return self.damping_mode == "exact"

    def _np_batchable(self) -> bool:
        return self.damping_mode == "pi" and super()._np_batchable()

    def emit_inverse(self, b, factors, damping, method=linalg.DEFAULT_METHOD, previous=None):
        if self.damping_mode == "exact":
            raise ConfigError(
                f"layer {self.layer.name!r}: exact damping is computed on the host (numpy_inverse, method 'eigh')"
            )
        return super().emit_inverse(b, factors, damping, method, previous)

    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        if self.damping_mode != "exact":
            return super().numpy_inverse(factors, damping, method, previous)
        A, G = np.asarray(factors["A"]), np.asarray(factors["G"])
        dtype = np.result_type(A.dtype, G.dtype)
        ok = bool(np.isfinite(A).all() and np.isfinite(G).all())
        state = None
        if ok:
            try:
                sa, Ua, sg, Ug = self._np_eigenbases(A, G)
                denom = sg[..., :, None] * sa[..., None, :] + float(damping)
                with np.errstate(all="ignore"):
                    D = 1.0 / denom
                ok = bool(np.all(denom > 0) and np.isfinite(D).all())
                state = {"A_Q": Ua, "G_Q": Ug, "D_inv": D}
            except np.linalg.LinAlgError:
                ok = False
        if not ok:
            if previous is not None:
                state = dict(previous)
            else:
                state = {
                    "A_Q": np.broadcast_to(np.eye(self.nA), (*self.batch, self.nA, self.nA)),
                    "G_Q": np.broadcast_to(np.eye(self.nG), (*self.batch, self.nG, self.nG)),
                    "D_inv": np.ones(self.mat_shape),
                }
        return {k: np.asarray(v, dtype=dtype) for k, v in state.items()}, ok

    @staticmethod
    def _np_eigenbases(A, G):
        """(sa, Ua, sg, Ug): eigh of the symmetrized factors in float64, eigenvalues clipped
        at 0 (exact damping's state; ekfac's eigenbases). Raises LinAlgError."""
        sa, Ua = np.linalg.eigh(linalg.np_symmetrized(np.asarray(A, np.float64)))
        sg, Ug = np.linalg.eigh(linalg.np_symmetrized(np.asarray(G, np.float64)))
        return np.maximum(sa, 0), Ua, np.maximum(sg, 0), Ug

    # ---- the power hook: exact damping multiplies by G X A + lambda X, and its host state
    # (eigenbases, D_inv) by Ug [(Ug^T X Ua) * D_inv] Ua^T; "pi" is the parts' hook
    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None):
        if state is not None and "D_inv" in state:
            X = self.view.emit_to(b, vectors)
            perm = list(range(len(self.batch))) + [len(self.batch) + 1, len(self.batch)]
            Y = b.matmul(b.matmul(b.transpose(state["G_Q"], perm), X), state["A_Q"])
            Y = b.mul(Y, state["D_inv"])
            Y = b.matmul(b.matmul(state["G_Q"], Y), b.transpose(state["A_Q"], perm))
            return self.view.emit_from(b, Y)
        if state is None and self.damping_mode == "exact":
            if exp != 1:
                raise ConfigError(f"layer {self.layer.name!r}: exact damping powers are host-side (numpy_matpower)")
            X = self.view.emit_to(b, vectors)
            Y = b.add(b.matmul(b.matmul(factors["G"], X), factors["A"]), b.mul(X, damping))
            return self.view.emit_from(b, Y)
        return super().emit_power(b, vectors, exp, factors=factors, damping=damping, state=state)

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None):
        if state is not None and "D_inv" in state:
            X = self.view.np_to(vectors).astype(np.float64)
            Ua, Ug = np.asarray(state["A_Q"], np.float64), np.asarray(state["G_Q"], np.float64)
            Y = (np.swapaxes(Ug, -1, -2) @ X @ Ua) * state["D_inv"]
            return self.view.np_from(Ug @ Y @ np.swapaxes(Ua, -1, -2))
        if state is None and exp == 1 and self.damping_mode == "exact":
            X = self.view.np_to(vectors).astype(np.float64)
            A, G = np.asarray(factors["A"], np.float64), np.asarray(factors["G"], np.float64)
            return self.view.np_from(G @ X @ A + float(damping) * X)
        return super().numpy_power(vectors, exp, factors=factors, damping=damping, state=state)

    def np_cholesky_parts(self, factors, damping, inverse=False):
        if self.damping_mode == "exact":
            raise ConfigError(f"layer {self.layer.name!r}: exact damping has no Kronecker Cholesky factor; "
                              "use damping_mode 'pi'")
        return super().np_cholesky_parts(factors, damping, inverse)

    def numpy_matpower(self, factors, damping, exp):
        if self.damping_mode == "exact":
            if exp == -1:
                return self.numpy_inverse(factors, damping, "eigh")
            sa, Ua, sg, Ug = self._np_eigenbases(factors["A"], factors["G"])
            D = (sg[..., :, None] * sa[..., None, :] + float(damping)) ** exp
            return {"A_Q": Ua, "G_Q": Ug, "D_inv": D}, bool(np.isfinite(D).all())
        return super().numpy_matpower(factors, damping, exp)
