"""load_model: a validated load, every failure a one-line ModelError naming the file."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kfac_compiler.errors import KfacError, ModelError
from kfac_compiler.models import get_model
from kfac_compiler.passes.load import check_output, load_model, validate_model


def tiny(opset=17, float_init=True, outputs=("y",)):
    W = np.ones((4, 3), np.float32) if float_init else np.ones((4, 3), np.int64)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT if float_init else TensorProto.INT64, None)]
    if "z" in outputs:
        nodes.append(helper.make_node("Relu", ["y"], ["z"], name="relu"))
        outs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    g = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT if float_init else TensorProto.INT64, ["N", 4])],
        outs, initializer=[numpy_helper.from_array(W, "W")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def one_line(e: KfacError) -> str:
    msg = str(e)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_loads_a_zoo_model(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(get_model("small_cnn"), p)
    m = load_model(p, "logits")
    assert len(m.graph.node) > 0
    assert load_model(str(p), None).graph.output[0].name == "logits"


def test_missing_file(tmp_path):
    with pytest.raises(ModelError) as e:
        load_model(tmp_path / "nope.onnx", None)
    assert "nope.onnx" in one_line(e.value) and "does not exist" in str(e.value)


def test_directory(tmp_path):
    with pytest.raises(ModelError, match="is a directory"):
        load_model(tmp_path, None)


def test_not_onnx(tmp_path):
    p = tmp_path / "garbage.onnx"
    p.write_bytes(b"this is not a protobuf at all \x00\xff\xfe")
    with pytest.raises(ModelError) as e:
        load_model(p, None)
    assert "garbage.onnx" in one_line(e.value) and "not an ONNX model" in str(e.value)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    with pytest.raises(ModelError, match="empty.onnx.*not an ONNX model"):
        load_model(p, None)


def test_truncated(tmp_path):
    data = get_model("mlp_classifier").SerializeToString()
    p = tmp_path / "cut.onnx"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError) as e:
        load_model(p, None)
    assert "cut.onnx" in one_line(e.value) and "truncated" in str(e.value)


@pytest.mark.parametrize("opset", [11, 27])
def test_opset_out_of_range(tmp_path, opset):
    p = tmp_path / "old.onnx"
    onnx.save(tiny(opset=opset), p)
    with pytest.raises(ModelError) as e:
        load_model(p, None)
    msg = one_line(e.value)
    assert f"opset {opset}" in msg and "13..26" in msg and "old.onnx" in msg


def test_external_data_missing_and_present(tmp_path):
    m = tiny()
    p = tmp_path / "ext.onnx"
    onnx.save_model(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.weights",
                    size_threshold=0)
    assert (tmp_path / "ext.weights").exists()
    loaded = load_model(p, "y")
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), np.ones((4, 3), np.float32))
    os.remove(tmp_path / "ext.weights")
    with pytest.raises(ModelError) as e:
        load_model(p, "y")
    msg = one_line(e.value)
    assert "ext.weights" in msg and "missing" in msg and "ext.onnx" in msg


def test_no_float_initializers(tmp_path):
    p = tmp_path / "ints.onnx"
    onnx.save(tiny(float_init=False), p)
    with pytest.raises(ModelError) as e:
        load_model(p, None)
    assert "no float initializers" in one_line(e.value) and "ints.onnx" in str(e.value)


def test_unknown_output_lists_outputs_and_tensors(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(tiny(outputs=("y", "z")), p)
    with pytest.raises(ModelError) as e:
        load_model(p, "logits")
    msg = one_line(e.value)
    assert "'logits'" in msg and "graph outputs: y, z" in msg


def test_ambiguous_output(tmp_path):
    m = tiny(outputs=("y", "z"))
    with pytest.raises(ModelError, match="has 2 outputs .*--output"):
        check_output(m, None, "m.onnx")
    assert check_output(m, "y") == "y"
    assert check_output(m, None if len(m.graph.output) == 1 else "z") == "z"


def test_intermediate_tensor_is_a_valid_output():
    m = get_model("mlp_classifier")
    validate_model(m, "fc2/Relu:0")  # no ModelError
    assert check_output(m, "fc2/Relu:0") == "fc2/Relu:0"
    with pytest.raises(ModelError, match="fc2/Relu:1"):
        validate_model(m, "fc2/Relu:1")  # a name the graph does not have


def test_invalid_graph_is_reported():
    m = tiny()
    m.graph.node[0].input[0] = "undefined_tensor"
    with pytest.raises(ModelError) as e:
        validate_model(m, None, "bad.onnx")
    assert "bad.onnx" in one_line(e.value) and "not a valid ONNX model" in str(e.value)


def test_not_a_model_proto():
    with pytest.raises(ModelError, match="expected an onnx.ModelProto"):
        validate_model("model.onnx", None)
