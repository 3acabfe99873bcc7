"""Compile options: `CompileConfig`, loaded from TOML, JSON or a dict.

Every key is checked: an unknown key, a value of the wrong type or range, or a bad regular
expression raises a one-line ConfigError naming the key. Example (TOML):

    exclude = ["pos_emb"]
    train = ["temperature"]   # train although the constants rule freezes it
    untie = ["ln.weight"]     # or "all": one copy per consumer node
    damping = 1e-3
    ema_decay = 0.9

    [approximations]          # per layer kind (or menu key such as "fully_connected_multi")
    conv = "diagonal"

    [layers]                  # per layer: exact layer name or regex (full match)
    "fc3" = "kron_in_diag"

    [[links]]                 # parameters linked by hand into one generic block
    params = ["head.weight", "head.bias"]
    approximation = "full"

    [estimator]
    mode = "gradients"        # gradients|empirical|curvature_prop|curvature_prop_GGN|exact|exact_GGN
    num_samples = 1

    [inverse]
    method = "auto"           # auto (schur)|schur|inverse_op|newton_schulz|cholesky|eigh
    update_period = 10        # default: chosen by the budget
    damping_split = "pi"      # pi|exact

    [stats]
    update_period = 1         # default: chosen by the budget

    [budget]                  # cost-aware choice (passes/budget.py); overhead = 0: off
    overhead = 1.0            # curvature work per step <= 1.0 x forward+backward FLOPs
    batch_size = 32           # ... at this batch size (default: train's --batch-size, else 32)
    min_dim = 512             # narrower factors are never approximated
    memory_gb = 24            # each block's training state, and all together, must fit (default: this machine's memory)

    [loss_options]            # the loss kind's own options (each loss class lists them)
    variance = 0.5            # squared_error; the old top-level key loss_variance still works

    [[heads]]                 # several loss heads instead of loss/output (docs/frontend.md)
    output = "logits"
    loss = "softmax_cross_entropy"
    coefficient = 1.0         # default 1
    targets = "labels"        # the targets array's name (default: the output's name)
    [[heads]]
    output = "aux"
    loss = "squared_error"
    coefficient = 0.5
    targets = "values"
    options = { variance = 2.0 }
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from kfac_compiler.contract import estimation_mode
from kfac_compiler.errors import ConfigError, os_errors
from kfac_compiler.linalg import METHODS as INVERSE_METHODS
from kfac_compiler.losses import Loss, loss_class
from kfac_compiler.parsing import compile_patterns, name_matches, nesting_checked  # noqa: F401 (names: parsing.py)
from kfac_compiler.requests import MAX_NUM_SAMPLES, NUM_SAMPLES_WHY

DAMPING_SPLITS = ("pi", "exact")
DTYPES = ("float32", "float64")


@dataclass
class EstimatorConfig:
    mode: str = "gradients"
    num_samples: int = 1


@dataclass
class InverseConfig:
    method: str = "auto"  # schur on CPU and CUDA (linalg.concrete_method); failed blocks: host Cholesky
    update_period: int | None = None  # None: chosen by the budget (10 unless a refresh is dear)
    damping_split: str = "pi"


@dataclass
class StatsConfig:
    update_period: int | None = None  # None: chosen by the budget (1 unless statistics are dear)


@dataclass
class BudgetConfig:
    """The cost-aware choice (passes/budget.py): the curvature work per step (preconditioning,
    amortized statistics and inverses) at most `overhead` times the model's forward+backward
    FLOPs at `batch_size` (None: the training batch where the caller knows it, `kfac-compiler
    train --batch-size`, else passes/budget.py's REFERENCE_BATCH 32); factors narrower than
    `min_dim` are never approximated. overhead 0: off (every layer keeps its menu default,
    periods 1 and 10)."""

    overhead: float = 1.0
    batch_size: int | None = None
    min_dim: int = 512
    memory_gb: float | None = None  # each block's training state, and all together, must fit (None: this machine's memory)


@dataclass
class CompileConfig:
    """All front-end and schedule options (defaults in parentheses in docs/frontend.md).

    include / exclude: parameter names or regexes (full match) selecting the trainable
    parameters among the float initializers that reach the output; train: initializers to
    train although the constants rule freezes them (passes/trainable.py); untie: shared
    parameters to split into one copy per consumer node (names, regexes or "all"); retie:
    train an exporter's copies of one parameter (equal values, or a matrix's transpose) as one.
    approximations: {layer kind or menu key: approximation}; layers: {layer name or regex:
    approximation}; links: [{"params": [...], "approximation": "diagonal"|"full", "name": ...}].
    """

    loss: str | None = None
    output: str | None = None
    # several loss heads instead of loss/output: [{output, loss, coefficient, targets, options}]
    heads: list[dict[str, Any]] = field(default_factory=list)
    include: list[str] | None = None
    exclude: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    untie: list[str] = field(default_factory=list)
    retie: bool = True
    approximations: dict[str, str] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)
    links: list[dict[str, Any]] = field(default_factory=list)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    ema_decay: float = 0.9
    damping: float = 1e-3
    inverse: InverseConfig = field(default_factory=InverseConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    # The options of the loss kind ({name: value}; the loss class declares and checks them).
    loss_options: dict[str, Any] = field(default_factory=dict)
    # Old spelling of squared_error's variance option (its LossOption.config_alias); kept so
    # that existing configs work. loss_options wins where both are given.
    loss_variance: float = 1.0
    dtype: str = "float32"
    # Conv and its gradients may use the Gather im2col forms (oprules/conv.py); False: the
    # Slice/Conv forms only (an A/B switch; every emission request resolves it from here)
    conv_gather: bool = True

    # ------------------------------------------------------------------ io
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> CompileConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a table/object at top level, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        nested = {"estimator": EstimatorConfig, "inverse": InverseConfig, "stats": StatsConfig, "budget": BudgetConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(known))})")
            if key in nested:
                kwargs[key] = _nested(nested[key], value, key, source)
            else:
                kwargs[key] = value
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> CompileConfig:
        path = os.fspath(path)
        if os.path.isdir(path):
            raise ConfigError(f"config file {path!r} is a directory; give a TOML or JSON file")
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        ext = os.path.splitext(path)[1].lower()
        try:
            with os_errors(ConfigError, "config file", path, writing=False):
                if ext == ".json":
                    with open(path, encoding="utf-8") as f:
                        data = nesting_checked(lambda: json.load(f))
                else:
                    import tomllib

                    with open(path, "rb") as f:
                        data = nesting_checked(lambda: tomllib.load(f))
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, TOMLDecodeError
            kind = "JSON" if ext == ".json" else "TOML"
            raise ConfigError(f"config file {path!r} is not valid {kind}: {_one_line(e)}") from None
        return cls.from_dict(data, source=path)

    def to_dict(self) -> dict[str, Any]:
        """The options as plan.json's "config" records them (no "heads" key for one loss:
        a plan with one loss reads as it did before heads existed)."""
        data = dataclasses.asdict(self)
        if not data["heads"]:
            del data["heads"]
        return data

    # ------------------------------------------------------------ checking
    def validate(self, source: str = "config") -> None:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{source}: {key}: {msg}")

        if self.loss is not None:
            if not isinstance(self.loss, str):  # several losses are [[heads]] (docs/frontend.md)
                raise bad("loss", f"expected a loss kind (a string), got {self.loss!r}; several loss heads are "
                                  "[[heads]] tables")
            try:
                loss_class(self.loss)
            except ConfigError as e:
                raise bad("loss", str(e)) from None
        if not isinstance(self.loss_options, dict) or not all(isinstance(k, str) for k in self.loss_options):
            raise bad("loss_options", "expected a table {option = value}")
        if self.loss is not None:  # else checked when the loss kind is known (compile_frontend)
            loss_class(self.loss).resolve_options(self.loss_options, where=f"{source}: loss_options: ")
        if self.output is not None and not isinstance(self.output, str):
            raise bad("output", "expected a tensor name")
        if self.heads:
            from kfac_compiler.losses.heads import parse_heads

            self.heads = parse_heads(self.heads, f"{source}: heads")
        if self.include is not None:
            self.include = _str_list(self.include, "include", source)
            compile_patterns(self.include, "include")
        for key in ("retie", "conv_gather"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, f"expected true or false, got {getattr(self, key)!r}")
        for key in ("exclude", "train", "untie"):
            if key == "untie" and self.untie in ("all", "uniform"):
                self.untie = [self.untie]
            setattr(self, key, _str_list(getattr(self, key), key, source))
            compile_patterns(getattr(self, key), key)
        from kfac_compiler.blocks import APPROXIMATIONS

        if not isinstance(self.approximations, dict):
            raise bad("approximations", "expected a table {kind = approximation}")
        for key, value in self.approximations.items():
            if key not in APPROXIMATIONS:
                raise bad(
                    f"approximations.{key}",
                    f"unknown layer kind {key!r}; known: {', '.join(APPROXIMATIONS)}",
                )
            allowed = allowed_for_key(key)
            if value not in allowed:
                raise bad(f"approximations.{key}", f"{value!r} is not allowed; choose one of {', '.join(allowed)}")
        if not isinstance(self.layers, dict):
            raise bad("layers", "expected a table {layer name or regex = approximation}")
        for key, value in self.layers.items():
            if not isinstance(value, str):
                raise bad(f"layers.{key}", "expected an approximation name")
            compile_patterns([key], "layers")
        self.links = _check_links(self.links, source)
        est = self.estimator
        try:
            est.mode = estimation_mode(est.mode)  # kfac-jax's spellings too; its message, our key
        except ConfigError as e:
            raise bad("estimator.mode", str(e)) from None
        _check_int(est.num_samples, "estimator.num_samples", source)
        if est.num_samples > MAX_NUM_SAMPLES:
            raise bad("estimator.num_samples", f"at most {MAX_NUM_SAMPLES} ({NUM_SAMPLES_WHY}), got {est.num_samples}")
        inv = self.inverse
        if inv.method not in INVERSE_METHODS:
            raise bad("inverse.method", f"unknown method {inv.method!r}; choose one of {', '.join(INVERSE_METHODS)}")
        if inv.damping_split not in DAMPING_SPLITS:
            raise bad("inverse.damping_split", f"{inv.damping_split!r}; choose one of {', '.join(DAMPING_SPLITS)}")
        if inv.update_period is not None:
            _check_int(inv.update_period, "inverse.update_period", source)
        if self.stats.update_period is not None:
            _check_int(self.stats.update_period, "stats.update_period", source)
        _check_float(self.budget.overhead, "budget.overhead", source, 0.0, None)
        if self.budget.batch_size is not None:
            _check_int(self.budget.batch_size, "budget.batch_size", source)
        _check_int(self.budget.min_dim, "budget.min_dim", source)
        if self.budget.memory_gb is not None:
            _check_float(self.budget.memory_gb, "budget.memory_gb", source, 0.0, None, lo_open=True)
        _check_float(self.ema_decay, "ema_decay", source, 0.0, 1.0, hi_open=True)
        _check_float(self.damping, "damping", source, 0.0, None)
        _check_float(self.loss_variance, "loss_variance", source, 0.0, None, lo_open=True)
        if self.dtype not in DTYPES:
            raise bad("dtype", f"{self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.dtype != "float32":  # a plan that said float64 ran float32 factors: the budget counted twice their bytes
            raise bad("dtype", f"{self.dtype!r}: factors are float32 on every device (every emitted graph computes "
                               "in float32, a float64 model's included); leave dtype at 'float32'")

    def loss_options_for(self, loss: type[Loss]) -> dict[str, Any]:
        """The options given for `loss`: loss_options, plus the values of the old top-level
        keys its options name as config_alias (where loss_options does not set them)."""
        given = dict(self.loss_options)
        for opt in loss.options:
            if opt.config_alias is not None:
                given.setdefault(opt.name, getattr(self, opt.config_alias))
        return given


def load_config(config: CompileConfig | dict | str | os.PathLike | None) -> CompileConfig:
    """A validated CompileConfig from a config object, a dict, a file path or None (defaults)."""
    if config is None:
        return CompileConfig()
    if isinstance(config, CompileConfig):
        config.validate()
        return config
    if isinstance(config, dict):
        return CompileConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return CompileConfig.from_file(config)
    raise ConfigError(f"config must be a CompileConfig, a dict or a file path, not {type(config).__name__}")


def allowed_for_key(key: str) -> tuple[str, ...]:
    """Approximations a per-kind key may name: its menu, plus the multi-use menu for a kind."""
    from kfac_compiler.blocks import APPROXIMATIONS

    allowed = list(APPROXIMATIONS[key])
    for a in APPROXIMATIONS.get(f"{key}_multi", ()):
        if a not in allowed:
            allowed.append(a)
    return tuple(allowed)


# ---------------------------------------------------------------- helpers
def _nested(cls, value, key: str, source: str):
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key}: expected a table/object")
    known = {f.name for f in dataclasses.fields(cls)}
    for k in value:
        if k not in known:
            raise ConfigError(f"{source}: unknown key '{key}.{k}' (known: {', '.join(sorted(known))})")
    return cls(**value)


def _str_list(value, key: str, source: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{source}: {key}: expected a list of names or regexes")
    return list(value)


def _check_int(value, key: str, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: {key}: expected an integer >= 1, got {value!r}")


def _check_float(value, key, source, lo, hi, lo_open=False, hi_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: {key}: expected a finite number, got {value!r}")
    ok = (value > lo if lo_open else value >= lo) if lo is not None else True
    if hi is not None:
        ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        lo_s = "(" if lo_open else "["
        hi_s = ")" if hi_open else "]"
        rng = f"{lo_s}{lo}, {hi if hi is not None else 'inf'}{hi_s}"
        raise ConfigError(f"{source}: {key}: {value!r} is outside {rng}")


def _check_links(links, source: str) -> list[dict[str, Any]]:
    if not isinstance(links, (list, tuple)):
        raise ConfigError(f"{source}: links: expected a list of {{params = [...], approximation = ...}}")
    out = []
    seen: dict[str, int] = {}
    for i, link in enumerate(links):
        where = f"links[{i}]"
        if not isinstance(link, dict):
            raise ConfigError(f"{source}: {where}: expected a table with 'params'")
        for k in link:
            if k not in ("params", "approximation", "name"):
                raise ConfigError(f"{source}: unknown key '{where}.{k}' (known: approximation, name, params)")
        params = link.get("params")
        if not params or not isinstance(params, (list, tuple)) or not all(isinstance(p, str) for p in params):
            raise ConfigError(f"{source}: {where}.params: expected a non-empty list of parameter names")
        for p in params:
            if p in seen:
                raise ConfigError(f"{source}: {where}: parameter {p!r} is already linked in links[{seen[p]}]")
            seen[p] = i
        approx = link.get("approximation", "diagonal")
        from kfac_compiler.blocks import APPROXIMATIONS

        if approx not in APPROXIMATIONS["generic"]:
            raise ConfigError(
                f"{source}: {where}.approximation: {approx!r} is not allowed for linked parameters; "
                f"choose one of {', '.join(APPROXIMATIONS['generic'])}"
            )
        name = link.get("name")
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"{source}: {where}.name: expected a string")
        out.append({"params": list(params), "approximation": approx, "name": name})
    return out


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
