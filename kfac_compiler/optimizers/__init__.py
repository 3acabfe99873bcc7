"""Optimizers as plugins (base.py): each in its own module with its settings, the graph it
emits and its host-side policy, registered by name in OPTIMIZERS."""
from kfac_compiler.optimizers.base import (
    OPTIMIZERS,
    Gram,
    Optimizer,
    FirstOrderStepOptions,
    make_config,
    optimizer_class,
    register_optimizer,
    regularized,
)
from kfac_compiler.optimizers.settings import ALIASES, OptimizerConfig

# Importing the optimizer modules registers them.
from kfac_compiler.optimizers import adam, kfac, sgd  # noqa: E402,F401
from kfac_compiler.optimizers.adam import AdamConfig  # noqa: E402
from kfac_compiler.optimizers.kfac import KfacConfig, ema_coefficient, lm_adapt, reduction_ratio  # noqa: E402
from kfac_compiler.optimizers.sgd import SgdConfig  # noqa: E402

__all__ = [
    "ALIASES", "OPTIMIZERS", "AdamConfig", "Gram", "KfacConfig", "Optimizer", "OptimizerConfig", "SgdConfig",
    "FirstOrderStepOptions", "ema_coefficient", "lm_adapt", "make_config", "optimizer_class", "reduction_ratio",
    "register_optimizer", "regularized",
]
