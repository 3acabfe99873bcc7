"""Lowering of the fused recurrent ops LSTM, GRU and RNN into primitive ONNX ops.

`lower_recurrent(model)` returns a NEW model (the input is never mutated) where every
default-domain `LSTM`, `GRU` and `RNN` node is unrolled over its time steps (the sequence
length must be static after shape inference) into Split/Squeeze, Gemm, Add, Split, the gate
activations, Mul, Where (for `sequence_lens`), Unsqueeze and Concat. The existing gradient
rules then apply, and the pattern library sees the per-step products as fully connected
layers: every step emits

    Gemm(x_t,    {W}.{dir}, {B}.{dir}.input,     transB=1)     # T uses of the input weights
    Gemm(h_prev, {R}.{dir}, {B}.{dir}.recurrent, transB=1)     # T uses of the recurrent weights

(h_prev at the first step is initial_h, zeros when absent), so W and R become multi-use
fully connected layers with their biases linked.

Parameters. A weight initializer W `[D, G*H, I]`, R `[D, G*H, H]`, B `[D, 2*G*H]` and P
`[D, 3*H]` (G gates, D directions) consumed only by recurrent ops is REPLACED by 2-D / 1-D
initializers per direction `dir` ("forward" or "reverse"):

    {W}.{dir}                     [G*H, I]   input weights, ONNX gate order (LSTM i,o,f,c; GRU z,r,h)
    {R}.{dir}                     [G*H, H]   recurrent weights (GRU linear_before_reset=0: z,r rows [2H, H])
    {R}.{dir}.candidate           [H, H]     GRU linear_before_reset=0 only: the h rows (they take r*h)
    {B}.{dir}.input               [G*H]      Wb
    {B}.{dir}.recurrent           [G*H]      Rb (GRU linear_before_reset=0: the z,r part [2H])
    {B}.{dir}.recurrent.candidate [H]        GRU linear_before_reset=0 only: Rbh
    {P}.{dir}                     [3*H]      LSTM peepholes (i, o, f)

The original initializer is removed. The pieces and where they sit in it are recorded in the
model's metadata (`METADATA_KEY`, JSON); `fold_recurrent_params(model, values)` assembles the
original initializers back from (trained) piece values. Weights that are not initializers,
or also used by other ops, are sliced with Gather/Slice nodes instead.

Supported: directions forward, reverse, bidirectional; sequence_lens (masks: outputs past a
sample's length are 0, Y_h/Y_c the last valid state, the reverse direction starts at each
sample's last valid step); initial_h / initial_c; layout 0 and 1; LSTM peepholes and
input_forget; clip; GRU linear_before_reset 0 and 1; activations Sigmoid, Tanh, Relu,
HardSigmoid, LeakyRelu, ThresholdedRelu, Elu, Softsign, Softplus, Affine, ScaledTanh with
activation_alpha/beta consumed in the order of the activations (ONNX Runtime's defaults
where absent, see `_ACTS`).
A dynamic sequence length, an unknown activation or an input of unknown rank is a one-line
UnsupportedOpError naming the node.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler import contract as C
from kfac_compiler.errors import UnsupportedOpError
from kfac_compiler.graph import GraphView, attrs_of
from kfac_compiler.onnx_files import tensor_array

RECURRENT_OPS = ("LSTM", "GRU", "RNN")
METADATA_KEY = C.RECURRENT_PIECES_KEY
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
# activation (lower case) -> (ONNX op or None, uses alpha, uses beta, default alpha, default beta).
# The defaults are ONNX Runtime's (its CPU kernels are the reference the lowering is tested
# against): LeakyRelu 0.01, HardSigmoid 0.2/0.5, Elu 1.0, and 0 for Affine, ScaledTanh and
# ThresholdedRelu (where the ONNX operators' own defaults would be 1.0).
_ACTS = {
    "sigmoid": ("Sigmoid", False, False, None, None),
    "tanh": ("Tanh", False, False, None, None),
    "relu": ("Relu", False, False, None, None),
    "softsign": ("Softsign", False, False, None, None),
    "softplus": ("Softplus", False, False, None, None),
    "hardsigmoid": ("HardSigmoid", True, True, 0.2, 0.5),
    "leakyrelu": ("LeakyRelu", True, False, 0.01, None),
    "thresholdedrelu": ("ThresholdedRelu", True, False, 0.0, None),
    "elu": ("Elu", True, False, 1.0, None),
    "affine": (None, True, True, 0.0, 0.0),
    "scaledtanh": (None, True, True, 0.0, 0.0),
}
_NP = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64, TensorProto.FLOAT16: np.float16}


def _is_recurrent(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in RECURRENT_OPS


def _weight_slot(node: onnx.NodeProto, slot: int) -> bool:
    """W, R, B (and an LSTM's peepholes P): the inputs lowered into per-direction pieces."""
    return slot in (1, 2, 3) or (slot == 7 and node.op_type == "LSTM")


def lowered_pieces(model: onnx.ModelProto) -> set[str]:
    """The initializers the lowering cut out of fused ops' weights (the metadata record). They
    are one tensor of the user's model, read by the lowering's own per-step nodes: equal pieces
    (a Keras Bidirectional LSTM's two directions' biases at initialisation) are no exporter's
    copies, and their sharing is no exporter's merge."""
    record = json.loads({p.key: p.value for p in model.metadata_props}.get(METADATA_KEY, "{}"))
    return {piece[0] for pieces in record.values() for piece in pieces}


def weight_inputs(model: onnx.ModelProto) -> list[str]:
    """The recurrent ops' weight inputs (W, R, B, P) that are computed, not initializers: what
    passes/fold_params.py may fold into initializers before the lowering."""
    inits = {t.name for t in model.graph.initializer}
    return [name for node in model.graph.node if _is_recurrent(node)
            for slot, name in enumerate(node.input) if name and _weight_slot(node, slot) and name not in inits]


def _attr(a: dict, name: str, default=None):
    v = a.get(name, default)
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, (list, tuple)):
        v = [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


class _Emitter:
    """Appends nodes with readable fresh names (`prefix/hint`); float constants are Constant
    nodes (never initializers: those would look like parameters)."""

    def __init__(self, taken: set[str], np_float) -> None:
        self.taken = taken
        self.np_float = np_float
        self.nodes: list[onnx.NodeProto] = []
        self._consts: dict[tuple, str] = {}
        self.value_info: list[onnx.ValueInfoProto] = []
        self.elem_type = TensorProto.FLOAT

    def annotate(self, names, shape) -> None:
        """Declare `names` of `shape` (a symbolic batch dim): shape inference keeps the
        declared symbol where it would invent one per tensor, so the unrolled steps' tensors
        share one batch symbol and their Concat's gradient splits in equal parts."""
        self.value_info.extend(helper.make_tensor_value_info(n, self.elem_type, shape) for n in names)

    def fresh(self, name: str) -> str:
        cand, k = name, 0
        while cand in self.taken:
            k += 1
            cand = f"{name}_{k}"
        self.taken.add(cand)
        return cand

    def op(self, op_type, inputs, name, n_out=1, outputs=None, **attrs):
        name = self.fresh(name)
        if outputs is None:
            outputs = [self.fresh(f"{name}:{i}") for i in range(n_out)]
        else:
            self.taken.update(outputs)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=name, **attrs))
        return outputs[0] if n_out == 1 else list(outputs)

    def const(self, value, name: str, dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype if dtype is not None else self.np_float)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            out = self.fresh(name)
            self.nodes.append(helper.make_node("Constant", [], [out], name=self.fresh(f"{out}/const"),
                                               value=numpy_helper.from_array(arr, out)))
            self._consts[key] = out
        return self._consts[key]

    def ints(self, values, name: str) -> str:
        return self.const(np.asarray(values, np.int64), name, dtype=np.int64)


class _Params:
    """Per-direction pieces of W, R, B, P: new initializers when the original is an
    initializer used only by recurrent ops (replaced), else Gather/Slice nodes."""

    def __init__(self, model: onnx.ModelProto, view: GraphView, em: _Emitter) -> None:
        self.view, self.em = view, em
        self.inits = {t.name: t for t in model.graph.initializer}
        ours: dict[str, int] = {}
        other: set[str] = {o.name for o in model.graph.output}
        for node in model.graph.node:
            for i, name in enumerate(node.input):
                if not name:
                    continue
                if _is_recurrent(node) and _weight_slot(node, i):
                    ours[name] = ours.get(name, 0) + 1
                else:
                    other.add(name)
        self.replaceable = {n for n in ours if n in self.inits and n not in other}
        self.replaced: set[str] = set()
        self.new_inits: list[onnx.TensorProto] = []
        self.record: dict[str, list] = {}  # original -> [[piece, direction index, start, end]]
        self._cache: dict[tuple, str] = {}

    def piece(self, name: str, d: int, start: int, end: int, piece_name: str, hint: str) -> str:
        key = (name, d, start, end)
        if key in self._cache:
            return self._cache[key]
        if name in self.replaceable:
            arr = tensor_array(self.inits[name])[d, start:end]
            out = self.em.fresh(piece_name)
            self.new_inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), out))
            self.replaced.add(name)
            self.record.setdefault(name, []).append([out, d, start, end])
        else:
            em = self.em
            sel = em.op("Gather", [name, em.ints(d, f"{hint}/index")], f"{hint}/Gather", axis=0)
            out = em.op("Slice", [sel, em.ints([start], f"{hint}/start"), em.ints([end], f"{hint}/end"),
                                  em.ints([0], f"{hint}/axis")], f"{hint}/Slice")
        self._cache[key] = out
        return out


def lower_recurrent(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with its LSTM/GRU/RNN nodes lowered (the model itself when it has
    none). Run shape inference first: the sequence length must be a static dim."""
    if not any(_is_recurrent(n) for n in model.graph.node):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    view = GraphView(m)
    taken = view.all_names() | {o for n in m.graph.node for o in n.output}
    x_types = {view.dtypes.get(n.input[0]) for n in m.graph.node if _is_recurrent(n)}
    np_float = _NP.get(next(iter(x_types)) if len(x_types) == 1 else TensorProto.FLOAT, np.float32)
    em = _Emitter(taken, np_float)
    params = _Params(m, view, em)
    nodes: list[onnx.NodeProto] = []
    for idx, node in enumerate(m.graph.node):
        if not _is_recurrent(node):
            nodes.append(node)
            continue
        em.np_float = _NP.get(view.dtypes.get(node.input[0]), np.float32)
        em.elem_type = view.dtypes.get(node.input[0]) or TensorProto.FLOAT
        em._consts = {}
        em.nodes = []
        _lower_node(node, node.name or f"{node.op_type}_{idx}", view, em, params)
        nodes.extend(em.nodes)
    g = m.graph
    del g.node[:]
    g.node.extend(nodes)
    if params.replaced:
        kept = [t for t in g.initializer if t.name not in params.replaced]
        del g.initializer[:]
        g.initializer.extend(kept + params.new_inits)
        ins = [i for i in g.input if i.name not in params.replaced]
        del g.input[:]
        g.input.extend(ins)
        old = {p.key: p.value for p in m.metadata_props}
        record = json.loads(old.get(METADATA_KEY, "{}"))
        record.update(params.record)
        helper.set_model_props(m, {**old, METADATA_KEY: json.dumps(record, sort_keys=True)})
    drop = {o for n in model.graph.node if _is_recurrent(n) for o in n.output}
    vis = [v for v in g.value_info if v.name not in drop] + em.value_info
    del g.value_info[:]
    g.value_info.extend(vis)
    return m


def _unsupported(node_name: str, op: str, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"node {node_name!r}: op {op} {why}")


def _activations(name: str, node: onnx.NodeProto, a: dict, D: int) -> list[tuple[str, float | None, float | None]]:
    n = len(_DEFAULT_ACTS[node.op_type])
    acts = _attr(a, "activations") or list(_DEFAULT_ACTS[node.op_type]) * D
    if len(acts) != n * D:
        raise _unsupported(name, node.op_type, f"has {len(acts)} activations; expected {n * D} ({n} per direction)")
    alphas = list(a.get("activation_alpha", []) or [])
    betas = list(a.get("activation_beta", []) or [])
    out = []
    for act in acts:
        spec = _ACTS.get(act.lower())
        if spec is None:
            raise _unsupported(name, node.op_type, f"uses activation {act!r}, which is not supported "
                                                   f"(supported: {', '.join(sorted(_ACTS))})")
        _, ua, ub, da, db = spec
        alpha = (alphas.pop(0) if alphas else da) if ua else None
        beta = (betas.pop(0) if betas else db) if ub else None
        out.append((act.lower(), alpha, beta))
    return out


def _apply_act(em: _Emitter, act, x: str, name: str) -> str:
    kind, alpha, beta = act
    op = _ACTS[kind][0]
    if kind == "affine":
        return em.op("Add", [em.op("Mul", [x, em.const(alpha, f"{name}/alpha")], f"{name}/Mul"),
                             em.const(beta, f"{name}/beta")], f"{name}/Add")
    if kind == "scaledtanh":
        inner = em.op("Mul", [x, em.const(beta, f"{name}/beta")], f"{name}/Mul_beta")
        return em.op("Mul", [em.op("Tanh", [inner], f"{name}/Tanh"), em.const(alpha, f"{name}/alpha")],
                     f"{name}/Mul_alpha")
    attrs = {}
    if alpha is not None:
        attrs["alpha"] = float(alpha)
    if beta is not None:
        attrs["beta"] = float(beta)
    return em.op(op, [x], f"{name}/{op}", **attrs)


def _lower_node(node: onnx.NodeProto, name: str, view: GraphView, em: _Emitter, params: _Params) -> None:
    op = node.op_type
    a = attrs_of(node)
    G = _GATES[op]
    ins = list(node.input) + [""] * 8

    def opt(i):
        return ins[i] or None

    X, W, R, B, seq, h0 = ins[0], ins[1], ins[2], opt(3), opt(4), opt(5)
    c0 = opt(6) if op == "LSTM" else None
    P = opt(7) if op == "LSTM" else None
    layout = int(a.get("layout", 0))
    direction = _attr(a, "direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise _unsupported(name, op, f"has unknown direction {direction!r}")
    D = 2 if direction == "bidirectional" else 1
    xs = view.shape(X)
    if xs is None or len(xs) != 3:
        raise _unsupported(name, op, f"input {X!r} has an unknown shape; run shape inference (static sequence length needed)")
    t_axis, b_axis = (1, 0) if layout else (0, 1)
    T = xs[t_axis]
    if not isinstance(T, int):
        raise _unsupported(name, op, f"has a dynamic sequence length ({T if T else 'unknown'!r}); "
                                     "export the model with a static sequence length")
    H = a.get("hidden_size")
    if H is None:
        rs = view.shape(R)
        if rs is None or not isinstance(rs[-1], int):
            raise _unsupported(name, op, "has no hidden_size and R has an unknown shape")
        H = rs[-1]
    H = int(H)
    clip = a.get("clip")
    acts = _activations(name, node, a, D)
    k = len(_DEFAULT_ACTS[op])
    lbr = int(a.get("linear_before_reset", 0)) if op == "GRU" else 1
    input_forget = int(a.get("input_forget", 0)) if op == "LSTM" else 0
    N = xs[b_axis]

    # The input projections do not depend on the recurrence: one Gemm per direction over the
    # T*N time-major rows of X ([T*N, I] x [I, G*H]), split into the T steps' [N, G*H] rows.
    rows = em.op("Flatten", [em.op("Transpose", [X], f"{name}/Transpose_X", perm=[1, 0, 2]) if layout else X],
                 f"{name}/Flatten_X", axis=2)
    batch = N if isinstance(N, str) and N else f"{name}/batch"  # the steps' shared batch symbol
    opset = next((o.version for o in view.model.opset_import if o.domain in ("", "ai.onnx")), 13)

    def time_steps(x: str, hint: str) -> list[str]:
        """x [T*N, cols] time-major -> T tensors [N, cols] (equal parts: no sizes needed)."""
        if T == 1:
            return [x]
        if opset >= 18:
            return em.op("Split", [x], hint, n_out=T, axis=0, num_outputs=T)
        return em.op("Split", [x], hint, n_out=T, axis=0)

    masks = None
    if seq:
        seq64 = em.op("Cast", [seq], f"{name}/Cast_seq", to=TensorProto.INT64)
        masks = [em.op("Unsqueeze", [em.op("Less", [em.ints(t, f"{name}/t{t}/step"), seq64], f"{name}/t{t}/Less"),
                                     em.ints([1], f"{name}/axis1")], f"{name}/t{t}/mask")
                 for t in range(T)]
    zero_state = None

    def zeros():
        nonlocal zero_state
        if zero_state is None:
            if isinstance(N, int):
                zero_state = em.const(np.zeros((N, H)), f"{name}/zero_state")
            else:
                if opset >= 15:
                    n_dim = em.op("Shape", [X], f"{name}/Shape_X", start=b_axis, end=b_axis + 1)
                else:  # Shape's start/end came in opset 15
                    n_dim = em.op("Slice", [em.op("Shape", [X], f"{name}/Shape_X"), em.ints([b_axis], f"{name}/b0"),
                                            em.ints([b_axis + 1], f"{name}/b1")], f"{name}/batch_dim")
                shp = em.op("Concat", [n_dim, em.ints([H], f"{name}/hidden")], f"{name}/state_shape", axis=0)
                zero_state = em.op("ConstantOfShape", [shp], f"{name}/zero_state",
                                   value=numpy_helper.from_array(np.zeros(1, em.np_float)))
        return zero_state

    def initial(s, d, hint):
        if not s:
            return zeros()
        return em.op("Gather", [s, em.ints(d, f"{name}/dir{d}")], f"{name}/{hint}", axis=1 if layout else 0)

    def clipped(x, hint):
        if clip is None:
            return x
        return em.op("Clip", [x, em.const(-float(clip), f"{name}/clip_lo"), em.const(float(clip), f"{name}/clip_hi")],
                     f"{hint}/Clip")

    one = None
    ys_all, hs, cs = [], [], []
    for d in range(D):
        dname = ("forward", "reverse")[d] if D == 2 else direction
        reverse = dname == "reverse"
        pre = f"{name}/{dname}"
        GH = G * H
        Wd = params.piece(W, d, 0, GH, f"{W}.{dname}", f"{pre}/W")
        r_rows = GH if lbr else 2 * H
        Rd = params.piece(R, d, 0, r_rows, f"{R}.{dname}", f"{pre}/R")
        Rh = params.piece(R, d, 2 * H, GH, f"{R}.{dname}.candidate", f"{pre}/R_candidate") if not lbr else None
        Wb = params.piece(B, d, 0, GH, f"{B}.{dname}.input", f"{pre}/B_input") if B else None
        Rb = params.piece(B, d, GH, GH + r_rows, f"{B}.{dname}.recurrent", f"{pre}/B_recurrent") if B else None
        Rbh = (params.piece(B, d, GH + 2 * H, 2 * GH, f"{B}.{dname}.recurrent.candidate", f"{pre}/B_candidate")
               if B and not lbr else None)
        peep = None
        if P:
            Pd = params.piece(P, d, 0, 3 * H, f"{P}.{dname}", f"{pre}/P")
            peep = em.op("Split", [Pd, em.ints([H] * 3, f"{name}/split_3")], f"{pre}/Split_P", n_out=3, axis=0)
        f_act, g_act, h_act = (acts[d * k:(d + 1) * k] + [None, None])[:3]
        h = initial(h0, d, f"{dname}/initial_h")
        c = initial(c0, d, f"{dname}/initial_c") if op == "LSTM" else None
        ys = [None] * T
        xws = time_steps(em.op("Gemm", [rows, Wd] + ([Wb] if Wb else []), f"{pre}/Gemm_W", transB=1),
                         f"{pre}/Split_W_steps")
        if T > 1 and not isinstance(N, int):
            em.annotate(xws, [batch, GH])
        for t in (reversed(range(T)) if reverse else range(T)):
            s = f"{pre}/t{t}"
            xw = xws[t]
            hr = em.op("Gemm", [h, Rd] + ([Rb] if Rb else []), f"{s}/Gemm_R", transB=1)
            c_new = None
            if op == "RNN":
                h_new = _apply_act(em, f_act, clipped(em.op("Add", [xw, hr], f"{s}/Add"), s), f"{s}/f")
            elif op == "LSTM" and not peep and not input_forget:
                z = em.op("Add", [xw, hr], f"{s}/Add")
                # i, o, f are contiguous in ONNX's gate order and share one activation: one
                # activation over [N, 3H] (and so one gradient chain instead of three)
                gs, gc = em.op("Split", [clipped(z, s), em.ints([3 * H, H], f"{name}/split_3_1")], f"{s}/Split",
                               n_out=2, axis=1)
                i_g, o_g, f_g = em.op("Split", [_apply_act(em, f_act, gs, f"{s}/iof"),
                                                em.ints([H] * 3, f"{name}/split_3")], f"{s}/Split_iof", n_out=3, axis=1)
                c_g = _apply_act(em, g_act, gc, f"{s}/c")
                c_new = em.op("Add", [em.op("Mul", [f_g, c], f"{s}/Mul_fc"), em.op("Mul", [i_g, c_g], f"{s}/Mul_ic")],
                              f"{s}/C")
                h_new = em.op("Mul", [o_g, _apply_act(em, h_act, c_new, f"{s}/h")], f"{s}/H")
            elif op == "LSTM":  # peepholes or input_forget: the gates one by one
                z = em.op("Add", [xw, hr], f"{s}/Add")
                gi, go, gf, gc = em.op("Split", [z, em.ints([H] * 4, f"{name}/split_4")], f"{s}/Split", n_out=4, axis=1)
                if peep:
                    gi = em.op("Add", [gi, em.op("Mul", [peep[0], c], f"{s}/Mul_Pi")], f"{s}/Add_Pi")
                i_g = _apply_act(em, f_act, clipped(gi, f"{s}/i"), f"{s}/i")
                if input_forget:
                    one = one or em.const(1.0, f"{name}/one")
                    f_g = em.op("Sub", [one, i_g], f"{s}/f/Sub")
                else:
                    if peep:
                        gf = em.op("Add", [gf, em.op("Mul", [peep[2], c], f"{s}/Mul_Pf")], f"{s}/Add_Pf")
                    f_g = _apply_act(em, f_act, clipped(gf, f"{s}/f"), f"{s}/f")
                c_g = _apply_act(em, g_act, clipped(gc, f"{s}/c"), f"{s}/c")
                c_new = em.op("Add", [em.op("Mul", [f_g, c], f"{s}/Mul_fc"), em.op("Mul", [i_g, c_g], f"{s}/Mul_ic")],
                              f"{s}/C")
                if peep:
                    go = em.op("Add", [go, em.op("Mul", [peep[1], c_new], f"{s}/Mul_Po")], f"{s}/Add_Po")
                o_g = _apply_act(em, f_act, clipped(go, f"{s}/o"), f"{s}/o")
                h_new = em.op("Mul", [o_g, _apply_act(em, h_act, c_new, f"{s}/h")], f"{s}/H")
            else:  # GRU: z, r contiguous and sharing one activation, as the LSTM's i, o, f
                split_2_1 = em.ints([2 * H, H], f"{name}/split_2_1")
                xzr, xh = em.op("Split", [xw, split_2_1], f"{s}/Split_W", n_out=2, axis=1)
                if lbr:
                    hzr, hh = em.op("Split", [hr, split_2_1], f"{s}/Split_R", n_out=2, axis=1)
                else:
                    hzr = hr
                zr = _apply_act(em, f_act, clipped(em.op("Add", [xzr, hzr], f"{s}/Add_zr"), f"{s}/zr"), f"{s}/zr")
                z_g, r_g = em.op("Split", [zr, em.ints([H] * 2, f"{name}/split_2")], f"{s}/Split_zr", n_out=2, axis=1)
                if lbr:
                    hc = em.op("Mul", [r_g, hh], f"{s}/Mul_rh")
                else:
                    rh = em.op("Mul", [r_g, h], f"{s}/Mul_rh")
                    hc = em.op("Gemm", [rh, Rh] + ([Rbh] if Rbh else []), f"{s}/Gemm_R_candidate", transB=1)
                n_g = _apply_act(em, g_act, clipped(em.op("Add", [xh, hc], f"{s}/Add_h"), f"{s}/h"), f"{s}/h")
                one = one or em.const(1.0, f"{name}/one")
                h_new = em.op("Add", [em.op("Mul", [em.op("Sub", [one, z_g], f"{s}/Sub_z"), n_g], f"{s}/Mul_zn"),
                                      em.op("Mul", [z_g, h], f"{s}/Mul_zh")], f"{s}/H")
            if masks is not None:
                mt = masks[t]
                ys[t] = em.op("Where", [mt, h_new, em.const(0.0, f"{name}/zero")], f"{s}/Y")
                h = em.op("Where", [mt, h_new, h], f"{s}/H_carry")
                if c_new is not None:
                    c = em.op("Where", [mt, c_new, c], f"{s}/C_carry")
            else:
                ys[t], h, c = h_new, h_new, c_new
            if not isinstance(N, int):
                em.annotate(list(dict.fromkeys(x for x in (ys[t], h, c) if x is not None)), [batch, H])
        ys_all.append(ys)
        hs.append(h)
        cs.append(c)

    outs = list(node.output) + ["", "", ""]
    Y, Y_h, Y_c = outs[0], outs[1], (outs[2] if op == "LSTM" else "")
    if Y:
        # layout 0: [T, D, N, H] from the steps' rows stacked time-major ([T*N, H]); layout 1:
        # [N, T, D, H] from the steps side by side ([N, T*H])
        cat_axis, step_shape, d_cat = (1, [-1, T, 1, H], 2) if layout else (0, [T, 1, -1, H], 1)
        per_dir = []
        for d, ys in enumerate(ys_all):
            cat = ys[0] if T == 1 else em.op("Concat", ys, f"{name}/Y/d{d}/Concat", axis=cat_axis)
            per_dir.append(em.op("Reshape", [cat, em.ints(step_shape, f"{name}/y_shape")], f"{name}/Y/d{d}/Reshape",
                                 outputs=[Y] if D == 1 else None))
        if D == 2:
            em.op("Concat", per_dir, f"{name}/Y/Concat", axis=d_cat, outputs=[Y])
        if not isinstance(N, int):
            em.annotate([Y], [batch, T, D, H] if layout else [T, D, batch, H])
    for out, states in ((Y_h, hs), (Y_c, cs)):
        if not out:
            continue
        s_axis = 1 if layout else 0
        us = [em.op("Unsqueeze", [st, em.ints([s_axis], f"{name}/state_axis")], f"{name}/{out}/d{d}/Unsqueeze",
                    outputs=[out] if D == 1 else None) for d, st in enumerate(states)]
        if D == 2:
            em.op("Concat", us, f"{name}/{out}/Concat", axis=s_axis, outputs=[out])
