"""What is read back from files is validated at the boundary: plan.json against its schema
with every file it names confined to the plan directory, ONNX external data confined to the
model's folder, checkpoints (metadata, entries' CRCs, slot values), and OSErrors turned into
one line naming the file and what to do. A bad file is one line, never a traceback, and a
failed restore changes nothing."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import external_data_helper

import kfac_compiler as kc
from kfac_compiler.cli import main
from kfac_compiler.errors import CheckpointError, ConfigError, DataError, ModelError, PlanError
from kfac_compiler.models import ZOO, save_model
from kfac_compiler.plan import load_plan
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.checkpoint import read_meta


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(model path, plan directory, plan) of the digits classifier."""
    d = tmp_path_factory.mktemp("base")
    model = save_model("mlp_classifier", d / "mlp.onnx")
    plan = kc.compile(model, loss="softmax_cross_entropy", emit=False)
    return str(model), plan.save(d / "plan"), plan


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- plans
def edited(base, tmp_path, edit) -> tuple[str, str]:
    """A copy of the plan directory with plan.json edited by `edit(doc)`; (dir, plan.json)."""
    d = str(tmp_path / "edited")
    shutil.copytree(base[1], d)
    pj = os.path.join(d, "plan.json")
    doc = json.load(open(pj))
    edit(doc)
    json.dump(doc, open(pj, "w"))
    return d, pj


PLAN_EDITS = {
    "unknown parameter in a layer": (lambda d: d["layers"][0]["params"].append("ghost.weight"),
                                     "layers[0].params: 'ghost.weight' is not a trainable parameter of the plan"),
    "parameter in two layers": (lambda d: d["layers"][2]["params"].append("fc1.bias"),
                                "layers[2].params: 'fc1.bias' is already a parameter of layer 'fc1'"),
    "parameter in no layer": (lambda d: d["layers"].pop(2), "layers: trainable parameter 'fc3.weight' is in no layer"),
    "no layers": (lambda d: d.update(layers=[]), "layers: expected a non-empty list, got []"),
    "layers an object": (lambda d: d.update(layers={}), "layers: expected a non-empty list, got {}"),
    "loss a string": (lambda d: d.update(loss="softmax_cross_entropy"),
                      "loss: expected an object, got 'softmax_cross_entropy'"),
    "unknown loss": (lambda d: d["loss"].update(kind="hinge"), "loss: unknown loss 'hinge'"),
    "output does not exist": (lambda d: d.update(output="probs"), "output: the model has no tensor named 'probs'"),
    "trainable a string": (lambda d: d.update(trainable="fc1.weight"), "trainable: expected a list, got 'fc1.weight'"),
    "trainable not an initializer": (lambda d: d["trainable"].append("ghost"),
                                     "trainable[6]: 'ghost' is not an initializer of the plan's model"),
    "use without its input": (lambda d: d["layers"][1]["uses"][0].pop("input"), "layers[1].uses[0].input: missing"),
    "use of an unknown tensor": (lambda d: d["layers"][0]["uses"][0].update(input="pixels"),
                                 "layers[0].uses[0].input: the model has no tensor named 'pixels'"),
    "use of an unknown node": (lambda d: d["layers"][1]["uses"][0].update(nodes=["fc2/MatMul"]),
                               "layers[1].uses[0].nodes: the model has no node named 'fc2/MatMul'"),
    "unknown key in a layer": (lambda d: d["layers"][0].update(param=["x"]), "layers[0].param: unknown entry"),
    "damping a string": (lambda d: d["schedule"].update(damping="1e-3"),
                         "schedule.damping: expected a finite number, got '1e-3'"),
    "damping NaN": (lambda d: d["schedule"].update(damping=float("nan")),
                    "schedule.damping: expected a finite number, got nan"),
    "unknown estimator mode": (lambda d: d["estimator"].update(mode="fisher"), "estimator.mode: 'fisher' is not one of"),
    "factor shape a string": (lambda d: d["layers"][0]["factors"][0].update(shape="65x65"),
                              "layers[0].factors[0].shape: expected a list, got '65x65'"),
    "unknown input": (lambda d: d["inputs"][0].update(name="pixels"), "inputs: ['pixels'] are not the model's data inputs"),
    "model outside the folder": (lambda d: d.update(model="../mlp.onnx"),
                                 "model: '../mlp.onnx' is not a file inside the plan directory"),
    "model an absolute path": (lambda d: d.update(model="/etc/hostname"),
                               "model: '/etc/hostname' is not a file inside the plan directory"),
    "model the folder itself": (lambda d: d.update(model="."), "model: '.' is not a file inside the plan directory"),
    "subgraph outside the folder": (lambda d: d.update(subgraphs={"kfac_step": {"file": "../../x.onnx"}}),
                                    "subgraphs.kfac_step.file: '../../x.onnx' is not a file inside the plan directory"),
    "subgraph name a path": (lambda d: d.update(subgraphs={"../x": {}}), "subgraphs.../x: not a subgraph name"),
}


@pytest.mark.parametrize("case", list(PLAN_EDITS))
def test_hand_edited_plans_are_one_line_plan_errors(base, tmp_path, case, capsys):
    edit, message = PLAN_EDITS[case]
    d, pj = edited(base, tmp_path, edit)
    with pytest.raises(PlanError) as e:
        load_plan(d)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{pj!r}: {message}") and text.endswith("; recompile the model"), text
    assert main(["inspect", d]) == 2
    assert one_error_line(capsys) == f"error: {text}"


def test_plan_files_are_confined_through_symlinks(base, tmp_path):
    d, pj = edited(base, tmp_path, lambda doc: doc.update(model="link.onnx"))
    os.symlink(base[0], os.path.join(d, "link.onnx"))  # inside by name, outside in fact
    with pytest.raises(PlanError, match=r"model: 'link.onnx' is not a file inside the plan directory"):
        load_plan(d)


def with_external_data(model_path: str, folder, location: str) -> str:
    """`model_path` re-saved in `folder` with its weights in external data at `location`."""
    m = onnx.load(model_path)
    external_data_helper.convert_model_to_external_data(m, location="w.bin", size_threshold=0)
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "model.onnx")
    onnx.save(m, out)
    m = onnx.load(out, load_external_data=False)
    for t in m.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(m, out)
    return out


def test_an_in_memory_model_with_external_data_not_loaded_is_checked_without_it(base, tmp_path):
    """The checks read types and shapes, not values: external data not loaded (every weight,
    small ones too) is not looked for, and the model is valid."""
    from kfac_compiler.passes.load import validate_model

    model = onnx.load(with_external_data(base[0], tmp_path / "m", "w.bin"), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    validate_model(model, None)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_external_data_outside_the_models_folder_is_refused(base, tmp_path, where, capsys):
    outside = tmp_path / "w.bin"
    location = "../w.bin" if where == "parent" else str(outside)
    model = with_external_data(base[0], tmp_path / "m", location)
    os.replace(tmp_path / "m" / "w.bin", outside)  # the data really is there
    with pytest.raises(ModelError) as e:
        kc.compile(model, loss="softmax_cross_entropy", emit=False)
    assert str(e.value) == (f"{model!r}: external data file {location!r} lies outside the model's folder "
                            f"{str(tmp_path / 'm')!r}; move it next to the model and name it relative to the model's folder")
    assert main(["compile", model, "--loss", "softmax_cross_entropy", "-o", str(tmp_path / "p"), "-q"]) == 2
    assert one_error_line(capsys) == f"error: {e.value}"
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("kind", ["missing", "folder", "fifo"])
def test_external_data_that_is_not_a_file_is_named_for_what_it_is(base, tmp_path, kind):
    model = with_external_data(base[0], tmp_path / "m", "w.bin")
    data = tmp_path / "m" / "w.bin"
    os.remove(data)
    if kind == "folder":
        data.mkdir()
    elif kind == "fifo":
        os.mkfifo(data)
    what = {"missing": "is missing", "folder": "is a folder",
            "fifo": "is not a regular file (a device, pipe or socket)"}[kind]
    with pytest.raises(ModelError) as e:
        kc.compile(model, loss="softmax_cross_entropy", emit=False)
    assert str(e.value) == (f"{model!r}: external data file 'w.bin' {what} (expected a file next to the model in "
                            f"{str(tmp_path / 'm')!r})")


def test_plan_model_external_data_outside_the_plan_is_refused(base, tmp_path):
    d = str(tmp_path / "plan")
    shutil.copytree(base[1], d)
    with_external_data(os.path.join(d, "model.onnx"), d, "../w.bin")
    os.replace(os.path.join(d, "w.bin"), tmp_path / "w.bin")
    with pytest.raises(PlanError, match=r"'model.onnx' names external data '../w.bin' outside the plan directory"):
        load_plan(d)


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    """A K-FAC trainer two steps in, and its checkpoint."""
    plan = base[2]
    x, y = ZOO["mlp_classifier"].make_data(64, seed=0)
    tr = Trainer(plan, optimizer="kfac", batch_size=64)
    tr.step({"input": x["input"]}, y)
    tr.step({"input": x["input"]}, y)
    path = tr.save_checkpoint(tmp_path_factory.mktemp("ck") / "run.ckpt")
    return tr, path


def rewritten(path: str, out, edit) -> str:
    """The checkpoint at `path` with its metadata (and arrays) changed by edit(meta, arrays)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(bytes(arrays["__meta__"]).decode())
    edit(meta, arrays)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(out, "wb") as f:  # (np.savez would add .npz to the name)
        np.savez(f, **arrays)
    return str(out)


def _slot(meta, name):
    return f"slot_{meta['slots'].index(name):05d}"


META_EDITS = {
    "step_count a string": (lambda m, a: m["host"].update(step_count="2"),
                            "metadata entry 'host.step_count' must be an integer >= 0, got '2'"),
    "negative step": (lambda m, a: m["host"].update(step_count=-3),
                      "metadata entry 'host.step_count' must be an integer >= 0, got -3"),
    "applied beyond taken": (lambda m, a: m["host"].update(applied_steps=9),
                             "host.applied_steps 9 exceeds host.step_count 2"),
    "host missing": (lambda m, a: m.pop("host"), "metadata entry 'host' is missing"),
    "unknown optimizer": (lambda m, a: m.update(optimizer="lion"),
                          "was written by optimizer 'lion', which is not registered here"),
    "knobs a list": (lambda m, a: m.update(knobs=[]), "metadata entry 'knobs' must be an object of optimizer options"),
    "slots a string": (lambda m, a: m.update(slots="params"), "metadata entry 'slots' must be a list of distinct slot names"),
    "seed negative": (lambda m, a: m.update(seed=-1), "metadata entry 'seed' must be an integer >= 0, got -1"),
    "plan without fingerprint": (lambda m, a: m["plan"].pop("fingerprint"), "metadata entry 'plan' must be an object"),
    "data a string": (lambda m, a: m.update(data="digits"), "metadata entry 'data' must be an object with 'examples' "
                                                             "and 'sha256', got 'digits'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(META_EDITS))
def test_hand_edited_checkpoint_metadata_is_one_line(trained, tmp_path, case, capsys):
    tr, path = trained
    edit, message = META_EDITS[case]
    bad = rewritten(path, tmp_path / "bad.ckpt", edit)
    with pytest.raises(CheckpointError) as e:
        read_meta(bad)
    assert "\n" not in str(e.value) and message in str(e.value) and repr(bad) in str(e.value), str(e.value)
    assert main(["train", "--resume", bad, "--steps", "3"]) == 2
    assert one_error_line(capsys) == f"error: {e.value}"


RESTORE_EDITS = {
    "damping negative": (lambda m, a: m["host"].update(damping=-1.0),
                         "unusable host state (ValueError: host.damping must be a finite number > 0, got -1.0)"),
    "damping a string": (lambda m, a: m["host"].update(damping="0.01"),
                         "metadata entry 'host.damping' must be a finite number, got '0.01'"),
    "damping missing": (lambda m, a: m["host"].pop("damping"), "metadata entry 'host.damping' is missing"),
    "ema_weight above 1": (lambda m, a: m["host"].update(ema_weight=3.0), "host.ema_weight must be in [0, 1], got 3.0"),
    "inverses_ready a number": (lambda m, a: m["host"].update(inverses_ready=1),
                                "metadata entry 'host.inverses_ready' must be true or false, got 1"),
    "NaN in a parameter": (lambda m, a: a[_slot(m, "fc2.bias")].__setitem__(0, np.nan),
                           "slot 'fc2.bias' holds NaN or infinite values"),
    "parameter of another dtype": (lambda m, a: a.update({_slot(m, "fc2.bias"): a[_slot(m, "fc2.bias")].astype(np.float64)}),
                                   "slot 'fc2.bias' is float64 [128], expected float32 [128]"),
    "rng state garbage": (lambda m, a: m.update(rng={"bit_generator": "nope"}), "unusable RNG state"),
    "stored knob of the wrong type": (lambda m, a: m["knobs"].update(adapt_damping="no"),
                                      "knobs: optimizer option 'adapt_damping' must be True or False, got 'no'"),
    "stored knob unknown": (lambda m, a: m["knobs"].update(bogus=1), "knobs: optimizer 'kfac' has no option 'bogus'"),
}


@pytest.mark.parametrize("case", list(RESTORE_EDITS))
def test_bad_checkpoint_contents_change_nothing(trained, tmp_path, case):
    tr, path = trained
    edit, message = RESTORE_EDITS[case]
    bad = rewritten(path, tmp_path / "bad.ckpt", edit)
    before, host = tr.state(), tr.host_state()
    with pytest.raises(CheckpointError) as e:
        if case.startswith("stored knob"):
            Trainer.load_checkpoint(bad, tr.plan)
        else:
            tr.restore(bad)
    assert "\n" not in str(e.value) and message in str(e.value) and repr(bad) in str(e.value), str(e.value)
    assert tr.host_state() == host
    after = tr.state()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_flipped_and_truncated_checkpoints(trained, tmp_path):
    """Every flipped byte is a one-line CheckpointError or restores exactly the saved state
    (a byte the format does not read, e.g. a timestamp); every truncation is an error."""
    tr, path = trained
    raw = open(path, "rb").read()
    saved, host = tr.state(), tr.host_state()
    with np.load(path) as z:  # a byte inside the first parameter's values: the CRC catches it
        offset = raw.index(z["slot_00000"].tobytes()[:64]) + 100
    positions = [offset] + list(np.random.default_rng(0).integers(0, len(raw), 24))
    errors = 0
    for i in positions:
        flipped = bytearray(raw)
        flipped[i] ^= 0x04
        bad = tmp_path / "flipped.ckpt"
        bad.write_bytes(bytes(flipped))
        try:
            tr.restore(bad)
        except CheckpointError as e:
            errors += 1
            assert "\n" not in str(e) and repr(str(bad)) in str(e)
            if i == offset:
                assert str(e).endswith("is corrupt: entry 'slot_00000' (BadZipFile: Bad CRC-32 for file "
                                       "'slot_00000.npy'); use an earlier copy")
        else:
            assert i != offset
        now = tr.state()
        assert tr.host_state() == host and all(np.array_equal(saved[k], now[k]) for k in saved), i
    assert errors >= len(positions) // 2
    for n in (0, 10, len(raw) // 3, len(raw) - 22, len(raw) - 1):
        bad = tmp_path / "short.ckpt"
        bad.write_bytes(raw[:n])
        with pytest.raises(CheckpointError, match=r"is not readable \(|is corrupt: entry"):
            tr.restore(bad)


# ----------------------------------------------------------------------------- OS errors
def test_compile_into_a_path_under_a_file_is_one_line(base, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    out = blocker / "plan"
    assert main(["compile", base[0], "--loss", "softmax_cross_entropy", "-o", str(out), "-q"]) == 2
    assert one_error_line(capsys) == f"error: -o {str(out)!r}: {str(blocker)!r} is a file, not a folder"
    assert blocker.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_compile_into_a_read_only_folder_is_one_line(base, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["compile", base[0], "--loss", "softmax_cross_entropy", "-o", str(ro / "plan"), "-q"]) == 2
        assert one_error_line(capsys).endswith("permission denied: make it writable or choose another path")
    finally:
        ro.chmod(0o700)


def test_checkpoint_under_a_file_is_one_line(trained, tmp_path):
    tr, _ = trained
    (tmp_path / "file").write_text("mine")
    with pytest.raises(CheckpointError) as e:
        tr.save_checkpoint(tmp_path / "file" / "c.ckpt")
    assert str(e.value) == (f"cannot write the checkpoint {str(tmp_path / 'file' / 'c.ckpt')!r}: "
                            "a part of the path is a file, not a directory")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_metrics_on_a_device_is_refused_before_training(tmp_path, capsys):
    """A link to /dev/full (every write fails with ENOSPC) is a device, not a file: refused up
    front (a full disk during the run: tests/test_run_io.py)."""
    metrics = tmp_path / "m.csv"
    os.symlink("/dev/full", metrics)
    assert main(["train", "--steps", "2", "--metrics", str(metrics), "-q", "--optimizer", "sgd"]) == 2
    assert one_error_line(capsys) == (f"error: --metrics {str(metrics)!r} is not a regular file (a device, pipe or "
                                      "socket); give a file path")


def test_config_file_that_is_unreadable_is_one_line(base, tmp_path, capsys):
    assert main(["compile", base[0], "--loss", "softmax_cross_entropy", "--config", str(tmp_path), "-o",
                 str(tmp_path / "p")]) == 2
    assert one_error_line(capsys) == f"error: config file {str(tmp_path)!r} is a directory; give a TOML or JSON file"
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b"damping = \xff\n")
    with pytest.raises(ConfigError, match=r"^config file .*c\.toml' is not valid TOML: "):
        kc.compile(base[0], loss="softmax_cross_entropy", config=str(cfg), emit=False)


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """A plan directory of the digits classifier with its subgraphs stored."""
    d = tmp_path_factory.mktemp("emitted")
    plan = kc.compile(save_model("mlp_classifier", d / "mlp.onnx"), loss="softmax_cross_entropy")
    return plan.save(d / "plan")


STATE_SPEC_EDITS = {  # what the fuzz of tests/test_fault_injection.py found as tracebacks
    "a slot's spec deleted": (lambda s: s.pop("inverse/fc2/G_inv"), "no state_specs entry for slot 'inverse/fc2/G_inv'"),
    "a garbled dtype": (lambda s: s["factor/fc1/A"].update(dtype="fLoat32"), "data type 'fLoat32' not understood"),
}


@pytest.mark.parametrize("case", list(STATE_SPEC_EDITS))
def test_a_stored_subgraphs_state_specs_edited_is_one_line_at_training(emitted, tmp_path, case):
    edit, why = STATE_SPEC_EDITS[case]
    d = str(tmp_path / "edited")
    shutil.copytree(emitted, d)
    pj = os.path.join(d, "plan.json")
    doc = json.load(open(pj))
    edit(doc["subgraphs"]["kfac_step"]["info"]["state_specs"])
    json.dump(doc, open(pj, "w"))
    x, y = ZOO["mlp_classifier"].make_data(32, seed=0)
    with pytest.raises(PlanError) as e:  # batch 32: no sub-batch, so the stored kfac_step is the one run
        Trainer(load_plan(d), batch_size=32).step(x, y)
    text = str(e.value)
    assert "\n" not in text and why in text
    assert text.startswith("the plan's subgraph 'kfac_step' disagrees with its entry in plan.json (")
    assert text.endswith("; recompile the plan")


# --------------------------------------------------------------------------- lying models
def _mlp() -> onnx.ModelProto:
    return ZOO["mlp_classifier"].build(seed=0)


def _first_weight(m: onnx.ModelProto) -> onnx.TensorProto:
    return next(t for t in m.graph.initializer if len(t.dims) == 2)


def _lie_raw(m):  # dims claim 1000x the rows its raw_data holds
    _first_weight(m).dims[0] *= 1000


def _lie_huge(m):  # a 40 TB claim must not be allocated
    t = _first_weight(m)
    t.dims[:] = [10**7, 10**6]


def _lie_typed(m):  # values in float_data instead of raw_data, one missing
    t = _first_weight(m)
    values = onnx.numpy_helper.to_array(t).reshape(-1)
    t.ClearField("raw_data")
    t.float_data.extend(values[:-1].tolist())


def _two_producers(m):
    g = m.graph
    g.node[1].output[0] = g.node[0].output[0]


def _produces_an_initializer(m):
    m.graph.node[0].output[0] = _first_weight(m).name


def _input_narrower_than_its_weight(m):  # the input declared 32 wide; fc1's weight takes 64
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 32


def _unknown_attribute(m):
    m.graph.node[1].attribute.append(onnx.helper.make_attribute("foo", 1))


def _extra_input(m):
    m.graph.node[1].input.append(m.graph.node[1].input[0])


def _input_of_another_type(m):  # int64 pixels into a float Gemm
    m.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT64


def _duplicate_initializer(m):
    m.graph.initializer.append(_first_weight(m))


def _duplicate_input(m):
    m.graph.input.append(m.graph.input[0])


def _output_declared_wider(m):  # 10 logits declared 11
    m.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 11


def _initializer_input_of_another_shape(m):  # a default value that does not fit its declaration
    m.graph.input.append(onnx.helper.make_tensor_value_info(_first_weight(m).name, onnx.TensorProto.FLOAT, [7]))


def _with_if(m, body_nodes, *, first=False):
    """An If (unused: validation reads every node) whose two branches are `body_nodes`."""
    body = onnx.helper.make_graph(body_nodes, "body", [], [onnx.helper.make_tensor_value_info(
        body_nodes[-1].output[0], onnx.TensorProto.FLOAT, None)])
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), "cond"))
    node = onnx.helper.make_node("If", ["cond"], ["unused"], then_branch=body, else_branch=body, name="branch")
    m.graph.node.insert(0, node) if first else m.graph.node.append(node)


def _if_reads_an_undefined_name(m):
    _with_if(m, [onnx.helper.make_node("Identity", ["ghost"], ["t"], name="inner")])


def _if_reads_a_later_tensor(m):  # the outer tensor exists, but only after the If
    _with_if(m, [onnx.helper.make_node("Identity", [m.graph.node[-1].output[0]], ["t"], name="inner")], first=True)


def _if_body_with_two_producers(m):
    _with_if(m, [onnx.helper.make_node("Identity", ["fc1.bias"], ["t"], name="a"),
                 onnx.helper.make_node("Identity", ["fc1.bias"], ["t"], name="b")])


def _if_body_redefines_an_outer_tensor(m):
    _with_if(m, [onnx.helper.make_node("Identity", ["fc1.bias"], [m.graph.node[0].output[0]], name="a")])


INVALID = " is not a valid ONNX model: "


@pytest.mark.parametrize("edit,want", [
    (_unknown_attribute, INVALID + "node 'fc1/Relu' (Relu): Unrecognized attribute: foo for operator Relu "
                                   "(onnx.checker); fix or re-export the model"),
    (_extra_input, INVALID + "node 'fc1/Relu' (Relu): Node(fc1/Relu) with schema(::Relu:14) has input size 2 not in "
                             "range [min=1, max=1]. (onnx.checker); fix or re-export the model"),
    (_input_of_another_type, ": shapes or types that contradict each other at node 'fc1/Gemm' (Gemm): B has "
                             "inconsistent type tensor(float); fix the declared input or output shapes or types, or "
                             "re-export the model"),
    (_duplicate_initializer, INVALID + "initializer 'fc1.weight' is defined twice (a tensor has one definition); "
                                       "re-export the model"),
    (_duplicate_input, INVALID + "graph input 'input' is defined twice (a tensor has one definition); re-export the "
                                 "model"),
    (_initializer_input_of_another_shape, ": initializer 'fc1.weight' is also a graph input declared float[7] but holds "
                                          "float[128, 64] (an initializer that is an input is its default value); "
                                          "declare the input as the initializer or drop the input"),
    (_if_reads_an_undefined_name, INVALID + "input 'ghost' of node 'inner' in the else_branch of node 'branch' is not "
                                            "defined anywhere"),
    (_if_reads_a_later_tensor, INVALID + "input 'logits' of node 'inner' in the else_branch of node 'branch' is "
                                         "produced only after it"),
    (_if_body_with_two_producers, INVALID + "tensor 't' is an output of node 'b' in the else_branch of node 'branch' "
                                            "and of node 'a' (a tensor has one producer)"),
    (_if_body_redefines_an_outer_tensor, INVALID + "tensor '{out}', an output of node 'a' in the else_branch of node "
                                                   "'branch', is already a tensor of an enclosing graph (names are "
                                                   "unique across nested graphs)"),
], ids=["unknown-attribute", "extra-input", "input-type", "duplicate-initializer", "duplicate-input",
        "default-value-shape", "if-undefined", "if-later", "if-two-producers", "if-redefines"])
def test_invalid_onnx_is_one_line_naming_the_node_or_tensor(tmp_path, capsys, edit, want):
    """What ONNX (onnx.checker, its SSA and scoping rules, strict type inference) calls invalid:
    refused at compile in one line naming the node or tensor, before anything is written."""
    _refused_in_one_line(tmp_path, capsys, edit, want)


def test_an_initializer_that_is_also_a_graph_input_is_a_parameter(tmp_path):
    """Valid ONNX (the initializer is the input's default value): trained as a parameter with the
    input dropped from the plan, exactly as the model without the input declaration (the same
    loss and gradients); the source graph exported keeps the declaration with the trained value."""
    from kfac_compiler.runtime import Trainer

    plain = _mlp()
    declared = _mlp()
    w = _first_weight(declared)
    declared.graph.input.append(onnx.helper.make_tensor_value_info(w.name, onnx.TensorProto.FLOAT, list(w.dims)))
    path = tmp_path / "declared.onnx"
    onnx.save(declared, str(path))
    plans = [kc.compile(m, loss="softmax_cross_entropy", emit=False) for m in (plain, str(path))]
    assert plans[1].trainable == plans[0].trainable and w.name in plans[1].trainable
    assert [i.name for i in plans[1].inputs] == ["input"]
    x, y = np.random.default_rng(0).random((5, 64), np.float32), np.arange(5)
    (l0, g0), (l1, g1) = (kc.gradients(p, {"input": x}, y) for p in plans)
    assert l0 == l1 and all(np.array_equal(g0[k], g1[k]) for k in g0)
    tr = Trainer(plans[1], optimizer="sgd", learning_rate=0.1)
    tr.step({"input": x}, y)
    out = onnx.load(tr.export(tmp_path / "trained.onnx", graph="source"))
    assert w.name in [i.name for i in out.graph.input]
    trained = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(trained[w.name], tr.parameters()[w.name])


@pytest.mark.parametrize("edit,want", [
    (_lie_raw, ": initializer 'fc1.weight' declares a 128000x64 tensor (32768000 bytes) but holds 32768 bytes; "
               "re-export the model"),
    (_lie_huge, ": initializer 'fc1.weight' declares a 10000000x1000000 tensor (40000000000000 bytes) but holds "
                "32768 bytes; re-export the model"),
    (_lie_typed, ": initializer 'fc1.weight' declares a 128x64 tensor (8192 values) but holds 8191 values; "
                 "re-export the model"),
    (_two_producers, " is not a valid ONNX model: tensor '{out}' is an output of node '{second}' and of node "
                     "'{first}' (a tensor has one producer)"),
    (_produces_an_initializer, " is not a valid ONNX model: tensor 'fc1.weight' is an output of node '{first}' "
                               "and of an initializer (a tensor has one producer)"),
    (_input_narrower_than_its_weight, ": shapes or types that contradict each other at node 'fc1/Gemm' (Gemm): Dimension "
                                      "mismatch in unification between 64 and 32; fix the declared input or output "
                                      "shapes or types, or re-export the model"),
    (_output_declared_wider, ": shapes or types that contradict each other at node 'fc3/Gemm' (Gemm): Inferred shape "
                             "and existing shape differ in dimension 1: (10) vs (11); fix the declared input or output "
                             "shapes or types, or re-export the model"),
], ids=["raw-data", "40-TB", "typed-field", "two-producers", "produces-an-initializer", "input-shape", "output-shape"])
def test_models_that_contradict_themselves_are_one_line(tmp_path, capsys, edit, want):
    _refused_in_one_line(tmp_path, capsys, edit, want)


def _refused_in_one_line(tmp_path, capsys, edit, want):
    """`compile` of the digits MLP edited by `edit`: exit 2, exactly `want` after the file's
    name ({out}, {first}, {second}: the first nodes' names), no plan written."""
    m = _mlp()
    g = m.graph
    names = {"out": g.node[0].output[0], "first": g.node[0].name or g.node[0].op_type,
             "second": g.node[1].name or g.node[1].op_type}
    edit(m)
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    code = main(["compile", str(path), "--loss", "softmax_cross_entropy", "-o", str(tmp_path / "plan")])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {str(path)!r}{want.format(**names)}\n", err
    assert not (tmp_path / "plan").exists()


def test_a_model_onnx_runtime_cannot_load_is_one_line():
    """An LSTM whose initial cell state has the wrong width (as torch.export writes for
    LSTM(proj_size=...)): the compiler accepts it, and the first session ONNX Runtime refuses
    (its shape inference) was a raw ONNX Runtime traceback. The model's own forward pass fails
    to load too, so it is the model's: one ModelError line saying so."""
    from onnx import TensorProto, helper, numpy_helper

    from kfac_compiler.runtime import gradients

    H, IN, T, N = 3, 2, 2, 4
    rng = np.random.default_rng(0)
    zeros = {"h0": np.zeros((1, N, H), np.float32), "c0": np.zeros((1, N, H + 1), np.float32)}
    nodes = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v)) for k, v in zeros.items()]
    nodes += [helper.make_node("Transpose", ["input"], ["xt"], perm=[1, 0, 2]),
              helper.make_node("LSTM", ["xt", "W", "R", "B", "", "h0", "c0"], ["Y", "Yh"], hidden_size=H),
              helper.make_node("Reshape", ["Yh", "shape"], ["r"]), helper.make_node("Gemm", ["r", "w2"], ["out"], transB=1)]
    inits = {"W": rng.normal(size=(1, 4 * H, IN)), "R": rng.normal(size=(1, 4 * H, H)), "B": rng.normal(size=(1, 8 * H)),
             "w2": rng.normal(size=(2, H))}
    model = helper.make_model(helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [N, T, IN])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [N, 2])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()]
        + [numpy_helper.from_array(np.array([N, H], np.int64), "shape")]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    plan = kc.compile(model, loss="squared_error", output="out", emit=False)
    with pytest.raises(ModelError, match=r"^ONNX Runtime cannot run the model's own forward pass \(.*re-export") as e:
        gradients(plan, {"input": rng.normal(size=(N, T, IN)).astype(np.float32)}, np.zeros((N, 2), np.float32))
    assert "\n" not in str(e.value)


def test_a_scalar_data_input_is_refused_at_compile():
    """Training feeds data inputs by rows: a scalar input (an If's flag, a temperature)
    compiled and then every step refused it as "shape []; the model expects []"."""
    w = onnx.numpy_helper.from_array(np.ones((3, 2), np.float32), "W")
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["h"]), onnx.helper.make_node("Mul", ["h", "t"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3]),
         onnx.helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 2])], [w])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match=r"input 't' is a scalar \(shape \[\]\); training feeds data inputs by rows"):
        kc.compile(model, loss="squared_error", emit=False)


def test_a_batch_of_another_size_than_a_fixed_batch_model_says_how_it_was_exported():
    """A model exported with a fixed batch (jax2onnx without a symbolic one) refuses other
    batch sizes with a line that says so and what to do (it had said only 'the model expects
    [4, 3]')."""
    from kfac_compiler.runtime import Trainer

    w = onnx.numpy_helper.from_array(np.ones((3, 2), np.float32), "W")
    g = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                               [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 3])],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 2])], [w])
    plan = kc.compile(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)]),
                      loss="squared_error", emit=False)
    tr = Trainer(plan, optimizer="sgd", threads=1)
    tr.step({"x": np.ones((4, 3), np.float32)}, np.zeros((4, 2), np.float32))
    with pytest.raises(DataError, match=r"the model expects \[4, 3\] \(its batch dimension is fixed at 4, as it was "
                                        r"exported: re-export it with a symbolic batch axis"):
        tr.step({"x": np.ones((8, 3), np.float32)}, np.zeros((8, 2), np.float32))


def _renamed(new: str, which: str = "output"):
    """An edit renaming the first node's output (or the first weight) to `new`."""
    def edit(m):
        old = m.graph.node[0].output[0] if which == "output" else _first_weight(m).name
        if which == "output":
            m.graph.node[0].output[0] = new
        else:
            _first_weight(m).name = new
        for node in m.graph.node:
            node.input[:] = [new if i == old else i for i in node.input]
    return edit


@pytest.mark.parametrize("name,which,clash", [
    ("hp/damping", "output", "hp/..."), ("noise/0", "output", "noise/..."), ("new/W", "output", "new/..."),
    ("velocity/fc1.weight", "weight", "velocity/..."), ("factor/fc1/A", "output", "factor/..."),
])
def test_tensors_named_like_the_runtime_contract_are_refused(tmp_path, capsys, name, which, clash):
    """A model tensor named like the contract's inputs, hyper-parameters, state slots or
    results met the emitted graphs' own: compile wrote graphs onnx.checker and ONNX Runtime
    refuse (a duplicate `hp/damping`), or died in a networkx cycle (`new/W`)."""
    _refused_in_one_line(tmp_path, capsys, _renamed(name, which),
                         f": tensor {name!r} is named like the runtime's own {clash!r} (docs/runtime_contract.md); "
                         "rename it in the model before compiling")


def test_a_sigmoid_output_under_sigmoid_cross_entropy_is_warned():
    """The loss applies its own sigmoid (Loss.link_op), as softmax cross-entropy its softmax:
    an output a Sigmoid node computes (Keras's Dense(1, activation="sigmoid")) would train a
    sigmoid of probabilities; the warning names the node and its input."""
    w = onnx.numpy_helper.from_array(np.ones((3, 1), np.float32), "W")
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["z"]), onnx.helper.make_node("Sigmoid", ["z"], ["p"], name="sig")],
        "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3])],
        [onnx.helper.make_tensor_value_info("p", onnx.TensorProto.FLOAT, ["N", 1])], [w])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match=r"output 'p' is computed by Sigmoid node 'sig': sigmoid_cross_entropy applies "
                                         r"its own sigmoid .* \(a double sigmoid\); pass 'z' as the output instead"):
        kc.compile(model, loss="sigmoid_cross_entropy", emit=False)
