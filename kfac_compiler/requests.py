"""Emission requests: the typed options of every subgraph kind, resolved before they are a key.

A `Request` names a subgraph kind and carries a frozen options object of that kind's type.
`resolve` fills every option that depends on the plan or the device (the estimator mode and
samples, the concrete inverse method, the damping split, conv_gather), so equal resolved requests mean
an identical graph: the plan stores its graphs under them and the emission cache
(kfac_compiler.backend.service) keys on them. Nothing here imports the back end: the runtime
builds and resolves requests, then looks them up in the plan (docs/architecture.md).

    req = request("statistics", mode="exact").resolve(Settings.of(plan, "cpu"))
    req.key()    # 'statistics(conv_gather=True,damping_split=pi,mode=exact,num_samples=1,...)'

The back end's kinds are registered here; an optimizer plugin registers its step's kind
(its `subgraphs`, kfac_compiler.optimizers.base) with `register_kind`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from kfac_compiler import contract as C
from kfac_compiler.errors import ConfigError
from kfac_compiler.linalg.methods import AUTO_METHOD, concrete_method

O = TypeVar("O", bound="SubgraphOptions")


# the most sampled targets one statistics update draws: each is a backward pass of its own in
# the emitted graph (a billion took gigabytes and minutes before a one-line refusal existed)
MAX_NUM_SAMPLES = 64
NUM_SAMPLES_WHY = "each sample is a backward pass of its own in every statistics update"


@dataclass(frozen=True)
class Settings:
    """What a request is resolved against: the plan's estimator and inverse settings and the
    device the graph will run on."""

    mode: str = "gradients"
    num_samples: int = 1
    inverse_method: str = "auto"
    damping_split: str = "pi"
    device: str = "cpu"
    conv_gather: bool = True

    @classmethod
    def of(cls, plan: Any, device: str = "cpu") -> Settings:
        """The settings of a kfac_compiler.plan.Plan on `device` ("cpu", "cuda")."""
        return cls(plan.estimator.mode, int(plan.estimator.num_samples), plan.inverse.method,
                   plan.inverse.damping_split, device, bool((plan.config or {}).get("conv_gather", True)))


@dataclass(frozen=True)
class SubgraphOptions:
    """The options every subgraph has. `weighted`: an example_weights input weights the loss,
    per example [N] or per position (shaped like Loss.weight_shape of the targets); `damping_split`: how blocks split damping between Kronecker factors (the
    plan's, filled by resolve); `conv_gather`: Conv and its gradients may use the Gather
    im2col forms (oprules/conv.py; False: the Slice/Conv forms only; the plan's compile
    option, filled by resolve)."""

    weighted: bool = False
    damping_split: str | None = None
    conv_gather: bool | None = None

    # the fields resolve fills (None, or "auto" for a method) from the settings: each options
    # class lists its own, so a plugin's field of the same name is never overwritten
    resolved: ClassVar[tuple[str, ...]] = ("damping_split", "conv_gather")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # lists (plan.json, callers) as tuples, nested ones too: hashable keys
            if isinstance(getattr(self, f.name), (list, tuple)):
                object.__setattr__(self, f.name, _hashable(getattr(self, f.name)))

    def unresolved(self) -> list[str]:
        """The fields resolve has yet to fill."""
        return [name for name in self.resolved if getattr(self, name) is None
                or (name == "method" and getattr(self, name) == AUTO_METHOD)]

    def resolve(self: O, settings: Settings) -> O:
        """These options with every plan- or device-dependent one concrete ("auto" methods
        included), so that they can key a graph."""
        changes = {name: RESOLVERS[name](settings) for name in self.unresolved()}
        return dataclasses.replace(self, **changes) if changes else self

    def to_json(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls: type[O], doc: Mapping[str, Any]) -> O:
        """From plan.json (lists back to tuples); ConfigError naming an unknown option."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in doc if k not in names]
        if unknown:
            raise ConfigError(f"{cls.__name__} has no option {unknown[0]!r}")
        return cls(**doc)


def _jsonable(v: Any) -> Any:
    return [_jsonable(x) for x in v] if isinstance(v, tuple) else v


def _hashable(v: Any) -> Any:
    """`v` with every list, at any depth, a tuple (plan.json gives an option's nested tuples back as lists)."""
    return tuple(_hashable(x) for x in v) if isinstance(v, (list, tuple)) else v


# whether an optimizer emits its update once over every parameter's concatenation
# (optimizers/multi_tensor.py) where its settings leave it open, by device: off on both. On
# the CPU the concatenations' copies cost about what the nodes they save do (ResNet-18's Adam
# step 1.08x slower, SGD's 1.12x; the GPT's 1.02x, 1.16x; the zoo's within noise). On CUDA
# (an H200, onnxruntime-gpu 1.31, uncaptured) the Concat of 62 parameters and its Splits took
# 338 ms of ResNet-18's 340 ms Adam step (6.7 ms per parameter), the GPT's 44 ms against 11.6
# (docs/runtime.md, "Multi-tensor updates"; benchmarks/results/2026-11-30-h200.md)
MULTI_TENSOR_DEFAULT: Mapping[str, bool] = {"cuda": False, "cpu": False}

# how resolve fills each resolvable field from the settings
RESOLVERS: Mapping[str, Callable[[Settings], Any]] = {
    "mode": lambda s: s.mode,
    "num_samples": lambda s: s.num_samples,
    "method": lambda s: concrete_method(s.inverse_method, s.device),
    "damping_split": lambda s: s.damping_split,
    "conv_gather": lambda s: s.conv_gather,
    "multi_tensor": lambda s: MULTI_TENSOR_DEFAULT.get(s.device, False),
}


# --------------------------------------------------------------------------- the back end's kinds
@dataclass(frozen=True)
class LossOptions(SubgraphOptions):
    pass


@dataclass(frozen=True)
class PredictOptions(SubgraphOptions):
    pass


@dataclass(frozen=True)
class GradientsOptions(SubgraphOptions):
    pass


@dataclass(frozen=True)
class StatisticsOptions(SubgraphOptions):
    """One batch's factor statistics (`statistics`) or their moving averages
    (`update_statistics`), on the first `stats_batch` examples (None: all), of every block or
    of `layers` only (K-FAC with first-order parameter groups: the groups' layers have no
    statistics)."""

    resolved: ClassVar[tuple[str, ...]] = SubgraphOptions.resolved + ("mode", "num_samples")

    mode: str | None = None
    num_samples: int | None = None
    stats_batch: int | None = None
    layers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class InverseOptions(SubgraphOptions):
    """Damped inverses (`inverse_update`) of every block, or of `layers` only (a refresh
    spread over steps)."""

    resolved: ClassVar[tuple[str, ...]] = SubgraphOptions.resolved + ("method",)

    method: str | None = None
    layers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class PowerOptions(InverseOptions):
    """`power_update`: the state of (F + damping)^power for a power other than -1."""

    power: float = -0.5


@dataclass(frozen=True)
class PreconditionOptions(SubgraphOptions):
    pass


@dataclass(frozen=True)
class MultiplyOptions(SubgraphOptions):
    """(F + damping)^exp v from the moving-average factors."""

    exp: float = 1


@dataclass(frozen=True)
class SubgraphKind:
    """A subgraph kind: its contract name, its options type, and whether a training step runs
    it every step (its session keeps spinning workers and the CPU arena, and profiles of a
    steady step read it). `emit`: an optimizer's emitter `emit(em, options)`; the back end
    registers emitters for its own kinds (kfac_compiler.backend.registry)."""

    name: str
    options: type[SubgraphOptions]
    every_step: bool = False
    emit: Callable[..., None] | None = None
    owner: str = "the back end"


KINDS: dict[str, SubgraphKind] = {}


def register_kind(kind: SubgraphKind) -> SubgraphKind:
    """Make `kind` requestable; a name another owner registered is a ConfigError."""
    old = KINDS.get(kind.name)
    if old is not None and old.owner != kind.owner:
        raise ConfigError(f"{kind.owner} emits a subgraph named {kind.name!r}, which {old.owner} already emits")
    KINDS[kind.name] = kind
    return kind


for _kind in (SubgraphKind(C.LOSS_GRAPH, LossOptions), SubgraphKind(C.PREDICT, PredictOptions),
              SubgraphKind(C.GRADIENTS, GradientsOptions),
              SubgraphKind(C.STATISTICS, StatisticsOptions), SubgraphKind(C.UPDATE_STATISTICS, StatisticsOptions),
              SubgraphKind(C.INVERSE_UPDATE, InverseOptions), SubgraphKind(C.POWER_UPDATE, PowerOptions),
              SubgraphKind(C.PRECONDITION, PreconditionOptions), SubgraphKind(C.MULTIPLY, MultiplyOptions)):
    register_kind(_kind)


def kind(name: str) -> SubgraphKind:
    """The registered kind `name`; ConfigError listing the kinds. Looking one up imports the
    optimizer plugins (they register their steps' kinds)."""
    if name not in KINDS:
        import kfac_compiler.optimizers  # noqa: F401  (registers the optimizers' kinds)
    if name not in KINDS:
        raise ConfigError(f"unknown subgraph {name!r}; choose one of {', '.join(KINDS)}")
    return KINDS[name]


@dataclass(frozen=True)
class Request:
    """Subgraph `name` with `options` (of its kind's type)."""

    name: str
    options: SubgraphOptions

    def resolve(self, settings: Settings) -> Request:
        return Request(self.name, self.options.resolve(settings))

    def key(self) -> str:
        """Stable, readable text of the request (the plan and the caches key on the Request
        itself)."""
        items = ",".join(f"{k}={v}" for k, v in sorted(self.options.to_json().items()))
        return f"{self.name}({items})"


def request(name: str, options: SubgraphOptions | None = None, **values: Any) -> Request:
    """The request for subgraph `name`: `options` of its kind's type, or keyword values of
    its options (None values take the defaults); ConfigError naming an unknown option."""
    typ = kind(name).options
    if options is not None:
        if type(options) is not typ or values:
            raise ConfigError(f"subgraph {name!r} takes {typ.__name__} options")
        return Request(name, options)
    fields = {f.name for f in dataclasses.fields(typ)}
    unknown = [k for k in values if k not in fields]
    if unknown:
        raise ConfigError(f"subgraph {name!r} has no option {unknown[0]!r}; its options are {sorted(fields)}")
    return Request(name, typ(**{k: v for k, v in values.items() if v is not None}))
