"""The quadratic model's curvature terms t_i^T F t_j (t_P = J P, t_v = J v, F the loss's Fisher
in z), with one output-sized tangent alive at a time where the output is a wide head's.

The loss's emit_fisher_dots takes both tangents at z: on a language model (a head from rows
of width K to a vocabulary V >> K) v's tangent, ready early in the step (v is an input), was
held as an [N, T, V] tensor through the backward pass until P's came, and beside P's JVP the
step's peak. Here v's tangent is kept where it is small, at the head's inputs (rows of width
K, the head's weight tangent); its own term t_v^T F t_v is taken as soon as its logits
tangent is formed; the terms with P come from g = F t_P pulled back through the head:
t^T g = sum_k <J_k^T g, t_k> over the head's inputs k (t = sum_k J_k t_k is the head's JVP,
J_k^T g its VJP), the same sums up to float rounding.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.backend.forward import ForwardPass


def curvature_dots(em: Emission, fwd: ForwardPass, precond: dict[str, str], velocity: dict[str, str]
                   ) -> tuple[dict[tuple[int, int], str], str, str]:
    """({(0, 0): t_P.F t_P, (0, 1): t_P.F t_v, (1, 1): t_v.F t_v} summed over the batch with
    the example weights, J P, J v) on pass `fwd`."""
    b, z, loss = em.b, fwd.z, em.parts.loss
    node = em.head_of(fwd)  # the back end's (backend/head.py), which owns the op rules
    if node is None:
        j_p = em.jvp(fwd, precond, [z])[z]
        j_v = em.jvp(fwd, velocity, [z])[z]
        return loss.emit_fisher_dots(b, z, [j_p, j_v], fwd.weight), j_p, j_v
    t_v, j_v = em.head_jvp(fwd, node, velocity)
    vv = loss.emit_fisher_dots(b, z, [j_v], fwd.weight)[(0, 0)]  # emitted before P's tangent
    t_p, j_p = em.head_jvp(fwd, node, precond)
    g = loss.emit_fisher_times(b, z, j_p)
    if fwd.weight is not None:
        g = b.mul(g, fwd.weight)
    pulled = em.head_vjp(fwd, node, g, [p is not None or v is not None for p, v in zip(t_p, t_v)])

    def paired(ts: list[str | None]) -> str:
        return b.sum([b.reduce_sum(b.mul(ct, t), None) for ct, t in zip(pulled, ts) if ct is not None and t is not None])

    return {(0, 0): paired(t_p), (0, 1): paired(t_v), (1, 1): vv}, j_p, j_v
