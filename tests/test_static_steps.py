"""K-FAC's static_steps: one If-free step graph per step kind the schedule runs, with the
batch's shapes fixed, gives the If form's trajectory bit for bit; and capture_blockers
(runtime/capture.py) finds what would stop CUDA graph capture, naming the node."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kfac_compiler as kc
from helpers import assert_same_run_bitwise, onnx_model, train_rows, zoo_case
from kfac_compiler.builder import subgraphs
from kfac_compiler.errors import ConfigError, DataError
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.capture import capture_blockers
from kfac_compiler.runtime.static_shapes import with_static_dims
from kfac_compiler.runtime.subgraphs import resolved_request, subgraph

SCHEDULE = dict(cov_update_period=2, damping_adaptation_interval=3)  # every (stats, loss_after) pair by step 5
ROWS = (32, 32, 16, 32, 32, 16, 32)  # the third and sixth batches partial, as an epoch's last


def _train(plan, inputs, y, static: bool, rows=ROWS, **knobs):
    return train_rows(plan, inputs, y, rows, static_steps=static, **SCHEDULE, **knobs)


def _spins(prog) -> bool:
    """Whether a program's intra-op workers spin after a run (ONNX Runtime's default)."""
    try:
        entry = prog.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
    except RuntimeError:  # not set: the default, spinning
        return True
    return entry != "0"


def _ops(model: onnx.ModelProto) -> list[str]:
    out = []

    def walk(g):
        for node in g.node:
            out.append(node.op_type)
            for s in subgraphs(node):
                walk(s)

    walk(model.graph)
    return out


@pytest.mark.parametrize("name", ["mlp_classifier", pytest.param("small_cnn", marks=pytest.mark.slow)])
def test_static_steps_follow_the_if_form_bit_for_bit(name):
    plan, inputs, y = zoo_case(name, 80)
    ref, ref_metrics = _train(plan, inputs, y, static=False)
    tr, metrics = _train(plan, inputs, y, static=True)
    # the schedule used every kind: statistics on even steps, the loss after on steps 0, 3, 6
    assert [m["stats"] for m in metrics] == [1, 0, 1, 0, 1, 0, 1]
    assert [np.isfinite(m["rho"]) for m in metrics] == [True, False, False, True, False, False, True]
    assert_same_run_bitwise(ref, ref_metrics, tr, metrics)
    ref_state, state = ref.state(), tr.state()
    assert set(ref_state) == set(state)
    for slot, value in ref_state.items():
        assert np.array_equal(state[slot], value, equal_nan=True), slot
    # the If form: one step session with Ifs; static: a session per kind and batch shape the
    # run used (the 16-row batches: steps 2 and 5, statistics without and neither), none with an If
    ref_steps = [label for label in ref.programs() if label.startswith("kfac_step")]
    steps = {(p.info.options["with_stats"], p.info.options["loss_after"], dict(key[1])["targets"][0])
             for key, p in tr._programs.items() if p.name == "kfac_step"}
    assert len(ref_steps) == 1
    assert steps == {(s, a, 32) for s in (False, True) for a in (False, True)} | {(True, False, 16), (False, False, 16)}
    for key, prog in tr._programs.items():
        if prog.name == "kfac_step":
            model, _, _ = subgraph(plan, key[0])
            assert "If" not in _ops(model), key
    (key,) = [k for k, p in ref._programs.items() if p.name == "kfac_step"]
    assert _ops(subgraph(plan, key)[0]).count("If") == 2
    # the kinds take turns, so none of their pools spins after a run (the If form's one does)
    assert not any(_spins(p) for p in tr._programs.values() if p.name == "kfac_step")
    assert _spins(ref._programs[key])


def test_static_steps_with_gradient_accumulation_follow_the_if_form_bit_for_bit():
    """The cycle's last micro-batch runs the step kinds, the others `accumulate` (whose own
    statistics If goes with stats_conditional, as in a data-parallel run)."""
    plan, inputs, y = zoo_case("mlp_classifier", 80)
    ref, ref_metrics = _train(plan, inputs, y, static=False, rows=(32,) * 12, accumulate=2)
    tr, metrics = _train(plan, inputs, y, static=True, rows=(32,) * 12, accumulate=2)
    assert sum(np.isfinite(m.get("rho", np.nan)) for m in metrics) == 2  # cycles 0 and 3 adapt
    assert_same_run_bitwise(ref, ref_metrics, tr, metrics)


def _step_graph(plan, **options):
    tr = Trainer(plan, optimizer="kfac", batch_size=32, sessions=False, **SCHEDULE, **options)
    return tr, lambda **kind: subgraph(plan, resolved_request(
        plan, "cpu", "kfac_step", **{k: v for k, v in tr.policy.step_options(**kind).to_json().items()
                                     if v is not None}))[0]


def _transformer(tied: str):
    e = ZOO["transformer_block"]
    plan = kc.compile(get_model("transformer_block", seed=0), loss=e.loss, output="logits", emit=False,
                      config={"approximations": {"tied_embedding": tied}})
    inputs, y = e.make_data(32, seed=0)
    return plan, inputs, y


def _cases():
    for name in ("mlp_classifier", "small_cnn"):
        plan, inputs, y = zoo_case(name, 32)
        yield name, plan, inputs, y
    yield ("transformer_block[kron_tied]", *_transformer("kron_tied"))


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_static_step_kinds_have_no_capture_blockers_and_the_if_form_reports_its_ifs(case):
    _, plan, inputs, y = case
    shapes = {"targets": y.shape, **{k: v.shape for k, v in inputs.items()}}
    _, graph = _step_graph(plan, static_steps=True)
    for first in (False, True):
        for adapt in (False, True):
            assert capture_blockers(graph(first=first, adapt=adapt), shapes) == [], (first, adapt)
    _, graph = _step_graph(plan)
    model = graph()
    ifs = {n.name for n in model.graph.node if n.op_type == "If"}
    assert len(ifs) == 2
    blockers = capture_blockers(model, shapes)
    flagged = {b.split("'")[1] for b in blockers if "control flow" in b}
    assert flagged == ifs, blockers
    # without the batch's shapes the If-free graph still takes any batch: its inputs are reported
    static_free = capture_blockers(_step_graph(plan, static_steps=True)[1]())
    assert any(b.startswith("input 'targets': shape [N") for b in static_free), static_free


def test_the_tied_diagonal_statistics_loop_is_reported():
    """A real blocker the check found: the tied embedding's diagonal statistics run in a Loop
    over chunks of the batch (blocks/tied.py), so its statistics steps cannot be captured."""
    plan, inputs, y = _transformer("diagonal")
    shapes = {"targets": y.shape, **{k: v.shape for k, v in inputs.items()}}
    _, graph = _step_graph(plan, static_steps=True)
    blockers = capture_blockers(graph(adapt=False), shapes)
    loops = [n.name for n in graph(adapt=False).graph.node if n.op_type == "Loop"]
    assert len(loops) == 1
    assert f"node {loops[0]!r} (Loop): control flow (its branch or trip count is chosen at run time)" in blockers
    assert capture_blockers(graph(first=True, adapt=False), shapes) == []  # the kinds without statistics


def _dynamic_reshape() -> onnx.ModelProto:
    """y = Reshape(x, Concat(Shape(x)[0], shape_tail)): a batch-size reshape, and one whose
    tail comes from a graph input (data the host cannot know when the session is made)."""
    nodes = [helper.make_node("Shape", ["x"], ["n"], name="shape_x", end=1),
             helper.make_node("Concat", ["n", "tail"], ["shape"], name="cat", axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape_y")]
    tail = helper.make_tensor_value_info("tail", TensorProto.INT64, [1])
    return onnx_model(nodes, {"x": ["N", 6], "tail": tail}, {}, outputs=["y"])


def test_a_reshape_by_a_computed_shape_is_reported_by_name():
    blockers = capture_blockers(_dynamic_reshape())
    assert "node 'reshape_y' (Reshape): input 1 'shape' is read on the host but computed at run time" in blockers
    assert any(b.startswith("node 'shape_x' (Shape): the shape of 'x' is not static") for b in blockers), blockers
    assert "input 'x': shape [N, 6] is not static" in blockers
    # with x static the Shape folds, but the tail is still data
    blockers = capture_blockers(_dynamic_reshape(), {"x": (4, 6)})
    assert blockers == ["node 'reshape_y' (Reshape): input 1 'shape' is read on the host but computed at run time",
                        "node 'reshape_y' (Reshape): output 'y' has no static shape ([4, unk__0])"], blockers


def test_a_constant_reshape_of_a_static_batch_folds():
    m = _dynamic_reshape()
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([3, 2], np.int64), "tail2"))
    m.graph.node[1].input[1] = "tail2"
    assert capture_blockers(m, {"x": (4, 6)}) == []
    assert "node 'reshape_y' (Reshape): input 1 'shape' is read on the host but computed at run time" \
        in capture_blockers(m)


def test_static_dims_bind_every_input_and_refuse_a_mismatch():
    m = onnx_model([helper.make_node("Add", ["a", "b"], ["y"])], {"a": ["N", 3], "b": ["N", 3]}, {},
                   out_shape=["N", 3])
    fixed = with_static_dims(m, {"a": (5, 3)})
    dims = [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in [*fixed.graph.input, *fixed.graph.output]]
    assert dims == [[5, 3], [5, 3], [5, 3]]
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"  # a copy
    with pytest.raises(ValueError, match="input 'b' of graph 't' takes dim 3, but the batch's array is shaped"):
        with_static_dims(m, {"b": (5, 4)})
    with pytest.raises(ValueError, match="dim 'N' of graph 't' is 5 elsewhere but 6 in input 'b'"):
        with_static_dims(m, {"a": (5, 3), "b": (6, 3)})


def test_static_steps_is_a_checked_knob():
    plan, _, _ = zoo_case("mlp_classifier", 8)
    with pytest.raises(ConfigError, match="static_steps"):
        Trainer(plan, optimizer="kfac", static_steps="yes")


def test_static_dims_fold_the_size_of_a_static_tensor():
    """ONNX Runtime folds a Shape of a static tensor but not a Size: the static path makes it
    a constant (a mean's divisor), with the same value."""
    import onnxruntime as ort

    nodes = [helper.make_node("Size", ["x"], ["n"], name="size_x"),
             helper.make_node("Cast", ["n"], ["nf"], name="cast_n", to=TensorProto.FLOAT),
             helper.make_node("Div", ["x", "nf"], ["y"], name="div")]
    m = onnx_model(nodes, {"x": ["N", 3]}, {}, outputs=["y"], out_shape=["N", 3])
    assert "node 'size_x' (Size): ONNX Runtime does not fold Size: it runs on the host on every run" \
        in capture_blockers(m, {})
    fixed = with_static_dims(m, {"x": (4, 3)})
    assert [n.op_type for n in fixed.graph.node] == ["Constant", "Cast", "Div"]
    assert capture_blockers(fixed) == []
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    (y,) = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.array_equal(y, x / np.float32(12))


def test_a_batch_the_static_graph_cannot_take_is_one_line_naming_the_input():
    plan, inputs, y = zoo_case("mlp_classifier", 8)
    tr = Trainer(plan, optimizer="kfac", static_steps=True)
    shapes = tr.batch_shapes({"input": inputs["input"], "targets": y[:, None]})
    with pytest.raises(DataError, match=r"^subgraph 'kfac_step': input 'targets' has rank 1 in graph .*, but the "
                                        r"batch's array is shaped \[8, 1\]$"):
        tr.program("kfac_step", shapes=shapes, options=tr.policy.step_options())
