"""Small helper for building zoo graphs with onnx.helper.

Conventions shared by every zoo model:

* default-domain opset 17, ``ir_version = 8``;
* graph input ``"input"`` and output ``"logits"`` with a dynamic batch
  dimension named ``"N"``;
* graph initializers hold the model's parameters (plus BatchNormalization
  running statistics); fixed constants (gather indices, masks, scalars) are
  ``Constant`` nodes so that they never look like trainable parameters;
* every node has a unique, readable name such as ``"fc1/Gemm"``;
* the finished model is run through strict shape inference so that
  intermediate shapes are available in ``graph.value_info``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
BATCH_DIM = "N"
PRODUCER = "kfac_compiler.models"


def fan_in_normal(rng: np.random.Generator, shape: Sequence[int], fan_in: int,
                  gain: float = 1.0) -> np.ndarray:
    """Normal(0, gain / fan_in) weights as float32 (He init for gain=2)."""
    std = np.sqrt(gain / float(fan_in))
    return (rng.standard_normal(tuple(shape)) * std).astype(np.float32)


class GraphBuilder:
    """Accumulates nodes / initializers and enforces unique node names."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._node_names: set[str] = set()
        self._init_names: set[str] = set()

    # -- parameters / constants -------------------------------------------
    def param(self, name: str, value: np.ndarray) -> str:
        """Add a float32 initializer and return its name."""
        if name in self._init_names:
            raise ValueError(f"duplicate initializer {name!r}")
        arr = np.ascontiguousarray(value, dtype=np.float32)
        self.initializers.append(numpy_helper.from_array(arr, name=name))
        self._init_names.add(name)
        return name

    def const(self, name: str, value) -> str:
        """Add a ``Constant`` node named ``name`` producing tensor ``name``."""
        arr = np.asarray(value)
        tensor = numpy_helper.from_array(arr, name=name)
        self._add(helper.make_node("Constant", [], [name], name=name, value=tensor))
        return name

    # -- nodes ---------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], name: str,
           output: str | None = None, **attrs) -> str:
        """Add a node called ``name`` with one output (default ``name + ':0'``)."""
        out = output if output is not None else f"{name}:0"
        self._add(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def _add(self, node: onnx.NodeProto) -> None:
        if node.name in self._node_names:
            raise ValueError(f"duplicate node name {node.name!r}")
        self._node_names.add(node.name)
        self.nodes.append(node)

    # -- finishing -------------------------------------------------------------
    def build(self, inp: onnx.ValueInfoProto, out_name: str,
              out_elem_type: int, out_shape: Sequence, doc: str = "") -> onnx.ModelProto:
        # The last node must write the graph output name.
        last = self.nodes[-1]
        if last.output[0] != out_name:
            self.op("Identity", [last.output[0]], f"{out_name}/Identity", output=out_name)
        graph = helper.make_graph(
            self.nodes, self.name, [inp],
            [helper.make_tensor_value_info(out_name, out_elem_type, list(out_shape))],
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name=PRODUCER, doc_string=doc,
        )
        model.ir_version = IR_VERSION
        model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        onnx.checker.check_model(model, full_check=True)
        return model


def float_input(name: str, shape: Sequence) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def int64_input(name: str, shape: Sequence) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.INT64, list(shape))
