"""Where in kfac_step the memory peaks: RSS sampled during one run, mapped to the node ONNX
Runtime was executing (its profile), for 2026-11-29-tied-memory.md's step section.

    python benchmarks/results/2026-11-29-tied-memory.py --compile CONFIG PLAN_DIR
    python benchmarks/results/2026-11-29-step-memory-trace.py PLAN_DIR [BATCH [TOP]]

The session is the runtime's own (runtime.device.make_session) with its CPU arena off, so
that RSS follows what is alive (freed buffers go back to the system) rather than the arena's
high-water mark; the feeds are random (hp/update_stats and hp/loss_after on, so both If
branches run). Prints the peak growth over the RSS before the run and, for the TOP nodes
with the highest RSS, that RSS: the phases of the step that bound the peak.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

import numpy as np
import onnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import runtime.device as device  # noqa: E402

V = 50257
SET = {"hp/update_stats": 1.0, "hp/loss_after": 1.0, "hp/damping": 1e-3, "hp/max_momentum": 1.0}


def feeds(sess, batch: int) -> dict[str, np.ndarray]:
    """Random inputs of the right types: tokens and targets below V, noise in (0, 1)."""
    rng = np.random.default_rng(0)
    out = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else batch for d in i.shape]
        if i.type == "tensor(int64)":
            out[i.name] = rng.integers(0, V, shape).astype(np.int64)
        elif i.name.startswith("noise"):
            out[i.name] = rng.uniform(1e-7, 1 - 1e-7, shape).astype(np.float32)
        elif i.name.startswith("hp/"):
            out[i.name] = np.full(shape, SET.get(i.name, 0.01), np.float32)
        else:
            out[i.name] = (0.02 * rng.normal(size=shape)).astype(np.float32)
    return out


def main() -> None:
    plan, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    memory_options = device.memory_options

    def no_arena(options, dev, name, nodes=None):
        memory_options(options, dev, name, nodes)
        options.enable_cpu_mem_arena = False

    device.memory_options = no_arena
    os.environ[device.PROFILE_ENV] = os.path.join(tempfile.mkdtemp(), "prof")
    sess = device.make_session(onnx.load(os.path.join(plan, "kfac_step.onnx")), "cpu", "kfac_step")
    data = feeds(sess, batch)
    sess.run(None, data)  # the first run's one-time allocations stay out of the trace
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:  # VmRSS in MB, as often as the GIL allows while the run holds none
        with open("/proc/self/statm") as f:
            while not done.is_set():
                f.seek(0)
                samples.append((time.perf_counter(), int(f.read().split()[1]) * 4096 / 2**20))

    thread = threading.Thread(target=sample)
    thread.start()
    time.sleep(0.05)
    sess.run(None, data)
    done.set()
    thread.join()
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    run = [e for e in events if e.get("name") == "model_run"][-1]
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= run["ts"]]
    # the run's last kernel ends when sampling stops (to ~50 us): align the clocks there
    end_us, end_s = max(e["ts"] + e["dur"] for e in kernels), samples[-1][0]
    starts = [e["ts"] for e in kernels]

    def node_at(t: float) -> str:
        i = int(np.searchsorted(starts, end_us - (end_s - t) * 1e6, side="right")) - 1
        return kernels[max(i, 0)]["name"][:-len("_kernel_time")]

    base = min(mb for _, mb in samples)
    best: dict[str, float] = {}
    for t, mb in samples:
        name = node_at(t)
        best[name] = max(best.get(name, 0.0), mb - base)
    print(f"batch {batch}: peak growth {max(best.values()):.0f} MB over {base:.0f} MB, {len(samples)} samples")
    for name, mb in sorted(best.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {mb:6.0f}  {name}")


if __name__ == "__main__":
    main()
