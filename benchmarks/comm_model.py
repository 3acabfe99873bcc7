"""Communication model of data-parallel K-FAC (issue 25): bytes per step by type and the
modelled time per step on a few links, read off a compiled plan's blocks.

The schedule it models (docs/distributed.md, "How it scales to many GPUs"):
  * every step the gradients (float32, one packed buffer of every trainable parameter) and
    ten scalars (loss, the quadratic model's 7 terms, the loss after the update, a finite
    flag) are all-reduced (mean);
  * the factors' moving averages are linear in the batch statistics, so each rank keeps its
    own and a refresh group's factors are all-reduced only right before that group's inverse
    refresh: once per inv_update_period steps, whatever cov_update_period is;
  * each block's inverse is computed by one owner rank (blocks balanced over the ranks by
    inverse_flops, longest processing time first: refresh.balanced_groups) and broadcast
    from it, once per inv_update_period steps.

Cost model (alpha-free: bandwidth only, nominal link rates, so every time is a lower bound):
ring all-reduce of S bytes sends and receives 2(P-1)/P S per rank and takes that / bandwidth;
a pipelined broadcast of S bytes moves every byte over each rank's link once: S / bandwidth.
Compute per step = 3 x the layers' forward FLOPs (blocks' forward_flops) at the per-GPU batch
/ an assumed achieved throughput, plus the largest rank's share of the inverse FLOPs (by the
plan's inverse method on CUDA) / an assumed inverse throughput / inv_update_period.

    python benchmarks/comm_model.py [--models resnet50,gpt2_small,resnet18,digits_autoencoder]
        [--cache /tmp/comm-model] [--ranks 8] [--out benchmarks/results/2026-11-24-comm-model]
    python benchmarks/comm_model.py --plan PLAN_DIR_OR_ONNX --batch 32 [--loss ...]

An ONNX file is compiled with default settings and emit=False (the training subgraphs do
not change the blocks); plans are cached as plan folders under --cache.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DATE = "2026-11-24"
SCALARS = 10  # loss, the quadratic model's 7 terms, the loss after the update, the finite flag
FLOAT_BYTES = 4
INVERSE_PERIODS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@dataclass(frozen=True)
class Link:
    """A per-GPU link, by its nominal one-direction bandwidth (what a ring step sees)."""

    name: str
    bytes_per_s: float
    source: str


LINKS: tuple[Link, ...] = (
    Link("NVLink 4", 450e9, "H100 SXM datasheet: NVLink 900 GB/s per GPU, both directions: 450 GB/s each way"),
    Link("InfiniBand NDR", 50e9, "NDR 400 Gb/s per port (ConnectX-7), one port per GPU as in DGX H100: 50 GB/s"),
    Link("100 GbE", 12.5e9, "IEEE 802.3 100 Gb/s Ethernet: 12.5 GB/s"),
    Link("25 GbE", 3.125e9, "IEEE 802.3 25 Gb/s Ethernet: 3.125 GB/s"),
)

# H100 SXM dense TF32 tensor peak 494.7 TFLOP/s (datasheet); ONNX Runtime's CUDA EP runs
# float32 MatMul/Conv in TF32 by default (use_tf32). 40% of it: a well-fed large-batch step.
FWD_BWD_FLOPS_PER_S = 200e12
# The emitted `schur` inverses: a chain of float32 products on factors of 64..4609 rows; 20
# TFLOP/s is ~30% of the H100's 67 TFLOP/s FP32 peak. Our measured refresh is far slower
# (ResNet-18 on the H100, 2026-11-24-h100-inverse_methods-resnet18.log: ~0.45 s, ~23k
# small nodes): the figure is what a fused inverse would reach, so the inverse share is low.
INVERSE_FLOPS_PER_S = 20e12


@dataclass
class BlockComm:
    """One block's bytes and inverse FLOPs."""

    kind: str
    approximation: str | None
    factor_bytes: int
    inverse_bytes: int
    inverse_flops: int
    factor_shapes: list[list[int]]


@dataclass
class PlanComm:
    """What a plan puts on the wire, independent of links and ranks."""

    param_elements: int
    gradient_bytes: int  # the packed gradient buffer plus the scalars
    scalar_bytes: int
    factor_bytes: int
    inverse_bytes: int
    inverse_flops: int
    forward_flops_per_example: int
    stats_period: int
    inverse_period: int
    inverse_method: str
    blocks: dict[str, BlockComm] = field(default_factory=dict)
    without_factors: list[str] = field(default_factory=list)


def plan_comm(plan: Any) -> PlanComm:
    """Bytes by type, read off the plan: gradients from its trainable parameters, factors from
    the factor specs the plan records (what `inspect` shows), inverses and inverse FLOPs from
    its blocks (inverse_specs, inverse_flops by the method the plan's inverses use on CUDA)."""
    from kfac_compiler.linalg import concrete_method

    method = concrete_method(plan.inverse.method, "cuda")
    params = int(plan.totals()["param_elements"])
    from kfac_compiler.blocks import plan_blocks

    blocks = plan_blocks(plan)
    per: dict[str, BlockComm] = {}
    missing = []
    forward = 0
    for layer in plan.layers:
        block = blocks[layer.name]
        forward += int(block.forward_flops(1))
        specs = plan.factors.get(layer.name)
        if specs is None:
            missing.append(layer.name)
            continue
        per[layer.name] = BlockComm(
            kind=layer.kind,
            approximation=layer.approximation,
            factor_bytes=int(sum(s.nbytes for s in specs)),
            inverse_bytes=int(sum(s.nbytes for s in block.inverse_specs())),
            inverse_flops=int(block.inverse_flops(method)),
            factor_shapes=[list(s.shape) for s in specs],
        )
    scalars = SCALARS * FLOAT_BYTES
    return PlanComm(
        param_elements=params,
        gradient_bytes=FLOAT_BYTES * params + scalars,
        scalar_bytes=scalars,
        factor_bytes=sum(b.factor_bytes for b in per.values()),
        inverse_bytes=sum(b.inverse_bytes for b in per.values()),
        inverse_flops=sum(b.inverse_flops for b in per.values()),
        forward_flops_per_example=forward,
        stats_period=int(plan.schedule.stats.update_period),
        inverse_period=int(plan.schedule.inverse.update_period),
        inverse_method=method,
        blocks=per,
        without_factors=missing,
    )


def ring_allreduce(nbytes: float, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of `nbytes`."""
    return 2.0 * (ranks - 1) / ranks * nbytes


def largest_rank_inverse_flops(comm: PlanComm, ranks: int) -> float:
    """Inverse FLOPs of the busiest rank when the blocks are dealt to `ranks` owners by
    longest processing time first (the refresh groups' balancing, reused)."""
    from kfac_compiler.optimizers.kfac.refresh import balanced_groups

    costs = {n: float(b.inverse_flops) for n, b in comm.blocks.items()}
    if not costs:
        return 0.0
    return max(sum(costs[n] for n in g) for g in balanced_groups(costs, ranks))


def step_times(comm: PlanComm, link: Link, ranks: int, batch: int, period: int,
               fwd_bwd_rate: float = FWD_BWD_FLOPS_PER_S, inverse_rate: float = INVERSE_FLOPS_PER_S) -> dict[str, float]:
    """Modelled seconds per step (amortized over `period` steps where it is per refresh)."""
    bw = link.bytes_per_s
    inv_rank = largest_rank_inverse_flops(comm, ranks)
    return {
        "gradients": ring_allreduce(comm.gradient_bytes, ranks) / bw,
        "factors": ring_allreduce(comm.factor_bytes, ranks) / bw / period,
        "inverses": comm.inverse_bytes / bw / period,
        "fwd_bwd": 3 * comm.forward_flops_per_example * batch / fwd_bwd_rate,
        "inverse_compute": inv_rank / inverse_rate / period,
    }


def hiding_period(refresh_s: float, per_step_s: float) -> int | None:
    """The smallest inv_update_period at which `refresh_s` amortized is at most `per_step_s`
    (None: no period does, `per_step_s` <= 0)."""
    if per_step_s <= 0:
        return None
    return max(1, math.ceil(refresh_s / per_step_s - 1e-12))


def refresh_groups(comm: PlanComm) -> list[list[str]]:
    """The refresh groups "auto" makes at the plan's period (refresh.py), by the CUDA method's
    FLOPs: each group's factors are all-reduced and inverses broadcast on its own step."""
    from kfac_compiler.optimizers.kfac.refresh import balanced_groups, group_count

    costs = {n: float(b.inverse_flops) for n, b in comm.blocks.items()}
    if not costs:
        return []
    return balanced_groups(costs, group_count(costs, comm.inverse_period))


def model_rows(name: str, comm: PlanComm, batch: int, ranks: int, links: Sequence[Link],
               fwd_bwd_rate: float, inverse_rate: float) -> dict[str, Any]:
    """The figures of one model: bytes by type, per link the times and the hiding periods."""
    T = comm.inverse_period
    groups = refresh_groups(comm)
    out: dict[str, Any] = {
        "model": name,
        "batch_per_gpu": batch,
        "ranks": ranks,
        **{k: v for k, v in asdict(comm).items() if k != "blocks"},
        "bytes_per_step": {
            "gradients": comm.gradient_bytes,
            "factors_per_refresh": comm.factor_bytes,
            "inverses_per_refresh": comm.inverse_bytes,
            "factors_amortized": comm.factor_bytes / T,
            "inverses_amortized": comm.inverse_bytes / T,
        },
        "per_rank_traffic_per_step": {
            "gradients_allreduce": ring_allreduce(comm.gradient_bytes, ranks),
            "factors_allreduce_amortized": ring_allreduce(comm.factor_bytes, ranks) / T,
            "inverses_broadcast_amortized": comm.inverse_bytes / T,
        },
        "refresh_groups": len(groups),
        "largest_group_bytes": max((sum(comm.blocks[n].factor_bytes + comm.blocks[n].inverse_bytes for n in g)
                                    for g in groups), default=0),
        "factor_and_inverse_bytes_amortized_by_period": {
            str(p): (comm.factor_bytes + comm.inverse_bytes) / p for p in INVERSE_PERIODS},
        "largest_block": max(comm.blocks.items(), key=lambda kv: kv[1].factor_bytes)[0] if comm.blocks else None,
        "inverse_flops_largest_rank": {str(p): largest_rank_inverse_flops(comm, p) for p in sorted({1, 8, 64, 512, ranks})},
        "largest_block_inverse_flops": max((b.inverse_flops for b in comm.blocks.values()), default=0),
        "links": [],
    }
    # bytes-only crossover: factor + inverse traffic per refresh against one step's gradients
    refresh_bytes = ring_allreduce(comm.factor_bytes, ranks) + comm.inverse_bytes
    out["period_below_gradients"] = hiding_period(refresh_bytes, ring_allreduce(comm.gradient_bytes, ranks))
    for link in links:
        t = step_times(comm, link, ranks, batch, T, fwd_bwd_rate, inverse_rate)
        t1 = step_times(comm, link, ranks, batch, 1, fwd_bwd_rate, inverse_rate)
        refresh_s = t1["factors"] + t1["inverses"]
        # compute with the inverse share at the default period (it falls as the period grows)
        compute = t["fwd_bwd"] + t["inverse_compute"]
        out["links"].append({
            "link": link.name,
            "bytes_per_s": link.bytes_per_s,
            "seconds_per_step_at_default_period": t,
            "refresh_seconds": refresh_s,
            "comm_over_compute_at_default_period": (t["gradients"] + t["factors"] + t["inverses"]) / compute,
            "gradients_over_compute": t["gradients"] / compute,
            "period_below_gradients": hiding_period(refresh_s, t["gradients"]),
            "period_below_compute": hiding_period(refresh_s, t["fwd_bwd"]),
            # everything overlapped with fwd+bwd: the room the gradients leave (None: none)
            "period_all_below_compute": hiding_period(refresh_s, t["fwd_bwd"] - t["gradients"]),
        })
    return out


# ------------------------------------------------------------------------- the models
def _export_resnet50(path: str) -> None:
    import numpy as np

    from kfac_compiler.models import torch_exports as te

    te.export(te.resnet50(), path, np.zeros((1, 3, 224, 224), np.float32))


def _export_gpt2_small(path: str) -> None:
    import numpy as np

    from kfac_compiler.models import torch_exports as te

    net = te.gpt(vocab=50257, seq_len=1024, d_model=768, n_layer=12, n_head=12)
    te.export(net, path, np.zeros((1, 1024), np.int64))


def _export_resnet18(path: str) -> None:
    from kfac_compiler.models import torch_exports as te

    te.export(te.resnet18(), path, te.digits_images(2)[0]["input"])


def _export_autoencoder(path: str) -> None:
    from kfac_compiler.models import save_model

    save_model("digits_autoencoder", path)


@dataclass(frozen=True)
class Model:
    export: Callable[[str], None]
    loss: str
    batch: int  # per GPU
    note: str


MODELS: dict[str, Model] = {
    "resnet50": Model(_export_resnet50, "softmax_cross_entropy", 32,
                      "ResNet-50 (torchvision twin, BatchNorm folded by the export), 224x224, 1000 classes"),
    "gpt2_small": Model(_export_gpt2_small, "softmax_cross_entropy", 8,
                        "GPT-2-small (torch_exports.gpt: vocab 50257, 1024 tokens, width 768, 12 layers, 12 heads, tied head)"),
    "resnet18": Model(_export_resnet18, "softmax_cross_entropy", 128, "torch_exports.resnet18: 10 classes, 32x32 digits"),
    "digits_autoencoder": Model(_export_autoencoder, "sigmoid_cross_entropy", 128,
                                "the zoo's digits autoencoder 64-256-128-32-128-256-64"),
}


def cached_plan(name: str, cache: str) -> Any:
    """The model's plan, compiled once (default settings, no subgraphs) and kept under `cache`."""
    import kfac_compiler

    folder = os.path.join(cache, f"{name}.plan")
    if os.path.isfile(os.path.join(folder, "plan.json")):
        return kfac_compiler.load_plan(folder)
    os.makedirs(cache, exist_ok=True)
    onnx_path = os.path.join(cache, f"{name}.onnx")
    if not os.path.isfile(onnx_path):
        MODELS[name].export(onnx_path)
    plan = kfac_compiler.compile(onnx_path, loss=MODELS[name].loss, output="logits", emit=False)
    plan.save(folder)
    return plan


def load_or_compile(path: str, loss: str | None) -> Any:
    """A plan folder as saved, or an ONNX file compiled with default settings (no subgraphs)."""
    import kfac_compiler

    if os.path.isdir(path):
        return kfac_compiler.load_plan(path)
    return kfac_compiler.compile(path, loss=loss, emit=False)


# ------------------------------------------------------------------------- rendering
def _gb(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{n:.0f} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def render_markdown(rows: list[dict[str, Any]], args: argparse.Namespace, links: Sequence[Link]) -> str:
    lines = [
        f"# Communication model of data-parallel K-FAC ({DATE})",
        "",
        f"`python benchmarks/comm_model.py --models {','.join(r['model'] for r in rows)} --ranks {args.ranks}`",
        "",
        "Bytes read off each model's plan (default settings): gradients = 4 x trainable parameters + "
        f"{SCALARS} scalars, all-reduced every step; factors = the blocks' factor_specs (float32), all-reduced "
        "once per inverse refresh; inverses = the blocks' inverse_specs (float32), broadcast from their owner "
        "once per refresh. Amortized at the plan's inv_update_period.",
        "",
        "| model | params | period (stats, inverse) | gradients / step | factors / refresh | inverses / refresh | "
        "factors + inverses / step (amortized) | refresh groups (largest's factors + inverses) | "
        "period with factor+inverse traffic below the gradients' |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        b = r["bytes_per_step"]
        lines.append(
            f"| {r['model']} | {r['param_elements'] / 1e6:.2f}M | {r['stats_period']}, {r['inverse_period']} | "
            f"{_gb(b['gradients'])} | {_gb(b['factors_per_refresh'])} | {_gb(b['inverses_per_refresh'])} | "
            f"{_gb(b['factors_amortized'] + b['inverses_amortized'])} | {r['refresh_groups']} ({_gb(r['largest_group_bytes'])}) | "
            f"{r['period_below_gradients']} |")
    lines += [
        "",
        f"Modelled time per step at P = {args.ranks} ranks (ms; bandwidth only, nominal rates), at the plan's "
        "inv_update_period. compute = fwd+bwd at the per-GPU batch / "
        f"{args.fwd_bwd_tflops:g} TFLOP/s + the busiest rank's inverse FLOPs / {args.inverse_tflops:g} TFLOP/s / period. "
        "'hides below gradients / compute': the smallest inv_update_period at which the amortized factor all-reduce + "
        "inverse broadcast costs at most the gradient all-reduce / the fwd+bwd time / the fwd+bwd time left after "
        "the gradient all-reduce (never: the gradients alone take longer than fwd+bwd).",
        "",
        "| model | batch/GPU | link | gradients | factors | inverses | fwd+bwd | inverse compute | comm / compute | "
        "hides below gradients | hides below compute | gradients + it below compute |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for l in r["links"]:
            t = l["seconds_per_step_at_default_period"]
            lines.append(
                f"| {r['model']} | {r['batch_per_gpu']} | {l['link']} | {_ms(t['gradients'])} | {_ms(t['factors'])} | "
                f"{_ms(t['inverses'])} | {_ms(t['fwd_bwd'])} | {_ms(t['inverse_compute'])} | "
                f"{l['comm_over_compute_at_default_period']:.2f} | {l['period_below_gradients']} | {l['period_below_compute']} | "
                f"{l['period_all_below_compute'] or 'never'} |")
    lines += [
        "",
        "Inverse FLOPs per refresh of the busiest rank (blocks dealt to P owners, longest first), GFLOP:",
        "",
        "| model | largest block | " + " | ".join(f"P = {p}" for p in rows[0]["inverse_flops_largest_rank"]) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in rows[0]["inverse_flops_largest_rank"]) + " |",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['largest_block_inverse_flops'] / 1e9:.3g} | "
                     + " | ".join(f"{v / 1e9:.3g}" for v in r["inverse_flops_largest_rank"].values()) + " |")
    lines += ["", "Links (per GPU, one direction):", ""]
    lines += [f"- {l.name}: {l.bytes_per_s / 1e9:g} GB/s ({l.source})" for l in links]
    lines += ["", "Models:", ""]
    lines += [f"- {r['model']}: {MODELS[r['model']].note if r['model'] in MODELS else r['model']}; "
              f"forward {r['forward_flops_per_example'] / 1e9:.3g} GFLOP per example (the layers' own), "
              f"inverses by {r['inverse_method']}, {r['inverse_flops'] / 1e9:.3g} GFLOP per refresh"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,gpt2_small,resnet18,digits_autoencoder")
    ap.add_argument("--plan", help="one plan folder or ONNX file instead of --models")
    ap.add_argument("--loss", help="the loss of an ONNX --plan (default: recognised)")
    ap.add_argument("--batch", type=int, default=32, help="per-GPU batch of --plan")
    ap.add_argument("--cache", default="/tmp/comm-model")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--fwd-bwd-tflops", type=float, default=FWD_BWD_FLOPS_PER_S / 1e12)
    ap.add_argument("--inverse-tflops", type=float, default=INVERSE_FLOPS_PER_S / 1e12)
    ap.add_argument("--out", help="write OUT.md and OUT.json (default: print the markdown)")
    args = ap.parse_args(argv)
    rates = (args.fwd_bwd_tflops * 1e12, args.inverse_tflops * 1e12)
    if args.plan:
        plans = [(os.path.basename(args.plan.rstrip("/")), load_or_compile(args.plan, args.loss), args.batch)]
    else:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODELS]
        if unknown:
            ap.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
        plans = [(n, cached_plan(n, args.cache), MODELS[n].batch) for n in names]
    rows = [model_rows(name, plan_comm(plan), batch, args.ranks, LINKS, *rates) for name, plan, batch in plans]
    md = render_markdown(rows, args, LINKS)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(md)
        doc = {"date": DATE, "ranks": args.ranks, "fwd_bwd_flops_per_s": rates[0], "inverse_flops_per_s": rates[1],
               "links": [asdict(l) for l in LINKS], "models": rows}
        with open(args.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
