"""Several loss heads: give the model ONE output that carries every head.

Each head's output is reshaped to [N, d_h] and the pieces concatenated on axis 1 into a new
graph output, the only one; the loss `multi_head` (kfac_compiler/losses/heads.py) slices it
back per head. Everything downstream (canonicalize, the blocks, the back end, the runtime)
then sees a model with one output, as for a single loss.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kfac_compiler.errors import ConfigError, ModelError
from kfac_compiler.graph import GraphView, fresh_name
from kfac_compiler.losses import loss_class
from kfac_compiler.passes.canonicalize import infer_shapes
from kfac_compiler.passes.load import check_output

HEADS_OUTPUT = "multi_head_output"


def attach_heads(model: onnx.ModelProto, heads: list[dict[str, Any]], source: str) -> tuple[onnx.ModelProto, str, list[dict]]:
    """(a copy of `model` whose only output concatenates the heads, its name, the heads with
    their output shapes (the dims after the batch axis) filled in)."""
    inputs = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    for h in heads:
        check_output(model, h["output"], source)
        if h["targets"] in inputs:
            raise ConfigError(f"head {h['output']!r}: targets name {h['targets']!r} is a model input's; data files "
                              "hold both under their names, so give the targets another name")
    view = GraphView(infer_shapes(model, keep_going=True))
    name = fresh_name(HEADS_OUTPUT, view.all_names())
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    pieces, filled, batch, dtype = [], [], None, None
    for i, h in enumerate(heads):
        shape = view.shape(h["output"])
        rest = None if shape is None else shape[1:]
        if shape is None or not shape or not all(isinstance(d, int) and d > 0 for d in rest):
            raise ModelError(f"{source!r}: head {h['output']!r} has shape {None if shape is None else list(shape)}; a "
                             "head needs a batch axis and static other dims")
        if not view.is_float(h["output"]):
            raise ModelError(f"{source!r}: head {h['output']!r} is not a float tensor")
        if dtype is not None and view.dtypes[h["output"]] != dtype:
            raise ModelError(f"{source!r}: head {h['output']!r} has another float type than head {heads[0]['output']!r}")
        dtype = view.dtypes[h["output"]]
        problem = loss_class(h["loss"])(**h["options"]).output_problem(shape)
        if problem:
            raise ModelError(f"{source!r}: head {h['output']!r} has shape {list(shape)}; {problem}")
        batch = shape[0] if batch is None else batch
        width = int(np.prod(rest)) if rest else 1
        dims = f"{name}/shape{i}"
        g.initializer.append(numpy_helper.from_array(np.array([0, width], np.int64), dims))
        pieces.append(f"{name}/head{i}")
        g.node.append(helper.make_node("Reshape", [h["output"], dims], [pieces[-1]], name=f"{name}/reshape{i}"))
        filled.append({**h, "shape": [int(d) for d in rest]})
    g.node.append(helper.make_node("Concat", pieces, [name], name=f"{name}/concat", axis=1))
    width = sum(int(np.prod(h["shape"])) if h["shape"] else 1 for h in filled)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(name, dtype, [batch if batch is not None else "N", width]))
    return out, name, filled
