"""Fisher blocks: one class per approximation, registered by name.

See base.py for the contract every block implements and registry.py for the registry.
`APPROXIMATIONS` is the menu the front end offers per layer kind (first entry = default),
after TensorFlow K-FAC; it is derived from the registered classes, so `@register_block` in
any imported module makes a new approximation selectable (docs/extending_blocks.md).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Sequence

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
from kfac_compiler.blocks import broadcast, conv, conv_transpose, embedding, flat, fully_connected, series, tied  # noqa: E402,F401
from kfac_compiler.blocks import ekfac  # noqa: E402,F401
from kfac_compiler.blocks import weight_norm  # noqa: E402,F401
from kfac_compiler.blocks._parts import emit_inverses, numpy_inverses  # noqa: E402


def plan_blocks(plan: Any, layers: Sequence[str] | None = None) -> dict[str, FisherBlock]:
    """{layer name: FisherBlock} of a kfac_compiler.plan.Plan's layers (all, or `layers`, in
    that order): the back end emits with them, and the runtime computes host-side inverses and
    the lower-level API's host products with their numpy twins (kfac_compiler/host_blocks.py).
    PlanError naming a layer the plan does not have."""
    from kfac_compiler.errors import PlanError

    known = {layer.name: layer for layer in plan.layers}
    missing = [name for name in (layers or ()) if name not in known]
    if missing:
        raise PlanError(f"the plan has no layer {missing[0]!r}")
    shapes, view = plan.param_shapes, plan.view()
    blocks = {
        name: make_block(known[name], {p: shapes[p] for p in known[name].params},
                         [view.shape(u.input) for u in known[name].uses], damping_mode=plan.inverse.damping_split)
        for name in (layers if layers is not None else known)
    }
    for name, block in blocks.items():  # an edited plan.json: its approximation and its factors disagree
        listed = (getattr(plan, "factors", None) or {}).get(name)
        if listed is None:
            continue
        want = [(f.name, tuple(f.shape)) for f in listed]
        try:
            have = [(f.name, tuple(f.shape)) for f in block.factor_specs()]
        except NotImplementedError:  # a block that does not list its factors (the plan says so in a note)
            continue
        if have != want:
            raise PlanError(f"the plan's layer {name!r} lists factors {want} but its approximation "
                            f"{known[name].approximation!r} has {have}: the plan file was edited or is corrupt; recompile")
    return blocks

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
    "plan_blocks",
    "register_block",
    "unregister_block",
]
