"""Checkpoints: atomic .npz files; resuming continues the SAME trajectory bit-for-bit on CPU."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

import kfac_compiler as kc
from helpers import sampled_batch as batch
from helpers import zoo_case, zoo_plan
from kfac_compiler.errors import CheckpointError, PlanError
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.checkpoint import plan_fingerprint, read_meta


@pytest.fixture(scope="module")
def mlp():
    plan, inputs, y = zoo_case("mlp_classifier", 256)
    return plan, inputs["input"], y


# Small periods so that inverse refreshes, damping adaptation and fused steps all happen on
# both sides of the checkpoint. With cov_update_period=2 the first step after it (step 3)
# skips the statistics: a fresh trainer whose store never held their noise or EMA weight.
KNOBS = {
    "kfac": dict(inv_update_period=2, damping_adaptation_interval=2, cov_update_period=1),
    "kfac-stats-every-2": dict(inv_update_period=2, damping_adaptation_interval=2, cov_update_period=2),
    # three refresh groups over a period of 4: groups 1, 2 refreshed after steps 1, 2, none
    # after step 3 (the first after the checkpoint), group 0 after 4, group 1 after 5
    "kfac-spread-refresh": dict(inv_update_period=4, inverse_groups=3, damping_adaptation_interval=2),
    # the plateau rule's c doubles after steps 3 (its window half full at the checkpoint) and 5
    "kfac-plateau": dict(inv_update_period=2, curvature_scale_window=2, curvature_scale_plateau=0.99),
    # early windows of 2 in windows of 3, judged against the first window's median (carried,
    # with the count of losses): c doubles after steps 4 (66% due) and 6 (132% due)
    "kfac-plateau-early": dict(inv_update_period=2, curvature_scale_window=3, curvature_scale_early_window=2,
                               curvature_scale_plateau=0.99),
    "adam": dict(learning_rate=3e-3),
    "sgd": dict(learning_rate=0.05),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KNOBS))
def test_resume_is_bit_for_bit(mlp, tmp_path, name):
    plan, x, y = mlp
    opt = name.split("-")[0]
    straight = Trainer(plan, optimizer=opt, seed=7, **KNOBS[name])
    m_straight = [straight.step(*batch(x, y, s)) for s in range(6)]

    first = Trainer(plan, optimizer=opt, seed=7, **KNOBS[name])
    for s in range(3):
        first.step(*batch(x, y, s))
    path = tmp_path / "run.ckpt.npz"
    first.save_checkpoint(path)
    del first
    resumed = Trainer.load_checkpoint(path, plan)  # a new Trainer: optimizer and knobs from the file
    assert resumed.optimizer == opt and resumed.step_count == 3
    m_resumed = [resumed.step(*batch(x, y, s)) for s in range(3, 6)]

    a, b = straight.parameters(), resumed.parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    sa, sb = straight.state(), resumed.state()
    assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert [m["loss"] for m in m_straight[3:]] == [m["loss"] for m in m_resumed]
    if "inverse_groups" in KNOBS[name]:  # the refresh phase continues where it stopped
        groups = [m["inverse_group"] for m in m_resumed]
        assert groups[1:] == [0.0, 1.0] and np.isnan(groups[0])
        assert groups[1:] == [m["inverse_group"] for m in m_straight[4:]]
    assert straight.host_state() == resumed.host_state()  # damping, moving-average weight, counters
    if "curvature_scale_window" in KNOBS[name]:
        assert [m["curvature_scale"] for m in m_resumed] == [1.0, 2.0, 2.0]
    assert straight.rng.bit_generator.state == resumed.rng.bit_generator.state


@pytest.mark.slow
def test_restore_into_existing_trainer_and_contents(mlp, tmp_path):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="kfac", seed=1, damping=0.01)
    for s in range(4):
        tr.step(*batch(x, y, s))
    path = tr.save_checkpoint(tmp_path / "a.npz")
    meta = read_meta(path)
    assert meta["optimizer"] == "kfac" and meta["knobs"]["damping"] == 0.01
    assert meta["host"]["step_count"] == 4 and meta["plan"]["fingerprint"] == plan_fingerprint(plan)["fingerprint"]
    assert set(meta["slots"]) == set(tr.store.slots())
    assert "velocity/fc1.weight" in meta["slots"] and "factor/fc2/A" in meta["slots"]
    json.dumps(meta["rng"])  # the generator state is plain JSON
    other = Trainer(plan, optimizer="kfac", seed=99, damping=0.01)
    other.restore(path)
    assert other.step_count == 4 and other.damping == tr.damping
    nxt = batch(x, y, 10)
    assert tr.step(*nxt)["loss"] == other.step(*nxt)["loss"]
    assert all(np.array_equal(v, other.parameters()[k]) for k, v in tr.parameters().items())


def test_checkpoint_of_another_plan_is_refused(mlp, tmp_path):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="sgd")
    tr.step(*batch(x, y, 0))
    path = tr.save_checkpoint(tmp_path / "mlp.npz")
    smaller = zoo_plan("mlp_classifier", hidden=(32, 32))
    with pytest.raises(CheckpointError, match="another plan") as e:
        Trainer.load_checkpoint(path, smaller)
    assert "\n" not in str(e.value)
    reseeded = zoo_plan("mlp_classifier")  # same architecture ...
    assert plan_fingerprint(reseeded) == plan_fingerprint(plan)
    other_init = kc.compile(ZOO["mlp_classifier"].build(seed=1), loss="softmax_cross_entropy", output="logits", emit=False)
    with pytest.raises(CheckpointError, match="different source model"):  # ... other source weights
        Trainer.load_checkpoint(path, other_init)
    with pytest.raises(CheckpointError, match="optimizer"):
        Trainer(plan, optimizer="adam").restore(path)


def test_unreadable_checkpoints(tmp_path, mlp):
    plan, _, _ = mlp
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer.load_checkpoint(tmp_path / "nope.npz", plan)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    with pytest.raises(CheckpointError):
        Trainer.load_checkpoint(junk, plan)
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    with pytest.raises(CheckpointError, match="not a kfac_compiler checkpoint"):
        Trainer.load_checkpoint(tmp_path / "plain.npz", plan)


def test_checkpoint_writes_are_atomic(mlp, tmp_path, monkeypatch):
    plan, x, y = mlp
    tr = Trainer(plan, optimizer="sgd")
    tr.step(*batch(x, y, 0))
    path = tmp_path / "c.npz"
    tr.save_checkpoint(path)
    good = path.read_bytes()
    tr.step(*batch(x, y, 1))

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(CheckpointError, match=r"^cannot write the checkpoint '.*c\.npz': disk full$"):
        tr.save_checkpoint(path)
    monkeypatch.undo()
    assert path.read_bytes() == good  # the previous checkpoint is intact
    assert os.listdir(tmp_path) == ["c.npz"]  # and no temporary file is left behind
    assert read_meta(path)["host"]["step_count"] == 1


def test_load_checkpoint_takes_its_own_optimizer_and_refuses_another(mlp, tmp_path):
    """optimizer= naming the checkpoint's own optimizer is accepted (it was a TypeError:
    'multiple values for optimizer'); another one is one line, as the CLI's --optimizer."""
    from kfac_compiler.errors import ConfigError

    plan, x, y = mlp
    first = Trainer(plan, optimizer="kfac", seed=7)
    first.step(*batch(x, y, 0))
    path = tmp_path / "run.ckpt.npz"
    first.save_checkpoint(path)
    again = Trainer.load_checkpoint(path, plan, optimizer="kfac")
    assert again.optimizer == "kfac" and again.step_count == 1
    with pytest.raises(ConfigError, match="was written by optimizer 'kfac', not 'adam'"):
        Trainer.load_checkpoint(path, plan, optimizer="adam")


def test_the_public_load_plan_skips_the_source_check_when_asked(tmp_path):
    """kfac_compiler.load_plan(dir, check_source=False), as docs/frontend.md documents (the
    public wrapper dropped the keyword): a plan whose source changed loads."""
    src = tmp_path / "m.onnx"
    from kfac_compiler.models import save_model

    save_model("mlp_classifier", src)
    kc.compile(str(src), loss="softmax_cross_entropy", output="logits", emit=False).save(tmp_path / "plan")
    src.write_bytes(src.read_bytes() + b" ")  # the source changed: stale
    with pytest.raises(PlanError, match="stale"):
        kc.load_plan(tmp_path / "plan")
    assert kc.load_plan(tmp_path / "plan", check_source=False).trainable


def test_api_outputs_do_not_overwrite_what_the_plan_reads(tmp_path):
    """Trainer.export and save_checkpoint refuse, in one line, the model the plan was
    compiled from, its external data and the files of the folder it was loaded from (they
    replaced the user's model or its weights file, or a plan's model.onnx, whose trained
    weights a fresh Trainer then started from); another file in that folder is fine. The same
    inputs as the command line's (outputs.plan_inputs)."""
    from kfac_compiler.errors import OutputError
    from kfac_compiler.models import save_model

    src = tmp_path / "m.onnx"
    save_model("mlp_classifier", src)
    onnx.save(onnx.load(src), src, save_as_external_data=True, location="m.weights", size_threshold=0)
    kc.compile(str(src), loss="softmax_cross_entropy", output="logits").save(tmp_path / "plan")
    plan = kc.load_plan(tmp_path / "plan")
    trainer = Trainer(plan, optimizer="sgd")
    before = {p: (tmp_path / p).read_bytes() for p in ("m.onnx", "m.weights", "plan/model.onnx", "plan/plan.json")}
    for path, write, hit in [(src, trainer.export, f"'{src}', the plan's source model"),
                             (tmp_path / "m.weights", trainer.export, f"'{tmp_path}/m.weights', the external data of"),
                             (tmp_path / "m.weights", trainer.save_checkpoint, ".*, the external data of"),
                             (tmp_path / "plan" / "model.onnx", trainer.export, "a file of the plan folder"),
                             (tmp_path / "plan" / "plan.json", trainer.save_checkpoint, "a file of the plan folder")]:
        with pytest.raises(OutputError, match=f"would overwrite {hit}"):
            write(path)
    assert {p: (tmp_path / p).read_bytes() for p in before} == before
    trainer.export(tmp_path / "plan" / "trained.onnx")


def test_adam_resumed_with_beta1_uses_it(mlp, tmp_path):
    """load_checkpoint(..., beta1=0.5) continues with beta1 0.5 (the stored alias momentum
    0.9 won, silently): the first resumed step is numpy's Adam from the checkpoint's m and v
    with beta1 0.5; momentum=0.5 (the alias) takes the same step; beta1 and momentum both
    given and different are refused, as on a fresh trainer."""
    from kfac_compiler import contract as C
    from kfac_compiler.errors import ConfigError
    from kfac_compiler.runtime import gradients

    plan, x, y = mlp
    first = Trainer(plan, optimizer="adam", seed=7, learning_rate=3e-3)
    for s in range(2):
        first.step(*batch(x, y, s))
    path = tmp_path / "adam.ckpt.npz"
    first.save_checkpoint(path)
    theta, state = first.parameters(), first.state()
    _, g = gradients(plan, *batch(x, y, 2), params=theta)
    b1, b2, eps, lr, t = 0.5, 0.999, 1e-8, 3e-3, 3
    steps = {}
    for knob in ("beta1", "momentum"):
        resumed = Trainer.load_checkpoint(path, plan, **{knob: b1})
        resumed.step(*batch(x, y, 2))
        steps[knob] = resumed.parameters()
    for p in theta:
        m = b1 * state[C.adam_m(p)] + (1 - b1) * g[p]
        v = b2 * state[C.adam_v(p)] + (1 - b2) * g[p] ** 2
        want = theta[p] - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
        np.testing.assert_allclose(steps["beta1"][p], want, rtol=1e-5, atol=1e-7)
        assert np.array_equal(steps["beta1"][p], steps["momentum"][p])
    with pytest.raises(ConfigError, match="beta1 0.5 and its alias momentum 0.8 are both given"):
        Trainer.load_checkpoint(path, plan, beta1=0.5, momentum=0.8)
    with pytest.raises(ConfigError, match="both given"):
        Trainer(plan, optimizer="adam", beta1=0.5, momentum=0.8)
