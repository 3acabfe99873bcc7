"""Command-line options shared by `compile`, `inspect` and `train`: which initializers are trained,
and untied; several loss heads; the loss options that have a flag of their own; K-FAC's first-order
parameter groups."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kfac_compiler.config import CompileConfig
    from kfac_compiler.losses import LossOption


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


def apply_selection_args(cfg: CompileConfig, args: argparse.Namespace) -> None:
    """Add the command line's selection options to a CompileConfig (then validate it)."""
    if args.include is not None:
        cfg.include = list(cfg.include or []) + args.include
    for key, extra in (("exclude", args.exclude), ("train", args.train_params), ("untie", args.untie)):
        if extra is not None:
            setattr(cfg, key, list(getattr(cfg, key)) + extra)


def add_heads_arg(p: argparse.ArgumentParser) -> None:
    """--head OUTPUT,LOSS[,COEFFICIENT[,TARGETS]]: one loss head (repeatable; instead of --loss/--output)."""
    p.add_argument("--head", action="append", default=None, metavar="OUTPUT,LOSS[,COEFF[,TARGETS]]", dest="heads",
                   help="a loss head: the output tensor, its loss kind, its coefficient (default 1) and the name of "
                        "its targets array (default: the output's name); repeatable, instead of --loss/--output; "
                        "a head's loss options go in the config's [[heads]] tables")


def apply_heads_arg(cfg: CompileConfig, args: argparse.Namespace) -> None:
    """Replace the config's heads by the command line's --head options (then validate it)."""
    from kfac_compiler.errors import ConfigError

    if not args.heads:
        return
    heads = []
    for item in args.heads:
        parts = [p.strip() for p in item.split(",")]
        if not 2 <= len(parts) <= 4 or not all(parts):
            raise ConfigError(f"--head {item!r}: expected OUTPUT,LOSS[,COEFFICIENT[,TARGETS]] "
                              "(e.g. logits,softmax_cross_entropy,1.0,labels)")
        head: dict = {"output": parts[0], "loss": parts[1]}
        if len(parts) > 2:
            try:
                head["coefficient"] = float(parts[2])
            except ValueError:
                raise ConfigError(f"--head {item!r}: coefficient {parts[2]!r} is not a number") from None
        if len(parts) > 3:
            head["targets"] = parts[3]
        heads.append(head)
    cfg.heads = heads


def loss_option_flags() -> dict[str, tuple[LossOption, str]]:
    """{option name: (the option, its loss kind)} of the registered losses' options that have
    a flag (LossOption.parse), first declaration first: the flag sets the option of whichever
    loss the model is compiled with, which checks it (a loss without it refuses it)."""
    from kfac_compiler.losses import LOSSES

    flags: dict[str, tuple[LossOption, str]] = {}
    for cls in LOSSES.values():
        for opt in cls.options:
            if opt.parse is not None and opt.name not in flags:
                flags[opt.name] = (opt, cls.kind)
    return flags


def add_loss_option_args(p: argparse.ArgumentParser) -> None:
    """--<option> for every loss option with a flag (softmax cross-entropy's --ignore-index)."""
    for name, (opt, kind) in loss_option_flags().items():
        p.add_argument(opt.flag, type=opt.parse, default=None, dest=f"loss_option_{name}", metavar="VALUE",
                       help=f"{kind}: {opt.help} (the config's loss_options.{name})")


def given_loss_options(args: argparse.Namespace) -> dict[str, object]:
    """{option name: value} of the loss-option flags given on the command line."""
    values = {name: getattr(args, f"loss_option_{name}", None) for name in loss_option_flags()}
    return {name: v for name, v in values.items() if v is not None}


def apply_loss_option_args(cfg: CompileConfig, args: argparse.Namespace) -> None:
    """The loss-option flags into the config's loss_options (a flag wins over the config);
    the loss checks them when the plan is compiled."""
    given = given_loss_options(args)
    if given:
        cfg.loss_options = {**cfg.loss_options, **given}


def add_param_group_arg(p, rest: str) -> None:
    """--param-group: a first-order parameter group of a K-FAC run (optimizers/groups.py)."""
    p.add_argument("--param-group", action="append", default=None, metavar="'KEY=VALUE ...'",
                   help="K-FAC: train the layers a group selects with a first-order rule, e.g. 'kind=embedding,"
                        "scale_and_shift optimizer=adam lr=1e-3' or 'params=pos_emb|fc1\\..* optimizer=sgd "
                        "learning_rate=0.05 momentum=0.9' (selectors: params (a name or regex), layers, kind (the "
                        "kinds inspect shows); optional name=NAME; the optimizer's options; repeatable: one group "
                        f"each); {rest}")


def param_groups_arg(args) -> list[dict]:
    """The --param-group groups, parsed (optimizers/groups.parse_text)."""
    from kfac_compiler.optimizers.groups import parse_text

    return [parse_text(text, "--param-group") for text in args.param_group]
