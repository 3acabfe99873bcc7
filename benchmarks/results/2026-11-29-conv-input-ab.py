"""Issue 40 item 5: the group-1 conv input-gradient rule at step level. "old": every group-1
stride-1 input gradient outside the Gather forms is a ConvTranspose; "new" (oprules/conv.py):
a Conv with the flipped kernel when its pads are no larger than the forward's ("same"
convs), ConvTranspose otherwise. Both plans are compiled in this process (the rule patched
for the old one), and their Adam and K-FAC trainers step in interleaved blocks on the same
batches: per-round medians, and the per-round ratio new / old.

    python benchmarks/results/2026-11-29-conv-input-ab.py resnet18|small_cnn [ROUNDS] [BLOCK]
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import harness  # noqa: E402
import kfac_compiler as kc  # noqa: E402
from kfac_compiler.backend import emit_subgraph  # noqa: E402
from kfac_compiler.oprules import conv  # noqa: E402
from kfac_compiler.runtime import Trainer  # noqa: E402

NEW_RULE = conv._conv_input_grad


def old_rule(b, view, g, W, geo, X, so, group):
    """The rule before: at group 1 always ConvTranspose."""
    if group == 1:
        return conv.conv_t_to(b, view, g, W, geo, X, so, group)
    return NEW_RULE(b, view, g, W, geo, X, so, group)


def case(name: str, work: str):
    """(source model or path, inputs, targets, batch)."""
    if name == "resnet18":
        from bench_step import resnet_export
        path, _, x, y = resnet_export(work)
        return path, x, y, 32
    from kfac_compiler.models import ZOO, build_small_cnn
    inputs, y = ZOO["small_cnn"].make_data(1792, seed=0)
    return build_small_cnn(seed=0), inputs["input"], y, 128


def main() -> None:
    name = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    block = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    with tempfile.TemporaryDirectory() as work:
        source, x, y, bs = case(name, work)
        trainers = {}
        for label, rule in (("old", old_rule), ("new", NEW_RULE)):
            conv._conv_input_grad = rule
            plan = kc.compile(source, loss="softmax_cross_entropy", output="logits", budget={"batch_size": bs})
            ops = [n.op_type for n in emit_subgraph(plan, "adam_step")[0].graph.node]
            print(f"{label}: adam_step has {ops.count('ConvTranspose')} ConvTranspose, {ops.count('Conv')} Conv")
            for opt in ("adam", "kfac"):
                trainers[f"{opt} {label}"] = Trainer(plan, optimizer=opt, device="cpu", batch_size=bs, seed=0)
            for tr in list(trainers.values())[-2:]:  # sessions built and first runs made under this rule
                for s in range(3):
                    idx = np.arange(s * bs, (s + 1) * bs) % len(y)
                    tr.step({"input": x[idx]}, y[idx])
        conv._conv_input_grad = NEW_RULE
        count = dict.fromkeys(trainers, 3)

        def steps(key: str) -> list[float]:
            walls = []
            for _ in range(block):
                s = count[key]
                count[key] += 1
                idx = np.arange(s * bs, (s + 1) * bs) % len(y)
                walls.append(trainers[key].step({"input": x[idx]}, y[idx])["step_time"])
            return walls

        res = harness.interleave({k: (lambda k=k: steps(k)) for k in trainers}, rounds, gap=0.3)
    print(f"{name}, batch {bs}, {rounds} rounds of {block} steps, load {os.getloadavg()}")
    for opt in ("adam", "kfac"):
        med = {lab: [1e3 * float(np.median(r)) for r in res[f"{opt} {lab}"]] for lab in ("old", "new")}
        ratios = [n / o for n, o in zip(med["new"], med["old"])]
        print(f"{opt}: old {harness.median(med['old']):.1f} ms ({min(med['old']):.1f}-{max(med['old']):.1f}), "
              f"new {harness.median(med['new']):.1f} ms ({min(med['new']):.1f}-{max(med['new']):.1f}); "
              f"new/old per round {harness.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
