"""Fisher blocks: one class per approximation, registered by name.

See base.py for the contract every block implements and registry.py for the registry.
`APPROXIMATIONS` is the menu the front end offers per layer kind (first entry = default),
after TensorFlow K-FAC; it is derived from the registered classes, so `@register_block` in
any imported module makes a new approximation selectable (docs/extending_blocks.md).
"""
from __future__ import annotations

from kfac_compiler.blocks.base import FisherBlock, InverseState, make_block
from kfac_compiler.blocks.registry import (
    APPROXIMATIONS,
    BLOCK_CLASSES,
    BLOCKS,
    block_class,
    menu_key,
    register_block,
    unregister_block,
)

# Importing the block modules registers their classes (BLOCK_CLASSES[(name, kind)]).
from kfac_compiler.blocks import conv, conv_transpose, embedding, flat, fully_connected, series, tied  # noqa: E402,F401
from kfac_compiler.blocks import ekfac  # noqa: E402,F401
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
    "unregister_block",
]
