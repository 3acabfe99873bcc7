"""K-FAC with first-order parameter groups (K-FAC's param_groups, optimizers/groups.py).

Truth: a group's parameters follow its rule computed by hand in numpy (Adam, AdamW's decay,
heavy-ball SGD with l2) from kc.gradients at the step's parameters; the other parameters
take the step of a plan compiled with the group's parameters frozen (the same K-FAC step
with them held fixed: its alpha, mu, damping and rho too); a checkpointed run continues bit
for bit; a roll back restores every parameter; the groups' layers have no curvature state.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler import contract as C
from kfac_compiler.cli import main
from kfac_compiler.errors import ConfigError
from kfac_compiler.models import ZOO
from kfac_compiler.optimizers.groups import group_hp
from kfac_compiler.report import render
from kfac_compiler.runtime import Trainer

# the transformer block's embeddings and norms: the groups the issue asks for
NORMS = ["tok_emb", "pos_emb", "ln1.scale", "ln1.bias", "ln2.scale", "ln2.bias", "lnf.scale", "lnf.bias"]
ADAM = {"kind": ["tied_embedding", "scale_and_shift"], "params": "pos_emb", "optimizer": "adam", "lr": 3e-3,
        "betas": (0.8, 0.99), "eps": 1e-7, "decoupled_weight_decay": 0.1, "name": "emb"}


def _compiled(name: str, exclude=()):
    e = ZOO[name]
    model = e.build(seed=0)
    return kc.compile(model, loss=e.loss, output=e.output_name, emit=False, config={"exclude": list(exclude)})


@pytest.fixture(scope="module")
def transformer():
    inputs, y = ZOO["transformer_block"].make_data(256, seed=0)
    return _compiled("transformer_block"), inputs, y


@pytest.fixture(scope="module")
def mlp():
    inputs, y = ZOO["mlp_classifier"].make_data(256, seed=0)
    return _compiled("mlp_classifier"), inputs, y


def _batches(inputs, y, count: int, rows: int = 64):
    for k in range(count):
        idx = np.random.default_rng(k).choice(len(y), rows, replace=False)
        yield {n: a[idx] for n, a in inputs.items()}, y[idx]


def _f64(params):
    return {p: v.astype(np.float64) for p, v in params.items()}


@pytest.mark.slow
def test_an_adam_group_steps_by_adam_and_kfac_steps_the_rest_with_the_group_held(transformer):
    plan, inputs, y = transformer
    tr = Trainer(plan, threads=1, param_groups=[ADAM])
    assert [p for g in tr.policy.groups.groups for p in g.params] == NORMS
    frozen = Trainer(_compiled("transformer_block", exclude=NORMS), threads=1)
    lr, (b1, b2), eps, wd = ADAM["lr"], ADAM["betas"], ADAM["eps"], ADAM["decoupled_weight_decay"]
    m = {p: 0.0 for p in NORMS}
    v = {p: 0.0 for p in NORMS}
    for t, (batch, yb) in enumerate(_batches(inputs, y, 3), start=1):
        before = _f64(tr.parameters())
        _, grads = kc.gradients(plan, batch, yb, params=tr.parameters())
        metrics = tr.step(batch, yb)
        assert metrics["rejected"] == 0.0
        after = _f64(tr.parameters())
        lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        for p in NORMS:
            g = grads[p].astype(np.float64)
            m[p] = b1 * m[p] + (1 - b1) * g
            v[p] = b2 * v[p] + (1 - b2) * g * g
            want = (1 - lr * wd) * before[p] - lr_t * m[p] / (np.sqrt(v[p]) + eps)
            np.testing.assert_allclose(after[p], want, rtol=1e-4, atol=2e-6, err_msg=f"step {t}: {p}")
        assert metrics["emb/learning_rate"] == lr
        update = np.sqrt(sum(((after[p] - (1 - lr * wd) * before[p]) ** 2).sum() for p in NORMS))
        assert metrics["emb/update_norm"] == pytest.approx(update, rel=1e-4)
        assert metrics["emb/grad_norm"] == pytest.approx(np.sqrt(sum((grads[p] ** 2).sum() for p in NORMS)), rel=1e-4)
        if t == 1:  # the K-FAC parameters: the frozen plan's step, the groups' values being the same then
            m_frozen = frozen.step(batch, yb)
            theirs = frozen.parameters()
            for p in theirs:
                np.testing.assert_allclose(after[p], theirs[p], rtol=1e-5, atol=1e-6, err_msg=p)
                assert np.abs(after[p] - before[p]).max() > 1e-3, p  # K-FAC moved them
            for k in ("loss", "learning_rate", "momentum", "damping", "qmodel_change", "rho", "new_loss",
                      "update_norm", "grad_norm"):
                assert metrics[k] == pytest.approx(m_frozen[k], rel=1e-5, abs=1e-7), k


def test_an_sgd_group_with_l2_and_clipping_beside_fixed_rate_kfac(mlp):
    """fc1 by heavy-ball SGD with l2 and its gradient clipped by the group's own norm, fc2 and fc3
    by K-FAC's `regular` momentum type with its own l2: the group's settings and K-FAC's do not
    leak into each other."""
    plan, inputs, y = mlp
    lr, mu, l2, clip = 0.05, 0.9, 1e-2, 0.3
    kfac = dict(learning_rate=0.02, momentum=0.5, damping=0.1, l2_reg=1e-3)
    group = {"layers": "fc1", "optimizer": "sgd", "learning_rate": lr, "momentum": mu, "l2_reg": l2,
             "clip_norm": clip}
    tr = Trainer(plan, threads=1, param_groups=[group], **kfac)
    fc1 = ["fc1.weight", "fc1.bias"]
    frozen = Trainer(_compiled("mlp_classifier", exclude=fc1), threads=1, **kfac)
    vel = {p: 0.0 for p in fc1}
    for t, (batch, yb) in enumerate(_batches(inputs, y, 3), start=1):
        before = _f64(tr.parameters())
        _, grads = kc.gradients(plan, batch, yb, params=tr.parameters())
        metrics = tr.step(batch, yb)
        assert metrics["rejected"] == 0.0
        after = _f64(tr.parameters())
        norm = np.sqrt(sum((grads[p].astype(np.float64) ** 2).sum() for p in fc1))
        scale = min(1.0, clip / norm)
        assert scale < 0.9 or t > 1  # the first step's gradient is clipped
        assert metrics["group0/grad_norm"] == pytest.approx(norm, rel=1e-4)  # before clipping
        for p in fc1:
            vel[p] = mu * vel[p] - lr * (scale * grads[p].astype(np.float64) + l2 * before[p])
            np.testing.assert_allclose(after[p], before[p] + vel[p], rtol=1e-4, atol=1e-6, err_msg=f"step {t}: {p}")
        if t == 1:
            m_frozen = frozen.step(batch, yb)
            for p, value in frozen.parameters().items():
                np.testing.assert_allclose(after[p], value, rtol=1e-5, atol=1e-6, err_msg=p)
            assert metrics["update_norm"] == pytest.approx(m_frozen["update_norm"], rel=1e-5)
            assert metrics["group0/update_norm"] == pytest.approx(
                np.sqrt(sum((vel[p] ** 2).sum() for p in fc1)), rel=1e-4)


@pytest.mark.slow
def test_the_groups_layers_have_no_curvature_state_or_work(transformer):
    plan, inputs, y = transformer
    tr = Trainer(plan, threads=1, param_groups=[ADAM], batch_size=64)
    grouped = {"tok_emb", "pos_emb", "ln1", "ln2", "lnf"}
    curvature = {**C.layer_slots(tr.store.slots(), C.FACTOR), **C.layer_slots(tr.store.slots(), C.INVERSE)}
    assert set(curvature) == {layer.name for layer in plan.layers} - grouped
    step = tr.policy.step_program()
    stats = tr.policy.statistics_program()
    assert stats.info.options["layers"] == [layer.name for layer in plan.layers if layer.name not in grouped]
    for prog in (step, stats):
        layers = set(C.layer_slots(prog.state_outputs.values(), C.FACTOR))
        assert layers == set(curvature), prog.name
    assert group_hp("emb", C.LEARNING_RATE) in step.hp_inputs  # the group's rule reads its own names
    assert {C.adam_m(p) for p in NORMS} <= set(step.state_inputs)
    assert not any(C.velocity(p) in step.state_inputs for p in NORMS)  # no K-FAC velocity for them
    # without groups every request is what it was: the plan's stored graphs still serve it
    default = Trainer(plan, threads=1, batch_size=64)
    assert default.policy.statistics_program().info.options["layers"] is None
    assert default.policy.step_program().info.options["groups"] == []


@pytest.mark.slow
def test_checkpoint_resumes_a_grouped_run_bit_for_bit(transformer, tmp_path):
    plan, inputs, y = transformer
    groups = [ADAM, {"params": r"mlp\.fc2\..*", "optimizer": "sgd", "lr": 0.05, "name": "fc2"}]
    batches = list(_batches(inputs, y, 6))
    straight = Trainer(plan, threads=1, param_groups=groups)
    for batch, yb in batches:
        straight.step(batch, yb)
    first = Trainer(plan, threads=1, param_groups=groups)
    for batch, yb in batches[:3]:
        first.step(batch, yb)
    path = tmp_path / "run.ckpt"
    first.save_checkpoint(path)
    resumed = Trainer.load_checkpoint(path, plan, threads=1)  # the groups come with the checkpoint
    assert [g.name for g in resumed.policy.groups.groups] == ["emb", "fc2"]
    for batch, yb in batches[3:]:
        resumed.step(batch, yb)
    a, b = straight.state(), resumed.state()
    assert set(a) == set(b) and {C.adam_m("tok_emb"), C.velocity("mlp.fc2.weight")} <= set(a)
    for slot in a:
        assert np.array_equal(a[slot], b[slot]), slot
    # a group's options may change on resuming, not what it trains
    faster = [{**ADAM, "lr": 1e-2}, groups[1]]
    assert Trainer.load_checkpoint(path, plan, param_groups=faster).policy.groups.groups[0].config.learning_rate == 1e-2
    with pytest.raises(ConfigError, match="a resumed run trains the groups of its checkpoint"):
        Trainer.load_checkpoint(path, plan, param_groups=[ADAM])


def test_a_roll_back_undoes_the_groups_update_too(transformer):
    plan, inputs, y = transformer
    groups = [ADAM, {"layers": "mlp.fc2", "optimizer": "sgd", "lr": 0.05, "momentum": 0.9,
                     "decoupled_weight_decay": 0.01, "name": "fc2"}]
    tr = Trainer(plan, threads=1, param_groups=groups, adapt_damping=False)
    (b0, y0), (b1, y1) = _batches(inputs, y, 2)
    tr.step(b0, y0)
    before = tr.parameters()
    assert tr.step(b1, y1)["rejected"] == 0.0
    after = tr.parameters()
    data = {**b1, C.TARGETS: y1}
    assert not tr.policy.roll_back(data, keep=lambda loss: False)  # kept: nothing changes
    for p, value in tr.parameters().items():
        assert np.array_equal(value, after[p]), p
    assert tr.policy.roll_back(data, keep=lambda loss: True)
    for p, value in tr.parameters().items():
        assert np.abs(after[p] - before[p]).max() > 1e-5, p
        np.testing.assert_allclose(value, before[p], rtol=1e-5, atol=1e-6, err_msg=p)


def test_inspect_shows_each_layers_optimizer(transformer, tmp_path, capsys):
    plan, _, _ = transformer
    sgd = {"layers": ["attn.q", "attn.k"], "optimizer": "sgd", "lr": 0.05, "name": "qk"}
    table = render(plan, "table", param_groups=[ADAM, sgd])
    rows = {line.split()[0]: line for line in table.splitlines() if line.split() and line.split()[0] in
            {layer.name for layer in plan.layers}}
    for name in ("tok_emb", "pos_emb", "ln1", "ln2", "lnf"):
        assert rows[name].endswith("adam (emb)"), rows[name]
    assert rows["attn.q"].endswith("sgd (qk)") and rows["attn.v"].endswith("kfac")
    assert "group emb: adam (learning_rate 0.003, beta1 0.8, beta2 0.99, epsilon 1e-07, decoupled_weight_decay 0.1)" \
           " trains 5 layers, 496 values (tok_emb, pos_emb, ln1, ln2, lnf)" in " ".join(table.split())
    assert "optimizer" not in render(plan, "table")  # without groups the table is as it was
    doc = json.loads(render(plan, "json", param_groups=[ADAM]))
    assert {layer["name"]: (layer["optimizer"], layer["group"]) for layer in doc["layers"]}["pos_emb"] == ("adam", "emb")
    # the cost line and the JSON costs leave the groups' layers' curvature out, as the table does
    # (they had counted it): the compile-time totals minus those layers' per-layer costs
    per_layer, grouped = plan.costs["layers"], ("tok_emb", "pos_emb", "ln1", "ln2", "lnf")
    for key, part in (("apply_flops", "apply"), ("stats_flops_per_update", "stats"), ("inverse_flops_per_refresh", "inverse")):
        assert doc["costs"][key] == plan.costs[key] - sum(per_layer[n][part] for n in grouped)
    assert doc["costs"]["without_groups"] == sorted(grouped) and sum(per_layer[n]["apply"] for n in grouped) > 0
    apply_share = doc["costs"]["apply_flops"] / plan.costs["forward_backward_flops"]
    assert f"preconditioning {apply_share:.2f}x" in " ".join(render(plan, "table", param_groups=[ADAM]).split())
    assert {layer["name"]: layer["optimizer"] for layer in doc["layers"]}["attn.q"] == "kfac"
    assert doc["param_groups"][0]["params"] == NORMS
    out = tmp_path / "plan"
    plan.save(out)
    capsys.readouterr()
    assert main(["inspect", str(out), "--param-group", "kind=scale_and_shift optimizer=sgd lr=0.1 name=norms"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "group norms: sgd (learning_rate 0.1) trains 3 layers" in text
    assert main(["inspect", str(out), "--param-group", "kind=norm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: param_groups[0] ('group0'): kind 'norm' matches no layer of this plan (its kinds: "
                   "broadcast, fully_connected, scale_and_shift, tied_embedding; kfac-compiler inspect shows each "
                   "layer's)"]


@pytest.mark.parametrize("groups, message", [
    ([{"params": "nothing.*"}], r"param_groups\[0\] \('group0'\): params 'nothing.\*' matches no trainable parameter "
                                r"\(parameters: tok_emb, pos_emb"),
    ([{"layers": "fc9"}], r"layers 'fc9' matches no layer \(layers: tok_emb, pos_emb, ln1"),
    ([{"kind": "embedding"}], r"kind 'embedding' matches no layer of this plan"),
    ([{"kind": "scale_and_shift"}, {"params": "ln2.scale|ln2.bias", "name": "again"}],
     r"parameter 'ln2.scale' is selected by param_groups\[0\] \('group0'\) and by param_groups\[1\] \('again'\)"),
    ([{"params": r"attn\.q\.bias"}], r"selects 'attn.q.bias' but not 'attn.q.weight' of layer 'attn.q' "
                                     r"\(fully_connected, kron\), whose curvature block covers all its parameters"),
    ([{"params": ".*"}], "param_groups select every trainable parameter: nothing is left for K-FAC"),
    ([{"kind": "scale_and_shift", "optimizer": "kfac"}], "optimizer 'kfac' cannot train a parameter group"),
    ([{"kind": "scale_and_shift", "optimizer": "lbfgs"}], "unknown optimizer 'lbfgs'; a group takes one of adam, sgd"),
    ([{"kind": "scale_and_shift", "multi_tensor": True}], "a group's update is emitted per parameter"),
    ([{"kind": "scale_and_shift", "lr": -1.0}], r"\('group0'\): optimizer option 'learning_rate' must be > 0"),
    ([{"kind": "scale_and_shift", "learning_rate": lambda k: 0.1}], "learning_rate is a Python callable"),
    ([{"kind": "scale_and_shift", "momentun": 0.9}], "optimizer 'adam' has no option 'momentun'"),
    ([{"kind": "scale_and_shift", "name": "a b"}], "name must be letters, digits"),
    ([{"kind": "scale_and_shift", "name": "x"}, {"params": "pos_emb", "name": "x"}], "the name 'x' is given to two"),
    ([{"optimizer": "adam"}], r"selects nothing: give params"),
    ([{"params": "(unclosed"}], r"params: bad regular expression '\(unclosed'"),
    ({"kind": "embedding"}, "param_groups must be a list of groups"),
])
def test_bad_groups_are_one_line_errors(transformer, groups, message):
    plan, _, _ = transformer
    with pytest.raises(ConfigError, match=message) as info:
        Trainer(plan, threads=1, param_groups=groups, sessions=False)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_the_command_line_trains_groups_and_refuses_bad_ones(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "transformer_block", "--steps", "4", "--batch-size", "64", "--metrics", str(metrics),
                 "--param-group", "kind=tied_embedding,scale_and_shift params=pos_emb optimizer=adam lr=3e-3 "
                                  "betas=0.9,0.99 name=emb"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 4 and all(r["emb/learning_rate"] == 3e-3 and r["emb/update_norm"] > 0 for r in rows)
    capsys.readouterr()
    for argv, message in (
            (["--param-group", "kind=tied_embedding optimizer"], "expected KEY=VALUE pairs separated by spaces"),
            (["--param-group", "kind=tied_embedding lr=fast"], "--param-group 'kind=tied_embedding lr=fast': lr: 'fast'"),
            (["--knob", "param_groups=x"], "--knob param_groups: use --param-group instead"),
            (["--optimizer", "sgd", "--param-group", "kind=tied_embedding"], "optimizer 'sgd' has no parameter groups")):
        assert main(["train", "transformer_block", "--steps", "1", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.slow
def test_embeddings_and_norms_by_adam_beside_kfac_train_the_transformer(transformer):
    plan, inputs, y = transformer
    tr = Trainer(plan, threads=1, param_groups=[{**ADAM, "decoupled_weight_decay": 0.0}])
    start = tr.evaluate(inputs, y)["loss"]
    for batch, yb in _batches(inputs, y, 40):
        tr.step(batch, yb)
    end = tr.evaluate(inputs, y)["loss"]
    assert end < 0.7 * start, (start, end)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_accumulated_micro_batches_with_a_group_take_the_whole_batch_step(mlp, optimizer):
    """Gradient accumulation beside a group: the group's rule and K-FAC's preconditioning both
    see the cycle's mean gradient, K-FAC's factors the mean statistics, so two micro-batches
    per update take the whole-batch steps (a fixed learning rate: no quadratic model, which
    runs on the last micro-batch)."""
    plan, inputs, y = mlp
    knobs = dict(optimizer="kfac", seed=0, learning_rate=0.05, damping=0.1, inv_update_period=2,
                 stats_batch_size=None, mode="empirical",
                 param_groups=[{"layers": "fc1", "optimizer": optimizer, "lr": 1e-2}])
    split, whole = Trainer(plan, accumulate=2, **knobs), Trainer(plan, **knobs)
    for xb, yb in _batches(inputs, y, 3):
        for half in (slice(0, 32), slice(32, 64)):
            split.step({n: a[half] for n, a in xb.items()}, yb[half])
        whole.step(xb, yb)
    ours, truth = split.trained_values(), whole.trained_values()
    micro = split.policy.micro_program()  # the group's layer keeps no statistics there either
    assert set(C.layer_slots(micro.state_outputs.values(), C.FACTOR)) == {"fc2", "fc3"}
    assert {C.grad_accum(p) for p in ("fc1.weight", "fc1.bias")} <= set(micro.state_outputs.values())
    for p in truth:
        assert np.abs(ours[p] - truth[p]).max() <= 2e-5 * np.abs(truth[p]).max(), p
