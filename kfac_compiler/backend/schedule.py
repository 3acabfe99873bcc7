"""The order of an emitted graph's nodes: by topological generation, so that ONNX Runtime's
session setup stays near linear in the nodes.

ONNX Runtime sorts a graph topologically in every graph transformer pass (~90 at
ORT_ENABLE_ALL) and again for its session state, visiting the lowest node index first with
a priority queue kept as a sorted `std::list` (graph.cc, VisitorPriorityQueue): each push
walks the list, so one sort costs the sum, over the nodes, of how many ready nodes wait
unvisited. In the order the emitters append them, many nodes are ready long before they are
listed (a layer's statistics after the whole backward pass, the refresh's per-block chains
after each other): in a 100-layer deep MLP's first K-FAC step (width 32, 7,678 nodes) up to
1,408 nodes waited, each sort took ~0.27 s and the session 11-18 s (4.9 s listed by
generation). Listed by generation, a node comes right after
the generation that readies it and about one generation waits
(benchmarks/results/2026-11-29-setup-scaling.md). Any topological order computes the same
values. The sessions run the ready node of lowest index first (PRIORITY_BASED execution,
runtime/device.py), so this is also the order they execute in.
"""
from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import onnx

from kfac_compiler.builder import node_reads, subgraphs


def order_by_generation(graph: onnx.GraphProto) -> None:
    """Reorder the nodes of `graph` and of its subgraphs in place by topological generation,
    each generation in the given order. A node depends on the producers of what it reads,
    its bodies' outer-scope reads included (ONNX Runtime's implicit inputs)."""
    reads: list[Sequence[str]] = []
    for node in graph.node:
        bodies = subgraphs(node)
        for body in bodies:
            order_by_generation(body)
        reads.append(list(node_reads(node)) if bodies else node.input)
    generation = _generations(graph, reads)
    nodes = [graph.node[i] for i in sorted(range(len(generation)), key=generation.__getitem__)]
    del graph.node[:]
    graph.node.extend(nodes)


def _generations(graph: onnx.GraphProto, reads: list[Sequence[str]]) -> list[int]:
    """Each node's generation: 0 without a producer in `graph`, else one more than its
    producers' latest. One pass when the graph is listed topologically, as emitted
    (networkx's topological_generations took ~4x as long on 30,000 nodes); networkx otherwise."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    preds = [[producer[t] for t in names if t in producer] for names in reads]
    generation: list[int] = []
    for i, ps in enumerate(preds):
        if any(p >= i for p in ps):
            deps = nx.DiGraph()
            deps.add_nodes_from(range(len(preds)))
            deps.add_edges_from((p, j) for j, qs in enumerate(preds) for p in qs)
            out = [0] * len(preds)
            for g, members in enumerate(nx.topological_generations(deps)):
                for j in members:
                    out[j] = g
            return out
        generation.append(1 + max((generation[p] for p in ps), default=-1))
    return generation
