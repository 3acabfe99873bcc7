"""Multi-tensor first-order updates (kfac_compiler/optimizers/multi_tensor.py): SGD's and Adam's
update emitted once over every parameter's concatenation equals the per-parameter update and a
numpy reference on the loss graph's gradients, keeps the per-parameter state slots
(checkpoints move between the layouts), and adds a constant number of compute nodes to the
forward+backward however many parameters the model has."""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from helpers import sampled_batch as batch
from helpers import zoo_case, zoo_plan
from kfac_compiler import contract as C
from kfac_compiler.backend.service import emit_for
from kfac_compiler.builder import subgraphs
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import make_config
from kfac_compiler.optimizers.multi_tensor import concat_groups, join_flat, split_flat
from kfac_compiler.requests import MULTI_TENSOR_DEFAULT, Settings, request
from kfac_compiler.runtime import Trainer, gradients
from kfac_compiler.runtime.checkpoint import read_meta, stored_state
from kfac_compiler.runtime.subgraphs import resolved_request

STEPS = 4
KNOBS = {"sgd": dict(learning_rate=0.05, momentum=0.9, l2_reg=1e-3), "adam": dict(learning_rate=3e-3, l2_reg=1e-3)}


@pytest.fixture(scope="module")
def cnn():
    """A conv net (4-D, 2-D and 1-D parameters): plan, images, labels."""
    plan, inputs, y = zoo_case("small_cnn", 256)
    return plan, inputs["input"], y


def numpy_steps(opt: str, plan, inputs, y, theta: dict, steps: int) -> tuple[dict, dict, list]:
    """`steps` updates of `opt` in float64 numpy on the loss graph's gradients (runtime.gradients
    at the current weights): (parameters, state slots, [(update_norm, grad_norm)])."""
    cfg = make_config(opt, plan, **KNOBS[opt])
    theta = {p: v.astype(np.float64) for p, v in theta.items()}
    state = {}
    norms = []
    for k in range(steps):
        xb, yb = batch(inputs, y, k)
        _, raw = gradients(plan, xb, yb, params={p: v.astype(np.float32) for p, v in theta.items()})
        g = {p: raw[p].astype(np.float64) + cfg.l2_reg * theta[p] for p in theta}
        if opt == "sgd":
            upd = {p: cfg.momentum * state.get(C.velocity(p), 0.0) - cfg.learning_rate * g[p] for p in theta}
            state.update({C.velocity(p): upd[p] for p in theta})
        else:
            lr = cfg.lr_at(k + 1, k)
            m = {p: cfg.beta1 * state.get(C.adam_m(p), 0.0) + (1 - cfg.beta1) * g[p] for p in theta}
            v = {p: cfg.beta2 * state.get(C.adam_v(p), 0.0) + (1 - cfg.beta2) * g[p] ** 2 for p in theta}
            upd = {p: -lr * m[p] / (np.sqrt(v[p]) + cfg.epsilon) for p in theta}
            state.update({C.adam_m(p): m[p] for p in theta} | {C.adam_v(p): v[p] for p in theta})
        theta = {p: theta[p] + upd[p] for p in theta}
        norms.append((math.sqrt(sum(float(np.sum(u * u)) for u in upd.values())),
                      math.sqrt(sum(float(np.sum(r.astype(np.float64) ** 2)) for r in raw.values()))))
    return theta, state, norms


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_multi_tensor_step_equals_per_parameter_step_and_numpy(cnn, opt):
    plan, inputs, y = cnn
    runs = {}
    for multi in (False, True):
        tr = Trainer(plan, optimizer=opt, seed=0, multi_tensor=multi, **KNOBS[opt])
        (req,) = [r for r in tr.requests() if r.name == f"{opt}_step"]
        assert req.options.multi_tensor is multi
        metrics = [tr.step(*batch(inputs, y, k)) for k in range(STEPS)]
        kinds = (C.VELOCITY,) if opt == "sgd" else (C.ADAM_M, C.ADAM_V)
        assert all((C.flat(kind) in tr.store) is multi for kind in kinds)  # one flat slot per kind
        runs[multi] = (tr.parameters(), stored_state(tr), metrics)
    (_, s0, m0), (p1, s1, m1) = runs[False], runs[True]
    assert set(s0) == set(s1)  # the same per-parameter slots, as a checkpoint stores them
    for name in s0:  # the same elementwise arithmetic in both layouts
        np.testing.assert_allclose(s1[name], s0[name], rtol=1e-6, atol=1e-7, err_msg=name)
    for a, b in zip(m0, m1):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["update_norm"] == pytest.approx(a["update_norm"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    theta, state, norms = numpy_steps(opt, plan, inputs, y, plan.parameter_values(), STEPS)
    for p in theta:
        np.testing.assert_allclose(p1[p], theta[p], rtol=1e-4, atol=1e-6, err_msg=p)
    for name, ref in state.items():
        np.testing.assert_allclose(s1[name], ref, rtol=1e-3, atol=1e-7, err_msg=name)
    for m, (update_norm, grad_norm) in zip(m1, norms):
        assert m["update_norm"] == pytest.approx(update_norm, rel=1e-4)
        assert m["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("saved_multi", [False, True])
def test_checkpoints_move_between_the_layouts(cnn, tmp_path, opt, saved_multi):
    """A checkpoint stores a flat slot as its per-parameter slots: either layout resumes it."""
    plan, inputs, y = cnn
    steady = Trainer(plan, optimizer=opt, seed=0, multi_tensor=saved_multi, **KNOBS[opt])
    for k in range(2):
        steady.step(*batch(inputs, y, k))
    path = steady.save_checkpoint(tmp_path / "c.npz")
    assert not any(s.endswith("/" + C.FLAT) for s in read_meta(path)["slots"])
    resumed = Trainer(plan, optimizer=opt, seed=0, multi_tensor=not saved_multi, **KNOBS[opt]).restore(path)
    again = Trainer(plan, optimizer=opt, seed=0, multi_tensor=saved_multi, **KNOBS[opt]).restore(path)
    assert set(resumed.state()) == set(Trainer(plan, optimizer=opt, multi_tensor=not saved_multi).state())
    for k in range(2, 4):
        a, b, c = (tr.step(*batch(inputs, y, k)) for tr in (steady, resumed, again))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and c["loss"] == a["loss"]
    for name, value in stored_state(steady).items():
        np.testing.assert_allclose(stored_state(resumed)[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_array_equal(stored_state(again)[name], value, err_msg=name)


def test_flat_slots_split_and_join_in_the_concatenation_order(rng):
    shapes = {"w1": (4, 3), "b1": (4,), "w2": (2, 3), "s": (), "b2": (2,), "k": (2, 1, 3, 3)}
    assert concat_groups(shapes) == [["w1", "w2"], ["b1", "b2"], ["s"], ["k"]]
    values = {p: rng.standard_normal(shape).astype(np.float32) for p, shape in shapes.items()}
    flat = join_flat(values, shapes)
    assert flat.shape == (12 + 4 + 6 + 1 + 2 + 18,)
    np.testing.assert_array_equal(flat[:12], values["w1"].ravel())  # the groups' order
    np.testing.assert_array_equal(flat[12:18], values["w2"].ravel())
    back = split_flat(flat, shapes)
    assert list(back) == list(shapes)
    for p in shapes:
        np.testing.assert_array_equal(back[p], values[p])
    with pytest.raises(ValueError, match="w2"):
        join_flat({**values, "w2": values["w1"]}, shapes)
    with pytest.raises(ValueError):
        split_flat(flat[:-1], shapes)
    assert C.flat_kind(C.flat(C.ADAM_M)) == "adam_m" and C.flat_kind("my/own/*") == "my/own"
    assert C.flat_kind(C.adam_m("w")) is None and C.flat_kind("/*") is None


def op_counts(plan, name: str, **options) -> collections.Counter:
    model, _ = emit_for(plan, resolved_request(plan, "cpu", name, **options))
    counts: collections.Counter = collections.Counter()

    def walk(graph):
        for node in graph.node:
            counts[node.op_type] += 1
            for g in subgraphs(node):
                walk(g)

    walk(model.graph)
    return counts


# what a multi-tensor step may add per parameter: a Reshape to 1-D of the parameter and its
# gradient (ONNX Runtime runs it as an alias; the optimizer state is flat already) and the
# Identity marking each gradient's reduction point (ONNX Runtime removes those; one more: the
# loss metric's)
PER_PARAMETER = ("Reshape", "Identity")


@pytest.mark.parametrize("model", ["mlp_classifier", "transformer_block"])
@pytest.mark.parametrize("opt, bound", [("sgd", 16), ("adam", 24)])
def test_multi_tensor_step_adds_a_constant_number_of_compute_nodes(model, opt, bound):
    """Besides those, a Split per group of parameters of one trailing shape (the new
    parameters split into their shapes)."""
    plan = zoo_plan(model)
    values = plan.parameter_values()
    n, groups = len(values), len({v.shape[1:] if v.ndim else ("scalar", p) for p, v in values.items()})
    assert groups < n
    base = op_counts(plan, C.GRADIENTS)
    for l2 in (False, True):
        step = op_counts(plan, f"{opt}_step", l2=l2, multi_tensor=True)
        extra = step - base
        compute = sum(v for k, v in extra.items() if k not in PER_PARAMETER)
        assert compute <= bound + groups + 2 * l2, (model, opt, extra)
        assert extra["Split"] <= groups + 1
        assert extra["Concat"] == 2  # the parameters and the gradients
        assert extra["Reshape"] <= 2 * n + groups
        assert extra["Identity"] <= n + 2
        per = op_counts(plan, f"{opt}_step", l2=l2, multi_tensor=False)
        assert sum(per.values()) - sum(base.values()) > (3 if opt == "sgd" else 9) * n  # the chains it replaces


def test_multi_tensor_resolves_by_device_and_the_knob_forces_it(cnn):
    plan, _, _ = cnn
    for device in ("cpu", "cuda"):
        req = request("adam_step").resolve(Settings.of(plan, device))
        assert req.options.multi_tensor is MULTI_TENSOR_DEFAULT[device]
        assert "multi_tensor=" in req.key()
    # off on both: on an H200 the uncaptured Concat of ResNet-18's parameters and its Splits
    # took 338 of the Adam step's 340 ms (kfac_compiler/requests.py)
    assert MULTI_TENSOR_DEFAULT == {"cpu": False, "cuda": False}
    forced = request("sgd_step", multi_tensor=True).resolve(Settings.of(plan, "cuda"))
    assert forced.options.multi_tensor is True
    assert make_config("sgd", plan, multi_tensor=False).multi_tensor is False
    assert make_config("adam", plan).multi_tensor is None  # the device's default
    assert make_config("adam", plan).parse_option("multi_tensor", "no") == ("multi_tensor", False)
    with pytest.raises(ConfigError, match="multi_tensor"):
        make_config("adam", plan, multi_tensor="maybe")
    assert make_config("kfac", plan, multi_tensor=True).multi_tensor is True  # tests/test_kfac_multi_tensor.py
    with pytest.raises(ConfigError, match="multi_tensor"):
        make_config("kfac", plan, multi_tensor="maybe")
