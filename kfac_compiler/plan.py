"""The plan: the contract between the compiler and the runtime.

A plan directory holds plan.json (schema below, docs/frontend.md), model.onnx (the canonical
model) and one <name>.onnx per emitted subgraph. `Plan.save(dir)` is atomic: it writes a
temporary directory next to the target and swaps it into place, carrying over the files of the
folder that are not the plan's; it refuses a non-empty directory that is not a plan (no
plan.json) unless asked. `load_plan(dir)` refuses another schema version and a plan whose
source model file changed since compiling.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper

from kfac_compiler.config import EstimatorConfig, InverseConfig, StatsConfig
from kfac_compiler.contract import TARGETS, SubgraphInfo
from kfac_compiler.errors import ConfigError, PlanError, one_line, os_errors, os_reason
from kfac_compiler.graph import GraphView, fold_recurrent_params, held_elsewhere, source_holders, split_source_params
from kfac_compiler.ir import FactorSpec, Layer, LayerUse
from kfac_compiler.losses import Loss, make_loss
from kfac_compiler.onnx_files import (
    has_data_on_disk,
    inside,
    load_onnx,
    pointing_into,
    tensor_array,
    write_onnx,
)
from kfac_compiler.parsing import nesting_checked
from kfac_compiler.plan_schema import SUBGRAPH_NAME, check_document, check_plan

if TYPE_CHECKING:
    import numpy as np

    from kfac_compiler.requests import Request

SCHEMA_VERSION = 1
PLAN_FILE = "plan.json"
MODEL_FILE = "model.onnx"
MODEL_DATA_FILE = "model.onnx.data"  # its external data, for a model over 1 GiB


@functools.cache
def _default_options_cached(cls: type) -> tuple[tuple[str, Any], ...]:
    try:
        return tuple(cls().to_json().items())
    except TypeError:  # a plugin's options type without defaults for every field
        return ()


def _default_options(cls: type) -> dict[str, Any]:
    """The JSON of an options type's defaults ({} where it has none for some field)."""
    return dict(_default_options_cached(cls))


# ------------------------------------------------------------------------------ plan sections
@dataclass
class LossSpec:
    """The loss the plan trains: its kind (a registered loss), the kind's options (e.g.
    squared_error's variance) and, when the source graph ended in a loss op, which one."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    recognised_from: str | None = None
    recognised_node: str | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # an option left at None (its default: "off", e.g. ignore_index) is not recorded, so
        # that a plan's entry, and its checkpoints' fingerprint, stay what they were before
        # the option existed (from_json reads a missing option as its default)
        self.options = {k: v for k, v in self.options.items() if v is not None}

    def to_json(self) -> dict[str, Any]:
        """plan.json's loss entry (its layout predates this class: checkpoints fingerprint it;
        the "variance" slot, squared_error's option, is written as null for the other kinds)."""
        doc = {"kind": self.kind, "variance": None, **_jsonable(self.options), "recognised_from": self.recognised_from}
        if self.recognised_from is not None:
            doc.update(recognised_node=self.recognised_node, notes=list(self.notes))
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LossSpec:
        named = ("kind", "recognised_from", "recognised_node", "notes")
        options = {k: v for k, v in doc.items() if k not in named and v is not None}
        return cls(doc["kind"], options, doc.get("recognised_from"), doc.get("recognised_node"),
                   list(doc.get("notes") or []))

    def build(self) -> Loss:
        """The loss object (its class from the registry, with these options)."""
        return make_loss(self.kind, **self.options)


@dataclass
class TensorSpec:
    """A data tensor of the plan: the model's inputs, and the targets (which may come from a
    model input the compiler cut off with the loss: `from_input`)."""

    name: str
    shape: list[Any] | None
    dtype: str | None
    from_input: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {"name": self.name, "shape": self.shape, "dtype": self.dtype}
        if self.name == TARGETS:
            doc["from_input"] = self.from_input
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TensorSpec:
        return cls(doc["name"], doc.get("shape"), doc.get("dtype"), doc.get("from_input"))


@dataclass
class Schedule:
    """The training schedule the plan was compiled with (the optimizer's defaults)."""

    ema_decay: float = 0.9
    damping: float = 1e-3
    inverse: InverseConfig = field(default_factory=InverseConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Schedule:
        return cls(doc.get("ema_decay", 0.9), doc.get("damping", 1e-3), InverseConfig(**doc.get("inverse", {})),
                   StatsConfig(**doc.get("stats", {})))


@dataclass
class Plan:
    """Everything the back end and the runtime need, in memory.

    `factors[layer name]` lists the block's FactorSpecs (None when the block class was not
    available at compile time). `subgraphs` / `subgraph_info` hold the stored subgraphs by
    file stem ("kfac_step", "kfac_step-2", ...), each info with its kind and resolved options
    (kfac_compiler.compile with emit=True stores those a default run requests; see
    `stored_subgraph`); save() adds each one's file, inputs and outputs to plan.json. The
    Fisher block objects are the back end's: kfac_compiler.blocks.plan_blocks(plan).
    """

    model: onnx.ModelProto
    output: str
    loss: LossSpec
    inputs: list[TensorSpec]
    targets: TensorSpec
    trainable: list[str]
    frozen: list[str]
    layers: list[Layer]
    factors: dict[str, list[FactorSpec] | None] = field(default_factory=dict)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    schedule: Schedule = field(default_factory=Schedule)
    dtype: str = "float32"
    source_path: str | None = None
    source_sha256: str = ""
    source_external: dict[str, list[int]] = field(default_factory=dict)  # external_signature at compile
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    subgraphs: dict[str, onnx.ModelProto] = field(default_factory=dict)
    subgraph_info: dict[str, SubgraphInfo] = field(default_factory=dict)
    # frozen initializer -> why it is not trained (the constants rule, include/exclude, ...)
    frozen_reasons: dict[str, str] = field(default_factory=dict)
    # an exporter's copy of a parameter (no initializer in the plan's model) -> the parameter
    # it is computed from, and whether as its transpose (passes/untie.py, retie)
    retied: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the cost-aware choice's prediction at its reference batch (passes/budget.py): totals in
    # FLOPs per step / update / refresh, the chosen periods, and per layer its BlockCost
    costs: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # the folder load_plan read it from (not stored): its files are the plan's, no output's
    folder: str | None = None

    # ------------------------------------------------------------ lookups
    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every initializer of the canonical model."""
        return {t.name: tuple(int(d) for d in t.dims) for t in self.model.graph.initializer}

    @property
    def inverse(self) -> InverseConfig:
        """The inverse schedule: method, update_period, damping_split."""
        return self.schedule.inverse

    @property
    def source_hash(self) -> str:
        """Alias of source_sha256."""
        return self.source_sha256

    @property
    def loss_recognised_from(self) -> str | None:
        """The loss op found at the end of the source graph (None: the loss kind was given)."""
        return self.loss.recognised_from

    @property
    def data_inputs(self) -> list[onnx.ValueInfoProto]:
        """The model's graph inputs that are not initializers (the user's data)."""
        inits = {t.name for t in self.model.graph.initializer}
        return [vi for vi in self.model.graph.input if vi.name not in inits]

    def parameter_values(self) -> dict[str, np.ndarray]:
        """The trainable parameters' initial values (copies of the model's initializers)."""
        inits = {t.name: t for t in self.model.graph.initializer}
        missing = [p for p in self.trainable if p not in inits]
        if missing:
            raise PlanError(f"trainable parameter {missing[0]!r} is not an initializer of the plan's model")
        return {p: tensor_array(inits[p]).copy() for p in self.trainable}

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named {name!r}; layers: {', '.join(l.name for l in self.layers)}")

    def view(self) -> GraphView:
        return GraphView(self.model)

    # ------------------------------------------------------------ stored subgraphs
    def _stem(self, request: Request) -> str | None:
        """The file stem stored under the resolved `request` (same kind and options), or None."""
        want = request.options.to_json()
        # an option added since the graph was stored is absent from its entry: its default
        # (the behaviour before the option existed) is what the graph was emitted with
        defaults = _default_options(type(request.options))
        return next((stem for stem, info in self.subgraph_info.items()
                     if (info.kind or stem) == request.name and {**defaults, **info.options} == want), None)

    def stored_subgraph(self, request: Request) -> tuple[onnx.ModelProto, SubgraphInfo] | None:
        """The stored graph of the resolved `request` (same kind and resolved options), or None."""
        stem = self._stem(request)
        return (self.subgraphs[stem], self.subgraph_info[stem]) if stem in self.subgraphs else None

    def store_subgraph(self, request: Request, model: onnx.ModelProto, info: SubgraphInfo) -> str:
        """Keep `model` as the graph of the resolved `request` (replacing one stored under the
        same request); returns its file stem."""
        stem = self._stem(request)
        if stem is None:
            stem, n = request.name, 1
            while stem in self.subgraphs or stem in self.subgraph_info:
                n += 1
                stem = f"{request.name}-{n}"
        self.subgraphs[stem] = model
        self.subgraph_info[stem] = dataclasses.replace(info, kind=request.name, options=request.options.to_json())
        return stem

    def holders(self, initializer: str) -> list[str]:
        """The initializers of the plan's model holding a SOURCE model initializer: itself, the
        parameter an exporter's copy is retied to, a fused recurrent op's lowered pieces, or
        the initializer (or its pieces) folded from an exporter's run-time assembly of it."""
        if initializer in self.retied:
            return [self.retied[initializer]["of"]]
        return self.source_holders().get(initializer) or [initializer]

    def source_holders(self) -> dict[str, list[str]]:
        """{source initializer the plan's model replaced: its holders} (graph.source_holders:
        the records passes/recurrent.py and passes/fold_params.py keep in the model's metadata)."""
        return source_holders(self.model)

    def holders_of_pieces(self) -> set[str]:
        """The plan model's initializers that hold pieces of source initializers it replaced
        (lowered recurrent weights, folded assemblies)."""
        return {h for holders in self.source_holders().values() for h in holders}

    def source_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """{source model initializer: value} from `values` keyed by the plan model's
        initializers (trained parameters, running statistics): an exporter's retied copy from
        its parameter (transposed back where it was), a fused recurrent op's W/R/B assembled
        from their lowered pieces, the others by name. Source initializers with no value in
        `values` are left out; so are untied copies (the source has their original only)."""
        out = {name: v for name, v in fold_recurrent_params(self.model, values).items()}
        for name, value in values.items():
            out.setdefault(name, value)
        for copy, rec in self.retied.items():
            if rec["of"] in values:
                out[copy] = values[rec["of"]].T if rec.get("transposed") else values[rec["of"]]
        return out

    def source_trainable(self) -> dict[str, tuple[int, ...]]:
        """{trainable initializer of the user's model: its shape there}: `trainable` (the
        plan's own layout, what its graphs read) with each parameter that holds pieces of
        source initializers (held_elsewhere: lowered recurrent weights, folded assemblies,
        re-laid-out views) replaced by those sources, in the order of `trainable`. An
        exporter's copy the plan ties to its original (`retied`) is not listed: it is the
        original."""
        return self._source_trainable(held_elsewhere(self.model))

    def _source_trainable(self, held: Mapping[str, dict]) -> dict[str, tuple[int, ...]]:
        """source_trainable with graph.held_elsewhere's answer `held` given."""
        of: dict[str, list[str]] = {}
        for src, h in held.items():
            for holder in h["holders"]:
                of.setdefault(holder, []).append(src)
        shapes = self.param_shapes
        out: dict[str, tuple[int, ...]] = {}
        for p in self.trainable:
            for src in of.get(p, []):
                out.setdefault(src, tuple(held[src]["shape"]))
            if p not in of:
                out[p] = shapes[p]
        return out

    def to_source_layout(self, values: dict[str, Any]) -> dict[str, Any]:
        """The trainable parameters `values` (keyed by `trainable`, the plan's layout) in the
        user's names and shapes (source_trainable); a source some of whose elements a frozen
        initializer holds takes those from the plan's model."""
        frozen = {t.name: t for t in self.model.graph.initializer
                  if t.name in self.holders_of_pieces() and t.name not in values}
        whole = self.source_values({**{n: tensor_array(t) for n, t in frozen.items()}, **values})
        return {name: whole[name] for name in self.source_trainable()}

    def to_plan_layout(self, values: Mapping[str, Any], current: dict[str, Any]) -> dict[str, Any]:
        """The inverse of to_source_layout for the parameters `values` gives (names of
        source_trainable, the user's shapes), keyed by `trainable`: each source's elements
        copied into the plan initializers that hold them, the rest of those initializers from
        `current` (the plan-layout values now). A name or shape of the plan's own layout, or
        one the model does not train, is a one-line ConfigError."""
        held = held_elsewhere(self.model)
        shapes = self._source_trainable(held)
        for name, v in values.items():
            if name not in shapes:
                sources = [s for s, h in held.items() if name in h["holders"]]
                if name in self.trainable and sources:
                    raise ConfigError(f"{name!r} is a name in the plan's layout (it holds {sources[0]!r} "
                                      f"{list(shapes.get(sources[0], held[sources[0]]['shape']))} of your model); give "
                                      f"{sources[0]!r} or pass layout='plan'")
                raise ConfigError(f"{name!r} is not a trainable parameter of the model "
                                  f"(e.g. {', '.join(list(shapes)[:3])}; Plan.source_trainable lists them)")
            got = np.shape(v)
            if name in held and tuple(got) != tuple(shapes[name]):
                hint = " (the plan's shape: pass layout='plan')" if tuple(got) == self.param_shapes.get(name) else ""
                raise ConfigError(f"parameter {name!r} has shape {list(shapes[name])} in your model; got {list(got)}{hint}")
        plan_values = split_source_params(self.model, {k: np.asarray(v) for k, v in values.items()}, current)
        trainable = set(self.trainable)
        return {k: v for k, v in plan_values.items() if k in trainable}

    def frozen_reason(self, name: str) -> str:
        """Why the frozen initializer `name` is not trained."""
        return self.frozen_reasons.get(name, "frozen")

    def totals(self) -> dict[str, Any]:
        shapes = self.param_shapes
        factor_bytes = 0
        n_factors = 0
        unknown = []
        for layer in self.layers:
            specs = self.factors.get(layer.name)
            if specs is None:
                unknown.append(layer.name)
                continue
            factor_bytes += sum(s.nbytes for s in specs)
            n_factors += len(specs)
        by_kind: dict[str, int] = {}
        for layer in self.layers:
            by_kind[layer.kind] = by_kind.get(layer.kind, 0) + 1
        return {
            "layers": len(self.layers),
            "layers_by_kind": by_kind,
            "trainable_params": len(self.trainable),
            "frozen_params": len(self.frozen),
            "param_elements": int(sum(math.prod(shapes[p]) for p in self.trainable)),
            # coverage: the parameter elements in layers of a structured kind (not generic)
            "structured_elements": int(sum(math.prod(shapes[p]) for layer in self.layers if layer.kind != "generic"
                                           for p in layer.params)),
            "factors": n_factors,
            "factor_bytes": int(factor_bytes),
            "layers_without_factors": unknown,
        }

    # -------------------------------------------------------------- json
    def layer_json(self, layer: Layer) -> dict[str, Any]:
        specs = self.factors.get(layer.name)
        return {
            "name": layer.name,
            "kind": layer.kind,
            "pattern": layer.pattern,
            "params": list(layer.params),
            "uses": [{"nodes": list(u.nodes), "input": u.input, "output": u.output} for u in layer.uses],
            "attrs": _jsonable(layer.attrs),
            "approximation": layer.approximation,
            "factors": None if specs is None else [factor_json(s) for s in specs],
            "notes": list(layer.notes),
        }

    def to_json(self) -> dict[str, Any]:
        """The plan.json document (without the subgraph file entries save() adds)."""
        return {
            "schema_version": self.schema_version,
            "source": {"path": self.source_path, "sha256": self.source_sha256,
                       **({"external": self.source_external} if self.source_external else {})},
            "model": MODEL_FILE,
            "output": self.output,
            "loss": self.loss.to_json(),
            "inputs": [i.to_json() for i in self.inputs],
            "targets": self.targets.to_json(),
            "trainable": list(self.trainable),
            "frozen": list(self.frozen),
            "frozen_reasons": {name: self.frozen_reason(name) for name in self.frozen},
            "retied": {name: dict(v) for name, v in self.retied.items()},
            "costs": _jsonable(self.costs),
            "layers": [self.layer_json(l) for l in self.layers],
            "estimator": dataclasses.asdict(self.estimator),
            "schedule": self.schedule.to_json(),
            "dtype": self.dtype,
            "totals": self.totals(),
            "config": _jsonable(self.config),
            "notes": list(self.notes),
            "subgraphs": {name: self._subgraph_json(name) for name in self.subgraphs},
        }

    def _subgraph_json(self, name: str) -> dict[str, Any]:
        """{file, inputs, outputs, reads, writes (state slots), info (the SubgraphInfo)}."""
        info = self.subgraph_info.get(name) or SubgraphInfo()
        writes = list(dict.fromkeys(info.state_outputs.values()))
        return {"file": f"{name}.onnx", **_io_json(self.subgraphs[name]), "reads": list(info.state_inputs),
                "writes": writes, "info": _jsonable(info.to_json())}

    # -------------------------------------------------------------- save
    def save(self, path: str | os.PathLike, overwrite: bool = False) -> str:
        """Write the plan folder atomically (kfac_compiler.atomic.replace_folder: a kill at any
        moment leaves the old plan or the new one); returns its absolute path. Re-saving a plan
        replaces only the plan's own files, the others in its folder stay. A non-empty folder
        that is not a plan is refused unless `overwrite`: the plan's files are then written into
        it one by one (each atomically, plan.json last), replacing those of the same names; the
        plan's source model is never replaced."""
        from kfac_compiler.atomic import remove_stale, replace_folder, write_file

        target = os.path.abspath(os.fspath(path))
        for name in self.subgraphs:
            if not SUBGRAPH_NAME.match(name) or name in ("model", "plan"):
                raise PlanError(f"subgraph name {name!r} cannot be a file name in a plan directory")
        files = [PLAN_FILE, MODEL_FILE, *(f"{name}.onnx" for name in self.subgraphs)]
        if has_data_on_disk(self.model):  # a model over 1 GiB: its values beside it, not inside
            files.insert(2, MODEL_DATA_FILE)
        real = os.path.realpath(target)
        check_plan_target(target, overwrite)
        # what the save writes or drops, and model.onnx.data, which a later save of the folder drops
        touched = {os.path.realpath(os.path.join(real, f)) for f in {*files, MODEL_DATA_FILE, *plan_files(real)}}
        if any(os.path.realpath(p) in touched for _, p in plan_inputs(self.source_path, None, touched)):
            raise PlanError(f"saving the plan to {target!r} would overwrite its source model {self.source_path!r} "
                            "or its external data; save it to another folder")
        doc = self.to_json()

        regions: dict[str, tuple[int, int]] = {}

        def fill_one(file: str, out, folder: str) -> None:
            if file == PLAN_FILE:
                out.write((json.dumps(doc, indent=1) + "\n").encode("utf-8"))
            elif file == MODEL_FILE:
                regions.update(write_onnx(self.model, out, os.path.join(folder, MODEL_DATA_FILE), MODEL_DATA_FILE))
            else:  # after MODEL_FILE: a frozen value of the model left on disk names its copy in MODEL_DATA_FILE
                out.write(pointing_into(self.subgraphs[file[:-len(".onnx")]], regions, MODEL_DATA_FILE).SerializeToString())

        written = [f for f in files[1:] + files[:1] if f != MODEL_DATA_FILE]  # plan.json last; the data with the model

        def fill(tmp: str) -> None:
            for f in written:
                with open(os.path.join(tmp, f), "wb") as out:
                    fill_one(f, out, tmp)
                    out.flush()
                    os.fsync(out.fileno())

        try:
            if os.path.isdir(real) and _plan_doc(real) is None and os.listdir(real):
                # overwrite: the folder is the user's, not swapped; plan.json last makes it a plan
                for f in written:
                    remove_stale(os.path.join(real, f))
                    write_file(os.path.join(real, f), functools.partial(fill_one, f, folder=real))
            else:
                replace_folder(real, fill, set(files) | plan_files(real))
        except OSError as e:
            raise PlanError(f"cannot write the plan to {target!r}: {os_reason(e, writing=True)}") from None
        return target


def check_plan_target(path: str | os.PathLike, overwrite: bool = False) -> None:
    """PlanError unless `path` may receive a plan: new, an empty folder, a plan folder, or with
    `overwrite` any folder (the command line checks this before compiling)."""
    target = os.path.abspath(os.fspath(path))
    real = os.path.realpath(target)
    if os.path.exists(real):
        if not os.path.isdir(real):
            raise PlanError(f"cannot save the plan to {target!r}: it is a file")
        if _plan_doc(real) is None and os.listdir(real) and not overwrite:
            raise PlanError(f"refusing to overwrite {target!r}: it is a non-empty directory that is not a plan "
                            f"(no {PLAN_FILE} of ours); give an empty or new folder, or pass overwrite=True (--force)")


def _plan_doc(folder: str) -> dict | None:
    """The folder's plan.json if it is one of ours (schema_version, source, layers), else None:
    another tool's plan.json does not make the folder ours to swap or clean."""
    try:
        with open(os.path.join(folder, PLAN_FILE), encoding="utf-8") as f:
            doc = nesting_checked(lambda: json.load(f))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    ours = (isinstance(doc, dict) and isinstance(doc.get("schema_version"), int)
            and isinstance(doc.get("source"), dict) and isinstance(doc.get("layers"), list))
    return doc if ours else None


def plan_source(folder: str) -> str | None:
    """The path of the model the plan in `folder` was compiled from, as its plan.json records
    it (load_plan reads it to tell a stale plan), or None (no plan of ours, no source)."""
    doc = _plan_doc(folder)
    path = doc["source"].get("path") if doc is not None else None
    return path if isinstance(path, str) and path else None


def plan_inputs(source: str | None, folder: str | None, written: Iterable[str]) -> list[tuple[str, str]]:
    """(what, path) of the files a plan reads that no output may overwrite, for the command
    line (outputs.model_inputs) and the API (input_problem) alike: the model it was compiled
    from, the plan folder it was loaded from (standing for its files, plan_files) and the
    external-data files of either's model, looked up only where one of `written` (the real
    paths of existing file outputs) lies in that model's folder (reading a big model's graph
    costs a second)."""
    from kfac_compiler.onnx_files import external_files

    found: list[tuple[str, str]] = []
    models = []
    if source and os.path.isfile(source):
        found.append(("plan's source model", source))
        models.append(source)
    if folder:
        found.append(("plan folder", folder))
        if os.path.isfile(os.path.join(folder, MODEL_FILE)):  # a plan of a model over 1 GiB keeps its values beside
            models.append(os.path.join(folder, MODEL_FILE))
    written = list(written)
    for path in models:
        home = os.path.dirname(os.path.realpath(path))
        if any(w.startswith(home + os.sep) for w in written):
            found += [(f"external data of {path!r}", data) for data in external_files(path)]
    return found


def input_problem(plan: Plan, path: str | os.PathLike) -> str | None:
    """What of `plan`'s inputs (plan_inputs) an API output at `path` would overwrite, as a
    phrase; None where nothing. The command line checks the same inputs (outputs.model_inputs)."""
    real = os.path.realpath(path)
    for what, read in plan_inputs(plan.source_path, plan.folder, [real] if os.path.isfile(real) else []):
        if os.path.isdir(read):
            if os.path.dirname(real) == os.path.realpath(read) and os.path.basename(real) in plan_files(read):
                return f"a file of the plan folder {read!r}"
        elif os.path.exists(read) and os.path.realpath(read) == real:
            return f"{read!r}, the {what}"
    return None


def plan_files(folder: str) -> set[str]:
    """The names of the files the plan in `folder` (if any) consists of, by its plan.json
    (its model's external data included): what a save replaces and no output may overwrite."""
    doc = _plan_doc(folder)
    if doc is None:
        return set()
    try:
        own = {PLAN_FILE, MODEL_FILE, MODEL_DATA_FILE, os.path.basename(str(doc.get("model", MODEL_FILE)))}
        own |= {os.path.basename(str(e.get("file", f"{n}.onnx"))) for n, e in doc.get("subgraphs", {}).items()}
        return own
    except (AttributeError, TypeError):
        return set()


def factor_json(s: FactorSpec) -> dict[str, Any]:
    return {"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "role": s.role, "bytes": s.nbytes}


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def external_signature(model_path: str | os.PathLike) -> dict[str, list[int]]:
    """{file name: [size, mtime in ns]} of the external-data files of the model at
    `model_path` ({} without any): its weights can change while the .onnx, which holds only
    their locations, stays the same byte for byte (a re-export of trained weights). Sizes and
    times, not hashes: a model with external data is large."""
    from kfac_compiler.onnx_files import external_files

    folder = os.path.dirname(os.path.realpath(model_path))
    out = {}
    for path in external_files(model_path):
        st = os.stat(path)
        out[os.path.relpath(path, folder)] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


def source_change(path: str, sha256: str, external: Mapping[str, Sequence[int]] | None) -> str | None:
    """How the source model at `path` (which exists) differs from the one a plan was compiled
    from (its sha256 and external-data signature then), or None."""
    now = file_sha256(path)
    if now != sha256:
        return f"its source model {path!r} changed since it was compiled (sha256 {sha256[:12]} then, {now[:12]} now)"
    if external:
        current = external_signature(path)
        for name, then in external.items():
            if current.get(name) != list(then):
                return (f"its source model's external data {name!r} (beside {path!r}) changed since it was compiled "
                        f"({'gone' if name not in current else 'its size or modification time'})")
    return None


def load_plan(path: str | os.PathLike, check_source: bool = True) -> Plan:
    """Read a plan directory; PlanError if missing, unreadable, not of plan.json's schema
    (plan_schema.py), naming a file outside the directory, of another schema version or stale."""
    if not isinstance(path, (str, os.PathLike)):
        raise PlanError(f"load_plan expects a plan directory path, got {type(path).__name__}")
    path = os.fspath(path)
    pj = os.path.join(path, PLAN_FILE)
    if os.path.isfile(path):
        hint = f": compile it first (kfac-compiler compile {path} -o PLAN_DIR)" if path.endswith(".onnx") else ""
        raise PlanError(f"{path!r} is a file, not a plan directory{hint}")
    if not os.path.isdir(path):
        raise PlanError(f"plan directory {path!r} does not exist")
    if not os.path.isfile(pj):
        raise PlanError(f"{path!r} is not a plan directory (no {PLAN_FILE})")
    try:
        with os_errors(PlanError, "the plan file", pj, writing=False), open(pj, encoding="utf-8") as f:
            doc = nesting_checked(lambda: json.load(f))
    except (ValueError, UnicodeDecodeError) as e:
        raise PlanError(f"{pj!r} is not valid JSON ({' '.join(str(e).split())})") from None
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if version != SCHEMA_VERSION:
        raise PlanError(
            f"plan {path!r} has schema version {version!r}; this kfac_compiler reads version {SCHEMA_VERSION}: "
            "recompile the model"
        )
    check_document(doc, pj)
    source = doc["source"]
    src_path, src_hash = source.get("path"), source.get("sha256", "")
    external = {k: list(v) for k, v in source.get("external", {}).items()}
    if check_source and src_path and os.path.isfile(src_path):
        with os_errors(PlanError, "the plan's source model", src_path, writing=False):
            change = source_change(src_path, src_hash, external)
        if change is not None:
            raise PlanError(f"plan {path!r} is stale: {change}; recompile")
    model = _load_onnx(_plan_file(path, pj, "model", doc.get("model", MODEL_FILE)), path)
    layers, factors = [], {}
    for ld in doc["layers"]:
        layer = Layer(
            name=ld["name"],
            kind=ld["kind"],
            params=tuple(ld["params"]),
            uses=tuple(LayerUse(tuple(u["nodes"]), u["input"], u["output"]) for u in ld["uses"]),
            attrs=_tuples(ld.get("attrs", {})),
            approximation=ld.get("approximation"),
            pattern=ld.get("pattern", ""),
            notes=tuple(ld.get("notes", ())),
        )
        layers.append(layer)
        fs = ld.get("factors")
        factors[layer.name] = (
            None
            if fs is None
            else [FactorSpec(f["name"], tuple(f["shape"]), f.get("dtype", "float32"), f.get("role", "")) for f in fs]
        )
    subgraphs, info = {}, {}
    for name, entry in doc.get("subgraphs", {}).items():
        file = _plan_file(path, pj, f"subgraphs.{name}.file", entry.get("file", f"{name}.onnx"))
        subgraphs[name] = _load_onnx(file, path)
        try:
            info[name] = SubgraphInfo.from_json(entry.get("info", {}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"{pj!r}: subgraphs.{name}.info is malformed ({one_line(e)}); recompile") from None
    estimator, schedule = doc.get("estimator", {}), doc.get("schedule", {})
    plan = Plan(
        model=model,
        output=doc["output"],
        loss=LossSpec.from_json(doc["loss"]),
        inputs=[TensorSpec.from_json(i) for i in doc["inputs"]],
        targets=TensorSpec.from_json(doc["targets"]),
        trainable=list(doc["trainable"]),
        frozen=list(doc["frozen"]),
        frozen_reasons=dict(doc.get("frozen_reasons", {})),
        retied=dict(doc.get("retied", {})),
        costs=dict(doc.get("costs", {})),
        layers=layers,
        factors=factors,
        estimator=EstimatorConfig(**estimator),
        schedule=Schedule.from_json(schedule),
        dtype=doc.get("dtype", "float32"),
        source_path=src_path,
        source_sha256=src_hash,
        source_external=external,
        config=doc.get("config", {}),
        notes=list(doc.get("notes", [])),
        subgraphs=subgraphs,
        subgraph_info=info,
        schema_version=version,
        folder=os.path.realpath(path),
    )
    check_plan(plan, pj)
    return plan


def _plan_file(plan_dir: str, pj: str, key: str, name: str) -> str:
    """The file plan.json names under `key`: inside the plan directory, and present."""
    file = inside(plan_dir, name)
    if file is None:
        raise PlanError(f"{pj!r}: {key}: {name!r} is not a file inside the plan directory; recompile the model")
    if not os.path.isfile(file):
        raise PlanError(f"plan {plan_dir!r} is incomplete: {name!r} is missing")
    return file


def _load_onnx(file: str, plan_dir: str) -> onnx.ModelProto:
    """An ONNX file of the plan, its external data (if any) read from the plan directory only."""
    try:
        with os_errors(PlanError, f"plan {plan_dir!r}: file", file, writing=False):
            return load_onnx(file, lambda outside: PlanError(
                f"plan {plan_dir!r}: {os.path.basename(file)!r} names external data {outside[0]!r} outside the plan "
                "directory; recompile the model"))
    except (DecodeError, ValueError, RuntimeError, UnicodeDecodeError, onnx.checker.ValidationError) as e:
        raise PlanError(f"plan {plan_dir!r}: {os.path.basename(file)!r} is unreadable ({type(e).__name__}); "
                        "recompile the model") from None


def value_spec(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    """{name, shape, dtype} of a ValueInfo (dims: int, symbolic name or None); see tensor_spec."""
    t = vi.type.tensor_type
    shape = None
    if t.HasField("shape"):
        shape = []
        for d in t.shape.dim:
            shape.append(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None))
    try:
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else None
    except (KeyError, ValueError, TypeError):
        dtype = onnx.TensorProto.DataType.Name(t.elem_type).lower()
    return {"name": vi.name, "shape": shape, "dtype": dtype}


def tensor_spec(vi: onnx.ValueInfoProto) -> TensorSpec:
    return TensorSpec(**value_spec(vi))


def _io_json(model: onnx.ModelProto) -> dict[str, Any]:
    g = model.graph
    inits = {t.name for t in g.initializer}
    return {
        "inputs": [value_spec(v) for v in g.input if v.name not in inits],
        "outputs": [value_spec(v) for v in g.output],
    }


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):  # numpy scalars
        return x.item()
    if isinstance(x, bytes):
        return x.decode()
    return x


def _tuples(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x
