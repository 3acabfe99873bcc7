"""Data-movement ops: reshapes, Transpose, Concat/Split, Slice, Expand, Gather family, Pad,
Tile, TopK, CumSum, CumProd, Trilu, DepthToSpace/SpaceToDepth.

CumProd (opset 26) is differentiated without dividing by x: with E_k the exclusive product
before k (in the scan's direction) and A[k, i] = [k in S(i)] times the product of the x_j
in S(i) beyond k (S(i): the positions y_i multiplies), dy_i/dx_k = E_k A[k, i]. A comes
from the node itself applied along a new axis to x with the positions up to k read as 1,
so the derivative graphs hold an [..., n, n, ...] tensor (n: the scanned length)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from kfac_compiler.oprules import register
from kfac_compiler.oprules._util import (
    INT64_MAX,
    add_n,
    attr,
    axis_len,
    c,
    cval,
    dim_parts,
    dims_slice,
    filled,
    inp,
    linear_jvp,
    make_shape,
    need,
    reapply,
    reshape_target,
    shape_tensor,
    unbroadcast,
    unsupported,
    zeros,
    zeros_like,
)


# ------------------------------------------------------------------- reshape-like ops
@register(("Reshape", "Flatten", "Squeeze", "Unsqueeze"), inputs=(0,))
def _reshape_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else b.reshape(g, reshape_target(b, view, node.input[0]))]


_reshape_vjp.defjvp(linear_jvp(0))


@register("Transpose", inputs=(0,))
def _transpose_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    perm = attr(node, "perm")
    if perm is None:  # reversal is its own inverse
        return [b.op("Transpose", [g])]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return [b.transpose(g, inv)]


_transpose_vjp.defjvp(linear_jvp(0))


# ---------------------------------------------------------------------- Concat / Split
def _axis_dim(b, view, x: str, axis: int):
    s = view.shape(x)
    if s is not None and -len(s) <= axis < len(s) and isinstance(s[axis], int):
        return s[axis]
    return dims_slice(b, x, axis, None if axis == -1 else axis + 1)


def _static_or_symbol(view, x: str, axis: int) -> int | str | None:
    """x's dim along `axis`: an int, shape inference's symbol, or None when unknown."""
    s = view.shape(x)
    return s[axis] if s is not None and -len(s) <= axis < len(s) else None


@register("Concat")
def _concat_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    n = len(node.input)
    if g is None or not any(need(needs, i) for i in range(n)):
        return [None] * n
    axis = int(attr(node, "axis"))
    r = view.rank(node.output[0])
    if axis < 0 and r is not None:
        axis += r
    dims = [_static_or_symbol(view, x, axis) for x in node.input]
    if n > 1 and isinstance(dims[0], str) and all(d == dims[0] for d in dims):
        # one symbolic size shared by every input (an unrolled recurrence's steps): equal
        # parts, no Shape per input
        parts = b.op("Split", [g], n_out=n, axis=axis, **({"num_outputs": n} if b.opset >= 18 else {}))
    else:
        sizes = make_shape(b, [_axis_dim(b, view, x, axis) for x in node.input])
        parts = b.op("Split", [g, sizes], n_out=n, axis=axis)
    parts = parts if isinstance(parts, list) else [parts]
    return [p if need(needs, i) else None for i, p in enumerate(parts)]


@_concat_vjp.defjvp
def _concat_jvp(b, view, node, ts):
    if all(t is None for t in ts):
        return [None]
    parts = [t if t is not None else zeros_like(b, view, x) for t, x in zip(ts, node.input)]
    return [b.op("Concat", parts, axis=attr(node, "axis"))]


@register("Split", inputs=(0,))
def _split_vjp(b, view, node, gys):
    if all(g is None for g in gys):
        return [None]
    parts = [g if g is not None else zeros_like(b, view, y) for g, y in zip(gys, node.output)]
    return [b.op("Concat", parts, axis=attr(node, "axis", 0))]


@_split_vjp.defjvp
def _split_jvp(b, view, node, ts):
    if ts[0] is None:
        return [None] * len(node.output)
    return reapply(b, node, {0: ts[0]}, n_out=len(node.output))


# ------------------------------------------------------------------------------- Slice
def _slice_static(view, node):
    """Per sliced axis (axis, dim, selected indices), or None when not static."""
    X = node.input[0]
    xs = view.shape(X)
    starts, ends = cval(view, inp(node, 1)), cval(view, inp(node, 2))
    if xs is None or starts is None or ends is None:
        return None
    r = len(xs)
    axes = cval(view, inp(node, 3)) if inp(node, 3) else np.arange(len(starts))
    steps = cval(view, inp(node, 4)) if inp(node, 4) else np.ones(len(starts), np.int64)
    if axes is None or steps is None:
        return None
    out = []
    for a, s, e, st in zip(axes.tolist(), starts.tolist(), ends.tolist(), steps.tolist()):
        a = a + r if a < 0 else a
        d = xs[a]
        if not isinstance(d, int):
            return None
        out.append((a, d, list(range(*slice(int(s), int(e), int(st)).indices(d)))))
    return out


@register("Slice", since=10, inputs=(0,))
def _slice_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X = node.input[0]
    spec = _slice_static(view, node)
    if spec is not None:
        r = view.rank(X)
        if any(len(idx) == 0 for _, _, idx in spec):
            return [zeros_like(b, view, X)]
        cur_shape = list(view.shape(X))
        for a, _d, idx in spec:
            cur_shape[a] = len(idx)
        pads = [0] * (2 * r)
        cur = g
        for a, d, idx in spec:
            if idx == list(range(idx[0], idx[0] + len(idx))):  # contiguous: pad
                pads[a] += idx[0]
                pads[r + a] += d - idx[-1] - 1
                continue
            # strided / reversed: scatter along the axis (indices are unique)
            parts = [p if isinstance(p, int) else dims_slice(b, cur, i, i + 1)
                     for i, p in enumerate(cur_shape)]
            ind_shape = parts.copy()
            parts[a] = d
            ishape = [1] * r
            ishape[a] = len(idx)
            ind = b.const(np.asarray(idx, np.int64).reshape(ishape), hint="slice_idx")
            ind = b.op("Expand", [ind, make_shape(b, ind_shape)])
            cur = b.op("ScatterElements", [zeros(b, make_shape(b, parts)), ind, cur], axis=a)
            cur_shape[a] = d
        if any(pads):
            cur = b.op("Pad", [cur, b.ints(pads)])
        return [cur]
    # dynamic: slice an index map of X and scatter the cotangent through it
    size = b.op("Size", [X])
    ids = b.op("Range", [b.const(np.asarray(0, np.int64)), size, b.const(np.asarray(1, np.int64))])
    ids = b.reshape(ids, b.op("Shape", [X]))
    (sel,) = reapply(b, node, {0: ids})
    flat = b.op(
        "ScatterElements",
        [zeros(b, b.reshape(size, [1])), b.reshape(sel, [-1]), b.reshape(g, [-1])],
        axis=0,
    )
    return [b.reshape(flat, b.op("Shape", [X]))]


_slice_vjp.defjvp(linear_jvp(0))


# ------------------------------------------------------------------------------ Expand
@register("Expand", inputs=(0,))
def _expand_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else unbroadcast(b, view, g, node.input[0], node.output[0])]


_expand_vjp.defjvp(linear_jvp(0))


# ------------------------------------------------------------------------ Gather family
def _int64(b, view, name: str) -> str:
    return name if view.dtypes.get(name) == TensorProto.INT64 else b.cast(name, TensorProto.INT64)


def _scatter_add_rows(b, base: str, idx: str, updates: str) -> str:
    """`base` with updates[k] added to row idx[k] (idx of any shape, entries in range;
    updates of shape idx.shape + base.shape[1:]). ScatterElements, not ScatterND: ONNX
    Runtime's CPU ScatterND(reduction="add") splits the updates over its threads without
    atomics and loses some where indices repeat, as an embedding's tokens do (errors of 43 on
    sums of ~30 at 2 threads; tests/test_scatter_add.py), where ScatterElements' add is exact."""
    k = b.reshape(b.op("Size", [idx]), [1])
    rows = b.reshape(idx, b.op("Concat", [k, b.ints([1])], axis=0))
    flat = b.reshape(updates, b.op("Concat", [k, b.ints([-1])], axis=0))
    at = b.op("Expand", [rows, b.op("Shape", [flat])])
    out = b.op("ScatterElements", [b.reshape(base, [0, -1]), at, flat], axis=0, reduction="add")
    return b.reshape(out, b.op("Shape", [base]))


def _norm_indices(b, view, idx: str, dim) -> str:
    """Indices with negative entries wrapped (constant-folded when possible)."""
    iv = cval(view, idx)
    if iv is not None and isinstance(dim, int):
        iv = np.asarray(iv, np.int64)
        if (iv >= 0).all():
            return _int64(b, view, idx)
        return b.const(np.where(iv < 0, iv + dim, iv).astype(np.int64), hint="indices")
    i64 = _int64(b, view, idx)
    d = b.const(np.asarray(dim, np.int64)) if isinstance(dim, int) else b.reshape(dim, [])
    zero = b.const(np.asarray(0, np.int64))
    return b.op("Where", [b.op("Less", [i64, zero]), b.add(i64, d), i64])


@register("Gather", inputs=(0,))
def _gather_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X, I = node.input
    r, q = view.rank(X), view.rank(I)
    axis = int(attr(node, "axis", 0))
    if r is None or q is None:
        raise unsupported(node, view, "needs the ranks of data and indices (run shape inference)")
    axis = axis + r if axis < 0 else axis
    (dim,) = dim_parts(b, view, X, axis, axis + 1)
    idx = _norm_indices(b, view, I, dim)
    if axis == 0:
        gT = g
    else:
        gT = b.transpose(g, list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, r - 1 + q)))
    tshape = dim_parts(b, view, X, axis, axis + 1) + dim_parts(b, view, X, 0, axis) + dim_parts(b, view, X, axis + 1)
    if b.opset >= 16:
        zT = zeros_like(b, view, X) if axis == 0 else zeros(b, make_shape(b, tshape))
        sT = _scatter_add_rows(b, zT, idx, gT)
    else:
        # one-hot product: dX^T[d, :] = sum_k onehot[k, d] g[k, :]
        k = b.reshape(b.op("Size", [idx]), [1])
        depth = b.const(np.asarray(dim, np.int64)) if isinstance(dim, int) else b.reshape(dim, [])
        values = b.const(np.asarray([0.0, 1.0], dtype=b.np_float))
        oh = b.op("OneHot", [b.reshape(idx, [-1]), depth, values], axis=-1)
        g2 = b.reshape(gT, b.op("Concat", [k, b.ints([-1])], axis=0))
        sT = b.reshape(b.op("Gemm", [oh, g2], transA=1), make_shape(b, tshape))
    if axis == 0:
        return [sT]
    perm = [axis] + list(range(axis)) + list(range(axis + 1, r))
    inv = [0] * r
    for i, p in enumerate(perm):
        inv[p] = i
    return [b.transpose(sT, inv)]


_gather_vjp.defjvp(linear_jvp(0))


@register("GatherElements", inputs=(0,))
def _gather_elements_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X, I = node.input
    axis = int(attr(node, "axis", 0))
    r = view.rank(X)
    if axis < 0 and r is not None:
        axis += r
    (dim,) = dim_parts(b, view, X, axis, None if axis == -1 else axis + 1)
    idx = _norm_indices(b, view, I, dim)
    return [b.op("ScatterElements", [zeros_like(b, view, X), idx, g], axis=axis, reduction="add")]


@_gather_elements_vjp.defcheck
def _gather_elements_check(view, node):
    if view.opset < 16:
        raise unsupported(node, view, "gradient needs ScatterElements(reduction='add'): opset >= 16")


_gather_elements_vjp.defjvp(linear_jvp(0))


@register("GatherND", inputs=(0,))
def _gather_nd_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X, I = node.input
    shape, k = view.shape(X), (view.shape(I) or [None])[-1]
    lead = None if shape is None or not isinstance(k, int) else shape[:k]
    if lead is None or not all(isinstance(d, int) for d in lead):  # no static row strides: ScatterND (see above)
        return [b.op("ScatterND", [zeros_like(b, view, X), _int64(b, view, I), g], reduction="add")]
    # the rows of X's first k dims, linearized: a Gather's row scatter (_scatter_add_rows)
    dims = np.asarray(lead, np.int64)
    i64 = _int64(b, view, I)
    i64 = b.op("Where", [b.op("Less", [i64, b.ints([0] * k)]), b.add(i64, b.const(dims)), i64])
    strides = np.asarray([int(np.prod(dims[j + 1:])) for j in range(k)], np.int64)
    rows = b.reduce("ReduceSum", b.mul(i64, b.const(strides)), [-1])
    base = b.reshape(zeros_like(b, view, X), [int(np.prod(dims)), *([-1] if k < len(shape) else [])])
    return [b.reshape(_scatter_add_rows(b, base, rows, g), shape_tensor(b, view, X))]


@_gather_nd_vjp.defcheck
def _gather_nd_check(view, node):
    if view.opset < 16:
        raise unsupported(node, view, "gradient needs ScatterND(reduction='add'): opset >= 16")
    if int(attr(node, "batch_dims", 0)) != 0:
        raise unsupported(node, view, "gradient supports batch_dims=0 only")


_gather_nd_vjp.defjvp(linear_jvp(0))


# -------------------------------------------------------------------------------- Pad
@register("Pad", since=11, inputs=(0, 2))
def _pad_vjp(b, view, node, gys, needs=None):
    g = gys[0]
    res: list[str | None] = [None] * len(node.input)
    if g is None:
        return res
    pads = node.input[1]
    axes = inp(node, 3)  # opset 18
    pv = cval(view, pads)
    av = cval(view, axes) if axes else None
    if pv is None or (axes and av is None):
        # negative pads crop (ORT supports them; onnx.reference does not)
        dx = b.op("Pad", [g, b.neg(pads)] + (["", axes] if axes else []))
    else:
        pv = np.asarray(pv, np.int64).reshape(-1)
        n = len(pv) // 2
        ax = av.reshape(-1).tolist() if axes else list(range(n))
        crop, grow = np.maximum(pv, 0), np.maximum(-pv, 0)
        dx = g
        if grow.any():  # the forward cropped (negative pads): zero-fill those rows back
            dx = b.op("Pad", [dx, b.ints(grow.tolist())] + (["", axes] if axes else []))
        if crop.any():
            ends = [-int(e) if e > 0 else INT64_MAX for e in crop[n:]]
            dx = b.op("Slice", [dx, b.ints(crop[:n].tolist()), b.ints(ends), b.ints(ax)])
    res[0] = dx
    if inp(node, 2) and need(needs, 2):  # the pad value: everything not copied from x
        res[2] = b.sub(b.reduce_sum(g, None, keepdims=False), b.reduce_sum(dx, None, keepdims=False))
    return res


@_pad_vjp.defcheck
def _pad_check(view, node):
    if attr(node, "mode", "constant") != "constant":
        raise unsupported(node, view, f"gradient supports mode='constant' only (got {attr(node, 'mode')!r})")


@_pad_vjp.defjvp
def _pad_jvp(b, view, node, ts):
    t = ts[0]
    tv = ts[2] if len(ts) > 2 else None
    terms = []
    if t is not None:
        terms.append(reapply(b, node, {0: t, 2: None})[0])  # pad value 0 for the tangent
    if tv is not None:
        terms.append(reapply(b, node, {0: zeros_like(b, view, node.input[0]), 2: tv})[0])
    return [add_n(b, terms)]


# ------------------------------------------------------------------------------- Tile
@register("Tile", inputs=(0,))
def _tile_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X = node.input[0]
    reps = [int(v) for v in cval(view, node.input[1]).reshape(-1)]
    parts: list = []
    for i, rep in enumerate(reps):
        parts += [rep] + dim_parts(b, view, X, i, i + 1)
    g2 = b.reshape(g, make_shape(b, parts))
    return [b.reduce_sum(g2, list(range(0, 2 * len(reps), 2)), keepdims=False)]


@_tile_vjp.defcheck
def _tile_check(view, node):
    if cval(view, node.input[1]) is None or view.rank(node.input[0]) is None:
        raise unsupported(node, view, "gradient needs constant repeats and a known input rank")


_tile_vjp.defjvp(linear_jvp(0))


# ------------------------------------------------------------------------------- TopK
@register("TopK", inputs=(0,))
def _topk_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    X = node.input[0]
    return [b.op("ScatterElements", [zeros_like(b, view, X), node.output[1], g], axis=attr(node, "axis", -1))]


@_topk_vjp.defjvp
def _topk_jvp(b, view, node, ts):
    if ts[0] is None:
        return [None, None]
    return [b.op("GatherElements", [ts[0], node.output[1]], axis=attr(node, "axis", -1)), None]


# ------------------------------------------------------------- CumSum, CumProd, Trilu
@register("CumSum", inputs=(0,))
def _cumsum_vjp(b, view, node, gys):
    g = gys[0]
    if g is None:
        return [None]
    rev = 1 - int(attr(node, "reverse", 0))
    return [b.op("CumSum", [g, node.input[1]], exclusive=attr(node, "exclusive"), reverse=rev or None)]


_cumsum_vjp.defjvp(linear_jvp(0))


def _cumprod_pair(b, view, node) -> tuple[str, str, int]:
    """(E, A, axis): E = the exclusive products before each x_k ([..., n, ...]), A[k, i] =
    dy_i/dx_k / E_k on [..., n_k, n_i, ...] (k at `axis`, i at axis + 1)."""
    _cumprod_check(view, node)
    x = node.input[0]
    r = view.rank(x)
    a = int(np.asarray(cval(view, inp(node, 1))).reshape(-1)[0]) % r
    rev, excl = int(attr(node, "reverse", 0)), int(attr(node, "exclusive", 0))
    e = b.op("CumProd", [x, node.input[1]], exclusive=1, reverse=rev or None)
    n = axis_len(b, view, x, a)
    ones = filled(b, b.op("Concat", [n, n], axis=0), 1.0, hint="ones")

    def tri(k: int) -> str:  # [n_k, n_i, 1, ...]: i - k >= k' (upper) or i - k <= k' (lower)
        m = b.op("Trilu", [ones, b.ints([k])], upper=0 if rev else 1)
        return b.reshape(m, [0, 0] + [1] * (r - a - 1))

    beyond = b.op("Cast", [tri(-1 if rev else 1)], to=TensorProto.BOOL)  # j beyond k: j > k (j < k reversed)
    xk = b.unsqueeze(x, [a])
    masked = b.op("Where", [beyond, xk, c(b, 1.0)])
    t = b.op("CumProd", [masked, b.const(np.asarray(a + 1, dtype=np.int64))], exclusive=excl or None,
             reverse=rev or None)
    inc = tri((-1 if rev else 1) if excl else 0)  # k in S(i): i >= k (i > k exclusive), mirrored reversed
    return e, b.mul(inc, t), a


@register("CumProd", since=26, inputs=(0,))
def _cumprod_vjp(b, view, node, gys):
    """dx_k = E_k sum_i A[k, i] g_i."""
    g = gys[0]
    if g is None:
        return [None]
    e, m, a = _cumprod_pair(b, view, node)
    return [b.mul(e, b.reduce_sum(b.mul(m, b.unsqueeze(g, [a])), [a + 1]))]


@_cumprod_vjp.defjvp
def _cumprod_jvp(b, view, node, ts):
    """dy_i = sum_k A[k, i] E_k t_k."""
    t = ts[0]
    if t is None:
        return [None]
    e, m, a = _cumprod_pair(b, view, node)
    return [b.reduce_sum(b.mul(m, b.unsqueeze(b.mul(e, t), [a + 1])), [a])]


@_cumprod_vjp.defcheck
def _cumprod_check(view, node):
    """The forms _cumprod_pair can emit: a known rank and a constant axis (else one line)."""
    if view.rank(node.input[0]) is None or cval(view, inp(node, 1)) is None:
        raise unsupported(node, view, "needs the input rank and a constant axis")


@register("Trilu", inputs=(0,))
def _trilu_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else reapply(b, node, {0: g})[0]]  # a mask: self-adjoint


_trilu_vjp.defjvp(linear_jvp(0))


@register("SpaceToDepth", inputs=(0,))
def _s2d_vjp(b, view, node, gys):
    g = gys[0]
    bs = attr(node, "blocksize")
    return [None if g is None else b.op("DepthToSpace", [g], blocksize=bs, mode="DCR")]


_s2d_vjp.defjvp(linear_jvp(0))


@register("DepthToSpace", inputs=(0,))
def _d2s_vjp(b, view, node, gys):
    g = gys[0]
    return [None if g is None else b.op("SpaceToDepth", [g], blocksize=attr(node, "blocksize"))]


@_d2s_vjp.defcheck
def _d2s_check(view, node):
    if attr(node, "mode", "DCR") != "DCR":
        raise unsupported(node, view, "gradient supports mode='DCR' only")


_d2s_vjp.defjvp(linear_jvp(0))


# ------------------------------------------------------------------------ Scatter family
# ScatterND / ScatterElements with reduction "none" (replace) or "add" are linear in data and
# updates: the data's cotangent is g (add) or g with the written positions zeroed (none:
# those values were replaced), the updates' is g gathered at the indices. "mul", "max" and
# "min" have no rule. (torch.export writes ScatterND for Swin's shifted-window masks.)
def _scatter_reduction(node) -> str:
    red = attr(node, "reduction", "none")
    return red.decode() if isinstance(red, bytes) else str(red)


def _scatter_vjp(gather: str, b, view, node, gys, needs=None):
    g = gys[0]
    if g is None:
        return [None, None, None]
    X, I, U = node.input[:3]
    extra = {"axis": int(attr(node, "axis", 0))} if gather == "GatherElements" else {}
    i64 = _int64(b, view, I)
    gx = None
    if need(needs, 0):
        gx = g if _scatter_reduction(node) == "add" else reapply(b, node, {0: g, 1: i64, 2: zeros_like(b, view, U)})[0]
    gu = b.op(gather, [g, i64], **extra) if need(needs, 2) else None
    return [gx, None, gu]


def _scatter_jvp(b, view, node, ts):
    tx, tu = ts[0], ts[2] if len(ts) > 2 else None
    if tx is None and tu is None:
        return [None]
    return reapply(b, node, {0: tx or zeros_like(b, view, node.input[0]),
                             2: tu or zeros_like(b, view, node.input[2])})


def _scatter_check(view, node):
    if _scatter_reduction(node) not in ("none", "add"):
        raise unsupported(node, view, f"gradient supports reduction 'none' and 'add', not "
                                      f"{_scatter_reduction(node)!r}")


@register("ScatterND", inputs=(0, 2))
def _scatter_nd_vjp(b, view, node, gys, needs=None):
    return _scatter_vjp("GatherND", b, view, node, gys, needs)


@register("ScatterElements", inputs=(0, 2))
def _scatter_elements_vjp(b, view, node, gys, needs=None):
    return _scatter_vjp("GatherElements", b, view, node, gys, needs)


for _rule in (_scatter_nd_vjp, _scatter_elements_vjp):
    _rule.defjvp(_scatter_jvp)
    _rule.defcheck(_scatter_check)


# ---------------------------------------------------------------------- ReverseSequence
@register("ReverseSequence", inputs=(0,))
def _revseq_vjp(b, view, node, gys):
    """A permutation that is its own inverse (same sequence_lens): the adjoint reverses g."""
    g = gys[0]
    return [None if g is None else reapply(b, node, {0: g})[0]]


_revseq_vjp.defjvp(linear_jvp(0))
