"""Strict parsing and checking of what the user hands us: command-line options and knobs,
optimizer settings given to the API, API arrays and vectors, data ranges and token ids.
Each bad input is one line naming the culprit (CLI: `error: ...`, exit code 2), never a
traceback and never a setting silently read as something else."""
from __future__ import annotations

import os

import numpy as np
import pytest

import kfac_compiler as kc
from helpers import zoo_case
from kfac_compiler.cli import build_parser, main
from kfac_compiler.errors import ConfigError, DataError
from kfac_compiler.models import ZOO, save_model
from kfac_compiler.optimizers import make_config
from kfac_compiler.runtime import Curvature, Trainer
from kfac_compiler.train_cli import _knobs


@pytest.fixture(scope="module")
def mlp():
    plan, x, y = zoo_case("mlp_classifier", 64)
    return plan, x["input"], y


@pytest.fixture(scope="module")
def sgd(mlp):
    plan, _, _ = mlp
    return Trainer(plan, optimizer="sgd", learning_rate=0.1)


def cli(argv, capsys) -> tuple[int, str]:
    """(exit code, the one `error:` line) of `kfac-compiler argv`."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return code, lines[0]


# ----------------------------------------------------------------------------- command line
@pytest.mark.parametrize("argv, option", [
    (["train", "--learning-rat", "0.1"], "--learning-rat"),
    (["train", "--check", "x.ckpt"], "--check"),
    (["compile", "m.onnx", "--los", "softmax_cross_entropy", "-o", "p"], "--los"),
    (["inspect", "p", "--form", "json"], "--form"),
])
def test_options_are_never_abbreviated(argv, option, capsys):
    code, line = cli(argv, capsys)
    assert code == 2 and line.startswith(f"error: unrecognized arguments: {option}")


@pytest.mark.parametrize("text, value", [("no", False), ("OFF", False), ("false", False), ("0", False),
                                         ("yes", True), ("On", True), ("true", True), ("1", True)])
def test_knob_booleans_are_words_not_truthiness(mlp, text, value):
    plan, _, _ = mlp
    args = build_parser().parse_args(["train", "--knob", f"adapt_damping={text}", "--knob", "norm_constraint=none",
                                      "--knob", "inverse_groups=2", "--knob", "inv_update_period=5"])
    knobs = _knobs(args)
    assert knobs == {"adapt_damping": value, "norm_constraint": None, "inverse_groups": 2, "inv_update_period": 5}
    assert make_config("kfac", plan, **knobs).adapt_damping is value


@pytest.mark.parametrize("knob, message", [
    ("adapt_damping=maybe", "--knob adapt_damping: 'maybe' is not a boolean; use true/false, 1/0, yes/no or on/off"),
    ("min_damping=nan", "--knob min_damping: 'nan' is not a finite number"),
    ("max_damping=inf", "--knob max_damping: 'inf' is not a finite number"),
    ("inv_update_period=ten", "--knob inv_update_period: 'ten' is not an integer"),
    ("seed=2", "--knob seed: use --seed instead (it has its own flag)"),
    ("threads=2", "--knob threads: use --threads instead (it has its own flag)"),
    ("learning_rate=0.1", "--knob learning_rate: use --learning-rate instead (it has its own flag)"),
    ("initial_damping=0.1", "--knob initial_damping: use --damping instead (it has its own flag)"),
    ("weight-decay=0.1", "--knob weight_decay: use --l2 instead (it has its own flag)"),
    ("bogus=1", "optimizer 'kfac' has no option 'bogus'"),
    ("inv_update_period", "--knob 'inv_update_period': expected KEY=VALUE"),
])
def test_bad_knobs_are_one_line_errors_before_compiling(tmp_path, knob, message, capsys):
    metrics = tmp_path / "m.csv"
    code, line = cli(["train", "--knob", knob, "--steps", "1", "--metrics", str(metrics)], capsys)
    assert code == 2 and line.startswith(f"error: {message}"), line
    assert not metrics.exists()


@pytest.mark.parametrize("flag, value", [("--learning-rate", "nan"), ("--damping", "inf"), ("--l2", "-inf"),
                                         ("--momentum", "fast")])
def test_float_flags_must_be_finite_numbers(flag, value, capsys):
    code, line = cli(["train", f"{flag}={value}"], capsys)
    kind = "a number" if value == "fast" else "a finite number"
    assert code == 2 and line.startswith(f"error: argument {flag}: {value!r} is not {kind}")


def test_a_knob_given_twice_is_refused(capsys):
    code, line = cli(["train", "--knob", "inv_update_period=5", "--knob", "inv_update_period=6"], capsys)
    assert code == 2 and line == "error: --knob inv_update_period given twice"


# ----------------------------------------------------------------------------- API settings
@pytest.mark.parametrize("knobs, message", [
    (dict(adapt_damping="no"), "optimizer option 'adapt_damping' must be True or False, got 'no'"),
    (dict(adapt_damping=2), "optimizer option 'adapt_damping' must be True or False, got 2"),
    (dict(reject_increase="false"), "optimizer option 'reject_increase' must be True or False, got 'false'"),
    (dict(damping=float("inf")), "optimizer option 'damping' must be a finite number, got inf"),
    (dict(max_damping=float("nan")), "optimizer option 'max_damping' must be a finite number, got nan"),
    (dict(damping="0.1"), "optimizer option 'damping' must be a number or None, got '0.1'"),
    (dict(inv_update_period=10.0), "optimizer option 'inv_update_period' must be an integer or None, got 10.0"),
    (dict(mode=3), "optimizer option 'mode' must be a string or None, got 3"),
    (dict(damping_adaptation_interval=None), "optimizer option 'damping_adaptation_interval' cannot be None"),
])
def test_api_optimizer_options_are_type_checked(mlp, knobs, message):
    plan, _, _ = mlp
    with pytest.raises(ConfigError) as e:
        Trainer(plan, **knobs)
    assert str(e.value) == message


def test_api_booleans_take_bools_and_0_1(mlp):
    plan, _, _ = mlp
    assert make_config("kfac", plan, adapt_damping=0).adapt_damping is False
    assert make_config("kfac", plan, adapt_damping=np.bool_(True)).adapt_damping is True
    assert make_config("kfac", plan, inv_update_period=np.int64(7)).inv_update_period == 7


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(seed=-1), "seed must be an integer >= 0, got -1"),
    (dict(seed=1.5), "seed must be an integer, got 1.5"),
    (dict(threads="2"), "threads must be an integer, got '2'"),
    (dict(threads=0), "threads must be an integer >= 1, got 0"),
])
def test_trainer_arguments_are_checked(mlp, kwargs, message):
    plan, _, _ = mlp
    with pytest.raises(ConfigError) as e:
        Trainer(plan, optimizer="sgd", learning_rate=0.1, **kwargs)
    assert str(e.value) == message


# ----------------------------------------------------------------------------- API arrays
def test_float64_and_lists_are_converted_with_a_range_check(mlp, sgd):
    _, x, y = mlp
    ref = sgd.evaluate({"input": x}, y)["loss"]
    assert sgd.evaluate({"input": x.astype(np.float64).tolist()}, y.tolist())["loss"] == ref
    big = x.astype(np.float64)
    big[3, 5] = -1e300
    with pytest.raises(DataError) as e:
        sgd.step({"input": big}, y)
    assert str(e.value) == ("batch: array 'input' holds -1e+300, beyond float32's range [-3.40282e+38, 3.40282e+38]; "
                            "rescale the data")
    with pytest.raises(DataError, match=r"^input 'input' is not a rectangular array of numbers \(setting an array"):
        sgd.step({"input": [[0.0] * 64, [0.0] * 3]}, y[:2])
    with pytest.raises(ConfigError, match=r"^evaluate: batch_size must be an integer, got 'a'$"):
        sgd.evaluate({"input": x}, y, batch_size="a")


def test_predict_converts_and_checks_its_inputs(mlp, sgd):
    _, x, _ = mlp
    assert np.array_equal(sgd.predict({"input": x.astype(np.float64)}), sgd.predict({"input": x}))
    with pytest.raises(DataError, match=r"^predict: array 'input' has shape \[64, 3\]; the model expects \['N', 64\]$"):
        sgd.predict({"input": x[:, :3]})
    with pytest.raises(DataError, match=r"^predict: array 'input' contains 1 NaN/Inf value\(s\)$"):
        sgd.predict({"input": np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x)})


def test_set_parameters_refuses_nan_and_checks_before_writing(sgd):
    before = sgd.parameters()
    values = {k: v.copy() for k, v in before.items()}
    values["fc2.bias"][0] = np.nan
    with pytest.raises(DataError) as e:
        sgd.set_parameters(values)
    assert str(e.value) == "parameter 'fc2.bias' holds 1 NaN/Inf value(s)"
    values = {k: v.astype(np.float64) for k, v in before.items()}
    values["fc2.bias"][0] = 1e300
    with pytest.raises(DataError, match=r"^parameter 'fc2.bias' holds 1e\+300, beyond float32's range"):
        sgd.set_parameters(values)
    with pytest.raises(ConfigError, match=r"^parameter 'fc1.weight' has shape \[128, 64\]; got \[3\]$"):
        sgd.set_parameters({"fc1.weight": np.zeros(3)})
    after = sgd.parameters()  # fc1.weight was valid and listed first: nothing was written
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_curvature_checks_damping_and_vectors(mlp):
    plan, x, y = mlp
    curv = Curvature(plan)
    curv.update({"input": x}, y)
    for bad, message in ((float("inf"), "damping must be a finite number, got inf"),
                         (float("nan"), "damping must be a finite number, got nan"),
                         (True, "damping must be a finite number, got True"),
                         (-1.0, "damping must be > 0, got -1.0")):
        with pytest.raises(ConfigError) as e:
            curv.update_inverses(bad)
        assert str(e.value) == message
    assert curv.update_inverses(1e-3) is True
    grads = {p: np.zeros(v.shape, np.float32) for p, v in curv.parameters().items()}
    assert set(curv.precondition(grads)) == set(grads)
    wrong = {**grads, "fc2.weight": np.zeros((3, 3))}
    with pytest.raises(DataError) as e:
        curv.precondition(wrong)
    assert str(e.value) == "precondition: the vector for 'fc2.weight' has shape [3, 3]; expected [128, 128]"
    with pytest.raises(DataError, match=r"^multiply_all: no vector for parameter 'fc1.bias'$"):
        curv.multiply_all({"fc1.weight": grads["fc1.weight"]})
    with pytest.raises(DataError, match=r"^multiply\('fc1'\): 'fc2.bias' is not one of the parameters"):
        curv.multiply("fc1", {"fc1.weight": grads["fc1.weight"], "fc1.bias": grads["fc1.bias"], "fc2.bias": 0})
    with pytest.raises(ConfigError, match=r"^damping must be >= 0, got -0.5$"):
        curv.multiply("fc1", {"fc1.weight": grads["fc1.weight"], "fc1.bias": grads["fc1.bias"]}, damping=-0.5)
    with pytest.raises(ConfigError, match=r"^ema_decay must be in \[0, 1\), got 1.0$"):
        Curvature(plan, ema_decay=1.0)


# ----------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    path = save_model("transformer_block", tmp_path_factory.mktemp("tf") / "tf.onnx")
    plan = kc.compile(path, loss="softmax_cross_entropy", emit=False)
    x, y = ZOO["transformer_block"].make_data(16, seed=0)
    return path, plan, x, y


def test_token_ids_outside_the_embedding_are_refused(transformer, tmp_path, capsys):
    path, plan, x, y = transformer
    rows = [t for t in plan.model.graph.initializer if t.name == "tok_emb"][0].dims[0]
    tr = Trainer(plan, optimizer="sgd", learning_rate=0.1)
    for bad in (rows, -1):
        ids = x["input"].copy()
        ids[2, 1] = bad
        with pytest.raises(DataError) as e:
            tr.step({"input": ids}, y)
        assert str(e.value) == (f"batch: array 'input' holds token id {bad}; the embedding it indexes has {rows} rows "
                                f"(ids 0..{rows - 1})")
    ids = x["input"].copy()
    ids[0, 0] = rows + 5
    data = tmp_path / "tokens.npz"
    np.savez(data, input=ids, targets=y)
    metrics = tmp_path / "m.csv"
    code, line = cli(["train", str(path), "--loss", "softmax_cross_entropy", "--data", str(data), "--steps", "1",
                      "--metrics", str(metrics)], capsys)
    assert code == 2 and line == (f"error: {data}: array 'input' holds token id {rows + 5}; the embedding it indexes "
                                  f"has {rows} rows (ids 0..{rows - 1})")
    assert not metrics.exists()


def test_float64_beyond_float32_is_refused_before_training(mlp, tmp_path, capsys):
    _, x, y = mlp
    big = x.astype(np.float64)
    big[0, 0] = 1e39
    data = tmp_path / "big.npz"
    np.savez(data, input=big, targets=y)
    metrics = tmp_path / "m.csv"
    code, line = cli(["train", "--data", str(data), "--steps", "2", "--metrics", str(metrics)], capsys)
    assert code == 2 and line == (f"error: {data}: array 'input' holds 1e+39, beyond float32's range "
                                  "[-3.40282e+38, 3.40282e+38]; rescale the data")
    assert not metrics.exists()


@pytest.mark.parametrize("case", ["npy", "directory", "pickled"])
def test_unreadable_data_files_are_one_line(mlp, tmp_path, case, capsys):
    _, x, y = mlp
    data = tmp_path / "d.npz"
    if case == "npy":
        with open(data, "wb") as f:
            np.save(f, x)
        message = f"error: data file {str(data)!r} is a single .npy array, not an .npz of named arrays"
    elif case == "directory":
        data.mkdir()
        message = f"error: data file {str(data)!r} is a directory; give an .npz file"
    else:
        np.savez(data, input=np.array([{"a": 1}] * len(y), dtype=object), targets=y)
        message = (f"error: data file {str(data)!r} is not a readable .npz (it holds object (pickled) arrays, "
                   "which are never loaded: save plain numeric arrays)")
    code, line = cli(["train", "--data", str(data), "--steps", "1"], capsys)
    assert code == 2 and line == message, line


@pytest.mark.parametrize("value", ["0", "no", "off", "1", "yes", "bogus"])
def test_kfac_disable_cuda_is_parsed_strictly(monkeypatch, value):
    from kfac_compiler.runtime.device import cuda_status

    monkeypatch.setenv("KFAC_DISABLE_CUDA", value)
    cuda_status.cache_clear()
    try:
        if value == "bogus":
            with pytest.raises(ConfigError, match=r"^KFAC_DISABLE_CUDA: 'bogus' is not a boolean"):
                cuda_status()
        elif value in ("1", "yes"):
            assert cuda_status() == (False, "KFAC_DISABLE_CUDA is set")
        else:
            assert cuda_status()[1] != "KFAC_DISABLE_CUDA is set"
    finally:
        cuda_status.cache_clear()
        monkeypatch.delenv("KFAC_DISABLE_CUDA")


def test_config_numbers_must_be_finite(tmp_path):
    from kfac_compiler.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text("[budget]\noverhead = inf\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(cfg))
    assert str(e.value) == f"{cfg}: budget.overhead: expected a finite number, got inf"
    assert os.path.exists(cfg)
