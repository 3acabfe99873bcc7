"""One optimizer of the scale benchmark in its own process, so that its peak memory is its own
(bench_scale.py starts these; not meant to be run by hand).

    python benchmarks/scale_worker.py SPEC_JSON

SPEC_JSON's "role":
  * "compile": compile the ONNX model, save the plan directory; reply the compile time and
    peak RSS, and exit;
  * "ours": load the saved plan (kfac_compiler.load_plan) and build a Trainer;
  * "torch": build the torch module from the parent's weights, with torch's Adam or
    kfac-pytorch.
Then (ours, torch) commands, one JSON object per stdin line, each answered by one stdout line
starting with "@@ " (anything else on stdout is a library's chatter):
  {"cmd": "steps", "start": k, "n": m}   m steps on batches k..k+m-1: their wall times, last loss
  {"cmd": "memory"}                      peak RSS of the load + build and of the steps since
  {"cmd": "target", ...}                 from the initial state, train until the loss on the
                                         evaluation examples reaches "target" (checked every
                                         "every" steps, evaluation not timed) or "max_steps"
  {"cmd": "quit"}
Peak RSS is Linux's VmHWM; after the build it is reset (/proc/self/clear_refs) so that the
steps' peak is measured apart from the build's (the initial-state checkpoint the "target"
command restores is written in between).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def reply(**kw) -> None:
    sys.stdout.write("@@ " + json.dumps(kw, default=float) + "\n")
    sys.stdout.flush()


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ------------------------------------------------------------------------------ memory
def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_mb() -> float:
    hwm = _status_mb("VmHWM")
    if hwm is None:  # not Linux: the lifetime peak
        import resource

        scale = 1024.0 if sys.platform != "darwin" else 1024.0 * 1024.0
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale
    return hwm


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def gpu_peak_mb(device: str) -> float | None:
    if device != "cuda":
        return None
    try:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None
    except ImportError:
        return None


# ------------------------------------------------------------------------------ runners
class Ours:
    """Our runtime: a Trainer on the saved plan."""

    def __init__(self, spec: dict, x: np.ndarray, y: np.ndarray):
        import kfac_compiler as kc
        from kfac_compiler.runtime import Trainer

        self.x, self.y, self.spec = x, y, spec
        plan = kc.load_plan(spec["plan"])
        knobs = dict(spec.get("knobs") or {})
        if spec["optimizer"] == "adam":
            knobs.setdefault("learning_rate", 1e-3)
        self.make = lambda: Trainer(plan, optimizer=spec["optimizer"], device=spec["device"],
                                    batch_size=spec["batch"], seed=0, **knobs)
        self.tr = self.make()
        cfg = self.tr.config
        self.periods = (getattr(cfg, "cov_update_period", None), getattr(cfg, "inv_update_period", None))
        self.ckpt = None

    def save_initial(self, workdir: str) -> None:
        self.ckpt = self.tr.save_checkpoint(os.path.join(workdir, f"init-{self.spec['optimizer']}.ckpt"))

    def step(self, idx: np.ndarray) -> tuple[float, float]:
        m = self.tr.step({"input": self.x[idx]}, self.y[idx])
        return m["step_time"], m["loss"]

    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.tr.evaluate({"input": x}, y, batch_size=self.spec["eval_batch"])["loss"]

    def reset(self) -> None:
        self.tr.restore(self.ckpt)


class Torch:
    """torch's Adam or kfac-pytorch on the exported module's weights."""

    def __init__(self, spec: dict, x: np.ndarray, y: np.ndarray):
        import torch

        from torch_peers import torch_setup

        self.spec, self.torch = spec, torch
        self.periods = tuple(spec["periods"])
        self.setup = torch_setup
        self.reset()
        self.xt, self.yt = torch.from_numpy(x).to(self.dev), torch.from_numpy(y).to(self.dev)

    def reset(self) -> None:
        """A fresh module, optimizer and preconditioner on the parent's initial weights."""
        from scale_models import build

        spec = self.spec
        net = build(spec["model"])[0]
        net.load_state_dict(self.torch.load(spec["state"]))
        self.net = self.opt = self.pre = None  # drop the old ones (and their hooks) first
        self.net, self.opt, self.pre, self.dev = self.setup(net, spec["device"], spec["optimizer"], self.periods,
                                                            spec.get("skip") or (), spec.get("kfac_pytorch"))

    def save_initial(self, workdir: str) -> None:
        pass

    def step(self, idx: np.ndarray) -> tuple[float, float]:
        from torch_peers import timed_torch_step

        i = self.torch.from_numpy(idx).to(self.dev)
        return timed_torch_step(self.net, self.opt, self.pre, self.dev, self.xt[i], self.yt[i])

    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        from torch_peers import full_loss_torch

        return full_loss_torch(self.net, self.dev, x, y, self.spec["eval_batch"])


def to_target(runner, batches: np.ndarray, xe, ye, target, max_steps: int, every: int, max_s: float | None) -> dict:
    """Train from the initial state until the evaluation loss <= target, a non-finite loss,
    max_steps steps, or max_s seconds of wall time (evaluations included); the reported
    seconds exclude the evaluations (harness.to_target)."""
    import harness

    runner.reset()
    run = harness.to_target(lambda k: runner.step(batches[k % len(batches)])[1], lambda: runner.eval_loss(xe, ye),
                            max_steps=max_steps, targets=[] if target is None else [target], every=every,
                            max_seconds=max_s)
    return {"steps": run.steps, "s": run.seconds, "loss": run.loss, "curve": run.curve, "walls": run.step_times,
            "stop": run.stop, "diverged": run.stop == "diverged"}


# ------------------------------------------------------------------------------ main
def compile_plan(spec: dict) -> None:
    import kfac_compiler as kc

    t0 = time.perf_counter()
    plan = kc.compile(spec["onnx"], loss="softmax_cross_entropy", output="logits")
    compile_s = time.perf_counter() - t0
    plan.save(spec["plan"])
    reply(ok=True, compile_s=compile_s, save_s=time.perf_counter() - t0 - compile_s, peak_mb=peak_mb(),
          totals=plan.totals())


def serve(spec: dict) -> None:
    data = np.load(spec["data"])
    x, y, batches = data["x"], data["y"], data["batches"]
    xe, ye = x[data["eval_idx"]], y[data["eval_idx"]]
    base = _status_mb("VmRSS")
    t0 = time.perf_counter()
    runner = (Ours if spec["role"] == "ours" else Torch)(spec, x, y)
    build_s = time.perf_counter() - t0
    build_peak = peak_mb()
    if spec.get("target"):
        runner.save_initial(spec["workdir"])
    reset = reset_peak()
    reply(ok=True, build_s=build_s, base_mb=base, build_peak_mb=build_peak, peak_reset=reset,
          periods=list(runner.periods))
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "steps":
                walls, loss = [], float("nan")
                for k in range(cmd["start"], cmd["start"] + cmd["n"]):
                    w, loss = runner.step(batches[k % len(batches)])
                    walls.append(w)
                reply(ok=True, walls=walls, loss=loss)
            elif cmd["cmd"] == "memory":
                reply(ok=True, steps_peak_mb=peak_mb(), gpu_peak_mb=gpu_peak_mb(spec["device"]))
            elif cmd["cmd"] == "target":
                reply(ok=True, **to_target(runner, batches, xe, ye, cmd.get("target"), cmd["max_steps"],
                                           cmd["every"], cmd.get("max_s")))
            elif cmd["cmd"] == "quit":
                return
        except Exception as e:  # noqa: BLE001 - reported to the parent as the cell's error
            traceback.print_exc(file=sys.stderr)
            reply(ok=False, error=one_line(e))


def main() -> int:
    import warnings

    warnings.simplefilter("ignore")
    spec = json.loads(sys.argv[1])
    try:
        if spec["role"] == "compile":
            compile_plan(spec)
        else:
            serve(spec)
    except Exception as e:  # noqa: BLE001 - one line for the table; the traceback goes to stderr
        traceback.print_exc(file=sys.stderr)
        reply(ok=False, error=one_line(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
