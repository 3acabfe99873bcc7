"""Parameters broadcast over the batch (layer kind "broadcast"): a position table added to
the activations ([1, T, D] or [T, D]), a table looked up with constant, batch-less indices and
then added (repeated, negative and unused rows), or with indices computed from the sequence
length (a position buffer sliced to it), a class token Expand-ed to [N, 1, D] and
concatenated. Truth, in float64 numpy, independent of the compiler: a numpy forward pass of
each tiny model, per-example loss gradients and per-example logit Jacobians with respect to the
parameter by central finite differences; the Fisher blocks are then brute-force sums of those.
Statistics come from the plan's `statistics` subgraph run in ONNX Runtime."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.backend import emit_subgraph
from kfac_compiler.losses import make_loss

T, D, C, ROWS = 4, 3, 3, 6
INDICES = np.array([3, 0, 3, -1])  # row 3 twice, row 5 as -1, rows 1, 2 and 4 never read
FORMS = {  # form -> (parameter, its shape, pattern)
    "add3": ("pos", (1, T, D), "broadcast_add"),
    "add2": ("pos", (T, D), "broadcast_add"),
    "gather": ("table", (ROWS, D), "broadcast_gather_add"),
    "gather_dyn": ("table", (ROWS, D), "broadcast_gather_add"),  # indices: the first T of a range
    "expand": ("cls", (1, 1, D), "broadcast_expand"),
}


def _batch_shape(out: str, x: str, tail: list[int]) -> tuple[list, list]:
    """Nodes (and their constants) computing `out` = [N, *tail] from x's batch size N (an
    Expand shape)."""
    return [
        helper.make_node("Shape", [x], ["x_shape"], name="shape"),
        helper.make_node("Slice", ["x_shape", "zero", "one"], ["n"], name="n"),
        helper.make_node("Concat", ["n", "tail"], [out], name="batch_shape", axis=0),
    ], [numpy_helper.from_array(np.array([0]), "zero"), numpy_helper.from_array(np.array([1]), "one"),
        numpy_helper.from_array(np.array(tail, np.int64), "tail")]


def _model(form: str, seed: int = 0):
    """x [N, T, D] -> y (the parameter broadcast in) -> Tanh -> Flatten -> Gemm -> logits."""
    rng = np.random.default_rng(seed)
    name, shape, _ = FORMS[form]
    params = {name: rng.normal(size=shape)}
    tokens = T + 1 if form == "expand" else T
    params["fc.weight"] = rng.normal(size=(C, tokens * D)) * 0.5
    params["fc.bias"] = rng.normal(size=C) * 0.1
    consts, nodes = [], []
    if form == "add3":
        nodes.append(helper.make_node("Add", ["x", "pos"], ["y"], name="add"))
    elif form == "add2":
        nodes.append(helper.make_node("Add", ["pos", "x"], ["y"], name="add"))
    elif form == "gather":
        consts.append(numpy_helper.from_array(INDICES.astype(np.int64), "idx"))
        nodes += [helper.make_node("Gather", ["table", "idx"], ["rows"], name="lookup", axis=0),
                  helper.make_node("Add", ["x", "rows"], ["y"], name="add")]
    elif form == "gather_dyn":  # TorchScript's positions: a buffer sliced to the sequence length
        consts += [numpy_helper.from_array(np.arange(ROWS, dtype=np.int64), "positions"),
                   numpy_helper.from_array(np.array([0]), "zero"), numpy_helper.from_array(np.array([1]), "one"),
                   numpy_helper.from_array(np.array([2]), "two")]
        nodes += [helper.make_node("Shape", ["x"], ["x_shape"], name="shape"),
                  helper.make_node("Slice", ["x_shape", "one", "two"], ["t"], name="t"),
                  helper.make_node("Slice", ["positions", "zero", "t"], ["idx"], name="idx"),
                  helper.make_node("Gather", ["table", "idx"], ["rows"], name="lookup", axis=0),
                  helper.make_node("Add", ["x", "rows"], ["y"], name="add")]
    else:
        extra, inits = _batch_shape("target", "x", [1, D])
        nodes += extra
        consts += inits
        nodes += [helper.make_node("Expand", ["cls", "target"], ["tok"], name="tok"),
                  helper.make_node("Concat", ["tok", "x"], ["y"], name="cat", axis=1)]
    nodes += [helper.make_node("Tanh", ["y"], ["h"], name="act"),
              helper.make_node("Flatten", ["h"], ["f"], name="flat", axis=1),
              helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1)]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in params.items()] + consts
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, D])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", C])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {n: v.astype(np.float32).astype(np.float64) for n, v in params.items()}


def _forward(form: str, params: dict, x: np.ndarray) -> np.ndarray:
    name = FORMS[form][0]
    p = params[name]
    if form in ("add3", "add2"):
        y = x + p
    elif form == "gather":
        y = x + p[INDICES]
    elif form == "gather_dyn":
        y = x + p[:T]
    else:
        y = np.concatenate([np.broadcast_to(p, (len(x), 1, D)), x], axis=1)
    f = np.tanh(y).reshape(len(x), -1)
    return f @ params["fc.weight"].T + params["fc.bias"]


def _jacobians(form: str, params: dict, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """[N, C, P]: d logits_n / d vec(parameter), central differences per example."""
    name = FORMS[form][0]
    theta = params[name]
    cols = []
    for i in range(theta.size):
        zs = []
        for sign in (1, -1):
            t = theta.copy().reshape(-1)
            t[i] += sign * eps
            zs.append(_forward(form, dict(params, **{name: t.reshape(theta.shape)}), x))
        cols.append((zs[0] - zs[1]) / (2 * eps))
    return np.stack(cols, axis=2)


def _per_example_grads(form: str, params: dict, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[N, P]: gradients of each example's cross-entropy loss, J_n^T dl/dz_n."""
    loss = make_loss("softmax_cross_entropy")
    dz = loss.np_grad(_forward(form, params, x), y)
    return np.einsum("ncp,nc->np", _jacobians(form, params, x), dz)


def _statistics(plan, x, y, mode):
    model, _ = emit_subgraph(plan, "statistics", mode=mode)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inits = {t.name: numpy_helper.to_array(t) for t in plan.model.graph.initializer}
    feeds = {"x": x.astype(np.float32), "targets": y, **{p: inits[p] for p in plan.trainable}}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _data(n: int = 5, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, T, D)).astype(np.float32).astype(np.float64)
    return x, rng.integers(0, C, size=n)


def _compile(form: str, approx: str, seed: int = 0):
    model, params = _model(form, seed)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False,
                      layers={FORMS[form][0]: approx})
    return plan, params


@pytest.mark.parametrize("form", list(FORMS))
def test_pattern_makes_a_broadcast_layer(form):
    name, shape, pattern = FORMS[form]
    model, _ = _model(form)
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    layer = plan.layer(name)
    assert (layer.kind, layer.pattern, layer.params, layer.approximation) == ("broadcast", pattern, (name,), "diagonal")
    assert [l.kind for l in plan.layers if l.kind == "generic"] == []
    assert plan.totals()["structured_elements"] == plan.totals()["param_elements"]


@pytest.mark.parametrize("approx", ["diagonal", "full"])
@pytest.mark.parametrize("form", list(FORMS))
def test_empirical_statistics_are_the_per_example_gradients_outer_products(form, approx):
    """Empirical mode: the block's statistic is 1/N sum_n g_n g_n^T (its diagonal) with g_n the
    example's own loss gradient, here by finite differences: exact per-example gradients
    (rows of the table never indexed: 0), not the sqrt(N) x batch-gradient stand-in."""
    plan, params = _compile(form, approx)
    x, y = _data()
    g = _per_example_grads(form, params, x, y)
    if form.startswith("gather"):  # the truth's unused rows
        assert not g.reshape(len(x), ROWS, D)[:, [1, 2, 4] if form == "gather" else [4, 5]].any()
    _assert_statistic(plan, form, approx, x, y, "empirical", g.T @ g / len(x))


@pytest.mark.parametrize("approx", ["diagonal", "full"])
@pytest.mark.parametrize("form", list(FORMS))
def test_exact_statistics_are_the_brute_force_fisher(form, approx):
    """Exact mode: F = 1/N sum_n J_n^T F_z(z_n) J_n (its diagonal), J_n by finite differences."""
    plan, params = _compile(form, approx, seed=2)
    x, y = _data(6, seed=3)
    loss = make_loss("softmax_cross_entropy")
    z, J = _forward(form, params, x), _jacobians(form, params, x)
    _assert_statistic(plan, form, approx, x, y, "exact",
                      sum(J[n].T @ loss.np_fisher(z[n]) @ J[n] for n in range(len(x))) / len(x))


def _assert_statistic(plan, form, approx, x, y, mode, fisher):
    """The plan's statistic of `form`'s parameter in `mode` is `fisher` (its diagonal for
    the diagonal block)."""
    stats = _statistics(plan, x, y, mode)
    name = FORMS[form][0]
    got = stats[f"stat/{name}/full"] if approx == "full" else stats[f"stat/{name}/diag"].reshape(-1)
    want = fisher if approx == "full" else np.diag(fisher)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("approx", ["diagonal", "full"])
def test_block_alone_emitted_and_numpy_against_scattered_gradients(approx):
    """The block alone (tests/test_blocks.py style), a Gather with batch-less indices, two uses
    (int64 [3] and int32 [1, 3] indices) and two seeds: emitted statistics in ORT and the numpy twin against sum over seeds of
    1/N sum_n g_n g_n^T, g_n = sum over uses of the use's cotangent summed over the batch-free
    axes (here axis 1 of [N, 2, K, D]) and added into the looked-up rows (np.add.at)."""
    from test_blocks import assert_close, emitted_stats, make_block, make_layer

    idx = [2, 2, -4]  # rows 1 and 3 unused; -4 is row 0
    layer = make_layer("broadcast", ("table",), 2, approx, scale_axes=(2, 3), output_rank=4, indexed=True)
    blk = make_block(layer, {"table": (4, D)})
    rng = np.random.default_rng(7)
    cots = [[rng.standard_normal((5, 2, 3, D)).astype(np.float32) for _ in range(2)] for _ in range(2)]
    want = 0.0
    for s in range(2):
        g = np.zeros((5, 4, D))
        for u in range(2):
            np.add.at(g, (slice(None), idx), np.asarray(cots[u][s], np.float64).sum(1))
        g = g.reshape(5, -1)
        want = want + g.T @ g / 5
    want = want if approx == "full" else np.diag(want)
    key = "full" if approx == "full" else "diag"
    inputs = [np.array(idx, np.int64), np.array(idx, np.int32).reshape(1, 3)]  # the uses' indices
    assert_close(emitted_stats(blk, inputs, cots)[key], want)
    assert_close(blk.numpy_statistics(inputs, cots)[key], want, 1e-6, 1e-6)


def test_a_parameter_added_to_no_data_stays_generic():
    """Add(P, constant): no batch to broadcast over (the data never reaches the Add), so no
    broadcast layer; nor a [N-sized] parameter that varies along axis 0."""
    model, _ = _model("add3")
    model.graph.node[0].input[0] = "offset"
    model.graph.node[0].output[0] = "y0"
    model.graph.node.insert(0, helper.make_node("Constant", [], ["offset"], name="offset",
                                                value=numpy_helper.from_array(np.ones((1, T, D), np.float32))))
    model.graph.node.insert(2, helper.make_node("Add", ["y0", "x"], ["y"], name="mix"))
    plan = kc.compile(model, loss="softmax_cross_entropy", output="logits", emit=False)
    assert plan.layer("pos").kind == "generic"
    batched, _ = _model("add3")
    batched.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((2, T, D), np.float32), "pos"))
    batched.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    plan = kc.compile(batched, loss="softmax_cross_entropy", output="logits", emit=False)
    assert plan.layer("pos").kind == "generic"
