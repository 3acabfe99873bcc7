"""Command-line options shared by `compile` and `train`: which initializers are trained, and untied."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kfac_compiler.config import CompileConfig


def add_selection_args(p: argparse.ArgumentParser) -> None:
    """--include/--exclude/--train/--untie: which initializers are trained, and untied."""
    p.add_argument("--include", action="append", default=None, metavar="PARAM",
                   help="train only these parameters (name or regex; repeatable)")
    p.add_argument("--exclude", action="append", default=None, metavar="PARAM",
                   help="freeze these parameters (name or regex; repeatable)")
    p.add_argument("--train", action="append", default=None, metavar="PARAM", dest="train_params",
                   help="train these although the constants rule freezes them (name or regex; repeatable)")
    p.add_argument("--untie", action="append", default=None, metavar="PARAM",
                   help="give each node using this shared parameter its own copy (name, regex, 'uniform' for every "
                        "shared parameter whose values are all equal, or 'all'; repeatable)")


def apply_selection_args(cfg: "CompileConfig", args: argparse.Namespace) -> None:
    """Add the command line's selection options to a CompileConfig (then validate it)."""
    if args.include is not None:
        cfg.include = list(cfg.include or []) + args.include
    for key, extra in (("exclude", args.exclude), ("train", args.train_params), ("untie", args.untie)):
        if extra is not None:
            setattr(cfg, key, list(getattr(cfg, key)) + extra)
