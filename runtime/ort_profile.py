"""What ONNX Runtime really ran: which provider executed each node, and the Memcpy nodes it
inserted between the CPU and the device, with their bytes.

A CUDA session silently places nodes the CUDA provider lacks on the CPU and copies their
inputs and outputs across; such copies of a factor or an inverse would cost more than the
step. Profiling is switched on per session by the environment variable KFAC_ORT_PROFILE
(runtime/device.py); this module reads the file a session writes on end_profiling():

    os.environ["KFAC_ORT_PROFILE"] = "/tmp/prof"      # before the Trainer is built
    trainer = Trainer(plan, device="cuda"); ...steps...
    summary = step_profiles(trainer)[label]           # the sessions every step runs
    summary.copies       # {"MemcpyToHost": (count, bytes), "MemcpyFromHost": (count, bytes)}
    summary.cpu_nodes    # {"Shape": 12, ...}: nodes run by the CPU provider
    summary.op_times     # {("Concat", "CUDAExecutionProvider"): (executions, microseconds), ...}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kfac_compiler.runtime.device import every_step

MEMCPY_OPS = ("MemcpyToHost", "MemcpyFromHost")
CPU_EP = "CPUExecutionProvider"


@dataclass
class ProfileSummary:
    """Totals over every run the profile recorded (divide by the runs for per-run figures)."""

    runs: int = 0
    nodes: dict[str, int] = field(default_factory=dict)        # provider -> node executions
    cpu_nodes: dict[str, int] = field(default_factory=dict)    # op type -> executions on the CPU provider
    copies: dict[str, tuple[int, int]] = field(default_factory=dict)  # Memcpy op -> (count, bytes)
    # (op type, provider) -> (executions, microseconds): where a run's time goes
    op_times: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)

    def copy_bytes(self) -> int:
        return sum(b for _, b in self.copies.values())


def read_profile(path: str) -> ProfileSummary:
    """Summarize an ONNX Runtime profile JSON (session.end_profiling()'s file)."""
    with open(path) as f:
        events = json.load(f)
    s = ProfileSummary()
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            s.runs += 1
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        args = e.get("args", {})
        op, provider = str(args.get("op_name", "?")), str(args.get("provider", "?"))
        s.nodes[provider] = s.nodes.get(provider, 0) + 1
        count, us = s.op_times.get((op, provider), (0, 0.0))
        s.op_times[(op, provider)] = (count + 1, us + float(e.get("dur", 0) or 0))
        if op in MEMCPY_OPS:
            count, nbytes = s.copies.get(op, (0, 0))
            s.copies[op] = (count + 1, nbytes + int(args.get("output_size", 0) or 0))
        elif provider == CPU_EP:
            s.cpu_nodes[op] = s.cpu_nodes.get(op, 0) + 1
    return s


def step_profiles(trainer: Any) -> dict[str, ProfileSummary]:
    """The profiles of the sessions a training step runs every step (the subgraph kinds the
    optimizer plugin declares every_step; a data-parallel step's stages each), by label;
    ends those sessions' profiling."""
    out = {}
    for label, prog in trainer.programs().items():
        if every_step(prog.name):
            for k, part in enumerate(getattr(prog, "programs", [prog])):
                out[label if part is prog else f"{label}/stage{k}"] = read_profile(part.session.end_profiling())
    return out
