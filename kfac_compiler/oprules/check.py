"""Verification helpers for differentiation rules: float type conversion, derivative models,
and central finite-difference checks of vjp and jvp (used by the tests; handy when adding
a rule).

    model64 = convert_float_type(model, TensorProto.DOUBLE)
    report = fd_check(model64, feeds, wrt=["x", "W"])      # ReferenceEvaluator, float64
    assert report.ok, report
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.builder import GraphBuilder, value_info
from kfac_compiler.graph import FLOAT_TYPES, GraphView, with_float_type


# ------------------------------------------------------------------ type conversion
def convert_float_type(model: onnx.ModelProto, to: int = TensorProto.DOUBLE) -> onnx.ModelProto:
    """A copy of `model` with every float32/float64 tensor (initializers, inputs, outputs,
    value_info, Constant/ConstantOfShape values, Cast targets) turned into `to`."""
    return with_float_type(model, to, {TensorProto.FLOAT, TensorProto.DOUBLE})


def lift_initializers(model: onnx.ModelProto, names: Sequence[str]) -> tuple[onnx.ModelProto, dict]:
    """Turn the initializers `names` into graph inputs; returns (model, their values)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    keep, vals = [], {}
    for t in g.initializer:
        if t.name in names:
            vals[t.name] = numpy_helper.to_array(t)
            g.input.append(value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del g.initializer[:]
    g.initializer.extend(keep)
    return m, vals


# ------------------------------------------------------------------------ running
def _reference_fixes() -> list:
    """Replacements for onnx.reference ops that are wrong in onnx 1.23: ConvTranspose with
    group > 1 (slices the weight by output channels) and MaxPool's Indices output with
    overlapping or padded windows, Erf and Gelu (computed in float32), Softmax and
    LogSoftmax before opset 13 (flatten-to-2-D semantics ignored), LRN (windows over the
    batch axis, 4-D only), LpNormalization (p=1 sums x, not |x|),
    MeanVarianceNormalization (fails on float64: a float32 epsilon) and GridSample's 4-D
    linear/nearest modes with zeros/border padding and AffineGrid (float32 coordinates:
    finite differences of a float64 input see their rounding); GlobalLpPool, which it lacks;
    DeformConv (its GridSample calls are float32, and it loops per pixel)."""
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_conv_transpose import ConvTranspose as _RefConvTranspose

    class ConvTranspose(_RefConvTranspose):
        op_domain = ""

        def _run(self, X, W, B=None, **kw):
            group = kw.get("group") or 1
            if group == 1:
                return super()._run(X, W, B, **kw)
            cg, og = X.shape[1] // group, W.shape[1]
            outs = []
            for gi in range(group):
                bg = None if B is None else B[gi * og:(gi + 1) * og]
                outs.append(super()._run(X[:, gi * cg:(gi + 1) * cg], W[gi * cg:(gi + 1) * cg], bg,
                                         **{**kw, "group": 1})[0])
            return (np.concatenate(outs, axis=1).astype(X.dtype),)

    class MaxPool(OpRun):
        op_domain = ""

        def _run(self, X, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None,
                 pads=None, storage_order=None, strides=None):
            k = list(kernel_shape)
            nd = len(k)
            S = X.shape[2:]
            s = list(strides or [1] * nd)
            d = list(dilations or [1] * nd)
            eff = [(k[i] - 1) * d[i] + 1 for i in range(nd)]
            p = list(pads or [0] * (2 * nd))
            auto = auto_pad or "NOTSET"
            if auto == "VALID":
                p = [0] * (2 * nd)
            elif auto in ("SAME_UPPER", "SAME_LOWER"):
                for i in range(nd):
                    o = -(-S[i] // s[i])
                    tot = max(0, (o - 1) * s[i] + eff[i] - S[i])
                    lo, hi = tot // 2, tot - tot // 2
                    p[i], p[nd + i] = (lo, hi) if auto == "SAME_UPPER" else (hi, lo)
            outs = []
            for i in range(nd):
                num = S[i] + p[i] + p[nd + i] - eff[i]
                o = (-(-num // s[i]) if ceil_mode else num // s[i]) + 1
                if ceil_mode and (o - 1) * s[i] >= S[i] + p[i]:
                    o -= 1
                outs.append(o)
            N, C = X.shape[:2]
            Y = np.full((N, C, *outs), -np.inf, dtype=X.dtype)
            I = np.zeros((N, C, *outs), dtype=np.int64)
            base = (np.arange(N)[:, None] * C + np.arange(C)[None, :]) * int(np.prod(S))
            for o in np.ndindex(*outs):
                for kk in np.ndindex(*k):
                    pos = [o[i] * s[i] - p[i] + kk[i] * d[i] for i in range(nd)]
                    if any(q < 0 or q >= S[i] for i, q in enumerate(pos)):
                        continue
                    v = X[(slice(None), slice(None), *pos)]
                    if storage_order:
                        flat, mul = 0, 1
                        for i in range(nd):
                            flat += pos[i] * mul
                            mul *= S[i]
                    else:
                        flat = int(np.ravel_multi_index(pos, S))
                    sl = (slice(None), slice(None), *o)
                    better = v > Y[sl]
                    Y[sl] = np.where(better, v, Y[sl])
                    I[sl] = np.where(better, base + flat, I[sl])
            return (Y, I) if len(self.onnx_node.output) > 1 else (Y,)

    class Erf(OpRun):
        op_domain = ""

        def _run(self, x):
            from math import erf

            return (np.vectorize(erf, otypes=[np.float64])(x).astype(x.dtype),)

    class Gelu(OpRun):
        op_domain = ""

        def _run(self, x, approximate="none"):
            from math import erf

            if approximate == "tanh":
                y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
            else:
                y = 0.5 * x * (1 + np.vectorize(erf, otypes=[np.float64])(x / np.sqrt(2)))
            return (y.astype(x.dtype),)

    def softmax_like(log: bool):
        class _Softmax(OpRun):
            op_domain = ""

            def _run(self, x, axis=None):
                old = self.run_params["opsets"].get("", 13) < 13
                axis = (1 if old else -1) if axis is None else axis
                if old:  # opset < 13: coerce to 2-D at `axis`
                    axis = axis % x.ndim
                    x2 = x.reshape(int(np.prod(x.shape[:axis])), -1)
                else:
                    x2 = x
                ax = 1 if old else axis
                t = x2 - x2.max(axis=ax, keepdims=True)
                lse = np.log(np.exp(t).sum(axis=ax, keepdims=True))
                y = t - lse if log else np.exp(t - lse)
                return (y.reshape(x.shape).astype(x.dtype),)

        _Softmax.__name__ = "LogSoftmax" if log else "Softmax"
        return _Softmax

    class LRN(OpRun):
        op_domain = ""

        def _run(self, x, alpha=None, beta=None, bias=None, size=None):
            lo, hi = (size - 1) // 2, size // 2
            sq = np.zeros_like(x)
            for ch in range(x.shape[1]):
                sq[:, ch] = np.sum(x[:, max(0, ch - lo):ch + hi + 1] ** 2, axis=1)
            return ((x / (bias + (alpha / size) * sq) ** beta).astype(x.dtype),)

    class LpNormalization(OpRun):
        op_domain = ""

        def _run(self, x, axis=None, p=None):
            norm = np.sum(np.abs(x) ** p, axis=axis, keepdims=True) ** (1.0 / p)
            return (np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm)).astype(x.dtype),)

    class MeanVarianceNormalization(OpRun):
        op_domain = ""

        def _run(self, x, axes=None):
            ax = tuple(axes) if axes is not None else (0, 2, 3)
            mean = x.mean(axis=ax, keepdims=True)
            std = np.sqrt((x**2).mean(axis=ax, keepdims=True) - mean**2)
            return (((x - mean) / (std + 1e-9)).astype(x.dtype),)

    from onnx.reference.ops.op_grid_sample import GridSample as _RefGridSample

    class GridSample(_RefGridSample):
        op_domain = ""

        def _run(self, X, grid, align_corners=None, mode=None, padding_mode=None):
            mode = mode or ("bilinear" if self.run_params["opsets"].get("", 16) < 20 else "linear")
            pad = padding_mode or "zeros"
            if X.ndim != 4 or mode not in ("linear", "bilinear", "nearest") or pad not in ("zeros", "border"):
                return super()._run(X, grid, align_corners=align_corners, mode=mode, padding_mode=padding_mode)
            N, C, H, W = X.shape
            def pix(gc, size):
                p = (gc + 1) * (size - 1) / 2 if align_corners else ((gc + 1) * size - 1) / 2
                return np.clip(p, 0, size - 1) if pad == "border" else p
            ix, iy = pix(grid[..., 0], W), pix(grid[..., 1], H)  # [N, Ho, Wo]
            def at(yc, xc):
                ok = (xc >= 0) & (xc <= W - 1) & (yc >= 0) & (yc <= H - 1)
                yi, xi = np.clip(yc, 0, H - 1).astype(np.int64), np.clip(xc, 0, W - 1).astype(np.int64)
                v = X[np.arange(N)[:, None, None], :, yi, xi]  # [N, Ho, Wo, C]
                return np.moveaxis(v * ok[..., None], -1, 1)
            if mode == "nearest":
                return (at(np.round(iy), np.round(ix)).astype(X.dtype),)
            x0, y0 = np.floor(ix), np.floor(iy)
            wx, wy = ix - x0, iy - y0
            y = sum(at(y0 + j, x0 + i) * ((wx if i else 1 - wx) * (wy if j else 1 - wy))[:, None]
                    for i in (0, 1) for j in (0, 1))
            return (y.astype(X.dtype),)

    class AffineGrid(OpRun):
        op_domain = ""

        def _run(self, theta, size, align_corners=None):
            spatial = [int(v) for v in size[2:]]
            axes = [np.linspace(-1, 1, n) if align_corners else (2 * np.arange(n) + 1) / n - 1
                    for n in spatial]
            mesh = np.meshgrid(*axes, indexing="ij")  # per axis, [*S]
            base = np.stack([m.ravel() for m in reversed(mesh)] + [np.ones(mesh[0].size)], axis=1)  # x first
            grid = np.einsum("pj,nij->npi", base, theta)
            return (grid.reshape([theta.shape[0]] + spatial + [len(spatial)]).astype(theta.dtype),)

    class GlobalLpPool(OpRun):
        op_domain = ""

        def _run(self, x, p=None):
            p = 2 if p is None else p
            s = (np.abs(x) ** p).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
            return ((s ** (1.0 / p)).astype(x.dtype),)

    class DeformConv(OpRun):
        op_domain = ""

        def _run(self, X, W, offset, B=None, mask=None, dilations=None, group=None, kernel_shape=None,
                 offset_group=None, pads=None, strides=None):
            N, C, H, Wd = X.shape
            O, Ci, kh, kw = W.shape
            grp, G = group or 1, offset_group or 1
            s, d, p = strides or [1, 1], dilations or [1, 1], pads or [0, 0, 0, 0]
            oh, ow = offset.shape[2:]
            off = offset.reshape(N, G, kh, kw, 2, oh, ow)
            m = np.ones((N, G, kh, kw, oh, ow)) if mask is None else mask.reshape(N, G, kh, kw, oh, ow)
            py = ((np.arange(kh) * d[0])[:, None, None, None] + (np.arange(oh) * s[0] - p[0])[None, None, :, None]
                  + off[:, :, :, :, 0])  # [N, G, kh, kw, oh, ow] pixel coordinates
            px = ((np.arange(kw) * d[1])[None, :, None, None] + (np.arange(ow) * s[1] - p[1])[None, None, None, :]
                  + off[:, :, :, :, 1])
            xg = X.reshape(N, G, C // G, H, Wd)
            n_i = np.arange(N)[:, None, None, None, None, None]
            g_i = np.arange(G)[None, :, None, None, None, None]
            cols = 0.0
            for yc in (np.floor(py), np.floor(py) + 1):
                for xc in (np.floor(px), np.floor(px) + 1):
                    ok = (yc >= 0) & (yc <= H - 1) & (xc >= 0) & (xc <= Wd - 1)
                    w = (1 - np.abs(py - yc)) * (1 - np.abs(px - xc)) * ok * m
                    v = xg[n_i, g_i, :, np.clip(yc, 0, H - 1).astype(int), np.clip(xc, 0, Wd - 1).astype(int)]
                    cols = cols + v * w[..., None]  # [N, G, kh, kw, oh, ow, C/G]
            cols = np.moveaxis(cols, -1, 2).reshape(N, grp, Ci * kh * kw, oh * ow)
            y = np.einsum("gok,ngkp->ngop", W.reshape(grp, O // grp, Ci * kh * kw), cols).reshape(N, O, oh, ow)
            if B is not None:
                y = y + B.reshape(1, -1, 1, 1)
            return (y.astype(X.dtype),)

    return [ConvTranspose, MaxPool, Erf, Gelu, softmax_like(False), softmax_like(True), LRN, LpNormalization,
            MeanVarianceNormalization, GridSample, AffineGrid, GlobalLpPool, DeformConv]


def run_reference(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], outputs=None) -> dict:
    """Evaluate with onnx.reference (exact float64), with the fixes of `_reference_fixes`."""
    from onnx.reference import ReferenceEvaluator

    names = list(outputs) if outputs is not None else [o.name for o in model.graph.output]
    res = ReferenceEvaluator(model, new_ops=_reference_fixes()).run(names, dict(feeds))
    return dict(zip(names, res))


def run_ort(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], outputs=None) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = list(outputs) if outputs is not None else [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    res = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(names, res))


def one_node_model(
    op_type: str,
    inputs: Sequence[tuple[str, np.ndarray | None]],
    attrs: Mapping | None = None,
    n_out: int = 1,
    opset: int = 17,
    runtime_inputs: Sequence[str] = (),
    symbolic: bool | Sequence[str] = False,
    domain: str = "",
    constants: Sequence[str] = (),
    keep_dtype: Sequence[str] = (),
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A float64 model of one node. Float arrays become graph inputs (unless named in
    `constants`), other arrays initializers, except names in `runtime_inputs` (graph inputs
    too); None
    marks an omitted optional input. With `symbolic`, graph input dims are symbolic (every
    dim its own name; `symbolic` may list the inputs to treat so), so rules must use their
    dynamic-shape code paths. Float arrays named in `keep_dtype` keep their dtype (e.g.
    Resize's float32 scales). Returns the model
    (shape-inferred) and the feeds."""
    names, ginputs, inits, feeds = [], [], [], {}
    for name, arr in inputs:
        if arr is None:
            names.append("")
            continue
        names.append(name)
        arr = np.asarray(arr)
        if arr.dtype.kind == "f" and name not in keep_dtype:
            arr = arr.astype(np.float64)
        if (arr.dtype.kind == "f" and name not in constants) or name in runtime_inputs:
            et = helper.np_dtype_to_tensor_dtype(arr.dtype)
            sym = symbolic is True or (not isinstance(symbolic, bool) and name in symbolic)
            dims = [f"{name}_d{j}" for j in range(arr.ndim)] if sym else list(arr.shape)
            ginputs.append(value_info(name, et, dims))
            feeds[name] = arr
        else:
            inits.append(numpy_helper.from_array(arr, name))
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op_type, names, outs, name=f"{op_type}_0", domain=domain, **dict(attrs or {}))
    graph = helper.make_graph([node], f"{op_type}_test", ginputs,
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs],
                              initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    m = onnx.shape_inference.infer_shapes(m, data_prop=True)
    vi = {v.name: v for v in m.graph.value_info}
    for o in m.graph.output:
        if o.name in vi:
            o.CopyFrom(vi[o.name])
        elif o.type.tensor_type.elem_type == TensorProto.UNDEFINED:
            o.type.tensor_type.elem_type = TensorProto.DOUBLE
    return m, feeds


# -------------------------------------------------------------- derivative models
def derivative_model(
    model: onnx.ModelProto, wrt: Sequence[str], outputs: Sequence[str], mode: str = "vjp"
) -> onnx.ModelProto:
    """vjp: inputs + "seed/<o>" -> outputs + "grad/<w>"; jvp: inputs + "tan/<w>" -> outputs +
    "jvp/<o>". Missing (co)tangents come out as zeros. Built with the model's float type."""
    from kfac_compiler.oprules._util import zeros_like
    from kfac_compiler.passes.autodiff import _finish, _prepare, backward, jvp

    model = _prepare(model)
    view = GraphView(model)
    ftype = next((view.dtypes[o] for o in outputs if view.dtypes.get(o) in FLOAT_TYPES), TensorProto.DOUBLE)
    taken = view.all_names() | {vi.name for vi in model.graph.value_info}
    b = GraphBuilder(view.opset, prefix="chk", taken=taken, float_type=ftype)

    def vi(name, new):
        return value_info(new, view.dtypes.get(name) or ftype, view.shape(name))

    outs = [vi(o, o) for o in outputs]
    if mode == "vjp":
        seeds = {o: f"seed/{o}" for o in outputs}
        b.taken.update(seeds.values())
        res = backward(b, view, seeds, list(wrt))
        for w in wrt:
            b.identity(res[w] if res[w] is not None else zeros_like(b, view, w), f"grad/{w}")
            outs.append(vi(w, f"grad/{w}"))
        ins = [vi(o, s) for o, s in seeds.items()]
    else:
        tans = {w: f"tan/{w}" for w in wrt}
        b.taken.update(tans.values())
        res = jvp(b, view, tans, list(outputs))
        for o in outputs:
            b.identity(res[o] if res[o] is not None else zeros_like(b, view, o), f"jvp/{o}")
            outs.append(vi(o, f"jvp/{o}"))
        ins = [vi(w, t) for w, t in tans.items()]
    return _finish(model, view, b, f"{model.graph.name}_{mode}", ins, outs)


# -------------------------------------------------------------- finite differences
@dataclass
class FDReport:
    """Per-tensor errors of a finite-difference check (ok when all are within tolerance)."""

    vjp: dict[str, tuple[float, float]] = field(default_factory=dict)  # w -> (analytic, fd)
    jvp: dict[str, float] = field(default_factory=dict)  # w -> max scaled error
    failures: list[str] = field(default_factory=list)
    grads: dict[str, np.ndarray] = field(default_factory=dict)
    jvps: dict[str, np.ndarray] = field(default_factory=dict)
    feeds: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        return "; ".join(self.failures) or "ok"


def _float_inputs(model: onnx.ModelProto) -> list[str]:
    return [i.name for i in model.graph.input if i.type.tensor_type.elem_type in FLOAT_TYPES]


def fd_check(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str] | None = None,
    outputs: Sequence[str] | None = None,
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    seed: int = 0,
    check_jvp: bool = True,
    per_input_jvp: bool = True,
    run=run_reference,
) -> FDReport:
    """Check backward() and jvp() of a float64 model against central differences.

    `wrt` are graph inputs or initializers (default: all float graph inputs); `outputs`
    default to all float graph outputs. For each w: u . (f(x + eps v) - f(x - eps v)) / 2eps
    is compared with vjp(u) . v for random u, v; jvp(v) is compared elementwise."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    wrt = list(wrt) if wrt is not None else _float_inputs(model)
    model, lifted = lift_initializers(model, [w for w in wrt if w in inits])
    feeds = {**dict(feeds), **lifted}
    outs = list(outputs) if outputs is not None else [
        o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES
    ]
    rep = FDReport(feeds=dict(feeds))
    y0 = run(model, feeds, outs)
    us = {o: rng.standard_normal(np.shape(y0[o])) for o in outs}
    vs = {w: rng.standard_normal(np.shape(feeds[w])) for w in wrt}
    ny = 1.0 + max(float(np.max(np.abs(y0[o]))) if np.size(y0[o]) else 0.0 for o in outs)

    vm = derivative_model(model, wrt, outs, "vjp")
    gres = run(vm, {**feeds, **{f"seed/{o}": us[o].astype(y0[o].dtype) for o in outs}},
               [f"grad/{w}" for w in wrt])
    fds = {}
    for w in wrt:
        dt = np.asarray(feeds[w]).dtype
        plus = run(model, {**feeds, w: np.asarray(feeds[w] + eps * vs[w], dtype=dt)}, outs)
        minus = run(model, {**feeds, w: np.asarray(feeds[w] - eps * vs[w], dtype=dt)}, outs)
        fds[w] = {o: (plus[o] - minus[o]) / (2 * eps) for o in outs}
        fd = sum(float(np.sum(us[o] * fds[w][o])) for o in outs)
        g = gres[f"grad/{w}"]
        rep.grads[w] = g
        if np.shape(g) != np.shape(feeds[w]):
            rep.failures.append(f"grad/{w} has shape {np.shape(g)}, expected {np.shape(feeds[w])}")
            continue
        an = float(np.sum(g.astype(np.float64) * vs[w]))
        rep.vjp[w] = (an, fd)
        scale = sum(float(np.linalg.norm(us[o]) * np.linalg.norm(fds[w][o])) for o in outs)
        if not np.isfinite(an) or not np.isfinite(fd) or abs(an - fd) > atol * ny * (1 + scale) + rtol * max(abs(an), abs(fd), scale * 1e-3):
            rep.failures.append(f"vjp {w}: analytic {an:.10g} vs fd {fd:.10g}")
    if check_jvp:
        jm = derivative_model(model, wrt, outs, "jvp")
        groups = [[w] for w in wrt] if per_input_jvp else [list(wrt)]
        for grp in groups:
            tfeeds = {f"tan/{w}": np.asarray(vs[w] if w in grp else np.zeros_like(vs[w]),
                                             dtype=np.asarray(feeds[w]).dtype) for w in wrt}
            jr = run(jm, {**feeds, **tfeeds}, [f"jvp/{o}" for o in outs])
            key = ",".join(grp)
            worst = 0.0
            for o in outs:
                fd = sum(fds[w][o] for w in grp)
                j = jr[f"jvp/{o}"]
                rep.jvps[f"{key}->{o}"] = j
                if np.shape(j) != np.shape(fd):
                    rep.failures.append(f"jvp {key}->{o}: shape {np.shape(j)} vs {np.shape(fd)}")
                    continue
                tol = atol * ny + rtol * (np.abs(fd) + np.max(np.abs(fd), initial=0.0) * 1e-3)
                err = np.abs(j - fd) - tol
                worst = max(worst, float(np.max(err, initial=-1.0)))
                if not np.all(np.isfinite(j)) or not np.all(np.isfinite(fd)) or np.any(err > 0):
                    k = int(np.argmax(err))
                    rep.failures.append(
                        f"jvp {key}->{o}: {np.ravel(j)[k]:.10g} vs fd {np.ravel(fd)[k]:.10g} at flat index {k}"
                    )
            rep.jvp[key] = worst
    return rep
