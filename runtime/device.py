"""Execution device selection for ONNX Runtime sessions.

onnxruntime-gpu falls back to the CPU *silently* when the CUDA execution provider cannot be
loaded (missing CUDA/cuDNN libraries, no GPU, driver mismatch). `resolve_device` therefore
probes CUDA once per process with a tiny real session and checks that
`session.get_providers()` really lists CUDAExecutionProvider and that a run succeeds.

    providers = resolve_device("auto")        # CUDA when it really works, else CPU
    sess = make_session(model, providers)     # raises DeviceError if CUDA was asked and lost

CUDA sessions run with `use_tf32=0`: the curvature factors, their inverses and the quadratic
model are sensitive to the 10-bit mantissa of TF32 matmuls.
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from kfac_compiler.errors import DeviceError
from kfac_compiler.parsing import parse_bool
from kfac_compiler.progress import stage
from kfac_compiler.requests import KINDS

DEVICES = ("cpu", "cuda", "auto")
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"

# Provider options used for every CUDA session.
CUDA_OPTIONS: dict[str, Any] = {"device_id": 0, "use_tf32": 0}


def _probe_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "cuda_probe", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@functools.lru_cache(maxsize=1)
def cuda_status() -> tuple[bool, str]:
    """(works, reason). Cached: the probe creates one real CUDA session per process."""
    if os.environ.get("KFAC_DISABLE_CUDA", "").strip() and parse_bool(os.environ["KFAC_DISABLE_CUDA"], "KFAC_DISABLE_CUDA"):
        return False, "KFAC_DISABLE_CUDA is set"
    if CUDA_EP not in ort.get_available_providers():
        return False, f"this onnxruntime build has no {CUDA_EP} (install onnxruntime-gpu)"
    try:
        import numpy as np

        _preload_cuda_libraries()

        so = ort.SessionOptions()
        so.log_severity_level = 4
        # ONNX Runtime logs the failed provider load on the process's stderr (C++ side): capture
        # it so that the reason ends up in our one-line message instead of a wall of log.
        with _captured_stderr() as captured:
            sess = ort.InferenceSession(
                _probe_model().SerializeToString(), so, providers=[(CUDA_EP, dict(CUDA_OPTIONS)), CPU_EP]
            )
        if CUDA_EP not in sess.get_providers():
            reason = _load_failure(captured.text())
            return False, ("onnxruntime fell back to CPU" + (f" ({reason})" if reason else
                           " (CUDA/cuDNN libraries or GPU missing)"))
        x = np.eye(2, dtype=np.float32) * 2
        (y,) = sess.run(None, {"x": x})
        if not np.allclose(y, x @ x):
            return False, "the CUDA execution provider returned wrong results on a 2x2 probe"
        # onnxruntime-gpu >= 1.2x warns "No registered plugin EP device found for
        # 'CUDAExecutionProvider'" on its default logger at every CUDA session it creates
        # (the classic provider is used all the same): errors only, as for our sessions
        ort.set_default_logger_severity(3)
    except Exception as e:  # noqa: BLE001 - any failure means "no CUDA"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return False, f"creating a CUDA session failed: {first}"
    return True, "ok"


def _preload_cuda_libraries() -> None:
    """Load CUDA, cuBLAS and cuDNN from the `nvidia-*` wheels (pip install
    'kfac_compiler[cuda]') when they are installed: onnxruntime-gpu does not search
    site-packages by itself, so without this a pip-only machine falls back to the CPU.
    Libraries already on the loader's path (a system CUDA, or torch imported first) win."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), _captured_stderr():  # it prints its warnings
        try:
            preload(cuda=True, cudnn=True, msvc=False)
        except Exception:  # noqa: BLE001 - then the probe's own failure says what is missing
            pass


class _captured_stderr:
    """Redirect file descriptor 2 to a temporary file (best effort)."""

    def __enter__(self):
        import sys
        import tempfile

        self._tmp = tempfile.TemporaryFile(mode="w+b")
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
        except OSError:
            self._saved = None
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)
        with self._tmp:  # read and closed here, whether or not text() is asked for
            self._tmp.seek(0)
            self._text = self._tmp.read().decode("utf-8", "replace")
        return False

    def text(self) -> str:
        """What was written to file descriptor 2 inside the block (after it exits)."""
        return self._text


def _load_failure(log: str) -> str:
    import re

    m = re.search(r"with error: ([^\n\x1b]+)", log)
    if m:
        return m.group(1).strip()
    m = re.search(r"(Failed to create CUDAExecutionProvider[^\n\x1b]*?)(?:\. Please|$)", log)
    return m.group(1).strip() if m else ""


def cuda_available() -> bool:
    return cuda_status()[0]


@dataclass(frozen=True)
class Device:
    """A resolved device: the providers for sessions and the OrtValue device type."""

    name: str  # "cpu" or "cuda"
    providers: tuple

    @property
    def ort_device(self) -> str:
        return self.name

    @property
    def device_id(self) -> int:
        return int(CUDA_OPTIONS["device_id"]) if self.name == "cuda" else 0


def resolve_device(device: str = "auto") -> list:
    """The ONNX Runtime providers list for "cpu", "cuda" or "auto".

    "cuda" without a working CUDA execution provider raises DeviceError; "auto" picks CUDA
    only when the probe session really runs on it.
    """
    return list(get_device(device).providers)


def get_device(device: str | Device = "auto") -> Device:
    if isinstance(device, Device):
        return device
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; choose one of cpu, cuda, auto")
    if device == "cpu":
        return Device("cpu", (CPU_EP,))
    ok, why = cuda_status()
    if ok:
        return Device("cuda", ((CUDA_EP, dict(CUDA_OPTIONS)), CPU_EP))
    if device == "cuda":
        raise DeviceError(f"device 'cuda' is not available: {why}; use --device cpu or auto")
    return Device("cpu", (CPU_EP,))


def device_from_providers(providers: Sequence) -> Device:
    names = [p[0] if isinstance(p, (tuple, list)) else p for p in providers]
    if names and names[0] == CUDA_EP:
        return Device("cuda", tuple(providers))
    return Device("cpu", tuple(providers))


def usable_cpus() -> int:
    """The logical CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def capped_threads(threads: int) -> int:
    """An intra-op thread count of at most the usable CPUs, with a warning when capped: more
    threads than CPUs only time-slice (10**6 threads spend minutes being created)."""
    cpus = usable_cpus()
    if threads > cpus:
        warnings.warn(f"threads {threads} exceeds the {cpus} CPUs this process may run on; using {cpus}",
                      stacklevel=3)
        return cpus
    return threads


@functools.lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (ONNX Runtime's default pool
    size; hyper-threads do not add GEMM throughput)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
                cores.add((f.read().strip(), core))
        except OSError:
            cores.add(("cpu", str(c)))
    return max(1, len(cores))


def session_options(threads: int | None = None, spin: bool = True) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Nodes in the emitted order (Kahn's, the lowest-index ready node first) rather than ORT's
    # default depth-first order, which on a training step runs a loss's LogSoftmax after the
    # whole step and so holds the logits (and the quadratic model's JVPs) through the backward
    # pass: the step of a 50,257-vocabulary GPT peaks 49-147 MB lower (the graph variants
    # measured), Adam's within 12 MB, small zoo models' within 1 MB
    # (docs/runtime.md, "Memory"). The order changes no value.
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # Always an explicit thread count: ONNX Runtime's default pool (intra_op_num_threads 0)
    # pins each worker to one core, and a spinning worker pinned to the core where the
    # caller's thread (or another process) runs halves that thread's share of it for as long
    # as the scheduler leaves it there, often the whole run. An explicit count leaves the
    # placement to the scheduler.
    so.intra_op_num_threads = int(threads) if threads else physical_cores()
    if not spin:
        # A trainer runs several sessions in turn, each with its own intra-op pool whose idle
        # workers spin for a while after a run, stealing the cores from the next session's
        # run. Sessions that do not run every step must not spin.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    prefix = os.environ.get(PROFILE_ENV)
    if prefix:
        so.enable_profiling = True
        so.profile_file_prefix = prefix
    return so


# KFAC_ORT_PROFILE=<prefix>: every session records ONNX Runtime's per-node profile (which
# provider ran each node, the Memcpy nodes between them and their sizes), written to
# <prefix>_<date>.json by session.end_profiling(); benchmarks/bench_gpu.py reads it.
PROFILE_ENV = "KFAC_ORT_PROFILE"

# Sessions of the subgraph kinds a training step runs every step (requests.SubgraphKind.every_step,
# declared by the optimizer plugins) keep their intra-op workers spinning between runs and keep
# ONNX Runtime's CPU arena. Memory (CPU): every other session (statistics-only steps, inverse
# refreshes, evaluation, Curvature's products) returns its intermediates after each run, since
# an arena keeps each session's peak for good and those peaks add up across sessions
# (ResNet-18, full factors: update_statistics +0.47 GB, inverse_update +0.8 GB, held for the
# whole run). No CPU session uses ORT's memory pattern: with the arena, the pattern's one
# planned block came on top of the chunks the first run had left in it, doubling the step's
# arena (kfac_step +1.3 GB instead of +0.63); step times with and without were within the
# machine's noise (docs/runtime.md, "Memory").


def every_step(name: str) -> bool:
    """Whether session `name` runs every training step: a registered kind that says so, or a
    stage of one ("kfac_step/stage1": a data-parallel step cut at its reduction points,
    runtime/staged.py)."""
    kind = KINDS.get(name.split("/", 1)[0])
    return kind is not None and kind.every_step


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (another C library)."""
    libc = _libc()
    return getattr(libc, "malloc_trim", None) if libc is not None else None


@functools.cache
def _libc() -> Any:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _heap_free_bytes() -> Callable[[], int] | None:
    """A function giving the bytes glibc's heap holds free (mallinfo2's fordblks, over every
    arena), or None where there is no mallinfo2 (glibc < 2.33, another C library)."""
    import ctypes

    libc = _libc()
    info = getattr(libc, "mallinfo2", None) if libc is not None else None
    if info is None:
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    info.restype = MallInfo2
    return lambda: int(info().fordblks)


# release_heap trims only a heap holding more than this free: malloc_trim walks every free
# chunk and returns its pages one system call at a time, far slower than mallinfo2 reads the
# free total, and the next run without an arena faults the returned pages back in; on a
# small model's frequent inverse refreshes that cost more than the few MB it returned
# (benchmarks/results/2026-11-29-host-overhead.md)
TRIM_FREE_BYTES = 16 << 20


def release_heap() -> None:
    """Give the heap pages glibc keeps after a session without an arena freed its
    intermediates back to the system (malloc_trim): without it they stay resident under the
    every-step session's arena, 50-120 MB after a 50,257-vocabulary GPT's statistics run, and
    how much depends on the allocation pattern (peaks 800-900 MB one run to the next). A
    heap with at most TRIM_FREE_BYTES free is left as it is: trimming it costs more host
    time than the memory it returns is worth."""
    trim = _malloc_trim()
    if trim is None:
        return
    free = _heap_free_bytes()
    if free is None or free() > TRIM_FREE_BYTES:
        trim(0)


# A graph of LARGE_GRAPH_NODES nodes or more (a deep plan's; every zoo model's, ResNet-18's
# and the GPT export's step graph is smaller) gets two session options that keep ONNX
# Runtime's setup from growing quadratically (benchmarks/results/2026-11-29-setup-scaling.md):
# * no planned memory reuse (SessionOptions.enable_mem_reuse): the allocation planner matches
#   every new buffer against a list that keeps each freed buffer no later one fits (scalars,
#   shapes met once); a 200-layer MLP's first K-FAC step (15,178 nodes, no graph
#   optimizations) took 19 s with reuse, 2.4 s without; declared shapes (backend/shapes.py)
#   do not change that (a 300-layer step: 13-20 s with reuse, 5 s without). Values are still freed after their
#   last reader; what is lost is running an op in place in a dead input's buffer (run time,
#   and one intermediate more at a time at that op).
# * when the session does not run every step (the inverse refresh, statistics-only steps,
#   evaluation), no graph optimizations: each of ORT_ENABLE_ALL's ~64-93 passes sorts the
#   graph, and a refresh's independent per-block chains keep that sort's queue long (a
#   500-layer refresh, 28,022 nodes: 122 s at ORT_ENABLE_ALL under load 15). Its outputs
#   were bitwise equal at either level (deep MLP, transformer_block, small_cnn,
#   mlp_classifier); the steps, which do run every step, keep ORT_ENABLE_ALL.
LARGE_GRAPH_NODES = 5_000


def memory_options(options: ort.SessionOptions, device: Device, name: str, nodes: int | None = None) -> None:
    """Set the CPU arena, memory pattern and, for a large graph of `nodes` nodes, memory
    reuse and graph optimizations of subgraph `name`'s session (see every_step and
    LARGE_GRAPH_NODES)."""
    options.enable_cpu_mem_arena = every_step(name)
    if device.name == "cpu":
        options.enable_mem_pattern = False
    if nodes is not None and nodes >= LARGE_GRAPH_NODES:
        options.enable_mem_reuse = False
        if not every_step(name):
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL


# the CUDA provider option that records a session's kernels on its second run (per graph id,
# RunOptions' GRAPH_ID) and replays them on every later run with that id
CUDA_GRAPH_OPTION = "enable_cuda_graph"
# RunOptions config key: which captured graph a run records or replays; "-1" runs uncaptured
GRAPH_ID = "gpu_graph_id"


class CaptureRefused(DeviceError):
    """ONNX Runtime refused to make a session with CUDA graph capture (control flow, a node on
    the CPU provider): the caller runs that graph uncaptured."""


def with_cuda_graph(providers: Sequence) -> list:
    """`providers` with CUDA graph capture turned on for the CUDA provider (others unchanged)."""
    out: list = []
    for p in providers:
        name, opts = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (p, {})
        out.append((name, {**opts, CUDA_GRAPH_OPTION: "1"}) if name == CUDA_EP else p)
    return out


def make_session(model: onnx.ModelProto | bytes, device: str | Device, name: str = "subgraph",
                 threads: int | None = None, spin: bool = True, capture: bool = False,
                 graph_nodes: int | None = None) -> ort.InferenceSession:
    """An InferenceSession on `device`, checked: a CUDA request that fell back raises DeviceError.
    `capture`: on CUDA, with graph capture (the caller binds every input and output to fixed
    device buffers and names a graph id per run: runtime/program.py). `graph_nodes`: the size
    whose memory and optimization options it takes (a stage: its whole graph's)."""
    from kfac_compiler.onnx_files import with_relative_data

    dev = get_device(device)
    folder = None
    nodes = None if isinstance(model, bytes) else len(model.graph.node)
    if not isinstance(model, bytes):
        model, folder = with_relative_data(model)  # frozen values of a model over 1 GiB, left on disk
    data = model if isinstance(model, bytes) else model.SerializeToString()
    # A subgraph ONNX Runtime cannot load is a compiler bug, not a user error: let it escape.
    # a stage of a step does not spin: the next stage's session runs right after it; `spin`
    # False: one of several sessions that take turns running the step (Program)
    options = session_options(threads, spin=spin and every_step(name) and "/" not in name)
    memory_options(options, dev, name, graph_nodes or nodes)
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    with stage(f"ONNX Runtime session {name}" + (f" ({nodes:,} nodes)" if nodes is not None else "")):
        if capture and dev.name == "cuda":
            try:
                sess = ort.InferenceSession(data, options, providers=with_cuda_graph(dev.providers))
            except Exception as e:  # noqa: BLE001 - ONNX Runtime refuses the graph: say which and what to do
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise CaptureRefused(f"subgraph {name!r}: ONNX Runtime cannot capture it as a CUDA graph "
                                     f"({first[:200]})") from None
        else:
            sess = ort.InferenceSession(data, options, providers=list(dev.providers))
    if dev.name == "cuda" and CUDA_EP not in sess.get_providers():
        raise DeviceError(f"subgraph {name!r}: ONNX Runtime fell back to CPU although CUDA was requested")
    return sess
