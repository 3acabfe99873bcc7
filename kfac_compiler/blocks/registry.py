"""The block registry and the menu derived from it.

`register_block` is the one place a Fisher block class is made known: it is then built for
its layer kinds (`BLOCK_CLASSES[(name, kind)]`, `block_class`, `make_block`) and listed on
their menus (`APPROXIMATIONS`, what config `approximations` / `layers` and the CLI's
`--approx` may choose), so a block defined in any module is selectable once its module is
imported. The class declares where it appears (see FisherBlock in base.py):

    name        the approximation's name (several classes may share one across kinds)
    layer_kinds the layer kinds it is built for
    uses        "single": on the kind's menu only; "multi": on the multi-use menu
                "<kind>_multi" only; "any": on both
    menu_rank   its place within a menu, lowest first; the first entry is the default
                (equal ranks: registration order)

A kind has a multi-use menu only when some block declares uses = "multi" for it; layers
with several uses of other kinds choose from the kind's menu. This module reads those
class attributes only, so it imports no block code (base.py re-exports it).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from kfac_compiler.ir import LAYER_KINDS

USES = ("single", "multi", "any")

BLOCKS: dict[str, type] = {}
# Several classes share an approximation name (e.g. "kron" for fully connected, conv and
# embedding layers): the registry proper is keyed by (name, layer kind). BLOCKS keeps, per
# name, the first class registered under it (so `name in BLOCKS` still tests a known name).
BLOCK_CLASSES: dict[tuple[str, str], type] = {}


def register_block(cls: type) -> type:
    """Class decorator: build `cls` for its layer kinds and list it on their menus."""
    if not cls.name or not cls.layer_kinds:
        raise TypeError(f"block class {cls.__name__}: set `name` and `layer_kinds` before registering it")
    if cls.uses not in USES:
        raise TypeError(f"block class {cls.__name__}: uses={cls.uses!r} is not one of {', '.join(USES)}")
    missing = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "__isabstractmethod__", False))
    if missing:  # else an empty NotImplementedError deep inside the compiler
        raise TypeError(f"block class {cls.__name__}: implement {', '.join(missing)} before registering it "
                        "(docs/extending_blocks.md, 'What a block implements')")
    BLOCKS.setdefault(cls.name, cls)
    for kind in cls.layer_kinds:
        BLOCK_CLASSES[(cls.name, kind)] = cls
    return cls


def unregister_block(cls: type) -> None:
    """Undo register_block(cls) (tests, plug-ins that withdraw a block)."""
    for key in [k for k, c in BLOCK_CLASSES.items() if c is cls]:
        del BLOCK_CLASSES[key]
    if BLOCKS.get(cls.name) is cls:
        del BLOCKS[cls.name]
        same = [c for (n, _), c in BLOCK_CLASSES.items() if n == cls.name]
        if same:
            BLOCKS[cls.name] = same[0]


def block_class(name: str, kind: str) -> type | None:
    """The block class for approximation `name` on a layer of `kind` (None if there is none)."""
    import kfac_compiler.blocks  # noqa: F401  (registers every built-in block module)

    return BLOCK_CLASSES.get((name, kind))


def multi_key(kind: str) -> str:
    """The menu key of a kind's multi-use menu."""
    return f"{kind}_multi"


def derive_menus() -> dict[str, tuple[str, ...]]:
    """{menu key: approximation names, default first} from the registered classes. Keys
    follow ir.LAYER_KINDS (other kinds after, in registration order), each kind's multi-use
    menu right after its own."""
    multi_kinds = {kind for (_, kind), cls in BLOCK_CLASSES.items() if cls.uses == "multi"}
    entries: dict[str, list[tuple[int, int, str]]] = {}
    for order, ((name, kind), cls) in enumerate(BLOCK_CLASSES.items()):
        keys = [kind] if cls.uses != "multi" else []
        if cls.uses != "single" and kind in multi_kinds:
            keys.append(multi_key(kind))
        for key in keys:
            entries.setdefault(key, []).append((cls.menu_rank, order, name))
    kinds = list(dict.fromkeys(kind for _, kind in BLOCK_CLASSES))
    kinds.sort(key=lambda k: LAYER_KINDS.index(k) if k in LAYER_KINDS else len(LAYER_KINDS))
    menus = {}
    for kind in kinds:
        for key in (kind, multi_key(kind)):
            if key in entries:
                menus[key] = tuple(name for _, _, name in sorted(entries[key]))
    return menus


class Menu(Mapping[str, tuple[str, ...]]):
    """A live, read-only view {menu key: names, default first} of `derive_menus()`, so that
    a block registered after import (an extension module) shows up everywhere the menu is
    read."""

    def __getitem__(self, key: str) -> tuple[str, ...]:
        return derive_menus()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(derive_menus())

    def __len__(self) -> int:
        return len(derive_menus())

    def __repr__(self) -> str:
        return repr(derive_menus())


APPROXIMATIONS: Mapping[str, tuple[str, ...]] = Menu()


def menu_key(kind: str, num_uses: int) -> str:
    """Key into APPROXIMATIONS for a layer kind and its number of uses."""
    multi = multi_key(kind)
    return multi if num_uses > 1 and multi in APPROXIMATIONS else kind


__all__ = [
    "APPROXIMATIONS",
    "BLOCKS",
    "BLOCK_CLASSES",
    "Menu",
    "USES",
    "block_class",
    "derive_menus",
    "menu_key",
    "register_block",
    "unregister_block",
]
