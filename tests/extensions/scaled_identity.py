"""A Fisher block defined in one file, with the public block API only.

"scaled_identity" for fully connected layers: F ~ c I with c the mean of the diagonal of
the Kronecker factors' product, c = (tr A / dim A) (tr G / dim G) (A, G as for "kron":
a~ = (alpha a, beta) rows, delta the per-example output gradients). The factor is the
scalar c; the inverse state c_inv = 1 / (c + damping); every real power is (c + damping)^p.
Registering the class makes it selectable: config approximations.fully_connected =
"scaled_identity" (or .fully_connected_multi: uses = "any"), listed last (menu_rank 100).
"""
from __future__ import annotations

import numpy as np

from kfac_compiler import linalg
from kfac_compiler.blocks import FisherBlock, InverseState, register_block
from kfac_compiler.blocks.ops import emit_concat, emit_dim
from kfac_compiler.ir import FactorSpec


@register_block
class ScaledIdentity(FisherBlock):
    """F ~ (tr A / dim A)(tr G / dim G) I for a fully connected layer."""

    name = "scaled_identity"
    layer_kinds = ("fully_connected",)
    uses = "any"
    host_matpowers = True  # a scalar: every real power on the host

    def __init__(self, layer, param_shapes, input_shapes=None, **options):
        super().__init__(layer, param_shapes, input_shapes, **options)
        w = tuple(param_shapes[layer.weight])
        out_in = layer.attrs.get("weight_layout", "in_out") == "out_in"
        self.n_out, self.n_in = w if out_in else w[::-1]
        self.has_bias = layer.bias is not None
        alpha, beta = layer.attrs.get("alpha"), layer.attrs.get("beta")
        self.alpha = 1.0 if alpha is None else float(alpha)
        self.beta = 1.0 if beta is None else float(beta)
        self.nA = self.n_in + int(self.has_bias)

    # ---- what the plan records
    def factor_specs(self):
        return [FactorSpec("c", (), role="c")]

    def inverse_specs(self):
        return [FactorSpec("c_inv", (), role="c_inv")]

    def stats_flops(self, batch):
        return 2 * batch * (self.n_in + self.n_out)

    def inverse_flops(self, method=linalg.DEFAULT_METHOD):
        return 4

    # ---- statistics: c = mean(a~^2 over rows and columns) * sum(delta^2) / (N dim G)
    def emit_statistics(self, b, inputs, cotangents):
        X = emit_concat(b, [b.reshape(x, [-1, self.n_in]) for x in inputs], axis=0)
        rows = emit_dim(b, X, 0)
        sq_a = b.scale(b.reduce("ReduceSumSquare", X, None), self.alpha**2)
        if self.has_bias:
            sq_a = b.add(sq_a, b.scale(rows, self.beta**2))
        D = emit_concat(b, [b.reshape(d, [-1, self.n_out]) for ds in cotangents for d in ds], axis=0)
        n = emit_dim(b, cotangents[0][0], 0)
        mean_a = b.div(sq_a, b.scale(rows, float(self.nA)))
        mean_g = b.div(b.reduce("ReduceSumSquare", D, None), b.scale(n, float(self.n_out)))
        return {"c": b.mul(mean_a, mean_g)}

    def numpy_statistics(self, inputs, cotangents):
        X = np.concatenate([self.alpha * np.asarray(x, np.float64).reshape(-1, self.n_in) for x in inputs])
        sq_a = (X * X).sum() + (len(X) * self.beta**2 if self.has_bias else 0.0)
        D = np.concatenate([np.asarray(d, np.float64).reshape(-1, self.n_out) for ds in cotangents for d in ds])
        n = np.shape(cotangents[0][0])[0]
        return {"c": np.asarray(sq_a / (len(X) * self.nA) * (D * D).sum() / (n * self.n_out))}

    # ---- inverse state: 1 / (c + damping), kept at `previous` (or 1) when not usable
    def emit_inverse(self, b, factors, damping, method=linalg.DEFAULT_METHOD, previous=None):
        damped = b.add(factors["c"], damping)
        new = b.op("Reciprocal", [damped])
        ok = b.op("And", [linalg.emit_finite(b, new), b.op("Greater", [damped, b.const(0.0)])])
        old = previous["c_inv"] if previous else b.const(1.0)
        state = InverseState(c_inv=linalg.emit_select(b, ok, new, old))
        state.ok = ok
        return state

    def numpy_inverse(self, factors, damping, method="eigh", previous=None):
        c = np.asarray(factors["c"])
        damped = c.astype(np.float64) + float(damping)
        ok = bool(np.isfinite(damped) and damped > 0)
        value = 1.0 / damped if ok else (previous["c_inv"] if previous is not None else 1.0)
        return {"c_inv": np.asarray(value, dtype=c.dtype)}, ok

    def numpy_matpower(self, factors, damping, exp):
        damped = float(np.asarray(factors["c"], np.float64)) + float(damping)
        ok = bool(np.isfinite(damped) and damped > 0)
        return {"c_pow": np.asarray(damped**exp if ok else 1.0)}, ok

    # ---- the power hook: every parameter times (c + damping)^exp, or times the state
    def emit_power(self, b, vectors, exp, *, factors=None, damping=None, state=None):
        if state is not None:
            s = state["c_inv"] if "c_inv" in state else state["c_pow"]
        else:
            s = b.add(factors["c"], damping)
            if exp != 1:
                s = b.op("Pow", [s, b.const(float(exp))])
        return {p: b.mul(v, s) for p, v in vectors.items()}

    def numpy_power(self, vectors, exp, *, factors=None, damping=None, state=None):
        if state is not None:
            s = float(np.asarray(state["c_inv"] if "c_inv" in state else state["c_pow"], np.float64))
        else:
            s = (float(np.asarray(factors["c"], np.float64)) + float(damping)) ** exp
        return {p: np.asarray(v, np.float64) * s for p, v in vectors.items()}
