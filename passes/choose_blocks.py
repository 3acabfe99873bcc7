"""Pass 4: choose each layer's Fisher block (its `approximation`).

The menu of a layer is kfac_compiler.blocks.APPROXIMATIONS[menu_key(kind, num_uses)], derived
from the registered block classes (blocks/registry.py); its first entry is the default.
Precedence, highest first:
  1. config.layers {layer name or regex (full match): approximation} - the first entry that
     matches the layer name, in file order;
  2. an approximation already set on the layer (user links);
  3. config.approximations[menu key] (e.g. "fully_connected_multi");
  4. config.approximations[kind] (e.g. "fully_connected");
  5. the menu's default.
A choice outside the layer's menu is a ConfigError naming the layer and the allowed values.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kfac_compiler.blocks import APPROXIMATIONS, menu_key
from kfac_compiler.config import CompileConfig, compile_patterns
from kfac_compiler.errors import ConfigError
from kfac_compiler.ir import Layer


def choose_blocks(layers: Iterable[Layer], config: CompileConfig | None = None) -> list[Layer]:
    """Layers with `approximation` set (new objects; the input is not changed)."""
    config = config or CompileConfig()
    layers = list(layers)
    overrides = list(config.layers.items())
    rxs = compile_patterns([k for k, _ in overrides], "layers")
    used = [False] * len(overrides)
    out = []
    for layer in layers:
        key = menu_key(layer.kind, layer.num_uses)
        menu = APPROXIMATIONS.get(key)
        if not menu:
            raise ConfigError(f"layer {layer.name!r}: no Fisher block is known for kind {layer.kind!r}")
        choice, source = None, ""
        for i, ((pat, approx), rx) in enumerate(zip(overrides, rxs)):
            if layer.name == pat or rx.fullmatch(layer.name):
                choice, source, used[i] = approx, f"config layers[{pat!r}]", True
                break
        if choice is None and layer.approximation:
            choice, source = layer.approximation, "links"
        if choice is None and key in config.approximations:
            choice, source = config.approximations[key], f"config approximations.{key}"
        if choice is None and layer.kind in config.approximations:
            choice, source = config.approximations[layer.kind], f"config approximations.{layer.kind}"
        if choice is None:
            choice = menu[0]
        if choice not in menu:
            uses = f" with {layer.num_uses} uses" if layer.num_uses > 1 else ""
            raise ConfigError(
                f"layer {layer.name!r} ({layer.kind}{uses}): approximation {choice!r} from {source} is not "
                f"allowed; choose one of {', '.join(menu)}"
            )
        out.append(dataclasses.replace(layer, approximation=choice))
    for (pat, _), u in zip(overrides, used):
        if not u:
            raise ConfigError(
                f"config layers[{pat!r}] matches no layer (layers: "
                f"{', '.join(l.name for l in layers[:12])}{', ...' if len(layers) > 12 else ''})"
            )
    return out


def pinned_layers(layers: Iterable[Layer], config: CompileConfig | None = None) -> set[str]:
    """Names of the layers whose approximation the user chose (precedence levels 1-4 above:
    config layers, links, config approximations), before choose_blocks runs; the cost-aware
    choice (passes/budget.py) leaves them alone."""
    config = config or CompileConfig()
    rxs = compile_patterns(list(config.layers), "layers")
    out = set()
    for layer in layers:
        key = menu_key(layer.kind, layer.num_uses)
        if (layer.approximation or key in config.approximations or layer.kind in config.approximations
                or any(layer.name == pat or rx.fullmatch(layer.name) for pat, rx in zip(config.layers, rxs))):
            out.add(layer.name)
    return out


def allowed_approximations(layer: Layer) -> tuple[str, ...]:
    """The menu for a layer (first entry = default)."""
    return APPROXIMATIONS[menu_key(layer.kind, layer.num_uses)]


__all__ = ["allowed_approximations", "choose_blocks", "pinned_layers"]
