"""Command line: `kfac-compiler compile|inspect|train`.

    kfac-compiler compile MODEL --loss KIND [--output NAME] [--ignore-index I] [--config FILE]
                  [--head OUTPUT,LOSS[,COEFF[,TARGETS]] ...] (several loss heads instead of --loss/--output)
                  [--approx KIND=APPROX ...] [--include P ...] [--exclude P ...] [--train P ...]
                  [--untie P|all ...] [--frontend-only] -o PLAN_DIR [--force]
    kfac-compiler inspect PLAN_DIR [--format table|json|dot] [--wide] [--ranks P] [--param-group 'KEY=VALUE ...' ...]

Every KfacError is printed as `error: <message>` on stderr with exit code 2 (also for bad
command lines; options are never abbreviated); warnings are printed as `warning: <message>`.
An OSError no boundary converted is printed as one line naming its file (exit code 2); any
other exception is a bug and keeps its traceback. A Ctrl-C, SIGTERM or SIGHUP outside a
training loop's steps (those stop at a step boundary, train_cli) unwinds the command (its
locks and temp files removed), prints `interrupted` (`stopped by SIGTERM`), exit code 130
(143, 129: kfac_compiler.interrupt). A closed stdout (`>&-`) discards the output; a reader
that leaves (`| head`) ends the command quietly with exit code 141 (128 + SIGPIPE).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

# Only what the error handling needs is imported here: the rest (numpy, onnx, ...) loads
# inside main(), where a Ctrl-C during the imports is handled like any other.
from kfac_compiler.errors import ConfigError, KfacError, os_reason


class _UsageError(KfacError):
    pass


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (`--learning-rat` is an error, not --learning-rate: a prefix
    that is unique today silently changes meaning when an option is added); errors raise."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse would print usage and sys.exit(2)
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    from kfac_compiler.cli_options import add_heads_arg, add_loss_option_args, add_param_group_arg, add_selection_args
    from kfac_compiler.losses import losses_help

    p = _Parser(prog="kfac-compiler", description="Compile ONNX models into K-FAC curvature plans.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{compile,inspect,train}")
    sub.required = True

    c = sub.add_parser("compile", help="compile an ONNX model into a plan directory")
    c.add_argument("model", metavar="MODEL", help="the .onnx file")
    c.add_argument("--loss", metavar="KIND", help=f"{losses_help()} (optional when the graph ends in a loss op; "
                   "options go in the config's loss_options table)")
    c.add_argument("--output", help="the tensor the loss applies to (default: the only graph output)")
    add_loss_option_args(c)
    c.add_argument("--config", help="a TOML or JSON config file")
    c.add_argument("--approx", action="append", default=[], metavar="KEY=APPROX",
                   help="approximation for a layer kind (e.g. conv=diagonal) or a layer name/regex; repeatable")
    add_selection_args(c)
    add_heads_arg(c)
    c.add_argument("-o", "--out", required=True, metavar="PLAN_DIR",
                   help="the plan directory to write (re-saving a plan replaces only the plan's files in it)")
    c.add_argument("--force", action="store_true",
                   help="write into PLAN_DIR although it is a non-empty folder that is not a plan")
    c.add_argument("--frontend-only", action="store_true",
                   help="stop after the front end: layers, blocks and factor sizes, no training subgraphs")
    c.add_argument("-q", "--quiet", action="store_true", help="do not print the layer table")

    i = sub.add_parser("inspect", help="show a plan's layers, blocks and factor sizes")
    i.add_argument("plan", metavar="PLAN_DIR")
    i.add_argument("--format", default="table", choices=("table", "json", "dot"))
    i.add_argument("--wide", action="store_true",
                   help="the table's every column (per-layer FLOPs, inverse methods) and whole layer names "
                        "(default: 100 columns)")
    i.add_argument("--ranks", type=int, default=None, metavar="P",
                   help="also show how P data-parallel ranks share the inverse work (docs/distributed.md)")
    add_param_group_arg(i, "the table shows each layer's optimizer in such a run")

    _add_train_parser(sub)
    return p


# ---------------------------------------------------------------------- train
def _add_train_parser(subparsers) -> None:
    from kfac_compiler.train_cli import add_train_parser

    add_train_parser(subparsers)


def _run_train(args) -> int:
    from kfac_compiler.train_cli import run_train

    return run_train(args)


# ------------------------------------------------------------------- commands
def _run_compile(args) -> int:
    """Check and lock the plan folder first: a bad -o fails before the compile, not after."""
    from kfac_compiler.locks import locked
    from kfac_compiler.outputs import Output, check_outputs
    from kfac_compiler.plan import check_plan_target

    check_outputs([Output("-o", args.out, folder=True)], [("MODEL", args.model), ("--config", args.config)])
    check_plan_target(args.out, overwrite=args.force)
    with locked([("-o", args.out)]):
        return _compile(args)


def _compile(args) -> int:
    from kfac_compiler.cli_options import apply_heads_arg, apply_loss_option_args, apply_selection_args
    from kfac_compiler.config import load_config
    from kfac_compiler.frontend import compile_frontend
    from kfac_compiler.progress import show_on_stderr, stage
    from kfac_compiler.report import render_table

    cfg = load_config(args.config)
    from kfac_compiler.blocks import APPROXIMATIONS

    for item in args.approx:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"--approx {item!r}: expected KEY=APPROX (e.g. conv=diagonal or fc1=kron)")
        if key in APPROXIMATIONS:
            cfg.approximations[key] = value
        else:
            cfg.layers[key] = value
    apply_selection_args(cfg, args)
    apply_heads_arg(cfg, args)
    apply_loss_option_args(cfg, args)
    cfg.validate("command line")
    with show_on_stderr(not args.quiet):
        if args.frontend_only:
            with stage("front end (load, layers, factors)"):
                plan = compile_frontend(args.model, loss=args.loss, output=args.output, config=cfg)
        else:
            import kfac_compiler

            plan = kfac_compiler.compile(args.model, loss=args.loss, output=args.output, config=cfg)
        with stage(f"plan written to {args.out}"):
            path = plan.save(args.out, overwrite=args.force)
    if not args.quiet:
        sys.stdout.write(render_table(plan))
    subgraphs = f" with subgraphs {', '.join(plan.subgraphs)}" if plan.subgraphs else ""
    print(f"plan written to {path}{subgraphs}")
    return 0


def _run_inspect(args) -> int:
    from kfac_compiler.cli_options import param_groups_arg
    from kfac_compiler.plan import load_plan
    from kfac_compiler.report import render

    if args.ranks is not None and args.ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {args.ranks}")
    if args.param_group and args.format == "dot":
        raise ConfigError("--param-group shows in the table and json formats, not in dot")
    groups = param_groups_arg(args) if args.param_group else None
    plan = load_plan(args.plan)
    sys.stdout.write(render(plan, args.format, args.ranks, wide=args.wide, param_groups=groups))
    return 0


def _other_rank() -> bool:
    """Whether an MPI launcher started this process as a rank other than 0: `compile` and
    `inspect` are one process's work (P ranks raced on one plan folder, and printed P plans)."""
    from kfac_compiler.runtime.comm import launched_rank, launched_ranks

    return launched_ranks() > 1 and launched_rank() != 0


SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


def _open_std_streams() -> None:
    """A stream closed by the caller (`>&-`, `2>&-`) is None in Python: its output is
    discarded, as asked, instead of failing the command after its work is done."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 - lives as long as the process


def main(argv: Sequence[str] | None = None) -> int:
    from kfac_compiler.interrupt import deferred_stop, raise_on_stop

    _open_std_streams()
    try:
        with raise_on_stop(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with deferred_stop():
                    import numpy  # noqa: F401 - loaded here, where a Ctrl-C waits for the import
                    import onnx  # noqa: F401

                    args = build_parser().parse_args(argv)
                if args.command == "train":
                    code = _run_train(args)
                elif _other_rank():
                    code = 0  # mpirun -n P compile/inspect: rank 0 alone writes and prints
                elif args.command == "compile":
                    code = _run_compile(args)
                else:
                    code = _run_inspect(args)
            finally:
                seen = set()
                for w in caught:
                    msg = " ".join(str(w.message).split())
                    if msg not in seen:
                        seen.add(msg)
                        print(f"warning: {msg}", file=sys.stderr)
        return code
    except KfacError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `... | head`: the reader left; what it did not read is dropped
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - Python flushes stdout at exit
        return SIGPIPE_EXIT
    except KeyboardInterrupt as e:  # outside a training loop's steps (those stop at a step boundary)
        from kfac_compiler.interrupt import describe, exit_code, signal_of

        print(describe(signal_of(e)), file=sys.stderr)
        return exit_code(signal_of(e))
    except OSError as e:  # last resort: the boundaries convert the OSErrors they expect
        where = f"{e.filename!r}: " if e.filename else ""
        print(f"error: {where}{os_reason(e, writing=None)}", file=sys.stderr)
        return KfacError.exit_code


if __name__ == "__main__":
    sys.exit(main())
