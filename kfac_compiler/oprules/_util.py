"""Small helpers shared by the differentiation rules (shapes, broadcasting, zeros, attrs)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.errors import UnsupportedOpError
from kfac_compiler.graph import FLOAT_TYPES

INT64_MAX = np.iinfo(np.int64).max

_NP = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
}


# ------------------------------------------------------------------ node access
def attr(node: onnx.NodeProto, name: str, default=None):
    """Attribute value (strings decoded) or `default`."""
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            if isinstance(v, bytes):
                v = v.decode()
            return v
    return default


def inp(node: onnx.NodeProto, i: int) -> str | None:
    """Name of input `i`, or None when absent/empty."""
    return node.input[i] if i < len(node.input) and node.input[i] else None


def out(node: onnx.NodeProto, i: int) -> str | None:
    return node.output[i] if i < len(node.output) and node.output[i] else None


def need(needs: Sequence[bool] | None, i: int) -> bool:
    return needs is None or (i < len(needs) and bool(needs[i]))


def cval(view, name: str | None) -> np.ndarray | None:
    """Constant value of a tensor (initializer or Constant output), else None."""
    return None if not name else view.constant_value(name)


def unsupported(node: onnx.NodeProto, view, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"node {node.name!r}: op {node.op_type} (opset {view.opset}) {why}")


# ------------------------------------------------------------------- shapes
def shape(view, name: str):
    return view.shape(name)


def rank(view, name: str) -> int | None:
    return view.rank(name)


def static_shape(view, name: str) -> tuple[int, ...] | None:
    s = view.shape(name)
    if s is None or not all(isinstance(d, int) for d in s):
        return None
    return tuple(s)


def same_shape(view, a: str, c: str) -> bool:
    """True when both shapes are known to be equal (identical int or symbolic dims)."""
    sa, sc = view.shape(a), view.shape(c)
    return (
        sa is not None
        and sc is not None
        and len(sa) == len(sc)
        and all(x is not None and x == y for x, y in zip(sa, sc))
    )


def dims_slice(b, x: str, start: int, end: int | None = None) -> str:
    """Shape(x)[start:end] as a 1-D int64 tensor, in the form the opset allows."""
    if b.opset >= 15:
        return b.op("Shape", [x], start=start, end=end)
    s = b.op("Shape", [x])
    return b.op("Slice", [s, b.ints([start]), b.ints([INT64_MAX if end is None else end])])


def shape_tensor(b, view, name: str) -> str:
    """The shape of forward tensor `name` as an int64 tensor (a constant when static)."""
    s = static_shape(view, name)
    return b.ints(s) if s is not None else b.op("Shape", [name])


def reshape_target(b, view, name: str) -> str:
    """Reshape's shape input giving forward tensor `name`'s shape: a constant when static or
    when only one dim is symbolic (-1 there, every other dim known and non-zero: an unrolled
    RNN's per-step Squeeze/Unsqueeze gradients with a symbolic batch need no Shape node),
    else Shape(name)."""
    s = view.shape(name)
    if s is not None:
        unknown = [i for i, d in enumerate(s) if not isinstance(d, int)]
        if len(unknown) == 1 and all(d != 0 for d in s if isinstance(d, int)):
            return b.ints([-1 if i == unknown[0] else int(d) for i, d in enumerate(s)])
    return shape_tensor(b, view, name)


def make_shape(b, parts: Sequence[int | str]) -> str:
    """A 1-D int64 shape tensor from ints and 1-D int64 tensors (names)."""
    if all(isinstance(p, (int, np.integer)) for p in parts):
        return b.ints([int(p) for p in parts])
    pieces: list[str] = []
    run: list[int] = []
    for p in parts:
        if isinstance(p, (int, np.integer)):
            run.append(int(p))
        else:
            if run:
                pieces.append(b.ints(run))
                run = []
            pieces.append(p)
    if run:
        pieces.append(b.ints(run))
    return pieces[0] if len(pieces) == 1 else b.op("Concat", pieces, axis=0)


def axis_len(b, view, x: str, axis: int) -> str:
    """x's size along `axis` (>= 0) as a 1-element int64 tensor (a constant when static)."""
    s = view.shape(x)
    if s is not None and isinstance(s[axis], int):
        return b.ints([s[axis]])
    return dims_slice(b, x, axis, axis + 1)


def dim_parts(b, view, x: str, start: int = 0, end: int | None = None) -> list[int | str]:
    """Dims start:end of `x` as ints where static, else 1-element shape tensors."""
    s = view.shape(x)
    if s is None:
        return [dims_slice(b, x, start, end)]
    r = len(s)
    end = r if end is None else (end + r if end < 0 else end)
    start = start + r if start < 0 else start
    parts: list[int | str] = []
    i = start
    while i < end:
        if isinstance(s[i], int):
            parts.append(s[i])
            i += 1
        else:
            j = i
            while j < end and not isinstance(s[j], int):
                j += 1
            parts.append(dims_slice(b, x, i, j))
            i = j
    return parts


def norm_axes(axes: Sequence[int], r: int) -> list[int]:
    return sorted(int(a) + r if a < 0 else int(a) for a in axes)


# -------------------------------------------------------------------- values
def ftype(b, view, name: str) -> int:
    t = view.dtypes.get(name)
    return t if t in FLOAT_TYPES else b.float_type


def np_ftype(b) -> type:
    return np.float64 if b.float_type == TensorProto.DOUBLE else np.float32


def c(b, value) -> str:
    """A float constant in the builder's float type."""
    return b.const(np.asarray(value, dtype=b.np_float))


def filled(b, shape_name: str, value: float, hint: str = "filled") -> str:
    """`value` in the builder's float type, with the shape in the int64 tensor `shape_name`."""
    val = numpy_helper.from_array(np.full(1, value, dtype=b.np_float))
    return b.op("ConstantOfShape", [shape_name], value=val, hint=hint)


def zeros(b, shape_name: str) -> str:
    """Zeros of the builder's float type with the shape in the int64 tensor `shape_name`."""
    return filled(b, shape_name, 0.0, hint="zeros")


def zeros_like(b, view, name: str) -> str:
    return zeros(b, shape_tensor(b, view, name))


def add_n(b, names: Sequence[str | None]) -> str | None:
    names = [n for n in names if n]
    if not names:
        return None
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        return b.add(names[0], names[1])
    return b.op("Sum", list(names))


def where0(b, cond: str, v: str) -> str:
    """v where cond else 0."""
    return b.op("Where", [cond, v, c(b, 0.0)])


def recip0(b, y: str) -> str:
    """1 / y, and 0 where y == 0: the derivative of a norm (ReduceL2, LpPool, LpNormalization)
    at an all-zero group, window or vector, which torch takes as 0 (x / y there is 0 / 0)."""
    return b.op("Where", [b.op("Equal", [y, c(b, 0.0)]), c(b, 0.0), b.div(c(b, 1.0), y)])


def gt0(b, x: str) -> str:
    """The boolean x > 0."""
    return b.op("Greater", [x, c(b, 0.0)])


def numel(b, view, x: str) -> str:
    """Number of elements of x as a float scalar (constant when static)."""
    s = static_shape(view, x)
    if s is not None:
        return c(b, float(np.prod(s)))
    return b.cast(b.op("Size", [x]), b.float_type)


# ------------------------------------------------------------- broadcasting
def unbroadcast(b, view, g: str, target: str, ref: str | None = None, rshape=None) -> str:
    """Sum `g` (shaped like `ref`, the broadcast result, or like `rshape` when given) down
    to the shape of `target`.

    Static shapes are used when they decide the reduction axes; otherwise the axes are
    computed at run time from Shape(g) and Shape(target)."""
    ts = view.shape(target)
    rs = rshape if rshape is not None else (view.shape(ref) if ref else None)
    if ts is not None and rs is not None and len(rs) >= len(ts):
        lead = len(rs) - len(ts)
        axes = list(range(lead))
        ok = True
        for i, d in enumerate(ts):
            r = rs[lead + i]
            if d == 1:
                if r != 1:
                    axes.append(lead + i)
            elif isinstance(d, int) or (isinstance(d, str) and d == r):
                continue
            else:
                ok = False
                break
        if ok:
            if not axes:
                return g
            if axes == [0] and len(rs) == 2 and view.dtypes.get(target) == b.float_type:
                red = sum_rows(b, g, rs[0])
            else:
                red = b.reduce_sum(g, axes, keepdims=True)
            if lead:
                red = b.squeeze(red, list(range(lead)))
            return red
    return _unbroadcast_dynamic(b, view, g, target, None if rs is None else len(rs))


def sum_rows(b, g: str, rows) -> str:
    """[1, n] = the sum of the rows of 2-d g, as ones[1, rows] @ g: ONNX Runtime's ReduceSum
    over axis 0 strides down the columns, several times slower than the GEMV (the bias
    gradients of a dense layer). `rows`: g's static row count, or a symbolic dim. A Gemm, so
    that autodiff fuses a multi-use bias's column sums with the weight's (`_fuse_gemms`)."""
    if isinstance(rows, int):
        ones = c(b, np.ones((1, rows)))
    else:
        ones = filled(b, b.op("Concat", [b.ints([1]), b.shape(g, 0, 1)], axis=0), 1.0, hint="ones")
    return b.op("Gemm", [ones, g])


def _unbroadcast_dynamic(b, view, g: str, target: str, rg: int | None) -> str:
    gs = b.op("Shape", [g])
    ts = b.op("Shape", [target])
    one = b.ints([1])
    rt = view.rank(target)
    if rt is not None and rg is not None:
        pad = b.ints([1] * (rg - rt)) if rg > rt else None
    else:
        lead = b.sub(b.op("Size", [gs]), b.op("Size", [ts]))
        lead = b.reshape(lead, [1])
        pad = b.op(
            "ConstantOfShape", [lead], value=numpy_helper.from_array(np.ones(1, dtype=np.int64))
        )
    pts = b.op("Concat", [pad, ts], axis=0) if pad is not None else ts
    mask = b.op("And", [b.op("Equal", [pts, one]), b.op("Not", [b.op("Equal", [gs, one])])])
    axes = b.reshape(b.op("NonZero", [mask]), [-1])
    red = b.op("ReduceSum", [g, axes], keepdims=1, noop_with_empty_axes=1)
    return b.reshape(red, ts)


def expand_to(b, view, t: str, src: str, dst: str) -> str:
    """Broadcast tangent `t` (shaped like `src`) to the shape of forward tensor `dst`."""
    if same_shape(view, src, dst):
        return t
    return b.op("Expand", [t, shape_tensor(b, view, dst)])


def expand_like(b, view, t: str, y: str) -> str:
    """Expand a tangent of unknown (possibly smaller) shape to the shape of y."""
    return b.op("Expand", [t, shape_tensor(b, view, y)])


# --------------------------------------------------------------- re-emission
def reapply(b, node: onnx.NodeProto, replace: dict[int, str | None], n_out: int = 1,
            drop: Sequence[str] = ()) -> list[str]:
    """Emit a copy of `node` (same op and attributes, minus `drop`) with inputs replaced;
    return its first `n_out` outputs (fresh names)."""
    inputs = list(node.input)
    for i, v in replace.items():
        while len(inputs) <= i:
            inputs.append("")
        inputs[i] = v or ""
    while inputs and not inputs[-1]:
        inputs.pop()
    outputs = [b.fresh(node.op_type) for _ in range(n_out)]
    new = helper.make_node(node.op_type, inputs, outputs, name=b.fresh(node.op_type + "/node"),
                           domain=node.domain)
    new.attribute.extend(a for a in node.attribute if a.name not in drop)
    b.nodes.append(new)
    return outputs


def linear_jvp(slot: int = 0, n_out: int = 1):
    """jvp of an op that is linear in input `slot` (other inputs are constants): the op
    applied to the tangent."""

    def jvp(b, view, node, ts):
        t = ts[slot] if slot < len(ts) else None
        if t is None:
            return [None] * len(node.output)
        return reapply(b, node, {slot: t}, n_out=n_out)

    return jvp
