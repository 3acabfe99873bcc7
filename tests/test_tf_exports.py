"""tf2onnx exports of small Keras models against TensorFlow's own gradients
(tests/fixtures/tf, README there).

With the squared-error loss (variance 1) at targets y = z - u, `kc.gradients` returns the
ONNX gradient of sum(z * u) times 1/N, which is TF's `tape.gradient(sum(out * u), var)`
once the initializer's layout is undone."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

import kfac_compiler as kc
from helpers import run_model

FIXTURES = Path(__file__).parent / "fixtures" / "tf"


def fixture(stem: str) -> tuple[str, dict[str, np.ndarray]]:
    path = FIXTURES / f"{stem}.onnx"
    return str(path), dict(np.load(FIXTURES / f"{stem}.npz"))


def source_gradients(path: str, data: dict[str, np.ndarray], **options) -> tuple[kc.Plan, dict[str, np.ndarray]]:
    """The plan and the ONNX gradients of sum(z * u) in the user's layout (initializer names)."""
    x, u = data["input"], data["u"]
    z = run_model(onnx.load(path), {"input": x}, "logits")
    plan = kc.compile(path, loss="squared_error", output="logits", emit=False, **options)
    _, grads = kc.gradients(plan, {"input": x}, (z - u).astype(np.float32))
    return plan, {k: v * len(x) for k, v in plan.source_values(grads).items()}


def keras_to_onnx_gates(h: int) -> np.ndarray:
    """Rows of Keras' LSTM gate order i, f, c, o in ONNX's i, o, f, c."""
    return np.concatenate([np.arange(h) + h * k for k in (0, 3, 1, 2)])


def test_bidirectional_lstm_directions_keep_their_own_input_bias():
    """A Keras Bidirectional LSTM starts with the same bias in both directions (zeros and the
    forget gate's ones); the lowering's per-direction pieces were retied as an exporter's copy
    and trained as one parameter (the reverse direction's gradient 0, exported as 0)."""
    path, data = fixture("bilstm-op17")
    plan, grads = source_gradients(path, data)
    assert plan.retied == {}
    b_name = next(k for k in grads if k.startswith("B__"))
    b = grads[b_name]  # [2 directions, Wb (4H) + Rb (4H)]
    h = 6
    rows = keras_to_onnx_gates(h)
    for d, keras in enumerate(("forward", "backward")):
        tf_grad = data[f"grad/bi/{keras}_lstm_1/lstm_cell/bias:0"][rows]
        for part in (slice(0, 4 * h), slice(4 * h, 8 * h)):  # Keras' one bias is ONNX's Wb + Rb
            np.testing.assert_allclose(b[d, part], tf_grad, rtol=1e-4, atol=1e-5 * np.abs(tf_grad).max())


@pytest.mark.parametrize("untie", [[], "uniform", "all"])
def test_lstm_time_steps_share_its_weights_without_a_merge_warning(untie):
    """tf2onnx writes a Keras LSTM's missing recurrent bias as zeros; the lowering's time
    steps read that piece, which was reported as an exporter's merge "to untie" (--untie
    uniform), and following the advice trained one recurrent bias per time step (the user's
    LSTM cannot hold them: the export was 25-88% off). No warning; untie leaves the pieces
    alone, and the gradients of W, R, B are TF's."""
    path, data = fixture("lstm-op17")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan, grads = source_gradients(path, data, untie=untie)
    assert not [str(w.message) for w in caught if "untie" in str(w.message)]
    assert not [p for p in plan.trainable if ".untied" in p]
    h = 8
    rows = keras_to_onnx_gates(h)
    cell = "grad/lstm/lstm_cell"
    bias = data[f"{cell}/bias:0"][rows]
    expected = {"W0__548": data[f"{cell}/kernel:0"].T[rows], "R0__549": data[f"{cell}/recurrent_kernel:0"].T[rows],
                "B0__550": np.concatenate([bias, bias])}  # Keras' one bias is ONNX's Wb + Rb
    for name, tf_grad in expected.items():
        np.testing.assert_allclose(grads[name][0], tf_grad, rtol=1e-4, atol=1e-5 * np.abs(tf_grad).max(), err_msg=name)


def tf_gradient_errors(stem: str, grads: dict[str, np.ndarray], data: dict[str, np.ndarray]) -> dict[str, float]:
    """{Keras variable: largest error of its gradient} where `<stem>.map.json` says which
    initializers hold it (initializer = transpose(variable, perm), reshaped): a variable
    several initializers hold (tf2onnx's Shape-only copies) gets the sum of theirs."""
    info = json.loads((FIXTURES / f"{stem}.map.json").read_text())
    errors = {}
    for var, entry in info["map"].items():
        tf_grad = data[f"grad/{var}"]
        ours = np.zeros_like(tf_grad)
        for name, perm in entry["hits"]:
            if name in grads:
                laid = np.transpose(tf_grad, perm).shape
                ours += np.transpose(grads[name].reshape(laid), np.argsort(perm))
        errors[var] = float(np.abs(ours - tf_grad).max())
    return errors


def test_attention_output_kernel_behind_a_folded_reshape_is_fully_connected():
    """tf2onnx writes a Keras MultiHeadAttention's output kernel [2, 4, 8] as [1, 1, 8, 2, 4]
    read by a Reshape whose target it computes from Shape(kernel); once that target is folded
    the Shape reads the kernel dead, and the relayout fold, run before dead nodes were
    dropped, saw the kernel read twice: a generic layer instead of fully connected."""
    path, data = fixture("transformer-op17")
    plan, grads = source_gradients(path, data)
    info = json.loads((FIXTURES / "transformer-op17.map.json").read_text())
    ((kernel, _),) = info["map"]["mha/attention_output/kernel:0"]["hits"]  # [1, 1, 8, 2, 4]
    assert [l.kind for l in plan.layers if kernel in l.params] == ["fully_connected"]
    assert not [l.name for l in plan.layers if l.kind == "generic"]
    errors = tf_gradient_errors("transformer-op17", grads, data)
    scale = max(np.abs(v).max() for k, v in data.items() if k.startswith("grad/"))
    assert max(errors.values()) < 1e-6 * scale, errors  # of the largest: the key bias' is 0 up to rounding


def test_softmax_cross_entropy_on_a_softmax_output_is_warned_with_the_scores_to_pass():
    """A Keras classifier ending in Dense(k, activation="softmax") exports its probabilities;
    softmax_cross_entropy on them trained a double softmax without a word. The warning names
    the Softmax node and its input; compiled on that input, the loss is the cross-entropy of
    TF's own probabilities."""
    path, data = fixture("mlp_softmax-op17")
    with pytest.warns(UserWarning) as caught:
        plan = kc.compile(path, loss="softmax_cross_entropy", emit=False)
    scores = "mlp_softmax/probs/BiasAdd:0"
    want = (f"output 'probs' is computed by Softmax node 'mlp_softmax/probs/Softmax': softmax_cross_entropy applies "
            f"its own softmax to the scores it is given, so this trains a softmax of probabilities (a double softmax); "
            f"pass {scores!r} as the output instead (--output {scores}; output={scores!r} in the API)")
    assert want in [str(w.message) for w in caught] and want in plan.notes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = kc.compile(path, loss="softmax_cross_entropy", output=scores, emit=False)
    x, probs = data["input"], data["out"].astype(np.float64)
    y = np.arange(len(x)) % probs.shape[1]
    loss, _ = kc.gradients(fixed, {"input": x}, y)
    assert loss == pytest.approx(-np.log(probs[np.arange(len(x)), y]).mean(), rel=1e-5)
