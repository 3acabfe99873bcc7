"""Real exports: models nobody here wrote (a torchvision-layout ResNet, MobileNet v2/v3 blocks,
Hugging Face GPT-2 (eager and SDPA attention) and BERT, the hand-written GPT, nn.LSTM and
nn.GRU language models, a bidirectional LSTM, timm's PoolFormer block with GroupNorms,
torchvision's ViT, Swin and EfficientNet, transformers' Llama and Wav2Vec2), from both
torch exporters (TorchScript at opset 17; torch.export at
its default opset 20 with and without its optimizer, and at opset 23 for a few), compiled and checked against torch autograd. No torch needed: the fixtures
(tests/fixtures/real, made by `python -m kfac_compiler.models.real_exports`) hold the ONNX
files and the torch reference values (models/real_exports.py documents the .npz keys).

Checks per fixture:
  compile    kc.compile(model, "softmax_cross_entropy", output="logits") succeeds;
  trainable  the trainable set is exactly the initializers that hold torch parameters (after
             the exporter's folding, e.g. eval-mode BatchNorm into the conv): no constant
             (Clip bounds, zero states, scalars, masks) is trained, none is missing;
  tied       an initializer copy of one torch parameter (a tied embedding and head exported
             as two tensors) is trained as ONE parameter: all copies in one layer;
  gradients  kc.gradients' loss is torch's, and each torch parameter's gradient is the sum of
             the gradients of the initializer elements that hold it (rtol 1e-4 of the
             gradient norm);
  blocks     each layer's kind and Fisher block is the one expected for the torch module
             (EXPECTED_BLOCKS; a tied embedding+head takes whatever the compiler gives);
  merged     (the <family>_init fixtures: default initialisation) exporter-merged equal
             initializers are trained as separate parameters;
  train      (slow) 20 default K-FAC steps on the fixture's batch lower its loss by 10%.

XFAIL lists what fails and why (the marks are not strict, so an xpass is reported, not failed);
XFAIL_STRICT the same for the families added later, strict (an xpass fails: remove the entry).
"""
from __future__ import annotations

import fnmatch
import json
import re
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.graph import fold_recurrent_params
from kfac_compiler.models.real_data import gradient_errors

pytestmark = pytest.mark.slow  # torch exports and third-party models: CI runs these (`pytest` without -m)

FIXTURES = Path(__file__).parent / "fixtures" / "real"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text()) if (FIXTURES / "manifest.json").exists() else {}
CASES = sorted(k for k, v in MANIFEST.items() if v.get("status") == "ok" and not v.get("default_init"))
# the same models at their own initialisation (equal initializers merged by the exporters)
INIT_CASES = sorted(k for k, v in MANIFEST.items() if v.get("status") == "ok" and v.get("default_init"))

# (fixture glob, check) -> the missing feature. Checks: compile, trainable, tied, gradients,
# blocks, train, merged ("*" for every check).
XFAIL: dict[tuple[str, str], str] = {
    # the optimizer drops the folded all-zero conv biases altogether (180 elements): nothing
    # in the graph to train; only a compiler that adds biases back could pass this one
    ("resnet_init-dynamo", "merged"): "exporter's optimizer removed the zero folded conv biases (not in the graph)",
    # ... and GPT-2's zero linear biases (576 elements) become one scalar `zeros` literal
    ("gpt2_init-dynamo", "merged"): "exporter's optimizer replaced the zero linear biases by one scalar literal",
}

# (fixture glob, check) -> the reason; strict: an xpass fails, so a fix is noticed
XFAIL_STRICT: dict[tuple[str, str], str] = {}

_TIED = None  # any kind and block (recorded by benchmarks/bench_to_target.py real-exports)
_IMAGE = [
    (r"classifier.*|fc\..*", "fully_connected", "kron"),
    (r"(fused:)?features\.\d+\.conv\.1\.0\.(weight|bias)", "depthwise_conv", "channel_full"),  # MobileNet depthwise
    (r".*\.fc[12]\.(weight|bias)", "conv", "kron"),                                          # squeeze-excitation
    (r"(fused:)?.*(conv\d|downsample\.0|\.0)\.(weight|bias)", "conv", "kron"),
    (r".*(bn\d|downsample\.1|\.1)\.(weight|bias)", "scale_and_shift", "full"),              # BatchNorm (not folded)
]
_RNN = [
    (r"emb\.weight", "embedding", "kron"),
    (r"rnn\.weight_ih_l\d(_reverse)?", "fully_connected", "kron"),         # one Gemm over all time steps
    (r"rnn\.weight_hh_l\d(_reverse)?", "fully_connected", "kron_indep"),   # one use per time step
    (r"rnn\.bias_.*", _TIED, None),                                 # whatever goes with the weights
    (r"head\..*", "fully_connected", "kron"),
]
# first matching rule of the torch parameter held by an initializer: (kind, approximation)
EXPECTED_BLOCKS: dict[str, list] = {
    "resnet": _IMAGE, "mobilenet_v2": _IMAGE, "mobilenet_v3": _IMAGE,
    "gpt2": [
        (r".*\.wte\.weight", _TIED, None),
        (r".*\.wpe\.weight", "broadcast", "diagonal"),
        (r".*\.ln_(1|2|f)\..*", "scale_and_shift", "full"),
        (r".*\.(c_attn|c_proj|c_fc)\..*", "fully_connected", "kron"),
    ],
    "gpt2_sdpa": [
        (r".*\.wte\.weight", _TIED, None),
        (r".*\.wpe\.weight", "broadcast", "diagonal"),
        (r".*\.ln_(1|2|f)\..*", "scale_and_shift", "full"),
        (r".*\.(c_attn|c_proj|c_fc)\..*", "fully_connected", "kron"),
    ],
    "bert": [
        (r".*\.word_embeddings\.weight", _TIED, None),
        # positions looked up with batch-less indices (the same rows for every example; TorchScript
        # slices them to `input.size(1)`, a dim the model declares static)
        (r".*\.position_embeddings\.weight", "broadcast", "diagonal"),
        (r".*\.token_type_embeddings\.weight", "embedding", "kron"),
        (r".*LayerNorm\..*", "scale_and_shift", "full"),
        (r".*cls\.predictions\.bias", _TIED, None),  # the tied decoder's bias
        (r".*\.(query|key|value|dense)\..*", "fully_connected", "kron"),
    ],
    "gpt": [
        (r"wte\.weight", _TIED, None),
        (r"wpe\.weight", "broadcast", "diagonal"),
        (r".*ln_(1|2|f)\..*", "scale_and_shift", "full"),
        (r".*\.(qkv|proj|fc|fc_out)\..*", "fully_connected", "kron"),
    ],
    "lstm": _RNN, "gru": _RNN, "bilstm": _RNN,
    "efficientnet": [(r"(fused:)?features\.(1\.0\.block\.0|2\.0\.block\.1)\.0\.(weight|bias)", "depthwise_conv",
                      "channel_full")] + _IMAGE,
    "vit": [
        (r"class_token|encoder\.pos_embedding", "broadcast", "diagonal"),
        (r"conv_proj\..*", "conv", "kron"),
        (r".*ln(_\d)?\..*", "scale_and_shift", "full"),
        (r".*(in_proj_weight|in_proj_bias|out_proj|mlp\.\d|heads\.head).*", "fully_connected", "kron"),
    ],
    "swin": [
        (r"features\.0\.0\..*", "conv", "kron"),
        (r"features\.0\.2\..*|.*norm\d?\.(weight|bias)", "scale_and_shift", "full"),
        (r".*relative_position_bias_table", "broadcast", "diagonal"),
        (r".*(qkv|proj|mlp\.\d|reduction)\..*|head\..*", "fully_connected", "kron"),
    ],
    "llama": [
        (r".*embed_tokens\.weight", "embedding", "kron"),
        (r".*norm\.weight", "scale_and_shift", "full"),  # RMSNorm: pattern mul_scale
        (r".*(_proj|lm_head)\.weight", "fully_connected", "kron"),
    ],
    "wav2vec2": [
        # weight_norm computed at run time (dynamo_noopt): g, v and the bias in one block; the other
        # exporters fold g v / |v| into a constant weight (a plain conv)
        (r".*pos_conv_embed\.conv\.(parametrizations\.weight\.original[01]|bias)",
         {"dynamo_noopt": ("weight_norm_conv", "kron"), "*": ("conv", "kron")}),
        (r"(fused:)?.*(conv_layers\.\d\.conv|pos_conv_embed\.conv)\..*", "conv", "kron"),
        (r".*(layer_norm)\..*", "scale_and_shift", "full"),
        (r".*(projection|_proj|_dense|projector|classifier)\..*", "fully_connected", "kron"),
    ],
    "groupnorm": [
        (r"(stem|fc1|fc2)\..*", "conv", "kron"),
        (r"norm\d\..*", "scale_and_shift", "full"),  # the GroupNorm's affine (Mul/Add after the reshape back)
        (r"head\..*", "fully_connected", "kron"),
    ],
}


def _xfail(case: str, check: str) -> tuple[str, bool] | None:
    """(reason, strict) of the xfail mark of `check` on `case`, or None."""
    for table, strict in ((XFAIL_STRICT, True), (XFAIL, False)):
        for (pattern, c), reason in table.items():
            if c in (check, "*") and fnmatch.fnmatchcase(case, pattern):
                return reason, strict
    return None


def cases(check: str, among: list | None = None) -> list:
    out = []
    for case in CASES if among is None else among:
        mark = _xfail(case, check)
        marks = [pytest.mark.xfail(reason=mark[0], strict=mark[1])] if mark else []
        out.append(pytest.param(case, marks=marks, id=case))
    return out or [pytest.param(None, marks=pytest.mark.skip(reason="no fixtures in tests/fixtures/real"))]


@cache
def fixture(case: str) -> dict:
    with np.load(FIXTURES / f"{case}.npz") as d:
        data = {k: d[k] for k in d.files}
    if "ref_sizes" not in data:  # a default-initialisation fixture
        return data
    sizes = data["ref_sizes"]
    data["owner"] = np.repeat(np.arange(len(sizes)), sizes)  # flat reference element -> parameter
    data["inits"] = {str(n): data[f"init_index_{i}"] for i, n in enumerate(data["init_names"])}
    return data


@cache
def compiled(case: str, emit: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kc.compile(str(FIXTURES / f"{case}.onnx"), loss="softmax_cross_entropy", output="logits", emit=emit)


def _holders(case: str) -> dict[str, list[str]]:
    """torch parameter -> the trainable-to-be initializers holding its elements."""
    d = fixture(case)
    out: dict[str, list[str]] = {}
    for name, idx in d["inits"].items():
        for o in np.unique(d["owner"][idx]):
            out.setdefault(str(d["ref_names"][o]), []).append(name)
    return out


@pytest.mark.parametrize("case", cases("compile"))
def test_compiles(case):
    plan = compiled(case, emit=True)  # the front end and the default training subgraphs
    assert plan.layers and plan.trainable and plan.subgraphs


@pytest.mark.parametrize("case", cases("trainable"))
def test_trainable_set(case):
    d, plan = fixture(case), compiled(case)
    trained = set(plan.trainable)
    constants = sorted(trained & {str(n) for n in d["frozen_names"]})
    assert not constants, f"{case}: constants trained as parameters: {constants}"
    want = {h for i in d["inits"] for h in plan.holders(i)}
    assert trained == want, f"{case}: extra {sorted(trained - want)}, missing {sorted(want - trained)}"


@pytest.mark.parametrize("case", cases("tied"))
def test_tied_copies_are_one_parameter(case):
    plan = compiled(case)
    layer_of = {p: layer.name for layer in plan.layers for p in layer.params}
    for param, inits in _holders(case).items():
        if len(inits) > 1:
            layers = {layer_of.get(h) for i in inits for h in plan.holders(i)}
            assert len(layers) == 1, f"{case}: {param} held by {inits}, trained in separate layers {sorted(map(str, layers))}"


@pytest.mark.parametrize("case", cases("gradients"))
def test_gradients_match_torch(case):
    d, plan = fixture(case), compiled(case)
    loss, grads = kc.gradients(plan, inputs={"input": d["input"]}, targets=d["targets"])
    np.testing.assert_allclose(loss, d["loss"], rtol=1e-4, err_msg=case)
    grads = {**grads, **fold_recurrent_params(plan.model, grads)}  # lowered pieces -> W, R, B
    errors, scale = gradient_errors(d, grads, retied=plan.retied)
    bad = [f"{name}: |diff| {err:.2e} (|grad| {norm:.2e})" for name, (err, norm) in errors.items()
           if err > 1e-4 * scale + 1e-3 * norm]
    assert not bad, f"{case} (gradient norm {scale:.3e}): " + "; ".join(bad)


@pytest.mark.parametrize("case", cases("blocks"))
def test_blocks(case):
    family = MANIFEST[case]["family"]
    rules = EXPECTED_BLOCKS[family]
    plan = compiled(case)
    layer_of = {p: layer for layer in plan.layers for p in layer.params}
    wrong = []
    for param, inits in _holders(case).items():
        rule = next((r for r in rules if re.fullmatch(r[0], param)), None)
        assert rule is not None, f"{case}: no EXPECTED_BLOCKS rule for {param}"
        if rule[1] is _TIED:
            continue
        want = rule[1:]
        if isinstance(rule[1], dict):  # per exporter
            want = next(v for k, v in rule[1].items() if fnmatch.fnmatchcase(MANIFEST[case]["exporter"], k))
        for init in inits:
            for holder in plan.holders(init):
                layer = layer_of.get(holder)
                got = (layer.kind, layer.approximation) if layer else None
                if got != want:
                    wrong.append(f"{param} ({holder}): {got}, expected {want}")
    # initializers that hold no torch parameter must not form layers at all
    holding = {h for i in fixture(case)["inits"] for h in plan.holders(i)}
    extra = sorted({layer.name for layer in plan.layers if not set(layer.params) & holding})
    assert not wrong and not extra, f"{case}: {'; '.join(wrong)}; layers of constants: {extra}"


def test_inspect_reports_the_share_of_parameters_in_structured_blocks():
    """`inspect` says how much of the model the structured blocks cover: on Wav2Vec2 without the
    exporter's optimizer every torch parameter, the weight-normed positional conv's g, v and
    bias included (one weight_norm_conv block; they were 532 generic elements), counted from
    torch's parameter sizes; a generic layer (here: the classifier's weight and bias, by a
    user link) is counted out."""
    case = "wav2vec2-dynamo_noopt"
    if case not in CASES:
        pytest.skip(f"no fixture {case}")
    from kfac_compiler.report import render

    d = fixture(case)
    sizes = {str(n): int(k) for n, k in zip(d["ref_names"], d["ref_sizes"]) if not str(n).startswith("fused:")}
    total = sum(sizes.values())
    plan = compiled(case)
    assert (plan.totals()["param_elements"], plan.totals()["structured_elements"]) == (total, total)
    assert f"coverage:  100.0% of the {total:,} parameter elements in structured blocks" in render(plan, "table")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linked = kc.compile(str(FIXTURES / f"{case}.onnx"), loss="softmax_cross_entropy", output="logits",
                            emit=False, links=[{"params": ["model.classifier.weight", "model.classifier.bias"]}])
    n_generic = sizes["model.classifier.weight"] + sizes["model.classifier.bias"]
    line = (f"coverage:  {100 * (total - n_generic) / total:.1f}% of the {total:,} parameter elements in structured "
            f"blocks; generic: {n_generic:,} in 1 layer")
    assert line in render(linked, "table").splitlines()


@pytest.mark.parametrize("case", cases("merged", INIT_CASES))
def test_merged_initializers_are_separate_parameters(case):
    """At the models' own initialisation the exporters write equal tensors (zero biases, unit
    gains, BatchNorm-folded zero biases) as ONE initializer used by several layers; with
    untie="uniform" (the one flag the warning names) the compiler trains one parameter per
    torch parameter: as many trainable elements as the random-weight twin's export has (and
    the same loss as torch)."""
    d = fixture(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kc.compile(str(FIXTURES / f"{case}.onnx"), loss="softmax_cross_entropy", output="logits",
                          emit=False, untie="uniform")
    values = plan.parameter_values()
    # the twin's count includes an exporter's copy of a tied weight; here it is retied
    copies = {c: tuple(t.dims) for t in plan.model.graph.initializer for c in [t.name]}
    n = int(sum(values[p].size for p in plan.trainable))
    n += int(sum(np.prod(copies.get(v["of"], ())) for v in plan.retied.values()))
    loss, _ = kc.gradients(plan, inputs={"input": d["input"]}, targets=d["targets"])
    np.testing.assert_allclose(loss, d["loss"], rtol=1e-4, err_msg=case)
    assert n == int(d["expected_elements"]), (
        f"{case}: {n} trainable elements, torch's parameters have {int(d['expected_elements'])} "
        f"({len(plan.trainable)} trainable initializers)")


@pytest.mark.slow
@pytest.mark.parametrize("case", cases("train"))
def test_kfac_steps_lower_the_loss(case):
    """20 default K-FAC steps on the fixture's batch (8 examples: a task any of these models
    can learn) lower its loss by 10%. (On the benchmark's stream of held-out digits the tiny
    MobileNets barely move in 20-40 steps with K-FAC or Adam: not a test of the compiler.)"""
    from kfac_compiler.runtime import Trainer

    d, plan = fixture(case), compiled(case, emit=True)
    inputs, targets = {"input": d["input"]}, d["targets"]
    trainer = Trainer(plan, optimizer="kfac", device="cpu", seed=0)
    before = trainer.evaluate(inputs, targets)["loss"]
    for _ in range(20):
        trainer.step(inputs, targets)
    after = trainer.evaluate(inputs, targets)["loss"]
    assert np.isfinite(after) and after < 0.9 * before, f"{case}: loss {before:.4f} -> {after:.4f}"


@pytest.mark.parametrize("case", cases("export"))
def test_export_writes_the_users_graph_with_the_trained_values(case, tmp_path):
    """Trainer.export(graph="source"): the fixture's own graph (node list, names, fused
    recurrent ops, initializer names and dtypes, outputs) with the trained values; it
    computes what the plan's trained graph computes (ONNX Runtime on both)."""
    import onnx
    import onnxruntime as ort

    from kfac_compiler.runtime import Trainer

    d, plan = fixture(case), compiled(case)
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.05, threads=1)
    for _ in range(2):
        tr.step({"input": d["input"]}, d["targets"])
    source = onnx.load(str(FIXTURES / f"{case}.onnx"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untied copies, where a fixture has them
        ours = onnx.load(tr.export(tmp_path / "source.onnx", graph="source"))
    assert [(n.op_type, n.name, list(n.input), list(n.output)) for n in ours.graph.node] == \
        [(n.op_type, n.name, list(n.input), list(n.output)) for n in source.graph.node]
    assert [(t.name, t.data_type, list(t.dims)) for t in ours.graph.initializer] == \
        [(t.name, t.data_type, list(t.dims)) for t in source.graph.initializer]
    assert [o.name for o in ours.graph.output] == [o.name for o in source.graph.output]
    changed = [t.name for t, s in zip(ours.graph.initializer, source.graph.initializer)
               if not np.array_equal(onnx.numpy_helper.to_array(t), onnx.numpy_helper.to_array(s))]
    assert changed, f"{case}: no trained value written"
    canonical = tr.export(tmp_path / "plan.onnx")
    run = {p: ort.InferenceSession(p, providers=["CPUExecutionProvider"]) for p in (str(tmp_path / "source.onnx"),
                                                                                      canonical)}
    logits = [s.run(["logits"], {"input": d["input"]})[0] for s in run.values()]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4, err_msg=case)


def test_export_of_the_source_graph_needs_the_unchanged_source(tmp_path):
    from kfac_compiler.errors import PlanError
    from kfac_compiler.runtime import Trainer

    src = tmp_path / "m.onnx"
    src.write_bytes((FIXTURES / f"{CASES[0]}.onnx").read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kc.compile(str(src), loss="softmax_cross_entropy", output="logits", emit=False)
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.05)
    with open(src, "ab") as f:
        f.write(b"\0")
    with pytest.raises(PlanError, match="cannot export the source graph: its source .* changed since"):
        tr.export(tmp_path / "out.onnx", graph="source")
