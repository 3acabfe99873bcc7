"""A wide head's own products for the quadratic model's curvature terms
(optimizers/kfac/curvature.py): the node that makes z, where it widens its input rows into a
vocabulary's logits, and its op rule's JVP and VJP. The back end owns the op rules; the
optimizer asks through Emission (head_of, head_jvp, head_vjp)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import onnx

from kfac_compiler.oprules import Rule, find

if TYPE_CHECKING:
    from kfac_compiler.backend.forward import ForwardPass
    from kfac_compiler.builder import GraphBuilder

# A head this much wider than its inputs' rows takes the pulled-back form (below, the
# logits tangents are not the step's largest tensors and the form saves nothing)
WIDENING = 2


def _rule(fwd: ForwardPass, node: onnx.NodeProto) -> Rule:
    rule = find(node, fwd.view.opset)
    assert rule is not None and rule.jvp_fn is not None and rule.vjp_fn is not None
    return rule


def wide_head(fwd: ForwardPass) -> onnx.NodeProto | None:
    """The MatMul or Gemm that makes z, where its output rows are at least WIDENING times
    wider than the rows it multiplies (static widths), and it has both rules; else None."""
    node = fwd.view.producer.get(fwd.z)
    if node is None or node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
        return None
    rule = find(node, fwd.view.opset)
    a, out = fwd.view.shape(node.input[0]), fwd.view.shape(fwd.z)
    if rule is None or rule.jvp_fn is None or rule.vjp_fn is None or not a or not out:
        return None
    trans_a = node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute)
    k, v = a[0] if trans_a else a[-1], out[-1]
    return node if isinstance(k, int) and isinstance(v, int) and v >= WIDENING * k else None


def head_jvp(b: GraphBuilder, fwd: ForwardPass, node: onnx.NodeProto,
             at: dict[str, str]) -> tuple[list[str | None], str]:
    """(the tangents of the head's differentiable inputs, from `at` {input: tangent}; that of z)."""
    rule = _rule(fwd, node)
    ts = [at.get(x) if x and rule.diff_slot(i) else None for i, x in enumerate(node.input)]
    jz = rule.jvp(b, fwd.view, node, ts)[0]
    assert jz is not None, f"no tangent reaches the head {node.name!r}"  # the parameters' tangents all do
    return ts, jz


def head_vjp(b: GraphBuilder, fwd: ForwardPass, node: onnx.NodeProto, g: str, needs: list[bool]) -> list[str | None]:
    """The head's input cotangents for z's cotangent `g` (those `needs` asks for)."""
    return _rule(fwd, node).vjp(b, fwd.view, node, [g], needs)
