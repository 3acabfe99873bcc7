"""Data-parallel K-FAC on this machine: step time against the number of ranks, and the bytes
each rank sends per step by kind, measured (runtime/comm.py counts them).

    python benchmarks/bench_mpi.py [--models mlp_classifier small_cnn resnet18] [--ranks 1 2 4]
                                   [--steps 30] [--out DIR]

For each model (compiled once into a plan folder under /tmp) and each P the same global batch
trains under `mpirun -n P` (P = 1: one process, the fused step; "1 staged": one rank with a
communicator, the step cut into its stages, which is the staging's own cost). Reported: the
median step time of the timed steps (the first `--warmup` steps, which build sessions and run
the first refresh, are left out), the time in collectives, and the bytes per step by kind.
Ranks on one machine share its cores (threads per rank = cores / P), so on a 2-core machine
this measures the overheads of the data-parallel step, not a speed-up: docs/distributed.md
models many GPUs. Writes <out>/<date>-mpi-scaling.{md,json} (with the date, machine, commit
and load; benchmarks/harness.py; `--out -` prints only).

    python benchmarks/bench_mpi.py --gap [--models ...] [--ranks 2 4] [--batch 128] [--steps 30]

`--gap`: no timing; every model (default: the whole zoo) trains with K-FAC and with Adam at
default settings on one process and under `mpirun -n P`, the same global batch and seed, and
the worst relative loss gap over the steps, max_t |loss_P(t) - loss_1(t)| / |loss_1(t)|, is
reported per model, optimizer and P (docs/distributed.md, "Same math as one process"),
beside two one-process references: on one thread against the default threads (the same math,
where ONNX Runtime's kernels sum in another order: a lower bound of rounding), and with every
initial parameter moved by one float32 ulp (np.nextafter): how far the optimizer carries a
rounding-sized difference in 30 steps.
Writes <out>/<date>-mpi-gap.{md,json}.

    python benchmarks/bench_mpi.py --vs-fused [--models small_cnn resnet18] [--rounds 8] [--block 5]

`--vs-fused`: the staged step's own cost on one process. Two warm workers, one stepping the
fused step and one the staged step (an MPI singleton with a communicator: the program a
data-parallel rank runs, all-reduces over one rank), take turns: each round every worker runs
`--block` steps, the order rotating, both on the same steps of the same run (the same
statistics, refresh and damping steps). Reported per model: the median step with the min-max
of the per-round medians, the median of the per-round ratios staged / fused, and the staged
step's seconds per stage session. Writes <out>/<date>-staged-vs-fused.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

harness.import_paths()
BATCH = {"mlp_classifier": 256, "small_cnn": 128, "resnet18": 32}


def plan_dir(model: str, cache: str) -> str:
    """The model's plan folder (compiled on first use)."""
    import kfac_compiler as kc

    path = os.path.join(cache, f"{model}.plan")
    if os.path.exists(os.path.join(path, "plan.json")):
        return path
    if model == "resnet18":
        from kfac_compiler.models import torch_exports as te

        onnx_path = os.path.join(cache, "resnet18.onnx")
        te.export(te.resnet18(), onnx_path, te.digits_images(8)[0]["input"])
        plan = kc.compile(onnx_path, loss="softmax_cross_entropy")
    else:
        from kfac_compiler.models import ZOO

        e = ZOO[model]
        plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name)
    plan.save(path)
    return path


def data_for(model: str, n: int):
    if model == "resnet18":
        from kfac_compiler.models import torch_exports as te

        return te.digits_images(n)
    from kfac_compiler.models import ZOO

    return ZOO[model].make_data(n=n)


def serve(args: argparse.Namespace) -> None:
    """A warm worker for --vs-fused: builds its trainer, runs --warmup steps, then per line
    "N" on stdin runs the next N steps and prints one JSON line: their seconds and, staged,
    each stage session's seconds."""
    from kfac_compiler.plan import load_plan
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.comm import Communicator, mpi
    from kfac_compiler.runtime.data import batch_indices

    comm = Communicator(mpi().COMM_WORLD) if args.staged_one else None
    batch = args.batch or BATCH[args.model]
    inputs, targets = data_for(args.model, 4 * batch)
    trainer = Trainer(load_plan(args.plan), optimizer=args.optimizer, seed=0, batch_size=batch, comm=comm,
                      threads=args.threads)
    n, step = targets.shape[0], 0

    def run(count: int) -> dict:
        nonlocal step
        stages = [p for p in trainer.programs().values() if hasattr(p, "programs")]
        before = [[q.session_seconds for q in p.programs] for p in stages]
        times = []
        cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(count):
            idx = batch_indices(n, batch, step, 0)
            t0 = time.perf_counter()
            trainer.step({k: v[idx] for k, v in inputs.items()}, targets[idx])
            times.append(time.perf_counter() - t0)
            step += 1
        per_stage: list[float] = []
        for p, was in zip(stages, before):  # summed over the step's variants (first step, statistics)
            got = [q.session_seconds - w for q, w in zip(p.programs, was)]
            per_stage = [a + b for a, b in zip(per_stage, got)] if per_stage else got
        return {"times": times, "stages": per_stage, "threads": trainer.threads,
                "cpu_s": (time.process_time() - cpu0) / max(1, count),
                "page_faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / max(1, count)}

    run(args.warmup)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(int(line))), flush=True)


class Served:
    """A --serve worker process: call() runs the next `block` steps and returns their seconds."""

    def __init__(self, model: str, plan: str, staged: bool, args: argparse.Namespace) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--serve", "--model", model, "--plan", plan,
               "--warmup", str(args.warmup), "--optimizer", args.optimizer]
        if args.batch:
            cmd += ["--batch", str(args.batch)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if staged:
            cmd.append("--staged-one")
        self.block = args.block
        self.stages: list[list[float]] = []
        self.cpu: list[float] = []  # per block: the process's CPU seconds per step (every thread)
        self.faults: list[float] = []  # per block: minor page faults per step (memory touched afresh)
        self.threads = None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise SystemExit(f"worker exited with {self.proc.wait()}")

    def __call__(self) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{self.block}\n")
        self.proc.stdin.flush()
        got = self._read()
        self.stages.append(got["stages"])
        self.cpu.append(got["cpu_s"])
        self.faults.append(got["page_faults"])
        self.threads = got["threads"]
        return got["times"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def vs_fused(args: argparse.Namespace) -> None:
    """The staged step against the fused one on one process, interleaved (see --vs-fused)."""
    run = harness.Run("staged-vs-fused")
    os.makedirs(args.cache, exist_ok=True)
    rows, results = [], []
    for model in args.models:
        plan = plan_dir(model, args.cache)
        workers = {"fused": Served(model, plan, False, args), "staged": Served(model, plan, True, args)}
        try:
            res = harness.interleave(workers, args.rounds, gap=0.5)
        finally:
            for w in workers.values():
                w.close()
        per_round = {k: harness.spread([harness.median(r) for r in v]) for k, v in res.items()}
        steps = {k: harness.median(harness.flat(v)) for k, v in res.items()}
        ratio = harness.spread(harness.round_ratios(res, "staged", "fused", harness.median))
        stage_s = [sum(col) / (args.rounds * args.block) for col in zip(*workers["staged"].stages)]
        share = " / ".join(f"{1e3 * s:.1f}" for s in stage_s)
        cpu = {k: harness.median(w.cpu) for k, w in workers.items()}
        faults = {k: harness.median(w.faults) for k, w in workers.items()}
        rows.append([model, str(workers["fused"].threads), f"{1e3 * steps['fused']:.1f} ms",
                     per_round["fused"].scaled(1e3).format(".1f"), f"{1e3 * steps['staged']:.1f} ms",
                     per_round["staged"].scaled(1e3).format(".1f"), ratio.format(".2f", "x"), share,
                     f"{1e3 * cpu['fused']:.1f} / {1e3 * cpu['staged']:.1f} ms",
                     f"{faults['fused']:.0f} / {faults['staged']:.0f}"])
        results.append({"model": model, "rounds": args.rounds, "block": args.block, "threads": workers["fused"].threads,
                        "fused_s": res["fused"], "staged_s": res["staged"], "ratio": ratio.as_dict(),
                        "stage_seconds_per_step": stage_s, "cpu_s_per_step": cpu, "page_faults_per_step": faults})
        print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith("_s")}), flush=True)
    head = ["model", "threads", "fused: median step", "fused: per-round medians", "staged: median step",
            "staged: per-round medians", "staged / fused (per-round)", "staged: ms per step in each stage",
            "CPU per step, fused / staged", "page faults per step, fused / staged"]
    table = harness.table(head, rows)
    run.write(f"One process, {args.rounds} interleaved rounds of {args.block} steps per worker after {args.warmup} "
              "warm-up steps; the staged worker is an MPI singleton with a communicator.\n\n" + table, results,
              args.out, title="The staged step against the fused step on one process")
    print(table)


def worker(args: argparse.Namespace) -> None:
    """One rank's run: --steps steps at the global batch; rank 0 prints a JSON line."""
    from kfac_compiler.plan import load_plan
    from kfac_compiler.runtime import Trainer
    from kfac_compiler.runtime.comm import Communicator, mpi
    from kfac_compiler.runtime.data import batch_indices

    comm = "auto"
    if args.staged_one:
        comm = Communicator(mpi().COMM_WORLD)
    plan = load_plan(args.plan)
    batch = args.batch or BATCH[args.model]
    inputs, targets = data_for(args.model, 4 * batch)
    trainer = Trainer(plan, optimizer=args.optimizer, seed=0, batch_size=batch, comm=comm, threads=args.threads)
    if args.ulp:  # a rounding-sized start: every parameter one float32 ulp up
        import numpy as np

        trainer.set_parameters({p: np.nextafter(v, np.float32(np.inf)) for p, v in trainer.parameters().items()})
    n = targets.shape[0]
    times, comm_s, losses = [], [], []
    sent0 = None
    for step in range(args.steps):
        idx = batch_indices(n, batch, step, 0)
        c0 = trainer.comm.seconds if trainer.comm else 0.0
        t0 = time.perf_counter()
        losses.append(trainer.step({k: v[idx] for k, v in inputs.items()}, targets[idx])["loss"])
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            comm_s.append((trainer.comm.seconds if trainer.comm else 0.0) - c0)
        if step + 1 == args.warmup and trainer.comm:
            sent0 = dict(trainer.comm.sent)
    if trainer.rank == 0:
        timed = args.steps - args.warmup
        sent = {}
        if trainer.comm:
            sent = {k: (v - (sent0 or {}).get(k, 0)) / timed for k, v in trainer.comm.sent.items()}
        print(json.dumps({"model": args.model, "ranks": trainer.ranks, "staged": trainer.comm is not None,
                          "threads": trainer.threads, "batch": batch, "median_step_s": harness.median(times),
                          "median_comm_s": harness.median(comm_s), "bytes_per_step": sent,
                          "parameters": int(sum(v.size for v in trainer.parameters().values())),
                          "optimizer": args.optimizer, "losses": losses}))


def launch(model: str, plan: str, ranks: int, staged_one: bool, args: argparse.Namespace,
           threads: int | None = None, ulp: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--plan", plan,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--optimizer", args.optimizer]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if threads:
        cmd += ["--threads", str(threads)]
    if ulp:
        cmd.append("--ulp")
    if staged_one:
        cmd.append("--staged-one")
    if ranks > 1 or staged_one:
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        from mpi_util import rank_command

        cmd = rank_command(ranks, cmd)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"{model} on {ranks} ranks failed:\n{out.stderr[-2000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def render(rows: list[dict]) -> str:
    kinds = sorted({k for r in rows for k in r["bytes_per_step"]})
    head = ["model", "ranks", "threads/rank", "batch (global)", "median step", "vs 1 process", "in collectives",
            *[f"{k} B/step" for k in kinds]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {r["model"]: r["median_step_s"] for r in rows if r["ranks"] == 1 and not r["staged"]}
    for r in rows:
        label = f"{r['ranks']}" + (" staged" if r["ranks"] == 1 and r["staged"] else "")
        cells = [r["model"], label, str(r["threads"]), str(r["batch"]), f"{1e3 * r['median_step_s']:.1f} ms",
                 f"{r['median_step_s'] / base[r['model']]:.2f}x", f"{1e3 * r['median_comm_s']:.1f} ms",
                 *[f"{r['bytes_per_step'].get(k, 0):,.0f}" for k in kinds]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def worst_gap(losses: list[float], reference: list[float]) -> tuple[float, int]:
    """(max_t |losses[t] - reference[t]| / |reference[t]|, the first step t reaching it)."""
    gaps = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    worst = max(gaps)
    return worst, gaps.index(worst)


def gap(args: argparse.Namespace) -> None:
    """The worst relative loss gap of P ranks against one process, per model and optimizer."""
    from kfac_compiler.models import ZOO

    run = harness.Run("mpi-gap")
    os.makedirs(args.cache, exist_ok=True)
    results, rows = [], []
    for model in args.models or list(ZOO):
        plan = plan_dir(model, args.cache)
        for optimizer in ("kfac", "adam"):
            args.optimizer = optimizer
            one = launch(model, plan, 1, False, args)
            cells = [model, optimizer, f"{one['losses'][0]:.4f}", f"{one['losses'][-1]:.4f}"]
            threaded = launch(model, plan, 1, False, args, threads=1)
            worst, at = worst_gap(threaded["losses"], one["losses"])
            results.append({"model": model, "optimizer": optimizer, "ranks": 1, "threads": 1, "batch": one["batch"],
                            "worst_relative_gap": worst, "at_step": at, "losses": threaded["losses"],
                            "one_process_losses": one["losses"]})
            cells.append(f"{worst:.1e} (step {at + 1})")
            moved = launch(model, plan, 1, False, args, ulp=True)
            worst, at = worst_gap(moved["losses"], one["losses"])
            results.append({"model": model, "optimizer": optimizer, "ranks": 1, "ulp": True, "batch": one["batch"],
                            "worst_relative_gap": worst, "at_step": at, "losses": moved["losses"],
                            "one_process_losses": one["losses"]})
            cells.append(f"{worst:.1e} (step {at + 1})")
            for ranks in [r for r in args.ranks if r > 1]:
                got = launch(model, plan, ranks, False, args)
                worst, at = worst_gap(got["losses"], one["losses"])
                results.append({"model": model, "optimizer": optimizer, "ranks": ranks, "batch": one["batch"],
                                "worst_relative_gap": worst, "at_step": at, "losses": got["losses"],
                                "one_process_losses": one["losses"]})
                cells.append(f"{worst:.1e} (step {at + 1})")
                print(json.dumps(results[-1]), flush=True)
            rows.append(cells)
    head = ["model", "optimizer", "loss, step 1", f"loss, step {args.steps} (1 process)",
            "1 process on 1 thread: worst gap", "1 process, parameters 1 ulp up: worst gap", *[f"{r} ranks: worst gap" for r in args.ranks if r > 1]]
    table = harness.table(head, rows)
    run.write(f"Global batch {args.batch or 'per model'}, seed 0, default settings, {args.steps} steps; worst "
              "relative loss gap max_t |loss_P - loss_1| / |loss_1| against one process (the step where it "
              "is reached).\n\n" + table, results, args.out, title="Data-parallel runs against one process")
    print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None,
                   help="default: mlp_classifier small_cnn resnet18 (timing), the whole zoo (--gap)")
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    harness.add_out_argument(p)
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "kfac-bench-mpi"))
    p.add_argument("--gap", action="store_true", help="the loss gap against one process instead of step times")
    p.add_argument("--vs-fused", action="store_true",
                   help="the staged step against the fused one on one process, interleaved")
    p.add_argument("--rounds", type=int, default=8, help="--vs-fused: interleaved rounds")
    p.add_argument("--block", type=int, default=5, help="--vs-fused: steps per worker and round")
    p.add_argument("--batch", type=int, default=None, help="the global batch (default: per model; --gap: 128)")
    p.add_argument("--optimizer", default="kfac", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ulp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--staged-one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        serve(args) if args.serve else worker(args)
        return
    if args.vs_fused:
        args.models = args.models or ["small_cnn", "resnet18"]
        vs_fused(args)
        return
    if args.gap:
        args.batch = args.batch or 128
        gap(args)
        return
    args.models = args.models or ["mlp_classifier", "small_cnn", "resnet18"]
    run = harness.Run("mpi-scaling")
    os.makedirs(args.cache, exist_ok=True)
    rows = []
    for model in args.models:
        plan = plan_dir(model, args.cache)
        for ranks in args.ranks:
            rows.append(launch(model, plan, ranks, False, args))
            print(json.dumps(rows[-1]), flush=True)
            if ranks == 1:
                rows.append(launch(model, plan, 1, True, args))
                print(json.dumps(rows[-1]), flush=True)
    table = render(rows)
    run.write("Open MPI on loopback; medians of the timed steps.\n\n" + table, rows, args.out,
              title="Data-parallel K-FAC on this machine")
    print(table)


if __name__ == "__main__":
    main()
