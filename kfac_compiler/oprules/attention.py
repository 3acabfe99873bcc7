"""Attention (opset 23): Y = softmax(scale Q K^T + mask) V, per head, with grouped KV heads
(GQA), causal masking and 3-d [B, S, H * D] or 4-d [B, H, S, D] operands.

The softmax probabilities P are recomputed by re-emitting the node with
qk_matmul_output_mode=3 (its fourth output is P, with the op's own masking, causal
alignment and scale), so the rule never re-implements the masking semantics. Then, in the
4-d head layout with K, V repeated to the query heads (summed back for their cotangents):

    dV = P^T g,  dP = g V^T,  dS = P (dP - rowsum(dP P)),  dQ = scale dS K,  dK = scale dS^T Q,
    d(float mask) = dS summed to the mask's shape;
    jvp: tS = scale (tQ K^T + Q tK^T) + t_mask,  tP = P (tS - rowsum(tS P)),  tY = tP V + P tV.

Not supported (UnsupportedOpError): past_key/past_value (KV cache) or nonpad_kv_seqlen
inputs, softcap != 0, gradients through the present_key/present_value/qk outputs.
"""
from __future__ import annotations

import math

from onnx import helper

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import add_n, attr, c, inp, need, unbroadcast, unsupported


def _geometry(view, node):
    q, k, v = node.input[0], node.input[1], node.input[2]
    sq, sk, sv = view.shape(q), view.shape(k), view.shape(v)
    if sq is None or sk is None or sv is None:
        raise unsupported(node, view, "needs the ranks of Q, K, V (run shape inference)")
    r = len(sq)
    if r == 4:
        hq, hkv, d, dv = sq[1], sk[1], sq[3], sv[3]
    elif r == 3:
        hq, hkv = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
        if hq is None or hkv is None:
            raise unsupported(node, view, "with 3-d inputs needs q_num_heads and kv_num_heads")
        d = sq[2] // hq if isinstance(sq[2], int) else None
        dv = sv[2] // hkv if isinstance(sv[2], int) else None
    else:
        raise unsupported(node, view, f"with rank-{r} inputs is not differentiable")
    if not (isinstance(hq, int) and isinstance(hkv, int) and hq % hkv == 0):
        raise unsupported(node, view, f"needs static head counts (q {hq!r}, kv {hkv!r})")
    scale = attr(node, "scale")
    if scale is None:
        if not isinstance(d, int):
            raise unsupported(node, view, "without a scale attribute needs a static head size")
        scale = 1.0 / math.sqrt(d)
    return {"rank": r, "hq": hq, "hkv": hkv, "d": d, "dv": dv, "scale": float(scale)}


def _check(view, node):
    if inp(node, 4) or inp(node, 5) or inp(node, 6):
        raise unsupported(node, view, "with past_key/past_value (KV cache) or nonpad_kv_seqlen is not differentiable")
    if float(attr(node, "softcap", 0.0) or 0.0) != 0.0:
        raise unsupported(node, view, "with softcap is not differentiable")
    for o in list(node.output)[1:]:
        if o and (view.consumers.get(o) or o in view.graph_outputs):
            raise unsupported(node, view, f"output {o!r} (present_key/present_value/qk) is used: not differentiable")
    _geometry(view, node)


def _probs(b, node) -> str:
    """P [B, Hq, Sq, Skv]: the node re-emitted with qk_matmul_output_mode=3."""
    y, p = b.fresh("attn_y"), b.fresh("attn_p")
    n = helper.make_node("Attention", list(node.input), [y, "", "", p], name=b.fresh("Attention/probs"))
    n.attribute.extend(a for a in node.attribute if a.name != "qk_matmul_output_mode")
    n.attribute.append(helper.make_attribute("qk_matmul_output_mode", 3))
    b.nodes.append(n)
    return p


def _to4(b, t: str, geo, heads: int) -> str:
    """[B, S, H*D] -> [B, H, S, D] (3-d layout); 4-d unchanged."""
    if geo["rank"] == 4:
        return t
    return b.transpose(b.reshape(t, [0, 0, heads, -1]), [0, 2, 1, 3])


def _from4(b, t: str, geo) -> str:
    if geo["rank"] == 4:
        return t
    return b.reshape(b.transpose(t, [0, 2, 1, 3]), [0, 0, -1])


def _rep(b, t: str, geo) -> str:
    """KV heads [B, Hkv, S, D] repeated to the query heads [B, Hq, S, D] (head h uses h // rep)."""
    rep = geo["hq"] // geo["hkv"]
    if rep == 1:
        return t
    u = b.unsqueeze(t, [2])  # [B, Hkv, 1, S, D]
    head, tail = b.op("Shape", [t], end=2), b.op("Shape", [t], start=2)
    u = b.op("Expand", [u, b.op("Concat", [head, b.ints([rep]), tail], axis=0)])
    return b.reshape(u, b.op("Concat", [b.op("Shape", [t], end=1), b.ints([geo["hq"]]), tail], axis=0))


def _unrep(b, t: str, geo) -> str:
    """[B, Hq, S, D] -> [B, Hkv, S, D], summing each KV head's query group."""
    rep = geo["hq"] // geo["hkv"]
    if rep == 1:
        return t
    shp = b.op("Concat", [b.op("Shape", [t], end=1), b.ints([geo["hkv"], rep]), b.op("Shape", [t], start=2)], axis=0)
    return b.reduce_sum(b.reshape(t, shp), [2])


def _tr(b, t: str) -> str:
    return b.transpose(t, [0, 1, 3, 2])


@register("Attention", since=23, inputs=(0, 1, 2, 3))
def _attn_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    res: list[str | None] = [None] * len(node.input)
    if g is None:
        return res
    geo = _geometry(view, node)
    Q = _to4(b, node.input[0], geo, geo["hq"])
    K = _rep(b, _to4(b, node.input[1], geo, geo["hkv"]), geo)
    V = _rep(b, _to4(b, node.input[2], geo, geo["hkv"]), geo)
    g4 = _to4(b, g, geo, geo["hq"])
    P = _probs(b, node)
    if need(needs, 2):
        res[2] = _from4(b, _unrep(b, b.matmul(_tr(b, P), g4), geo), geo)
    mask = inp(node, 3)
    mask_grad = mask is not None and need(needs, 3) and view.is_float(mask)
    if not (need(needs, 0) or need(needs, 1) or mask_grad):
        return res
    dP = b.matmul(g4, _tr(b, V))
    dS = b.mul(P, b.sub(dP, b.reduce_sum(b.mul(dP, P), [-1], keepdims=True)))
    s = c(b, geo["scale"])
    if need(needs, 0):
        res[0] = _from4(b, b.mul(b.matmul(dS, K), s), geo)
    if need(needs, 1):
        res[1] = _from4(b, _unrep(b, b.mul(b.matmul(_tr(b, dS), Q), s), geo), geo)
    if mask_grad:
        res[3] = unbroadcast(b, view, dS, mask, rshape=None if view.shape(mask) is None else _score_shape(view, node, geo))
    return res


def _score_shape(view, node, geo):
    sq, sk = view.shape(node.input[0]), view.shape(node.input[1])
    if geo["rank"] == 4:
        return (sq[0], geo["hq"], sq[2], sk[2])
    return (sq[0], geo["hq"], sq[1], sk[1])


@_attn_vjp.defjvp
def _attn_jvp(b, view, node, ts):
    tq, tk, tv = (list(ts) + [None] * 4)[:3]
    tm = ts[3] if len(ts) > 3 else None
    if tq is None and tk is None and tv is None and tm is None:
        return [None] * len(node.output)
    geo = _geometry(view, node)
    Q = _to4(b, node.input[0], geo, geo["hq"])
    K = _rep(b, _to4(b, node.input[1], geo, geo["hkv"]), geo)
    V = _rep(b, _to4(b, node.input[2], geo, geo["hkv"]), geo)
    P = _probs(b, node)
    terms = []
    s_terms = []
    if tq is not None:
        s_terms.append(b.matmul(_to4(b, tq, geo, geo["hq"]), _tr(b, K)))
    if tk is not None:
        s_terms.append(b.matmul(Q, _tr(b, _rep(b, _to4(b, tk, geo, geo["hkv"]), geo))))
    tS = b.mul(add_n(b, s_terms), c(b, geo["scale"])) if s_terms else None
    if tm is not None:
        tS = tm if tS is None else b.add(tS, tm)
    if tS is not None:
        tP = b.mul(P, b.sub(tS, b.reduce_sum(b.mul(tS, P), [-1], keepdims=True)))
        terms.append(b.matmul(tP, V))
    if tv is not None:
        terms.append(b.matmul(P, _rep(b, _to4(b, tv, geo, geo["hkv"]), geo)))
    return [_from4(b, add_n(b, terms), geo)] + [None] * (len(node.output) - 1)


_attn_vjp.defcheck(_check)


# ==================================================================== RotaryEmbedding
@register("RotaryEmbedding", since=23, inputs=(0,))
def _rope_vjp(b, view, node, gys):
    """A rotation of each (pair of) coordinate(s) by a position-dependent angle: orthogonal,
    so the vjp is the rotation by the opposite angle, the op with sin_cache negated (the
    unrotated tail, rotary_embedding_dim < head size, passes through either way). The caches
    are taken as constants."""
    g = gys[0]
    if g is None:
        return [None]
    ins = list(node.input)
    ins[0], ins[2] = g, b.neg(node.input[2])
    out = b.fresh("rope_vjp")
    n = helper.make_node("RotaryEmbedding", ins, [out], name=b.fresh("RotaryEmbedding/vjp"))
    n.attribute.extend(node.attribute)
    b.nodes.append(n)
    return [out]


def _rope_jvp(b, view, node, ts):
    from kfac_compiler.oprules._util import linear_jvp

    return linear_jvp(0)(b, view, node, ts)


_rope_vjp.defjvp(_rope_jvp)
