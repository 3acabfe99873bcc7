"""Helpers the test files share. Randomness is explicit: every function that draws takes a
`numpy.random.Generator` (tests get a fresh, seeded one from conftest's `rng` fixture) or a
seed, so that what a test sees does not depend on which tests ran before it."""
from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import kfac_compiler as kc
from kfac_compiler.builder import NP_TO_ONNX, GraphBuilder, value_info
from kfac_compiler.models import ZOO, get_model


# ------------------------------------------------------------------------------ arrays
def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Standard normal float32 values of `shape` from `rng`."""
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------ graphs
def onnx_model(nodes, inputs: Mapping, inits: Mapping, outputs: Sequence = ("y",), opset: int = 17,
               out_shape=None) -> onnx.ModelProto:
    """A float model from nodes. inputs: {name: shape} or {name: ValueInfoProto}; inits:
    {name: array}; outputs: names (float, shape `out_shape`) or ValueInfoProtos."""
    ins = [v if isinstance(v, onnx.ValueInfoProto) else helper.make_tensor_value_info(k, TensorProto.FLOAT, v)
           for k, v in inputs.items()]
    outs = [o if isinstance(o, onnx.ValueInfoProto) else helper.make_tensor_value_info(o, TensorProto.FLOAT, out_shape)
            for o in ([outputs] if isinstance(outputs, str) else outputs)]
    g = helper.make_graph(nodes, "t", ins, outs,
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def run_graph(build, feeds: dict, opset: int = 17, float_type=TensorProto.FLOAT) -> dict:
    """Build nodes with `build(b)` -> {key: tensor name}; run them in ORT on `feeds`."""
    b = GraphBuilder(opset, taken=feeds.keys(), float_type=float_type)
    outs = build(b)
    keys = list(outs)
    inputs = [value_info(k, NP_TO_ONNX[np.asarray(v).dtype], list(np.shape(v))) for k, v in feeds.items()]
    model = b.make_model("test", inputs, [helper.make_empty_tensor_value_info(outs[k]) for k in keys])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(keys, sess.run(None, {k: np.asarray(v) for k, v in feeds.items()})))


def spd(rng: np.random.Generator, n: int, cond: float = 100.0, batch: tuple = ()) -> np.ndarray:
    """Random SPD matrices [*batch, n, n] (float64) with eigenvalues log-spaced in [1/cond, 1]."""
    out = np.empty((*batch, n, n))
    s = np.logspace(-np.log10(cond), 0, n)
    for idx in np.ndindex(*batch):
        Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        out[idx] = (Q * s) @ Q.T
    return out


# ------------------------------------------------------------------------------ zoo plans and data
def zoo_plan(name: str, *, seed: int = 0, output: str | None = "logits", **build) -> kc.Plan:
    """Zoo model `name` (its builder's `build` options, initialized with `seed`) compiled
    with its loss, emit=False."""
    e = ZOO[name]
    return kc.compile(get_model(name, seed=seed, **build), loss=e.loss, output=output, emit=False)


def zoo_case(name: str, n: int | None, *, seed: int = 0, **build):
    """(plan, inputs dict, targets): zoo_plan(name, **build) and n of its examples (None: all),
    drawn with `seed`."""
    inputs, y = ZOO[name].make_data(n, seed=seed)
    return zoo_plan(name, seed=seed, **build), inputs, y


def train_rows(plan, inputs: Mapping, y: np.ndarray, rows: Sequence[int], optimizer: str = "kfac", **knobs):
    """(trainer, metrics per step without the timings) of consecutive batches of `rows` rows
    each (a smaller one as an epoch's last), batch size 32, seed 0."""
    from kfac_compiler.runtime import Trainer

    tr = Trainer(plan, optimizer=optimizer, batch_size=32, seed=0, **knobs)
    metrics, start = [], 0
    for n in rows:
        part = slice(start % len(y), start % len(y) + n)
        start += n
        m = tr.step({k: v[part] for k, v in inputs.items()}, y[part])
        metrics.append({k: v for k, v in m.items() if k not in ("step_time", "host_time")})
    return tr, metrics


def assert_same_run_bitwise(ref, ref_metrics: Sequence[dict], tr, metrics: Sequence[dict]) -> None:
    """Two trainers' parameters and every step's metrics (train_rows') equal bit for bit."""
    for p, value in ref.parameters().items():
        assert np.array_equal(tr.parameters()[p], value), p
    for k, (a, b) in enumerate(zip(ref_metrics, metrics, strict=True)):
        assert a.keys() == b.keys(), k
        for key in a:
            assert np.array_equal(a[key], b[key], equal_nan=True), (k, key, a[key], b[key])


def sampled_batch(x: np.ndarray, y: np.ndarray, seed, bs: int = 64) -> tuple[dict, np.ndarray]:
    """({"input": x[idx]}, y[idx]) for bs distinct rows drawn by default_rng(seed)."""
    idx = np.random.default_rng(seed).choice(len(y), bs, replace=False)
    return {"input": x[idx]}, y[idx]


def run_model(model: onnx.ModelProto, feeds: dict, output: str | None = None) -> np.ndarray:
    """The model's first output (or `output`) on `feeds`, ORT CPU."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([output] if output else None, feeds)[0]


# ------------------------------------------------------------------------------ processes
class Lines:
    """A child process's output lines, read by a thread: `next(timeout)` waits (bounded) for
    the next one, so that a test synchronizes on what the child says it has done instead of
    sleeping for long enough."""

    def __init__(self, stream) -> None:
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next(self, timeout: float = 60.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the process within {timeout:g} s") from None
        if line is None:
            raise AssertionError("the process closed its output")
        return line


def reference_loss(model: onnx.ModelProto, feeds: dict, values: dict | None = None) -> float:
    """The original graph on onnx.reference with the initializers `values` replaced."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if values and t.name in values:
            t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    return float(ReferenceEvaluator(m).run(None, feeds)[0])
