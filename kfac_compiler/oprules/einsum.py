"""Einsum: a multilinear op, so every operand's cotangent is one Einsum of the output
cotangent with the other operands.

For operand i with subscripts t_i (output subscripts `out`), dX_i[t_i] = sum over the
other letters of g[out] * prod_{j != i} X_j[t_j], i.e. Einsum("out,t_j,...->t_i"), with two
additions so that the result has exactly X_i's shape:

- a letter repeated in t_i (a diagonal, "ii->i") is renamed at its later occurrences and an
  identity matrix operand "ik" is added (the cotangent lives on the diagonal);
- a letter of t_i that occurs nowhere else (summed over in the forward, "ij->i") gets a
  ones vector operand of its size (the cotangent is broadcast along it).

Ellipsis ("...") is kept in the emitted equations; it is supported when the operand's
ellipsis dims are those of the output (no broadcasting of the ellipsis part into the
operand; symbolic dims are assumed equal), else the rule raises UnsupportedOpError. (ONNX
Runtime 1.31 refuses Einsum nodes whose operands' ellipsis dims differ at all, "Ellipsis
represents incompatible dimensions", so broadcasting ellipses do not occur in runnable models.) jvp: the sum over operands of the
Einsum with that operand replaced by its tangent.
"""
from __future__ import annotations

import string

import numpy as np

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import add_n, attr, dims_slice, filled, make_shape, need, unsupported

_LETTERS = string.ascii_lowercase + string.ascii_uppercase
ELL = "..."


def _split_term(term: str) -> list[str]:
    """'a...bc' -> ['a', '...', 'b', 'c']."""
    out, i = [], 0
    while i < len(term):
        if term.startswith(ELL, i):
            out.append(ELL)
            i += 3
        else:
            out.append(term[i])
            i += 1
    return out


def parse(eq: str, n_in: int) -> tuple[list[list[str]], list[str]]:
    """Input and output subscripts as lists of letters and '...'; implicit output as numpy
    (ellipsis first, then the letters occurring once, sorted)."""
    eq = eq.replace(" ", "")
    if "->" in eq:
        lhs, rhs = eq.split("->")
    else:
        lhs, rhs = eq, None
    ins = [_split_term(t) for t in lhs.split(",")]
    if len(ins) != n_in:
        raise ValueError(f"equation {eq!r} has {len(ins)} operands, node has {n_in} inputs")
    if rhs is None:
        letters = [x for t in ins for x in t if x != ELL]
        once = sorted({x for x in letters if letters.count(x) == 1})
        rhs_l = ([ELL] if any(ELL in t for t in ins) else []) + once
    else:
        rhs_l = _split_term(rhs)
    return ins, rhs_l


def _fmt(terms: list[list[str]], out: list[str]) -> str:
    return ",".join("".join(t) for t in terms) + "->" + "".join(out)


def _ell_rank(view, x: str, term: list[str]) -> int | None:
    s = view.shape(x)
    if s is None:
        return None
    return len(s) - len([c for c in term if c != ELL])


def _ell_dims(view, x: str, term: list[str]):
    s = view.shape(x)
    if s is None or ELL not in term:
        return ()
    k = term.index(ELL)
    r = _ell_rank(view, x, term)
    return tuple(s[k:k + r])


def _check_operand(view, node, ins, out, i) -> None:
    t = ins[i]
    if ELL not in t:
        return
    if ELL not in out:
        if _ell_rank(view, node.input[i], t) == 0:
            return
        raise unsupported(node, view, "is not differentiable here: an operand's ellipsis dims are summed "
                                      "over (no '...' in the output)")
    if view.shape(node.input[i]) is None or view.shape(node.output[0]) is None:
        raise unsupported(node, view, "with '...' needs static ranks (run shape inference)")
    mine = _ell_dims(view, node.input[i], t)
    full = _ell_dims(view, node.output[0], out)
    # symbolic dims are taken as equal (not broadcast); known ints must agree
    if len(mine) != len(full) or any(isinstance(a, int) and isinstance(c, int) and a != c or a == 1 != c
                                     for a, c in zip(mine, full)):
        raise unsupported(node, view, f"is not differentiable here: operand {i}'s ellipsis dims {list(mine)} "
                                      f"are broadcast to {list(full)} (unsupported)")


def _letter_dim(b, view, x: str, term: list[str], letter: str):
    """The size of `letter` in operand x (subscripts `term`) as a 1-element int64 tensor or int."""
    pos = term.index(letter)
    if ELL in term and pos > term.index(ELL):
        axis = pos - len(term)  # counted from the end
    else:
        axis = pos
    s = view.shape(x)
    if s is not None and isinstance(s[axis], int):
        return s[axis]
    return dims_slice(b, x, axis, None if axis == -1 else axis + 1)


def _operand_grad(b, view, node, ins, out, i, g) -> str:
    x = node.input[i]
    t = ins[i]
    others = [j for j in range(len(ins)) if j != i]
    terms = [out] + [ins[j] for j in others]
    names = [g] + [node.input[j] for j in others]
    used = {c for tt in ins + [out] for c in tt if c != ELL}
    free = (c for c in _LETTERS if c not in used)
    target: list[str] = []
    seen: set[str] = set()
    for c in t:
        if c == ELL or c not in seen:
            target.append(c)
            seen.add(c)
            continue
        k = next(free)  # a later occurrence of a repeated letter: eye "ck"
        n = _letter_dim(b, view, x, t, c)
        if isinstance(n, int):
            eye = b.const(np.eye(n, dtype=b.np_float), hint="eye")
        else:
            eye = b.op("EyeLike", [filled(b, make_shape(b, [n, n]), 0.0)])
        terms.append([c, k])
        names.append(eye)
        target.append(k)
    present = {c for tt in terms for c in tt}
    for c in dict.fromkeys(t):
        if c != ELL and c not in present:  # summed in the forward: broadcast back
            n = _letter_dim(b, view, x, t, c)
            ones = b.const(np.ones(n, dtype=b.np_float), hint="ones") if isinstance(n, int) \
                else filled(b, make_shape(b, [n]), 1.0, hint="ones")
            terms.append([c])
            names.append(ones)
    if ELL not in target and any(ELL in tt for tt in terms):
        # ORT wants '...' in the output when an input has one: spell the ellipsis out
        r_full = len(view.shape(node.output[0])) - len([c for c in out if c != ELL])
        ell = [next(free) for _ in range(r_full)]
        terms = [_spell(tt, ell, r_full if tt is out else _ell_rank(view, n, tt)) for tt, n in zip(terms, names)]
    return b.op("Einsum", names, equation=_fmt(terms, target))


def _spell(term: list[str], ell: list[str], r: int | None) -> list[str]:
    """`term` with '...' replaced by the last r letters of `ell` (right-aligned broadcast)."""
    if ELL not in term:
        return term
    k = term.index(ELL)
    return term[:k] + (ell[len(ell) - r:] if r else []) + term[k + 1:]


@register("Einsum", since=12)
def _einsum_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    if g is None:
        return [None] * len(node.input)
    ins, out = parse(attr(node, "equation"), len(node.input))
    res = []
    for i in range(len(node.input)):
        if not need(needs, i):
            res.append(None)
            continue
        res.append(_operand_grad(b, view, node, ins, out, i, g))
    return res


@_einsum_vjp.defjvp
def _einsum_jvp(b, view, node, ts):
    terms = []
    for i, t in enumerate(ts):
        if t is None:
            continue
        inputs = list(node.input)
        inputs[i] = t
        terms.append(b.op("Einsum", inputs, equation=attr(node, "equation")))
    return [add_n(b, terms)]


@_einsum_vjp.defcheck
def _einsum_check(view, node):
    try:
        ins, out = parse(attr(node, "equation", ""), len(node.input))
    except ValueError as e:
        raise unsupported(node, view, f"has a malformed equation: {e}") from None
    for i in range(len(node.input)):
        _check_operand(view, node, ins, out, i)
