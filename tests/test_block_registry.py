"""The block menu is derived from the registered classes: pinned to the menu the front end
offers (the tied_embedding row added with blocks/tied.py, ekfac with blocks/ekfac.py, weight_norm_conv with blocks/weight_norm.py), and a class registered later (with its `uses` and `menu_rank`) shows up
in it, in config validation and in the block choice."""
from __future__ import annotations

import pytest

from kfac_compiler.blocks import APPROXIMATIONS, BLOCK_CLASSES, BLOCKS, menu_key, register_block, unregister_block
from kfac_compiler.blocks.fully_connected import FullyConnectedDiagonal
from kfac_compiler.config import CompileConfig
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import Layer, LayerUse
from kfac_compiler.passes.choose_blocks import choose_blocks

MENU = {
    "fully_connected": ("kron", "diagonal", "kron_in_diag", "kron_out_diag", "kron_both_diag", "ekfac"),
    "fully_connected_multi": ("kron_indep", "kron_series_1", "kron_series_2", "kron_indep_in_diag", "kron_indep_out_diag",
                              "kron_indep_both_diag", "diagonal", "kron_in_diag", "kron_out_diag", "kron_both_diag", "ekfac"),
    "conv": ("kron", "diagonal", "kron_in_diag", "kron_out_diag", "kron_both_diag", "ekfac"),
    "conv_multi": ("kron_indep", "kron_indep_in_diag", "kron_indep_out_diag", "kron_indep_both_diag", "diagonal",
                   "kron_in_diag", "kron_out_diag", "kron_both_diag", "ekfac"),
    "weight_norm_conv": ("kron",),
    "depthwise_conv": ("channel_full", "diagonal", "kron"),
    "conv_transpose": ("kron", "diagonal"),
    "embedding": ("kron",),
    "scale_and_shift": ("full", "diagonal"),
    "broadcast": ("diagonal", "full"),
    "tied_embedding": ("diagonal", "kron_tied_vocab_diag", "kron_tied"),
    "generic": ("diagonal", "full"),
}


@pytest.fixture
def registry():
    """Restores the registry after a test that registers classes of its own."""
    classes, blocks = dict(BLOCK_CLASSES), dict(BLOCKS)
    yield
    BLOCK_CLASSES.clear()
    BLOCK_CLASSES.update(classes)
    BLOCKS.clear()
    BLOCKS.update(blocks)


def layer(kind: str, uses: int = 1, approximation: str | None = None) -> Layer:
    use = tuple(LayerUse((f"n{u}",), f"x{u}", f"y{u}") for u in range(uses))
    return Layer("fc", kind, ("W",), use, approximation=approximation)


def test_menu_is_the_one_the_front_end_always_offered():
    assert list(APPROXIMATIONS) == list(MENU)  # key order too: error messages list them
    assert dict(APPROXIMATIONS) == MENU
    assert APPROXIMATIONS == MENU
    assert menu_key("fully_connected", 3) == "fully_connected_multi"
    assert menu_key("depthwise_conv", 3) == "depthwise_conv"  # no multi-use menu: its own
    assert menu_key("embedding", 1) == "embedding"


def test_a_registered_class_joins_the_menus_by_its_declaration(registry):
    @register_block
    class Extra(FullyConnectedDiagonal):
        name = "extra"
        uses = "any"
        menu_rank = 11  # between kron_in_diag and kron_out_diag; after diagonal (10) in the multi menu

    fc = ("kron", "diagonal", "kron_in_diag", "extra", "kron_out_diag", "kron_both_diag", "ekfac")
    assert APPROXIMATIONS["fully_connected"] == fc
    multi = ("kron_indep", "kron_series_1", "kron_series_2", "kron_indep_in_diag", "kron_indep_out_diag",
             "kron_indep_both_diag", "diagonal", "kron_in_diag", "extra", "kron_out_diag", "kron_both_diag", "ekfac")
    assert APPROXIMATIONS["fully_connected_multi"] == multi
    cfg = CompileConfig.from_dict({"approximations": {"fully_connected_multi": "extra"}})
    (chosen,) = choose_blocks([layer("fully_connected", uses=2)], cfg)
    assert chosen.approximation == "extra"
    unregister_block(Extra)
    assert APPROXIMATIONS == MENU
    with pytest.raises(ConfigError, match="extra"):
        CompileConfig.from_dict({"approximations": {"fully_connected": "extra"}})


def test_a_multi_only_class_creates_the_kinds_multi_menu_and_rank_zero_is_the_default(registry):
    @register_block
    class DepthwiseMulti(FullyConnectedDiagonal):
        name = "depthwise_multi"
        layer_kinds = ("depthwise_conv",)
        uses = "multi"
        menu_rank = 0

    assert APPROXIMATIONS["depthwise_conv"] == MENU["depthwise_conv"]
    assert APPROXIMATIONS["depthwise_conv_multi"] == ("depthwise_multi", *MENU["depthwise_conv"])
    assert list(APPROXIMATIONS).index("depthwise_conv_multi") == list(APPROXIMATIONS).index("depthwise_conv") + 1
    assert menu_key("depthwise_conv", 2) == "depthwise_conv_multi"
    (chosen,) = choose_blocks([layer("depthwise_conv", uses=2)])
    assert chosen.approximation == "depthwise_multi"


def test_a_new_kind_is_listed_after_the_known_ones(registry):
    @register_block
    class Other(FullyConnectedDiagonal):
        name = "diagonal"
        layer_kinds = ("my_kind",)

    assert list(APPROXIMATIONS)[-1] == "my_kind" and APPROXIMATIONS["my_kind"] == ("diagonal",)
    assert BLOCKS["diagonal"] is not Other  # BLOCKS keeps the first class of a name
    unregister_block(Other)
    assert "my_kind" not in APPROXIMATIONS


def test_bad_declarations_are_refused():
    class NoName(FullyConnectedDiagonal):
        name = ""

    class BadUses(FullyConnectedDiagonal):
        name = "bad_uses"
        uses = "twice"

    for cls in (NoName, BadUses):
        with pytest.raises(TypeError):
            register_block(cls)
    assert APPROXIMATIONS == MENU


def test_a_block_missing_a_hook_is_refused_naming_it():
    """A FisherBlock subclass that leaves a hook to the base (here the statistics, the inverse
    and their numpy twins) is refused when registered, naming what to implement; it used to
    register and fail later with an empty NotImplementedError deep in the compiler."""
    from kfac_compiler.blocks.base import FisherBlock

    class Empty(FisherBlock):
        name, layer_kinds = "empty_block", ("fully_connected",)

        def factor_specs(self):
            return []

    with pytest.raises(TypeError, match="block class Empty: implement emit_inverse, emit_power, emit_statistics, "
                                        "inverse_flops, inverse_specs, numpy_inverse, numpy_power, "
                                        "numpy_statistics, stats_flops before registering it"):
        register_block(Empty)
    assert APPROXIMATIONS == MENU
