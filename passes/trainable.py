"""Pass: which float initializers are parameters, and which are constants (with a reason).

Exporters lift literals and buffers into initializers: attention scales, GELU's constants,
Pow exponents, ReLU6's Clip bounds, -inf / -3.4e38 mask fills, causal masks. Training them
is wrong (a trained Pow exponent sends GPT-2 to NaN in one step), so the trainable set is
decided by a documented rule (docs/frontend.md, "Parameters and constants"). A float
initializer that reaches the output is a CONSTANT (frozen, with its reason) when

  1. it holds a non-finite value (a mask fill such as -inf);
  2. it reaches the output only through non-learnable inputs: settings of an op (Clip's
     bounds, Pow's exponent, shapes, axes, pads, scales, indices, Dropout's ratio), the
     inputs of ops without a gradient (comparisons, Shape, ArgMax, ...), a Where condition,
     a Gemm's C with beta = 0, or anything whose only path is a non-float tensor;
  3. it has one element, every node using it is elementwise arithmetic (Add, Mul, Div, Pow,
     Max, Where, ...) or Expand (a zero initial state broadcast to the batch) and it is not a bias added to a MatMul / Gemm / Conv output: exporters
     lift Python scalars this way (a 1x1 weight, a bias of one unit or a PRelu slope stay
     parameters);
  4. it is a BatchNormalization running mean or variance;
  5. it is the scale of ones or the shift of zeros of an InstanceNormalization between two
     Reshapes: how exporters write torch's GroupNorm (the real affine follows as Mul/Add);
     with one group per channel the reshape back is a no-op an optimizer drops, and the
     InstanceNormalization after a Reshape is read by that per-channel Mul/Add directly.
  6. what it computes before meeting the data selects none of its elements (a mask built by
     scattering constants, then overwritten by Where), or is rotation tables (cos^2 + sin^2 = 1:
     rotary embeddings' tables or inverse frequencies): passes/input_free.py.

Everything else is a parameter. The config overrides either way: `exclude` freezes, `include`
restricts, `train` trains a parameter the rule froze (`exclude` wins over `train`).

A model exported by the torch bridge (kfac_compiler.torch) carries a manifest saying which
initializers are torch parameters; then it decides instead of the rule: exactly the torch
parameters (and their copies, which the front end ties to them) train, buffers and other
constants are frozen ("torch buffer NAME", "not a torch parameter"), a parameter is still
frozen when it holds non-finite values or reaches the output only through non-learnable inputs
(rules 1 and 2; rules 3, 5 and 6 are the heuristics the manifest replaces), and an initializer the
manifest calls ambiguous is left to the rule. The selectors apply on top as above.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from kfac_compiler.builder import live, outer_reads, subgraphs
from kfac_compiler.config import compile_patterns
from kfac_compiler.contract import TORCH_MANIFEST_KEY
from kfac_compiler.errors import ConfigError, UnsupportedOpError
from kfac_compiler.graph import FLOAT_TYPES, GraphView, source_holders
from kfac_compiler.oprules import find as find_rule
from kfac_compiler.passes.input_free import InputFree, input_free_reason

# Input slots that are an op's settings, never data to learn (beyond what the gradient
# rules already say: rules' `inputs` and nondiff ops are consulted too). Slots are 0-based.
SETTING_SLOTS: dict[str, tuple[int, ...]] = {
    "Clip": (1, 2), "Pow": (1,), "Where": (0,), "Reshape": (1,), "Expand": (1,), "Tile": (1,),
    "Slice": (1, 2, 3, 4), "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "ReduceSum": (1,), "ReduceMean": (1,),
    "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,), "ReduceL1": (1,), "ReduceL2": (1,),
    "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,), "Dropout": (1, 2), "Gather": (1,),
    "GatherElements": (1,), "GatherND": (1,), "ScatterND": (1,), "ScatterElements": (1,),
    "CumSum": (1,), "Trilu": (1,), "TopK": (1,), "OneHot": (0, 1, 2), "Range": (0, 1, 2),
    "ConstantOfShape": (0,), "BatchNormalization": (3, 4),
}
# Elementwise arithmetic: where exporters put the Python scalars they lift into initializers.
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Sum", "Mean", "Where", "Clip",
                "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Expand"}
_LINEAR_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose"}


class NothingToTrain(ConfigError):
    """No trainable parameter reaches the output (the front end adds what it knows of why)."""


@dataclass(frozen=True)
class TrainableSet:
    """The split of the float initializers that reach the output, in initializer order."""

    trainable: list[str]
    frozen: list[str]
    reasons: dict[str, str] = field(default_factory=dict)  # frozen name -> why


def slot_name(node: onnx.NodeProto, slot: int, opset: int) -> str:
    """`input 1 (min)`: the slot with the op schema's name for it when there is one."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
        formal = schema.inputs[min(slot, len(schema.inputs) - 1)].name
        return f"input {slot} ({formal})"
    except (onnx.defs.SchemaError, IndexError):  # custom domain or an op onnx does not know
        return f"input {slot}"


def _dead_slot(node: onnx.NodeProto, slot: int) -> str | None:
    """Why an input's value never reaches the output (None when it may): Gemm's C times beta
    = 0, which jax2onnx writes for jnp.dot(x, W) with a dummy zero C; its gradient is 0."""
    if node.op_type == "Gemm" and not node.domain and slot == 2:
        beta = next((a.f for a in node.attribute if a.name == "beta"), 1.0)
        if beta == 0.0:
            return "multiplied by beta = 0"
    return None


def _learnable_slot(node: onnx.NodeProto, slot: int, opset: int) -> bool:
    if slot in SETTING_SLOTS.get(node.op_type, ()) and not node.domain:
        return False
    if _dead_slot(node, slot):
        return False
    rule = find_rule(node, opset)
    return rule is None or rule.diff_slot(slot)  # no rule: the autodiff pass reports the op


def _learnable_tensors(view: GraphView, output: str) -> set[str]:
    """Tensors on a path to `output` through learnable float slots only (an unknown element
    type, e.g. a sequence's, does not stop the path)."""
    learnable = {output}
    for node in reversed(view.nodes):  # nodes are in topological order
        if not any(o in learnable for o in node.output if o):
            continue
        for slot, name in enumerate(node.input):
            if name and _learnable_slot(node, slot, view.opset) and view.dtypes.get(name, 0) in (0, *FLOAT_TYPES):
                learnable.add(name)
        for sub in subgraphs(node):  # what an If/Loop/Scan body reads from here is on the path too
            learnable |= {n for n in outer_reads(sub) if view.dtypes.get(n, 0) in (0, *FLOAT_TYPES)}
    return learnable


def _check_outer_scope_reads(view: GraphView, trainable: list[str], learnable: set[str]) -> None:
    """Gradients do not flow into If/Loop/Scan bodies (the autodiff pass differentiates the
    node's inputs, and a body reads the enclosing graph's tensors by name): a body on the path to
    the output that reads a trainable parameter, or a tensor computed from one, would leave that
    parameter's gradient without the body's share. That is one line naming the node, the tensor
    and the parameter, not a silently frozen or wrong gradient."""
    origin = {p: p for p in trainable}  # tensor -> a trainable parameter it depends on
    for node in view.nodes:
        reads = [n for n in node.input if n] + [n for sub in subgraphs(node) for n in sorted(outer_reads(sub))]
        src = next((origin[n] for n in reads if n in origin), None)
        if src is not None:
            origin.update({o: src for o in node.output if o})
        if not any(o in learnable for o in node.output if o):
            continue
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):  # by name
                hit = next((n for n in sorted(outer_reads(sub)) if n in origin), None)
                if hit is not None:
                    param = origin[hit]
                    what = "is a trainable parameter" if hit == param else f"is computed from the trainable parameter {param!r}"
                    raise UnsupportedOpError(
                        f"node {node.name!r} ({node.op_type}) reads {hit!r} inside its {attr.name} from the enclosing "
                        f"graph, and {hit!r} {what}: gradients do not flow into If/Loop/Scan bodies; freeze {param!r} "
                        f"(exclude = [{param!r}], CLI --exclude {param}) or export the model without control flow")



def _is_literal(view: GraphView, name: str) -> bool:
    """Every use is elementwise arithmetic, none adds it to a linear op's output (a bias)."""
    for node in view.consumers.get(name, []):
        if node.op_type not in _ELEMENTWISE or node.domain:
            return False
        if node.op_type == "Add":
            others = [view.producer.get(n) for n in node.input if n != name]
            if any(p is not None and p.op_type in _LINEAR_OPS for p in others):
                return False
    return True


def _group_norm_placeholder(view: GraphView, name: str) -> str | None:
    """Rule 5: exporters write torch's GroupNorm as InstanceNormalization over the input
    reshaped to [N, groups, -1] with a scale of ones and a shift of zeros (one element for
    GroupNorm(1), one per group otherwise), reshape back and apply the GroupNorm's own weight
    and bias as Mul/Add. Those placeholders are constants: `name` is one when every use is
    such a node's scale or shift, the node's scale is all ones and its shift all zeros, and
    the node reads a Reshape and is read only by Reshapes."""
    uses = view.consumers.get(name, [])
    if not uses:
        return None
    for node in uses:
        if node.op_type != "InstanceNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
            return None
        scale, shift = (view.constant_value(t) for t in node.input[1:3])
        producer = view.producer.get(node.input[0])
        readers = view.consumers.get(node.output[0], [])
        if (name not in node.input[1:3] or scale is None or shift is None or not np.all(scale == 1)
                or not np.all(shift == 0) or producer is None or producer.op_type != "Reshape" or not readers):
            return None
        if any(r.op_type != "Reshape" for r in readers) and not _affine_follows(view, node, scale.size):
            return None
    what = "unit scale" if name == uses[0].input[1] else "zero shift"
    back = all(r.op_type == "Reshape" for r in view.consumers[uses[0].output[0]])
    where = "between Reshapes" if back else "after a Reshape, before a per-channel Mul/Add"
    return (f"constant: the {what} of InstanceNormalization {uses[0].name!r} {where} (an exporter's "
            "GroupNorm; its own weight and bias follow as Mul/Add)")


def _affine_follows(view: GraphView, node: onnx.NodeProto, channels: int) -> bool:
    """GroupNorm(C, C) (one group per channel, e.g. Wav2Vec2's feature extractor): the
    reshape back to the input's shape is a no-op the exporter's optimizer drops, so the
    InstanceNormalization's only reader is the GroupNorm's own affine, Mul then Add by
    `channels`-element tensors computed without the data. A real InstanceNorm reads the
    activations themselves (no Reshape before it), and one that does read a Reshape with a
    per-channel affine after its own would be two affines in a row."""
    t = node.output[0]
    for op in ("Mul", "Add"):
        readers = view.consumers.get(t, [])
        if len(readers) != 1 or readers[0].op_type != op or list(readers[0].input).count(t) != 1:
            return False
        other = next(i for i in readers[0].input if i != t)
        shape = view.shape(other)
        if other in view.from_inputs or shape is None or not all(isinstance(d, int) for d in shape) \
                or int(np.prod(shape, dtype=np.int64)) != channels:
            return False
        t = readers[0].output[0]
    return True


def constant_reason(view: GraphView, name: str, learnable: set[str], literals: bool = True) -> str | None:
    """Why the float initializer `name` is a constant under the rule, or None (a parameter);
    literals=False skips rules 3 and 5 (a single value in elementwise arithmetic, a GroupNorm's
    placeholder scale or shift: the heuristics a torch manifest replaces)."""
    value = view.array(name)
    if value.size and not np.all(np.isfinite(value)):
        return "constant: holds non-finite values (a mask fill such as -inf)"
    if name not in learnable:
        for node in view.consumers.get(name, []):
            for slot, n in enumerate(node.input):
                if n == name:
                    dead = _dead_slot(node, slot)
                    return (f"constant: reaches the output only through non-learnable inputs "
                            f"({node.op_type} {node.name!r} {slot_name(node, slot, view.opset)}"
                            f"{', ' + dead if dead else ''})")
        return "constant: reaches the output only through non-learnable inputs"
    if literals and value.size == 1 and _is_literal(view, name):
        return "constant: a single value in elementwise arithmetic (a literal the exporter lifted)"
    return _group_norm_placeholder(view, name) if literals else None


def torch_roles(model: onnx.ModelProto) -> dict[str, dict[str, Any]] | None:
    """{initializer: its manifest entry} from the torch bridge's manifest (None without one);
    the lowered pieces of a fused recurrent weight, and a weight folded from the exporter's
    run-time assembly of torch tensors, get their source's entry (the first source's)."""
    props = {p.key: p.value for p in model.metadata_props}
    if TORCH_MANIFEST_KEY not in props:
        return None
    roles = dict(json.loads(props[TORCH_MANIFEST_KEY]).get("initializers", {}))
    for orig, holders in source_holders(model).items():
        if orig in roles:
            for holder in holders:
                roles.setdefault(holder, roles[orig])
    return roles


def untrained_torch_parameters(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """(torch parameters whose initializers the canonical `model` dropped: not on the path to
    its output, e.g. another output's head; torch parameters in no initializer of the export:
    unused by its forward, or folded into constants), from the bridge's manifest; neither is
    trained, and load_trained leaves both as the module has them."""
    props = {p.key: p.value for p in model.metadata_props}
    if TORCH_MANIFEST_KEY not in props:
        return [], []
    manifest = json.loads(props[TORCH_MANIFEST_KEY])
    kept = set(torch_roles(model) or {}) & {t.name for t in model.graph.initializer}
    dropped = [n for init, e in manifest.get("initializers", {}).items()
               if e.get("role") == "parameter" and "copy_of" not in e and init not in kept
               for n in ([e["torch"]] if "torch" in e else [b[0] for b in e.get("blocks", [])]) + e.get("merged", [])]
    return sorted(set(dropped)), list(manifest.get("unmapped", []))


def torch_copies(model: onnx.ModelProto, trainable: list[str]) -> dict[str, tuple[str, bool]]:
    """{copy: (its parameter's initializer, transposed)} among `trainable`, from the manifest:
    an exporter's second initializer of one torch parameter (its transpose, a folded copy; a copy
    in another shape, a folded Unsqueeze, is not retied and trains apart)."""
    roles = torch_roles(model) or {}
    keep = set(trainable)
    out = {}
    for name in trainable:
        e = roles.get(name, {})
        of = e.get("copy_of")
        if e.get("role") == "parameter" and of in keep and of not in out and not e.get("reshaped"):
            out[name] = (of, bool(e.get("transposed")) != bool(roles[of].get("transposed")))
    return out


def _manifest_reason(entry: dict[str, Any] | None, rule: Any) -> str | None:
    """Why a float initializer is frozen under the torch manifest (None: trained); `rule()` is
    the constants rule's reason without rule 3."""
    entry = entry or {}
    role = entry.get("role")
    if role == "parameter":
        names = entry.get("torch") or entry["blocks"][0][0]
        if entry.get("frozen"):
            return f"torch parameter {names} has requires_grad=False"
        why = rule()
        return f"torch parameter {names}, but {why}" if why else None
    if role == "buffer":
        return f"torch buffer {entry['torch']}"
    if role == "constant":
        return "not a torch parameter (a constant of the export)"
    return None


def split_trainable(
    model: onnx.ModelProto,
    output: str,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    train: list[str] | None = None,
    view: GraphView | None = None,
) -> TrainableSet:
    """Parameters and constants among the float initializers that reach `output`.

    A bad regex, an include/exclude/train entry matching no initializer, or nothing left to
    train is a ConfigError.
    """
    view = view or GraphView(model)
    reach = live(view.nodes, [output])[1]
    candidates = [t.name for t in model.graph.initializer if t.data_type in FLOAT_TYPES and t.name in reach]
    running: dict[str, str] = {}
    for node in view.nodes:
        if node.op_type == "BatchNormalization":
            for i in list(node.input)[3:5]:
                if i:
                    running[i] = f"BatchNormalization {node.name!r} running statistic"
    learnable = _learnable_tensors(view, output)
    selectors = {key: (list(pats or []), compile_patterns(list(pats or []), key))
                 for key, pats in (("include", include), ("exclude", exclude), ("train", train))}
    used = {key: [False] * len(pats) for key, (pats, _) in selectors.items()}

    def hit(key: str, name: str) -> str | None:
        pats, rxs = selectors[key]
        first = None
        for i, (p, rx) in enumerate(zip(pats, rxs)):
            if name == p or rx.fullmatch(name) is not None:
                used[key][i] = True
                first = first or p
        return first

    roles = torch_roles(model)
    free: InputFree | None = None  # rule 6's tables, built on first need
    trainable, frozen, reasons = [], [], {}
    for name in candidates:
        excluded, forced, included = hit("exclude", name), hit("train", name), hit("include", name)
        entry = roles.get(name) if roles is not None else None
        if entry is not None and entry.get("role") in ("parameter", "buffer", "constant"):
            reason = _manifest_reason(entry, lambda n=name: constant_reason(view, n, learnable, literals=False))
        else:
            reason = running.get(name) or constant_reason(view, name, learnable)
            if reason is None:
                free = free or InputFree(view, lambda node, slot: _learnable_slot(node, slot, view.opset))
                reason = input_free_reason(free, name)
        if reason is not None and forced:
            reason = None
        if reason is None and include is not None and not included:
            reason = "not selected by include"
        if excluded:
            reason = f"excluded by config (exclude {excluded!r})"
        if reason is None:
            trainable.append(name)
        else:
            frozen.append(name)
            reasons[name] = reason
    for key, (pats, _) in selectors.items():
        for p, u in zip(pats, used[key]):
            if not u:
                raise ConfigError(
                    f"{key}: {p!r} matches no float initializer reaching {output!r} "
                    f"(initializers: {', '.join(candidates[:12])}{', ...' if len(candidates) > 12 else ''})"
                )
    _check_outer_scope_reads(view, trainable, learnable)
    if not trainable:
        raise NothingToTrain(f"no trainable parameters reach {output!r} after include/exclude and the constants rule "
                          f"(frozen: {', '.join(f'{n}: {reasons[n]}' for n in frozen[:4])}); "
                          "train a constant with the config's train list (CLI --train)")
    return TrainableSet(trainable, frozen, reasons)


def trainable_params(model: onnx.ModelProto, output: str, include: list[str] | None = None,
                     exclude: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(trainable, frozen) names: `split_trainable` without the reasons."""
    split = split_trainable(model, output, include, exclude)
    return split.trainable, split.frozen


__all__ = ["SETTING_SLOTS", "NothingToTrain", "TrainableSet", "constant_reason", "split_trainable", "torch_copies", "torch_roles",
           "trainable_params"]
