"""Deeply nested documents (a config, plan.json, a checkpoint's metadata) are one line
naming the file, not a RecursionError with thousands of lines (parsing.nesting_checked); an
ONNX file is bounded by protobuf's own depth limit, also one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tomllib

from kfac_compiler.errors import CheckpointError, PlanError
from kfac_compiler.parsing import MAX_NESTING, nesting_checked
from kfac_compiler.runtime.checkpoint import read_meta

DEEP = "[" * 100_000 + "]" * 100_000  # past any recursion limit


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_the_limit_counts_levels_of_arrays_and_tables():
    assert nesting_checked(lambda: json.loads(nested(MAX_NESTING))) is not None
    doc = {"a": json.loads(nested(MAX_NESTING - 1))}  # the dict is level 1
    assert nesting_checked(lambda: doc) is doc
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_NESTING} levels"):
        nesting_checked(lambda: json.loads(nested(MAX_NESTING + 1)))
    with pytest.raises(ValueError, match="nested deeper"):
        nesting_checked(lambda: {"a": json.loads(nested(MAX_NESTING))})
    with pytest.raises(ValueError, match="nested deeper"):  # the decoder's own RecursionError
        nesting_checked(lambda: json.loads(DEEP))
    with pytest.raises(ValueError, match="nested deeper"):
        nesting_checked(lambda: tomllib.loads("a = " + DEEP))


@pytest.mark.parametrize("ext", ["json", "toml"])
def test_a_deep_config_is_one_line(tmp_path, capsys, ext):
    from kfac_compiler.cli import main
    from kfac_compiler.models import save_model

    cfg = tmp_path / f"c.{ext}"
    cfg.write_text(f'{{"a": {DEEP}}}' if ext == "json" else f"a = {DEEP}\n")
    model = save_model("mlp_classifier", tmp_path / "m.onnx")
    code = main(["compile", str(model), "--loss", "softmax_cross_entropy", "--config", str(cfg), "-o",
                 str(tmp_path / "plan")])
    err = capsys.readouterr().err
    kind = ext.upper()
    assert code == 2 and err == f"error: config file {str(cfg)!r} is not valid {kind}: nested deeper than 100 levels\n"


def test_a_deep_plan_json_is_one_line(tmp_path):
    from kfac_compiler.plan import load_plan

    (tmp_path / "plan.json").write_text(f'{{"schema_version": {DEEP}}}')
    pj = str(tmp_path / "plan.json")
    with pytest.raises(PlanError) as got:
        load_plan(str(tmp_path))
    assert str(got.value) == f"{pj!r} is not valid JSON (nested deeper than 100 levels)"


def test_a_deep_checkpoint_metadata_is_one_line(tmp_path):
    path = tmp_path / "c.ckpt"
    with open(path, "wb") as f:
        np.savez(f, __meta__=np.frombuffer(f'{{"format": {DEEP}}}'.encode(), dtype=np.uint8))
    with pytest.raises(CheckpointError) as got:
        read_meta(path)
    assert str(got.value) == f"checkpoint {str(path)!r} has corrupt metadata (ValueError: nested deeper than 100 levels)"


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def deep_if_model(levels: int) -> bytes:
    """mlp_classifier's model with one more node: an If whose then_branch holds an If ...
    `levels` deep, written field by field, as Python's protobuf refuses to build a message
    nested past its depth limit (GraphProto: node 1, name 2, output 12; NodeProto: input 1,
    output 2, op_type 4, attribute 5; AttributeProto: name 1, g 6, type 20 = GRAPH 5;
    ModelProto.graph 7, a second one merged into the first: the node appended)."""
    from onnx import TensorProto, helper

    from kfac_compiler.models import get_model

    out = _ld(12, helper.make_tensor_value_info("o", TensorProto.FLOAT, [1]).SerializeToString())
    node = _ld(2, b"o") + _ld(4, b"Constant")
    for k in range(levels):
        body = _ld(1, node) + _ld(2, f"g{k}".encode()) + out
        branch = _ld(1, b"then_branch") + _ld(6, body) + _varint(20 << 3) + _varint(5)
        node = _ld(1, b"input") + _ld(2, b"o") + _ld(4, b"If") + _ld(5, branch)
    return get_model("mlp_classifier", seed=0).SerializeToString() + _ld(7, _ld(1, node))


def test_an_onnx_model_nested_past_protobufs_limit_is_one_line(tmp_path, capsys):
    """ONNX files are bounded by protobuf's own depth limit: If bodies nested 200 deep (3
    messages a level) are one line naming the file, nothing written; 5 deep the same bytes
    parse (a well-formed message: only the depth is refused)."""
    import onnx

    from kfac_compiler.cli import main

    shallow = onnx.load_from_string(deep_if_model(5))
    assert [n.op_type for n in shallow.graph.node][-1] == "If"
    model = tmp_path / "deep.onnx"
    model.write_bytes(deep_if_model(200))
    code = main(["compile", str(model), "--loss", "softmax_cross_entropy", "-o", str(tmp_path / "plan")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {str(model)!r} is not an ONNX model"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.onnx"]  # (upb says "Exceeded ...MaxDepth")
