"""Safeguards: no update whose loss, loss after it or value is non-finite stays applied, and a
run that ends with a non-finite loss fails. The model is y = (x W) * sqrt(s) with s just above 0
and zero targets: the first K-FAC update drives s below 0, where the loss is NaN."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.cli import main
from kfac_compiler.runtime import Trainer


def sqrt_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "fc.weight"),
             numpy_helper.from_array(np.full(3, 1e-4, np.float32), "s")]
    nodes = [helper.make_node("MatMul", ["x", "fc.weight"], ["a"]), helper.make_node("Sqrt", ["s"], ["r"]),
             helper.make_node("Mul", ["a", "r"], ["y"])]
    g = helper.make_graph(nodes, "sqrt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def batch():
    x = np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32)
    return {"x": x}, np.zeros((32, 3), np.float32)


def test_first_step_with_a_nan_loss_after_is_rejected():
    trainer = Trainer(kc.compile(sqrt_model(), loss="squared_error"), optimizer="kfac")
    before = trainer.parameters()
    inputs, y = batch()
    m = trainer.step(inputs, targets=y)
    assert np.isnan(m["new_loss"]) and m["rejected"] == 1.0 and m["update_norm"] == 0.0
    assert all(np.array_equal(before[p], v) for p, v in trainer.parameters().items())
    assert trainer.applied_steps == 0 and m["damping"] * 10 == trainer.damping


def test_an_unchecked_update_whose_loss_is_nan_is_undone():
    trainer = Trainer(kc.compile(sqrt_model(), loss="squared_error"), optimizer="kfac", damping_adaptation_interval=5)
    inputs, y = batch()
    history = []
    for _ in range(6):
        params = trainer.parameters()
        history.append((params, trainer.step(inputs, targets=y)))
    rolled = [i for i, (_, m) in enumerate(history) if m.get("rolled_back")]
    assert rolled, "the model must produce an update with a NaN loss (else this test checks nothing)"
    for i in rolled:  # back to the parameters before the undone update, which was step i - 1
        assert np.isnan(history[i][1]["loss"]) and history[i - 1][1]["rejected"] == 0.0
        undone_from = history[i - 1][0]
        after = history[i + 1][0] if i + 1 < len(history) else trainer.parameters()
        for p in undone_from:
            np.testing.assert_allclose(after[p], undone_from[p], rtol=1e-6, atol=1e-9)
    final = trainer.parameters()
    assert np.all(final["s"] > 0) and np.isfinite(trainer.evaluate(inputs, y)["loss"])


def test_train_exits_nonzero_on_a_non_finite_final_loss(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    onnx.save(sqrt_model(), model)
    data = tmp_path / "d.npz"
    inputs, y = batch()
    np.savez(data, x=inputs["x"], targets=y)
    code = main(["train", str(model), "--loss", "squared_error", "--data", str(data), "--optimizer", "sgd",
                 "--learning-rate", "100", "--steps", "3", "--batch-size", "32", "-q", "--save", str(tmp_path / "out.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: training ended with a non-finite loss")
    assert (tmp_path / "out.onnx").exists()


def linear_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "fc.weight")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "fc.weight"], ["y"])], "linear",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_train_exits_nonzero_on_a_finite_loss_far_above_the_first(tmp_path, capsys):
    """With zero targets and x.T x / N ~ I, an SGD step multiplies W by about 1 - lr: the loss
    grows ~(lr - 1)^2 per step and stays finite. lr 11 (x100 per step, ~1e6 after 3 steps)
    fails the run; lr 3 (x4 per step, ~200x) is not flagged."""
    model, data = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(linear_model(), model)
    inputs, y = batch()
    np.savez(data, x=inputs["x"], targets=y)

    def train(lr: str) -> tuple[int, list[str], str]:
        code = main(["train", str(model), "--loss", "squared_error", "--data", str(data), "--optimizer", "sgd",
                     "--momentum", "0", "--learning-rate", lr, "--steps", "3", "--batch-size", "32", "-q",
                     "--save", str(tmp_path / f"out{lr}.onnx")])
        out, err = capsys.readouterr()
        return code, err.strip().splitlines(), out

    code, err, out = train("11")
    final = float(out.split("final train loss ")[1].split()[0])
    assert code == 1 and np.isfinite(final) and final > 1e5
    assert err[-1].startswith("error: training ended with loss") and "over 1000x the first step's" in err[-1]
    assert (tmp_path / "out11.onnx").exists()
    code, err, out = train("3")
    final = float(out.split("final train loss ")[1].split()[0])
    assert code == 0 and not err and 100 < final < 1e4, (final, err)
