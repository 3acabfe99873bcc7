"""Depthwise-conv blocks on depthwise-heavy exports: held-out loss after N steps of K-FAC with
each depthwise_conv block against Adam (lr 1e-3), from the same start on the same batches.

    python benchmarks/bench_depthwise_blocks.py export DIR      # torchvision models (needs torch)
    python benchmarks/bench_depthwise_blocks.py compare MODEL.onnx ... [--steps 30] [--blocks ...]

  export   torchvision's efficientnet_b0, mnasnet0_5, shufflenet_v2_x0_5 (weights=None, their
           own initialisation, 10 classes, eval mode) exported like models/real_exports.py's
           fixtures (torch.onnx.export, "ts" exporter by default) to DIR/<model>-<exporter>.onnx
  compare  per model: Adam's (lr 1e-3) held-out loss after --steps steps, and per block (config
           approximations.depthwise_conv) K-FAC's (the Trainer's defaults) and its steps to
           Adam's, on models/real_data's 16x16 RGB digits (bench_to_target.held_out_run: the
           real-exports loop)

The exports are not fixtures (nothing here is committed but the table). Losses and step counts
are deterministic; the seconds in the JSON are not comparable on a shared machine.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

harness.import_paths()

from bench_to_target import _compile_quiet, _one_line, held_out_run  # noqa: E402

BLOCKS = ("diagonal", "kron", "channel_full")
TORCHVISION = ("efficientnet_b0", "mnasnet0_5", "shufflenet_v2_x0_5")


def cmd_export(args, say, run):
    """torchvision's depthwise-heavy models as ONNX files in args.dir."""
    torchvision = harness.require("torchvision", "exporting torchvision's models")
    from kfac_compiler.models.real_data import batch
    from kfac_compiler.models.real_exports import export

    x, _ = batch("image", 8, seed=0)
    os.makedirs(args.dir, exist_ok=True)
    for name in args.models:
        module = getattr(torchvision.models, name)(weights=None, num_classes=10).eval()
        path = Path(args.dir) / f"{name}-{args.exporter}.onnx"
        path.write_bytes(export(module, x, args.exporter).SerializeToString())
        say(f"{path}: {path.stat().st_size / 1e6:.1f} MB")


def cmd_compare(args, say, run):
    """Held-out loss after --steps steps, Adam (lr 1e-3) then K-FAC per depthwise_conv block,
    and K-FAC's steps to Adam's final loss (evaluated every --every steps)."""
    rows, table = [], []
    for path in args.models:
        r: dict = {"model": Path(path).stem}
        target = None
        for block in args.blocks:
            try:
                plan = _compile_quiet(path, config={"approximations": {"depthwise_conv": block}})
                if target is None:  # Adam's run does not depend on the block
                    r["depthwise_convs"] = sum(layer.kind == "depthwise_conv" for layer in plan.layers)
                    r["loss0"], adam = held_out_run(plan, "adam", "image", args.steps, args.batch_size, args.every,
                                                    learning_rate=1e-3)
                    r["adam"], r["adam_curve"], target = adam.loss, adam.curve, adam.loss
                _, kfac = held_out_run(plan, "kfac", "image", args.steps, args.batch_size, args.every, [target])
                r[block], r[f"{block}_steps"], r[f"{block}_curve"] = kfac.loss, kfac.hit(target)[0], kfac.curve
            except Exception as e:  # noqa: BLE001 - reported
                r[block] = _one_line(e)
            print(r["model"], block, r[block], r.get(f"{block}_steps"), file=sys.stderr, flush=True)
        rows.append(r)

        def cell(v):
            return f"{v:.3f}" if isinstance(v, float) else str(v)

        table.append([r["model"], r.get("depthwise_convs", ""), cell(r.get("loss0", "")), cell(r.get("adam", ""))]
                     + [f"{cell(r[b])} ({r.get(f'{b}_steps') or '-'})" for b in args.blocks])
    say(f"Held-out loss (mean over bench_to_target.HELD_OUT digits) after {args.steps} steps of batch "
        f"{args.batch_size} from the same start; in parentheses K-FAC's steps to Adam's loss after {args.steps} "
        f"(evaluated every {args.every}; -: not reached).")
    say()
    say(harness.table(["model", "depthwise convs", "loss at 0", "Adam 1e-3"] + [f"K-FAC {b}" for b in args.blocks],
                      table))
    return rows


def parser():
    ap, add = harness.command_parser(__doc__)
    p = add("export", cmd_export, "export torchvision's depthwise-heavy models")
    p.add_argument("dir")
    p.add_argument("--models", nargs="*", default=list(TORCHVISION))
    p.add_argument("--exporter", default="ts", help="models/real_exports.py EXPORTERS (default ts)")
    p = add("compare", cmd_compare, "K-FAC per depthwise_conv block vs Adam")
    p.add_argument("models", nargs="+", help="ONNX files (images [N, 3, 16, 16] -> logits [N, 10])")
    p.add_argument("--blocks", nargs="*", default=list(BLOCKS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="evaluate the held-out loss every this many steps")
    p.add_argument("--batch-size", type=int, default=32)
    return ap


if __name__ == "__main__":
    sys.exit(harness.main(parser(), "depthwise-blocks"))
