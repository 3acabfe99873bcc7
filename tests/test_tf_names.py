"""The TF K-FAC / kfac-jax spellings docs/coming_from_tf_kfac.md lists do what ours do."""
import numpy as np
import pytest

from helpers import zoo_plan
from kfac_compiler.config import CompileConfig
from kfac_compiler.contract import MODE_ALIASES
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers import KfacConfig
from kfac_compiler.runtime import Curvature


@pytest.fixture(scope="module")
def mlp():
    plan = zoo_plan("mlp_classifier", output=None)
    rng = np.random.default_rng(0)
    x = rng.random((16, 64), dtype=np.float32)
    y = rng.integers(0, 10, 16)
    return plan, {"input": x}, y


@pytest.mark.parametrize("alias", ["fisher_empirical", "fisher_exact", "ggn_exact"])
def test_kfac_jax_estimation_modes_estimate_what_ours_do(mlp, alias):
    plan, x, y = mlp
    ours = Curvature(plan, seed=3).estimate(x, y, mode=MODE_ALIASES[alias])
    theirs = Curvature(plan, seed=3, mode=alias).estimate(x, y)
    for layer, factors in ours.items():
        for name, value in factors.items():
            np.testing.assert_array_equal(theirs[layer][name], value)


def test_kfac_jax_mode_names_in_config_and_knobs():
    assert CompileConfig.from_dict({"estimator": {"mode": "ggn_curvature_prop"}}).estimator.mode == "curvature_prop_GGN"
    assert KfacConfig.from_knobs(estimation_mode="fisher_gradients").mode == "gradients"
    with pytest.raises(ConfigError, match="unknown estimation mode 'fisher'.*kfac-jax's fisher_gradients"):
        KfacConfig.from_knobs(estimation_mode="fisher")


@pytest.mark.parametrize("alias,ours,value", [
    ("initial_damping", "damping", 0.01), ("weight_decay", "l2_reg", 1e-4), ("curvature_ema", "cov_ema_decay", 0.8),
    ("covariance_ema_decay", "cov_ema_decay", 0.8), ("curvature_update_period", "cov_update_period", 3),
    ("inverse_update_period", "inv_update_period", 7), ("num_burnin_steps", "burn_in_steps", 2),
    ("cov_update_every", "cov_update_period", 3), ("invert_every", "inv_update_period", 7),
    ("num_estimator_samples", "num_samples", 2), ("use_adaptive_damping", "adapt_damping", False),
    ("use_adaptive_learning_rate", "use_qmodel", True), ("damping_schedule", "damping", "0.1@0,0.01@10"),
])
def test_kfac_jax_and_tf_knob_spellings_set_our_knobs(alias, ours, value):
    knobs = {"adapt_damping": False} if alias == "damping_schedule" else {}
    theirs = KfacConfig.from_knobs(**{alias: value}, **knobs)
    assert theirs.to_dict() == KfacConfig.from_knobs(**{ours: value}, **knobs).to_dict()
    assert getattr(theirs, ours) is not None


def test_learning_rate_schedule_spelling_schedules_the_learning_rate():
    cfg = KfacConfig.from_knobs(learning_rate_schedule=lambda k: 0.1 / (1 + k), momentum_type="regular")
    assert [cfg.at("learning_rate", k) for k in (0, 1, 3)] == [0.1, 0.05, 0.025]
