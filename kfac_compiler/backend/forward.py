"""Forward passes inside an emitted subgraph: the loss and its gradients on the whole batch,
clones of the forward graph on the batch's first m examples (sub_batch_pass) or at other
parameters (clone_forward), each described by a ForwardPass that autodiff can walk."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import onnx

from kfac_compiler import contract as C
from kfac_compiler.builder import value_info
from kfac_compiler.errors import ConfigError
from kfac_compiler.graph import GraphView
from kfac_compiler.passes.autodiff import backward

if TYPE_CHECKING:
    from kfac_compiler.backend.emission import Emission


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


def loss_and_grads(em: Emission, extra_wrt: Sequence[str] = ()) -> tuple[str, str, dict[str, str], dict[str, str]]:
    """Mean loss, batch size N, grads of the mean loss, and cotangents of `extra_wrt`; sets
    em.full, the whole batch's forward pass."""
    b, z = em.b, em.output
    y = em.targets()
    weights = C.EXAMPLE_WEIGHTS if em.parts.weighted else None
    w, sqrt_w = em.example_weights()
    loss = em.parts.loss.emit_loss(b, z, y, weights)
    for name, value in em.parts.loss.emit_metrics(b, z, y, weights).items():
        em.metric(C.loss_metric(name), value)
    n = b.batch_size(z)
    data_grad = em.parts.loss.emit_grad(b, z, y)
    if w is not None:
        data_grad = b.mul(data_grad, w)
    wrt = list(em.parts.params) + [t for t in extra_wrt if t not in em.parts.params]
    cots = backward(b, em.view, {z: b.div(data_grad, n)}, wrt)
    grads = {p: cots.get(p) or em.zeros_like_param(p) for p in em.parts.params}
    extra = {t: cots.get(t) for t in extra_wrt}
    em.full = ForwardPass(em.view, lambda t: t, z, y, n, data_grad, sqrt_w, w)
    return loss, n, grads, extra


def sub_batch_pass(em: Emission, m: int | None) -> ForwardPass:
    """The forward pass on the whole batch (m = None) or on m of its N examples: a clone of
    the forward graph (built once per m and shared), on which the factor statistics and the
    quadratic model's curvature products cost m/N of their full-batch price (the moving
    average pools many batches anyway). Call after loss_and_grads.

    The rows are spread evenly, row floor(k N / m') for k < m' = min(m, N) (every (N/m)-th
    where m divides N), not the first m: a data-parallel run gives each of P ranks N/P
    contiguous rows and m/P sub-batch rows, and rank r's row floor(j (N/P) / (m/P)) of its
    share is the batch's row floor((r m/P + j) N / m), the one process's, whenever P divides N
    and m (m need not divide N: with every (N // m)-th row from the first, batch 96 and m 64
    took rows 0-63 in one process but 0-31 and 48-79 on two ranks). So P ranks compute the
    same statistics as one process (with the noise of sub-batch row k drawn for row k on
    every rank, Trainer.draw_noise)."""
    full = cast(ForwardPass, em.full)  # set by loss_and_grads, which runs first
    if m is None:
        return full
    cached = em._sub_passes.get(int(m))
    if cached is not None:
        return cached
    m = int(m)
    if m < 1:
        raise ConfigError(f"a sub-batch size must be >= 1, got {m}")
    b = em.b
    rows = b.shape(full.y, 0, 1)  # N, as a 1-element tensor
    taken = b.op("Min", [rows, b.ints([m])])  # m' = min(m, N)
    k = b.op("Range", [b.const(0, "int64"), b.squeeze(taken, [0]), b.const(1, "int64")])
    index = b.op("Div", [b.mul(k, rows), taken])  # floor(k N / m'): integer division of non-negatives

    def pick(x: str) -> str:
        return b.op("Gather", [x, index], axis=0)

    sliced = {x: pick(x) for x in em.view.graph_inputs}
    view, rename = clone_forward(em, f"kfac/sub{m}/", sliced, own_batch=True)  # one prefix per size
    z = rename(em.output)
    y = pick(full.y)
    n = b.batch_size(z)
    data_grad = em.parts.loss.emit_grad(b, z, y)
    w = sqrt_w = None
    if full.weight is not None:  # a weighted loss: example_weights() are tensors
        w, sqrt_w = (pick(t) for t in cast("tuple[str, str]", em.example_weights()))
        data_grad = b.mul(data_grad, w)
    em._sub_passes[m] = ForwardPass(view, rename, z, y, n, data_grad, sqrt_w, w, rows=m)
    return em._sub_passes[m]


def clone_forward(em: Emission, prefix: str, substitutions: dict[str, str],
                  own_batch: bool = False) -> tuple[GraphView, Callable[[str], str]]:
    """Append a copy of the forward graph whose inputs/parameters listed in
    `substitutions` read other tensors; every tensor the copy computes is renamed with
    `prefix`. Returns the copy's index (for autodiff) and the renaming function.
    `own_batch`: the copy's rows are not the whole batch's (its declared shapes get a batch
    symbol of their own, backend/shapes.py)."""
    b = em.b
    graph = em.parts.model.graph
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
    if em.shapes is not None and (own_batch or not set(substitutions) & set(em.view.graph_inputs)):
        em.shapes.add_pass(rename, prefix, own_batch)  # other rows without own_batch: declared nowhere

    def renamed_infos(infos):
        out = []
        for vi in infos:
            r = onnx.ValueInfoProto()
            r.CopyFrom(vi)
            r.name = rename(vi.name)
            out.append(r)
        return out

    data = set(em.view.graph_inputs)
    inputs = renamed_infos([vi for vi in graph.input if vi.name in data])
    inits = [t for t in graph.initializer if t.name not in substitutions]
    inputs += [value_info(substitutions[t.name], t.data_type, list(t.dims))
               for t in graph.initializer if t.name in substitutions]
    sub = onnx.helper.make_graph(
        clones, prefix.strip("/"), inputs, renamed_infos(graph.output),
        initializer=inits, value_info=renamed_infos(graph.value_info),
    )
    return GraphView(onnx.helper.make_model(sub, opset_imports=em.parts.model.opset_import)), rename
