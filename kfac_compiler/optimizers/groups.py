"""Parameter groups: a first-order rule (Adam, SGD) for chosen layers while K-FAC
preconditions the rest, in K-FAC's one step graph (docs/runtime.md, "Parameter groups").

    Trainer(plan, optimizer="kfac", param_groups=[
        {"kind": ["tied_embedding", "scale_and_shift"], "optimizer": "adam", "learning_rate": 1e-3},
        {"params": r"pos_emb", "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "name": "pos"},
    ])

A group selects by parameter name (`params`: names or regexes, full match), by layer name
(`layers`) or by layer kind (`kind`: the kinds `inspect` shows), and takes its optimizer's
options (torch's `lr`, `eps`, `betas` too). The selection applies per layer: a layer's
curvature block covers all its parameters (a Kronecker block's input factor carries the
bias's homogeneous coordinate), so a group takes whole layers, and selecting part of one is
refused; the compile-time link that gives a bias a layer of its own (`[[links]]`,
docs/frontend.md) is the way to train it apart. The block then changes, which is why that is
a compile option and the groups are not: everything else is decided when the run starts, on
the same plan.

In the step graph (`kfac_step`'s `groups` option) the groups' parameters are held out of the
curvature (Emission.hold): no statistics, inverses, preconditioning, velocity or quadratic
model for them, so K-FAC's alpha, mu, damping, norm constraint and loss-after check see only
its own parameters, with the groups' held at their values. The groups' gradients come out of
the same backward pass, and each group's rule (first_order.emit_rule, the rule of its
optimizer's own step) writes their update and its state (adam_m/<p>, adam_v/<p>,
velocity/<p>), reading its hyper-parameters as hp/group/<name>/<hp>. The policy here binds
those each step, reports the groups' metrics and undoes their last update in a roll back.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kfac_compiler import contract as C
from kfac_compiler.errors import ConfigError
from kfac_compiler.optimizers.base import OPTIMIZERS, FirstOrderStepOptions, optimizer_class
from kfac_compiler.optimizers.first_order import FirstOrderOptimizer, emit_rule
from kfac_compiler.optimizers.multi_tensor import Layout
from kfac_compiler.optimizers.schedules import CALLABLE
from kfac_compiler.parsing import compile_patterns, name_matches

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission
    from kfac_compiler.plan import Plan
    from kfac_compiler.runtime.state import StateStore

SELECTORS = ("params", "layers", "kind")
# a group as kfac_step's `groups` option holds it: (name, optimizer, parameters, flags)
GroupSpec = tuple[str, str, tuple[str, ...], tuple[str, ...]]
DEFAULT_OPTIMIZER = "adam"
# torch.optim's spellings of a group's options (betas: Adam's (beta1, beta2))
TORCH_NAMES = {"lr": "learning_rate", "eps": "epsilon"}
# the rule's graph options a group's settings switch on (FirstOrderStepOptions' fields); a
# group's update is emitted per parameter, never multi-tensor (its state slots are per parameter)
FLAGS = ("l2", "clip", "decay")
NAME = re.compile(r"[A-Za-z0-9_.-]+")
EXAMPLE = "kind=embedding optimizer=adam learning_rate=1e-3"


def group_hp(group: str, name: str) -> str:
    """The graph input of hyper-parameter `name` (C.LEARNING_RATE, ...) for group `group`."""
    return C.hp(f"group/{group}/{name[len(C.HP_PREFIX):]}")


def group_metric(group: str, name: str) -> str:
    return C.metric(f"group/{group}/{name}")


def trainable_rules() -> list[str]:
    """The registered optimizers whose rule can train a group."""
    return [n for n, cls in OPTIMIZERS.items() if _is_rule(cls)]


def _is_rule(cls: type) -> bool:
    return issubclass(cls, FirstOrderOptimizer) and getattr(cls, "rule", None) is not None


# --------------------------------------------------------------------------- settings
def normalize(value: Any) -> list[dict[str, Any]] | None:
    """K-FAC's `param_groups` knob as JSON: a list of groups, each {"name", "optimizer", the
    selectors given, the optimizer options given (canonical names; a schedule as its text)};
    None for no groups. A group is a dict or the command line's text (parse_text). One-line
    ConfigError naming the group for anything its optimizer would refuse."""
    if value is None:
        return None
    if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(f"param_groups must be a list of groups (dicts such as {{'kind': 'embedding', "
                          f"'optimizer': 'adam', 'learning_rate': 1e-3}}), got {value!r}")
    out: list[dict[str, Any]] = []
    for i, group in enumerate(value):
        if isinstance(group, str):
            group = parse_text(group, f"param_groups[{i}]")
        if not isinstance(group, Mapping):
            raise ConfigError(f"param_groups[{i}] must be a dict, got {group!r}")
        out.append(_normalized(dict(group), i))
    names = [g["name"] for g in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"param_groups: the name {twice[0]!r} is given to two groups; name each group once")
    return out or None


def _normalized(group: dict[str, Any], i: int) -> dict[str, Any]:
    name = group.pop("name", None)
    name = f"group{i}" if name is None else name
    where = f"param_groups[{i}]"
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"{where}: name must be letters, digits, '_', '.' or '-', got {name!r}")
    where = f"{where} ({name!r})"
    opt = group.pop("optimizer", DEFAULT_OPTIMIZER)
    if not isinstance(opt, str) or opt not in OPTIMIZERS:
        raise ConfigError(f"{where}: unknown optimizer {opt!r}; a group takes one of {', '.join(trainable_rules())}")
    cls = optimizer_class(opt)
    if not _is_rule(cls):
        raise ConfigError(f"{where}: optimizer {opt!r} cannot train a parameter group (a group takes a first-order "
                          f"rule: {', '.join(trainable_rules())}; the other parameters are K-FAC's)")
    doc: dict[str, Any] = {"name": name, "optimizer": opt}
    for key in SELECTORS:
        if key in group:
            doc[key] = _strings(group.pop(key), f"{where}: {key}")
    if not any(k in doc for k in SELECTORS):
        raise ConfigError(f"{where} selects nothing: give params (names or regexes), layers or kind "
                          f"(e.g. {{'kind': 'embedding', 'optimizer': 'adam'}})")
    knobs = _canonical(cls, group, where)
    try:
        cfg = cls.Config.from_knobs(None, **knobs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    stored = cfg.to_dict()
    for k in knobs:
        if stored[k] == CALLABLE:
            raise ConfigError(f"{where}: {k} is a Python callable, which a checkpoint cannot store: give its schedule "
                              "as text (e.g. 'cosine:1e-3,0,1000')")
        doc[k] = stored[k]
    return doc


def _strings(value: Any, where: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v for v in items):
        raise ConfigError(f"{where} must be a name or regex, or a list of them, got {value!r}")
    return list(items)


def _canonical(cls: type[FirstOrderOptimizer], knobs: dict[str, Any], where: str) -> dict[str, Any]:
    """The group's optimizer options by their canonical names (torch's lr, eps, betas too)."""
    out: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        try:
            name = cls.Config.option_name(TORCH_NAMES.get(key, key))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if name == "multi_tensor":
            raise ConfigError(f"{where}: a group's update is emitted per parameter (its state slots are per "
                              "parameter); drop multi_tensor")
        if name in out:
            raise ConfigError(f"{where}: option {name!r} given twice (as {key!r} and another spelling)")
        out[name] = value

    for key, value in knobs.items():
        if key == "betas":  # torch's (beta1, beta2); the command line's text "0.9,0.999"
            pair = value.split(",") if isinstance(value, str) else value
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ConfigError(f"{where}: betas must be a pair (beta1, beta2), got {value!r}")
            for name, v in zip(("beta1", "beta2"), pair):
                try:
                    put(name, cls.Config.parse_option(name, v)[1] if isinstance(value, str) else v)
                except ConfigError as e:
                    raise ConfigError(f"{where}: betas: {e}") from None
        else:
            put(key, value)
    return out


def parse_text(text: str, where: str = "--param-group") -> dict[str, Any]:
    """A group from the command line's text: KEY=VALUE pairs separated by spaces, e.g.
    'kind=embedding,scale_and_shift optimizer=adam learning_rate=1e-3' (a selector's items
    separated by commas; a value parsed by its option's declared type, a schedule's text too)."""
    pairs: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not value:
            raise ConfigError(f"{where} {text!r}: expected KEY=VALUE pairs separated by spaces (e.g. '{EXAMPLE}')")
        if key in pairs:
            raise ConfigError(f"{where} {text!r}: {key} given twice")
        pairs[key] = value
    if not pairs:
        raise ConfigError(f"{where}: empty; expected KEY=VALUE pairs such as '{EXAMPLE}'")
    group: dict[str, Any] = {}
    for key in ("name", "optimizer"):
        if key in pairs:
            group[key] = pairs.pop(key)
    for key in SELECTORS:
        if key in pairs:
            raw = pairs.pop(key)
            group[key] = raw if key == "params" else raw.split(",")  # a regex may hold commas: a{1,2}
    cls = OPTIMIZERS.get(group.get("optimizer", DEFAULT_OPTIMIZER))
    for key, value in pairs.items():
        if cls is None or key == "betas":
            group[key] = value  # refused or split by normalize, with the group's name
            continue
        try:
            group[key] = cls.Config.parse_option(TORCH_NAMES.get(key, key), value, key)[1]
        except ConfigError as e:
            raise ConfigError(f"{where} {text!r}: {e}") from None
    return group


def same_selection(stored: Sequence[Mapping[str, Any]] | None, given: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether two normalized param_groups select alike (names, optimizers, selectors): a
    resumed run's groups may change their options, not what they train (the state slots are
    the checkpoint's)."""
    def key(groups):
        return [(g["name"], g["optimizer"], *(tuple(g.get(k, ())) for k in SELECTORS)) for g in groups or ()]
    return key(stored) == key(given)


# --------------------------------------------------------------------------- selection
@dataclass(frozen=True)
class ParamGroup:
    """A group resolved against a plan: its layers and parameters (plan order), its
    optimizer's class and validated settings, and the graph options its settings switch on."""

    name: str
    optimizer: str
    layers: tuple[str, ...]
    params: tuple[str, ...]
    cls: type[FirstOrderOptimizer]
    config: Any
    knobs: dict[str, Any]

    @property
    def flags(self) -> tuple[str, ...]:
        """FirstOrderStepOptions' switches this group's settings turn on."""
        cfg = self.config
        on = {"l2": cfg.l2_reg > 0, **cfg.recipe_options()}
        return tuple(f for f in FLAGS if on[f])

    def spec(self) -> GroupSpec:
        """The group as kfac_step's `groups` option holds it (hashable, JSON as lists)."""
        return (self.name, self.optimizer, self.params, self.flags)

    def hyper_parameters(self, t: int, k: int) -> dict[str, float]:
        """Its rule's hyper-parameters for its t-th applied update at step count k, by the
        rule's own names (group_hp gives the graph's)."""
        cfg = self.config
        hp = {**self.cls.rule_hyper_parameters(cfg, t, k), **cfg.recipe_hyper_parameters(k)}
        if cfg.l2_reg > 0:
            hp[C.L2] = float(cfg.l2_reg)
        return hp

    def describe(self) -> str:
        """'adam (learning_rate 0.001)' for inspect and the train command's summary."""
        opts = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.knobs.items())
        return f"{self.optimizer}" + (f" ({opts})" if opts else "")


def select(plan: Plan, value: Any) -> list[ParamGroup]:
    """The groups of `value` (the param_groups knob, normalized or not) resolved against
    `plan`: each selector must select something, a layer is selected whole, no parameter is
    in two groups, and K-FAC keeps at least one layer (one-line ConfigErrors naming the group)."""
    groups = normalize(value) or []
    owner: dict[str, str] = {}  # parameter -> the group that took it
    out = []
    for i, g in enumerate(groups):
        where = f"param_groups[{i}] ({g['name']!r})"
        chosen = _selected(plan, g, where)
        layers = []
        for layer in plan.layers:
            mine = [p for p in layer.params if p in chosen]
            if not mine:
                continue
            left = [p for p in layer.params if p not in chosen]
            if left:
                raise ConfigError(
                    f"{where} selects {_names(mine)} but not {_names(left)} of layer {layer.name!r} ({layer.kind}, "
                    f"{layer.approximation}), whose curvature block covers all its parameters: select the whole "
                    f"layer (layers={layer.name!r}), or compile with a link giving {_names(mine)} a layer of its own "
                    f"(config [[links]] params = {mine}) to train it apart")
            for p in layer.params:
                if p in owner:
                    raise ConfigError(f"parameter {p!r} is selected by {owner[p]} and by {where}; a parameter trains "
                                      "with one optimizer: narrow one of the selections")
                owner[p] = where
            layers.append(layer.name)
        params = tuple(p for name in layers for p in plan.layer(name).params)
        cls = optimizer_class(g["optimizer"])
        knobs = {k: v for k, v in g.items() if k not in ("name", "optimizer", *SELECTORS)}
        try:
            cfg = cls.Config.from_knobs(plan, **knobs)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        out.append(ParamGroup(g["name"], g["optimizer"], tuple(layers), params, cls, cfg, knobs))
    if out and all(p in owner for p in plan.trainable):
        raise ConfigError("param_groups select every trainable parameter: nothing is left for K-FAC; train with "
                          f"optimizer={out[0].optimizer!r} instead, or narrow the groups")
    return out


def _names(params: Sequence[str]) -> str:
    return ", ".join(repr(p) for p in params)


def _selected(plan: Plan, g: Mapping[str, Any], where: str) -> set[str]:
    """The parameters a group's selectors name (each selector must name something)."""
    chosen: set[str] = set()
    for pattern, rx in zip(g.get("params", ()), compile_patterns(g.get("params", []), f"{where}: params")):
        hits = [p for p in plan.trainable if name_matches(p, pattern, rx)]
        if not hits:
            frozen = [p for p in plan.frozen if name_matches(p, pattern, rx)]
            why = (f": {frozen[0]!r} is frozen ({plan.frozen_reason(frozen[0])})" if frozen
                   else f" (parameters: {_listing(plan.trainable)})")
            raise ConfigError(f"{where}: params {pattern!r} matches no trainable parameter{why}")
        chosen.update(hits)
    names = [layer.name for layer in plan.layers]
    for pattern, rx in zip(g.get("layers", ()), compile_patterns(g.get("layers", []), f"{where}: layers")):
        hits = [layer for layer in plan.layers if name_matches(layer.name, pattern, rx)]
        if not hits:
            raise ConfigError(f"{where}: layers {pattern!r} matches no layer (layers: {_listing(names)})")
        chosen.update(p for layer in hits for p in layer.params)
    kinds = sorted({layer.kind for layer in plan.layers})
    for kind in g.get("kind", ()):
        hits = [layer for layer in plan.layers if layer.kind == kind]
        if not hits:
            raise ConfigError(f"{where}: kind {kind!r} matches no layer of this plan (its kinds: {', '.join(kinds)}; "
                              "kfac-compiler inspect shows each layer's)")
        chosen.update(p for layer in hits for p in layer.params)
    return chosen


def _listing(names: Sequence[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


# --------------------------------------------------------------------------- the step graph
def hold(em: Emission, groups: Sequence[GroupSpec]) -> None:
    """Take the groups' parameters (kfac_step's `groups` option) out of the curvature, before
    the step emits anything."""
    em.hold([p for _, _, params, _ in groups for p in params])


def emit_updates(em: Emission, groups: Sequence[GroupSpec], raw_grads: Mapping[str, str]) -> list[str]:
    """Each group's update by its rule from the (reduced) gradients `raw_grads`, its metrics
    group/<name>/update_norm and grad_norm; returns the finiteness terms the step's
    metric/finite adds (a group's NaN update rejects the whole step)."""
    b, ok = em.b, []
    for name, optimizer, params, flags in groups:
        lay = Layout(em, False, params)

        def hp(n: str, name: str = name) -> str:
            return em.hp(group_hp(name, n))

        options = FirstOrderStepOptions(**{f: True for f in flags})
        steps, g_raw = emit_rule(em, lay, {p: raw_grads[p] for p in params}, options, optimizer_class(optimizer).rule,
                                 hp)
        update_sq = lay.sum_squares(steps)
        em.metric(group_metric(name, "update_norm"), b.op("Sqrt", [update_sq]))
        em.metric(group_metric(name, "grad_norm"), b.op("Sqrt", [lay.sum_squares(g_raw)]))
        ok.append(update_sq)
    return ok


# --------------------------------------------------------------------------- the host
class Groups:
    """K-FAC's host side of its parameter groups: which parameters and layers stay K-FAC's,
    the groups' hyper-parameters each step, their metrics, and their last update's undo."""

    def __init__(self, plan: Plan, value: Any) -> None:
        self.groups = select(plan, value) if value else []
        held = {p for g in self.groups for p in g.params}
        self.kfac_params = [p for p in plan.trainable if p not in held]
        # None without groups: every subgraph as before (no `layers` option in its request)
        self.kfac_layers = (tuple(layer.name for layer in plan.layers if not held & set(layer.params))
                            if self.groups else None)
        self.spec = tuple(g.spec() for g in self.groups)
        self.last_hp: dict[str, dict[str, float]] = {}  # group -> the hyper-parameters of its last applied update
        self._pending: dict[str, dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    def hyper_parameters(self, t: int, k: int) -> dict[str, float]:
        """The groups' graph inputs for a step at count k whose update would be the t-th applied."""
        self._pending = {g.name: g.hyper_parameters(t, k) for g in self.groups}
        return {group_hp(name, n): v for name, hp in self._pending.items() for n, v in hp.items()}

    def metrics(self, out: Mapping[str, float], applied: bool, k: int) -> dict[str, float]:
        """<group>/learning_rate (before Adam's bias correction, as Adam reports it),
        <group>/update_norm (0 for a rejected step) and <group>/grad_norm."""
        m = {}
        for g in self.groups:
            m[f"{g.name}/learning_rate"] = float(g.config.at("learning_rate", k))
            m[f"{g.name}/update_norm"] = out.get(group_metric(g.name, "update_norm"), float("nan")) if applied else 0.0
            m[f"{g.name}/grad_norm"] = out.get(group_metric(g.name, "grad_norm"), float("nan"))
        return m

    def applied(self) -> None:
        """The step whose hyper-parameters hyper_parameters() gave was applied."""
        self.last_hp = dict(self._pending)

    def undone(self) -> None:
        """The last applied update was rolled back (undo kept): nothing is left to undo."""
        self.last_hp = {}

    def undo(self, store: StateStore) -> dict[str, np.ndarray]:
        """Set the groups' parameters to their values before the last applied update (each
        rule's previous_parameters; its state slots stay); returns {parameter: value now}, for
        putting back. Nothing before a first applied update."""
        kept = {}
        for g in self.groups:
            hp = self.last_hp.get(g.name)
            if hp is None:
                continue
            for p in g.params:
                theta = store.to_numpy(p)
                state = {kind: store.to_numpy(f"{kind}/{p}") for kind in g.cls.state_kinds}
                kept[p] = theta
                store.set(p, g.cls.previous_parameters(theta, state, hp).astype(theta.dtype))
        return kept

    def summary_lines(self) -> list[str]:
        return [f"group {g.name}: {g.describe()} trains {', '.join(g.layers)}" for g in self.groups]

    def host_state(self) -> dict[str, Any]:
        return {"group_hp": {name: dict(hp) for name, hp in self.last_hp.items()}} if self.groups else {}

    def set_host_state(self, state: Mapping[str, Any]) -> None:
        """Restore host_state(); ValueError for a value no run writes."""
        stored = state.get("group_hp", {}) if self.groups else {}
        if not isinstance(stored, Mapping) or not all(
                isinstance(hp, Mapping) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                for v in hp.values()) for hp in stored.values()):
            raise ValueError(f"host.group_hp must map group names to hyper-parameter numbers, got {stored!r}")
        self.last_hp = {str(name): {str(k): float(v) for k, v in hp.items()} for name, hp in stored.items()}
