"""Cutting a step graph at its reduction points into stages, for data-parallel runs.

An emitted step marks each value a data-parallel run averages over the ranks with an Identity
(`Emission.reduce_mean`): `info.reductions[point]` maps the Identity's output (the reduced
tensor the later nodes read) to its input (this rank's local mean). One process runs the
graph fused; `split_stages` cuts it so that the host can all-reduce in between:

    stage 0   every node that needs no reduced tensor (loss, gradients, factor statistics)
      -- all-reduce the locals whose reduced tensors stage 1 reads
    stage 1   every node that needs a reduced tensor of cut 0 at most (preconditioning, the
              quadratic model's terms) ... and so on.

A node goes to the earliest stage its inputs allow (a reduced tensor is available one stage
after its local); constants (nodes fed only by initializers and constants) are copied into
every stage that reads them. A tensor one stage makes and a later one reads is `carried`: an
output of the first and an input of the second, handed over as the same OrtValue (no copy).
Each stage keeps the step's declared shapes (value_info, backend/shapes.py) of the tensors it
makes inside, so that ONNX Runtime plans its buffers as it does the fused step's.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

import onnx
from onnx import helper

from kfac_compiler.builder import node_reads
from kfac_compiler.contract import SubgraphInfo


class StageError(RuntimeError):
    """A step graph that cannot be cut at its reduction points (a compiler bug)."""


@dataclass
class Stage:
    """One stage: its model and info (the step's inputs and outputs it has), the tensors it
    reads from earlier stages or all-reductions (`carried_in`), the tensors it hands on
    (`carried_out`), and the reduction cut after it: reduced tensor -> local tensor."""

    model: onnx.ModelProto
    info: SubgraphInfo
    carried_in: list[str] = field(default_factory=list)
    carried_out: list[str] = field(default_factory=list)
    reduce_after: dict[str, str] = field(default_factory=dict)


def _reads(node: onnx.NodeProto) -> list[str]:
    return [n for n in node_reads(node) if n]


def split_stages(model: onnx.ModelProto, info: SubgraphInfo, max_nodes: int | None = None) -> list[Stage]:
    """The stages of `model` (a fused step with `info.reductions`); one stage when it has no
    reduction point and `max_nodes` is None. `max_nodes`: also a new stage after every
    max_nodes nodes of the graph's order, so that no session sorts more."""
    graph = model.graph
    reduced = {r: local for pairs in info.reductions.values() for r, local in pairs.items()}
    initializers = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    stage_of: dict[str, int] = {}   # tensor -> the stage that makes it (graph inputs: absent)
    constant: set[str] = set()      # tensors fed by initializers and constants only
    markers: dict[str, str] = {}    # reduced tensor -> local
    placed: list[tuple[onnx.NodeProto, int | None, list[str]]] = []  # [(node, stage or None: constant, its reads)]
    floor = 0  # the stage the graph's order has reached (max_nodes)
    sizes: Counter[int] = Counter()  # stage -> its nodes so far (constants aside)
    for node in graph.node:
        if node.op_type == "Identity" and len(node.output) == 1 and node.output[0] in reduced:
            local = node.input[0]
            if node.output[0] in markers or reduced[node.output[0]] != local:
                raise StageError(f"reduction marker {node.output[0]!r} disagrees with info.reductions")
            markers[node.output[0]] = local
            stage_of[node.output[0]] = stage_of.get(local, 0) + 1
            continue
        reads = _reads(node)
        if all(n in initializers or n in constant for n in reads) and node.op_type != "If":
            constant.update(node.output)
            placed.append((node, None, reads))
            continue
        s = max([floor] + [stage_of[n] for n in reads if n in stage_of])
        sizes[s] += 1
        if max_nodes and sizes[s] >= max_nodes:
            floor = s + 1
        for o in node.output:
            stage_of[o] = s
        placed.append((node, s, reads))
    missing = sorted(set(reduced) - set(markers))
    if missing:
        raise StageError(f"reduced tensor {missing[0]!r} has no Identity marker in the graph")
    count = 1 + max(stage_of.values(), default=0)  # the markers' stages and every node's
    # the cut after stage k: the locals made in stage k at the latest whose reduced tensors
    # stage k + 1 reads (a local made earlier is carried to stage k)
    cuts: list[dict[str, str]] = [{} for _ in range(count)]
    for r, local in markers.items():
        cuts[stage_of[r] - 1][r] = local
    outputs = {o.name: o for o in graph.output}
    if max_nodes is None:  # a chunk's sunk views would all be ready at once: the long sort again
        _sink_views(placed, stage_of, cuts, outputs)
    types = _tensor_types(model)
    declared = {vi.name: vi for vi in graph.value_info}  # backend/shapes.py's, nested bodies' stay in their nodes
    # what each stage reads, and which tensors cross a stage boundary
    node_reads_in: list[set[str]] = [set() for _ in range(count)]  # what each stage's nodes read
    by_stage: list[list[onnx.NodeProto]] = [[] for _ in range(count)]
    constants: list[tuple[onnx.NodeProto, list[str]]] = []
    for node, at, reads in placed:
        if at is None:
            constants.append((node, reads))
        else:
            node_reads_in[at].update(reads)
            by_stage[at].append(node)
    reads_in = [set(r) for r in node_reads_in]
    for k, cut in enumerate(cuts):
        reads_in[k].update(cut.values())  # the host reads the locals after stage k
    for name in outputs:
        if name in stage_of:
            reads_in[stage_of[name]].add(name)
        elif name in constant:  # made from constants alone (a host-inverse refresh's flag): the last stage
            reads_in[count - 1].add(name)
    last_read: dict[str, int] = {}  # tensor -> the last stage that reads it
    for k, names in enumerate(reads_in):
        for n in names:
            last_read[n] = k
    made_by = {o: i for i, (node, _) in enumerate(constants) for o in node.output}
    stages = []
    for s in range(count):
        nodes, constant_reads = _with_constants(by_stage[s], constants, made_by, reads_in[s])
        made = {o for n in nodes for o in n.output}
        carried_in = sorted(n for n in reads_in[s] if n not in made and n in stage_of and n not in inputs)
        carried_out = sorted(n for n in made if last_read.get(n, -1) > s and stage_of.get(n) == s)
        stage_outputs = [n for n in outputs if n in made and (stage_of.get(n) == s or (n in constant and s == count - 1))]
        stages.append(_stage(model, info, s, nodes, node_reads_in[s] | constant_reads, carried_in, carried_out,
                             stage_outputs, cuts[s], outputs, initializers, types, declared))
    return stages


# ONNX ops whose output is their first input's data under another shape: ONNX Runtime runs
# them in place inside a session, but a stage's output must be written out (a copy)
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def _sink_views(placed: list[tuple[onnx.NodeProto, int | None, list[str]]], stage_of: dict[str, int],
                cuts: list[dict[str, str]], outputs: Collection[str]) -> None:
    """Move each view node (VIEW_OPS) that its own stage does not read to the first stage that
    does, so that a stage hands on the tensor it viewed instead of a copy of it (ResNet-18's
    stage 0 handed on 93 MB of reshaped activations a step, copied out where the fused step
    copies nothing). In place: `placed` and `stage_of`. The same values either way."""
    readers: dict[str, Counter[int]] = defaultdict(Counter)  # tensor -> stage -> reads there
    for _, at, reads in placed:
        if at is not None:
            for n in reads:
                readers[n][at] += 1
    for k, cut in enumerate(cuts):  # the host reads a cut's locals after stage k
        for local in cut.values():
            readers[local][k] += 1
    for name in outputs:  # a step's output leaves from the stage that makes it
        if name in stage_of:
            readers[name][stage_of[name]] += 1
    for i in reversed(range(len(placed))):  # consumers first: a chain of views moves together
        node, at, reads = placed[i]
        if at is None or node.op_type not in VIEW_OPS or len(node.output) != 1:
            continue
        users = [k for k, c in readers[node.output[0]].items() if c > 0]
        if not users or min(users) <= at:
            continue
        to = min(users)
        placed[i] = (node, to, reads)
        stage_of[node.output[0]] = to
        for n in reads:
            readers[n][at] -= 1
            readers[n][to] += 1


def _with_constants(nodes: list[onnx.NodeProto], constants: list[tuple[onnx.NodeProto, list[str]]],
                    made_by: dict[str, int], wanted: set[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """`nodes` preceded by the constant nodes (`constants`: each with what it reads; `made_by`:
    output -> its index there) that `wanted`, what the stage reads, (transitively) needs, in
    the graph's order, and what those read. Walks only what is needed: a stage costs its own
    size, not the graph's."""
    keep: set[int] = set()
    todo = [made_by[n] for n in wanted if n in made_by]
    while todo:
        i = todo.pop()
        if i not in keep:
            keep.add(i)
            todo.extend(made_by[n] for n in constants[i][1] if n in made_by)
    order = sorted(keep)
    return [constants[i][0] for i in order] + nodes, {n for i in order for n in constants[i][1]}


def _tensor_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every typed tensor of the graph (shape inference), for the stages' new inputs and
    outputs."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as e:  # noqa: BLE001 - onnx raises several types for one cause
        raise StageError(f"shape inference of the step failed: {e}") from None
    g = inferred.graph
    types = {v.name: v.type for v in list(g.input) + list(g.output) + list(g.value_info)
             if v.type.tensor_type.elem_type}
    for t in g.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, None))
    for node in g.node:  # ops onnx does not know (com.microsoft's Inverse): their first input's type
        known = next((types[i] for i in node.input if i in types), None)
        for o in node.output:
            if o and o not in types and known is not None:
                types[o] = helper.make_tensor_type_proto(known.tensor_type.elem_type, None)
    return types


def _value_info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
        raise StageError(f"cannot type tensor {name!r}, which crosses a stage boundary")
    vi = onnx.ValueInfoProto()
    vi.name = name
    vi.type.CopyFrom(t)
    return vi


def _stage(model: onnx.ModelProto, info: SubgraphInfo, s: int, nodes: list[onnx.NodeProto], read: set[str],
           carried_in: list[str], carried_out: list[str], stage_outputs: list[str], cut: dict[str, str],
           outputs: dict[str, onnx.ValueInfoProto], initializers: dict[str, onnx.TensorProto],
           types: dict[str, onnx.TypeProto], declared: dict[str, onnx.ValueInfoProto]) -> Stage:
    """Stage `s`: its `nodes` (what they `read`), the step's inputs and `outputs` it has, and
    the tensors it takes from and hands to the other stages."""
    graph_inputs = [i for i in model.graph.input if i.name in read]
    outs = set(stage_outputs)
    # the host reads the locals of the cut after this stage (those made here or carried in);
    # a step's output a later stage reads is handed on where the step writes it (a state
    # slot's spare buffer, a metric's host scalar, a result)
    hand_on = list(dict.fromkeys(n for n in carried_out + list(cut.values()) if n not in outs))
    boundary = outs | set(hand_on)
    inside = [declared[o] for node in nodes for o in node.output if o in declared and o not in boundary]
    g = helper.make_graph(
        nodes, f"{model.graph.name}/stage{s}",
        graph_inputs + [_value_info(n, types) for n in carried_in],
        [outputs[n] for n in stage_outputs] + [_value_info(n, types) for n in hand_on],
        [initializers[n] for n in sorted(read & initializers.keys())],
        value_info=inside,
    )
    m = helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    m.functions.extend(model.functions)
    names = {i.name for i in graph_inputs}
    stage_info = SubgraphInfo(
        data_inputs=[n for n in info.data_inputs if n in names],
        hp_inputs=[n for n in info.hp_inputs if n in names],
        state_inputs=[n for n in info.state_inputs if n in names],
        state_outputs={o: slot for o, slot in info.state_outputs.items() if o in outs},
        metrics=[m_ for m_ in info.metrics if m_ in outs],
        results=[r for r in info.results if r in outs] + hand_on,
        state_specs=info.state_specs, noise=info.noise, options=info.options,
    )
    return Stage(m, stage_info, carried_in, carried_out, cut)
