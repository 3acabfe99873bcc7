"""Trainer.parameters() / set_parameters() speak the user's model: its initializers' names and
shapes, where the plan holds some in its own layout (torch.export's LSTM/GRU assembled at run
time and lowered per direction, TorchScript's fused GRU lowered, a GroupNorm affine re-laid
out [C] -> [C, 1, 1]); layout="plan" gives the plan's own (Plan.trainable).

Truth, independent of the plan: the source .onnx file's initializers (names, shapes, values),
torch's autograd gradients stored with each fixture (tests/fixtures/real/*.npz, recovered
here from one plain SGD step in the user's layout), and ONNX Runtime run on the source file
with the values written into its initializers."""
from __future__ import annotations

import json
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import kfac_compiler as kc
from kfac_compiler.errors import CheckpointError, ConfigError
from kfac_compiler.runtime import Trainer

FIXTURES = Path(__file__).parent / "fixtures" / "real"
# a torch.export LSTM without its optimizer (assembled + lowered), TorchScript's fused GRU
# (lowered), a GroupNorm whose affine torch.export unsqueezes at run time (a view)
CASES = ("lstm-dynamo_noopt", "bilstm-dynamo_noopt", "gru-ts", "groupnorm-dynamo_noopt")
LR = 0.5


@cache
def _plan(case: str):
    path = FIXTURES / f"{case}.onnx"
    if not path.exists():
        pytest.skip("no real-export fixtures")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kc.compile(str(path), loss="softmax_cross_entropy", output="logits", emit=False)


def _source(case: str) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(FIXTURES / f"{case}.onnx")).graph.initializer}


def _torch(case: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """({source initializer: torch's value}, {source initializer: torch's gradient}, data)."""
    with np.load(FIXTURES / f"{case}.npz") as d:
        data = {k: d[k] for k in d.files}
    shapes = {k: v.shape for k, v in _source(case).items()}
    index = {str(n): data[f"init_index_{i}"] for i, n in enumerate(data["init_names"])}
    values = {n: data["ref_values"][k].reshape(shapes[n]) for n, k in index.items()}
    grads = {n: data["ref_grads"][k].reshape(shapes[n]) for n, k in index.items()}
    return values, grads, data


def _source_loss(case: str, values: dict[str, np.ndarray], data: dict) -> float:
    """Softmax cross-entropy of the SOURCE file run by ONNX Runtime with `values` written into its
    initializers: summed over a sequence's positions, mean over the examples (the plan's loss)."""
    model = onnx.load(str(FIXTURES / f"{case}.onnx"))
    for t in model.graph.initializer:
        if t.name in values:
            t.CopyFrom(numpy_helper.from_array(np.asarray(values[t.name], dtype=numpy_helper.to_array(t).dtype), t.name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(["logits"], {"input": data["input"]})
    z = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    y = data["targets"].reshape(-1)
    logp = z - z.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].sum() / len(data["targets"]))


@pytest.mark.parametrize("case", CASES)
def test_parameters_are_the_source_files_initializers(case):
    """parameters() has exactly the source file's trainable initializers, their shapes and
    values (torch's, per the fixture); layout="plan" has Plan.trainable with the plan's shapes,
    which differ from the source's on every one of these fixtures."""
    plan = _plan(case)
    source = _source(case)
    torch_values, _, _ = _torch(case)
    trainer = Trainer(plan, optimizer="sgd")
    got = trainer.parameters()
    assert list(got) == list(plan.source_trainable())
    assert set(got) == set(torch_values)  # the fixtures train every initializer torch names
    for name, v in got.items():
        assert v.shape == source[name].shape, name
        np.testing.assert_array_equal(v, source[name], err_msg=name)
        np.testing.assert_array_equal(v, torch_values[name], err_msg=name)
    ours = trainer.parameters(layout="plan")
    assert list(ours) == list(plan.trainable)
    assert {n: v.shape for n, v in ours.items()} == {n: plan.param_shapes[n] for n in plan.trainable}
    assert {n: v.shape for n, v in ours.items()} != {n: v.shape for n, v in got.items()}


@pytest.mark.parametrize("case", CASES)
def test_one_sgd_step_in_the_users_layout_is_torchs_gradient(case):
    """Plain SGD (momentum 0): (before - after) / lr in the user's layout is torch's gradient of
    each source initializer (the fixture's float32 autograd), to the gradient test's tolerance."""
    plan = _plan(case)
    _, torch_grads, data = _torch(case)
    trainer = Trainer(plan, optimizer="sgd", learning_rate=LR, momentum=0.0, batch_size=len(data["targets"]))
    before = trainer.parameters()
    trainer.step({"input": data["input"]}, data["targets"])
    after = trainer.parameters()
    scale = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in torch_grads.values())))
    for name, g in torch_grads.items():
        ours = (before[name].astype(np.float64) - after[name]) / LR
        err, norm = float(np.linalg.norm(ours - g)), float(np.linalg.norm(g))
        assert err <= 1e-4 * scale + 1e-3 * norm, f"{name}: |diff| {err:.2e} (|grad| {norm:.2e}, all {scale:.2e})"


@pytest.mark.parametrize("case", CASES)
def test_set_parameters_in_the_users_layout_is_what_the_source_file_computes(case):
    """Values set in the user's names and shapes are what the plan trains with: the trainer's
    loss equals ONNX Runtime's on the source file holding the same values; a partial set
    changes only the given parameter (the plan's holders of the others are unchanged), and
    parameters() gives the values back exactly."""
    plan = _plan(case)
    _, _, data = _torch(case)
    trainer = Trainer(plan, optimizer="sgd")
    rng = np.random.default_rng(1)
    new = {n: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for n, v in trainer.parameters().items()}
    trainer.set_parameters(new)
    back = trainer.parameters()
    assert all(np.array_equal(back[n], new[n]) for n in new)
    loss = trainer.evaluate({"input": data["input"]}, data["targets"])["loss"]
    np.testing.assert_allclose(loss, _source_loss(case, new, data), rtol=1e-5)
    held = [n for n, s in plan.source_trainable().items() if n not in plan.trainable or plan.param_shapes[n] != s]
    one = held[0]
    plan_before = trainer.parameters(layout="plan")
    trainer.set_parameters({one: np.zeros_like(new[one])})
    after = trainer.parameters()
    assert not np.any(after[one]) and all(np.array_equal(after[n], new[n]) for n in new if n != one)
    holders = set(plan.holders(one))
    changed = {p for p, v in trainer.parameters(layout="plan").items() if not np.array_equal(v, plan_before[p])}
    assert changed and changed <= holders


def test_a_plan_layout_name_wrong_shape_or_layout_is_one_line():
    """In the user's layout, a plan-layout name is refused naming the parameter it holds; a
    wrong shape names the user's shape; an unknown layout is refused; layout="plan" takes
    the plan's names."""
    plan = _plan("lstm-dynamo_noopt")
    trainer = Trainer(plan, optimizer="sgd")
    piece = next(p for p in plan.trainable if p not in plan.source_trainable())
    src = next(s for s, h in plan.source_holders().items() if piece in h and s in plan.source_trainable())
    value = trainer.parameters(layout="plan")[piece]
    with pytest.raises(ConfigError, match=rf"^'{piece}' is a name in the plan's layout \(it holds '{src}' "):
        trainer.set_parameters({piece: value})
    shape = list(plan.source_trainable()[src])
    with pytest.raises(ConfigError, match=rf"^parameter '{src}' has shape \{shape}\ in your model; got \[1\]$"
                       .replace("\\{", "\\[").replace("\\}", "\\]")):
        trainer.set_parameters({src: np.zeros(1, np.float32)})
    gn = _plan("groupnorm-dynamo_noopt")
    view = next(n for n, s in gn.source_trainable().items() if gn.param_shapes.get(n) not in (None, s))
    with pytest.raises(ConfigError, match=rf"^parameter '{view}' has shape .* in your model; got .*pass layout='plan'\)$"):
        Trainer(gn, optimizer="sgd").set_parameters({view: np.zeros(gn.param_shapes[view], np.float32)})
    with pytest.raises(ConfigError, match="not a trainable parameter of the model"):
        trainer.set_parameters({"nope": np.zeros(1, np.float32)})
    with pytest.raises(ConfigError, match="layout must be one of 'source', 'plan', got 'torch'"):
        trainer.parameters(layout="torch")
    trainer.set_parameters({piece: value + 1}, layout="plan")
    np.testing.assert_array_equal(trainer.parameters(layout="plan")[piece], value + 1)


@pytest.mark.slow
def test_a_checkpoint_is_tagged_with_the_plan_layout_and_restores_the_users_parameters(tmp_path):
    """The checkpoint's slots are the plan's state (meta "layout": "plan"); a trainer loaded
    from it gives the saved trainer's parameters in the user's layout, bit for bit; another
    layout tag is refused in one line."""
    from test_load_validation import rewritten

    plan = _plan("lstm-dynamo_noopt")
    _, _, data = _torch("lstm-dynamo_noopt")
    trainer = Trainer(plan, optimizer="kfac", batch_size=len(data["targets"]))
    trainer.step({"input": data["input"]}, data["targets"])
    path = trainer.save_checkpoint(tmp_path / "run.ckpt")
    with np.load(path) as z:
        assert json.loads(bytes(z["__meta__"]).decode())["layout"] == "plan"
    loaded = Trainer.load_checkpoint(path, plan)
    want, got = trainer.parameters(), loaded.parameters()
    assert list(got) == list(plan.source_trainable())
    assert all(np.array_equal(got[n], want[n]) for n in want)
    bad = rewritten(path, tmp_path / "bad.ckpt", lambda m, a: m.update(layout="source"))
    with pytest.raises(CheckpointError, match=r"metadata entry 'layout' is 'source'; this kfac_compiler writes"):
        Trainer.load_checkpoint(bad, plan)
