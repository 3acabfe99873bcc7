"""A subgraph under construction (`Emission`): its inputs and outputs by contract name,
and the building blocks every emitter uses.

Each subgraph is a standalone ONNX model built from the canonical forward graph with the
trainable initializers turned into graph inputs, plus the nodes the emitter adds; `finish`
returns it with its SubgraphInfo (docs/runtime_contract.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import onnx
from onnx import TensorProto

from kfac_compiler import contract as C
from kfac_compiler.backend import factors, forward, head
from kfac_compiler.backend.dedupe import merge_duplicates
from kfac_compiler.backend.forward import ForwardPass
from kfac_compiler.backend.plan_parts import PlanParts
from kfac_compiler.backend.schedule import order_by_generation
from kfac_compiler.backend.shapes import DeclaredShapes
from kfac_compiler.blocks import FisherBlock, make_block
from kfac_compiler.blocks.gram import GramStatistic
from kfac_compiler.builder import GraphBuilder, subgraphs, value_info
from kfac_compiler.contract import SlotSpec, SubgraphInfo
from kfac_compiler.errors import ModelError, PlanError
from kfac_compiler.graph import GraphView
from kfac_compiler.oprules.conv import lower_forward
from kfac_compiler.passes.autodiff import jvp

FLOAT = TensorProto.FLOAT
T = TypeVar("T")
WEIGHTS = C.EXAMPLE_WEIGHTS  # the optional per-example loss weights input


@dataclass
class Emission:
    """A subgraph under construction: the forward graph with the parameters as inputs, plus
    the nodes its emitter adds. It is the API a subgraph emitter (kfac_compiler.backend's own
    and every optimizer plugin's) writes against: declare inputs and outputs by their
    contract names (data_input, hp, state_input, state_output, metric, result), build the
    loss, its gradients and forward passes (forward.py), the factor statistics and the
    preconditioner (factors.py), and `b`, the GraphBuilder, for everything else."""

    parts: PlanParts
    view: GraphView
    b: GraphBuilder
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    info: SubgraphInfo = field(default_factory=SubgraphInfo)
    blocks: dict[str, FisherBlock] = field(default_factory=dict)
    full: ForwardPass | None = None  # the whole batch's forward pass, set by loss_and_grads
    _sub_passes: dict[int, ForwardPass] = field(default_factory=dict)  # sub_batch_pass clones
    _weights: tuple[str, str] | None = None  # (w, sqrt w) of a weighted loss, shaped like the output
    reductions: list[tuple[str, Any]] = field(default_factory=list)  # reduce_mean's points, in order
    held: list[str] = field(default_factory=list)  # parameters outside the curvature (hold)
    shapes: DeclaredShapes | None = None  # the forward passes whose shapes finish declares (backend/shapes.py)

    # ------------------------------------------------------------- set-up
    @classmethod
    def start(cls, parts: PlanParts, float_type: int = FLOAT, conv_gather: bool = True) -> Emission:
        """A new subgraph of `parts`' forward graph; `conv_gather`: the Gather im2col forms of
        Conv may be used (oprules/conv.py)."""
        view = GraphView(parts.model)
        for name in C.RESERVED:
            if name in view.all_names():
                raise ModelError(f"the model already has a tensor named {name!r}; rename it before compiling")
        b = GraphBuilder(view.opset, prefix="kfac", taken=view.all_names(), float_type=float_type)
        b.conv_gather = conv_gather
        em = cls(parts, view, b, shapes=DeclaredShapes.of(view))
        for vi in parts.model.graph.input:
            if vi.name not in view.initializers:
                em.inputs.append(vi)
                em.info.data_inputs.append(vi.name)
        for p in parts.params:
            em.state_input(p, view.static_shape(p), "param")
        if parts.blocks is not None:
            em.blocks = dict(parts.blocks)
        else:
            shapes = {p: view.static_shape(p) for t in parts.layers for p in t.params}
            em.blocks = {
                layer.name: make_block(layer, shapes, [view.shape(u.input) for u in layer.uses])
                for layer in parts.layers
            }
        return em

    def keep_layers(self, layers: Sequence[str] | None) -> None:
        """The blocks of `layers` only (None: every block): the others' parameters held out
        (hold), as a statistics subgraph for K-FAC with parameter groups asks."""
        if layers is None:
            return
        unknown = sorted(set(layers) - {layer.name for layer in self.parts.layers})
        if unknown:
            raise PlanError(f"statistics: the plan has no layer {unknown[0]!r}")
        self.hold([p for layer in self.parts.layers if layer.name not in layers for p in layer.params])

    def hold(self, params: Sequence[str]) -> None:
        """Take `params` out of the curvature before anything is emitted: their layers leave
        parts.layers (no statistics, inverses or preconditioning) and they leave parts.params
        (no K-FAC update, velocity or quadratic-model terms; forward clones keep their
        values). They stay state inputs, and a step's gradients (optimizers.base's
        mean_loss_and_grads) still include theirs, so that an optimizer can update them by a
        rule of its own in the same graph (first-order parameter groups,
        optimizers/groups.py). A layer is held whole or not at all."""
        held = set(params)
        if not held:
            return
        for layer in self.parts.layers:
            if held & set(layer.params) and not set(layer.params) <= held:
                raise ValueError(f"hold: layer {layer.name!r} is held in part ({sorted(held & set(layer.params))})")
        self.held += [p for p in self.parts.params if p in held]
        self.parts = dataclasses.replace(
            self.parts, params=[p for p in self.parts.params if p not in held],
            layers=[layer for layer in self.parts.layers if not held & set(layer.params)])

    # --------------------------------------------------------- interfaces
    def data_input(self, name: str, elem_type: int, shape) -> str:
        self.inputs.append(value_info(name, elem_type, shape))
        self.info.data_inputs.append(name)
        return name

    def hp(self, name: str) -> str:
        """The float32 scalar input `name` (a contract name such as C.DAMPING, or a short name
        the optimizer owns: "beta1" is hp/beta1), declared on first use."""
        full = name if name.startswith(C.HP_PREFIX) else C.hp(name)
        if full not in self.info.hp_inputs:
            self.inputs.append(value_info(full, FLOAT, []))
            self.info.hp_inputs.append(full)
        return full

    def state_input(self, slot: str, shape: tuple, init: str) -> str:
        if slot not in self.info.state_specs:
            self.inputs.append(value_info(slot, self.b.float_type, list(shape)))
            self.info.state_inputs.append(slot)
            self.info.state_specs[slot] = SlotSpec(list(shape), "float32", init)
        return slot

    def state_output(self, slot: str, tensor: str) -> None:
        name = C.new(slot)
        self.b.identity(tensor, name)
        self.outputs.append(value_info(name, self.b.float_type, self.info.state_specs[slot].shape))
        self.info.state_outputs[name] = slot

    def metric(self, name: str, tensor: str) -> None:
        """Report scalar `tensor` as metric `name` (a contract name, or a short name:
        "alpha" is metric/alpha)."""
        full = name if name == C.LOSS or name.startswith(C.METRIC_PREFIX) else C.metric(name)
        self.b.identity(tensor, full)
        self.outputs.append(value_info(full, self.b.float_type, []))
        self.info.metrics.append(full)

    def result(self, name: str, tensor: str, elem_type: int | None = None) -> None:
        self.b.identity(tensor, name)
        self.outputs.append(value_info(name, elem_type or self.b.float_type, None))
        self.info.results.append(name)

    def _fold_output_identities(self) -> None:
        """Name emitted tensors after the graph outputs they feed instead of copying them
        through Identity nodes (each Identity to an output is a copy in ONNX Runtime)."""
        producer = {o: n for n in self.b.nodes for o in n.output}
        outputs = {vi.name for vi in self.outputs}
        # a reduction point's Identity stays: a data-parallel run cuts the graph there
        markers = {r for pairs in self.info.reductions.values() for r in pairs}
        rename: dict[str, str] = {}
        keep = []
        for node in self.b.nodes:
            src = node.input[0] if node.op_type == "Identity" else None
            if (src is not None and node.output[0] in outputs and src in producer
                    and src not in outputs and src not in rename and src not in markers):
                rename[src] = node.output[0]
                continue
            keep.append(node)
        for node in keep:
            _rename_uses(node, rename)
            for i, t in enumerate(node.output):
                if t in rename:
                    node.output[i] = rename[t]
        self.b.nodes = keep

    def running_statistics(self) -> None:
        """In a training step (a subgraph that writes the parameters): the running mean and
        variance of every training-mode BatchNormalization become state (slots named after
        their initializers, init "model": the plan's values) updated with the op's own
        running outputs on the whole batch, running = input * momentum + batch * (1 -
        momentum) (ONNX semantics; the variance is the biased batch variance). A rejected
        step leaves them as they were, like every slot. A micro-batch of an accumulation cycle
        (a subgraph that writes gradient sums) updates them too, as torch's forward in training
        mode does on every micro-batch. Other subgraphs read the model's initializers (a
        training-mode forward pass does not depend on them)."""
        params = set(self.parts.params) | set(self.held)
        if not any(slot in params or C.parse_slot(slot).kind == C.GRAD_ACCUM
                   for slot in self.info.state_outputs.values()):
            return
        for slot, tensor in running_stat_outputs(self.parts.model, params):
            self.state_input(slot, self.view.static_shape(slot), "model")
            self.state_output(slot, tensor)

    def finish(self, name: str) -> tuple[onnx.ModelProto, SubgraphInfo]:
        self.running_statistics()
        self._fold_output_identities()
        params = set(self.parts.params) | set(self.held)
        state = params | set(self.info.state_specs)
        base_inits = [t for t in self.parts.model.graph.initializer if t.name not in state]
        model = self.b.make_model(
            name,
            self.inputs,
            self.outputs,
            base_nodes=self._lowered_forward(params),
            base_initializers=base_inits,
            extra_opsets=self.parts.model.opset_import,
        )
        # the reductions' tensors are named in info: they keep their producers
        merge_duplicates(model.graph, [t for pairs in self.info.reductions.values() for pair in pairs.items()
                                       for t in pair])
        order_by_generation(model.graph)  # ONNX Runtime's setup sorts it ~90 times (backend.schedule)
        if self.shapes is not None:  # so that ONNX Runtime's planner can reuse buffers (backend/shapes.py)
            self.shapes.declare(model, self.b.shaped_like)
        made = {o for n in model.graph.node for o in n.output}
        for point, pairs in list(self.info.reductions.items()):  # less the points no output reads
            kept = {r: local for r, local in pairs.items() if r in made}
            if kept:
                self.info.reductions[point] = kept
            else:
                del self.info.reductions[point]
        return model, self.info

    def _lowered_forward(self, params: set[str]) -> list[onnx.NodeProto]:
        """The forward nodes, with each Conv whose weight is a parameter (a runtime input:
        ONNX Runtime's fast NCHWc kernels need constant weights) lowered where that pays
        (oprules.conv.lower_forward)."""
        out: list[onnx.NodeProto] = []
        for node in self.parts.model.graph.node:
            if node.op_type == "Conv" and node.domain in ("", "ai.onnx") and node.input[1] in params:
                mark = len(self.b.nodes)
                if lower_forward(self.b, self.view, node):
                    out += self.b.nodes[mark:]
                    del self.b.nodes[mark:]
                    continue
            out.append(node)
        return out

    # ------------------------------------------------------------ pieces
    @property
    def output(self) -> str:
        return self.parts.output

    def targets(self) -> str:
        loss = self.parts.loss
        out_shape = self.view.shape(self.output) or ()
        return self.data_input(C.TARGETS, loss.target_type(), list(loss.target_shape(tuple(out_shape))))

    def example_weights(self) -> tuple[str, str] | tuple[None, None]:
        """With parts.weighted: the "example_weights" input, shaped like the loss's
        weight_shape (per example [N], or per position: loss L = 1/N sum_n sum_t w_nt l_nt),
        as (w, sqrt(w)), each shaped to broadcast against the model output."""
        if not self.parts.weighted:
            return None, None
        if WEIGHTS not in self.info.data_inputs:
            loss = self.parts.loss
            out_shape = tuple(self.view.shape(self.output) or ("N",))
            shape = list(loss.weight_shape(tuple(loss.target_shape(out_shape))))
            self.data_input(WEIGHTS, self.b.float_type, shape)
            trailing = list(range(len(shape), len(out_shape)))  # the axes within a position
            w = self.b.unsqueeze(WEIGHTS, trailing) if trailing else WEIGHTS
            self._weights = (w, self.b.op("Sqrt", [w]))
        return cast("tuple[str, str]", self._weights)  # set with the input, above

    def reduce_mean(self, point: str, values: T) -> T:
        """A reduction point: `values` (tensor names, or dataclasses, dicts, lists of them)
        are means over this process's examples, which a data-parallel step replaces here by
        their means over all ranks. Each tensor passes through an Identity whose output the
        later nodes read; `info.reductions[point]` maps those outputs to the local tensors, so
        the runtime can cut the graph there (runtime/stages.py) while one process runs it
        fused. `reductions` records each point in order (optimizers/kfac/graph.py, STAGES)."""
        self.reductions.append((point, values))
        pairs = self.info.reductions.setdefault(point, {})

        marked = {local: reduced for reduced, local in pairs.items()}

        def mark(tensor: str) -> str:  # a tensor met twice (b1 is whole_b1 on the whole batch) once
            if tensor not in marked:
                marked[tensor] = self.b.op("Identity", [tensor], hint="reduced")
                pairs[marked[tensor]] = tensor
            return marked[tensor]

        return _map_tensors(values, mark)

    def reduce_through_state(self, point: str, values: T) -> T:
        """A reduction point whose values only feed moving averages of state slots (the factor
        statistics): the average is linear in them, so a data-parallel run averages the slots
        over the ranks where they are read (before an inverse refresh or a checkpoint) and
        the step itself has no cut here. Recorded in `reductions` like reduce_mean."""
        self.reductions.append((point, values))
        return values

    def zeros_like_param(self, p: str) -> str:
        return self.b.const(np.zeros(self.view.shapes[p]), hint="zeros")

    def finite(self, tensors: list[str]) -> str:
        """Bool scalar: every tensor (scalar) is finite: their sum s is, so s - s is 0 (NaN for
        an infinite or NaN s; two nodes where IsNaN, IsInf, Or and Not took four)."""
        total = self.b.sum(tensors)
        return self.b.op("Equal", [self.b.sub(total, total), self.b.const(0.0)])

    # ---------------------------------------------- forward passes (forward.py)
    def loss_and_grads(self, extra_wrt: Sequence[str] = ()) -> tuple[str, str, dict[str, str], dict[str, str]]:
        """Mean loss, batch size N, grads of the mean loss, and cotangents of `extra_wrt`."""
        return forward.loss_and_grads(self, extra_wrt)

    def sub_batch_pass(self, m: int | None) -> ForwardPass:
        """The forward pass on the whole batch (m = None) or on its first m examples."""
        return forward.sub_batch_pass(self, m)

    def clone_forward(self, prefix: str, substitutions: dict[str, str]):
        """A copy of the forward graph reading `substitutions`; (its view, renaming)."""
        return forward.clone_forward(self, prefix, substitutions)

    def jvp(self, fwd: ForwardPass, tangents: dict[str, str], outputs: list[str]) -> dict[str, str]:
        """Forward-mode products through pass `fwd`: {output: J tangents}."""
        return jvp(self.b, fwd.view, dict(tangents), outputs)

    def head_of(self, fwd: ForwardPass) -> onnx.NodeProto | None:
        """The node making z when it widens its inputs into a vocabulary's logits (head.py)."""
        return head.wide_head(fwd)

    def head_jvp(self, fwd: ForwardPass, node: onnx.NodeProto,
                 tangents: dict[str, str]) -> tuple[list[str | None], str]:
        """(the tangents of head `node`'s inputs along `tangents`, that of its output z)."""
        at = self.jvp(fwd, tangents, [x for x in node.input if x])
        return head.head_jvp(self.b, fwd, node, at)

    def head_vjp(self, fwd: ForwardPass, node: onnx.NodeProto, g: str, needs: list[bool]) -> list[str | None]:
        """Head `node`'s input cotangents for z's cotangent `g`."""
        return head.head_vjp(self.b, fwd, node, g, needs)

    # ---------------------------------------------- factors and preconditioning (factors.py)
    def layer_cotangent_targets(self) -> list[str]:
        return factors.layer_cotangent_targets(self)

    def batch_statistics(self, fwd: ForwardPass, mode: str, num_samples: int,
                         data_cots: dict[str, str] | None = None) -> dict[str, dict[str, str | GramStatistic]]:
        """One batch's factor estimates {layer: {factor: tensor or GramStatistic}} on `fwd`."""
        return factors.batch_statistics(self, fwd, mode, num_samples, data_cots)

    def factor_updates(self, fwd: ForwardPass, cots: dict, mode: str, num_samples: int, ok: list[str],
                       conditional: bool = False) -> None:
        """The factors' moving-average updates from this batch's statistics on pass `fwd`, as
        state outputs (inside an If on hp/update_stats with `conditional`); their finiteness
        terms are appended to `ok`."""
        write = factors.conditional_factor_updates if conditional else factors.write_factor_updates
        write(self, fwd, cots, mode, num_samples, ok)

    def precondition(self, grads: dict[str, str]) -> dict[str, str]:
        """(F + damping)^-1 g for every block, from the inverse state slots."""
        return factors.precondition(self, grads)


def running_stat_outputs(model: onnx.ModelProto, params: set[str]) -> list[tuple[str, str]]:
    """(initializer, output) pairs of the running statistics of the training-mode
    BatchNormalization nodes: input 3 (mean) -> output 1, input 4 (var) -> output 2, where
    the input is a float initializer that is not trained and the output is named."""
    inits = {t.name: t for t in model.graph.initializer}
    pairs: list[tuple[str, str]] = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        if not any(a.name == "training_mode" and a.i for a in node.attribute):
            continue
        for i, o in ((3, 1), (4, 2)):
            src = node.input[i] if i < len(node.input) else ""
            out = node.output[o] if o < len(node.output) else ""
            if src in inits and src not in params and out and src not in {p for p, _ in pairs}:
                if inits[src].data_type == TensorProto.FLOAT:
                    pairs.append((src, out))
    return pairs


def _rename_uses(node: onnx.NodeProto, rename: Mapping[str, str]) -> None:
    """Rename the tensors `node` reads, including outer-scope reads inside its subgraphs
    (If branches)."""
    for i, t in enumerate(node.input):
        if t in rename:
            node.input[i] = rename[t]
    for g in subgraphs(node):
        for inner in g.node:
            _rename_uses(inner, rename)
        for out in g.output:  # a branch may pass an outer tensor through
            if out.name in rename:
                out.name = rename[out.name]


def _map_tensors(values: Any, fn) -> Any:
    """`values` with every tensor name (str) replaced by fn(name): through dicts, lists,
    tuples and dataclasses, keeping their types (numbers and None as they are)."""
    if isinstance(values, str):
        return fn(values)
    if values is None or isinstance(values, (bool, int, float)):  # a field that is no tensor (GramStatistic's)
        return values
    if isinstance(values, dict):
        return {k: _map_tensors(v, fn) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return type(values)(_map_tensors(v, fn) for v in values)
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        return dataclasses.replace(values, **{f.name: _map_tensors(getattr(values, f.name), fn)
                                              for f in dataclasses.fields(values) if f.init})
    raise TypeError(f"reduce_mean: cannot reduce a {type(values).__name__}")
