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


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("writer", ["external data", "streamed", "in memory"])
def test_a_converted_model_exports_in_its_type_through_every_writer(kind, writer, tmp_path, monkeypatch):
    """The plan's graph of a converted model (compiled from memory: no source file) is written
    in the source's type by each writer, the trained values cast per tensor as they are
    written: external data (a model over LAZY_EXTERNAL_BYTES, here lowered to 1 KiB; refused
    before), the one protobuf with values streamed from their arrays (LIGHT_VALUE_BYTES
    lowered), exported_model in memory. Truth: the trained float32 values cast by numpy; ONNX
    Runtime running the file (float16; its CPU provider has no bfloat16 Gemm)."""
    from kfac_compiler import onnx_files

    e = ZOO["mlp_classifier"]
    inputs, y = e.make_data(None, seed=0)
    x = inputs["input"]
    trainer = Trainer(kc.compile(with_float_type(e.build(seed=0), TYPES[kind], {TensorProto.FLOAT}), loss=e.loss,
                                 output=e.output_name, emit=False), optimizer="sgd", learning_rate=0.1, threads=1)
    for k in range(2):
        trainer.step({"input": x[k * 64:(k + 1) * 64]}, y[k * 64:(k + 1) * 64])
    trained = trainer.parameters()
    predicted = trainer.predict({"input": x[:32]})  # in float32, as trained; the source's type is taken too
    assert predicted.dtype == np.float32
    np.testing.assert_array_equal(trainer.predict({"input": x[:32].astype(np.float16)}),
                                  trainer.predict({"input": x[:32].astype(np.float16).astype(np.float32)}))
    if writer == "external data":
        monkeypatch.setattr(onnx_files, "LAZY_EXTERNAL_BYTES", 1024)
        monkeypatch.setattr(onnx_files, "LIGHT_VALUE_BYTES", 256)
    elif writer == "streamed":
        monkeypatch.setattr(onnx_files, "LIGHT_VALUE_BYTES", 256)
    if writer == "in memory":
        exported, path = trainer.exported_model(), None
    else:
        path = trainer.export(tmp_path / "trained.onnx")
        assert (tmp_path / "trained.onnx.data").exists() == (writer == "external data")
        exported = onnx.load(path)
    onnx.checker.check_model(exported, full_check=True)
    assert {t.data_type for t in exported.graph.initializer if t.data_type != TensorProto.INT64} == {TYPES[kind]}
    assert exported.graph.input[0].type.tensor_type.elem_type == TYPES[kind] and not exported.metadata_props
    np_type = onnx.helper.tensor_dtype_to_np_dtype(TYPES[kind])
    assert {t.name for t in exported.graph.initializer} >= set(trained)
    for t in exported.graph.initializer:
        if t.name in trained:
            np.testing.assert_array_equal(numpy_helper.to_array(t), trained[t.name].astype(np_type), err_msg=t.name)
    if path is not None and kind == "float16":
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        (logits,) = sess.run(None, {"input": x[:32].astype(np_type)})
        np.testing.assert_allclose(logits.astype(np.float32), predicted, atol=2e-2)


def test_values_count_in_their_initializers_type_against_the_external_data_threshold(monkeypatch):
    """needs_external weighs a float32 value written into a float16 initializer at 2 bytes an
    element, as it will be written: 600 elements are 1,200 bytes there, 2,400 in float32."""
    from kfac_compiler import onnx_files

    monkeypatch.setattr(onnx_files, "LAZY_EXTERNAL_BYTES", 2000)
    values = {"w": np.zeros(600, np.float32)}
    for kind, external in ((TensorProto.FLOAT16, False), (TensorProto.FLOAT, True)):
        g = onnx.helper.make_graph([], "g", [], [], [onnx.helper.make_tensor("w", kind, [600], np.zeros(600))])
        assert onnx_files.needs_external(onnx.helper.make_model(g), values) is external


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


@pytest.mark.parametrize("island", [TensorProto.DOUBLE, TensorProto.FLOAT16])
def test_a_float32_model_with_a_cast_island_trains_as_its_float32_twin(island, tmp_path):
    """Cast to float64 / float16, Tanh, Cast back (an upcast for stability, an autocast island)
    in a float32 model: converted to float32 like a mixed model (its gradient graphs had met the
    builder's float32 constants in the island: an ONNX Runtime type error when training began);
    the steps are those of the same model without the island, and the export keeps it."""
    from onnx import helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W")

    def model(casts: bool) -> onnx.ModelProto:
        nodes = [helper.make_node("MatMul", ["x", "W"], ["h"])]
        if casts:
            nodes += [helper.make_node("Cast", ["h"], ["hc"], to=island), helper.make_node("Tanh", ["hc"], ["t"]),
                      helper.make_node("Cast", ["t"], ["y"], to=TensorProto.FLOAT)]
        else:
            nodes.append(helper.make_node("Tanh", ["h"], ["y"]))
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    x, y = rng.standard_normal((16, 3)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    src = str(tmp_path / "island.onnx")
    onnx.save(model(True), src)
    runs = {}
    for name, m in (("island", src), ("plain", model(False))):
        tr = Trainer(kc.compile(m, loss="squared_error", output="y", emit=False), optimizer="kfac", seed=0, threads=1)
        runs[name] = ([tr.step({"x": x}, y)["loss"] for _ in range(3)], tr)
    np.testing.assert_allclose(runs["island"][0], runs["plain"][0], rtol=1e-5 if island == TensorProto.DOUBLE else 2e-3)
    out = str(tmp_path / "trained.onnx")
    runs["island"][1].export(out)
    exported = onnx.load(out)
    assert [n.op_type for n in exported.graph.node] == ["MatMul", "Cast", "Tanh", "Cast"]
    got = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, runs["island"][1].predict({"x": x}), rtol=1e-3, atol=1e-3)
