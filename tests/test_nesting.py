"""Deeply nested documents (a config, plan.json, a checkpoint's metadata) are one line
naming the file, not a RecursionError with thousands of lines (parsing.nesting_checked)."""
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
