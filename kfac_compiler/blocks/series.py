"""Multi-use fully connected layers with temporal structure: Martens, Ba & Johnson (2018),
"Kronecker-factored curvature approximations for recurrent neural networks", Options 1/2.

Uses r = 0..R-1 (layer.uses order = time order, R >= 2) apply one weight; w_r = a~_r (x) delta_r
is use r's gradient contribution and the block models F = E[(sum_r w_r)(sum_r w_r)^T] with
a stationary linear-Gaussian (AR(1)) process for w_r: V_d = cov(w_{r+d}, w_r) = Psi^d V_0,
Psi = Psi_A (x) Psi_G.

Factors (emitted in ONNX; every use must have the same number T of rows, aligned by position):
  A   = 1/(N T R) sum_{n,t,r} a~_r a~_r^T                       (as kron_indep)
  G   = 1/N sum_{n,t,r} delta_r delta_r^T                       (as kron_indep: R * G_0)
  A_1 = 1/(N T (R-1)) sum_{n,t, r<R-1} a~_{r+1} a~_r^T          (lag-one cross moment)
  G_1 = R/(R-1) * 1/N sum_{n,t, r<R-1} delta_{r+1} delta_r^T    (scaled like G: R * G_1^paper)
so that V_0 = A (x) G / R, Psi_A = A_1 A^-1 and Psi_G = G_1 G^-1 are the paper's.
Damping: A and G get the pi split (pi from tr A, tr G) before anything else; A_1, G_1 don't.

Option 1 ("kron_series_1", V_1 assumed symmetric, finite R): with A_1, G_1 symmetrized,
  the generalized eigenproblems A_1 k = psi A k (K_A^T A K_A = I) and the same for G give
  F = K^-T diag(zeta_R(psi) / R) K^-1, K = K_A (x) K_G, psi = psi_A (x) psi_G,
  zeta_R(x) = R + 2 sum_{d=1}^{R-1} (R - d) x^d  (= sum_{r,s} x^|r-s|);
  F^-1 vec(X) = vec(K_G [(K_G^T X K_A) * D_inv] K_A^T), D_inv = R / zeta_R(psi).
  psi_A, psi_G are clipped to [-1, 1] and their products psi to [-psi_max, psi_max]
  (option psi_max, default 0.99; the homogeneous coordinate alone has psi_A ~ 1).
Option 2 ("kron_series_2", R -> infinity, no symmetry needed):
  F = R sum_{d=-inf}^{inf} V_d = (I - Psi)^-1 S (I - Psi^T)^-1, S = A(x)G - Psi (A(x)G) Psi^T,
  F^-1 = (I - Psi^T) S^-1 (I - Psi); S^-1 from the generalized eigenproblems
  (A_1 A^-1 A_1^T) k = mu A k (likewise G): S = K^-T diag(1 - mu_A (x) mu_G) K^-1 with
  mu_A, mu_G clipped to [0, 1] and their products to at most psi_max^2; state K_A, K_G, D_inv = 1/(1 - mu), A_psi = Psi_A, G_psi = Psi_G.
The eigendecompositions run on the host (numpy/scipy eigh): inverse_is_host() is True.

Powers: F is not diagonal in an orthogonal Kronecker basis (K is A-orthonormal, not
orthogonal), so an integer power applies F or F^-1 repeatedly (ONNX: F^k from the factors,
F^-k from the inverse state; host: both from the inverse state), and any other real power is
host-only, from one dense eigh of the layer's F^-1 [n, n] (n = (in+1) out <= DENSE_MAX).
"""
from __future__ import annotations

import math

import numpy as np
import scipy.linalg

from kfac_compiler import linalg
from kfac_compiler.blocks.fully_connected import FullyConnectedKronBase
from kfac_compiler.blocks.ops import (
    emit_add_all,
    emit_concat,
    emit_dim,
    emit_examples,
    emit_live,
    emit_live_count,
    np_live,
)
from kfac_compiler.blocks.registry import register_block
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import FactorSpec

PSI_MAX = 0.99
DENSE_MAX = 2048  # non-integer powers: a dense eigh of the layer's [n, n] F, n = (in+1) out
NEUMANN_DOUBLINGS = 10  # emitted (I - Psi)^-1 ~ prod_{k<m} (I + Psi^(2^k)): 2^m terms


def zeta(x: np.ndarray, R: int) -> np.ndarray:
    """zeta_R(x) = sum_{r,s<R} x^|r-s| = R + 2 sum_{d=1}^{R-1} (R-d) x^d."""
    x = np.asarray(x, np.float64)
    out = np.full_like(x, float(R))
    p = np.ones_like(x)
    for d in range(1, R):
        p = p * x
        out = out + 2.0 * (R - d) * p
    return out


def _solve_stein(X: np.ndarray, PA: np.ndarray, PG: np.ndarray) -> np.ndarray:
    """Y with Y - PG Y PA^T = X, i.e. (I - PA (x) PG)^-1 vec(X), via eigendecompositions."""
    la, Qa = np.linalg.eig(PA)
    lg, Qg = np.linalg.eig(PG)
    Xt = np.linalg.solve(Qg, X) @ np.linalg.inv(Qa).T
    Yt = Xt / (1.0 - lg[:, None] * la[None, :])
    return np.real(Qg @ Yt @ Qa.T)


class FullyConnectedKronSeries(FullyConnectedKronBase):
    """Shared code of Options 1 and 2 (see module docstring)."""

    option: int = 1

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        self.R = len(layer.uses)
        if self.R < 2:
            raise ConfigError(f"layer {layer.name!r}: {self.name} needs a weight used at least twice")
        if self.damping_mode != "pi":
            raise ConfigError(f"layer {layer.name!r}: {self.name} supports damping_mode 'pi' only")
        # the cross moments pair use r's rows with use r+1's: every use needs as many per example
        rows = {tuple(shape[1:-1]) for shape in (input_shapes or []) if shape is not None
                and all(isinstance(d, int) for d in shape[1:-1])}
        if len({math.prod(r) for r in rows}) > 1:
            raise ConfigError(f"layer {layer.name!r}: {self.name} pairs the rows of consecutive uses, and its uses "
                              f"have {' and '.join(str(math.prod(r)) for r in sorted(rows))} rows per example; "
                              "use kron_indep or kron")
        self.psi_max = float(options.get("psi_max", PSI_MAX))
        self.doublings = int(options.get("neumann_doublings", NEUMANN_DOUBLINGS))

    @property
    def host_inverse_only(self) -> bool:
        return True

    # ---- plan records
    def factor_specs(self):
        return [
            FactorSpec("A", (self.nA, self.nA), role="A"),
            FactorSpec("G", (self.nG, self.nG), role="G"),
            FactorSpec("A_1", (self.nA, self.nA), role="A_1"),
            FactorSpec("G_1", (self.nG, self.nG), role="G_1"),
        ]

    def inverse_specs(self):
        specs = [
            FactorSpec("A_K", (self.nA, self.nA), role="A_K"),
            FactorSpec("G_K", (self.nG, self.nG), role="G_K"),
            FactorSpec("D_inv", (self.nG, self.nA), role="D_inv"),
        ]
        if self.option == 2:
            specs += [
                FactorSpec("A_psi", (self.nA, self.nA), role="A_psi", init="zeros"),
                FactorSpec("G_psi", (self.nG, self.nG), role="G_psi", init="zeros"),
            ]
        return specs

    def stats_flops(self, batch):
        return 2 * super().stats_flops(batch)

    def inverse_flops(self, method: str = linalg.DEFAULT_METHOD) -> int:
        return 30 * (self.nA**3 + self.nG**3)  # host eigh whatever the method

    # ---- statistics
    def emit_statistics(self, b, inputs, cotangents, masked=False, examples=None):
        out = super().emit_statistics(b, inputs, cotangents, masked, examples)
        rows = [self._emit_rows(b, x) for x in inputs]
        count = None
        if masked:  # A_1: the mean over consecutive pairs of rows that are both live
            live = [emit_live(b, [b.reshape(d, [-1, self.n_out]) for d in ds], [1]) for ds in cotangents]
            rows = [b.mul(r, m) for r, m in zip(rows, live)]
            pairs = emit_concat(b, [b.mul(live[u + 1], live[u]) for u in range(self.R - 1)], axis=0)
            count = emit_live_count(b, pairs, masked)
        X1 = emit_concat(b, rows[1:], axis=0)
        X0 = emit_concat(b, rows[:-1], axis=0)
        out["A_1"] = b.div(b.matmul(b.transpose(X1, [1, 0]), X0), count or emit_dim(b, X1, 0))
        S = len(cotangents[0])
        drows = [[b.reshape(cotangents[u][s], [-1, self.n_out]) for s in range(S)] for u in range(self.R)]
        D1 = emit_concat(b, [drows[u + 1][s] for u in range(self.R - 1) for s in range(S)], axis=0)
        D0 = emit_concat(b, [drows[u][s] for u in range(self.R - 1) for s in range(S)], axis=0)
        n = emit_examples(b, examples, cotangents)
        G1 = b.div(b.matmul(b.transpose(D1, [1, 0]), D0), n)
        out["G_1"] = b.scale(G1, self.R / (self.R - 1))
        return out

    def numpy_statistics(self, inputs, cotangents, masked=False):
        out = super().numpy_statistics(inputs, cotangents, masked)
        rows = [self._np_rows(x) for x in inputs]
        count = None
        if masked:
            live = [np_live([np.reshape(d, (-1, self.n_out)) for d in ds], [1]) for ds in cotangents]
            rows = [r * m for r, m in zip(rows, live)]
            count = max(float(sum((live[u + 1] * live[u]).sum() for u in range(self.R - 1))), 1.0)
        X1, X0 = np.concatenate(rows[1:]), np.concatenate(rows[:-1])
        out["A_1"] = X1.T @ X0 / (count or len(X1))
        S = len(cotangents[0])
        d = [[np.asarray(cotangents[u][s], np.float64).reshape(-1, self.n_out) for s in range(S)] for u in range(self.R)]
        D1 = np.concatenate([d[u + 1][s] for u in range(self.R - 1) for s in range(S)])
        D0 = np.concatenate([d[u][s] for u in range(self.R - 1) for s in range(S)])
        out["G_1"] = self.R / (self.R - 1) * D1.T @ D0 / np.shape(cotangents[0][0])[0]
        return out

    # ---- inverse (host)
    def emit_inverse(self, b, factors, damping, method=linalg.DEFAULT_METHOD, previous=None):
        raise ConfigError(
            f"layer {self.layer.name!r}: {self.name} needs eigendecompositions; its inverse is host-side "
            "(numpy_inverse, method 'eigh')"
        )

    def _fallback_state(self):
        st = {
            "A_K": np.eye(self.nA),
            "G_K": np.eye(self.nG),
            "D_inv": np.ones((self.nG, self.nA)),
        }
        if self.option == 2:
            st["A_psi"] = np.zeros((self.nA, self.nA))
            st["G_psi"] = np.zeros((self.nG, self.nG))
        return st

    def _np_damped_all(self, factors, damping):
        f = {k: np.asarray(v, np.float64) for k, v in factors.items()}
        d = self._np_damped(f, damping)
        return d["A"], d["G"], f["A_1"], f["G_1"]

    def _state(self, factors, damping) -> dict:
        Ad, Gd, A1, G1 = self._np_damped_all(factors, damping)
        if self.option == 1:
            pa, Ka = scipy.linalg.eigh(0.5 * (A1 + A1.T), Ad)
            pg, Kg = scipy.linalg.eigh(0.5 * (G1 + G1.T), Gd)
            pa, pg = np.clip(pa, -1.0, 1.0), np.clip(pg, -1.0, 1.0)
            psi = np.clip(pg[:, None] * pa[None, :], -self.psi_max, self.psi_max)
            return {"A_K": Ka, "G_K": Kg, "D_inv": self.R / zeta(psi, self.R)}
        Pa = np.linalg.solve(Ad, A1.T).T  # A_1 A^-1 (A symmetric)
        Pg = np.linalg.solve(Gd, G1.T).T
        Ma, Mg = Pa @ A1.T, Pg @ G1.T
        ma, Ka = scipy.linalg.eigh(0.5 * (Ma + Ma.T), Ad)
        mg, Kg = scipy.linalg.eigh(0.5 * (Mg + Mg.T), Gd)
        ma, mg = np.clip(ma, 0.0, 1.0), np.clip(mg, 0.0, 1.0)
        mu = np.minimum(mg[:, None] * ma[None, :], self.psi_max**2)
        return {"A_K": Ka, "G_K": Kg, "D_inv": 1.0 / (1.0 - mu), "A_psi": Pa, "G_psi": Pg}

    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        dtype = np.result_type(*[np.asarray(v).dtype for v in factors.values()])
        ok = all(np.isfinite(np.asarray(v)).all() for v in factors.values())
        state = None
        if ok:
            try:
                with np.errstate(all="ignore"):
                    state = self._state(factors, damping)
                ok = all(np.isfinite(v).all() for v in state.values())
            except (np.linalg.LinAlgError, ValueError):
                ok = False
        if not ok:
            state = dict(previous) if previous is not None else self._fallback_state()
        return {k: np.asarray(v, dtype=dtype) for k, v in state.items()}, bool(ok)

    # ---- the power hook. A state is the inverse state (numpy_inverse: K_A, K_G, D_inv(,
    # A_psi, G_psi)) or a numpy_matpower state: for an integer exp the inverse state with
    # "power" (applied |exp| times: F^-1 for exp < 0, F for exp > 0, solved from it on the
    # host), for any other real exp "F_pow", the dense power of the layer's F (DENSE_MAX).
    host_matpowers = True

    def check_power(self, exp: float) -> None:
        """A preconditioner state must fit the inverse slots (K_A, K_G, D_inv, ...): only -1
        does; other powers are products (Curvature.multiply_matpower), not a precon_power."""
        if exp != -1:
            raise ConfigError(
                f"layer {self.layer.name!r}: the {self.name!r} block has no precon_power {exp:g} state "
                "(its powers are host products: Curvature.multiply_matpower); use precon_power=-1 or "
                "another approximation for this layer"
            )

    def np_cholesky_parts(self, factors, damping, inverse=False):
        """Refused: F + damping is (A_0 (x) G_0 + the A_1, G_1 series terms) + damping, not a
        product of two damped factors, so KronBlock's L_A (x) L_G would silently ignore A_1, G_1."""
        raise ConfigError(
            f"layer {self.layer.name!r}: the {self.name!r} block has no Kronecker Cholesky factor (its "
            "curvature is a series, not one Kronecker product); use Curvature.multiply_matpower(layer, v, 0.5) "
            "for a symmetric square root, or another approximation for this layer"
        )

    def numpy_matpower(self, factors, damping, exp):
        if exp == -1:
            return self.numpy_inverse(factors, damping)
        if float(exp) == int(exp):
            state, ok = self.numpy_inverse(factors, damping)
            return {**state, "power": np.asarray(float(exp))}, ok
        return self._np_dense_power(factors, damping, float(exp))

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None):
        if state is None:
            if exp != 1:
                return self.numpy_multiply_matpower(vectors, factors, damping, exp)
            return self.view.np_from(self._np_forward(self.view.np_to(vectors), self._state(factors, damping)))
        X = self.view.np_to(vectors).astype(np.float64)
        if "F_pow" in state:
            return self.view.np_from((np.asarray(state["F_pow"], np.float64) @ X.reshape(-1)).reshape(X.shape))
        k = self._repeats(exp if exp is not None else float(np.asarray(state.get("power", -1))))
        st = {key: np.asarray(v, np.float64) for key, v in state.items() if key != "power"}
        for _ in range(abs(k)):
            X = self._np_inverse_apply(X, st) if k < 0 else self._np_forward(X, st)
        return self.view.np_from(X)

    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None):
        if state is not None:
            if "F_pow" in state:
                X = self.view.emit_to(b, vectors)
                Y = b.matmul(state["F_pow"], b.reshape(X, [-1, 1]))
                return self.view.emit_from(b, b.reshape(Y, [self.nG, self.nA]))
            if exp is None and "power" in state:
                raise ConfigError(
                    f"layer {self.layer.name!r}: {self.name}: an integer-power state applies its power "
                    "|exp| times: pass exp to emit_power"
                )
            k = self._repeats(-1 if exp is None else exp)
            if k > 0:
                raise ConfigError(
                    f"layer {self.layer.name!r}: {self.name} power {exp} in ONNX is from the factors "
                    "(emit_multiply_matpower), not from the inverse state"
                )
            X = self.view.emit_to(b, vectors)
            for _ in range(-k):
                X = self._emit_inverse_apply(b, X, state)
            return self.view.emit_from(b, X)
        k = self._repeats(exp)
        if k < 0:
            raise ConfigError(
                f"layer {self.layer.name!r}: {self.name} power {exp} needs eigendecompositions: use the "
                "host (numpy_matpower) or the inverse state (emit_power with state=)"
            )
        X = self.view.emit_to(b, vectors)
        if k:
            mats = self._emit_fisher_mats(b, factors, damping)
            for _ in range(k):
                X = self._emit_forward(b, X, mats)
        return self.view.emit_from(b, X)

    def _repeats(self, exp) -> int:
        """An integer exp as an int; a ConfigError naming the host way for any other."""
        if float(exp) != int(exp):
            raise ConfigError(
                f"layer {self.layer.name!r}: {self.name} power {exp} is not an integer: it needs a dense "
                "eigendecomposition of the layer's F (numpy_matpower, host)"
            )
        return int(exp)

    # ---- multiply by the inverse (state from numpy_inverse), on the matrix X [out, in+1]
    def _emit_inverse_apply(self, b, X, st):
        if self.option == 2:
            X = b.sub(X, b.matmul(b.matmul(st["G_psi"], X), b.transpose(st["A_psi"], [1, 0])))
        Y = b.matmul(b.matmul(b.transpose(st["G_K"], [1, 0]), X), st["A_K"])
        Y = b.mul(Y, st["D_inv"])
        Y = b.matmul(b.matmul(st["G_K"], Y), b.transpose(st["A_K"], [1, 0]))
        if self.option == 2:
            Y = b.sub(Y, b.matmul(b.matmul(b.transpose(st["G_psi"], [1, 0]), Y), st["A_psi"]))
        return Y

    def _np_inverse_apply(self, X, st):
        if self.option == 2:
            X = X - st["G_psi"] @ X @ st["A_psi"].T
        Y = (st["G_K"].T @ X @ st["A_K"]) * st["D_inv"]
        Y = st["G_K"] @ Y @ st["A_K"].T
        if self.option == 2:
            Y = Y - st["G_psi"].T @ Y @ st["A_psi"]
        return Y

    # ---- multiply by F (numpy: exact, from the same clipped state as the inverse)
    def _np_forward(self, X, st):
        X = np.asarray(X, np.float64)
        Ka_inv, Kg_inv = np.linalg.inv(st["A_K"]), np.linalg.inv(st["G_K"])
        if self.option == 2:
            X = _solve_stein(X, st["A_psi"].T, st["G_psi"].T)  # (I - Psi^T)^-1
        Z = (Kg_inv @ X @ Ka_inv.T) / st["D_inv"]
        Y = Kg_inv.T @ Z @ Ka_inv
        if self.option == 2:
            Y = _solve_stein(Y, st["A_psi"], st["G_psi"])  # (I - Psi)^-1
        return Y

    # ---- any real power on the host: the dense F^-1 [n, n] (n = (in+1) out, row-major vec of
    # X [out, in+1], where vec(L X R) = (L (x) R^T) vec(X)), one eigh, F^p = U s^-p U^T
    def _np_dense_power(self, factors, damping, exp):
        n = self.nA * self.nG
        if n > DENSE_MAX:
            raise ConfigError(
                f"layer {self.layer.name!r}: {self.name} power {exp} needs a dense eigendecomposition of "
                f"its {n} x {n} Fisher (at most {DENSE_MAX}); use an integer power"
            )
        st, ok = self.numpy_inverse(factors, damping)
        st = {k: np.asarray(v, np.float64) for k, v in st.items()}
        Finv = np.kron(st["G_K"], st["A_K"]) @ (st["D_inv"].reshape(-1)[:, None] * np.kron(st["G_K"].T, st["A_K"].T))
        if self.option == 2:
            Ipsi = np.eye(n) - np.kron(st["G_psi"], st["A_psi"])
            Finv = Ipsi.T @ Finv @ Ipsi
        s, U = np.linalg.eigh(linalg.np_symmetrized(Finv))
        ok = ok and bool(np.all(s > 0) and np.isfinite(s).all())
        with np.errstate(all="ignore"):
            P = (U * np.where(s > 0, s, 1.0) ** -exp) @ U.T
        dtype = np.result_type(*[np.asarray(v).dtype for v in factors.values()])
        return {"F_pow": np.asarray(P, dtype)}, ok

    # ---- multiply by F in ONNX (no eigenvalue clipping; option 2 truncated at 2^m terms)
    def _emit_fisher_mats(self, b, factors, damping) -> dict:
        """The matrices F is applied with (built once however often it is applied)."""
        d = self._emit_damped(b, factors, damping)
        Ad, Gd = d["A"], d["G"]
        A1, G1 = factors["A_1"], factors["G_1"]
        if self.option == 1:
            A1, G1 = linalg.emit_symmetrized(b, A1), linalg.emit_symmetrized(b, G1)
        Pa = b.matmul(A1, b.op("Inverse", [Ad], domain="com.microsoft"))
        Pg = b.matmul(G1, b.op("Inverse", [Gd], domain="com.microsoft"))
        mats = {"Ad": Ad, "Gd": Gd, "Pa": Pa, "Pg": Pg}
        if self.option == 2:
            mats["Sg"] = b.matmul(b.matmul(Pg, Gd), b.transpose(Pg, [1, 0]))
            mats["Sa"] = b.matmul(b.matmul(Pa, Ad), b.transpose(Pa, [1, 0]))
            pows = [(Pa, Pg)]  # (Psi_A^(2^k), Psi_G^(2^k)), k < doublings
            for _ in range(self.doublings - 1):
                pows.append((b.matmul(pows[-1][0], pows[-1][0]), b.matmul(pows[-1][1], pows[-1][1])))
            mats["pows"] = pows
        return mats

    def _emit_forward(self, b, X, mats):
        """F X for the matrix X [out, in+1]."""
        Ad, Gd, Pa, Pg = mats["Ad"], mats["Gd"], mats["Pa"], mats["Pg"]
        if self.option == 1:
            Y = b.matmul(b.matmul(Gd, X), Ad)
            terms = [b.scale(Y, 1.0)]
            for dd in range(1, self.R):
                Y = b.matmul(b.matmul(Pg, Y), b.transpose(Pa, [1, 0]))
                terms.append(b.scale(Y, 2.0 * (self.R - dd) / self.R))
            return emit_add_all(b, terms)
        # option 2: (I - Psi)^-1 S (I - Psi^T)^-1 v
        T = lambda m: b.transpose(m, [1, 0])  # noqa: E731
        X = self._emit_neumann(b, X, [(T(pa), T(pg)) for pa, pg in mats["pows"]])
        Y = b.matmul(b.matmul(Gd, X), Ad)
        Y = b.sub(Y, b.matmul(b.matmul(mats["Sg"], X), mats["Sa"]))
        return self._emit_neumann(b, Y, mats["pows"])

    def _emit_neumann(self, b, X, pows):
        """(I - PA (x) PG)^-1 vec(X) ~ prod_{k<m} (I + PA^(2^k) (x) PG^(2^k)) vec(X), given the
        powers (PA^(2^k), PG^(2^k))."""
        for PA, PG in pows:
            X = b.add(X, b.matmul(b.matmul(PG, X), b.transpose(PA, [1, 0])))
        return X


@register_block
class FullyConnectedKronSeries1(FullyConnectedKronSeries):
    """Martens, Ba & Johnson 2018, Option 1 (finite R, symmetric V_1)."""

    name = "kron_series_1"
    uses = "multi"
    menu_rank = 1
    option = 1


@register_block
class FullyConnectedKronSeries2(FullyConnectedKronSeries):
    """Martens, Ba & Johnson 2018, Option 2 (R -> infinity)."""

    name = "kron_series_2"
    uses = "multi"
    menu_rank = 2
    option = 2
