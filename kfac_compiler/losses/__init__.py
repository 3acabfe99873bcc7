"""Losses as predictive distributions: one class per loss kind, registered by name.

base.py holds the contract every loss implements (what a loss class owns and why) and the
registry; each built-in loss has its own module. A new loss is one module defining a Loss
subclass decorated with @register_loss (docs/extending_losses.md).
"""
from kfac_compiler.losses.base import (
    LOSSES,
    ElementwiseLoss,
    Loss,
    LossOption,
    loss_class,
    loss_kinds,
    losses_help,
    make_loss,
    optional_int,
    positive_int,
    positive_number,
    reduce_rows,
    register_loss,
)
from kfac_compiler.losses.softmax_cross_entropy import SoftmaxCrossEntropy
from kfac_compiler.losses.sigmoid_cross_entropy import SigmoidCrossEntropy
from kfac_compiler.losses.squared_error import SquaredError
from kfac_compiler.losses.heads import Head, MultiHead, parse_heads

__all__ = [
    "LOSSES", "ElementwiseLoss", "Head", "Loss", "MultiHead", "LossOption", "SigmoidCrossEntropy", "SoftmaxCrossEntropy", "SquaredError",
    "loss_class", "loss_kinds", "losses_help", "make_loss", "optional_int", "parse_heads", "positive_int", "positive_number",
    "reduce_rows", "register_loss",
]
