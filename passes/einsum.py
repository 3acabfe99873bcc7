"""Canonicalization: an Einsum that is a dense layer becomes a MatMul, so that the patterns see it.

jax2onnx (and hand-written ONNX) writes dense layers as Einsum: `jnp.einsum('btd,df->btf', x, W)`,
flax's nnx.Einsum `'btf,fhk->bthk'`, attention's head projections `'btd,dhk->bthk'` /
`'bqhk,hkd->bqd'`, `lax.dot_general` over another axis `'abc,bd->acd'`; with no Einsum pattern
they fell to generic (diagonal) blocks. `einsum_to_matmul` rewrites `Einsum(x, W)` (either
order), W an initializer or a Transpose of one (a tied head `Einsum(h, Transpose(E))`), when
every index of W is either contracted with x (and not in the output) or in the output and
not in x, and x keeps at least one index of its own, as

    y = Transpose?(Reshape?(MatMul(Reshape?(Transpose?(x)), Reshape?(Transpose?(W)))))

x's own indices first in its order, the contracted ones last (merged into one); W laid out
[contracted, W's own] (merged into two dims). The W-side re-layouts are of an initializer, so
canonicalization's relayout fold (fold_params.relayout_ends) makes them one [in, out]
initializer that keeps W's name (the plan gives W back in its source shape), and the matmul
patterns match. The same values: the product only regroups the sum.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kfac_compiler.graph import attrs_of, fresh_name


def einsum_to_matmul(m: onnx.ModelProto) -> int:
    """Rewrite the dense-layer Einsums of `m` in place (module docstring); returns how many."""
    g = m.graph
    inits = {t.name: tuple(int(d) for d in t.dims) for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output if o}
    taken = {n.name for n in g.node} | {o for n in g.node for o in n.output} | set(inits) | {i.name for i in g.input}
    out: list[onnx.NodeProto] = []
    count = 0
    for node in g.node:
        rewritten = _rewrite(node, inits, producers, taken) if _is_einsum(node) else None
        if rewritten is None:
            out.append(node)
        else:
            out.extend(rewritten)
            count += 1
    if count:
        del g.node[:]
        g.node.extend(out)
    return count


def _is_einsum(node: onnx.NodeProto) -> bool:
    return node.op_type == "Einsum" and node.domain in ("", "ai.onnx") and len(node.input) == 2


def _weight_shape(name: str, inits: dict, producers: dict) -> tuple[int, ...] | None:
    """The static shape of a parameter operand: an initializer, or a Transpose of one."""
    if name in inits:
        return inits[name]
    node = producers.get(name)
    if node is None or node.op_type != "Transpose" or node.input[0] not in inits:
        return None
    shape = inits[node.input[0]]
    perm = attrs_of(node).get("perm", list(reversed(range(len(shape)))))
    return tuple(shape[int(p)] for p in perm)


def _subscripts(node: onnx.NodeProto) -> tuple[str, str, str] | None:
    equation = attrs_of(node).get("equation")
    if isinstance(equation, bytes):
        equation = equation.decode()
    if not isinstance(equation, str):
        return None
    equation = equation.replace(" ", "")
    if "." in equation or "->" not in equation:
        return None
    lhs, result = equation.split("->")
    operands = lhs.split(",")
    if len(operands) != 2 or not all(s.isalpha() for s in (*operands, result) if s):
        return None
    a, b = operands
    if any(len(set(s)) != len(s) for s in (a, b, result)):
        return None  # a repeated index (a diagonal, a trace): not a product
    return a, b, result


def _rewrite(node: onnx.NodeProto, inits: dict, producers: dict, taken: set) -> list[onnx.NodeProto] | None:
    subs = _subscripts(node)
    if subs is None:
        return None
    for w_at in (1, 0):
        w_shape = _weight_shape(node.input[w_at], inits, producers)
        if w_shape is None:
            continue
        xs, ws, result = (subs[1 - w_at], subs[w_at], subs[2])
        if len(w_shape) != len(ws):
            return None
        contracted = [c for c in ws if c in xs]
        own_w = [c for c in ws if c not in xs]
        own_x = [c for c in xs if c not in ws]
        if (not contracted or not own_w or not own_x or any(c in result for c in contracted)
                or sorted(own_x + own_w) != sorted(result)):
            continue
        return _matmul_nodes(node, node.input[1 - w_at], node.input[w_at], xs, ws, result,
                             dict(zip(ws, w_shape)), own_x, contracted, own_w, taken)
    return None


def _matmul_nodes(node: onnx.NodeProto, x: str, w: str, xs: str, ws: str, result: str, size: dict,
                  own_x: list[str], contracted: list[str], own_w: list[str], taken: set) -> list[onnx.NodeProto]:
    nodes: list[onnx.NodeProto] = []

    def fresh(hint: str) -> str:
        return fresh_name(f"{node.name}/{hint}", taken)

    def add(op: str, inputs: list[str], hint: str, **attrs) -> str:
        out = fresh(hint)
        nodes.append(helper.make_node(op, inputs, [out], name=fresh(hint + "_node"), **attrs))
        return out

    def shape_const(dims: list[int], hint: str) -> str:
        return add("Constant", [], hint, value=numpy_helper.from_array(np.asarray(dims, np.int64)))

    def permuted(t: str, have: str, want: list[str], hint: str) -> str:
        perm = [have.index(c) for c in want]
        return t if perm == list(range(len(perm))) else add("Transpose", [t], hint, perm=perm)

    k = math.prod(size[c] for c in contracted)
    n = math.prod(size[c] for c in own_w)
    x2 = permuted(x, xs, own_x + contracted, "x_t")
    if len(contracted) > 1:
        x2 = add("Reshape", [x2, shape_const([0] * len(own_x) + [k], "x_shape")], "x_r")
    w2 = permuted(w, ws, contracted + own_w, "w_t")
    if len(contracted) > 1 or len(own_w) > 1:
        w2 = add("Reshape", [w2, shape_const([k, n], "w_shape")], "w_r")
    y = add("MatMul", [x2, w2], "matmul")
    if len(own_w) > 1:
        y = add("Reshape", [y, shape_const([0] * len(own_x) + [size[c] for c in own_w], "y_shape")], "y_r")
    have = "".join(own_x + own_w)
    if have != result:
        y = add("Transpose", [y], "y_t", perm=[have.index(c) for c in result])
    # the last node writes the Einsum's own output
    last = nodes[-1]
    last.output[0] = node.output[0]
    return nodes
