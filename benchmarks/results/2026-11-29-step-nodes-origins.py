"""Where the default steady K-FAC step's nodes come from (issue 40): the kfac_step graph a
default CPU trainer requests, as ONNX Runtime's CPU session holds it after its graph
optimizations, each node attributed to the emitter that made it, and the refresh
(inverse_update) graphs per group, amortized over the inverse period.

    python benchmarks/results/2026-11-29-step-nodes-origins.py resnet18,gpt [--multi]

Attribution: GraphBuilder.op is wrapped to record, per node name, the innermost of these
emitters running when it was made: the forward+backward (local_loss_and_grads), the factor
statistics and their moving averages (factor_updates, inside the statistics If), the
preconditioning (precondition), the Gram of the step's vectors (Gram), the quadratic model's
JVPs and terms (quadratic_model), its 2x2 solve (solve_quadratic_model), the update
(apply_update) and the loss after it (_loss_after, its If). ORT keeps the names of the nodes it
does not fuse; a fused node takes the name of one it fused (or a suffix of it). The forward
graph's own nodes (the model's names) count as fwd+bwd; what is left is "other" (the packing
of vectors, metrics, shape arithmetic). Where two emitters made equal nodes, ORT's CSE keeps
one of them: the split between statistics, JVPs and "other" moves by ~10 nodes between runs
(the totals do not).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_step as bs  # noqa: E402
from kfac_compiler import builder  # noqa: E402
from kfac_compiler.backend import factors, service  # noqa: E402
from kfac_compiler.backend.service import emit_for  # noqa: E402
from kfac_compiler.builder import subgraphs  # noqa: E402
from kfac_compiler.optimizers import base  # noqa: E402
from kfac_compiler.optimizers.kfac import graph  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402
from kfac_compiler.runtime.subgraphs import resolved_request  # noqa: E402

ORIGINS = [(graph, "local_loss_and_grads", "fwd+bwd"), (factors, "factor_updates", "statistics"),
           (factors, "precondition", "precondition"), (base.Gram, "__init__", "gram"),
           (base.Gram, "__call__", "gram"), (graph, "quadratic_model", "qmodel JVPs"),
           (graph, "solve_quadratic_model", "qmodel solve"), (graph, "apply_update", "update"),
           (graph, "_loss_after", "loss after")]
_stack = ["other"]
_origin: dict[str, str] = {}


def _instrument() -> None:
    op = builder.GraphBuilder.op

    def tagged(self, *a, **k):
        out = op(self, *a, **k)
        _origin[self.nodes[-1].name] = _stack[-1]
        return out

    builder.GraphBuilder.op = tagged  # type: ignore[method-assign]
    for owner, name, label in ORIGINS:
        f = getattr(owner, name)

        def wrapped(*a, f=f, label=label, **k):
            _stack.append(label)
            try:
                return f(*a, **k)
            finally:
                _stack.pop()

        setattr(owner, name, functools.wraps(f)(wrapped))


def _nodes(g, out, ctx=""):
    for n in g.node:
        out.append((n, ctx))
        for s in subgraphs(n):
            _nodes(s, out, ctx + "/" + n.name)
    return out


def origins(model) -> dict[str, collections.Counter]:
    """{origin: Counter of op types} over the nodes of `model` (If branches included)."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for n, ctx in _nodes(model.graph, []):
        base_name = re.sub(r"_(nchwc|token.*|new_reshape.*)$", "", n.name)
        label = _origin.get(n.name) or _origin.get(base_name)
        if label is None:
            label = "other" if n.name.startswith("kfac/") else "fwd+bwd"
        if "loss_after" in ctx:
            label = "loss after"
        out[label][n.op_type] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models")
    ap.add_argument("--multi", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    _instrument()
    for name in args.models.split(","):
        plan, x, y = bs._nodes_case(name, tempfile.mkdtemp())
        tr = Trainer(plan, optimizer="kfac", device="cpu", batch_size=min(args.batch, len(y)), sessions=False,
                     multi_tensor=args.multi)
        opts = {k: v for k, v in tr.policy.step_options().to_json().items() if v is not None}
        # node names repeat between emissions, and the Trainer's requests may have emitted this
        # graph already (the service's cache would hand it back with no origins recorded)
        service._CACHE.pop(id(plan), None)
        _origin.clear()
        model, _ = emit_for(plan, resolved_request(plan, "cpu", "kfac_step", **opts))
        by = origins(bs.ort_optimized(model))
        total = sum(sum(c.values()) for c in by.values())
        print(f"\n{name} kfac_step ({'multi' if args.multi else 'per-param'}), ORT CPU graph: {total} nodes "
              f"(the If branches: statistics every cov_update_period steps, loss after on adaptation steps)")
        print("| origin | nodes | Reshape | Transpose | other ops (most frequent) |")
        print("|---|---|---|---|---|")
        for label, c in sorted(by.items(), key=lambda kv: -sum(kv[1].values())):
            rest = ", ".join(f"{o} {k}" for o, k in c.most_common() if o not in ("Reshape", "Transpose"))
            print(f"| {label} | {sum(c.values())} | {c['Reshape']} | {c['Transpose']} | {rest[:110]} |")
        period = tr.config.inv_update_period
        rows = []
        for r in tr.requests():
            if r.name not in ("inverse_update", "power_update"):
                continue
            o = {k: v for k, v in r.options.to_json().items() if v is not None}
            m, _ = emit_for(plan, resolved_request(plan, "cpu", r.name, **o))
            ops = collections.Counter(n.op_type for n, _ in _nodes(bs.ort_optimized(m).graph, []))
            rows.append((len(o.get("layers") or []), sum(ops.values()), ops["Inverse"]))
        print(f"refresh: {len(rows)} groups over a period of {period}: (layers, nodes, Inverse) "
              + ", ".join(map(str, rows)) + f"; {sum(r[1] for r in rows) / period:.0f} nodes per step amortized")


if __name__ == "__main__":
    main()
