"""The command line (main(argv) + capsys) and config files."""
from __future__ import annotations

import json

import pytest

from kfac_compiler.cli import main
from kfac_compiler.config import CompileConfig, load_config
from kfac_compiler.errors import ConfigError
from kfac_compiler.models import save_model


@pytest.fixture()
def models(tmp_path):
    return {name: save_model(name, tmp_path / f"{name}.onnx") for name in ("mlp_classifier", "transformer_block", "depthwise_cnn")}


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [l for l in err if l.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_compile_and_inspect(tmp_path, models, capsys):
    out = tmp_path / "plan"
    assert main(["compile", models["mlp_classifier"], "--loss", "softmax_cross_entropy", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fc1" in text and "A 65x65, G 128x128" in text and "plan written to" in text
    files = sorted(p.name for p in out.iterdir())
    assert "plan.json" in files and "model.onnx" in files
    assert len(files) > 2, "the default compile also emits the training subgraphs"
    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert any(l.startswith("fc1 ") and "fully_connected" in l and "kron" in l for l in lines)
    assert any(l.startswith("total (3 layers)") for l in lines)
    # one inverse method for every layer: said once in the header, not in a column on every row
    assert lines[3] == "inverses:  auto: schur (graph) on CPU and CUDA, every 10 steps"
    assert sum("schur" in l for l in lines) == 1
    assert next(l for l in lines if l.startswith("layer ")).split() == [
        "layer", "kind", "params", "uses", "approximation", "factors", "bytes"]
    assert all(len(l) <= 100 for l in lines[1:])  # 100 columns by default
    assert main(["inspect", str(out), "--wide"]) == 0  # every column
    wide = capsys.readouterr().out.splitlines()
    assert next(l for l in wide if l.startswith("layer ")).split()[-6:] == [
        "stats", "FLOP/ex", "inverse", "FLOP", "precond", "FLOP"]

    assert main(["inspect", str(out), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [l["name"] for l in doc["layers"]] == ["fc1", "fc2", "fc3"]
    fc1 = doc["layers"][0]
    assert {"name", "kind", "params", "uses", "approximation", "factors"} <= set(fc1)
    # one example's statistics: a~ a~^T (65x65) and delta delta^T (128x128), 2 FLOPs per MAC
    assert fc1["stats_flops_per_example"] == 2 * (65 * 65 + 128 * 128)
    assert fc1["inverse_method"] == "auto: schur (graph) on CPU and CUDA" and fc1["estimator"] == "gradients"
    # the CPU's schur on the damped A (65) and G (128): 4/3 n^3 in MatMuls + the probe's 4 n^2
    assert fc1["inverse_flops"] == sum(4 * n**3 // 3 + 4 * n**2 for n in (65, 128))
    assert {s["name"] for s in doc["subgraphs"]} == {"kfac_step", "update_statistics", "inverse_update"}
    assert fc1["params"] == ["fc1.weight", "fc1.bias"] and fc1["approximation"] == "kron"
    assert fc1["uses"] == [{"nodes": ["fc1/Gemm"], "input": "input", "output": "fc1/Gemm:0"}]
    assert fc1["factors"] == [
        {"name": "A", "shape": [65, 65], "dtype": "float32", "bytes": 65 * 65 * 4},
        {"name": "G", "shape": [128, 128], "dtype": "float32", "bytes": 128 * 128 * 4},
    ]
    assert doc["totals"]["layers"] == 3
    assert doc["estimator"]["mode"] == "gradients" and doc["schedule"]["inverse"]["update_period"] == 10

    assert main(["inspect", str(out), "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph plan {") and '"fc1" -> "fc2";' in dot and '"input:input" -> "fc1";' in dot
    assert '"fc3" -> "output:logits";' in dot and "#9ecae1" in dot


def test_compile_options(tmp_path, models, capsys):
    out = tmp_path / "plan"
    cfg = tmp_path / "kfac.toml"
    cfg.write_text(
        'exclude = ["pos_emb"]\n'
        "damping = 0.01\n"
        "[approximations]\nscale_and_shift = \"diagonal\"\n"
        "[layers]\n\"attn\\\\..*\" = \"kron_in_diag\"\n"
        "[[links]]\nparams = [\"tok_emb\"]\napproximation = \"full\"\n"
        "[inverse]\nmethod = \"eigh\"\nupdate_period = 5\n"
    )
    code = main(["compile", models["transformer_block"], "--loss", "softmax_cross_entropy", "--config", str(cfg),
                 "--approx", "mlp.fc1=diagonal", "--approx", "fully_connected=kron_out_diag", "-o", str(out), "-q", "--frontend-only"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    main(["inspect", str(out), "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    approx = {l["name"]: l["approximation"] for l in doc["layers"]}
    assert approx == {
        "tok_emb": "full", "ln1": "diagonal", "attn.q": "kron_in_diag", "attn.k": "kron_in_diag",
        "attn.v": "kron_in_diag", "attn.proj": "kron_in_diag", "ln2": "diagonal", "mlp.fc1": "diagonal",
        "mlp.fc2": "kron_out_diag", "lnf": "diagonal",
    }
    assert doc["schedule"]["damping"] == 0.01 and doc["schedule"]["inverse"] == {
        "method": "eigh", "update_period": 5, "damping_split": "pi"}
    code = main(["compile", models["mlp_classifier"], "--loss", "softmax_cross_entropy", "--exclude", r".*\.bias",
                 "--include", "fc.*", "-o", str(tmp_path / "p2"), "-q", "--frontend-only"])
    assert code == 0
    capsys.readouterr()
    main(["inspect", str(tmp_path / "p2"), "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert [l["params"] for l in doc["layers"]] == [["fc1.weight"], ["fc2.weight"], ["fc3.weight"]]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["compile", "{tmp}/missing.onnx", "--loss", "squared_error", "-o", "{tmp}/p"], "missing.onnx' does not exist"),
        (["compile", "{mlp}", "--loss", "hinge", "-o", "{tmp}/p"], "unknown loss 'hinge'"),
        (["compile", "{mlp}", "-o", "{tmp}/p"], "no loss given"),
        (["compile", "{mlp}", "--loss", "softmax_cross_entropy", "--output", "nope", "-o", "{tmp}/p"], "no tensor named 'nope'"),
        (["compile", "{mlp}", "--loss", "softmax_cross_entropy", "--approx", "conv", "-o", "{tmp}/p"], "expected KEY=APPROX"),
        (["compile", "{mlp}", "--loss", "softmax_cross_entropy", "--approx", "fully_connected=full", "-o", "{tmp}/p"],
         "approximations.fully_connected: 'full' is not allowed"),
        (["compile", "{mlp}", "--loss", "softmax_cross_entropy", "--approx", "fc1=full", "-o", "{tmp}/p"],
         "layer 'fc1' (fully_connected): approximation 'full'"),
        (["compile", "{mlp}", "--loss", "softmax_cross_entropy", "--exclude", "(bad", "-o", "{tmp}/p"], "bad regular expression"),
        (["compile", "{mlp}", "--loss", "softmax_cross_entropy", "--config", "{tmp}/nope.toml", "-o", "{tmp}/p"],
         "config file"),
        (["compile", "{mlp}", "--loss", "softmax_cross_entropy", "-o", "{tmp}/data"], "refusing to overwrite"),
        (["inspect", "{tmp}/data"], "not a plan directory"),
        (["inspect", "{tmp}/nowhere"], "does not exist"),
        (["compile", "{mlp}"], "required: -o/--out"),
        (["frobnicate"], "invalid choice"),
        (["inspect", "{tmp}/data", "--format", "yaml"], "invalid choice"),
    ],
)
def test_errors_exit_2_with_one_line(tmp_path, models, capsys, argv, expected):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("x")
    argv = [a.format(tmp=tmp_path, mlp=models["mlp_classifier"]) for a in argv]
    if argv[0] == "compile":
        argv.append("--frontend-only")
    assert main(argv) == 2
    line = err_line(capsys)
    assert expected in line


def test_warnings_are_printed(tmp_path, models, capsys):
    # the zoo transformer's tied table links without a warning (a tied_embedding layer) ...
    assert main(["compile", models["transformer_block"], "--loss", "softmax_cross_entropy", "-o", str(tmp_path / "p"), "-q",
                 "--frontend-only"]) == 0
    assert "warning" not in capsys.readouterr().err
    # ... a weight shared by a lookup and an "in_out" MatMul is not the tied pair: warned
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Gather", ["W", "ids"], ["y"], name="g", axis=0),
             helper.make_node("MatMul", ["y", "W"], ["logits"], name="mm")]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
                              [numpy_helper.from_array(np.ones((4, 4), np.float32), "W")])
    path = str(tmp_path / "shared.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["compile", path, "--loss", "softmax_cross_entropy", "-o", str(tmp_path / "p2"), "-q", "--frontend-only"]) == 0
    assert "warning: parameter 'W' is used as embedding and fully_connected" in capsys.readouterr().err


def test_stale_plan_is_an_error(tmp_path, models, capsys):
    out = str(tmp_path / "plan")
    assert main(["compile", models["mlp_classifier"], "--loss", "softmax_cross_entropy", "-o", out, "-q", "--frontend-only"]) == 0
    save_model("mlp_classifier", models["mlp_classifier"], seed=3)
    assert main(["inspect", out]) == 2
    assert "stale" in err_line(capsys)


@pytest.mark.slow
def test_train_subcommand_runs_the_main_job(capsys):
    """`kfac-compiler train` with no arguments: the README's main job (200 K-FAC steps)."""
    assert main(["train", "-q"]) == 0
    final = [l for l in capsys.readouterr().out.splitlines() if l.startswith("final train loss")]
    assert final and float(final[0].split()[3]) < 0.05


# ------------------------------------------------------------------------- config
def test_config_toml_and_json(tmp_path):
    t = tmp_path / "c.toml"
    t.write_text('ema_decay = 0.9\n[estimator]\nmode = "empirical"\nnum_samples = 2\n[stats]\nupdate_period = 3\n')
    cfg = load_config(t)
    assert (cfg.ema_decay, cfg.estimator.mode, cfg.estimator.num_samples, cfg.stats.update_period) == (0.9, "empirical", 2, 3)
    assert cfg.inverse.update_period is None and cfg.damping == 1e-3 and cfg.loss_variance == 1.0
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"dtype": "float32", "inverse": {"damping_split": "exact"}}))
    cfg = load_config(j)
    assert cfg.dtype == "float32" and cfg.inverse.damping_split == "exact"
    # factors are float32 on every device: a plan that said float64 ran float32 factors, and its
    # budget counted twice their bytes
    j.write_text(json.dumps({"dtype": "float64"}))
    with pytest.raises(ConfigError, match="dtype.*'float64': factors are float32 on every device"):
        load_config(j)
    assert load_config(None) == CompileConfig()
    assert load_config({"damping": 0.1}).damping == 0.1


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"dampnig": 1}, "unknown key 'dampnig'"),
        ({"inverse": {"methd": "eigh"}}, "unknown key 'inverse.methd'"),
        ({"estimator": {"mode": "fisher"}}, "estimator.mode: unknown estimation mode 'fisher'; choose one of"),
        ({"estimator": {"num_samples": 0}}, "estimator.num_samples: expected an integer >= 1"),
        ({"inverse": {"method": "lu"}}, "inverse.method: unknown method 'lu'"),
        ({"inverse": {"damping_split": "half"}}, "inverse.damping_split"),
        ({"ema_decay": 1.0}, "ema_decay: 1.0 is outside [0.0, 1.0)"),
        ({"damping": -1}, "damping: -1 is outside"),
        ({"loss_variance": 0}, "loss_variance: 0 is outside"),
        ({"dtype": "float16"}, "dtype: 'float16'"),
        ({"exclude": "(x"}, "bad regular expression '(x'"),
        ({"layers": {"[a": "kron"}}, "bad regular expression '[a'"),
        ({"loss": "hinge"}, "unknown loss 'hinge'"),
        ({"links": {"params": ["a"]}}, "links: expected a list"),
        # each was accepted: num_samples of 1e9 grew to gigabytes for minutes, a list loss was a
        # TypeError traceback, conv_gather "false" was read as true
        ({"estimator": {"num_samples": 65}}, "estimator.num_samples: at most 64 (each sample is a backward pass"),
        ({"loss": ["softmax_cross_entropy"]}, "loss: expected a loss kind (a string), got ['softmax_cross_entropy']"),
        ({"loss": {"kind": "squared_error"}}, "loss: expected a loss kind (a string)"),
        ({"conv_gather": "false"}, "conv_gather: expected true or false, got 'false'"),
        ({"conv_gather": None}, "conv_gather: expected true or false, got None"),
    ],
)
def test_config_errors(data, expected):
    with pytest.raises(ConfigError) as e:
        CompileConfig.from_dict(data)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("damping = = 1\n")
    with pytest.raises(ConfigError, match="bad.toml' is not valid TOML"):
        load_config(bad)
    badj = tmp_path / "bad.json"
    badj.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(badj)
    unknown = tmp_path / "u.toml"
    unknown.write_text("[estimator]\nmodes = 'x'\n")
    with pytest.raises(ConfigError, match="u.toml: unknown key 'estimator.modes'"):
        load_config(unknown)


def test_unsupported_op_error_names_parameters_to_exclude(tmp_path, capsys):
    """An op without a gradient rule on a parameter's path: one line naming the node, the op
    (domain, opset) and the --exclude that gets past it; following that advice compiles."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = {"enc.weight": rng.standard_normal((4, 3, 3, 3)), "head.weight": rng.standard_normal((4, 5)),
             "head.bias": np.zeros(5)}
    nodes = [helper.make_node("Conv", ["input", "enc.weight"], ["c"], name="enc", pads=[1, 1, 1, 1]),
             helper.make_node("Constant", [], ["rois"], name="rois",
                              value=numpy_helper.from_array(np.asarray([[0, 0, 0, 4, 4]], np.float32))),
             helper.make_node("MaxRoiPool", ["c", "rois"], ["roi"], name="enc/roi", pooled_shape=[1, 1]),  # [1, 4, 1, 1]
             helper.make_node("GlobalAveragePool", ["c"], ["p"], name="enc/pool"),
             helper.make_node("Add", ["p", "roi"], ["n"], name="enc/add"),
             helper.make_node("Flatten", ["n"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "head.weight", "head.bias"], ["logits"], name="head")]
    g = helper.make_graph(nodes, "roi", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 6, 6])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path / "roi.onnx"
    onnx.save(m, path)
    argv = ["compile", str(path), "--loss", "softmax_cross_entropy", "-o", str(tmp_path / "plan")]
    assert main(argv) == 2
    msg = err_line(capsys)
    assert "node 'enc/roi': op MaxRoiPool (domain ai.onnx, opset 17) has no gradient rule" in msg
    assert "--exclude enc.weight" in msg and "head" not in msg and "docs/extending.md" in msg
    assert main(argv + ["--exclude", "enc.weight"]) == 0


@pytest.mark.slow
def test_compile_with_stdout_closed_writes_the_plan_and_exits_0(tmp_path, models):
    """`kfac-compiler compile ... >&-`: Python's sys.stdout is None; the table is discarded,
    as asked (was: an AttributeError traceback after the plan was written)."""
    import os
    import subprocess
    import sys

    plan = tmp_path / "plan"
    p = subprocess.run([sys.executable, "-m", "kfac_compiler.cli", "compile", models["mlp_classifier"], "--loss",
                        "softmax_cross_entropy", "-o", str(plan)], preexec_fn=lambda: os.close(1),
                       stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert (plan / "plan.json").is_file()


def test_a_reader_that_leaves_ends_the_command_quietly(tmp_path, models, monkeypatch, capsys):
    """`kfac-compiler inspect ... | head`: the reader closes the pipe; exit 141 (128 + SIGPIPE,
    as a shell reports it), no traceback, no error line."""
    import sys

    out = tmp_path / "plan"
    assert main(["compile", models["mlp_classifier"], "--loss", "softmax_cross_entropy", "-o", str(out), "-q"]) == 0
    capsys.readouterr()

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["inspect", str(out)]) == 141
    assert capsys.readouterr().err == ""


def test_compile_shows_its_slow_stages(tmp_path, monkeypatch, capsys):
    """`compile` prints one stderr line per stage of progress.SHOW_SECONDS or more (the front
    end, each emitted subgraph, the plan's writing); none with -q."""
    from kfac_compiler import progress

    model = save_model("mlp_classifier", tmp_path / "m.onnx")
    monkeypatch.setattr(progress, "SHOW_SECONDS", 0.0)
    assert main(["compile", str(model), "--loss", "softmax_cross_entropy", "-o", str(tmp_path / "plan")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("setup: ")]
    stages = [line.removeprefix("setup: ").rsplit(": ", 1)[0] for line in lines]
    assert stages[0] == "front end (load, layers, factors)" and stages[-1] == f"plan written to {tmp_path / 'plan'}"
    assert {"emitted kfac_step", "emitted inverse_update"} <= set(stages), stages
    assert all(line.endswith(" s") for line in lines)
    assert main(["compile", str(model), "--loss", "softmax_cross_entropy", "-q", "--force", "-o", str(tmp_path / "plan")]) == 0
    assert "setup: " not in capsys.readouterr().err
