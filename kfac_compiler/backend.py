"""The back end: emits the plan's subgraphs (training step, statistics, inverses, ...).

Each subgraph is a standalone ONNX model built from the canonical forward graph with the
trainable initializers turned into graph inputs, plus nodes emitted by the autodiff pass,
the loss, the estimator and the Fisher blocks. Names follow docs/runtime_contract.md, which
is what the runtime relies on; `info` describes the inputs, outputs and state slots.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from kfac_compiler.blocks import FisherBlock, make_block
from kfac_compiler.blocks._parts import GramStatistic, emit_statistic
from kfac_compiler import contract as C
from kfac_compiler import linalg
from kfac_compiler.builder import GraphBuilder, subgraphs, value_info
from kfac_compiler.contract import NoiseSpec, SlotSpec, SubgraphInfo
from kfac_compiler.errors import ConfigError, ModelError
from kfac_compiler.graph import GraphView
from kfac_compiler.ir import Layer
from kfac_compiler.losses import Loss, make_loss
from kfac_compiler.passes.autodiff import backward, jvp
from kfac_compiler.passes.estimator import emit_seeds, noise_spec

FLOAT = TensorProto.FLOAT
WEIGHTS = C.EXAMPLE_WEIGHTS  # the optional per-example loss weights input


@dataclass
class PlanParts:
    """What the back end needs from a plan, independent of the plan's storage format."""

    model: onnx.ModelProto
    output: str
    loss: Loss
    params: list[str]
    layers: list[Layer]
    mode: str = "gradients"
    num_samples: int = 1
    inverse_method: str = "auto"
    blocks: dict[str, FisherBlock] | None = None
    weighted: bool = False  # an "example_weights" [N] data input scales each example's loss
    damping_split: str = "pi"  # how the blocks split damping between Kronecker factors


def plan_parts(plan: "Plan | PlanParts") -> PlanParts:
    """Extract PlanParts from a kfac_compiler.plan.Plan (a PlanParts is returned as is)."""
    if isinstance(plan, PlanParts):
        return plan
    return PlanParts(
        model=plan.model,
        output=plan.output,
        loss=make_loss(plan.loss.kind, **plan.loss.options),
        params=list(plan.trainable),
        layers=list(plan.layers),
        mode=plan.estimator.mode,
        num_samples=int(plan.estimator.num_samples),
        inverse_method=plan.inverse.method,
        blocks=plan.blocks,
        damping_split=plan.inverse.damping_split,
    )


@dataclass
class Emission:
    """A subgraph under construction: the forward graph with params as inputs + new nodes."""

    parts: PlanParts
    view: GraphView
    b: GraphBuilder
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    info: SubgraphInfo = field(default_factory=SubgraphInfo)
    blocks: dict[str, FisherBlock] = field(default_factory=dict)
    _sub_passes: dict[int, "ForwardPass"] = field(default_factory=dict)  # sub_batch_pass clones

    # ------------------------------------------------------------- set-up
    @classmethod
    def start(cls, parts: PlanParts, float_type: int = FLOAT) -> "Emission":
        view = GraphView(parts.model)
        for name in C.RESERVED:
            if name in view.all_names():
                raise ModelError(f"the model already has a tensor named {name!r}; rename it before compiling")
        b = GraphBuilder(view.opset, prefix="kfac", taken=view.all_names(), float_type=float_type)
        em = cls(parts, view, b)
        for vi in parts.model.graph.input:
            if vi.name not in view.initializers:
                em.inputs.append(vi)
                em.info.data_inputs.append(vi.name)
        for p in parts.params:
            em.state_input(p, tuple(view.shapes[p]), "param")
        if parts.blocks is not None:
            em.blocks = dict(parts.blocks)
        else:
            shapes = {p: tuple(view.shapes[p]) for t in parts.layers for p in t.params}
            em.blocks = {
                layer.name: make_block(layer, shapes, [view.shape(u.input) for u in layer.uses])
                for layer in parts.layers
            }
        return em

    # --------------------------------------------------------- interfaces
    def data_input(self, name: str, elem_type: int, shape) -> str:
        self.inputs.append(value_info(name, elem_type, shape))
        self.info.data_inputs.append(name)
        return name

    def hp(self, name: str) -> str:
        full = C.hp(name)
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
        full = C.metric(name)
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
        rename: dict[str, str] = {}
        keep = []
        for node in self.b.nodes:
            src = node.input[0] if node.op_type == "Identity" else None
            if (src is not None and node.output[0] in outputs and src in producer
                    and src not in outputs and src not in rename):
                rename[src] = node.output[0]
                continue
            keep.append(node)
        for node in keep:
            _rename_uses(node, rename)
            for i, t in enumerate(node.output):
                if t in rename:
                    node.output[i] = rename[t]
        self.b.nodes = keep

    def finish(self, name: str) -> tuple[onnx.ModelProto, SubgraphInfo]:
        self._fold_output_identities()
        params = set(self.parts.params)
        base_inits = [t for t in self.parts.model.graph.initializer if t.name not in params]
        model = self.b.make_model(
            name,
            self.inputs,
            self.outputs,
            base_nodes=self.parts.model.graph.node,
            base_initializers=base_inits,
            extra_opsets=self.parts.model.opset_import,
        )
        return model, self.info

    # ------------------------------------------------------------ pieces
    @property
    def output(self) -> str:
        return self.parts.output

    def targets(self) -> str:
        loss = self.parts.loss
        out_shape = self.view.shape(self.output) or ()
        return self.data_input(C.TARGETS, loss.target_type(), list(loss.target_shape(tuple(out_shape))))

    def example_weights(self) -> tuple[str, str] | tuple[None, None]:
        """With parts.weighted: the "example_weights" [N] input (loss L = 1/N sum_n w_n l_n) as
        (w, sqrt(w)), each shaped to broadcast against the model output."""
        if not self.parts.weighted:
            return None, None
        if WEIGHTS not in self.info.data_inputs:
            out_shape = self.view.shape(self.output) or ("N",)
            self.data_input(WEIGHTS, self.b.float_type, [out_shape[0]])
            rank = len(out_shape)
            w = self.b.unsqueeze(WEIGHTS, list(range(1, rank))) if rank > 1 else WEIGHTS
            self._weights = (w, self.b.op("Sqrt", [w]))
        return self._weights

    def zeros_like_param(self, p: str) -> str:
        return self.b.const(np.zeros(self.view.shapes[p]), hint="zeros")

    def loss_and_grads(self, extra_wrt: list[str] = ()) -> tuple[str, str, dict[str, str], dict[str, str]]:
        """Mean loss, batch size N, grads of the mean loss, and cotangents of `extra_wrt`."""
        b, z = self.b, self.output
        y = self.targets()
        weights = WEIGHTS if self.parts.weighted else None
        w, sqrt_w = self.example_weights()
        loss = self.parts.loss.emit_loss(b, z, y, weights)
        n = b.batch_size(z)
        data_grad = self.parts.loss.emit_grad(b, z, y)
        if w is not None:
            data_grad = b.mul(data_grad, w)
        wrt = list(self.parts.params) + [t for t in extra_wrt if t not in self.parts.params]
        cots = backward(b, self.view, {z: b.div(data_grad, n)}, wrt)
        grads = {p: cots.get(p) or self.zeros_like_param(p) for p in self.parts.params}
        extra = {t: cots.get(t) for t in extra_wrt}
        self.full = ForwardPass(self.view, lambda t: t, z, y, n, data_grad, sqrt_w, w)
        return loss, n, grads, extra

    def sub_batch_pass(self, m: int | None) -> "ForwardPass":
        """The forward pass on the whole batch (m = None) or on its first m examples: a clone
        of the forward graph (built once per m and shared), on which the factor statistics
        and the quadratic model's curvature products cost m/N of their full-batch price (the
        moving average pools many batches anyway). Call after loss_and_grads."""
        if m is None:
            return self.full
        cached = self._sub_passes.get(int(m))
        if cached is not None:
            return cached
        m = int(m)
        if m < 1:
            raise ConfigError(f"a sub-batch size must be >= 1, got {m}")
        b = self.b
        start, end, axes = b.ints([0]), b.ints([m]), b.ints([0])
        sliced = {x: b.op("Slice", [x, start, end, axes]) for x in self.view.graph_inputs}
        view, rename = self.clone_forward(f"kfac/sub{m}/", sliced)  # one prefix per size
        z = rename(self.output)
        y = b.op("Slice", [self.full.y, start, end, axes])
        n = b.batch_size(z)
        data_grad = self.parts.loss.emit_grad(b, z, y)
        w = sqrt_w = None
        if self.full.weight is not None:
            w, sqrt_w = (b.op("Slice", [t, start, end, axes]) for t in self.example_weights())
            data_grad = b.mul(data_grad, w)
        self._sub_passes[m] = ForwardPass(view, rename, z, y, n, data_grad, sqrt_w, w, rows=m)
        return self._sub_passes[m]

    def clone_forward(self, prefix: str, substitutions: dict[str, str]) -> tuple[GraphView, Callable[[str], str]]:
        """Append a copy of the forward graph whose inputs/parameters listed in
        `substitutions` read other tensors; every tensor the copy computes is renamed with
        `prefix`. Returns the copy's index (for autodiff) and the renaming function."""
        b = self.b
        graph = self.parts.model.graph
        produced = {o for node in graph.node for o in node.output if o}

        def rename(t: str) -> str:
            if t in substitutions:
                return substitutions[t]
            return prefix + t if t in produced else t

        clones = []
        for node in graph.node:
            c = onnx.NodeProto()
            c.CopyFrom(node)
            c.name = prefix + node.name
            c.input[:] = [rename(t) if t else t for t in node.input]
            c.output[:] = [rename(t) if t else t for t in node.output]
            b.taken.update(c.output)
            clones.append(c)
        b.nodes.extend(clones)

        def renamed_infos(infos):
            out = []
            for vi in infos:
                r = onnx.ValueInfoProto()
                r.CopyFrom(vi)
                r.name = rename(vi.name)
                out.append(r)
            return out

        data = set(self.view.graph_inputs)
        inputs = renamed_infos([vi for vi in graph.input if vi.name in data])
        inits = [t for t in graph.initializer if t.name not in substitutions]
        inputs += [value_info(substitutions[t.name], t.data_type, list(t.dims))
                   for t in graph.initializer if t.name in substitutions]
        sub = onnx.helper.make_graph(
            clones, prefix.strip("/"), inputs, renamed_infos(graph.output),
            initializer=inits, value_info=renamed_infos(graph.value_info),
        )
        return GraphView(onnx.helper.make_model(sub, opset_imports=self.parts.model.opset_import)), rename

    def layer_cotangent_targets(self) -> list[str]:
        """Tensors whose per-example cotangents the blocks need (layer outputs; generic params)."""
        names: list[str] = []
        for layer in self.parts.layers:
            if layer.kind == "generic":
                names += [p for p in layer.params if p not in names]
            else:
                names += [u.output for u in layer.uses if u.output not in names]
        return names

    def batch_statistics(
        self, fwd: "ForwardPass", mode: str, num_samples: int, data_cots: dict[str, str] | None = None
    ) -> dict[str, dict[str, str]]:
        """One batch's factor estimates {layer: {factor: tensor}} for `mode` on pass `fwd`.
        `data_cots`: cotangents of the mean loss at the layer outputs from the full-batch
        backward, reused by the empirical mode when fwd is the full batch."""
        b, loss, z, n = self.b, self.parts.loss, fwd.z, fwd.n
        spec = noise_spec(mode, num_samples, loss)
        z_shape = tuple(self.view.shape(self.output) or ())
        noise = []
        if spec.count:
            noise_shape = list(loss.noise_shape(z_shape))
            if fwd.rows is not None:  # a sub-batch pass (used only on larger batches): m rows
                noise_shape[0] = fwd.rows
            self.info.noise = NoiseSpec(spec.count, noise_shape, spec.distribution)
            noise = [self.data_input(C.noise(s), self.b.float_type, noise_shape) for s in range(spec.count)]
        targets = [fwd.name(t) for t in self.layer_cotangent_targets()]
        if mode == "empirical" and fwd is self.full and data_cots is not None:
            per_seed = [{t: b.mul(data_cots[t], n) if data_cots[t] else None for t in targets}]
        else:
            seeds = emit_seeds(b, loss, z, z_shape, mode, num_samples, fwd.data_grad, noise)
            if fwd.seed_scale is not None and mode != "empirical":
                # Fisher of the weighted loss: sum_n w_n F_n, i.e. seeds scaled by sqrt(w_n)
                seeds = [b.mul(sd, fwd.seed_scale) for sd in seeds]
            per_seed = [backward(b, fwd.view, {z: s}, targets) for s in seeds]
        inv_sqrt_n = b.op("Reciprocal", [b.op("Sqrt", [n])])
        stats: dict[str, dict[str, str]] = {}
        for layer in self.parts.layers:
            block = self.blocks[layer.name]
            if layer.kind == "generic":
                inputs = list(layer.params)
                cots = [[self._per_example_fallback(d.get(p), p, inv_sqrt_n) for d in per_seed] for p in layer.params]
            else:
                inputs = [fwd.name(u.input) for u in layer.uses]
                outs = [fwd.name(u.output) for u in layer.uses]
                cots = [[d.get(o) or self._zeros_like(o) for d in per_seed] for o in outs]
            stats[layer.name] = block.emit_statistics(b, inputs, cots)
        return stats

    def _per_example_fallback(self, cot: str | None, p: str, inv_sqrt_n: str) -> str:
        """[1, *shape] = sum_n g_n / sqrt(N): unbiased for sampled targets (E g_n = 0)."""
        g = cot or self.zeros_like_param(p)
        return self.b.unsqueeze(self.b.mul(g, inv_sqrt_n), [0])

    def _zeros_like(self, t: str) -> str:
        return self.b.op("Mul", [t, self.b.const(0.0)])

    def precondition(self, grads: dict[str, str]) -> dict[str, str]:
        """(F + damping)^-1 g for every block, from the `inverse/<layer>/<name>` state slots."""
        out: dict[str, str] = {}
        for layer in self.parts.layers:
            block = self.blocks[layer.name]
            inverses = {
                s.name: self.state_input(C.inverse(layer.name, s.name), s.shape, _init_of(s))
                for s in block.inverse_specs()
            }
            out.update(block.emit_multiply_inverse(self.b, {p: grads[p] for p in layer.params}, inverses))
        return out

    def finite(self, tensors: list[str]) -> str:
        """Bool scalar: every tensor (scalar) is finite."""
        total = _sum(self.b, tensors)
        bad = self.b.op("Or", [self.b.op("IsNaN", [total]), self.b.op("IsInf", [total])])
        return self.b.op("Not", [bad])


@dataclass
class ForwardPass:
    """A forward pass in the emitted graph: its index (for autodiff), a map from the source
    model's tensor names to this pass's, the model output z, targets y, batch size n and the
    per-example data gradient dl_n/dz (times w_n for a weighted loss)."""

    view: GraphView
    name: Callable[[str], str]
    z: str
    y: str
    n: str
    data_grad: str
    seed_scale: str | None = None  # sqrt of the example weights, when the loss is weighted
    weight: str | None = None  # the example weights, shaped to broadcast against z
    rows: int | None = None  # m for the pass on the first m examples; None for the whole batch


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


def _init_of(spec) -> str:
    """Inverse state starts as the identity (a no-op preconditioner until the first update)
    unless the block's spec says otherwise."""
    return spec.init or "identity"


def _sum(b: GraphBuilder, terms: list[str]) -> str:
    if not terms:
        return b.const(0.0)
    return terms[0] if len(terms) == 1 else b.op("Sum", terms)


# ====================================================================== subgraphs
SUBGRAPHS: dict[str, Callable[..., tuple[onnx.ModelProto, SubgraphInfo]]] = {}


def subgraph(name: str):
    def deco(fn):
        SUBGRAPHS[name] = fn
        return fn

    return deco


def resolved_options(plan: Any, name: str, **options) -> dict[str, Any]:
    """Every option subgraph `name` is emitted with, defaults and plan settings filled in
    (mode, num_samples, inverse method, damping split, weighted): equal resolved options mean
    an identical subgraph, so the runtime can key its caches on them."""
    if name not in SUBGRAPHS:
        raise ConfigError(f"unknown subgraph {name!r}; choose one of {', '.join(SUBGRAPHS)}")
    params = list(inspect.signature(SUBGRAPHS[name]).parameters.values())[1:]
    out: dict[str, Any] = {p.name: p.default for p in params}
    unknown = [k for k in options if k not in out and k != "weighted"]
    if unknown:
        raise ConfigError(f"subgraph {name!r} has no option {unknown[0]!r}; its options are {sorted(out)}")
    out.update({k: v for k, v in options.items() if v is not None})
    parts = plan if isinstance(plan, PlanParts) else plan_parts(plan)
    plan_defaults = {"mode": parts.mode, "num_samples": parts.num_samples, "method": parts.inverse_method}
    for key, value in plan_defaults.items():
        if key in out and out[key] is None:
            out[key] = value
    out["weighted"] = bool(options.get("weighted", False))
    out["damping_split"] = parts.damping_split
    return out


def emit_subgraph(plan: Any, name: str, **options) -> tuple[onnx.ModelProto, SubgraphInfo]:
    """Emit subgraph `name` of the contract for `plan` (a Plan or PlanParts); info["options"]
    records the resolved options (see resolved_options)."""
    parts = plan if isinstance(plan, PlanParts) else plan_parts(plan)
    resolved = resolved_options(parts, name, **options)
    weighted = bool(options.pop("weighted", False))
    if weighted != parts.weighted:
        parts = dataclasses.replace(parts, weighted=weighted)
    model, info = SUBGRAPHS[name](parts, **options)
    info.options = resolved
    return model, info


@subgraph("loss")
def _loss(parts: PlanParts) -> tuple[onnx.ModelProto, SubgraphInfo]:
    em = Emission.start(parts)
    y = em.targets()
    em.example_weights()
    em.metric("loss", parts.loss.emit_loss(em.b, em.output, y, WEIGHTS if parts.weighted else None))
    em.result(C.MODEL_OUTPUT, em.output)
    return em.finish("loss")


@subgraph("gradients")
def _gradients(parts: PlanParts) -> tuple[onnx.ModelProto, SubgraphInfo]:
    em = Emission.start(parts)
    loss, _, grads, _ = em.loss_and_grads()
    em.metric("loss", loss)
    for p in parts.params:
        em.result(C.grad(p), grads[p])
    return em.finish("gradients")


@subgraph("statistics")
def _statistics(parts: PlanParts, mode: str | None = None, num_samples: int | None = None,
                stats_batch: int | None = None):
    em = Emission.start(parts)
    mode = mode or parts.mode
    num_samples = num_samples or parts.num_samples
    targets = em.layer_cotangent_targets() if mode == "empirical" and stats_batch is None else []
    loss, n, _, cots = em.loss_and_grads(targets)
    em.metric("loss", loss)
    stats = em.batch_statistics(em.sub_batch_pass(stats_batch), mode, num_samples, cots)
    for layer, factors in stats.items():
        for fname, stat in factors.items():
            em.result(C.stat(layer, fname), emit_statistic(em.b, stat))
    return em.finish("statistics")


def _factor_updates(em: Emission, fwd: ForwardPass, cots: dict, mode: str,
                    num_samples: int) -> tuple[list[tuple[str, str]], list[str]]:
    """The moving-average update (1 - c) F + c S of every factor slot F with this batch's
    statistic S, as (slot, new value) pairs, and finiteness terms. A GramStatistic
    S = X^T X / count becomes one Gemm(X * c / count, X, (1 - c) F, transA): its finiteness is
    that of |X|^2, which bounds every entry of X^T X."""
    b = em.b
    coeff = em.hp("ema_coeff")
    keep = b.sub(b.const(1.0), coeff)
    stats = em.batch_statistics(fwd, mode, num_samples, cots)
    updates, ok = [], []
    for layer in em.parts.layers:
        specs = {s.name: s for s in em.blocks[layer.name].factor_specs()}
        for fname, stat in stats[layer.name].items():
            slot = em.state_input(C.factor(layer.name, fname), specs[fname].shape, "zeros")
            if isinstance(stat, GramStatistic):
                scaled = b.mul(stat.rows, b.div(coeff, stat.count))
                updates.append((slot, b.op("Gemm", [scaled, stat.rows, b.mul(slot, keep)], transA=1)))
                ok.append(b.reduce("ReduceSumSquare", stat.rows, None))
            else:
                updates.append((slot, b.add(slot, b.mul(coeff, b.sub(stat, slot)))))
                ok.append(b.reduce_sum(stat, None))
    return updates, ok


def _write_factor_updates(em: Emission, fwd: ForwardPass, cots: dict, mode: str, num_samples: int,
                          ok: list[str]) -> None:
    """The factor updates as state outputs, on every run; their finiteness terms into `ok`."""
    updates, terms = _factor_updates(em, fwd, cots, mode, num_samples)
    for slot, new in updates:
        em.state_output(slot, new)
    ok += terms


def _conditional_factor_updates(em: Emission, fwd: ForwardPass, cots: dict, mode: str, num_samples: int,
                                ok: list[str]) -> None:
    """The factor updates inside an If on hp/update_stats > 0: the steps that skip the
    statistics (cov_update_period > 1, the first step) run the same session, whose factor
    outputs are then copies of its inputs. A second session for those steps would cost more:
    each session's idle workers spin on the second core (session 4 in docs/performance_log.md)."""
    b = em.b
    slots: list[str] = []

    def statistics() -> list[str]:
        updates, terms = _factor_updates(em, fwd, cots, mode, num_samples)
        slots.extend(slot for slot, _ in updates)
        return [new for _, new in updates] + [_sum(b, terms)]

    wanted = b.op("Greater", [em.hp("update_stats"), b.const(0.0)])
    results = b.conditional(wanted, statistics, lambda: slots + [b.const(0.0)],
                            lambda: [em.info.state_specs[s].shape for s in slots] + [[]], hint="statistics")
    for slot, new in zip(slots, results):
        em.state_output(slot, new)
    ok.append(results[-1])


def _regularized(em: Emission, grads: dict[str, str], l2: bool) -> dict[str, str]:
    """g + l2 * theta (only emitted when the optimizer uses weight decay)."""
    if not l2:
        return grads
    coeff = em.hp("l2")
    return {p: em.b.add(g, em.b.mul(coeff, p)) for p, g in grads.items()}


class Gram:
    """Dot products of parameter-shaped vectors, each emitted on first use: per parameter a
    ReduceSumSquare (x.x) or Mul + ReduceSum (x.y), then one Sum. One MatMul of the
    flattened vectors' concatenation ([k, P] @ [P, k]) did the same in fewer nodes but cost
    0.2 ms more per digits-autoencoder step: the concatenation copies every vector, and a
    3x3 product with an inner dimension of 107k runs memory-bound on one thread."""

    def __init__(self, em: Emission, vectors: dict[str, dict[str, str]]) -> None:
        self.b, self.params, self.vectors = em.b, list(em.parts.params), vectors
        self._dots: dict[tuple[str, str], str] = {}

    def __call__(self, x: str, y: str) -> str:
        key = (x, y) if x <= y else (y, x)
        if key not in self._dots:
            b, u, v = self.b, self.vectors[x], self.vectors[y]
            terms = [b.reduce("ReduceSumSquare", u[p], None) if x == y else b.reduce_sum(b.mul(u[p], v[p]), None)
                     for p in self.params]
            self._dots[key] = _sum(b, terms)
        return self._dots[key]


@subgraph("kfac_step")
def _kfac_step(
    parts: PlanParts,
    with_stats: bool = True,
    stats_if: bool = False,
    qmodel: bool = True,
    mode: str | None = None,
    num_samples: int | None = None,
    l2: bool = False,
    stats_batch: int | None = None,
    loss_after: bool = False,
    qmodel_batch: int | None = None,
):
    """One K-FAC step. The update is a * P + mu * v with P = (F + damping)^-1 g the
    preconditioned gradient and v the previous update (velocity); a, mu come from the 2x2
    quadratic model (qmodel) or from hp/learning_rate, hp/momentum (a = -lr), whose curvature
    products run on the first qmodel_batch examples (None: all). loss_after adds
    metric/loss_after, the loss of the same batch at the updated parameters, computed only
    when hp/loss_after > 0 (NaN otherwise)."""
    em = Emission.start(parts)
    b = em.b
    mode = mode or parts.mode
    num_samples = num_samples or parts.num_samples
    reuse = with_stats and mode == "empirical" and stats_batch is None
    loss, n, raw_grads, cots = em.loss_and_grads(em.layer_cotangent_targets() if reuse else [])
    grads = _regularized(em, raw_grads, l2)
    ok_terms = [loss]
    if with_stats and stats_if:
        _conditional_factor_updates(em, em.sub_batch_pass(stats_batch), cots, mode, num_samples, ok_terms)
    elif with_stats:
        _write_factor_updates(em, em.sub_batch_pass(stats_batch), cots, mode, num_samples, ok_terms)
    precond = em.precondition(grads)
    velocity = {p: em.state_input(C.velocity(p), tuple(em.view.shapes[p]), "zeros") for p in parts.params}
    vectors = {"g": grads, "P": precond, "v": velocity}
    if l2:
        vectors["raw"] = raw_grads
        vectors["t"] = {p: p for p in parts.params}  # theta, for the regularizer's change
    dots = Gram(em, vectors)
    if qmodel:
        damping = em.hp("damping")
        if l2:
            damping = b.add(damping, em.hp("l2"))
        # the model on the first qmodel_batch examples; equal to stats_batch, the forward
        # clone is shared
        gap = None  # the objective's distance to the loss's lower bound, where one is known
        if parts.loss.lower_bound is not None:
            gap = b.sub(loss, b.const(float(parts.loss.lower_bound)))
            if l2:  # the objective the model describes includes l2 |theta|^2 / 2
                gap = b.add(gap, b.mul(b.mul(b.const(0.5), em.hp("l2")), dots("t", "t")))
        a, mu, change = _qmodel(em, em.sub_batch_pass(qmodel_batch), precond, velocity, dots, damping, l2, gap)
    else:
        lr, mu = em.hp("learning_rate"), em.hp("momentum")
        a = b.neg(b.mul(lr, _norm_constraint(em, lr, dots("g", "P"))))
    update = {p: b.add(b.mul(a, precond[p]), b.mul(mu, velocity[p])) for p in parts.params}
    # |a P + mu v|^2 and g . update from the Gram entries
    update_sq = b.add(
        b.add(b.mul(b.mul(a, a), dots("P", "P")), b.mul(b.mul(b.const(2.0), b.mul(a, mu)), dots("P", "v"))),
        b.mul(b.mul(mu, mu), dots("v", "v")),
    )
    if not qmodel:
        change = b.add(b.mul(a, dots("g", "P")), b.mul(mu, dots("g", "v")))  # first-order only
    ok_terms += [update_sq, a, mu]
    ok_flags: list[str] = []
    new_params = {p: b.add(p, update[p]) for p in parts.params}
    for p in parts.params:
        em.state_output(p, new_params[p])
        em.state_output(C.velocity(p), update[p])
    if loss_after:
        # The objective at the new parameters on the same batch, for Levenberg-Marquardt
        # damping. The forward pass runs inside an If on hp/loss_after > 0, so only the
        # damping-adaptation steps pay for it, in this session (a second session would cost
        # more). With l2 it includes the regularizer's change l2 (theta.u + |u|^2 / 2), so that
        # loss_after - loss is the change of the objective the quadratic model describes.
        def objective_after() -> list[str]:
            _, rename = em.clone_forward("kfac/after/", new_params)
            after = parts.loss.emit_loss(b, rename(em.output), em.full.y, WEIGHTS if parts.weighted else None)
            if l2:
                reg = b.add(
                    b.add(b.mul(a, dots("t", "P")), b.mul(mu, dots("t", "v"))),
                    b.mul(b.const(0.5), update_sq),
                )
                after = b.add(after, b.mul(em.hp("l2"), reg))
            return [after]

        wanted = b.op("Greater", [em.hp("loss_after"), b.const(0.0)])
        (after,) = b.conditional(wanted, objective_after, [b.const(float("nan"))], [[]], hint="loss_after")
        em.metric("loss_after", after)
        # A failed step: with hp/reject_increase > 0, a step that raises the batch objective
        # by more than |predicted change| (rho < -1) is not applied (metric/finite = 0: the
        # runtime keeps the state and raises the damping). |.|: a sub-batch model can predict
        # a small increase of the whole batch's objective, and a step that then lowers it is
        # fine. NaN (no forward pass this step) compares false.
        increase = b.op("And", [b.op("Greater", [em.hp("reject_increase"), b.const(0.0)]),
                                b.op("Greater", [b.sub(after, loss), b.op("Abs", [change])])])
        ok_flags.append(b.op("Not", [increase]))
    em.metric("loss", loss)
    em.metric("update_norm", b.op("Sqrt", [update_sq]))
    em.metric("grad_norm", b.op("Sqrt", [dots("raw", "raw") if l2 else dots("g", "g")]))
    em.metric("alpha", b.neg(a))
    em.metric("mu", mu)
    em.metric("qmodel_change", change)
    ok = em.finite(ok_terms)
    for flag in ok_flags:
        ok = b.op("And", [ok, flag])
    em.metric("finite", b.cast(ok, FLOAT))
    return em.finish("kfac_step")


def _norm_constraint(em: Emission, lr: str, g_dot_precond: str) -> str:
    """KL clipping (TF K-FAC): scale so lr^2 g.F^-1 g <= c; c <= 0 disables."""
    b = em.b
    c = em.hp("norm_constraint")
    sq = b.mul(b.mul(lr, lr), b.op("Abs", [g_dot_precond]))
    ratio = b.op("Sqrt", [b.div(c, b.op("Max", [sq, b.const(1e-30)]))])
    clipped = b.op("Min", [ratio, b.const(1.0)])
    return b.op("Where", [b.op("Greater", [c, b.const(0.0)]), clipped, b.const(1.0)])


def _qmodel(em: Emission, fwd: ForwardPass, precond: dict, velocity: dict, dots: Gram, damping: str, l2: bool,
            gap: str | None = None):
    """a, mu minimizing m(a, mu) = g.u + 1/2 u.(C + damping)u for u = a P + mu v, with C the
    exact GGN (products from forward-mode JVPs), as in kfac-jax, on the batch `fwd` covers.

    On a sub-batch S the model is the sub-batch's own: C and g both from S, with
    g_S.u = sum_{n in S} (J_n u).dl_n/dz / |S| from the same JVPs (free). Mixing the whole
    batch's g with C_S overshoots wherever S under-represents the curvature along P (the
    digits classifier at batch 256 with the model on 128 examples diverged on 4 of 4 seeds;
    with g_S, 0 of 4). The returned change m(a, mu) uses the whole batch's g: it is the
    prediction that damping adaptation compares with the whole batch's loss change. With
    `gap` (the objective's distance to the loss's lower bound) a, mu are scaled down where
    that change would undercut the bound (_decrease_scale)."""
    b, z, n, loss = em.b, fwd.z, fwd.n, em.parts.loss
    j_p = jvp(b, fwd.view, dict(precond), [z])[z]
    j_v = jvp(b, fwd.view, dict(velocity), [z])[z]
    f_p, f_v = loss.emit_fisher_times(b, z, j_p), loss.emit_fisher_times(b, z, j_v)
    if fwd.weight is not None:  # C = 1/N sum_n w_n J_n^T F_n J_n for a weighted loss
        f_p, f_v = b.mul(f_p, fwd.weight), b.mul(f_v, fwd.weight)

    def mean_dot(u: str, w: str) -> str:
        return b.div(b.reduce_sum(b.mul(u, w), None), n)

    c11 = b.add(mean_dot(j_p, f_p), b.mul(damping, dots("P", "P")))
    c12 = b.add(mean_dot(j_p, f_v), b.mul(damping, dots("P", "v")))
    c22 = b.add(mean_dot(j_v, f_v), b.mul(damping, dots("v", "v")))
    whole_b1, whole_b2 = dots("g", "P"), dots("g", "v")
    if fwd is em.full:
        b1, b2 = whole_b1, whole_b2
    else:  # fwd.data_grad carries the example weights of a weighted loss
        b1, b2 = mean_dot(j_p, fwd.data_grad), mean_dot(j_v, fwd.data_grad)
        if l2:
            b1 = b.add(b1, b.mul(em.hp("l2"), dots("t", "P")))
            b2 = b.add(b2, b.mul(em.hp("l2"), dots("t", "v")))
    det = b.sub(b.mul(c11, c22), b.mul(c12, c12))
    # 2-D solve unless v = 0 (first step) or the system is numerically rank one in float32
    two_d = b.op("And", [
        b.op("Greater", [c22, b.const(0.0)]),
        b.op("Greater", [det, b.mul(b.const(1e-6), b.mul(c11, c22))]),
    ])
    safe_det = b.op("Where", [two_d, det, b.const(1.0)])
    a2 = b.neg(b.div(b.sub(b.mul(c22, b1), b.mul(c12, b2)), safe_det))
    mu2 = b.neg(b.div(b.sub(b.mul(c11, b2), b.mul(c12, b1)), safe_det))
    a1 = b.neg(b.div(b1, b.op("Max", [c11, b.const(1e-30)])))
    a = b.op("Where", [two_d, a2, a1])
    mu = b.op("Where", [two_d, mu2, b.const(0.0)])
    # |mu| <= hp/max_momentum, with a re-solved for the clipped mu: where the batch's
    # curvature along v is tiny the model's optimum has |mu| >> 1 and training diverges
    # (digits classifier and autoencoder, docs/runtime.md)
    limit = em.hp("max_momentum")
    mu_c = b.op("Min", [b.op("Max", [mu, b.neg(limit)]), limit])
    a_c = b.neg(b.div(b.add(b1, b.mul(mu_c, c12)), b.op("Max", [c11, b.const(1e-30)])))
    a = b.op("Where", [b.op("Equal", [mu, mu_c]), a, a_c])
    mu = mu_c

    def model(a: str, mu: str, b1: str, b2: str) -> str:
        quad = b.add(b.add(b.mul(b.mul(a, a), c11), b.mul(b.mul(b.const(2.0), b.mul(a, mu)), c12)), b.mul(b.mul(mu, mu), c22))
        return b.add(b.add(b.mul(a, b1), b.mul(mu, b2)), b.mul(b.const(0.5), quad))

    # Fall back to the momentum-free step when it is no worse: in exact arithmetic the
    # (clipped) 2-D solution never is, but with v almost parallel to P the float32 solve can
    # pick the wrong sign of mu and predict an increase (digits classifier, batch 256)
    keep = b.op("LessOrEqual", [model(a, mu, b1, b2), model(a1, b.const(0.0), b1, b2)])
    a = b.op("Where", [keep, a, a1])
    mu = b.op("Where", [keep, mu, b.const(0.0)])
    # the predicted change m(a, mu), with the whole batch's g
    change = model(a, mu, whole_b1, whole_b2)
    if gap is None:
        return a, mu, change
    scale = _decrease_scale(em, change, gap)
    a, mu = b.mul(scale, a), b.mul(scale, mu)
    return a, mu, model(a, mu, whole_b1, whole_b2)


def _decrease_scale(em: Emission, change: str, gap: str) -> str:
    """s = min(1, k gap / -change), k = hp/max_predicted_decrease (<= 0: off): the update is
    scaled by the ratio of the decrease allowed (the fraction k of the objective's distance
    to the loss's lower bound, `gap`) to the decrease predicted. A model that predicts a
    decrease below the bound is extrapolating past its validity: on the digits classifier at
    batches 16 and 32 each run-away inspected started with such a step (a predicted decrease
    of 10-360x the loss, |u| 9-500 where steps had been 0.1-0.5; docs/runtime.md
    "Safeguards")."""
    b = em.b
    k = em.hp("max_predicted_decrease")
    limit = b.mul(k, gap)
    capped = b.op("And", [b.op("Greater", [k, b.const(0.0)]), b.op("Less", [change, b.neg(limit)])])
    s = b.op("Where", [capped, b.div(limit, b.neg(change)), b.const(1.0)])
    em.metric("update_scale", s)
    return s


@subgraph("update_statistics")
def _update_statistics(parts: PlanParts, mode: str | None = None, num_samples: int | None = None,
                       stats_batch: int | None = None):
    """Moving-average factor update only (first step, burn-in, before an inverse refresh)."""
    em = Emission.start(parts)
    mode = mode or parts.mode
    num_samples = num_samples or parts.num_samples
    reuse = mode == "empirical" and stats_batch is None
    loss, n, _, cots = em.loss_and_grads(em.layer_cotangent_targets() if reuse else [])
    ok_terms = [loss]
    _write_factor_updates(em, em.sub_batch_pass(stats_batch), cots, mode, num_samples, ok_terms)
    em.metric("loss", loss)
    em.metric("finite", em.b.cast(em.finite(ok_terms), FLOAT))
    return em.finish("update_statistics")


@subgraph("sgd_step")
def _sgd_step(parts: PlanParts, l2: bool = False):
    """Heavy-ball SGD: v = momentum v - lr g; theta += v."""
    em = Emission.start(parts)
    b = em.b
    loss, _, raw, _ = em.loss_and_grads()
    grads = _regularized(em, raw, l2)
    lr, mom = em.hp("learning_rate"), em.hp("momentum")
    steps = {}
    for p in parts.params:
        vel = em.state_input(C.velocity(p), tuple(em.view.shapes[p]), "zeros")
        steps[p] = b.sub(b.mul(mom, vel), b.mul(lr, grads[p]))
        em.state_output(p, b.add(p, steps[p]))
        em.state_output(C.velocity(p), steps[p])
    _baseline_metrics(em, loss, steps, raw)
    return em.finish("sgd_step")


@subgraph("adam_step")
def _adam_step(parts: PlanParts, l2: bool = False):
    """Adam; the host passes the bias-corrected learning rate lr sqrt(1-b2^t)/(1-b1^t)."""
    em = Emission.start(parts)
    b = em.b
    loss, _, raw, _ = em.loss_and_grads()
    grads = _regularized(em, raw, l2)
    lr, b1, b2, eps = em.hp("learning_rate"), em.hp("beta1"), em.hp("beta2"), em.hp("epsilon")
    one = b.const(1.0)
    steps = {}
    for p in parts.params:
        shape = tuple(em.view.shapes[p])
        m = em.state_input(C.adam_m(p), shape, "zeros")
        v = em.state_input(C.adam_v(p), shape, "zeros")
        g = grads[p]
        m_new = b.add(b.mul(b1, m), b.mul(b.sub(one, b1), g))
        v_new = b.add(b.mul(b2, v), b.mul(b.sub(one, b2), b.mul(g, g)))
        steps[p] = b.neg(b.mul(lr, b.div(m_new, b.add(b.op("Sqrt", [v_new]), eps))))
        em.state_output(p, b.add(p, steps[p]))
        em.state_output(C.adam_m(p), m_new)
        em.state_output(C.adam_v(p), v_new)
    _baseline_metrics(em, loss, steps, raw)
    return em.finish("adam_step")


def _baseline_metrics(em: Emission, loss: str, steps: dict, raw: dict) -> None:
    dots = Gram(em, {"u": steps, "g": raw})
    update_sq = dots("u", "u")
    em.metric("loss", loss)
    em.metric("update_norm", em.b.op("Sqrt", [update_sq]))
    em.metric("grad_norm", em.b.op("Sqrt", [dots("g", "g")]))
    em.metric("finite", em.b.cast(em.finite([loss, update_sq]), FLOAT))


@subgraph("inverse_update")
def _inverse_update(parts: PlanParts, method: str | None = None):
    em = Emission.start(parts)
    b = em.b
    method = linalg.concrete_method(method or parts.inverse_method)  # "auto" emits inverse_op
    damping = em.hp("damping")
    oks = []
    for layer in parts.layers:
        block = em.blocks[layer.name]
        if block.inverse_is_host(method):
            continue
        factors = {
            s.name: em.state_input(C.factor(layer.name, s.name), s.shape, "zeros") for s in block.factor_specs()
        }
        previous = {
            s.name: em.state_input(C.inverse(layer.name, s.name), s.shape, _init_of(s)) for s in block.inverse_specs()
        }
        # The block keeps `previous` where a factor or its inverse is not finite (new.ok false).
        new = block.emit_inverse(b, factors, damping, method, previous=previous)
        oks.append(b.cast(new.ok, FLOAT))
        em.metric(f"inverse_ok/{layer.name}", oks[-1])  # the runtime redoes failed blocks on the host
        for s in block.inverse_specs():
            em.state_output(previous[s.name], new[s.name])
    all_ok = b.op("Min", oks) if len(oks) > 1 else (oks[0] if oks else b.const(1.0))
    em.metric("inverse_ok", all_ok)
    return em.finish("inverse_update")


@subgraph("precondition")
def _precondition(parts: PlanParts):
    em = Emission.start(parts)
    vecs = {p: em.data_input(C.vec(p), FLOAT, list(em.view.shapes[p])) for p in parts.params}
    out = em.precondition(vecs)
    for p in parts.params:
        em.result(C.precond(p), out[p])
    return em.finish("precondition")


@subgraph("multiply")
def _multiply(parts: PlanParts, exp: int = 1):
    """(F + damping)^exp v for every block, from the moving-average factors: the block
    multiply for exp = 1, an integer matrix power otherwise (fractional powers need
    eigendecompositions: Curvature.multiply_matpower does them on the host)."""
    em = Emission.start(parts)
    damping = em.hp("damping")
    vecs = {p: em.data_input(C.vec(p), FLOAT, list(em.view.shapes[p])) for p in parts.params}
    for layer in parts.layers:
        block = em.blocks[layer.name]
        factors = {s.name: em.state_input(C.factor(layer.name, s.name), s.shape, "zeros") for s in block.factor_specs()}
        mine = {p: vecs[p] for p in layer.params}
        if exp == 1:
            out = block.emit_multiply(em.b, mine, factors, damping)
        else:
            out = block.emit_multiply_matpower(em.b, mine, factors, damping, int(exp))
        for p in layer.params:
            em.result(C.product(p), out[p])
    return em.finish("multiply")

