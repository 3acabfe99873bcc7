"""The cost-aware choice (passes/budget.py): which factors become diagonal and which periods
are chosen, checked against FLOPs computed by hand for a wide conv model; the zoo keeps its
defaults; user choices are kept; the Trainer runs the chosen schedule."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kfac_compiler as kc
from kfac_compiler.models import ZOO, get_model
from kfac_compiler.passes.budget import STATS_PERIODS

C, S, CLASSES = 128, 2, 10  # a 3x3 conv 128 -> 128 on 2x2 inputs: its A is 128*9 + 1 = 1153 wide


def wide_conv_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((C, C, 3, 3)) * 0.03).astype(np.float32), "conv.w"),
        numpy_helper.from_array((rng.standard_normal(C) * 0.01).astype(np.float32), "conv.b"),
        numpy_helper.from_array((rng.standard_normal((CLASSES, C * S * S)) * 0.05).astype(np.float32), "fc.w"),
        numpy_helper.from_array((rng.standard_normal(CLASSES) * 0.01).astype(np.float32), "fc.b"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "conv.w", "conv.b"], ["h"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", C, S, S])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def layer_named(plan, param):
    return next(l for l in plan.layers if param in l.params)


def test_a_wide_conv_input_factor_becomes_diagonal_by_hand_computed_flops():
    plan = kc.compile(wide_conv_model(), loss="softmax_cross_entropy", emit=False)
    conv, fc = layer_named(plan, "conv.w"), layer_named(plan, "fc.w")
    N, T, nA, nG = 32, S * S, C * 9 + 1, C
    # forward+backward = 3 x forward: the conv's 2 N T C_out (C_in 9 + 1) and the head's 2 N (in + 1) out FLOPs
    base = 3 * (2 * N * T * C * nA + 2 * N * (C * S * S + 1) * CLASSES)
    full_apply = 2 * nG * nA**2 + 2 * nG**2 * nA  # G X A with both factors full: 1.7x base
    assert full_apply > base / 2
    assert conv.approximation == "kron_in_diag" and fc.approximation == "kron"
    costs = plan.costs
    assert costs["forward_backward_flops"] == base
    head_apply = 2 * CLASSES * (C * S * S + 1) ** 2 + 2 * CLASSES**2 * (C * S * S + 1)
    assert costs["layers"][conv.name]["apply"] == nG * nA + 2 * nG**2 * nA
    assert costs["apply_flops"] == nG * nA + 2 * nG**2 * nA + head_apply
    assert costs["apply_flops"] <= base / 2
    assert [s.shape for s in plan.factors[conv.name]] == [(nA,), (nG, nG)]
    assert any("conv" in n and "kron_in_diag" in n and "1153 wide" in n for n in plan.notes)
    # the periods: the smallest on the ladders keeping statistics and inverses within a quarter each
    s, r = plan.schedule.stats.update_period, plan.schedule.inverse.update_period
    assert costs["stats_flops_per_update"] / s <= base / 4
    smaller = [p for p in STATS_PERIODS if p < s]
    assert all(costs["stats_flops_per_update"] / p > base / 4 for p in smaller)
    assert (s, r) == (costs["stats_period"], costs["inverse_period"])
    assert costs["overhead"] <= 1.0


def test_a_larger_reference_batch_keeps_the_factor_full():
    # at batch 256 the conv's full preconditioning is 0.2x its forward+backward: within budget
    plan = kc.compile(wide_conv_model(), loss="softmax_cross_entropy", emit=False, budget={"batch_size": 256})
    assert layer_named(plan, "conv.w").approximation == "kron"
    assert plan.costs["apply_flops"] <= plan.costs["forward_backward_flops"] / 2


def test_the_predicted_step_counts_the_sampled_backward_on_64_rows_and_the_qmodel_on_the_batch():
    # at batch 256 the statistics' sampled backward runs on 64 examples, the quadratic model's
    # two JVPs (about two forwards each) on all 256: hand-computed forward FLOPs of both layers
    def forward(n):
        return 2 * n * S * S * C * (C * 9 + 1) + 2 * n * (C * S * S + 1) * CLASSES

    costs = kc.compile(wide_conv_model(), loss="softmax_cross_entropy", emit=False, budget={"batch_size": 256}).costs
    assert costs["forward_backward_flops"] == 3 * forward(256)
    assert costs["sampled_backward_flops"] == 2 * forward(64)
    assert costs["qmodel_flops"] == 4 * forward(256)


def test_train_uses_its_batch_size_unless_the_config_sets_one(tmp_path):
    from kfac_compiler.cli import build_parser
    from kfac_compiler.train_cli import compile_config

    cfg_file = tmp_path / "budget.toml"
    cfg_file.write_text("[budget]\nbatch_size = 32\n")
    args = build_parser().parse_args(["train", "m.onnx", "--batch-size", "256"])
    assert compile_config(args).budget.batch_size == 256
    args = build_parser().parse_args(["train", "m.onnx", "--batch-size", "256", "--config", str(cfg_file)])
    assert compile_config(args).budget.batch_size == 32  # even when it equals the API's reference batch
    plan = kc.compile(wide_conv_model(), loss="softmax_cross_entropy", emit=False)
    assert plan.costs["batch_size"] == 32  # the API's reference batch


def test_user_choices_and_periods_are_kept_and_zero_overhead_is_off():
    pinned = kc.compile(wide_conv_model(), loss="softmax_cross_entropy", emit=False,
                        layers={"conv.*": "kron"}, stats={"update_period": 3}, inverse={"update_period": 7})
    assert layer_named(pinned, "conv.w").approximation == "kron"
    assert (pinned.schedule.stats.update_period, pinned.schedule.inverse.update_period) == (3, 7)
    off = kc.compile(wide_conv_model(), loss="softmax_cross_entropy", emit=False, budget={"overhead": 0})
    assert layer_named(off, "conv.w").approximation == "kron"
    assert (off.schedule.stats.update_period, off.schedule.inverse.update_period) == (1, 10)
    assert not any("budget" in n for n in off.notes)
    with pytest.raises(kc.KfacError, match="budget.overhead"):
        kc.compile(wide_conv_model(), loss="softmax_cross_entropy", emit=False, budget={"overhead": -1})


@pytest.mark.parametrize("name", list(ZOO))
def test_the_zoo_keeps_its_defaults(name):
    """Every zoo factor is narrower than min_dim (512): nothing is approximated, periods 1 and 10
    (the digits results in docs/runtime.md were measured with them)."""
    entry = ZOO[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the RNN's shared zero bias is reported (passes/untie.py)
        plan = kc.compile(get_model(name), loss=entry.loss, emit=False)
        plain = kc.compile(get_model(name), loss=entry.loss, emit=False, budget={"overhead": 0})
    assert [l.approximation for l in plan.layers] == [l.approximation for l in plain.layers]
    assert (plan.schedule.stats.update_period, plan.schedule.inverse.update_period) == (1, 10)


def test_the_trainer_runs_the_chosen_schedule_and_trains():
    from kfac_compiler.runtime import Trainer

    plan = kc.compile(wide_conv_model(), loss="softmax_cross_entropy")
    s = plan.schedule.stats.update_period
    assert s > 1
    tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=32, seed=0)
    assert tr.config.cov_update_period == s and tr.config.inv_update_period == plan.schedule.inverse.update_period
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, C, S, S)).astype(np.float32)
    y = (x[:, :CLASSES].sum(axis=(2, 3)).argmax(1)).astype(np.int64)  # learnable from the input
    losses, stats = [], []
    for _ in range(2 * s + 1):
        m = tr.step({"input": x}, y)
        losses.append(m["loss"])
        stats.append(m["stats"])
    assert stats[: s + 1] == [1.0] + [0.0] * (s - 1) + [1.0]  # statistics at steps 0 and s only
    assert losses[-1] < 0.5 * losses[0]


# --------------------------------------------------------------------------- memory
def _mlp_plan(**config):
    e = ZOO["mlp_classifier"]
    return kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False, config=config)


def test_a_block_whose_state_does_not_fit_the_memory_budget_becomes_diagonal_step_by_step():
    """fc1 (64 inputs + bias, 128 outputs): kron holds A 65x65 and G 128x128 in float32, each
    with its inverse and both double-buffered: 4 x 4 x (65^2 + 128^2) = 329,744 bytes; the
    widest full factor (G) becomes its diagonal first: 4 x 4 x (65^2 + 128) = 69,648 bytes."""
    plan = _mlp_plan(budget={"memory_gb": 2e-4})  # 200,000 bytes
    approx = {layer.name: layer.approximation for layer in plan.layers}
    assert approx["fc1"] == "kron_out_diag"
    assert ("layer 'fc1': kron keeps 322.0 KiB of factors, inverses and their buffers, more than the 195.3 KiB of "
            "memory the budget allows (budget.memory_gb): approximated as kron_out_diag (68.0 KiB)") in plan.notes
    assert 4 * 4 * (65**2 + 128**2) == 329_744 and 4 * 4 * (65**2 + 128) == 69_648
    assert _mlp_plan(budget={"memory_gb": 1.0}).layers[0].approximation == "kron"


def test_a_chosen_approximation_that_does_not_fit_is_refused_with_one_that_does():
    with pytest.raises(kc.KfacError) as got:
        _mlp_plan(budget={"memory_gb": 2e-4}, layers={"fc1": "kron"})
    assert str(got.value) == ("layer 'fc1': kron keeps 322.0 KiB of factors, inverses and their buffers, more than the "
                              "195.3 KiB of memory the budget allows (budget.memory_gb); use kron_out_diag (its "
                              "state: 68.0 KiB)")
    with pytest.raises(kc.KfacError, match="choose a diagonal approximation or exclude the layer's parameters"):
        _mlp_plan(budget={"memory_gb": 1e-6})


def test_blocks_that_fit_alone_but_not_together_step_down_where_it_saves_most():
    """mlp_classifier's kron states (factors and inverses, float32, double-buffered): fc1 4*4*(65^2+128^2) =
    329,744, fc2 4*4*(129^2+128^2) = 528,400, fc3 4*4*(129^2+10^2) = 267,856 bytes: 1,126,000
    together, each under the 1,000,000 allowed. The widest-factor steps save fc1 4*4*(128^2-128)
    = 260,096, fc2 (A, 129 wide) 4*4*(129^2-129) = 264,192 and fc3 the same 264,192: fc2, the
    first of the largest, becomes kron_in_diag and the total, 861,808, fits."""
    plan = _mlp_plan(budget={"memory_gb": 1e-3})
    approx = {layer.name: layer.approximation for layer in plan.layers}
    assert approx == {"fc1": "kron", "fc2": "kron_in_diag", "fc3": "kron"}
    assert 329_744 + 528_400 + 267_856 == 1_126_000 and 1_126_000 - 264_192 == 861_808
    assert ("layer 'fc2': approximated as kron_in_diag instead of kron (516.0 KiB -> 258.0 KiB) so that the model's "
            "curvature state (1.1 MiB before this step) fits the 976.6 KiB of memory the budget allows "
            "(budget.memory_gb)") in plan.notes


def test_the_whole_models_state_is_refused_in_one_line_when_no_step_is_left():
    """Every layer pinned to kron: 1,126,000 bytes do not fit 1,000,000, and nothing may change."""
    with pytest.raises(kc.KfacError) as got:
        _mlp_plan(budget={"memory_gb": 1e-3}, layers={"fc1": "kron", "fc2": "kron", "fc3": "kron"})
    assert str(got.value) == (
        "the model's curvature keeps 1.1 MiB of factors, inverses and their buffers, more than the 976.6 KiB of memory "
        "the budget allows (budget.memory_gb), and no layer left to the compiler has a smaller approximation; the "
        "largest is layer 'fc2' (kron, 516.0 KiB): choose diagonal approximations or exclude parameters")


def _layernorm_head(width: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.ones(width, np.float32), "ln.w"),
             numpy_helper.from_array(np.zeros(width, np.float32), "ln.b"),
             numpy_helper.from_array((rng.standard_normal((CLASSES, width)) * 0.1).astype(np.float32), "fc.w"),
             numpy_helper.from_array(np.zeros(CLASSES, np.float32), "fc.b")]
    nodes = [helper.make_node("LayerNormalization", ["input", "ln.w", "ln.b"], ["h"], name="ln", axis=-1),
             helper.make_node("Gemm", ["h", "fc.w", "fc.b"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "ln_head", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_full_block_steps_down_to_the_diagonal_on_its_menu():
    """LayerNorm(64)'s scale_and_shift `full` block keeps one (2*64)^2 matrix: 4*4*128^2 =
    262,144 bytes; its `diagonal` 4*4*128 = 2,048; the head's kron 4*4*(65^2+10^2) = 69,200.
    Together 331,344 > 300,000 (each fits alone): full -> diagonal saves 260,096, more than
    the head's widest factor (A, 65 wide: 4*4*(65^2-65) = 66,560)."""
    model = _layernorm_head(64)
    kw = dict(loss="softmax_cross_entropy", output="logits", emit=False)
    assert {l.name: l.approximation for l in kc.compile(model, **kw).layers} == {"ln.w": "full", "fc.w": "kron"}
    plan = kc.compile(model, **kw, config={"budget": {"memory_gb": 3e-4}})
    assert {l.name: l.approximation for l in plan.layers} == {"ln.w": "diagonal", "fc.w": "kron"}
    assert 262_144 + 69_200 == 331_344 > 300_000 and 262_144 - 2_048 == 260_096 > 4 * 4 * (65**2 - 65) == 66_560
    assert ("layer 'ln.w': approximated as diagonal instead of full (256.0 KiB -> 2.0 KiB) so that the model's "
            "curvature state (323.6 KiB before this step) fits the 293.0 KiB of memory the budget allows "
            "(budget.memory_gb)") in plan.notes


def test_a_lone_full_block_over_the_budget_steps_down_to_the_diagonal_on_its_menu():
    """The single-block check takes the whole-model check's steps: LayerNorm(64)'s `full`
    scale_and_shift block alone keeps 4*4*(2*64)^2 = 262,144 bytes, over 200,000; its menu's
    next smaller entry, `diagonal`, keeps 4*4*128 = 2,048 (with the head's kron, 69,200, the
    model fits: 71,248). Before, only Kronecker steps were tried there and the compile was
    refused. Chosen by the user, `full` is refused naming `diagonal`."""
    model = _layernorm_head(64)
    kw = dict(loss="softmax_cross_entropy", output="logits", emit=False)
    plan = kc.compile(model, **kw, config={"budget": {"memory_gb": 2e-4}})
    assert {l.name: l.approximation for l in plan.layers} == {"ln.w": "diagonal", "fc.w": "kron"}
    assert 4 * 4 * 128**2 == 262_144 > 200_000 and 4 * 4 * 128 == 2_048 and 2_048 + 69_200 == 71_248
    assert ("layer 'ln.w': full keeps 256.0 KiB of factors, inverses and their buffers, more than the 195.3 KiB of "
            "memory the budget allows (budget.memory_gb): approximated as diagonal (2.0 KiB)") in plan.notes
    assert not any("so that the model's curvature state" in n for n in plan.notes)  # the single-block check did it
    with pytest.raises(kc.KfacError) as got:
        kc.compile(model, **kw, config={"budget": {"memory_gb": 2e-4}, "layers": {"ln.w": "full"}})
    assert str(got.value) == ("layer 'ln.w': full keeps 256.0 KiB of factors, inverses and their buffers, more than "
                              "the 195.3 KiB of memory the budget allows (budget.memory_gb); use diagonal (its state: "
                              "2.0 KiB)")


def test_the_budget_prices_and_steps_at_the_plans_damping_split():
    """With damping_split "exact" the blocks keep eigenbases (A_Q, G_Q and D_inv [out, in]),
    not the inverses of the factors, and take no diagonal factor. The budget priced them at the
    pi split: it counted 4 x the factors' bytes (an ekfac or exact plan it admitted used more),
    and stepped a factor to its diagonal, which the exact split then refused. Now fc1's exact
    kron state is 2 x 4 x (65^2 + 128^2 [factors] + 65^2 + 128^2 + 128 x 65 [eigenbases and
    D_inv]) = 396,304 bytes (the Trainer's slots, counted below, double-buffered); fc2's,
    2 x 4 x (2 x (129^2 + 128^2) + 128 x 129) = 660,496, is over a 500,000-byte budget: its
    step is to the menu's diagonal (2 x 4 x 2 x 128 x 129 = 264,192 bytes), never to
    kron_in_diag; and the apply FLOPs count both rotations and the scaling."""
    from kfac_compiler.runtime import Trainer

    plan = _mlp_plan(inverse={"damping_split": "exact"})
    tr = Trainer(plan)
    inputs, y = ZOO["mlp_classifier"].make_data(64, seed=0)
    tr.step(inputs, y)
    fc1 = sum(v.nbytes for k, v in tr.state().items() if k.startswith(("factor/fc1/", "inverse/fc1/")))
    assert 2 * fc1 == 2 * 4 * (2 * (65**2 + 128**2) + 128 * 65) == 396_304
    assert plan.costs["layers"]["fc1"]["apply"] == 2 * (2 * 128 * 65**2 + 2 * 128**2 * 65) + 128 * 65
    tight = _mlp_plan(inverse={"damping_split": "exact"}, budget={"memory_gb": 5e-4})
    approx = {layer.name: layer.approximation for layer in tight.layers}
    assert approx["fc2"] == "diagonal" and not any("diag" in a and a != "diagonal" for a in approx.values())
    assert ("layer 'fc2': kron keeps 645.0 KiB of factors, inverses and their buffers, more than the 488.3 KiB of "
            "memory the budget allows (budget.memory_gb): approximated as diagonal (258.0 KiB)") in tight.notes
    assert 2 * 4 * (2 * (129**2 + 128**2) + 128 * 129) == 660_496 and 2 * 4 * 2 * 128 * 129 == 264_192


def test_a_fully_connected_layer_on_time_major_rows_is_priced_per_position():
    """A MatMul on time-major rows [T, N, D] (torch's MultiheadAttention in-projection; its
    out-projection's merged [T N, D] rows alike) counted one position per example (ViT's
    attention FLOPs 17x low, the model's forward+backward 40% low, and the periods chosen from
    that). Priced from the example axis now: the batch-major layer's FLOPs, T = 4 positions."""
    from kfac_compiler.blocks import plan_blocks

    rng = np.random.default_rng(0)
    T, D, H = 4, 3, 5

    def model(layout: str) -> onnx.ModelProto:
        nodes, x = [], "input"
        if layout != "batch":
            nodes.append(helper.make_node("Transpose", ["input"], ["xt"], perm=[1, 0, 2]))  # [T, N, D]
            x = "xt"
        nodes += [helper.make_node("MatMul", [x, "W"], ["h"]),
                  helper.make_node("ReduceSum", ["h", "t_axis"], ["s"], keepdims=0),
                  helper.make_node("Gemm", ["s", "V"], ["logits"], transB=1)]
        inits = {"W": rng.normal(size=(D, H)).astype(np.float32), "V": rng.normal(size=(2, H)).astype(np.float32),
                 "t_axis": np.array([1 if layout == "batch" else 0], np.int64)}
        graph = helper.make_graph(nodes, layout, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", T, D])],
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2])],
                                  [numpy_helper.from_array(v, k) for k, v in inits.items()])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    costs = {}
    for layout in ("batch", "time_major"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = kc.compile(model(layout), loss="softmax_cross_entropy", output="logits", emit=False)
        assert plan_blocks(plan)["W"].positions_per_example() == T
        costs[layout] = plan.costs["layers"]["W"]
    assert costs["time_major"] == costs["batch"]


def test_the_statistics_cost_counts_the_estimators_backward_passes():
    """A statistics update runs one backward pass per sample (the sampled modes), per output
    coordinate (the exact modes: 10 classes here) and none in the empirical mode when its rows
    are the whole batch (it reuses the step's); the prediction priced one sampled pass
    whatever the mode (ResNet-18: 2.30x for every mode, 6.97x by hand with 8 samples)."""
    one = _mlp_plan().costs
    assert one["statistics_backward_passes"] == 1
    for estimator, passes in (({"num_samples": 8}, 8), ({"mode": "exact"}, 10), ({"mode": "empirical"}, 0)):
        costs = _mlp_plan(estimator=estimator).costs
        assert costs["statistics_backward_passes"] == passes
        assert costs["sampled_backward_flops"] == passes * one["sampled_backward_flops"]
        assert costs["stats_flops_per_update"] - costs["sampled_backward_flops"] == \
            one["stats_flops_per_update"] - one["sampled_backward_flops"]


def test_a_period_that_cannot_meet_the_overhead_says_so():
    """With budget.overhead 0.01 on the classifier (min_dim 1: every factor counts) no
    statistics period fits a quarter of it: the longest (50) is taken, and the note said it
    kept the work "within budget.overhead"; it gives the share it still costs now."""
    plan = _mlp_plan(budget={"overhead": 0.01, "min_dim": 1})
    c = plan.costs
    share = c["stats_flops_per_update"] / 50 / c["forward_backward_flops"]
    assert c["stats_period"] == 50 and share > 0.01 / 4
    assert (f"stats.update_period = 50 (default 1), the longest on offer: it still costs {share:.2f}x the "
            "forward+backward at batch 32, above the 0.0025x budget.overhead 0.01 allows it; set it in the config "
            "to override") in plan.notes
