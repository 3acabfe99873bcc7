"""Softmax/LogSoftmax and the cross-entropy losses built on them (SoftmaxCrossEntropyLoss,
NegativeLogLikelihoodLoss): the normalisation over the class axis and the label one-hot,
weights, ignore_index and reduction of the losses."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    add_n,
    attr,
    c,
    dims_slice,
    inp,
    need,
    out,
    static_shape,
    unsupported,
)


# ============================================================ Softmax / LogSoftmax
def _softmax_apply(b, view, node, v, mode):
    """mode 'vjp' or 'jvp'; handles opset>=13 (single axis) and <13 (flatten to 2-D)."""
    y = node.output[0]
    old = view.opset < 13
    axis = int(attr(node, "axis", 1 if old else -1))
    if old:
        v2 = b.op("Flatten", [v], axis=axis)
        y2 = b.op("Flatten", [y], axis=axis)
        ax = 1
    else:
        v2, y2, ax = v, y, axis
    if node.op_type == "Softmax":
        r = b.mul(y2, b.sub(v2, b.reduce_sum(b.mul(v2, y2), [ax], keepdims=True)))
    else:  # LogSoftmax: J = I - 1 p^T ; J^T = I - p 1^T
        p = b.op("Exp", [y2])
        if mode == "vjp":
            r = b.sub(v2, b.mul(p, b.reduce_sum(v2, [ax], keepdims=True)))
        else:
            r = b.sub(v2, b.reduce_sum(b.mul(p, v2), [ax], keepdims=True))
    if old:
        r = b.reshape(r, b.op("Shape", [node.input[0]]))
    return r


@register(("Softmax", "LogSoftmax"), inputs=(0,))
def _softmax_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else _softmax_apply(b, view, node, g, "vjp")]


@_softmax_vjp.defjvp
def _softmax_jvp(b, view, node, ts):
    t = ts[0]
    return [None if t is None else _softmax_apply(b, view, node, t, "jvp")]


# ================================================================ cross-entropy losses
class _CE:
    """Pieces shared by SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss rules.

    Per element i (over N and the extra dims): w_i = weights[y_i] (1 without weights) times
    the ignore mask; loss_i = -w_i lp[i, y_i]; reduction none: loss_i, sum: sum_i, mean:
    sum_i / sum_i w_i."""

    def __init__(self, b, view, node, scores_like: str):
        self.b, self.node = b, node
        labels = node.input[1]
        if view.dtypes.get(labels) != TensorProto.INT64:
            labels = b.cast(labels, TensorProto.INT64)
        self.weights = inp(node, 2)
        ii = attr(node, "ignore_index")
        self.keep = None
        self.safe = labels
        if ii is not None:
            keep = b.op("Not", [b.op("Equal", [labels, b.const(np.asarray(ii, np.int64))])])
            self.safe = b.op("Where", [keep, labels, b.const(np.asarray(0, np.int64))])
            self.keep = b.cast(keep, b.float_type)
        self.wm = self.keep
        if self.weights is not None:
            w = b.op("Gather", [self.weights, self.safe], axis=0)
            self.wm = w if self.keep is None else b.mul(w, self.keep)
        st = static_shape(view, scores_like)
        depth = (b.const(np.asarray(st[1], np.int64)) if st is not None
                 else b.reshape(dims_slice(b, scores_like, 1, 2), []))
        values = b.const(np.asarray([0.0, 1.0], dtype=b.np_float))
        self.onehot = b.op("OneHot", [self.safe, depth, values], axis=1)
        self.red = attr(node, "reduction", "mean")
        self.denom = None
        if self.red == "mean":
            if self.wm is not None:
                self.denom = b.reduce_sum(self.wm, None, keepdims=False)
            else:
                ls = static_shape(view, node.input[1])
                self.denom = (c(b, float(np.prod(ls))) if ls is not None
                              else b.cast(b.op("Size", [labels]), b.float_type))
        self.rank = view.rank(scores_like)

    def coef(self, g: str) -> str:
        """Per-element coefficient of -onehot in d loss / d lp (broadcasts over axis 1)."""
        b = self.b
        coef = b.div(g, self.denom) if self.red == "mean" else g
        if self.wm is not None:
            coef = b.mul(coef, self.wm)
        if self.red == "none" or self.wm is not None:
            coef = b.unsqueeze(coef, [1])
        return coef

    def reduce(self, per: str) -> str:
        """Apply the reduction to per-element values that already include w_i."""
        b = self.b
        if self.red == "none":
            return per
        tot = b.reduce_sum(per, None, keepdims=False)
        return tot if self.red == "sum" else b.div(tot, self.denom)

    def lp_at_label(self, lp: str) -> str:
        return self.b.reduce_sum(self.b.mul(self.onehot, lp), [1], keepdims=False)

    def weight_vjp(self, view, g: str, lp: str) -> str:
        """d loss / d weights[c] = sum_{i: y_i = c} e_i."""
        b = self.b
        e = b.neg(self.lp_at_label(lp))
        if self.red == "mean":
            e = b.div(b.sub(e, self.node.output[0]), self.denom)
        e = b.mul(e, g)
        if self.keep is not None:
            e = b.mul(e, self.keep)
        if self.rank is None:
            raise unsupported(self.node, view, "weights gradient needs the input rank")
        axes = [0] + list(range(2, self.rank))
        return b.reduce_sum(b.mul(self.onehot, b.unsqueeze(e, [1])), axes, keepdims=False)

    def weight_jvp(self, tw: str, lp: str) -> str:
        b = self.b
        twy = b.op("Gather", [tw, self.safe], axis=0)
        if self.keep is not None:
            twy = b.mul(twy, self.keep)
        per = b.neg(b.mul(twy, self.lp_at_label(lp)))
        if self.red == "none":
            return per
        tot = b.reduce_sum(per, None, keepdims=False)
        if self.red == "sum":
            return tot
        return b.div(b.sub(tot, b.mul(self.node.output[0], b.reduce_sum(twy, None, keepdims=False))), self.denom)


def _ce_logp(b, node) -> str:
    """Log-probabilities: NLL's input, or SoftmaxCrossEntropyLoss's log_prob output
    (recomputed when the node does not expose it)."""
    if node.op_type == "NegativeLogLikelihoodLoss":
        return node.input[0]
    return out(node, 1) or b.op("LogSoftmax", [node.input[0]], axis=1)


@register(("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"), since=13, inputs=(0, 2))
def _ce_vjp(b, view, node, gys, needs=None):
    g_loss = gys[0]
    g_lp = gys[1] if len(gys) > 1 else None
    res: list[str | None] = [None] * len(node.input)
    ce = _CE(b, view, node, node.input[0])
    lp = _ce_logp(b, node)
    if need(needs, 0):
        terms = []
        if g_loss is not None:
            terms.append(b.neg(b.mul(ce.onehot, ce.coef(g_loss))))
        if g_lp is not None:
            terms.append(g_lp)
        glp = add_n(b, terms)
        if glp is not None and node.op_type == "SoftmaxCrossEntropyLoss":
            p = b.op("Exp", [lp])
            glp = b.sub(glp, b.mul(p, b.reduce_sum(glp, [1], keepdims=True)))
        res[0] = glp
    if len(node.input) > 2 and inp(node, 2) and need(needs, 2) and g_loss is not None:
        res[2] = ce.weight_vjp(view, g_loss, lp)
    return res


@_ce_vjp.defjvp
def _ce_jvp(b, view, node, ts):
    t = ts[0]
    tw = ts[2] if len(ts) > 2 else None
    ce = _CE(b, view, node, node.input[0])
    lp = _ce_logp(b, node)
    dlp = None
    if t is not None:
        if node.op_type == "SoftmaxCrossEntropyLoss":
            dlp = b.sub(t, b.reduce_sum(b.mul(b.op("Exp", [lp]), t), [1], keepdims=True))
        else:
            dlp = t
    terms = []
    if dlp is not None:
        per = b.neg(ce.lp_at_label(dlp))
        if ce.wm is not None:
            per = b.mul(per, ce.wm)
        terms.append(ce.reduce(per))
    if tw is not None:
        terms.append(ce.weight_jvp(tw, lp))
    res = [add_n(b, terms)]
    if len(node.output) > 1:
        res.append(dlp if node.output[1] else None)
    return res
