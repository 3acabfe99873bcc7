"""The contract between the compiler and the runtime: every name the two sides share, the
typed description of a subgraph, and the one way the runtime asks for a subgraph.

The back end emits subgraphs whose inputs and outputs follow these names; the runtime binds
them to device buffers by the same names. Nothing else in either side spells a name: they
call the constructors below (and the parsers, to read one back).

| kind | names | constructors |
| --- | --- | --- |
| data inputs | the model's inputs, `targets`, `example_weights`, `noise/<s>`, `vec/<p>` | TARGETS, EXAMPLE_WEIGHTS, noise(s), vec(p) |
| hyper-parameters | `hp/<name>`, float32 scalars | hp(name) |
| state slots | parameters (initializer names), `velocity/<p>`, `grad_velocity/<p>`, `adam_m/<p>`, `adam_v/<p>` (multi-tensor updates: `velocity/*`, `grad_velocity/*`, `adam_m/*`, `adam_v/*`, the optimizer's parameters' concatenated: Optimizer.flat_params), `grad_accum/<p>` (gradient accumulation's running sum; not checkpointed), `factor/<layer>/<f>`, `inverse/<layer>/<i>` | velocity(p), grad_velocity(p), adam_m(p), adam_v(p), grad_accum(p), flat(kind), factor(l, f), inverse(l, i); parse_slot |
| state outputs | `new/<slot>` | new(slot) |
| metrics | `loss`, `metric/<name>` | LOSS, metric(name) |
| results | `grad/<p>`, `stat/<layer>/<f>`, `precond/<p>`, `product/<p>`, `kfac/output` | grad(p), stat(l, f), precond(p), product(p), MODEL_OUTPUT |

Subgraphs are named by the constants below (an optimizer names its own step); a request for
one carries typed options (kfac_compiler/requests.py) and `SubgraphInfo` says what each input
and output of the emitted graph is. This module is a leaf: it imports nothing of the compiler
but its errors (docs/architecture.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# ------------------------------------------------------------------------------ subgraph names
# the back end's own subgraphs (docs/runtime_contract.md); optimizers name their steps
LOSS_GRAPH = "loss"                      # the loss and the model output
PREDICT = "predict"                      # the model output alone (no targets)
GRADIENTS = "gradients"                  # the loss and every parameter's gradient
STATISTICS = "statistics"                # one batch's factor statistics
UPDATE_STATISTICS = "update_statistics"  # the factors' moving averages from one batch
INVERSE_UPDATE = "inverse_update"        # the damped inverses' state
POWER_UPDATE = "power_update"            # the state of (F + damping)^power, power != -1
PRECONDITION = "precondition"            # (F + damping)^-1 v from the inverses
MULTIPLY = "multiply"                    # (F + damping)^exp v from the factors

# the plan model's metadata key recording the lowered pieces of each fused recurrent weight
RECURRENT_PIECES_KEY = "kfac_compiler.recurrent_params"
# the plan model's metadata key recording which source initializers' elements an initializer
# folded from an exporter's run-time assembly (Slice/Concat of initializers) holds
FOLDED_PARAMS_KEY = "kfac_compiler.folded_params"
# the source model's metadata key holding the torch bridge's parameter manifest (JSON; written
# by kfac_compiler.torch.export, honoured by the front end's trainable split: docs/torch.md)
TORCH_MANIFEST_KEY = "kfac_compiler.torch_manifest"

# ------------------------------------------------------------------------------ data inputs
TARGETS = "targets"
EXAMPLE_WEIGHTS = "example_weights"  # optional loss weights, [N] or per position (Loss.weight_shape)
NOISE_PREFIX = "noise/"
VEC_PREFIX = "vec/"


def noise(s: int) -> str:
    """The s-th noise input of a sampled estimator."""
    return f"{NOISE_PREFIX}{int(s)}"


def noise_index(name: str) -> int:
    return int(name[len(NOISE_PREFIX):])


def is_noise(name: str) -> bool:
    return name.startswith(NOISE_PREFIX)


def vec(p: str) -> str:
    """The vector input for parameter p of `precondition` / `multiply`."""
    return f"{VEC_PREFIX}{p}"


# ------------------------------------------------------------------------------ hyper-parameters
HP_PREFIX = "hp/"


def hp(name: str) -> str:
    return f"{HP_PREFIX}{name}"


# the hyper-parameters more than one module binds or reads (an optimizer names its own)
DAMPING = hp("damping")            # the damping every block's inverse and product use
EMA_COEFF = hp("ema_coeff")        # this batch's weight in the factors' moving average
UPDATE_STATS = hp("update_stats")  # > 0: the step's statistics run (its If on them)
# the number of data-parallel ranks (1 in one process; every StateStore holds it): the generic
# fallback's pseudo-example scales by its square root before the ranks average it
RANKS = hp("ranks")
L2 = hp("l2")                      # weight decay
LEARNING_RATE = hp("learning_rate")
MOMENTUM = hp("momentum")


# ------------------------------------------------------------------------------ state slots
VELOCITY, ADAM_M, ADAM_V, FACTOR, INVERSE = "velocity", "adam_m", "adam_v", "factor", "inverse"
GRAD_VELOCITY = "grad_velocity"  # K-FAC's momentum_type="adam": the momentum sum of raw gradients
# gradient accumulation: the sum of a cycle's micro-batch gradients so far (optimizers/accumulate.py);
# scratch state, meaningless between cycles, so checkpoints (taken at cycle boundaries) leave it out
GRAD_ACCUM = "grad_accum"
PARAM = "param"
_PARAM_STATE = (VELOCITY, ADAM_M, ADAM_V, GRAD_VELOCITY, GRAD_ACCUM)


def velocity(p: str) -> str:
    return f"{VELOCITY}/{p}"


def grad_velocity(p: str) -> str:
    return f"{GRAD_VELOCITY}/{p}"


def grad_accum(p: str) -> str:
    return f"{GRAD_ACCUM}/{p}"


def adam_m(p: str) -> str:
    return f"{ADAM_M}/{p}"


def adam_v(p: str) -> str:
    return f"{ADAM_V}/{p}"


# the owner of a flat slot: <kind>/* holds every parameter's <kind>/<p>, flattened and
# concatenated in kfac_compiler.optimizers.multi_tensor.concat_groups' order (multi-tensor
# updates); checkpoints store it as the per-parameter slots
FLAT = "*"


def flat(kind: str) -> str:
    return f"{kind}/{FLAT}"


def flat_kind(slot: str) -> str | None:
    """The kind of a flat slot (`adam_m/*`: "adam_m", a plugin's own kinds too), else None."""
    suffix = f"/{FLAT}"
    return slot[:-len(suffix)] if slot.endswith(suffix) and len(slot) > len(suffix) else None


def factor(layer: str, name: str) -> str:
    return f"{FACTOR}/{layer}/{name}"


def inverse(layer: str, name: str) -> str:
    return f"{INVERSE}/{layer}/{name}"


@dataclass(frozen=True)
class SlotName:
    """A parsed state slot: kind (param, velocity, adam_m, adam_v, factor, inverse), the
    parameter or layer it belongs to, and the factor / inverse name (factor, inverse only)."""

    kind: str
    owner: str
    item: str = ""


def parse_slot(slot: str) -> SlotName:
    """The inverse of the slot constructors (a name matching none is a parameter). Layer
    names may contain '/', factor and inverse names may not."""
    head, sep, rest = slot.partition("/")
    if sep and head in _PARAM_STATE:
        return SlotName(head, rest)
    if sep and head in (FACTOR, INVERSE) and "/" in rest:
        layer, _, item = rest.rpartition("/")
        return SlotName(head, layer, item)
    return SlotName(PARAM, slot)


def layer_slots(slots, kind: str) -> dict[str, dict[str, str]]:
    """{layer: {item: slot}} of the factor or inverse slots among `slots`."""
    out: dict[str, dict[str, str]] = {}
    for s in slots:
        parsed = parse_slot(s)
        if parsed.kind == kind:
            out.setdefault(parsed.owner, {})[parsed.item] = s
    return out


NEW_PREFIX = "new/"


def new(slot: str) -> str:
    """The output that writes state slot `slot`."""
    return f"{NEW_PREFIX}{slot}"


# ------------------------------------------------------------------------------ metrics, results
LOSS = "loss"
METRIC_PREFIX = "metric/"


def metric(name: str) -> str:
    return LOSS if name == LOSS else f"{METRIC_PREFIX}{name}"


FINITE = metric("finite")  # 1.0: apply the step; 0.0: the runtime discards it (no flip)
INVERSE_OK = metric("inverse_ok")
UPDATE_NORM = metric("update_norm")  # |update| and |gradient| of a training step
GRAD_NORM = metric("grad_norm")


LOSS_METRIC_PREFIX = metric("loss/")  # the loss's own step metrics (Loss.emit_metrics: each head's loss)


def loss_metric(name: str) -> str:
    return f"{LOSS_METRIC_PREFIX}{name}"


def loss_metrics(out: Mapping[str, Any]) -> dict[str, float]:
    """The loss's own metrics of a run's outputs, by their short names (e.g. "loss_labels")."""
    return {k[len(LOSS_METRIC_PREFIX):]: v for k, v in out.items() if k.startswith(LOSS_METRIC_PREFIX)}


def inverse_ok(layer: str) -> str:
    """Per block of inverse_update: 1.0 if its emitted inverse passed the method's check."""
    return metric(f"inverse_ok/{layer}")


MODEL_OUTPUT = "kfac/output"  # the model output, as a result of the `loss` and `predict` subgraphs
RESERVED = (TARGETS, LOSS, EXAMPLE_WEIGHTS, MODEL_OUTPUT)  # model tensors may not use these


def grad(p: str) -> str:
    return f"grad/{p}"


STAT_PREFIX = "stat/"


def stat(layer: str, name: str) -> str:
    return f"{STAT_PREFIX}{layer}/{name}"


def parse_stat(name: str) -> tuple[str, str] | None:
    """(layer, factor) of a `stat/<layer>/<factor>` result, else None."""
    return split_layer_item(name, STAT_PREFIX)


def precond(p: str) -> str:
    return f"precond/{p}"


def product(p: str) -> str:
    return f"product/{p}"


def split_layer_item(name: str, prefix: str) -> tuple[str, str] | None:
    """(layer, item) of `<prefix><layer>/<item>` (stat/, factor/, inverse/), else None."""
    if not name.startswith(prefix):
        return None
    layer, _, item = name[len(prefix):].rpartition("/")
    return layer, item


# the prefixes of the names above: a model tensor named like them (`hp/damping`, `velocity/W`)
# would meet the runtime's own inputs, slots and results in the emitted graphs
RESERVED_PREFIXES = (NOISE_PREFIX, VEC_PREFIX, HP_PREFIX, *(f"{k}/" for k in (*_PARAM_STATE, FACTOR, INVERSE)),
                     NEW_PREFIX, METRIC_PREFIX, "grad/", STAT_PREFIX, "precond/", "product/")


def reserved_prefix(name: str) -> str | None:
    """`<prefix>...` of the contract's names that a model tensor called `name` would clash
    with, else None (RESERVED's whole names are the emission's check)."""
    return next((f"{p}..." for p in RESERVED_PREFIXES if name.startswith(p)), None)


# ------------------------------------------------------------------------------ reduction points
# Emission.reduce_mean's point for a batch's factor statistics (the back end's factor updates,
# inside an optimizer's step); an optimizer names its other points itself.
FACTOR_STATISTICS_POINT = "factor statistics"
# ... and for the statistics a block keeps in its inverse state (ekfac's S), which the same
# step's preconditioner reads at their new average: a data-parallel step cuts there
STATE_STATISTICS_POINT = "state statistics"
# ... and for the terms a batch statistic is built from that are not linear in the batch: the
# generic fallback's pseudo-example (squared after the ranks' mean) and a masked activation
# statistic's number of live rows (its divisor); a data-parallel step cuts there, so that
# every rank folds the global batch's statistic (backend/factors.py)
STATISTICS_TERMS_POINT = "statistics terms"


# ------------------------------------------------------------------------------ plan vocabulary
# The curvature estimators a plan or an optimizer may name (passes/estimator.py emits them).
ESTIMATION_MODES = ("gradients", "empirical", "curvature_prop", "curvature_prop_GGN", "exact", "exact_GGN")
# kfac-jax's estimation_mode spellings of the same estimators
MODE_ALIASES = {"fisher_gradients": "gradients", "fisher_empirical": "empirical", "fisher_exact": "exact",
                "fisher_curvature_prop": "curvature_prop", "ggn_exact": "exact_GGN",
                "ggn_curvature_prop": "curvature_prop_GGN"}


def estimation_mode(mode: object) -> str:
    """The estimator's name for `mode` (ours or kfac-jax's); ConfigError naming both lists."""
    from kfac_compiler.errors import ConfigError

    if isinstance(mode, str) and mode in ESTIMATION_MODES:
        return mode
    if isinstance(mode, str) and mode in MODE_ALIASES:
        return MODE_ALIASES[mode]
    raise ConfigError(f"unknown estimation mode {mode!r}; choose one of {', '.join(ESTIMATION_MODES)} "
                      f"(or kfac-jax's {', '.join(MODE_ALIASES)})")


# ------------------------------------------------------------------------------ subgraph info
@dataclass
class SlotSpec:
    """A state slot's shape, dtype and initial value: "param" (the plan's initializer),
    "model" (the plan model's initializer of the slot's name: non-trained state such as the
    running statistics of a training-mode BatchNormalization), "zeros", "identity" (eye for
    [k, k], one per matrix for [g, k, k], ones otherwise)."""

    shape: list[int]
    dtype: str = "float32"
    init: str = "zeros"


@dataclass
class NoiseSpec:
    """The noise inputs of a sampled estimator: `count` inputs of `shape` ("N" for the batch
    dimension, an int m when the statistics run on a sub-batch of m examples)."""

    count: int = 0
    shape: list[Any] = field(default_factory=list)
    distribution: str = "uniform"


@dataclass
class SubgraphInfo:
    """What every input and output of an emitted subgraph is (docs/runtime_contract.md).
    `kind`: the subgraph kind it was emitted as (empty in older plans: the file stem);
    `options`: every option it was emitted with, resolved (kfac_compiler/requests.py):
    equal kinds and options mean an identical graph."""

    data_inputs: list[str] = field(default_factory=list)
    hp_inputs: list[str] = field(default_factory=list)
    state_inputs: list[str] = field(default_factory=list)
    state_outputs: dict[str, str] = field(default_factory=dict)  # new/<slot> -> slot
    metrics: list[str] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    state_specs: dict[str, SlotSpec] = field(default_factory=dict)
    noise: NoiseSpec = field(default_factory=NoiseSpec)
    options: dict[str, Any] = field(default_factory=dict)
    kind: str = ""
    # the reduction points a data-parallel run cuts the graph at, in order: point -> {reduced
    # tensor: the local tensor (a mean over this process's examples) it stands for}
    reductions: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SubgraphInfo:
        """From plan.json's `info` (or an older plan's free-form dict: absent keys are empty)."""
        specs = {s: SlotSpec(**v) for s, v in (doc.get("state_specs") or {}).items()}
        noise_doc = doc.get("noise") or {}
        return cls(
            data_inputs=list(doc.get("data_inputs", [])),
            hp_inputs=list(doc.get("hp_inputs", [])),
            state_inputs=list(doc.get("state_inputs", [])),
            state_outputs=dict(doc.get("state_outputs", {})),
            metrics=list(doc.get("metrics", [])),
            results=list(doc.get("results", [])),
            state_specs=specs,
            noise=NoiseSpec(**noise_doc) if noise_doc else NoiseSpec(),
            options=dict(doc.get("options", {})),
            kind=str(doc.get("kind", "")),
            reductions={point: dict(pairs) for point, pairs in (doc.get("reductions") or {}).items()},
        )
