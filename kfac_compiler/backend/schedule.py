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
values; ONNX Runtime's execution order is its own (a depth-first walk from the outputs).
"""
from __future__ import annotations

import networkx as nx
import onnx

from kfac_compiler.builder import node_reads, subgraphs


def order_by_generation(graph: onnx.GraphProto) -> None:
    """Reorder the nodes of `graph` and of its subgraphs in place by topological generation,
    each generation in the given order. A node depends on the producers of what it reads,
    its bodies' outer-scope reads included (ONNX Runtime's implicit inputs)."""
    for node in graph.node:
        for body in subgraphs(node):
            order_by_generation(body)
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    deps = nx.DiGraph()
    deps.add_nodes_from(range(len(graph.node)))
    deps.add_edges_from((producer[t], i) for i, n in enumerate(graph.node) for t in node_reads(n) if t in producer)
    order = [i for generation in nx.topological_generations(deps) for i in sorted(generation)]
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)
