"""Plan: save/load round trip, atomic save, schema-version and stale-model refusals."""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kfac_compiler as kc
from kfac_compiler.blocks import plan_blocks
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import PlanError
from kfac_compiler.frontend import compile_frontend
from kfac_compiler.models import save_model
from kfac_compiler.plan import SCHEMA_VERSION, Plan, load_plan


@pytest.fixture()
def compiled(tmp_path):
    model = save_model("depthwise_cnn", tmp_path / "model_src.onnx")
    return compile_frontend(model, "softmax_cross_entropy", config={"damping": 1e-2}), model


def _subgraph():
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], "sub",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_round_trip(tmp_path, compiled):
    plan, src = compiled
    plan.subgraphs["train_step"] = _subgraph()
    plan.subgraph_info["train_step"] = SubgraphInfo(state_inputs=["fc.weight"], state_outputs={"new/fc.weight": "fc.weight"})
    out = plan.save(tmp_path / "plan")
    assert sorted(os.listdir(out)) == ["model.onnx", "plan.json", "train_step.onnx"]
    doc = json.load(open(os.path.join(out, "plan.json")))
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["source"]["path"] == os.path.abspath(src) and len(doc["source"]["sha256"]) == 64
    assert doc["subgraphs"]["train_step"]["file"] == "train_step.onnx"
    assert doc["subgraphs"]["train_step"]["inputs"] == [{"name": "x", "shape": ["N", 3], "dtype": "float32"}]
    assert doc["subgraphs"]["train_step"]["reads"] == ["fc.weight"]
    assert doc["subgraphs"]["train_step"]["writes"] == ["fc.weight"]
    assert doc["subgraphs"]["train_step"]["info"]["state_outputs"] == {"new/fc.weight": "fc.weight"}
    assert doc["schedule"]["damping"] == 0.01 and doc["estimator"] == {"mode": "gradients", "num_samples": 1}
    layer0 = doc["layers"][0]
    assert set(layer0) >= {"name", "kind", "pattern", "params", "uses", "approximation", "factors", "notes"}
    assert layer0["uses"] == [{"nodes": ["conv1/Conv"], "input": "input", "output": "conv1/Conv:0"}]

    back = load_plan(out)
    assert back.layers == plan.layers
    assert [l.attrs for l in back.layers] == [l.attrs for l in plan.layers]  # tuples restored
    assert back.factors == plan.factors
    assert back.model.SerializeToString() == plan.model.SerializeToString()
    assert (back.output, back.loss, back.inputs, back.targets) == (plan.output, plan.loss, plan.inputs, plan.targets)
    assert (back.trainable, back.frozen, back.estimator, back.schedule) == (plan.trainable, plan.frozen, plan.estimator, plan.schedule)
    assert back.subgraph_info == plan.subgraph_info
    assert back.subgraphs["train_step"].SerializeToString() == plan.subgraphs["train_step"].SerializeToString()
    assert back.totals() == plan.totals()
    assert set(plan_blocks(back)) == {l.name for l in back.layers}


def test_save_replaces_an_existing_plan_and_refuses_other_directories(tmp_path, compiled):
    plan, _ = compiled
    target = tmp_path / "plan"
    plan.save(target)
    plan.subgraphs["extra"] = _subgraph()
    plan.save(target)  # a plan directory is replaced as a whole
    assert "extra.onnx" in os.listdir(target)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".plan")]  # no temp leftovers

    other = tmp_path / "mydata"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(PlanError, match="refusing to overwrite .*mydata.* not a plan"):
        plan.save(other)
    assert (other / "precious.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    plan.save(empty)  # an empty directory holds nothing to clobber
    assert (empty / "plan.json").exists()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(PlanError, match="it is a file"):
        plan.save(f)


def test_bad_subgraph_name(tmp_path, compiled):
    plan, _ = compiled
    plan.subgraphs["../evil"] = _subgraph()
    with pytest.raises(PlanError, match="cannot be a file name"):
        plan.save(tmp_path / "plan")
    assert not (tmp_path / "plan").exists()


def test_schema_version_refused(tmp_path, compiled):
    plan, _ = compiled
    out = plan.save(tmp_path / "plan")
    pj = os.path.join(out, "plan.json")
    doc = json.load(open(pj))
    doc["schema_version"] = SCHEMA_VERSION + 1
    json.dump(doc, open(pj, "w"))
    with pytest.raises(PlanError) as e:
        load_plan(out)
    msg = str(e.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in msg and "recompile" in msg and "\n" not in msg


def test_changed_source_model_refused(tmp_path, compiled):
    plan, src = compiled
    out = plan.save(tmp_path / "plan")
    load_plan(out)
    save_model("depthwise_cnn", src, seed=1)  # other weights, same path
    with pytest.raises(PlanError) as e:
        load_plan(out)
    assert "stale" in str(e.value) and "model_src.onnx" in str(e.value) and "\n" not in str(e.value)
    assert load_plan(out, check_source=False).layers == plan.layers
    os.remove(src)  # the source is gone: nothing to compare with, the plan loads
    assert load_plan(out).layers == plan.layers


def test_in_memory_model_plan(tmp_path):
    from kfac_compiler.models import get_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile_frontend(get_model("transformer_block"), "softmax_cross_entropy")
    assert plan.source_path is None and len(plan.source_sha256) == 64
    back = load_plan(plan.save(tmp_path / "p"))
    assert back.layers == plan.layers and back.notes == plan.notes


def test_load_errors(tmp_path, compiled):
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "nowhere")
    (tmp_path / "notplan").mkdir()
    with pytest.raises(PlanError, match="not a plan directory"):
        load_plan(tmp_path / "notplan")
    (tmp_path / "model.onnx").write_bytes(b"")  # a model given where a plan belongs
    with pytest.raises(PlanError, match=r"is a file, not a plan directory: compile it first \(kfac-compiler compile "):
        load_plan(tmp_path / "model.onnx")
    plan, _ = compiled
    out = plan.save(tmp_path / "plan")
    with open(os.path.join(out, "plan.json"), "w") as f:
        f.write("{ not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(out)
    out = plan.save(tmp_path / "plan2")
    os.remove(os.path.join(out, "model.onnx"))
    with pytest.raises(PlanError, match="'model.onnx' is missing"):
        load_plan(out)
    out = plan.save(tmp_path / "plan3")
    doc = json.load(open(os.path.join(out, "plan.json")))
    del doc["layers"]
    json.dump(doc, open(os.path.join(out, "plan.json"), "w"))
    with pytest.raises(PlanError, match=r"plan\.json': layers: missing; recompile the model$"):
        load_plan(out)


def test_totals_and_param_shapes(compiled):
    plan, _ = compiled
    t = plan.totals()
    assert t["layers"] == 5 and t["trainable_params"] == 9 and t["frozen_params"] == 2
    assert t["param_elements"] == 72 + 16 + 80 + 144 + 2570
    assert t["layers_by_kind"] == {"conv": 2, "scale_and_shift": 1, "depthwise_conv": 1, "fully_connected": 1}
    if not t["layers_without_factors"]:
        assert t["factor_bytes"] == sum(s.nbytes for specs in plan.factors.values() for s in specs)
    assert plan.param_shapes["fc.weight"] == (10, 256)
    assert isinstance(plan, Plan)
    np.testing.assert_equal(len(plan.model.graph.node), len(onnx.load_from_string(plan.model.SerializeToString()).graph.node))


def test_save_never_replaces_or_drops_the_source_model_or_its_external_data(tmp_path):
    """A plan saved into the folder of the model it was compiled from (overwrite=True, the
    CLI's --force) refuses when it would write or drop the model or a file of its external
    data: model.onnx.data is a plan's name (a big plan's values; a later save of the folder,
    then a plan of ours, drops it), here the user's weights."""
    src = tmp_path / "net.onnx"
    save_model("mlp_classifier", src)
    onnx.save(onnx.load(src), src, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    weights = (tmp_path / "model.onnx.data").read_bytes()
    plan = kc.compile(str(src), loss="softmax_cross_entropy", output="logits", emit=False)
    with pytest.raises(PlanError, match="would overwrite its source model .*net.onnx' or its external data"):
        plan.save(tmp_path, overwrite=True)
    assert (tmp_path / "model.onnx.data").read_bytes() == weights and not (tmp_path / "plan.json").exists()
    plan.save(tmp_path / "plan")  # elsewhere: fine


EDITS = {
    "factor_shape": (lambda d: d["layers"][0]["factors"][0].__setitem__("shape", [4, 4]),
                     r"layers\['fc1'\]\.factors: subgraph '.*' keeps factor 'A' of shape \[65, 65\], which the layer "
                     r"lists as \[4, 4\]"),
    "dropped_factor": (lambda d: d["layers"][0].__setitem__("factors", d["layers"][0]["factors"][:1]),
                       r"keeps factor 'G' of shape \[8, 8\], which the layer lists as absent"),
    "approximation": (lambda d: d["layers"][0].__setitem__("approximation", "diagonal"),
                      r"the plan's layer 'fc1' lists factors \[\('A', \(65, 65\)\), \('G', \(8, 8\)\)\] but its "
                      r"approximation 'diagonal' has \[\('diag', \(8, 65\)\)\]"),
    "output": (lambda d: d.__setitem__("output", "fc1/Gemm:0"), r"output: 'fc1/Gemm:0' is not the plan model's output"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_plan_json_edited_to_contradict_its_graphs_is_refused(tmp_path, edit):
    """plan.json's factors, approximation or output edited against the stored graphs: one
    PlanError (inspect had shown the edit while the stored graphs trained the compiled plan,
    and a knob that made the runtime emit a graph mixed both into a ContractError traceback;
    an edited output trained `logits` while predict returned fc1's). The approximation is
    checked where its blocks are made (inspect, the emission service, host refreshes:
    plan_blocks); the stored graphs train what the factors say."""
    src = save_model("mlp_classifier", tmp_path / "m.onnx", hidden=(8,))
    out = kc.compile(src, loss="softmax_cross_entropy", output="logits").save(tmp_path / "plan")
    path = os.path.join(out, "plan.json")
    doc = json.load(open(path))
    change, message = EDITS[edit]
    change(doc)
    json.dump(doc, open(path, "w"))
    with pytest.raises(PlanError, match=message):
        plan_blocks(load_plan(out))


def test_a_source_whose_external_data_changed_is_stale(tmp_path):
    """The .onnx of a model with external data holds only the weights' locations: weights
    rewritten beside a byte-identical .onnx (a re-export of trained weights) made no stale
    plan, which then trained its compiled values and exported the new file's frozen ones."""
    rng = np.random.default_rng(0)

    def model(bias: float) -> onnx.ModelProto:
        g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "fb"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                              [onnx.numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W"),
                               onnx.numpy_helper.from_array(np.full(3, bias, np.float32), "fb")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    src = str(tmp_path / "m.onnx")
    onnx.save(model(0.0), src, save_as_external_data=True, location="m.weights", size_threshold=0)
    out = kc.compile(src, loss="squared_error", output="y", emit=False).save(tmp_path / "plan")
    load_plan(out)  # unchanged: fine
    before = open(src, "rb").read()
    os.makedirs(tmp_path / "again")
    onnx.save(model(5.0), str(tmp_path / "again" / "m.onnx"), save_as_external_data=True, location="m.weights",
              size_threshold=0)
    os.replace(tmp_path / "again" / "m.weights", tmp_path / "m.weights")
    assert open(src, "rb").read() == before
    with pytest.raises(PlanError, match=r"is stale: its source model's external data 'm\.weights' \(beside .*\) "
                                        r"changed since it was compiled \(its size or modification time\); recompile"):
        load_plan(out)
