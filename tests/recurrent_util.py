"""Builders for single fused recurrent-op models (tests/test_recurrent.py)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

NotImplemented_ = ort.capi.onnxruntime_pybind11_state.NotImplemented
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def make_model(op, *, direction="forward", layout=0, seq=False, init=False, peep=False, input_forget=0,
               clip=None, lbr=None, acts=None, alphas=None, betas=None, bias=True, T=5, N=2, I=3, H=4, seed=0,
               dtype=TensorProto.FLOAT, scale=0.5, inits=None, batch=None):
    """(model, feeds): X, sequence_lens, initial_h, initial_c are graph inputs; W, R, B, P
    initializers (random from `seed`, or the arrays in `inits`). `batch`: a symbolic batch
    dim name for the graph inputs."""
    rng = np.random.default_rng(seed)
    npf = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    G = GATES[op]
    D = 2 if direction == "bidirectional" else 1
    xshape = [N, T, I] if layout else [T, N, I]
    sshape = [N, D, H] if layout else [D, N, H]
    inits_arg = inits
    inits = {"W": rng.standard_normal((D, G * H, I)) * scale, "R": rng.standard_normal((D, G * H, H)) * scale}
    if bias:
        inits["B"] = rng.standard_normal((D, 2 * G * H)) * scale
    if peep:
        inits["P"] = rng.standard_normal((D, 3 * H)) * scale
    inits.update(inits_arg or {})
    feeds = {"X": rng.standard_normal(xshape).astype(npf)}
    if batch is not None:
        xshape = [batch, T, I] if layout else [T, batch, I]
        sshape = [batch, D, H] if layout else [D, batch, H]
    inputs = [helper.make_tensor_value_info("X", dtype, xshape)]
    names = ["X", "W", "R", "B" if bias else ""]
    if seq:
        feeds["sequence_lens"] = np.asarray([T, max(1, T - 2)] + [T - 1] * (N - 2), np.int32)[:N]
        inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch or N]))
    names.append("sequence_lens" if seq else "")
    names.append("initial_h" if init else "")
    if init:
        feeds["initial_h"] = (rng.standard_normal(sshape) * scale).astype(npf)
        inputs.append(helper.make_tensor_value_info("initial_h", dtype, sshape))
    if op == "LSTM":
        names.append("initial_c" if init else "")
        if init:
            feeds["initial_c"] = (rng.standard_normal(sshape) * scale).astype(npf)
            inputs.append(helper.make_tensor_value_info("initial_c", dtype, sshape))
        names.append("P" if peep else "")
    while names and not names[-1]:
        names.pop()
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    attrs = dict(hidden_size=H, direction=direction, layout=layout)
    if clip is not None:
        attrs["clip"] = clip
    if op == "LSTM" and input_forget:
        attrs["input_forget"] = input_forget
    if op == "GRU" and lbr is not None:
        attrs["linear_before_reset"] = lbr
    if acts is not None:
        attrs["activations"] = acts
    if alphas is not None:
        attrs["activation_alpha"] = alphas
    if betas is not None:
        attrs["activation_beta"] = betas
    node = helper.make_node(op, names, outs, name="rnn_node", **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, dtype, None) for o in outs],
                              initializer=[numpy_helper.from_array(v.astype(npf), k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m, feeds


def run(model, feeds, outputs=None):
    """ORT CPU; float64 graphs with an op ORT has no double kernel for (HardSigmoid, Elu,
    Softplus, Softsign, ThresholdedRelu) run on onnx.reference instead."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    names = [i.name for i in model.graph.input]
    feeds = {k: v for k, v in feeds.items() if k in names}
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except NotImplemented_:
        from kfac_compiler.oprules.check import run_reference as run_onnx_reference

        outs = outputs or [o.name for o in model.graph.output]
        res = run_onnx_reference(model, feeds, outs)
        return [np.asarray(res[o]) for o in outs]
    return sess.run(outputs, feeds)


def run_reference(op, feeds, outputs=None, **kw):
    """The fused op on ORT (float32). ORT runs layout 0 only: a layout-1 case runs as layout
    0 on transposed inputs and its outputs are transposed back."""
    layout = kw.get("layout", 0)
    m, _ = make_model(op, **{**kw, "layout": 0})
    if not layout:
        return run(m, feeds, outputs)
    f = dict(feeds)
    f["X"] = feeds["X"].transpose(1, 0, 2)
    for k in ("initial_h", "initial_c"):
        if k in f:
            f[k] = feeds[k].transpose(1, 0, 2)
    y, *states = run(m, f)
    return [y.transpose(2, 0, 1, 3)] + [s.transpose(1, 0, 2) for s in states]
