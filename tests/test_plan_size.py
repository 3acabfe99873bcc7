"""Plans scale with the model, not with its width squared: no emitted subgraph stores a
constant that grows with the layers' width (conv patch kernels, identity matrices: they
are built at run time), and a saved plan directory is about the model file's size."""
from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save

import kfac_compiler
from kfac_compiler.backend import emit_subgraph

# the subgraphs with the options that emit other code paths (inverse methods, matrix powers)
VARIANTS = [("loss", {}), ("gradients", {}), ("statistics", {}), ("precondition", {}), ("multiply", {}),
            ("multiply", {"exp": 2}), ("inverse_update", {"method": "newton_schulz"}),
            ("inverse_update", {"method": "schur"}), ("kfac_step", {"with_stats": True, "stats_if": True}),
            ("sgd_step", {"multi_tensor": False}), ("adam_step", {"multi_tensor": False}),
            ("sgd_step", {"multi_tensor": True}), ("adam_step", {"multi_tensor": True})]


def wide_conv_model(path, width: int) -> str:
    """x [N, width, 4, 4] -> two 3x3 convs (width channels, pads 1) -> mean pool -> Gemm -> logits [N, 10]."""
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array((0.05 * rng.standard_normal(shape)).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["h1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["h2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["h2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["logits"], transB=1),
    ]
    inits = [init("w1", width, width, 3, 3), init("b1", width), init("w2", width, width, 3, 3), init("b2", width),
             init("w3", 10, width), init("b3", 10)]
    graph = helper.make_graph(nodes, "wide_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width, 4, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, str(path))
    return str(path)


def initializer_bytes(plan) -> dict[str, list[int]]:
    """{subgraph (options): sizes of its initializers in bytes}, every variant."""
    out = {}
    for name, options in VARIANTS:
        model, _ = emit_subgraph(plan, name, **options)
        out[f"{name} {options}"] = [len(numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer]
    return out


def test_no_subgraph_stores_a_width_sized_constant(tmp_path):
    narrow, wide = (kfac_compiler.compile(wide_conv_model(tmp_path / f"w{w}.onnx", w), loss="softmax_cross_entropy",
                                          output="logits", emit=False, budget={"overhead": 0}) for w in (64, 128))
    # full factors (the cost-aware choice off): A is [1153, 1153]
    assert [l.approximation for l in wide.layers][:2] == ["kron", "kron"]
    small, big = initializer_bytes(narrow), initializer_bytes(wide)
    for key in big:
        # a dense identity patch kernel of the 128-channel conv is 5.3 MB, eye(1153) 5.3 MB;
        # what may grow is a probe vector (one float per factor row: 4.6 KB here)
        assert max(big[key]) <= 8192, (key, max(big[key]))
        assert sum(big[key]) - sum(small[key]) <= 16384, (key, sum(small[key]), sum(big[key]))


def test_saved_plan_is_about_the_model_file(tmp_path):
    src = wide_conv_model(tmp_path / "wide.onnx", 128)
    plan = kfac_compiler.compile(src, loss="softmax_cross_entropy", output="logits")
    out = plan.save(tmp_path / "plan")
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    model = os.path.getsize(src)
    assert model > 1_000_000  # the two convs' weights
    assert total <= 1.5 * model, {f: os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)}


@pytest.mark.parametrize("patches", ["depthwise", "slices"])
def test_wide_conv_patches_match_im2col(patches):
    """The patch tensor of a 128-channel conv (group 4, stride 2, dilation 2) equals numpy's im2col."""
    from kfac_compiler.blocks import make_block
    from kfac_compiler.ir import Layer, LayerUse
    from test_blocks import explicit_patches, run_graph

    attrs = dict(kernel_shape=[3, 3], strides=[2, 1], pads=[2, 1, 1, 2], dilations=[2, 1], group=4)
    layer = Layer("c", "conv", ("W", "b"), (LayerUse(("n",), "x", "y"),), attrs=attrs, approximation="kron")
    blk = make_block(layer, {"W": (64, 32, 3, 3), "b": (64,)}, patches=patches)
    x = np.random.default_rng(1).standard_normal((2, 128, 5, 4)).astype(np.float32)
    out = run_graph(lambda b: {"P": blk._emit_patches(b, "x")}, {"x": x})["P"]
    np.testing.assert_array_equal(out, explicit_patches(x.astype(np.float64), attrs, 4, True))
