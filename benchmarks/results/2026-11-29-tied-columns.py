"""Where kron_tied_vocab_diag's single Kronecker product under- or over-states the curvature
of its two terms, per vocabulary column, after the first K-FAC step on the gpt-ts fixture
(for 2026-11-29-tied-memory.md).

    python benchmarks/results/2026-11-29-tied-columns.py

With L diagonal the block is block-diagonal over columns v: the two terms give
K_v = A_V[v] G_D + G_V[v] A_D [D, D], the block L[v] R. Printed per column: the extreme
generalized eigenvalues of (L[v] R + lam I, K_v + lam I) (lam = 1e-3, the default damping):
below 1 the approximation understates the curvature there (a step longer than the terms'
by that factor), and A_V[v] (the token's share of the lookups).
"""
from __future__ import annotations

import warnings

import numpy as np
import scipy.linalg as sl

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler.blocks.tied import np_nkp_coefficients
from kfac_compiler.models.real_data import batch
from kfac_compiler.runtime import Trainer


def main() -> None:
    warnings.simplefilter("ignore")
    plan = kc.compile("tests/fixtures/real/gpt-ts.onnx", loss="softmax_cross_entropy",
                      config={"approximations": {"tied_embedding": "kron_tied_vocab_diag"}})
    x, y = batch("tokens", None, 0)
    tr = Trainer(plan, optimizer="kfac", seed=0)
    tr.step({"input": x[:32]}, y[:32])
    name = next(layer.name for layer in plan.layers if layer.kind == "tied_embedding")
    slots = C.layer_slots(tr.store.slots(), C.FACTOR)[name]
    A_V, G_D, A_D, G_V = (np.asarray(tr.store.to_numpy(slots[k]), np.float64) for k in ("A_V", "G_D", "A_D", "G_V"))
    Ga = [[A_V @ A_V, A_V @ G_V], [A_V @ G_V, G_V @ G_V]]
    Gb = [[(G_D * G_D).sum(), (G_D * A_D).sum()], [(G_D * A_D).sum(), (A_D * A_D).sum()]]
    (c1, c2), (d1, d2) = np_nkp_coefficients(Ga, Gb)
    L, R = c1 * A_V + c2 * G_V, d1 * G_D + d2 * A_D
    print(f"c = ({c1:.3f}, {c2:.3f}), d = ({d1:.3f}, {d2:.3f}); tr G_D {np.trace(G_D):.2f}, tr A_D {np.trace(A_D):.2f}")
    eye = np.eye(len(R))
    for v in np.argsort(-A_V):
        ev = sl.eigh(L[v] * R + 1e-3 * eye, A_V[v] * G_D + G_V[v] * A_D + 1e-3 * eye, eigvals_only=True)
        print(f"token {v:2d}  A_V {A_V[v]:.3f}  G_V {G_V[v]:.3f}  approx/terms min {ev.min():.3f} max {ev.max():.1f}")


if __name__ == "__main__":
    main()
