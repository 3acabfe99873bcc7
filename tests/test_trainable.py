"""Parameters vs constants (passes/trainable.py) and shared parameters (passes/untie.py)."""
from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from helpers import randn
from kfac_compiler.cli import main
from kfac_compiler.errors import ConfigError
from kfac_compiler.report import render
from kfac_compiler.runtime import Trainer


def model(nodes, inits, x_shape=("N", 4), y_shape=("N", 3), opset=17):
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def exported_like(rng) -> onnx.ModelProto:
    """What exporters write: a ReLU6 Clip with lifted bounds, a Pow exponent, an attention-style
    scale, a -inf mask fill, a float mask reaching only a Where condition, a 1x1 weight, a PRelu
    scalar slope and a one-unit bias, which must stay parameters."""
    nodes = [
        helper.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["a"], transB=1),
        helper.make_node("Clip", ["a", "zero", "six"], ["b"]),
        helper.make_node("Pow", ["b", "three"], ["c"]),
        helper.make_node("Div", ["c", "scale"], ["d"]),
        helper.make_node("Add", ["d", "fill"], ["e"]),
        helper.make_node("Cast", ["mask"], ["mask_b"], to=TensorProto.BOOL),
        helper.make_node("Where", ["mask_b", "e", "b"], ["f"]),
        helper.make_node("PRelu", ["f", "slope"], ["g"]),
        helper.make_node("MatMul", ["g", "head.weight"], ["h"]),
        helper.make_node("Add", ["h", "head.bias"], ["i"]),
        helper.make_node("MatMul", ["i", "one.weight"], ["y"]),
    ]
    inits = {"fc.weight": randn(rng, 3, 4), "fc.bias": randn(rng, 3), "zero": np.array(0, np.float32),
             "six": np.array(6, np.float32),
             "three": np.array(3, np.float32), "scale": np.array(8 ** 0.5, np.float32),
             "fill": np.array([0, -np.inf, 0], np.float32), "mask": np.array([1, 0, 1], np.float32),
             "slope": randn(rng, 1), "head.weight": randn(rng, 3, 1), "head.bias": randn(rng, 1),
             "one.weight": randn(rng, 1, 1)}
    return model(nodes, inits, y_shape=("N", 1))


EXPECTED_FROZEN = {
    "zero": "Clip", "six": "Clip", "three": "Pow", "scale": "single value", "fill": "non-finite", "mask": "Cast",
}


def test_constants_rule_freezes_lifted_literals_and_masks(rng):
    plan = kc.compile(exported_like(rng), loss="squared_error", emit=False)
    assert plan.trainable == ["fc.weight", "fc.bias", "slope", "head.weight", "head.bias", "one.weight"]
    assert sorted(plan.frozen) == sorted(EXPECTED_FROZEN)
    for name, why in EXPECTED_FROZEN.items():
        assert why in plan.frozen_reasons[name], (name, plan.frozen_reasons[name])
    assert "input 1 (min)" in plan.frozen_reasons["zero"] and "input 1 (Y)" in plan.frozen_reasons["three"]


def test_frozen_reasons_in_every_format_and_plan_json(tmp_path, rng):
    plan = kc.compile(exported_like(rng), loss="squared_error", emit=False)
    table, dot = render(plan, "table"), render(plan, "dot")
    summary = json.loads(render(plan, "json"))
    assert {f["name"]: f["reason"] for f in summary["frozen"]} == plan.frozen_reasons
    for name, reason in plan.frozen_reasons.items():
        assert f"{name}  " in table and reason in table
        assert f"{name}: {reason}".replace('"', "'") in dot
    plan.save(tmp_path / "p")
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert doc["frozen_reasons"] == plan.frozen_reasons
    assert kc.load_plan(tmp_path / "p").frozen_reasons == plan.frozen_reasons


def test_train_overrides_the_rule_and_exclude_wins(rng):
    plan = kc.compile(exported_like(rng), loss="squared_error", emit=False, train=["three", "s.*"], exclude=["six"])
    assert "three" in plan.trainable and "scale" in plan.trainable and "six" in plan.frozen
    assert plan.frozen_reasons["six"] == "excluded by config (exclude 'six')"
    with pytest.raises(ConfigError, match="train: 'nope' matches no float initializer"):
        kc.compile(exported_like(rng), loss="squared_error", emit=False, train=["nope"])


def test_constants_do_not_move_in_training(rng):
    plan = kc.compile(exported_like(rng), loss="squared_error")
    x = randn(rng, 16, 4)
    trainer = Trainer(plan, optimizer="kfac", learning_rate=0.1)
    for _ in range(3):
        trainer.step({"x": x}, targets=randn(rng, 16, 1))
    exported = {t.name: numpy_helper.to_array(t) for t in trainer.exported_model().graph.initializer}
    assert exported["zero"] == 0 and exported["six"] == 6 and exported["three"] == 3
    assert not np.allclose(exported["fc.weight"], numpy_helper.to_array(plan.model.graph.initializer[0]))


# ------------------------------------------------------ GroupNorm's placeholders (rule 5)
def group_norm_like(rng, groups: int = 1, reshaped: bool = True, scale=None, shift=None) -> onnx.ModelProto:
    """torch.export's GroupNorm(groups, 4): InstanceNormalization over x reshaped to [N, groups,
    -1] with a placeholder scale of ones and shift of zeros (`groups` elements each), reshaped
    back, then the GroupNorm's weight and bias as Mul/Add; mean over the spatial axes and a head.
    reshaped=False: an InstanceNorm2d(4, affine=True) at its initialisation (ones and zeros,
    a parameter)."""
    c = 4 if not reshaped else groups
    scale = np.ones(c, np.float32) if scale is None else scale
    shift = np.zeros(c, np.float32) if shift is None else shift
    inits = {"gn.in_scale": scale, "gn.in_shift": shift, "gn.weight": randn(rng, 4, 1, 1),
             "gn.bias": randn(rng, 4, 1, 1), "head.weight": randn(rng, 4, 3), "grouped": np.array([0, groups, -1]),
             "spatial": np.array([2, 3])}
    if reshaped:
        nodes = [helper.make_node("Reshape", ["x", "grouped"], ["xg"], name="gn/Reshape"),
                 helper.make_node("InstanceNormalization", ["xg", "gn.in_scale", "gn.in_shift"], ["ng"], name="gn/in"),
                 helper.make_node("Shape", ["x"], ["xs"], name="gn/Shape"),
                 helper.make_node("Reshape", ["ng", "xs"], ["n"], name="gn/Reshape_back")]
    else:
        nodes = [helper.make_node("InstanceNormalization", ["x", "gn.in_scale", "gn.in_shift"], ["n"], name="gn/in")]
    nodes += [helper.make_node("Mul", ["n", "gn.weight"], ["s"], name="gn/Mul"),
              helper.make_node("Add", ["s", "gn.bias"], ["a"], name="gn/Add"),
              helper.make_node("ReduceMean", ["a", "spatial"], ["p"], keepdims=0, name="pool"),
              helper.make_node("MatMul", ["p", "head.weight"], ["y"], name="head")]
    return model(nodes, inits, x_shape=("N", 4, 3, 3), opset=18)


@pytest.mark.parametrize("groups", [1, 2])
def test_group_norm_placeholders_are_frozen_with_their_reason(rng, groups):
    plan = kc.compile(group_norm_like(rng, groups), loss="squared_error", emit=False)
    assert plan.trainable == ["gn.weight", "gn.bias", "head.weight"]
    assert plan.frozen_reasons == {
        "gn.in_scale": "constant: the unit scale of InstanceNormalization 'gn/in' between Reshapes (an exporter's "
                       "GroupNorm; its own weight and bias follow as Mul/Add)",
        "gn.in_shift": "constant: the zero shift of InstanceNormalization 'gn/in' between Reshapes (an exporter's "
                       "GroupNorm; its own weight and bias follow as Mul/Add)"}
    assert [(layer.kind, layer.params) for layer in plan.layers] == [
        ("scale_and_shift", ("gn.weight", "gn.bias")), ("fully_connected", ("head.weight",))]
    table = render(plan, "table")
    assert "gn.in_scale  constant: the unit scale of InstanceNormalization 'gn/in' between Reshapes" in table
    forced = kc.compile(group_norm_like(rng, groups), loss="squared_error", emit=False, train=["gn.in_.*"])
    assert forced.trainable == ["gn.in_scale", "gn.in_shift", "gn.weight", "gn.bias", "head.weight"]


@pytest.mark.parametrize("case", ["instance_norm", "trained_scale", "trained_shift"])
def test_instance_norms_that_are_not_group_norm_placeholders_stay_parameters(rng, case):
    """A real InstanceNorm2d at its initialisation (ones and zeros, no reshapes around it), and a
    GroupNorm decomposition whose scale or shift is not ones / zeros (trained: it means something)."""
    kw = {"instance_norm": {"reshaped": False}, "trained_scale": {"scale": np.array([1.0, 1.5], np.float32)},
          "trained_shift": {"shift": np.array([0.0, 0.25], np.float32)}}[case]
    plan = kc.compile(group_norm_like(rng, 2, **kw), loss="squared_error", emit=False)
    assert plan.trainable == ["gn.in_scale", "gn.in_shift", "gn.weight", "gn.bias", "head.weight"]
    assert plan.frozen == []


def group_norm_per_channel(rng, reshape: bool = True, affine: bool = True) -> onnx.ModelProto:
    """torch.export's optimized GroupNorm(4, 4) on [N, 4, T] (Wav2Vec2's feature extractor): x
    reshaped to [N, 4, -1], InstanceNormalization(ones, zeros), and no reshape back (a no-op
    the optimizer drops): the GroupNorm's [4, 1] weight and bias follow as Mul/Add.
    reshape=False: an InstanceNorm1d(4, affine=True) at its initialisation, then a per-channel
    affine; affine=False: after the InstanceNorm a Relu, no affine."""
    inits = {"gn.in_scale": np.ones(4, np.float32), "gn.in_shift": np.zeros(4, np.float32),
             "gn.weight": randn(rng, 4, 1), "gn.bias": randn(rng, 4, 1), "head.weight": randn(rng, 4, 3),
             "grouped": np.array([0, 4, -1]), "time": np.array([2])}
    nodes = [helper.make_node("Reshape", ["x", "grouped"], ["xg"], name="gn/Reshape")] if reshape else []
    nodes += [helper.make_node("InstanceNormalization", ["xg" if reshape else "x", "gn.in_scale", "gn.in_shift"], ["n"],
                               name="gn/in")]
    if affine:
        nodes += [helper.make_node("Mul", ["n", "gn.weight"], ["s"], name="gn/Mul"),
                  helper.make_node("Add", ["s", "gn.bias"], ["a"], name="gn/Add")]
    else:
        nodes += [helper.make_node("Relu", ["n"], ["a"], name="relu")]
    nodes += [helper.make_node("ReduceMean", ["a", "time"], ["p"], keepdims=0, name="pool"),
              helper.make_node("MatMul", ["p", "head.weight"], ["y"], name="head")]
    return model(nodes, inits, x_shape=("N", 4, 5), opset=18)


def test_group_norm_placeholders_without_the_reshape_back_are_frozen(rng):
    """GroupNorm(C, C): a Reshape before the InstanceNormalization and the GroupNorm's own
    per-channel Mul/Add after it tell the placeholders from a real InstanceNorm (which reads the
    activations themselves); tests/fixtures/real/wav2vec2-dynamo checks it on torch's export."""
    plan = kc.compile(group_norm_per_channel(rng), loss="squared_error", emit=False)
    assert plan.trainable == ["gn.weight", "gn.bias", "head.weight"]
    assert plan.frozen_reasons["gn.in_scale"] == (
        "constant: the unit scale of InstanceNormalization 'gn/in' after a Reshape, before a per-channel Mul/Add "
        "(an exporter's GroupNorm; its own weight and bias follow as Mul/Add)")
    assert [(layer.kind, layer.params) for layer in plan.layers] == [
        ("scale_and_shift", ("gn.weight", "gn.bias")), ("fully_connected", ("head.weight",))]


@pytest.mark.parametrize("kw", [{"reshape": False}, {"affine": False}], ids=["no_reshape", "no_affine"])
def test_an_instance_norm_without_both_signs_of_a_group_norm_stays_a_parameter(rng, kw):
    plan = kc.compile(group_norm_per_channel(rng, **kw), loss="squared_error", emit=False)
    assert {"gn.in_scale", "gn.in_shift"} <= set(plan.trainable)


# ------------------------------------------------- outer-scope reads of If/Loop/Scan bodies
def branching(rng) -> onnx.ModelProto:
    """h = x W0; y = If(cond) {h W1} else {h W1}; logits = y Wb: both branches read `h` and
    `W1` from the enclosing graph, as exported control flow does."""
    body = helper.make_graph([helper.make_node("MatMul", ["h", "W1"], ["t"], name="inner")], "body", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["h"], name="pre"),
             helper.make_node("If", ["cond"], ["b"], then_branch=body, else_branch=body, name="branch"),
             helper.make_node("MatMul", ["b", "Wb"], ["y"], name="head")]
    inits = {"W0": randn(rng, 4, 4), "W1": randn(rng, 4, 3), "Wb": randn(rng, 3, 3), "cond": np.array(True)}
    return model(nodes, inits)


@pytest.mark.parametrize("exclude,want", [
    ([], "node 'branch' (If) reads 'W1' inside its else_branch from the enclosing graph, and 'W1' is a trainable "
         "parameter: gradients do not flow into If/Loop/Scan bodies; freeze 'W1' (exclude = ['W1'], CLI --exclude W1) "
         "or export the model without control flow"),
    (["W1"], "node 'branch' (If) reads 'h' inside its else_branch from the enclosing graph, and 'h' is computed from "
             "the trainable parameter 'W0': gradients do not flow into If/Loop/Scan bodies; freeze 'W0' (exclude = "
             "['W0'], CLI --exclude W0) or export the model without control flow"),
])
def test_a_body_reading_a_parameter_from_the_enclosing_graph_is_refused(rng, tmp_path, capsys, exclude, want):
    """Not silently frozen (before: W0 and W1 were frozen as 'reaching the output only through
    non-learnable inputs', and the gradients lacked the body's share)."""
    from kfac_compiler.errors import UnsupportedOpError

    with pytest.raises(UnsupportedOpError) as e:
        kc.compile(branching(rng), loss="softmax_cross_entropy", emit=False, exclude=exclude)
    assert str(e.value) == want
    path = tmp_path / "m.onnx"
    onnx.save(branching(rng), str(path))
    code = main(["compile", str(path), "--loss", "softmax_cross_entropy", *[a for x in exclude for a in ("--exclude", x)],
                 "-o", str(tmp_path / "plan")])
    assert code == 2 and capsys.readouterr().err == f"error: {want}\n"


def test_a_body_reading_only_frozen_tensors_trains_the_rest(rng):
    """With what the bodies read frozen, the model compiles and the head's gradient is the
    numpy float64 twin's: softmax cross-entropy of ((x W0) W1) Wb, mean over the batch."""
    m = branching(rng)
    plan = kc.compile(m, loss="softmax_cross_entropy", emit=False, exclude=["W0", "W1"])
    assert plan.trainable == ["Wb"]
    x, y = randn(rng, 6, 4), rng.integers(0, 3, 6)
    loss, grads = kc.gradients(plan, {"x": x}, y)
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer}
    b = x.astype(np.float64) @ w["W0"] @ w["W1"]
    z = b @ w["Wb"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_loss = -np.mean(np.log(p[np.arange(6), y]))
    p[np.arange(6), y] -= 1
    assert abs(float(loss) - want_loss) <= 1e-5 * max(1.0, want_loss)
    np.testing.assert_allclose(grads["Wb"], b.T @ p / 6, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------- untie
def merged_layernorms(rng) -> onnx.ModelProto:
    """Two LayerNorms sharing one all-ones gain and one all-zeros bias, as exporters merge them."""
    nodes = [
        helper.make_node("LayerNormalization", ["x", "ln.weight", "ln.bias"], ["a"], axis=-1, name="ln1"),
        helper.make_node("MatMul", ["a", "fc.weight"], ["b"], name="fc"),
        helper.make_node("LayerNormalization", ["b", "ln.weight", "ln.bias"], ["c"], axis=-1, name="ln2"),
        helper.make_node("MatMul", ["c", "fc2.weight"], ["y"], name="fc2"),
    ]
    inits = {"ln.weight": np.full(4, 1.0, np.float32), "ln.bias": np.full(4, 0.0, np.float32),
             "fc.weight": randn(rng, 4, 4), "fc2.weight": randn(rng, 4, 3)}
    return model(nodes, inits)


def test_merged_initializers_warn_by_name(rng):
    with pytest.warns(UserWarning, match=r"'ln.weight' is shared by 2 nodes \(ln1, ln2\) and all its values are 1"):
        plan = kc.compile(merged_layernorms(rng), loss="squared_error", emit=False)
    assert any("'ln.bias' is shared by 2 nodes" in n for n in plan.notes)
    assert plan.trainable == ["ln.weight", "ln.bias", "fc.weight", "fc2.weight"]


def test_a_shape_read_is_not_a_second_use(rng):
    """torch.export reads a convolution weight's Shape (for its padding arithmetic): the
    weight is still one use, with no tie noted and no untie offered."""
    nodes = [
        helper.make_node("Shape", ["fc.weight"], ["ws"], name="shape_of_weight", start=1),
        helper.make_node("Concat", ["minus_one", "ws"], ["target_shape"], name="target_shape", axis=0),
        helper.make_node("MatMul", ["x", "fc.weight"], ["a"], name="fc"),
        helper.make_node("Reshape", ["a", "target_shape"], ["y"], name="keep"),
    ]
    inits = {"fc.weight": randn(rng, 4, 3), "minus_one": np.array([-1])}
    plan = kc.compile(model(nodes, inits), loss="squared_error", emit=False)
    assert plan.trainable == ["fc.weight"]
    assert not any("shared by" in n for n in plan.notes)
    assert [l.kind for l in plan.layers] == ["fully_connected"]


def test_untie_gives_each_use_its_own_parameter_and_export_writes_them(tmp_path, rng):
    plan = kc.compile(merged_layernorms(rng), loss="squared_error", untie=["ln\\..*"])
    assert plan.trainable == ["ln.weight", "ln.weight.untied1", "ln.bias", "ln.bias.untied1", "fc.weight", "fc2.weight"]
    ln = [l for l in plan.layers if l.kind == "scale_and_shift"]
    assert [l.params for l in ln] == [("ln.weight", "ln.bias"), ("ln.weight.untied1", "ln.bias.untied1")]
    assert all(l.num_uses == 1 for l in ln)
    trainer = Trainer(plan, optimizer="kfac", learning_rate=0.1)
    x = randn(rng, 32, 4)
    for _ in range(3):
        trainer.step({"x": x}, targets=randn(rng, 32, 3))
    path = trainer.export(tmp_path / "trained.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    assert not np.allclose(inits["ln.weight"], inits["ln.weight.untied1"])  # trained apart
    nodes = {n.name: n for n in onnx.load(path).graph.node}
    assert list(nodes["ln2"].input)[1:] == ["ln.weight.untied1", "ln.bias.untied1"]


def test_untie_all_and_errors(rng):
    plan = kc.compile(merged_layernorms(rng), loss="squared_error", emit=False, untie="all")
    assert "ln.bias.untied1" in plan.trainable and any(n.startswith("untied: ") for n in plan.notes)
    with pytest.raises(ConfigError, match="untie: 'fc.weight' names no trainable parameter used by several nodes"):
        kc.compile(merged_layernorms(rng), loss="squared_error", emit=False, untie=["fc.weight"])


def test_cli_train_and_untie(tmp_path, capsys, rng):
    src = tmp_path / "m.onnx"
    onnx.save(merged_layernorms(rng), src)
    assert main(["compile", str(src), "--loss", "squared_error", "--untie", "all", "--frontend-only", "-q",
                 "-o", str(tmp_path / "p")]) == 0
    assert "ln.weight.untied1" in kc.load_plan(tmp_path / "p").trainable
    onnx.save(exported_like(rng), src)
    assert main(["compile", str(src), "--loss", "squared_error", "--train", "three", "--frontend-only",
                 "-o", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "frozen (5, not trained):" in out and "three" in kc.load_plan(tmp_path / "q").trainable
    assert main(["inspect", str(tmp_path / "q"), "--format", "json"]) == 0
    assert {f["name"] for f in json.loads(capsys.readouterr().out)["frozen"]} == set(EXPECTED_FROZEN) - {"three"}


# ----------------------------------------------------------------------- retie
def split_tie(rng, extra_copy: bool = False) -> onnx.ModelProto:
    """An embedding table and its transpose for the head, as the TorchScript exporter writes a
    tied embedding + head; optionally an exact copy of a weight (torch.export's optimizer)."""
    E = randn(rng, 7, 4)
    nodes = [helper.make_node("Gather", ["emb.weight", "ids"], ["h"], name="lookup", axis=0),
             helper.make_node("MatMul", ["h", "fc.weight"], ["a"], name="fc"),
             helper.make_node("MatMul", ["a", "fc.copy" if extra_copy else "fc.weight"], ["b"], name="fc2"),
             helper.make_node("MatMul", ["b", "head.weight"], ["y"], name="head")]
    W = randn(rng, 4, 4)
    inits = {"emb.weight": E, "fc.weight": W, "head.weight": np.ascontiguousarray(E.T),
             "ones": np.full(4, 1.0, np.float32)}
    if extra_copy:
        inits["fc.copy"] = W.copy()
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 7])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_retie_trains_an_exporters_copies_as_one_parameter(tmp_path, rng):
    plan = kc.compile(split_tie(rng, extra_copy=True), loss="softmax_cross_entropy")
    assert plan.retied == {"head.weight": {"of": "emb.weight", "transposed": True},
                           "fc.copy": {"of": "fc.weight", "transposed": False}}
    assert plan.trainable == ["emb.weight", "fc.weight"]
    emb = plan.layer("emb")
    assert emb.kind == "tied_embedding" and emb.num_uses == 2 and plan.layer("fc").num_uses == 2
    trainer = Trainer(plan, optimizer="kfac")
    ids = np.random.default_rng(0).integers(0, 7, 32)
    for _ in range(3):
        trainer.step({"ids": ids}, targets=ids)
    exported = onnx.load(trainer.export(tmp_path / "t.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    assert "head.weight" not in inits and any(n.op_type == "Transpose" and n.output[0] == "head.weight"
                                              for n in exported.graph.node)
    plan.save(tmp_path / "p")
    assert kc.load_plan(tmp_path / "p").retied == plan.retied


def test_finding_copies_reads_only_parameters_a_copy_could_equal(monkeypatch, rng):
    """A parameter whose shape no other parameter has, as is or transposed, is never read
    (a 2.2 GB embedding table was read, copied and hashed: 30 s of its compile)."""
    from kfac_compiler.graph import GraphView
    from kfac_compiler.passes.untie import find_copies

    m = split_tie(rng, extra_copy=True)
    m.graph.initializer.append(numpy_helper.from_array(randn(rng, 5, 6), "table"))
    view = GraphView(m)
    read: list[str] = []
    array = GraphView.array
    monkeypatch.setattr(GraphView, "array", lambda self, name: read.append(name) or array(self, name))
    copies = find_copies(view, ["emb.weight", "fc.weight", "table", "head.weight", "fc.copy"])
    assert copies == {"head.weight": ("emb.weight", True), "fc.copy": ("fc.weight", False)}
    assert "table" not in read and {"emb.weight", "fc.weight", "head.weight", "fc.copy"} <= set(read)


def test_retie_false_keeps_copies_apart_and_uniform_tensors_are_never_retied(rng):
    plan = kc.compile(split_tie(rng, extra_copy=True), loss="softmax_cross_entropy", emit=False, retie=False)
    assert plan.retied == {} and {"head.weight", "fc.copy"} <= set(plan.trainable)
    nodes = [helper.make_node("Mul", ["x", "a"], ["h"]), helper.make_node("Mul", ["h", "b"], ["y"])]
    m = model(nodes, {"a": np.full(3, 1.0, np.float32), "b": np.full(3, 1.0, np.float32)}, x_shape=("N", 3))
    assert kc.compile(m, loss="squared_error", emit=False).retied == {}
    with pytest.raises(ConfigError, match="retie: expected true or false"):
        kc.compile(m, loss="squared_error", emit=False, retie="no")


def test_float_inputs_without_the_batch_axis_are_warned_as_data(rng):
    """A weight passed as a graph input (a static shape beside the data's batch dim) is data
    fed with every batch, never trained: compile says so, naming it. An input with the batch
    dim, or a model whose only input is static (a fixed batch), is not named."""
    gemm = helper.make_node("Gemm", ["x", "W", "b"], ["y"])
    g = helper.make_graph([gemm], "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                        helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                          [numpy_helper.from_array(randn(rng, 3), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match=r"float graph inputs 'W' \[4, 3\] have no batch axis \(a static shape, "
                                         r"where 'x' has \['N', 4\]\): they are treated as data"):
        plan = kc.compile(m, loss="squared_error", emit=False)
    assert plan.trainable == ["b"] and [i.name for i in plan.inputs] == ["x", "W"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.compile(model([gemm], {"W": randn(rng, 4, 3), "b": randn(rng, 3)}, x_shape=(5, 4), y_shape=(5, 3)),
                   loss="squared_error", emit=False)
