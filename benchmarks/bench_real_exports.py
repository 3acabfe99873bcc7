"""Real exports (tests/fixtures/real: ResNet, MobileNet v2/v3, HF GPT-2/BERT, the hand-written
GPT, nn.LSTM/nn.GRU LMs from the TorchScript and torch.export exporters): what the compiler
makes of each, and K-FAC against Adam on a learnable task.

    python benchmarks/bench_real_exports.py [--fixtures tests/fixtures/real] [--steps 20]
        [--batch-size 32] [--only gpt2 ...] [--out benchmarks/results/<date>-real-exports.md]

Per fixture: compiles (kc.compile with softmax_cross_entropy on "logits", or the one-line
error; the columns up to "frozen" then come from the front end alone, emit=False), layers by kind, blocks (kind/approximation: count), trainable initializers against
those holding torch parameters (the fixture's record), constants trained (float initializers
holding no torch parameter but trained), frozen initializers (plan.frozen: count, examples),
then `--steps` steps of K-FAC (defaults) and of Adam (defaults, lr 1e-3) on the same batch
stream (consecutive batches of the digits in the zoo's seeded order: 16x16 RGB digit images
for the CNNs, rows of pixel tokens with next-pixel targets for the LMs; models/real_data.py),
and the mean loss of 256 held-out examples before and after (the LMs' loss sums 8 positions).
No torch needed. Writes a markdown table to `--out` and prints it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

import kfac_compiler as kc
from kfac_compiler.models.real_data import batch

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = 256


def one_line(e: BaseException) -> str:
    msg = str(e).splitlines()[0].replace(str(ROOT) + os.sep, "") if str(e) else ""
    return f"{type(e).__name__}: {msg[:160]}"


def train(plan, optimizer: str, x, y, steps: int, bs: int):
    from kfac_compiler.runtime import Trainer

    tr = Trainer(plan, optimizer=optimizer, device="cpu", seed=0, batch_size=bs)
    ex, ey = x[-HELD_OUT:], y[-HELD_OUT:]
    before = tr.evaluate({"input": ex}, ey)["loss"]
    t = time.perf_counter()
    for s in range(steps):
        lo = (s * bs) % (len(y) - HELD_OUT - bs)
        tr.step({"input": x[lo:lo + bs]}, y[lo:lo + bs])
    secs = (time.perf_counter() - t) / max(steps, 1)
    return before, tr.evaluate({"input": ex}, ey)["loss"], secs


def bench(case: str, entry: dict, fixtures: Path, steps: int, bs: int) -> dict:
    row = {"fixture": case, "family": entry["family"], "exporter": entry["exporter"], "opset": entry.get("opset")}
    with np.load(fixtures / f"{case}.npz") as d:
        if "init_names" in d.files:
            held = [str(n) for n in d["init_names"]]
            consts = {str(n) for n in d["frozen_names"]}
        else:  # a default-initialisation fixture: merged tensors, no per-tensor record
            held, consts = None, set()
            row["expected_elements"] = int(d["expected_elements"])
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = kc.compile(str(fixtures / f"{case}.onnx"), loss="softmax_cross_entropy", output="logits")
    except Exception as e:  # noqa: BLE001 - reported
        row["compiles"] = one_line(e)
        try:  # what the front end alone makes of it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = kc.compile(str(fixtures / f"{case}.onnx"), loss="softmax_cross_entropy", output="logits",
                                  emit=False)
        except Exception:  # noqa: BLE001 - the error above is the one reported
            return row
        row["frontend_only"] = True
    else:
        row["compiles"] = "yes"
    row["compile_s"] = time.perf_counter() - t
    row["layers"] = dict(Counter(layer.kind for layer in plan.layers))
    row["blocks"] = dict(Counter(f"{layer.kind}/{layer.approximation}" for layer in plan.layers))
    row["trainable"] = len(plan.trainable)
    if held is not None:
        holding = {h for name in held for h in plan.holders(name)}  # retied copies, lowered pieces
        row["held"] = len(holding)
        row["missing"] = sorted(holding - set(plan.trainable))
        row["constants_trained"] = sorted(set(plan.trainable) & consts) + sorted(set(plan.trainable) - holding - consts)
    else:
        with warnings.catch_warnings():  # one flag unties the exporter's merges (docs/frontend.md)
            warnings.simplefilter("ignore")
            plan = kc.compile(str(fixtures / f"{case}.onnx"), loss="softmax_cross_entropy", output="logits",
                              untie="uniform")
        values = plan.parameter_values()
        shapes = plan.param_shapes
        row["elements"] = int(sum(values[p].size for p in plan.trainable)) + int(
            sum(np.prod(shapes[v["of"]]) for v in plan.retied.values()))  # the twin counts an exporter's copy
    row["frozen"] = list(plan.frozen)
    row["warnings"] = len(plan.notes)
    if row.get("frontend_only"):
        return row
    x, y = batch(entry["kind"], None, seed=0)
    for opt in ("kfac", "adam"):
        try:
            before, after, secs = train(plan, opt, x, y, steps, bs)
            row["loss0"] = before
            row[opt] = after
            row[f"{opt}_ms"] = 1e3 * secs
        except Exception as e:  # noqa: BLE001 - reported
            row[opt] = one_line(e)
    return row


def fmt_loss(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else (str(v) if v is not None else "")


def fmt_counts(d: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) if d else ""


def fmt_list(xs: list | None, k: int = 3) -> str:
    if not xs:
        return "0"
    return f"{len(xs)}: " + ", ".join(f"`{x}`" for x in xs[:k]) + (", ..." if len(xs) > k else "")


def table(rows: list[dict], steps: int, bs: int) -> str:
    head = ["fixture", "opset", "compiles", "layers", "blocks", "trainable / held", "constants trained",
            "frozen", "held-out loss at 0", f"K-FAC at {steps}", f"Adam at {steps}", "K-FAC ms/step", "Adam ms/step"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("compiles") != "yes" and not r.get("frontend_only"):
            out.append(f"| {r['fixture']} | {r.get('opset', '')} | {r.get('compiles', '')} |" + " |" * (len(head) - 3))
            continue
        if "held" in r:
            tr = f"{r['trainable']} / {r['held']}" + (f" (missing {len(r['missing'])})" if r["missing"] else "")
        else:  # default initialisation: trainable elements against the random-weight twin's
            tr = f"{r['trainable']} tensors, {r['elements']} / {r['expected_elements']} elements"
        compiles = "yes" if r["compiles"] == "yes" else "no (front end only): " + r["compiles"][:110]
        cells = [r["fixture"], str(r["opset"]), compiles, fmt_counts(r["layers"]), fmt_counts(r["blocks"]), tr,
                 fmt_list(r["constants_trained"]) if "held" in r else "?", fmt_list(r["frozen"], 2), fmt_loss(r.get("loss0")),
                 fmt_loss(r.get("kfac")), fmt_loss(r.get("adam")),
                 f"{r['kfac_ms']:.1f}" if "kfac_ms" in r else "", f"{r['adam_ms']:.1f}" if "adam_ms" in r else ""]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", default=str(ROOT / "tests" / "fixtures" / "real"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--only", nargs="*", help="families")
    ap.add_argument("--out", default=None, help="markdown file (default benchmarks/results/<date>-real-exports.md)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    fixtures = Path(args.fixtures)
    manifest = json.loads((fixtures / "manifest.json").read_text())
    rows = []
    for case, entry in manifest.items():
        if args.only and entry["family"] not in args.only:
            continue
        if entry.get("status") != "ok":
            rows.append({"fixture": case, "compiles": f"not exported: {entry.get('status')}"})
            continue
        rows.append(bench(case, entry, fixtures, args.steps, args.batch_size))
        r = rows[-1]
        print(case, r.get("compiles"), fmt_loss(r.get("loss0")), fmt_loss(r.get("kfac")), fmt_loss(r.get("adam")),
              file=sys.stderr, flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = args.out or str(ROOT / "benchmarks" / "results" / f"{date}-real-exports.md")
    import platform

    import onnxruntime

    text = (f"# Real exports: compile, blocks, K-FAC vs Adam ({date})\n\n"
            f"`python benchmarks/bench_real_exports.py --steps {args.steps} --batch-size {args.batch_size}` on "
            f"{platform.machine()} CPU ({os.cpu_count()} cores), onnxruntime {onnxruntime.__version__}, fixtures "
            f"{os.path.relpath(fixtures, ROOT)} (models/real_exports.py). Losses: mean over {HELD_OUT} held-out "
            f"examples (LMs: summed over 8 positions), after {args.steps} steps of batch {args.batch_size} with "
            "default settings (K-FAC: the Trainer's defaults; Adam: lr 1e-3). 'held': initializers holding torch "
            "parameters (the fixture's record); 'constants trained': trained float initializers holding none; "
            "`<family>_init`: the model at its own initialisation (equal tensors merged by the exporter), "
            "trainable elements against those of the random-weight twin's export.\n\n"
            + table(rows, args.steps, args.batch_size) + "\n")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=float)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
