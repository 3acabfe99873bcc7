"""Pass: find parameters shared by several nodes, warn about merged ones, untie on request.

ONNX exporters de-duplicate equal initializers. On a freshly initialised transformer every
LayerNorm gain is all ones and every zero bias all zeros, so the file has ONE gain used by
5-16 LayerNorms: training it ties what the user never tied. The file cannot tell such a merge
from a tie the user meant (ALBERT shares whole layers, gains included), so the default keeps
what the file says and makes it loud:

  * a shared parameter whose values are all equal (the signature of a merge) gets a warning
    naming it, its uses and the option that unties it;
  * any other shared parameter (a hand-unrolled RNN's weights, a tied embedding) gets a plan
    note; the pieces of a fused LSTM/GRU/RNN's weights, which the lowering's time steps share,
    are neither reported nor untied;
  * `untie` (config; CLI --untie, repeatable; names, regexes, "uniform" for every shared
    parameter whose values are all equal, or "all") gives every consumer node after the first
    its own copy `<name>.untied<k>` (k = 1, 2, ... in graph order).

Why keeping is the default even for uniform values: legitimate ties are uniform at
initialisation too (an unrolled RNN's zero bias shared by its time steps, ALBERT's shared
gains), and untying them silently would change the model; `--untie uniform` is one flag.

The copies are ordinary initializers of the canonical model, so the trained model written by
`Trainer.export` carries them as separate initializers.

The opposite repair: exporters also split ONE tied parameter into two initializers (a tied
embedding's table for the lookup and its transpose for the head). `find_copies` finds
non-uniform initializers equal to another (or its transpose) and `retie` computes each copy
from its original, so the tie is trained as one parameter (config `retie`, on by default).
"""
from __future__ import annotations

import hashlib
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from kfac_compiler import oprules
from kfac_compiler.config import compile_patterns
from kfac_compiler.errors import ConfigError
from kfac_compiler.graph import GraphView
from kfac_compiler.onnx_files import tensor_array
from kfac_compiler.passes.recurrent import lowered_pieces

UNTIE_ALL = "all"
UNTIE_UNIFORM = "uniform"  # the shared parameters whose values are all equal (likely merges)


@dataclass(frozen=True)
class SharedParam:
    name: str
    nodes: tuple[str, ...]   # consumer nodes in graph order
    uniform: float | None    # the one value every element holds, else None


def shared_params(view: GraphView, params: list[str]) -> list[SharedParam]:
    """Parameters consumed by more than one node, in `params` order. A node that carries no
    gradient (a `Shape` of a convolution weight, which torch.export writes for padding) reads
    the parameter without using its values: it ties nothing and is not counted. Neither are
    the recurrent lowering's pieces: their time steps share them because the fused op does
    (a Keras LSTM's zero recurrent bias was reported as a merge to untie, and untying it made
    one parameter per time step, which the user's LSTM cannot hold)."""
    pieces = lowered_pieces(view.model)
    found = []
    for name in params:
        if name in pieces:
            continue
        nodes = tuple(dict.fromkeys(n.name for n in view.consumers.get(name, []) if not _reads_no_values(n, view.opset)))
        if len(nodes) < 2:
            continue
        value = view.array(name)
        uniform = float(value.flat[0]) if value.size > 1 and np.all(value == value.flat[0]) else None
        found.append(SharedParam(name, nodes, uniform))
    return found


def _reads_no_values(node: onnx.NodeProto, opset: int) -> bool:
    rule = oprules.find(node, opset)
    return rule is not None and rule.nondiff


def report_shared(shared: list[SharedParam], untied: set[str], notes: list[str]) -> None:
    """Warn about likely merges, note the other shared parameters (skipping untied ones)."""
    for s in shared:
        if s.name in untied:
            continue
        uses = f"{len(s.nodes)} nodes ({', '.join(s.nodes[:3])}{', ...' if len(s.nodes) > 3 else ''})"
        if s.uniform is not None:
            warnings.warn(
                f"parameter {s.name!r} is shared by {uses} and all its values are {s.uniform:g}, as when an exporter "
                f"merges equal initializers of a freshly initialised model; training ties these uses: untie it "
                f"with untie = [{s.name!r}] (CLI --untie {s.name}, or --untie uniform for every such merge) if they "
                f"are separate parameters",
                stacklevel=2,
            )
        else:
            notes.append(f"parameter {s.name!r} is shared by {uses} and trained as one tied parameter "
                         f"(untie it with --untie {s.name} if that is not intended)")


def select_untie(spec: list[str] | str | None, shared: list[SharedParam]) -> list[str]:
    """The shared parameters `spec` names ("all", "uniform", names or regexes); a name or regex
    naming none is an error."""
    if not spec:
        return []
    names = [s.name for s in shared]
    entries = [spec] if isinstance(spec, str) else list(spec)
    if UNTIE_ALL in entries:
        return names
    chosen: list[str] = [s.name for s in shared if s.uniform is not None] if UNTIE_UNIFORM in entries else []
    entries = [e for e in entries if e != UNTIE_UNIFORM]
    for pattern, rx in zip(entries, compile_patterns(entries, "untie")):
        hits = [n for n in names if n == pattern or rx.fullmatch(n)]
        if not hits:
            raise ConfigError(f"untie: {pattern!r} names no trainable parameter used by several nodes "
                              f"(shared: {', '.join(names[:12]) or 'none'})")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def untie(model: onnx.ModelProto, shared: list[SharedParam], names: list[str]) -> tuple[onnx.ModelProto, dict[str, list[str]]]:
    """A copy of `model` where each named shared parameter gets one initializer per consumer node.

    Returns the model and {original name: [copies]} (the first consumer keeps the original).
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    taken = {t.name for t in m.graph.initializer} | {i.name for i in m.graph.input}
    taken |= {o for n in m.graph.node for o in n.output}
    by_name = {s.name: s for s in shared}
    inits = {t.name: t for t in m.graph.initializer}
    nodes = {n.name: n for n in m.graph.node}
    copies: dict[str, list[str]] = {}
    for name in names:
        value = tensor_array(inits[name])
        for k, node_name in enumerate(by_name[name].nodes[1:], start=1):
            new = f"{name}.untied{k}"
            while new in taken:
                new += "_"
            taken.add(new)
            m.graph.initializer.append(numpy_helper.from_array(value, new))
            node = nodes[node_name]
            for i, inp in enumerate(node.input):
                if inp == name:
                    node.input[i] = new
            copies.setdefault(name, []).append(new)
    return m, copies




def find_copies(view: GraphView, params: list[str]) -> dict[str, tuple[str, bool]]:
    """{copy: (original, transposed)}: trainable initializers whose values equal another's
    (or, for matrices, its transpose) element for element. Exporters fold a tied weight's
    Transpose into a second initializer (the TorchScript exporter's embedding + head,
    torch.export's optimizer); random values equal by chance they are not. Uniform tensors
    (all ones, all zeros) are left alone: equal values are no evidence there.

    Only parameters whose shape and type another parameter has (or, for matrices, transposed)
    are read: a 2.2 GB embedding table without a peer was read, copied twice and hashed (30 of
    a 48 s compile).

    The recurrent lowering's pieces (passes/recurrent.py) are never copies or originals: they
    are parts of one tensor of the user's model, equal at a Keras initialisation (a
    Bidirectional LSTM's two directions' biases), and the exported model has no way to hold
    one as a copy of another (it wrote the reverse bias as 0)."""
    pieces = lowered_pieces(view.model)
    params = [p for p in params if p not in pieces]

    def spec(name: str, transposed: bool = False) -> tuple:
        shape = view.static_shape(name)
        return (shape[::-1] if transposed else shape, view.dtypes[name])

    count = Counter(spec(name) for name in params)
    seen: dict[tuple, str] = {}
    copies: dict[str, tuple[str, bool]] = {}
    for name in params:
        own, flipped = spec(name), spec(name, True)
        transposable = len(own[0]) == 2 and count[flipped] >= (2 if flipped == own else 1)
        if count[own] < 2 and not transposable:
            continue  # no parameter it could equal
        value = view.array(name)
        if value.size < 2 or np.all(value == value.flat[0]):
            continue
        key = (own, _digest(value))
        if key in seen and np.array_equal(view.array(seen[key]), value):
            copies[name] = (seen[key], False)
            continue
        if transposable:
            original = seen.get((flipped, _digest(value.T)))
            if original is not None and np.array_equal(view.array(original), value.T):
                copies[name] = (original, True)
                continue
        seen[key] = name
    return copies


def _digest(value: np.ndarray) -> bytes:
    """A hash of the values in C order (a copy only where `value` is not contiguous)."""
    return hashlib.blake2b(np.ascontiguousarray(value).reshape(-1).view(np.uint8), digest_size=16).digest()


def retie(model: onnx.ModelProto, copies: dict[str, tuple[str, bool]]) -> onnx.ModelProto:
    """A copy of `model` where every copy is computed from its original (a Transpose node
    producing the copy's name, or the original's name in its readers) and is no initializer."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    kept = [t for t in g.initializer if t.name not in copies]
    del g.initializer[:]
    g.initializer.extend(kept)
    nodes = []
    for name, (original, transposed) in copies.items():
        if transposed:
            nodes.append(onnx.helper.make_node("Transpose", [original], [name], name=f"{name}/retie", perm=[1, 0]))
            t = next(t for t in model.graph.initializer if t.name == name)
            g.value_info.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    for node in g.node:
        for i, inp in enumerate(node.input):
            if inp in copies and not copies[inp][1]:
                node.input[i] = copies[inp][0]
    nodes.extend(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return m


__all__ = ["UNTIE_ALL", "UNTIE_UNIFORM", "SharedParam", "find_copies", "report_shared", "retie", "select_untie", "shared_params", "untie"]
