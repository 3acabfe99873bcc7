"""The one harness every benchmark entry point uses: the to-target loop, timing with medians
(and the min-max beside them), interleaved repetitions, and the results file.

* `to_target(step, loss, ...)`: steps and seconds until a loss is at most a target (or a
  step cap, a time cap, a non-finite loss), the loss evaluated every few steps and never timed.
* `median`, `Spread` / `spread`: a median with the min-max of the samples; `timed` (a
  function's per-call seconds after warm-up); `interleave` (rounds in which every contender
  runs in turn, the order rotating, so that a machine whose speed drifts exposes all of them
  to the same drift) and `round_ratios` (the per-round ratios that cancel the drift).
* `Run`: one benchmark run's record. Made at the start it notes the date, the machine (CPU
  model, cores, memory, platform, library versions), the git commit (with a "dirty" flag) and
  the 1/5/15-minute load; `Run.write(...)` adds the load at the end and writes
  `<out>/<YYYY-MM-DD>-<name>.md` (a header with all of that, then the body) and, given data,
  `<name>.json` beside it. The default `<out>` is benchmarks/results/.

numpy is the only dependency; nothing here imports kfac_compiler.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def import_paths() -> None:
    """Put the repository root and benchmarks/ on sys.path (scripts run from anywhere)."""
    for path in (ROOT, HERE):
        if path not in sys.path:
            sys.path.insert(0, path)


# ------------------------------------------------------------------------------ statistics
def median(xs: Iterable[float | None]) -> float:
    """The median of the values that are not None; nan when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else float("nan")


@dataclass(frozen=True)
class Spread:
    """A sample's median with its min-max (and how many values it has)."""

    median: float
    lo: float
    hi: float
    n: int

    def scaled(self, k: float) -> Spread:
        return Spread(self.median * k, self.lo * k, self.hi * k, self.n)

    def format(self, spec: str = ".3f", unit: str = "") -> str:
        """"1.234 ms (1.100-1.500)"."""
        if self.n == 0:
            return "-"
        return f"{self.median:{spec}}{unit} ({self.lo:{spec}}-{self.hi:{spec}})"

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def spread(xs: Iterable[float | None]) -> Spread:
    vals = [x for x in xs if x is not None]
    if not vals:
        return Spread(float("nan"), float("nan"), float("nan"), 0)
    return Spread(statistics.median(vals), min(vals), max(vals), len(vals))


def timed(fn: Callable[[], object], reps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of `reps` calls of fn() after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleave(contenders: Mapping[str, Callable[[], float | Sequence[float]]], rounds: int, *,
               gap: float = 0.0, rotate: bool = True, warmup: int = 0) -> dict[str, list[list[float]]]:
    """Rounds in which every contender's fn() runs once, in turn; fn returns one sample or a
    list of them (e.g. the step times of a block of steps). `gap` seconds of pause before each
    block lets the previous contender's spinning worker threads go idle; `rotate` starts each
    round with the next contender. `warmup` unrecorded calls of each come first. Returns
    {name: [samples of round 0, samples of round 1, ...]}."""
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names) if rotate else 0
        for name in names[k:] + names[:k]:
            if gap:
                time.sleep(gap)  # a pause between blocks is the measurement's design, not synchronization
            got = contenders[name]()
            out[name].append(list(got) if isinstance(got, (list, tuple)) else [got])
    return out


def interleaved_ms(blocks: Mapping[str, Callable[[], object]], per_block: int, rounds: int, *,
                   gap: float = 0.05, warmup: int = 1) -> dict[str, list[float]]:
    """{name: ms per unit of each timed run of blocks[name]()}, every block run once a round
    (`interleave`: rotated, `gap` s of pause before each, `warmup` unrecorded runs first); a
    block is `per_block` units (e.g. steps)."""
    def timed_block(fn: Callable[[], object]) -> Callable[[], float]:
        return lambda: timed(fn, 1, warmup=0)[0] / per_block * 1e3
    res = interleave({k: timed_block(fn) for k, fn in blocks.items()}, rounds, gap=gap, warmup=warmup)
    return {k: flat(v) for k, v in res.items()}


def flat(rounds: Sequence[Sequence[float]]) -> list[float]:
    return [x for r in rounds for x in r]


def round_ratios(res: Mapping[str, Sequence[Sequence[float]]], a: str, b: str,
                 stat: Callable[[Sequence[float]], float] = statistics.fmean) -> list[float]:
    """stat(a's samples) / stat(b's samples) per round that both ran."""
    return [stat(x) / stat(y) for x, y in zip(res[a], res[b]) if x and y]


# ------------------------------------------------------------------------------ to target
@dataclass
class TargetRun:
    """What to_target saw: `steps` taken, `seconds` of steps (evaluations not included), the
    last evaluated `loss`, why it stopped (`stop`: "reached", "steps", "time", "diverged"),
    when each target was first reached ({target: (steps, seconds)}), the loss at each
    checkpoint step ({step: (loss, seconds)}), the evaluated curve [(step, loss)] and every
    step's seconds."""

    steps: int = 0
    seconds: float = 0.0
    loss: float = float("nan")
    stop: str = "steps"
    hits: dict = field(default_factory=dict)
    marks: dict = field(default_factory=dict)
    curve: list = field(default_factory=list)
    step_times: list = field(default_factory=list)

    @property
    def reached(self) -> bool:
        return self.stop == "reached"

    def hit(self, target: float) -> tuple[int | None, float | None]:
        return self.hits.get(target, (None, None))

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seconds": self.seconds, "loss": self.loss, "stop": self.stop,
                "reached": self.reached, "hits": {str(k): v for k, v in self.hits.items()},
                "marks": {str(k): v for k, v in self.marks.items()}, "curve": self.curve,
                "median_step_s": median(self.step_times)}


def to_target(step: Callable[[int], float | None], loss: Callable[[], float], *, max_steps: int,
              targets: Sequence[float] = (), every: int = 5, checkpoints: Sequence[int] = (),
              stop_at_target: bool = True, max_seconds: float | None = None) -> TargetRun:
    """Train with step(k) for k = 0, 1, ... (it returns the batch loss, or None) until loss()
    is at most every target, `max_steps` steps, `max_seconds` of wall time (evaluations
    included), or a non-finite batch or evaluated loss. loss() runs every `every` steps, at
    each checkpoint step and after the last step; only the steps are timed. With
    `stop_at_target=False` it runs all `max_steps` and records when each target was reached."""
    run = TargetRun()
    wanted = set(targets)
    marks = set(checkpoints)
    start = time.perf_counter()
    for k in range(max_steps):
        t0 = time.perf_counter()
        batch_loss = step(k)
        run.step_times.append(time.perf_counter() - t0)
        run.seconds += run.step_times[-1]
        run.steps = k + 1
        if batch_loss is not None and not math.isfinite(batch_loss):
            run.loss, run.stop = float(batch_loss), "diverged"
            return run
        out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        last = run.steps == max_steps
        if not (run.steps % every == 0 or run.steps in marks or last or out_of_time):
            continue
        run.loss = float(loss())
        run.curve.append((run.steps, run.loss))
        if run.steps in marks:
            run.marks[run.steps] = (run.loss, run.seconds)
        if not math.isfinite(run.loss):
            run.stop = "diverged"
            return run
        for t in wanted - set(run.hits):
            if run.loss <= t:
                run.hits[t] = (run.steps, run.seconds)
        if wanted and len(run.hits) == len(wanted):
            run.stop = "reached"
            if stop_at_target:
                return run
        if out_of_time:
            run.stop = "time" if run.stop != "reached" else run.stop
            return run
    return run


# ------------------------------------------------------------------------------ the record
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> dict:
    """{"commit": HEAD's hash or None, "dirty": whether tracked files differ from it}."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": None if status is None else bool(status)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    """The CPU model, cores, memory, platform and the versions of what the timings run on."""
    out = {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gb": memory_gb(),
           "platform": platform.platform(), "python": platform.python_version()}
    for mod in ("numpy", "onnxruntime", "torch"):
        if mod in sys.modules:  # only what the run imported: importing torch here costs seconds
            out[mod] = getattr(sys.modules[mod], "__version__", "?")
    return out


def today() -> str:
    return datetime.date.today().isoformat()


class Run:
    """One run of a benchmark: made at its start, written at its end (see the module doc)."""

    def __init__(self, name: str, argv: Sequence[str] | None = None, script: str | None = None):
        self.name = name
        self.date = today()
        self.script = script or os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.load_before = load()
        self.started = time.perf_counter()
        self.extra: dict = {}

    @property
    def command(self) -> str:
        return " ".join(["python", self.script, *self.argv])

    def header(self) -> dict:
        return {"name": self.name, "date": self.date, "command": self.command, "machine": machine(),
                **commit(), "load_before": self.load_before, "load_after": load(),
                "seconds": round(time.perf_counter() - self.started, 1), **self.extra}

    def markdown_header(self, head: dict, title: str | None = None) -> str:
        m = head["machine"]
        mem = f", {m['memory_gb']:.0f} GiB" if m.get("memory_gb") else ""
        libs = ", ".join(f"{k} {m[k]}" for k in ("numpy", "onnxruntime", "torch") if k in m)
        commit_text = (head["commit"] or "unknown")[:12] + (" (dirty)" if head["dirty"] else "")
        lines = [f"# {title or self.name} ({head['date']})", "",
                 f"- command: `{head['command']}`",
                 f"- machine: {m['cpu']}, {m['cores']} cores{mem}; {m['platform']}, Python {m['python']}"
                 + (f"; {libs}" if libs else ""),
                 f"- commit: {commit_text}",
                 f"- load (1/5/15 min): {head['load_before']} before, {head['load_after']} after; "
                 f"{head['seconds']:.0f} s"]
        lines += [f"- {k}: {v}" for k, v in self.extra.items()]
        return "\n".join(lines) + "\n"

    def write(self, body: str, data: object = None, out: str | None = RESULTS, title: str | None = None) -> str | None:
        """Write <out>/<date>-<name>.md (header + body) and, with data, the .json beside it;
        returns the .md path (None and nothing written when out is None or "-")."""
        if not out or out == "-":
            return None
        head = self.header()
        os.makedirs(out, exist_ok=True)
        base = os.path.join(out, f"{self.date}-{self.name}")
        with open(base + ".md", "w", encoding="utf-8") as f:
            f.write(self.markdown_header(head, title) + "\n" + body.rstrip() + "\n")
        if data is not None:
            with open(base + ".json", "w", encoding="utf-8") as f:
                json.dump({"header": head, "results": data}, f, indent=1, default=_json_default)
        print(f"wrote {base}.md" + (" and .json" if data is not None else ""), file=sys.stderr)
        return base + ".md"


def _json_default(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def add_out_argument(ap: argparse.ArgumentParser) -> None:
    """--out DIR (default benchmarks/results; "-": write nothing) on a (sub)command."""
    ap.add_argument("--out", default=RESULTS,
                    help="folder for <date>-<name>.md/.json (default benchmarks/results; '-': print only)")


def table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def skip(what: str, why: str) -> str:
    """The one line a benchmark prints for a peer or a part it cannot run here."""
    line = f"{what}: skipped ({why})"
    print(line, flush=True)
    return line


class Report:
    """Lines printed as they come and kept for the results file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def require(module: str, why: str):
    """Import `module` or stop the benchmark with one line saying what it is needed for."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"skipped: {why} needs {module} (pip install {module})") from None


def main(parser: argparse.ArgumentParser, prefix: str, argv: Sequence[str] | None = None) -> int:
    """Parse argv with a parser whose subcommands set `func(args, say, run) -> data` and
    `name`; run the chosen one and write its results file (`--out`)."""
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    run = Run(f"{prefix}-{args.name}", argv)
    say = Report()
    data = args.func(args, say, run)
    if data is not None or say.lines:
        run.write(say.text(), data, getattr(args, "out", None), title=f"{prefix} {args.name}")
    return 0


def parse_knobs(items: str | Sequence[str] | None) -> dict:
    """"a=1,b=2.5" or ["a=1", "b=2.5"] -> {"a": 1, "b": 2.5} (optimizer knobs on a command line)."""
    def number(text: str) -> int | float:
        try:
            return int(text)
        except ValueError:
            return float(text)

    items = items.split(",") if isinstance(items, str) else (items or ())
    return {k.strip(): number(v.strip()) for k, v in (kv.split("=", 1) for kv in items)}


def command_parser(doc: str) -> tuple[argparse.ArgumentParser, Callable]:
    """An entry point's parser from its module doc (first line: the description; from the
    third paragraph on: the epilog), and add(name, func, help) -> the subcommand's parser,
    which has --out and sets func and name for main()."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n\n", 2)[2])
    sub = ap.add_subparsers(title="subcommands", metavar="SUBCOMMAND")

    def add(name: str, func: Callable, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=(func.__doc__ or help).strip())
        p.set_defaults(func=func, name=name)
        add_out_argument(p)
        return p

    return ap, add
