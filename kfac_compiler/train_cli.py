"""`kfac-compiler train`: train a model (zoo name, .onnx file or plan directory) on a dataset.

    kfac-compiler train                                   # the zoo's mlp_classifier on digits
    kfac-compiler train digits_autoencoder --steps 500 --metrics run.csv --plot loss.png
    kfac-compiler train model.onnx --loss softmax_cross_entropy --data train.npz --save out.onnx
    kfac-compiler train lm.onnx --loss softmax_cross_entropy --ignore-index -100 --data tokens.npz
    kfac-compiler train --checkpoint run.ckpt ...; kfac-compiler train --resume run.ckpt ...

The lead wires this module into kfac_compiler/cli.py with `add_train_parser(subparsers)` and
`run_train(args) -> int`; KfacErrors propagate (the CLI prints `error: ...`, exit code 2).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from kfac_compiler.cli_options import (
    add_loss_option_args,
    add_param_group_arg,
    add_selection_args,
    apply_loss_option_args,
    apply_selection_args,
    given_loss_options,
    loss_option_flags,
    param_groups_arg,
)
from kfac_compiler.errors import ConfigError, DataError, DivergedError, ModelError, OutputError, os_errors, os_reason
from kfac_compiler.losses import loss_kinds, losses_help
from kfac_compiler.onnx_files import stored_bytes
from kfac_compiler.optimizers import OPTIMIZERS

if TYPE_CHECKING:
    from kfac_compiler.config import CompileConfig
    from kfac_compiler.models import ZooEntry
    from kfac_compiler.outputs import Output
    from kfac_compiler.plan import Plan
    from kfac_compiler.runtime.best_model import BestModel

DEFAULT_MODEL = "mlp_classifier"
SETUP_NOTICE_NODES = 10_000  # a plan this large spends seconds in ONNX Runtime's session setup: say so
CSV_COLUMNS = ("step", "loss", "learning_rate", "momentum", "damping", "update_norm", "grad_norm",
               "qmodel_change", "update_scale", "rho", "rejected", "burn_in", "step_time")


def _finite(text: str) -> float:
    """argparse type of the float flags: a finite number (float() would take 'nan' and 'inf')."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _fraction(text: str) -> float:
    """argparse type of --val-split: a number strictly between 0 and 1."""
    value = _finite(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1 (exclusive), got {text!r}")
    return value


def _schedule(text: str):
    """argparse type of --learning-rate, --momentum, --damping: a finite number or a schedule's
    text (kfac_compiler/optimizers/schedules.py; a bad one is a one-line usage error)."""
    from kfac_compiler.optimizers import schedules

    try:
        return schedules.parse(text, "")  # argparse names the flag
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SCHEDULE_HELP = ("; or a schedule over the steps: 0.1@0,0.01@1000 (piecewise constant), exp:V0,RATE,STEPS, "
                 "linear:V0,V1,STEPS, cosine:V0,V1,STEPS, each optionally after warmup:STEPS:")


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    t = subparsers.add_parser(
        "train", help="train a model with K-FAC (or Adam/SGD) on ONNX Runtime", allow_abbrev=False,
        description="Train a zoo model, an .onnx file (compiled on the fly) or a plan directory.",
    )
    t.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=f"zoo model name, .onnx file or plan directory (default: {DEFAULT_MODEL})")
    t.add_argument("--data", default="digits", metavar="digits|FILE.npz",
                   help="scikit-learn digits (default) or an .npz with arrays named after the model inputs plus 'targets' "
                        "(one array per loss head, named by its --head TARGETS, with several heads) and optionally "
                        "'weights': loss weights or a 0/1 mask, per example or shaped like the targets")
    t.add_argument("--loss", choices=loss_kinds(), metavar="KIND",
                   help=f"for an .onnx model (zoo models know theirs): {losses_help()}")
    t.add_argument("--output", metavar="NAME", help="the model output the loss applies to")
    add_loss_option_args(t)
    t.add_argument("--config", metavar="FILE", help="compile options (TOML or JSON) for an .onnx or zoo model")
    add_selection_args(t)
    t.add_argument("--val-data", metavar="FILE.npz",
                   help="held-out data (arrays as --data's), evaluated every --eval-every steps and at the end: "
                        "metrics eval_loss and eval_<metric> (e.g. eval_accuracy), a second curve in --plot")
    t.add_argument("--val-split", type=_fraction, default=None, metavar="F",
                   help="hold out this fraction of --data (a seeded split) as the held-out data instead of --val-data")
    t.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="steps between held-out evaluations (default: --steps / 20)")
    t.add_argument("--keep-best", action="store_true",
                   help="--save the model of the held-out evaluation with the lowest loss, not the last step's "
                        "(early stopping's best weights); the checkpoint holds the last step's state, for --resume, and the kept "
                        "model")
    t.add_argument("--patience", type=int, default=None, metavar="N",
                   help="early stopping: end the run after N held-out evaluations in a row that did not lower the "
                        "lowest held-out loss (with --keep-best, --save then writes that evaluation's model)")
    t.add_argument("--optimizer", default=None, choices=tuple(OPTIMIZERS), help="default kfac")
    t.add_argument("--steps", type=int, default=200, help="total optimizer steps (default 200)")
    t.add_argument("--batch-size", type=int, default=None,
                   help="examples per step (default 128; on --resume the checkpoint's)")
    t.add_argument("--accumulate", type=int, default=None, metavar="K",
                   help="gradient accumulation: run each step's batch as K micro-batches of --batch-size / K "
                        "examples, one after another, and update once (the update of the whole batch; K-FAC's "
                        "quadratic model runs on the last micro-batch); --batch-size must be divisible by K "
                        "(default 1; on --resume the checkpoint's)")
    t.add_argument("--seed", type=int, default=None,
                   help="batch order, estimator noise and zoo init (default 0; on --resume the checkpoint's)")
    t.add_argument("--learning-rate", type=_schedule, default=None, metavar="LR",
                   help="fixed learning rate (K-FAC default: adaptive via the quadratic model)" + SCHEDULE_HELP)
    t.add_argument("--momentum", type=_schedule, default=None, metavar="MU",
                   help="momentum (Adam: beta1; K-FAC: --knob momentum_type=regular|adam|qmodel_fixedmu)"
                        + SCHEDULE_HELP)
    t.add_argument("--damping", type=_schedule, default=None, metavar="LAMBDA",
                   help="K-FAC initial damping; a schedule needs adapt_damping=off" + SCHEDULE_HELP)
    t.add_argument("--l2", type=_finite, default=None, help="weight decay coefficient")
    t.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="any optimizer option, e.g. inv_update_period=10, adapt_damping=off, clip_norm=1.0 (torch's "
                        "clip_grad_norm_) or decoupled_weight_decay=0.01 (AdamW's weight decay; every optimizer) "
                        "(repeatable; booleans: true/false, 1/0, yes/no, on/off)")
    add_param_group_arg(t, "K-FAC trains the other layers")
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    t.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    t.add_argument("--cuda-graphs", action="store_true",
                   help="capture the step graphs as CUDA graphs and replay them (with --device cuda; faster Adam and "
                        "SGD steps, K-FAC's statistics steps may be refused: docs/runtime.md, CUDA graphs)")
    t.add_argument("--metrics", metavar="FILE.csv|FILE.jsonl", help="write per-step metrics")
    t.add_argument("--plot", metavar="FILE.png", help="plot the training loss (needs matplotlib)")
    t.add_argument("--save", metavar="FILE.onnx", help="write the model with the trained weights")
    t.add_argument("--save-graph", default="auto", choices=("auto", "source", "plan"),
                   help="--save writes the source model's own graph (its nodes, names and fused ops) with the trained "
                        "values, or the plan's canonical graph; auto (default): the source's where it holds every "
                        "trained value (not after --untie, not for the built-in models), else the plan's")
    t.add_argument("--checkpoint", metavar="PATH", help="write a checkpoint at the end (and every --checkpoint-every steps)")
    t.add_argument("--checkpoint-every", type=int, default=0, metavar="N")
    t.add_argument("--resume", metavar="PATH", help="continue from a checkpoint (same model, data and seed)")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return t


# --------------------------------------------------------------------------- helpers
# options with a flag of their own: as a --knob they would be a second, conflicting spelling
# (seed and threads are not even optimizer options), so the flag is the one place to set them
FLAG_KNOBS = {"seed": "--seed", "threads": "--threads", "batch_size": "--batch-size", "device": "--device",
              "optimizer": "--optimizer", "learning_rate": "--learning-rate", "momentum": "--momentum",
              "damping": "--damping", "l2_reg": "--l2", "param_groups": "--param-group",
              "accumulate": "--accumulate"}


def _knobs(args) -> dict[str, Any]:
    """The optimizer options of the command line, each --knob parsed by the option's declared
    type (`adapt_damping=no` is False; a typo or a NaN is a one-line ConfigError)."""
    from kfac_compiler.optimizers import optimizer_class
    from kfac_compiler.optimizers.settings import ALIASES

    config = optimizer_class(args.optimizer or "kfac").Config  # on --resume the checkpoint's (resume.settle)
    knobs: dict[str, Any] = {}
    for item in args.knob:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--knob {item!r}: expected KEY=VALUE (e.g. inv_update_period=10)")
        flag = FLAG_KNOBS.get(ALIASES.get(key, key))
        if flag:
            raise ConfigError(f"--knob {key}: use {flag} instead (it has its own flag)")
        if key in knobs:
            raise ConfigError(f"--knob {key} given twice")
        knobs[key] = config.parse_option(key, value)[1]
    if args.damping is not None:
        knobs["damping"] = args.damping
    if args.l2 is not None:
        knobs["l2_reg"] = args.l2
    if args.param_group:
        try:
            config.option_name("param_groups")
        except ConfigError:
            raise ConfigError(f"--param-group: optimizer {config.name!r} has no parameter groups (K-FAC's option: "
                              "the groups train with a first-order rule, the other layers with K-FAC)") from None
        knobs["param_groups"] = param_groups_arg(args)
    if args.accumulate is not None:  # settle(): given, the checkpoint's or 1
        knobs["accumulate"] = args.accumulate
    return knobs


def compile_config(args) -> CompileConfig | None:
    """The compile options of the command line (--config and the selection options; the cost-aware
    choice's reference batch is --batch-size unless the config sets it), or None for a plan."""
    from kfac_compiler.config import load_config

    given = [args.config, args.include, args.exclude, args.train_params, args.untie]
    if args.model and os.path.isdir(args.model):
        flags = [loss_option_flags()[name][0].flag for name in given_loss_options(args)]
        if any(g is not None for g in given) or flags:
            raise ConfigError(f"{args.model!r} is a compiled plan: --config, --include, --exclude, --train, --untie "
                              f"{'and ' + ', '.join(flags) + ' ' if flags else 'and the loss options '}apply when "
                              "compiling; pass the .onnx file instead")
        return None
    cfg = load_config(args.config)
    if cfg.budget.batch_size is None:
        cfg.budget.batch_size = args.batch_size
    apply_selection_args(cfg, args)
    apply_loss_option_args(cfg, args)
    cfg.validate("command line")
    return cfg


def load_model_and_plan(model: str | None, loss: str | None, output: str | None, seed: int,
                        config: CompileConfig | None = None):
    """(plan, zoo entry or None); `config` compiles an .onnx or zoo model (a plan directory has its own)."""
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO

    name = model or DEFAULT_MODEL
    if name in ZOO and not os.path.exists(name):
        entry = ZOO[name]
        plan = kc.compile(entry.build(seed=seed), loss=loss or entry.loss, output=output or entry.output_name,
                          config=config, emit=False)
        return plan, entry
    if os.path.isdir(name):
        from kfac_compiler.plan import load_plan

        return load_plan(name), None
    if os.path.isfile(name):
        return kc.compile(name, loss=loss, output=output, config=config, emit=False), None
    if name.lower().endswith(".onnx") or os.sep in name:
        raise ModelError(f"model file {name!r} does not exist")
    raise ModelError(
        f"{name!r} is neither a zoo model ({', '.join(ZOO)}), an .onnx file nor a plan directory"
    )


WEIGHTS_ARRAY = "weights"  # the data file's loss weights or mask (docs/runtime.md, "Weights and masks")


def load_data(plan: Plan, entry: ZooEntry | None, data: str, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(inputs, targets) checked; a data file's array "weights" (loss weights or a 0/1 mask,
    per example or shaped like the targets' leading axes) rides along in the inputs under
    the reserved name "example_weights", so that splitting and batching carry it by rows
    (take it out with `split_weights`)."""
    from kfac_compiler import contract as C
    from kfac_compiler.runtime.data import (
        check_weights,
        digits_for,
        index_bounds,
        input_spec,
        load_npz,
        output_spec,
        target_arrays_phrase,
        validate_dataset,
    )

    specs = {vi.name: input_spec(vi) for vi in plan.data_inputs}
    loss = plan.loss.build()
    out = output_spec(plan.model, plan.output)
    bounds = index_bounds(plan.model)
    if data == "digits":
        if entry is not None:
            inputs, targets = entry.make_data(None, seed=0)
        else:
            inputs, targets = digits_for(specs, loss, out)
        source = "digits"
    elif data.endswith(".npz") or os.path.isfile(data):
        inputs, targets = load_npz(data, loss.target_arrays())
        source = data
        weights = inputs.pop(WEIGHTS_ARRAY) if WEIGHTS_ARRAY in inputs and WEIGHTS_ARRAY not in specs else None
        checked, y = validate_dataset(specs, loss, inputs, targets, out, source=source, index_bounds=bounds)
        extra = [k for k in inputs if k not in specs]
        if extra:
            raise DataError(f"{data}: array {extra[0]!r} is not a model input (inputs: {list(specs)}, "
                            f"plus {target_arrays_phrase(loss)} and the optional {WEIGHTS_ARRAY!r})")
        if weights is not None:
            shape = loss.weight_shape(tuple(loss.mask_targets(y)[0].shape))
            checked[C.EXAMPLE_WEIGHTS] = check_weights(weights, shape, f"{data}: array {WEIGHTS_ARRAY!r}")
        return checked, y
    else:
        raise DataError(f"--data {data!r}: expected 'digits' or an existing .npz file")
    return validate_dataset(specs, loss, inputs, targets, out, source=source, index_bounds=bounds)


def split_weights(inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(the model inputs, the loss weights or None) of load_data's inputs."""
    from kfac_compiler import contract as C

    rest = dict(inputs)
    return rest, rest.pop(C.EXAMPLE_WEIGHTS, None)


def metric_columns(plan: Plan, held_out: bool) -> tuple[str, ...]:
    """The metrics CSV's columns: CSV_COLUMNS, and with held-out data eval_loss and the
    loss's own metrics as eval_<name> (blank on the steps without an evaluation)."""
    if not held_out:
        return CSV_COLUMNS
    return (*CSV_COLUMNS, "eval_loss", *(f"eval_{name}" for name in plan.loss.build().metrics))


def validation_split(inputs: dict[str, np.ndarray], targets: Any, fraction: float, seed: int):
    """(training inputs, training targets, (held-out inputs, held-out targets)): a seeded
    permutation's last ceil(fraction n) rows are held out; at least one row each side."""
    n = targets.shape[0]
    k = math.ceil(fraction * n)
    if not 0 < k < n:
        raise DataError(f"--val-split {fraction:g} of {n} examples leaves no {'held-out' if k == 0 else 'training'} "
                        "rows; give a fraction that leaves at least one of each")
    perm = np.random.default_rng([int(seed), 0x401D]).permutation(n)
    train, held = np.sort(perm[:-k]), np.sort(perm[-k:])
    return ({name: a[train] for name, a in inputs.items()}, targets[train],
            ({name: a[held] for name, a in inputs.items()}, targets[held]))


class MetricsWriter:
    def __init__(self, path: str | None, append: bool, columns: Sequence[str] = CSV_COLUMNS) -> None:
        self.path = path
        self.f: TextIO | None = None
        self.csv = None
        if not path:
            return
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".csv", ".jsonl", ".json", ".ndjson"):
            raise ConfigError(f"--metrics {path!r}: use a .csv or .jsonl file")
        mode = "a" if append and os.path.isfile(path) and os.path.getsize(path) > 0 else "w"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.f = open(path, mode, newline="", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--metrics {path!r}: cannot write it ({os_reason(e, writing=True)})") from None
        if ext == ".csv":
            self.csv = csv.DictWriter(self.f, fieldnames=list(columns), extrasaction="ignore")
            if mode == "w":
                self.csv.writeheader()

    def write(self, m: dict[str, Any]) -> None:
        if self.f is None:
            return
        # an OSError (a full disk) reaches the training loop, which stops there and still
        # writes the other outputs (_train)
        if self.csv is not None:
            row = {k: _fmt(m.get(k)) for k in self.csv.fieldnames}
            self.csv.writerow(row)
        else:
            self.f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                     for k, v in m.items()}) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            f, self.f = self.f, None
            f.close()


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return "" if math.isnan(v) else str(v)
        if v == int(v) and abs(v) < 1e15:
            return str(int(v))
        return repr(v)
    return str(v)


class Progress:
    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.stream = stream
        self.last = 0.0
        self.t0 = time.perf_counter()

    def update(self, done: int, loss: float, force: bool = False, held_out: float | None = None) -> None:
        """`held_out`: the last held-out loss, shown until the next one."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        fill = int(width * done / self.total)
        rate = done / max(now - self.t0, 1e-9)
        val = "" if held_out is None else f" val {held_out:.4f}"
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} loss {loss:.4f}{val} "
                          f"{rate:.0f} it/s ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _check_plot(path: str | None) -> None:
    if not path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"--plot {path!r} needs matplotlib (pip install matplotlib, or kfac_compiler[plot])") from None


def _plot(path: str, steps: list[float], losses: list[float], title: str,
          evaluated: Sequence[tuple[int, float]] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, lw=1, label="training (batch)")
    if evaluated:
        ax.plot([s for s, _ in evaluated], [v for _, v in evaluated], "o-", lw=1.5, ms=3, label="held-out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    from kfac_compiler.atomic import write_file

    try:
        with os_errors(OutputError, "the plot", path, writing=True):
            write_file(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- command
def run_train(args) -> int:
    """Check every output, lock them, train; Ctrl-C stops at a step boundary (exit 130).
    Under mpirun every rank runs this, rank 0 alone prints and writes (kfac_compiler.ranks)."""
    from kfac_compiler.ranks import on_ranks, world

    comm = world()
    return on_ranks(comm, lambda: _run(args, comm))


def _run(args, comm) -> int:
    from contextlib import ExitStack

    from kfac_compiler.runtime.comm import agreed

    with ExitStack() as held:  # rank 0's output locks, held to the end of the run
        outputs = agreed(comm, lambda: _check(args, comm, held))
        return _train(args, outputs, comm)


def _check(args, comm, held) -> list[Output]:
    """Everything before compiling: the options, the checkpoint's meta and (rank 0) the
    outputs, checked and locked. No collective: a rank that fails here is agreed on."""
    from kfac_compiler.locks import locked
    from kfac_compiler.outputs import check_outputs, model_inputs
    from kfac_compiler.ranks import is_root
    from kfac_compiler.resume import settle

    if args.steps < 0:
        raise ConfigError(f"--steps must be >= 0, got {args.steps}")
    if args.checkpoint_every < 0:
        raise ConfigError("--checkpoint-every must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if args.val_data and args.val_split:
        raise ConfigError("--val-data and --val-split both name held-out data; give one")
    if args.eval_every is not None and args.eval_every < 1:
        raise ConfigError(f"--eval-every must be >= 1, got {args.eval_every}")
    if args.eval_every is not None and not (args.val_data or args.val_split):
        raise ConfigError("--eval-every needs held-out data: --val-data FILE.npz or --val-split FRACTION")
    if args.keep_best and not (args.val_data or args.val_split):
        raise ConfigError("--keep-best needs held-out data: --val-data FILE.npz or --val-split FRACTION")
    if args.patience is not None and args.patience < 1:
        raise ConfigError(f"--patience must be >= 1, got {args.patience}")
    if args.patience is not None and not (args.val_data or args.val_split):
        raise ConfigError("--patience needs held-out data: --val-data FILE.npz or --val-split FRACTION")
    meta = None
    if args.resume:
        from kfac_compiler.runtime.checkpoint import read_meta

        meta = read_meta(args.resume)
    settle(args, meta)  # --seed, --batch-size, --accumulate, --optimizer: given, the checkpoint's or the defaults
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.accumulate < 1:
        raise ConfigError(f"--accumulate must be >= 1, got {args.accumulate}")
    if args.batch_size % args.accumulate:
        raise ConfigError(f"--batch-size {args.batch_size} does not split into --accumulate {args.accumulate} equal "
                          f"micro-batches; use a batch size divisible by {args.accumulate}")
    if comm is not None:
        _check_ranks(args, meta, comm.size)
    outputs = _outputs(args)
    if is_root(comm):
        _check_plot(args.plot)
        model = args.model if args.model and os.path.exists(args.model) else None
        data = args.data if args.data != "digits" else None
        check_outputs(outputs, [*model_inputs(model, outputs), ("--data", data), ("--val-data", args.val_data),
                                ("--config", args.config), ("--resume", args.resume)],
                      may_equal=[("--checkpoint", "--resume")])
        held.enter_context(locked([(o.option, o.path) for o in outputs]))
    return outputs


def _check_ranks(args, meta: dict[str, Any] | None, ranks: int) -> None:
    """The global batch splits evenly over the ranks; a checkpoint of another number of ranks
    resumes with a note (its factors are the ranks' mean: the same run up to rounding)."""
    if args.batch_size % (ranks * args.accumulate):
        raise ConfigError(f"--batch-size {args.batch_size} does not split evenly over {ranks} ranks"
                          + (f" in each of --accumulate {args.accumulate} micro-batches" if args.accumulate > 1 else "")
                          + f"; use a multiple of {ranks * args.accumulate}")
    theirs = int((meta or {}).get("ranks", 1))
    if meta is not None and theirs != ranks:
        import warnings

        warnings.warn(f"checkpoint {args.resume!r} was written by {theirs} rank{'s' * (theirs != 1)}, resuming on "
                      f"{ranks}: the same run up to float rounding (the batches, noise and factors do not depend "
                      "on the number of ranks)", stacklevel=2)


def _outputs(args) -> list[Output]:
    from kfac_compiler.outputs import Output

    return [Output(opt, path) for opt, path in (("--save", args.save), ("--checkpoint", args.checkpoint),
                                                ("--metrics", args.metrics), ("--plot", args.plot)) if path]


def _build(args, outputs: list[Output], comm):
    """(plan, zoo entry, inputs, targets, trainer): every rank builds the same; rank 0 checks
    its outputs' disks and continues a resumed metrics file."""
    from kfac_compiler.outputs import check_space
    from kfac_compiler.ranks import check_same_on_ranks, is_root
    from kfac_compiler.resume import check_resumed_data, continue_metrics
    from kfac_compiler.runtime.comm import agreed
    from kfac_compiler.runtime.data import dataset_fingerprint
    from kfac_compiler.runtime.trainer import Trainer

    def load():
        knobs = _knobs(args)  # before compiling: a bad --knob fails fast
        plan, entry = load_model_and_plan(args.model, args.loss, args.output, args.seed, compile_config(args))
        inputs, targets = load_data(plan, entry, args.data, args.seed)
        held = None
        if args.val_split:
            inputs, targets, held = validation_split(inputs, targets, args.val_split, args.seed)
        elif args.val_data:
            held = load_data(plan, entry, args.val_data, args.seed)
        fingerprint = dataset_fingerprint(inputs, targets)  # of the training rows: another split is other data
        check_resumed_data(args, fingerprint)  # before any session is built
        rows = min(args.batch_size, targets.shape[0])
        if rows % args.accumulate:
            raise DataError(f"the data's {targets.shape[0]} examples make a batch of {rows} rows, which does not split "
                            f"into --accumulate {args.accumulate} equal micro-batches; use fewer micro-batches or more "
                            "data")
        if comm is not None and rows // args.accumulate % comm.size:
            raise DataError(f"the data's {targets.shape[0]} examples make a batch of {targets.shape[0]} rows, which "
                            f"does not split evenly over {comm.size} ranks; use a --batch-size divisible by {comm.size}")
        return knobs, plan, entry, inputs, targets, fingerprint, held

    knobs, plan, entry, inputs, targets, fingerprint, held = agreed(comm, load)
    if comm is not None:
        from kfac_compiler.runtime.checkpoint import plan_fingerprint

        options = {f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items()) if k != "command"}
        check_same_on_ranks(comm, {**options, "plan fingerprint": plan_fingerprint(plan)["fingerprint"],
                                   "data fingerprint": fingerprint})
    n = targets.shape[0]
    if args.batch_size > n:
        import warnings

        warnings.warn(f"--batch-size {args.batch_size} is larger than the {n} training examples; every batch is "
                      f"all {n}", stacklevel=2)

    nodes = sum(len(g.graph.node) for g in plan.subgraphs.values())
    slow_setup = nodes >= SETUP_NOTICE_NODES and not args.quiet and is_root(comm)
    if slow_setup:  # ONNX Runtime's setup grows faster than the graphs (2x nodes: ~3-4x time)
        print(f"setting up ONNX Runtime sessions for {nodes:,} nodes of {len(plan.subgraphs)} subgraphs ...",
              file=sys.stderr, flush=True)
    began = time.perf_counter()

    def start() -> Trainer:  # Trainer() enters a collective only after its option checks
        if args.resume:
            overrides = dict(knobs)
            overrides.update({k: v for k, v in (("learning_rate", args.learning_rate), ("momentum", args.momentum),
                                                ("threads", args.threads)) if v is not None})
            trainer = Trainer.load_checkpoint(args.resume, plan, device=args.device,
                                              batch_size=min(args.batch_size, n) // args.accumulate, comm=comm,
                                              cuda_graphs=args.cuda_graphs, **overrides)
        else:
            trainer = Trainer(plan, optimizer=args.optimizer or "kfac", device=args.device,
                              learning_rate=args.learning_rate, momentum=args.momentum, seed=args.seed,
                              threads=args.threads, batch_size=min(args.batch_size, n) // args.accumulate, comm=comm,
                              cuda_graphs=args.cuda_graphs, **knobs)
        trainer.data_fingerprint = fingerprint
        if slow_setup:
            print(f"sessions ready in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        if is_root(comm):
            # room for what is written whole at the end (the metrics file grows row by row: a full
            # disk there stops the run at that step, the other outputs still written)
            sizes = {"--checkpoint": trainer.store.nbytes(buffers=False) + (1 << 16),
                     "--save": stored_bytes(plan.model) + (1 << 16), "--plot": 1 << 18}
            check_space([(o, sizes[o.option]) for o in outputs if o.option in sizes])
            why = trainer.source_problem() if args.save and args.save_graph == "source" else None
            if why is not None:  # known now: refused before the run, not after it (no model saved)
                raise ConfigError(f"--save-graph source: cannot export the source graph: {why}; "
                                  "use --save-graph plan (or auto)")
            if args.resume:
                continue_metrics(args.metrics, trainer.step_count + trainer.burn_in_count,
                                 metric_columns(plan, held is not None))
        return trainer

    return plan, entry, inputs, targets, held, agreed(comm, start)


def _train(args, outputs: list[Output], comm) -> int:
    import signal

    from kfac_compiler.errors import KfacError
    from kfac_compiler.interrupt import STOP_SIGNALS, StopOnInterrupt
    from kfac_compiler.progress import show_on_stderr
    from kfac_compiler.ranks import is_root, stop_together
    from kfac_compiler.runtime.best_model import BestModel
    from kfac_compiler.runtime.data import batch_indices
    from kfac_compiler.runtime.fit import EarlyStop

    root = is_root(comm)
    with show_on_stderr(not args.quiet and root):  # stages of seconds: the compile, emissions, sessions
        plan, entry, inputs, targets, held, trainer = _build(args, outputs, comm)
    n = targets.shape[0]
    every = args.eval_every or max(1, args.steps // 20)
    evaluated: list[tuple[int, float]] = []  # (step, held-out loss) for the plot
    held_final = None
    # rank 0 evaluates and offers; a resumed run's checkpoint brings the earlier run's best model
    best = trainer.best_model = (trainer.best_model or BestModel()) if args.keep_best else None
    stopper = None if args.patience is None else EarlyStop(args.patience, best.loss if best is not None else math.inf)
    early = None  # the step after which --patience ended the run
    done = trainer.step_count + trainer.burn_in_count
    name = args.model or DEFAULT_MODEL
    quiet = args.quiet or not sys.stderr.isatty() or not root
    if not args.quiet and root:
        batch = min(args.batch_size, n)
        split = f"{comm.size} ranks, batch {batch} ({batch // comm.size} per rank)" if comm else f"batch {batch}"
        if trainer.config.accumulate > 1:
            split += f" in {trainer.config.accumulate} micro-batches of {batch // trainer.config.accumulate}"
        held_out = "" if held is None else f" ({held[1].shape[0]} held out, evaluated every {every} steps)"
        print(f"training {os.path.basename(str(name))} with {trainer.optimizer} on {trainer.device.name}: "
              f"{n} examples{held_out}, {split}, steps {done}..{args.steps}", file=sys.stderr)
        for line in trainer.policy.summary_lines():
            print(f"  {line}", file=sys.stderr)
    writer = MetricsWriter(args.metrics if root else None, append=bool(args.resume),
                           columns=metric_columns(plan, held is not None))
    progress = Progress(args.steps, enabled=not quiet)
    steps_seen, losses = [], []
    t0 = time.perf_counter()
    rejected = 0
    stopped = None  # (option, failure) that ended the loop early: a metrics row or periodic checkpoint not written
    interrupted = False
    signals = STOP_SIGNALS if comm is None else (*STOP_SIGNALS, signal.SIGUSR1)  # mpirun forwards SIGUSR1
    with StopOnInterrupt(signals) as interrupt:
        try:
            for s in range(done, args.steps):
                idx = batch_indices(n, args.batch_size, s, args.seed)
                for part in np.split(idx, trainer.config.accumulate):  # gradient accumulation's micro-batches
                    batch, weights = split_weights({k: v[part] for k, v in inputs.items()})
                    m = trainer.step(batch, targets[part], weights=weights)
                m["step"] = float(s)
                rejected += int(m.get("rejected", 0.0))
                evaluation = held is not None and ((s + 1) % every == 0 or s + 1 == args.steps)
                done_waiting = False
                if root and evaluation:
                    held_in, held_w = split_weights(held[0])
                    held_final = trainer.evaluate(held_in, held[1], batch_size=1024, weights=held_w)  # rank 0's only
                    m.update({f"eval_{k}": v for k, v in held_final.items()})
                    evaluated.append((s, held_final["loss"]))
                    if best is not None:
                        best.offer(trainer, s, held_final["loss"], held_final)
                    done_waiting = stopper is not None and stopper.stop(held_final["loss"])
                try:
                    writer.write(m)
                    steps_seen.append(s)
                    losses.append(m["loss"])
                except OSError as e:  # a full disk: stop, and write what else was asked
                    stopped = ("--metrics", _failure("--metrics", args.metrics, e) + f" (step {s}'s row is missing)")
                progress.update(s + 1, m["loss"], force=(s + 1 == args.steps),
                                held_out=evaluated[-1][1] if evaluated else None)
                # every rank stops at the same step: on an interrupt any rank got, or rank 0's failure
                if stop_together(comm, interrupt.requested or stopped is not None):
                    interrupted = stopped is None
                    break
                # --patience: rank 0 decides, every rank stops after the same evaluation
                if stopper is not None and evaluation and stop_together(comm, done_waiting):
                    early = s
                    break
                if args.checkpoint and args.checkpoint_every and (s + 1) % args.checkpoint_every == 0:
                    try:
                        trainer.save_checkpoint(args.checkpoint)  # collective; rank 0 writes
                    except (KfacError, OSError) as e:
                        stopped = ("--checkpoint", _failure("--checkpoint", args.checkpoint, e))
                    if stop_together(comm, stopped is not None):
                        break
        finally:
            progress.close()
            try:
                writer.close()
            except OSError as e:  # the rows a full disk refused are flushed again on closing
                stopped = stopped or ("--metrics", _failure("--metrics", args.metrics, e))
        elapsed = time.perf_counter() - t0
        last = trainer.step_count + trainer.burn_in_count
        title = f"{os.path.basename(str(name))} ({trainer.optimizer})"
        written, failed = _write_outputs(args, trainer, title, steps_seen, losses if root else [],
                                         metrics_ok=stopped is None or stopped[0] != "--metrics", evaluated=evaluated,
                                         best=best)
        final = None
        if early is not None and root and stopper is not None:
            print(stopper.line(early))
        if not interrupted and root:
            train_in, train_w = split_weights(inputs)
            final = trainer.evaluate(train_in, targets, batch_size=1024, weights=train_w)
    return _finish(args, comm, trainer, final, written, failed, stopped, interrupt if interrupted else None,
                   (last, last - done, elapsed, rejected), losses[0] if losses else None,
                   held_final=None if interrupted else held_final, best=best)


# A run whose final loss (on the whole training set) ends above this factor times the first
# step's batch loss (or times 1 when that is below 1) has diverged although it stayed finite:
# the CLI fails it like a NaN run, after writing what was asked.
DIVERGED_FACTOR = 1e3
DIVERGED_ADVICE = ("lower the learning rate, raise --damping, or check the data and the model's constants "
                   "(kfac-compiler inspect)")


def _finish(args, comm, trainer, final, written, failed, stopped, interrupted, counts,
            start_loss: float | None = None, held_final: dict[str, float] | None = None,
            best: BestModel | None = None) -> int:
    """Rank 0 prints the summary and decides the outcome; every rank ends with it (an error
    raised on every rank, or the exit code). `interrupted`: the StopOnInterrupt that stopped
    the run (its signal's exit code), None when none did. `start_loss`: this run's first
    step's loss (None: no step ran), the reference of the divergence check."""
    from kfac_compiler.ranks import is_root, traffic

    last, run, elapsed, rejected = counts
    error, code = None, 0
    if is_root(comm):
        if final is not None:
            parts = [f"final train loss {final['loss']:.6f}"]
            parts += [f"{k} {value:.4f}" for k, value in final.items() if k != "loss"]
            parts.append(f"({last} steps, {elapsed:.1f} s")
            if rejected:
                parts[-1] += f", {rejected} rejected"
            parts[-1] += ")"
            print(" ".join(parts))
            if held_final is not None:
                print(" ".join([f"held-out loss {held_final['loss']:.6f}",
                                *(f"{k} {v:.4f}" for k, v in held_final.items() if k != "loss")]))
            if best is not None and best.step is not None:
                print(" ".join([f"kept the model of step {best.step}: held-out loss {best.loss:.6f}",
                                *(f"{k} {v:.4f}" for k, v in best.metrics.items() if k != "loss")]))
        if comm is not None and run:
            print(f"sent per step by each of {comm.size} ranks (mean of {run} steps): {traffic(trainer.comm.sent, run)}")
        for label, path in written:
            print(f"{label} written to {path}")
        if stopped or failed:
            kept = ", ".join(f"{label} {path!r}" for label, path in written) or "nothing"
            why = "; ".join(failed or [stopped[1]])
            error = OutputError((f"stopped at step {last}: " if stopped else "") + f"{why} (written: {kept})")
        elif interrupted:
            where = (f"checkpoint written to {args.checkpoint}" if args.checkpoint
                     else "no --checkpoint was given, so it cannot be resumed")
            print(f"{interrupted.describe()} at step {last}; {where}", file=sys.stderr)
            code = interrupted.exit_code
        elif not math.isfinite(final["loss"]):
            error = DivergedError(f"training ended with a non-finite loss ({final['loss']}): {DIVERGED_ADVICE}")
        elif start_loss is not None and final["loss"] > DIVERGED_FACTOR * max(abs(start_loss), 1.0):
            error = DivergedError(f"training ended with loss {final['loss']:.4g}, over {DIVERGED_FACTOR:g}x the first "
                                  f"step's {start_loss:.4g}: the run diverged; {DIVERGED_ADVICE}")
    if comm is None:
        if error is not None:
            raise error
        return code
    sys.stdout.flush()
    # rank 0's error is raised everywhere; its signal's exit code is every rank's
    return max(comm.gather(code)) if comm.agree(error, stop=code != 0) else code


def _write_outputs(args, trainer, title: str, steps: list[int], losses: list[float], metrics_ok: bool = True,
                   evaluated: Sequence[tuple[int, float]] = (),
                   best: BestModel | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """Write the checkpoint, the model and the plot asked for, each even when another fails
    (a full disk must not cost the others): ([(label, path) written], [failure lines]).
    Under MPI every rank calls this (a checkpoint is collective); rank 0 writes, and the
    others pass no `losses` (no plot). With `best` (--keep-best) the model is the best
    evaluation's and the checkpoint the last step's."""
    from kfac_compiler.errors import KfacError

    def save(path: str) -> None:
        if best is None:
            trainer.export(path, graph=args.save_graph)
        else:
            best.export(trainer, path, graph=args.save_graph)

    written, failed = [], []
    if args.metrics and metrics_ok:
        written.append(("metrics", args.metrics))  # row by row during the run
    jobs = (("checkpoint", "--checkpoint", args.checkpoint, trainer.save_checkpoint),
            ("model", "--save", args.save, save),
            ("plot", "--plot", args.plot if losses else None, lambda p: _plot(p, steps, losses, title, evaluated)))
    for label, option, path, write in jobs:
        if not path:
            continue
        try:
            write(path)
            written.append((label, path))
        except (KfacError, OSError) as e:
            failed.append(_failure(option, path, e))
    return written, failed


def _failure(option: str, path: str, e: BaseException) -> str:
    """`--checkpoint: cannot write 'x': No space left on device` (a KfacError names the path)."""
    if isinstance(e, OSError):
        return f"{option}: cannot write {path!r}: {os_reason(e, writing=True)}"
    return f"{option}: {' '.join(str(e).split())}"


def main(argv=None) -> int:
    """Standalone entry point (python -m kfac_compiler.train_cli ...): `kfac-compiler train`,
    with the command line's error handling (kfac_compiler.cli.main)."""
    from kfac_compiler.cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "train":
        argv = ["train", *argv]
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
