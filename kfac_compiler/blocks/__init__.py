"""Fisher blocks: one class per approximation, registered by name.

See base.py for the contract every block implements. `APPROXIMATIONS` is the menu the
front end offers per layer kind (first entry = default), after TensorFlow K-FAC.
"""
from __future__ import annotations

from kfac_compiler.blocks.base import (
    BLOCK_CLASSES,
    BLOCKS,
    FisherBlock,
    InverseState,
    block_class,
    make_block,
    register_block,
)

APPROXIMATIONS: dict[str, tuple[str, ...]] = {
    "fully_connected": ("kron", "diagonal", "kron_in_diag", "kron_out_diag", "kron_both_diag"),
    "fully_connected_multi": ("kron_indep", "kron_series_1", "kron_series_2", "diagonal"),
    "conv": ("kron", "diagonal"),
    "conv_multi": ("kron_indep", "diagonal"),
    "depthwise_conv": ("diagonal",),
    "embedding": ("kron",),
    "scale_and_shift": ("full", "diagonal"),
    "generic": ("diagonal", "full"),
}


def menu_key(kind: str, num_uses: int) -> str:
    """Key into APPROXIMATIONS for a layer kind and its number of uses."""
    multi = f"{kind}_multi"
    return multi if num_uses > 1 and multi in APPROXIMATIONS else kind


# Importing the block modules registers their classes (BLOCK_CLASSES[(name, kind)]).
from kfac_compiler.blocks import conv, embedding, flat, fully_connected, series  # noqa: E402,F401
from kfac_compiler.blocks._parts import emit_inverses, numpy_inverses  # noqa: E402

__all__ = [
    "APPROXIMATIONS",
    "BLOCK_CLASSES",
    "BLOCKS",
    "FisherBlock",
    "InverseState",
    "block_class",
    "emit_inverses",
    "make_block",
    "menu_key",
    "numpy_inverses",
    "register_block",
]
