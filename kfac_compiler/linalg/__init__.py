"""Damped inverses and matrix powers of SPD curvature factors: ONNX emitters + numpy twins.

Inverse methods (docs/conventions.md, "Inverse methods"):

  "auto" (the default) resolves per device (concrete_method): "schur" on the CPU and on
  CUDA, "inverse_op" when emitting a plan without a device. On every device the runtime
  recomputes a block whose emitted inverse is not ok with host "cholesky" (FALLBACK_METHOD).

  emitted (run inside ONNX Runtime, on the GPU when the session does):
    "inverse_op"     com.microsoft Inverse (LU), batched over a leading axis.
    "newton_schulz"  X_{k+1} = X_k (2I - M X_k), a fixed number of MatMul iterations;
                     warm-started from the previous inverse when it is passed in and still
                     contracts (spectral radius of I - M X_prev estimated below 0.7), else
                     from X_0 = I / ||M||_F.
    "schur"          2x2 blocks on Schur complements, recursively down to blocks of at most
                     SCHUR_LEAF rows (Inverse op there): all MatMuls, the fastest on the CPU
                     and on CUDA (docs/conventions.md, "Which method"), but its error grows
                     like cond^2 eps, so it is ok only while its probe residual is at most
                     SCHUR_TOL = 1e-2 (cond <~ 1e5); the rest go to the fallback.
  host (numpy/scipy; the runtime uploads the results):
    "cholesky"       LAPACK potrf + potrs in the factor's precision (float32 in the
                     runtime), M^-1 = L^-T L^-1 (TF K-FAC register_cholesky /
                     register_cholesky_inverse).
    "eigh"           float64 M = U diag(s) U^T; any matrix power U diag(s^p) U^T (register_matpower),
                     exact (non-factored) damping, the RNN series blocks.

Every method returns, with the result, a boolean "ok" per matrix: False when the input or
the result is not finite, or the result is not an inverse (relative residual
||M X - I||_F / sqrt(n), or schur's probe estimate of it, above `tol`). A caller never uses
a result that is not ok: it keeps the previous (last good) value, or the identity when there
is none. So a NaN/Inf or singular factor never turns into a NaN update.

Shapes: a matrix argument is [n, n] or a batch [..., n, n]; ok has the batch shape.
Matrices of equal size from many factors/blocks can be stacked so that one Inverse (or one
numpy eigh) call serves all of them: `emit_inverse_batch`, `np_inverse_batch`.

Modules: methods.py (the methods, their constants and FLOP counts), host.py (the numpy twins
and host inverses, np_*), emitted.py (the ONNX emitters, emit_*); all re-exported here.
"""
from kfac_compiler.linalg.emitted import *  # noqa: F401,F403
from kfac_compiler.linalg.host import *  # noqa: F401,F403
from kfac_compiler.linalg.methods import *  # noqa: F401,F403
