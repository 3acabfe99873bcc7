"""The compiler front end: ONNX file -> inspectable Plan (layers, blocks, factor shapes).

    load/validate -> recognise loss -> canonicalize -> trainable params -> match layers
    -> link params -> choose blocks -> factor specs -> Plan

`compile_frontend` composes the passes of kfac_compiler.passes; each can be run alone.
Warnings raised by the passes are re-emitted and recorded in `plan.notes`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from typing import Any

import onnx
from onnx import TensorProto

from kfac_compiler.blocks import APPROXIMATIONS, BLOCKS, make_block, menu_key
from kfac_compiler.config import CompileConfig, load_config
from kfac_compiler.contract import TARGETS, reserved_prefix
from kfac_compiler.errors import ConfigError, KfacError, ModelError, UnsupportedOpError
from kfac_compiler.graph import SOURCE_FLOAT_KEY, GraphView, float_types, fresh_name, with_float_type
from kfac_compiler.ir import FactorSpec, Layer
from kfac_compiler.losses import Loss, loss_class, loss_kinds
from kfac_compiler.losses.heads import MULTI_HEAD
from kfac_compiler.passes.batch_axis import example_axis_notes, with_example_axes
from kfac_compiler.passes.budget import REFERENCE_BATCH, STATS_BATCH, BudgetResult, estimator_passes, fit_budget
from kfac_compiler.passes.canonicalize import canonicalize, recognise_loss
from kfac_compiler.passes.choose_blocks import choose_blocks, pinned_layers
from kfac_compiler.passes.heads import attach_heads
from kfac_compiler.passes.link_params import link_params
from kfac_compiler.passes.load import check_output, load_model, validate_model
from kfac_compiler.passes.match_layers import match_layers
from kfac_compiler.passes.trainable import (
    NothingToTrain,
    TrainableSet,
    split_trainable,
    torch_copies,
    torch_roles,
    untrained_torch_parameters,
)
from kfac_compiler.passes.untie import find_copies, report_shared, retie, select_untie, shared_params, untie
from kfac_compiler.patterns.builtin import normalization_fallback_notes
from kfac_compiler.plan import (
    LossSpec,
    Plan,
    Schedule,
    TensorSpec,
    external_signature,
    file_sha256,
    tensor_spec,
    value_spec,
)


def compile_frontend(
    model_path_or_proto: str | os.PathLike | onnx.ModelProto,
    loss: str | None = None,
    output: str | None = None,
    config: CompileConfig | dict | str | os.PathLike | None = None,
    **overrides: Any,
) -> Plan:
    """Compile a model (file path or ModelProto) into a Plan without subgraphs.

    `loss`: a registered loss kind (kfac_compiler.losses), its options from
    config.loss_options; may be None when the graph ends in a recognised loss op (or
    config.loss is set). `output`: the tensor the loss applies to (default: config.output,
    else the only graph output). `overrides` set config keys (e.g. damping=1e-2,
    estimator={"mode": "empirical"}) on top of `config`.

    Several loss heads with coefficients: `heads=[Head(output, loss, coefficient, targets),
    ...]` (or tuples, dicts; config key `heads`) instead of `loss` and `output`.
    """
    cfg = apply_overrides(load_config(config), overrides)
    loss = loss if loss is not None else cfg.loss
    output = output if output is not None else cfg.output
    if not isinstance(loss, (str, type(None))):
        raise ConfigError(f"loss must be one loss kind name, got {type(loss).__name__}; several losses go in "
                          "heads=[(output, loss kind, coefficient, targets name), ...]")
    if not isinstance(output, (str, type(None))):
        raise ConfigError(f"output must be one tensor name, got {type(output).__name__}; several outputs go in "
                          "heads=[(output, loss kind, coefficient, targets name), ...]")
    if cfg.heads and (loss is not None or output is not None):
        raise ConfigError("give either heads or a loss and output, not both (each head names its output and loss)")
    if loss is not None:
        loss_class(loss)  # an unknown kind fails before the model is read
    checked_output = cfg.heads[0]["output"] if cfg.heads else output

    if isinstance(model_path_or_proto, onnx.ModelProto):
        model = model_path_or_proto
        source = "<model>"
        validate_model(model, checked_output, source=source)
        source_path = None
        source_hash = hashlib.sha256(model.SerializeToString()).hexdigest()
        source_external: dict[str, list[int]] = {}
    elif isinstance(model_path_or_proto, (str, os.PathLike)):
        source = os.fspath(model_path_or_proto)
        model = load_model(source, checked_output)
        source_path = os.path.abspath(source)
        source_hash = file_sha256(source_path)
        source_external = external_signature(source_path)
    else:
        raise ModelError(f"expected a model file path or an onnx.ModelProto, got {type(model_path_or_proto).__name__}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _compile(model, source, source_path, source_hash, source_external, loss, output, cfg)
    for w in caught:
        msg = str(w.message)
        if msg not in plan.notes:
            plan.notes.append(msg)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return plan


def apply_overrides(cfg: CompileConfig, overrides: dict[str, Any]) -> CompileConfig:
    """A copy of `cfg` with top-level keys replaced (nested tables merged), validated."""
    if not overrides:
        return cfg
    data = cfg.to_dict()
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict) and key in ("estimator", "inverse", "stats", "budget"):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return CompileConfig.from_dict(data, source="compile options")


def _compile(model, source, source_path, source_hash, source_external, loss, output, cfg: CompileConfig) -> Plan:
    heads = None
    if cfg.heads:
        model, output, heads = attach_heads(model, cfg.heads, source)
        loss = MULTI_HEAD
    output = check_output(model, output, source)
    rec = recognise_loss(model, output) if heads is None else None
    recognised: dict[str, Any] = {}
    recognised_options: dict[str, Any] = {}
    target_input = None
    if rec is not None:
        if loss is not None and loss != rec.kind:
            raise ConfigError(
                f"{source!r} ends in a {rec.op} loss ({rec.kind}) at {output!r}, but loss {loss!r} was given; "
                f"drop the loss option or pass --output {rec.scores}"
            )
        loss = rec.kind
        output = rec.scores
        target_input = rec.target_input
        recognised_options = dict(rec.options)
        recognised = {"recognised_from": rec.op, "recognised_node": rec.node, "notes": list(rec.notes)}
    elif loss is None:
        raise ConfigError(
            f"no loss given for {source!r} and the graph does not end in a recognised loss op; "
            f"pass a loss kind ({', '.join(loss_kinds())})"
        )
    cls = loss_class(loss)
    if heads is not None:
        if cfg.loss_options:
            raise ConfigError(f"loss_options {sorted(cfg.loss_options)} apply to the plan's only loss; with several "
                              "heads give each head's options in its [[heads]] table")
        given = {"heads": heads}
    else:
        given = {**recognised_options, **cfg.loss_options_for(cls)}
    loss_fn = cls(**cls.resolve_options(given, where="loss_options: "))

    model, float_note = _as_float32(model, source)
    canon = canonicalize(model, output)
    if float_note:
        canon.metadata_props.add(key=SOURCE_FLOAT_KEY, value=float_note[0])
    _name_running_outputs(canon)
    _refuse_reserved_names(canon, source)
    view = GraphView(canon)
    out_shape = view.shape(output)
    out_vi = canon.graph.output[0]
    if out_shape is not None and len(out_shape) == 0:
        raise ModelError(
            f"{source!r}: output {output!r} is a scalar; name the model's prediction (the scores the loss is "
            "applied to) with --output"
        )
    problem = loss_fn.output_problem(out_shape) if out_shape is not None else None
    if problem:
        raise ModelError(f"{source!r}: output {output!r} has shape {list(out_shape)}; {problem}")
    if rec is not None and rec.op == "SoftmaxCrossEntropyLoss" and out_shape is not None and len(out_shape) > 2:
        raise UnsupportedOpError(
            f"{source!r}: SoftmaxCrossEntropyLoss {rec.node!r} takes classes on axis 1 of a rank-{len(out_shape)} "
            "score tensor; kfac_compiler expects the class axis last: export the scores with classes last"
        )
    if not view.is_float(output) and output in view.dtypes and view.dtypes[output]:
        raise ModelError(f"{source!r}: output {output!r} is not a float tensor")
    scored = [(h["output"], h["loss"]) for h in heads] if heads is not None else [(output, loss)]
    for note in _linked_output_notes(view, scored, heads is not None):
        warnings.warn(note, stacklevel=2)

    plan_notes: list[str] = [float_note[1]] if float_note else []
    inputs_note = _unbatched_inputs_note(view)
    if inputs_note:
        warnings.warn(inputs_note, stacklevel=2)
    try:
        split = split_trainable(canon, output, cfg.include, cfg.exclude, cfg.train, view=view)
    except NothingToTrain as e:  # the warning would be lost with the plan: say it here
        raise NothingToTrain(f"{e}; {inputs_note}" if inputs_note else str(e)) from None
    if torch_roles(canon) is not None:
        plan_notes.append("torch manifest (kfac_compiler.torch.export): the trainable set is the module's parameters, "
                          "buffers and other constants are frozen; inspect lists the torch names in the frozen reasons")
        dropped, unmapped = untrained_torch_parameters(canon)
        for names, why in ((dropped, f"not on the path to output {output!r}"),
                           (unmapped, "in no initializer of the export (unused by its forward, or folded into constants)")):
            if names:
                plan_notes.append(f"torch parameters {', '.join(names[:6])}{', ...' if len(names) > 6 else ''} "
                                  f"({len(names)}) are {why}: not trained, load_trained leaves them as they are")
    canon, view, split, exporter_copies = _repair_ties(canon, view, split, cfg, plan_notes)
    if split.frozen:
        plan_notes.append(f"{len(split.frozen)} initializers frozen (not trained); inspect lists each with its reason")
    trainable, frozen = split.trainable, split.frozen
    matches = match_layers(canon, trainable, view=view)
    layers = link_params(matches, trainable, cfg.links, view=view)
    pinned = pinned_layers(layers, cfg)
    layers = choose_blocks(layers, cfg)
    for note in normalization_fallback_notes(view, layers):
        warnings.warn(note, stacklevel=2)

    layers = with_example_axes([_with_input_shape(layer, view) for layer in layers], view)
    shapes = {t.name: tuple(int(d) for d in t.dims) for t in canon.graph.initializer}
    budget = _fit_budget(layers, pinned, shapes, view, cfg, out_shape)
    layers = budget.layers
    plan_notes.extend(budget.notes)
    for note in example_axis_notes(layers, view, lambda layer: _block_of(layer, shapes, view)):
        warnings.warn(note, stacklevel=2)  # printed by the CLI, recorded in plan.notes
    factors: dict[str, list[FactorSpec] | None] = {}
    for layer in layers:
        factors[layer.name] = _factor_specs(layer, shapes, input_shapes(layer, view), cfg, plan_notes)

    targets = _targets_spec(loss_fn, value_spec(out_vi), target_input)
    inits = {t.name for t in canon.graph.initializer}
    for vi in canon.graph.input:  # steps feed data inputs by rows: a scalar one compiled, then refused every batch
        tt = vi.type.tensor_type
        if vi.name not in inits and tt.HasField("shape") and not tt.shape.dim:
            raise ModelError(f"{source!r}: input {vi.name!r} is a scalar (shape []); training feeds data inputs by "
                             "rows of examples: give it a batch axis, or make it an initializer if it is fixed")

    return Plan(
        model=canon,
        output=output,
        loss=LossSpec(loss, loss_fn.option_values(), **recognised),
        inputs=[tensor_spec(vi) for vi in canon.graph.input],
        targets=targets,
        trainable=trainable,
        frozen=frozen,
        frozen_reasons=dict(split.reasons),
        retied={c: {"of": o, "transposed": t} for c, (o, t) in exporter_copies.items()},
        layers=layers,
        factors=factors,
        estimator=dataclasses.replace(cfg.estimator),
        schedule=Schedule(cfg.ema_decay, cfg.damping,
                          dataclasses.replace(cfg.inverse, update_period=budget.inverse_period),
                          dataclasses.replace(cfg.stats, update_period=budget.stats_period)),
        dtype=cfg.dtype,
        source_path=source_path,
        source_sha256=source_hash,
        source_external=source_external,
        config=cfg.to_dict(),
        notes=plan_notes,
        costs=budget.costs,
    )


def _unbatched_inputs_note(view: GraphView) -> str | None:
    """Float graph inputs without the batch axis the other inputs have (a static shape while
    another input has a symbolic dim): jax2onnx's f(x, W, b) form writes the parameters as
    such inputs, which the plan takes for data fed with every batch, and nothing of theirs
    is trained (compile said nothing)."""
    inputs = [vi.name for vi in view.model.graph.input if vi.name not in view.initializers]
    shapes = {n: view.shape(n) for n in inputs}
    batched = [n for n, s in shapes.items() if s is not None and any(not isinstance(d, int) for d in s)]
    static = [n for n, s in shapes.items() if s is not None and all(isinstance(d, int) for d in s) and view.is_float(n)]
    if not batched or not static:
        return None
    listed = ", ".join(f"{n!r} {list(shapes[n] or ())}" for n in static[:6]) + (", ..." if len(static) > 6 else "")
    return (f"float graph inputs {listed} have no batch axis (a static shape, where {batched[0]!r} has "
            f"{list(shapes[batched[0]] or ())}): they are treated as data, fed with every batch and not trained; "
            "if they are the model's parameters (jax2onnx's f(x, W, b) form), make them initializers holding their "
            "values (export with the parameters closed over) and compile again")


def _refuse_reserved_names(model: onnx.ModelProto, source: str) -> None:
    """A tensor named like the runtime contract's names (`hp/damping`, `velocity/W`,
    `noise/0`, ...) would meet the emitted graphs' own inputs, slots and results: compiling
    wrote graphs that onnx.checker and ONNX Runtime refuse."""
    g = model.graph
    for name in [*(i.name for i in g.input), *(t.name for t in g.initializer), *(o for n in g.node for o in n.output)]:
        clash = reserved_prefix(name)
        if clash is not None:
            raise ModelError(f"{source!r}: tensor {name!r} is named like the runtime's own {clash!r} "
                             "(docs/runtime_contract.md); rename it in the model before compiling")


def _linked_output_notes(view: GraphView, scored: list[tuple[str, str]], heads: bool) -> list[str]:
    """A warning per loss applied to an output its own link op computes (Loss.link_op: every
    Keras classifier ending in Dense(k, activation="softmax") or "sigmoid"): the loss applies
    that op to the scores it is given, so it would train it twice (a perfect prediction of 4
    classes still scores 0.744), silently. It names the op's input to pass instead."""
    notes = []
    for output, kind in scored:
        node, op = view.producer.get(output), loss_class(kind).link_op
        if op is None or node is None or node.op_type != op or node.domain not in ("", "ai.onnx"):
            continue
        scores = node.input[0]
        how = (f"name {scores!r} as the head's output instead (--head {scores},{kind},...)" if heads else
               f"pass {scores!r} as the output instead (--output {scores}; output={scores!r} in the API)")
        notes.append(f"output {output!r} is computed by {op} node {node.name!r}: {kind} applies its own "
                     f"{op.lower()} to the scores it is given, so this trains a {op.lower()} of probabilities "
                     f"(a double {op.lower()}); {how}")
    return notes


def _as_float32(model: onnx.ModelProto, source: str) -> tuple[onnx.ModelProto, tuple[str, str] | None]:
    """A float16, bfloat16 or float64 model as a float32 one: every graph the compiler emits
    computes in float32 (master weights, factors, forward and backward), and ONNX Runtime's CPU
    provider lacks most float16/bfloat16 kernels. Returns the model and, when converted,
    (the source type's name, a plan note); Trainer.export converts the trained model back."""
    types = float_types(model) - {TensorProto.FLOAT}
    if not types:
        return model, None
    names = sorted(onnx.helper.tensor_dtype_to_np_dtype(t).name for t in types)
    uniform = len(types) == 1 and TensorProto.FLOAT not in float_types(model)
    kind = next(iter(types)) if uniform else TensorProto.FLOAT
    note = (f"{source!r} computes in {' and '.join(names)}: trained in float32 (weights, factors, forward and "
            f"backward); the trained model is exported in {onnx.helper.tensor_dtype_to_np_dtype(kind).name}")
    return with_float_type(model, TensorProto.FLOAT, types), (TensorProto.DataType.Name(kind), note)


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def _fit_budget(layers: list[Layer], pinned: set[str], shapes: dict, view: GraphView, cfg: CompileConfig,
                output_shape: Any = None) -> BudgetResult:
    """passes/budget.py on the chosen layers; layers whose block class is not available are
    skipped (their factors are unknown)."""
    from kfac_compiler.linalg import concrete_method

    known = [l for l in layers if _block_available(l.approximation, l.kind)]

    split = cfg.inverse.damping_split  # the plan's: its inverse state and products differ by split

    def make(layer: Layer):
        return make_block(layer, {p: shapes[p] for p in layer.params}, input_shapes(layer, view), damping_mode=split)

    def allowed(layer: Layer, approximation: str) -> bool:
        """On the layer's menu and buildable at the plan's split (exact damping takes no
        diagonal factor: the budget stepped a factor down to one, and compiling failed)."""
        if not _block_available(approximation, layer.kind):
            return False
        try:
            make(dataclasses.replace(layer, approximation=approximation))
        except ConfigError:
            return False
        return True

    result = fit_budget(
        known, make, pinned, overhead=cfg.budget.overhead,
        batch_size=cfg.budget.batch_size or REFERENCE_BATCH,
        min_dim=cfg.budget.min_dim, stats_period=cfg.stats.update_period, inverse_period=cfg.inverse.update_period,
        method=concrete_method(cfg.inverse.method, "cpu"), allowed=allowed,
        memory_bytes=int(cfg.budget.memory_gb * 1e9) if cfg.budget.memory_gb else physical_memory(),
        menu=lambda l: APPROXIMATIONS.get(menu_key(l.kind, l.num_uses), ()),
        backward_passes=estimator_passes(cfg.estimator.mode, cfg.estimator.num_samples, output_shape, STATS_BATCH,
                                         cfg.budget.batch_size or REFERENCE_BATCH),
    )
    result.costs["damping_split"] = split  # what the layers' "inverse" FLOPs assume
    chosen = {l.name: l for l in result.layers}
    result.layers = [chosen.get(l.name, l) for l in layers]
    return result


def _name_running_outputs(model: onnx.ModelProto) -> None:
    """Give every training-mode BatchNormalization all three outputs, named: ONNX Runtime
    (1.31) rejects the node with fewer and crashes on unnamed ones, and the training steps
    read the running statistics from them (kfac_compiler.backend.emission)."""
    taken = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    taken |= {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        if not any(a.name == "training_mode" and a.i for a in node.attribute):
            continue
        while len(node.output) < 3:
            node.output.append("")
        for i, suffix in ((1, "running_mean"), (2, "running_var")):
            if not node.output[i]:
                node.output[i] = fresh_name(f"{node.name}/{suffix}", taken)


Copies = dict[str, tuple[str, bool]]  # an exporter's copy -> (the parameter, transposed)


def _repair_ties(canon: onnx.ModelProto, view: GraphView, split: TrainableSet, cfg: CompileConfig,
                 notes: list[str]) -> tuple[onnx.ModelProto, GraphView, TrainableSet, Copies]:
    """Retie an exporter's copies of one parameter, untie what `untie` names, report the other
    shared parameters (passes/untie.py); returns the model, its view, the trainable set and
    the retied copies."""
    manifest = torch_roles(canon) is not None  # the torch bridge's manifest names the copies
    exporter_copies = {}
    if cfg.retie:
        exporter_copies = torch_copies(canon, split.trainable) if manifest else find_copies(view, split.trainable)
    if exporter_copies:
        canon = retie(canon, exporter_copies)
        view = GraphView(canon)
        split = dataclasses.replace(split, trainable=[p for p in split.trainable if p not in exporter_copies])
        retied = "; ".join(f"{c} = {'Transpose(' + o + ')' if t else o}" for c, (o, t) in exporter_copies.items())
        notes.append(f"re-tied (an exporter's copies of one parameter, trained as one; retie = false keeps them "
                     f"apart): {retied}")
    shared = shared_params(view, split.trainable)
    to_untie = select_untie(cfg.untie, shared)
    if to_untie:
        canon, copies = untie(canon, shared, to_untie)
        view = GraphView(canon)
        trainable = [c for p in split.trainable for c in [p] + copies.get(p, [])]
        split = dataclasses.replace(split, trainable=trainable)
        notes.append("untied: " + "; ".join(f"{k} -> {', '.join([k] + v)}" for k, v in copies.items()))
    report_shared(shared, set(to_untie), notes)
    return canon, view, split, exporter_copies


def _targets_spec(loss: Loss, output: dict[str, Any], from_input: str | None) -> TensorSpec:
    """The plan's targets: shape and dtype as the loss derives them from the output's."""
    o_shape, o_dtype = output["shape"], output["dtype"] or "float32"
    t_shape = None if o_shape is None else list(loss.target_shape(tuple(o_shape)))
    return TensorSpec(TARGETS, t_shape, loss.target_dtype(o_dtype), from_input)


def input_shapes(layer: Layer, view: GraphView) -> list[tuple | None]:
    """Static shape of each use's input tensor (dims: int, symbolic name or None)."""
    return [view.shape(u.input) for u in layer.uses]


def _with_input_shape(layer: Layer, view: GraphView) -> Layer:
    """Record attrs["input_shape"] (the blocks' fallback) when every use has the same input shape."""
    shapes = {view.shape(u.input) for u in layer.uses}
    if len(shapes) != 1 or None in shapes:
        return layer
    return dataclasses.replace(layer, attrs={**layer.attrs, "input_shape": next(iter(shapes))})


def _block_available(name: str | None, kind: str) -> bool:
    try:
        from kfac_compiler.blocks.base import block_class
    except ImportError:  # older registry: one class per name
        cls = BLOCKS.get(name or "")
        return cls is not None and kind in cls.layer_kinds
    return block_class(name or "", kind) is not None


def _block_of(layer: Layer, shapes: dict, view: GraphView):
    """The layer's block (None when its class is not available)."""
    if not _block_available(layer.approximation, layer.kind):
        return None
    return make_block(layer, {p: shapes[p] for p in layer.params}, input_shapes(layer, view))


def _factor_specs(layer: Layer, shapes: dict, in_shapes: list, cfg: CompileConfig, notes: list[str]) -> list[FactorSpec] | None:
    """The block's factor specs, or None when its class is not available (recorded in notes)."""
    if not _block_available(layer.approximation, layer.kind):
        notes.append(f"layer {layer.name!r}: Fisher block {layer.approximation!r} for {layer.kind} is not available; factors unknown")
        return None
    # with the plan's damping split: a block that cannot take it (exact damping on a diagonal
    # factor) says so now, not at the first statistics run
    block = make_block(layer, {p: shapes[p] for p in layer.params}, in_shapes, damping_mode=cfg.inverse.damping_split)
    try:
        specs = list(block.factor_specs())
    except NotImplementedError:
        notes.append(f"layer {layer.name!r}: block {layer.approximation!r} does not list its factors")
        return None
    return specs


__all__ = ["compile_frontend", "KfacError"]
