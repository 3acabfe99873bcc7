"""Paths inside a folder, and ONNX files whose external data must stay in theirs.

A plan's plan.json names its model and subgraph files, and an ONNX model names the files of
its external data: both are hand-editable, so a name like `../../home/me/secret` or an
absolute path would make loading read a file outside the folder the user handed us. Every
such name is resolved here (symbolic links followed) and refused unless it lies inside.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import onnx
from onnx import TensorProto


def inside(folder: str | os.PathLike, name: str) -> str | None:
    """The real path of `name` (relative to `folder`) if it lies inside `folder`, else None."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return None
    base = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(base, name))
    if target == base or os.path.commonpath([base, target]) != base:
        return None
    return target


def external_locations(model: onnx.ModelProto) -> Iterator[str]:
    """The `location` of every tensor stored as external data (initializers, attributes)."""
    for t in onnx.external_data_helper._get_all_tensors(model):
        if t.HasField("data_location") and t.data_location == TensorProto.EXTERNAL:
            for entry in t.external_data:
                if entry.key == "location":
                    yield entry.value


def outside_locations(model: onnx.ModelProto, folder: str | os.PathLike) -> list[str]:
    """The external-data locations of `model` that do not lie inside `folder` (sorted)."""
    return sorted({loc for loc in external_locations(model) if inside(folder, loc) is None})
