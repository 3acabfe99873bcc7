"""docs/tutorial_torch.md runs as written: its Python blocks, in order, in one namespace (the
blocks assert what the text claims). Needs torch, onnxscript, torchvision and transformers
(CI installs them); skipped without them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial_torch.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.slow
def test_the_tutorial_runs_as_written(tmp_path, monkeypatch, capsys):
    for module in ("torch", "onnxscript", "torchvision", "transformers"):  # here, not at collection: 6 s
        pytest.importorskip(module)
    blocks = python_blocks(TUTORIAL.read_text())
    assert len(blocks) == 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "tutorial"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{TUTORIAL.name}, block {i + 1}", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "torch vs ONNX Runtime, max abs difference" in printed
    assert (tmp_path / "resnet-trained.onnx").is_file() and (tmp_path / "resnet-trained.pt").is_file()
