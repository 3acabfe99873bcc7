"""Models in float16, bfloat16 and float64 train: the front end converts them to float32
(weights, factors, forward and backward; ONNX Runtime's CPU provider has few float16 kernels)
and `Trainer.export` writes the trained model back in the source's float type. Truth: the
same steps on the float32 model holding the same (rounded) weights; ONNX Runtime running the
exported model."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

import kfac_compiler as kc
from kfac_compiler.graph import with_float_type
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer

TYPES = {"float64": TensorProto.DOUBLE, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def losses(model: onnx.ModelProto, x, y, steps: int = 6) -> tuple[list[float], Trainer]:
    e = ZOO["mlp_classifier"]
    tr = Trainer(kc.compile(model, loss=e.loss, output=e.output_name, emit=False), optimizer="kfac", threads=1)
    return [tr.step({"input": x[k * 64:(k + 1) * 64]}, y[k * 64:(k + 1) * 64])["loss"] for k in range(steps)], tr


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TYPES))
def test_a_model_in_another_float_type_trains_as_its_float32_twin_and_exports_in_its_type(kind, tmp_path):
    e = ZOO["mlp_classifier"]
    source = with_float_type(e.build(seed=0), TYPES[kind], {TensorProto.FLOAT})
    twin = with_float_type(source, TensorProto.FLOAT, {TYPES[kind]})  # the same rounded weights in float32
    inputs, y = e.make_data(None, seed=0)
    x = inputs["input"]
    got, trainer = losses(source, x, y)
    want, twin_trainer = losses(twin, x, y)
    assert got == want and got[-1] < got[0]
    assert any(kind in note and "trained in float32" in note for note in trainer.plan.notes)

    path = trainer.export(tmp_path / "trained.onnx")
    exported = onnx.load(path)
    assert {t.data_type for t in exported.graph.initializer if t.data_type != TensorProto.INT64} == {TYPES[kind]}
    assert exported.graph.input[0].type.tensor_type.elem_type == TYPES[kind]
    assert not exported.metadata_props  # the front end's record of the source type is not the user's
    trained = twin_trainer.parameters()
    np_type = onnx.helper.tensor_dtype_to_np_dtype(TYPES[kind])
    for t in exported.graph.initializer:
        if t.name in trained:
            np.testing.assert_array_equal(numpy_helper.to_array(t), trained[t.name].astype(np_type), err_msg=t.name)
    if kind != "bfloat16":  # ONNX Runtime's CPU provider has no bfloat16 Gemm
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        (logits,) = sess.run(None, {"input": x[:32].astype(np_type)})
        expected = twin_trainer.predict({"input": x[:32]})
        np.testing.assert_allclose(logits.astype(np.float32), expected, atol=2e-2 if kind == "float16" else 1e-5)


@pytest.mark.slow
def test_float16_data_trains_a_float16_model_from_the_command_line(tmp_path, capsys):
    from kfac_compiler.cli import main

    e = ZOO["mlp_classifier"]
    model = tmp_path / "m16.onnx"
    onnx.save(with_float_type(e.build(seed=0), TensorProto.FLOAT16, {TensorProto.FLOAT}), model)
    inputs, y = e.make_data(None, seed=0)
    np.savez(tmp_path / "d.npz", input=inputs["input"].astype(np.float16), targets=y)
    out = tmp_path / "t.onnx"
    code = main(["train", str(model), "--loss", "softmax_cross_entropy", "--data", str(tmp_path / "d.npz"),
                 "--steps", "5", "-q", "--save", str(out)])
    assert code == 0, capsys.readouterr().err
    assert onnx.load(out).graph.initializer[0].data_type == TensorProto.FLOAT16
