"""Program: one ONNX Runtime session for one emitted subgraph, driven by the contract's `info`.

    prog = Program(model, info, device)          # info as in docs/runtime_contract.md
    out = prog.run(store, {"input": x, "targets": y})
    out["loss"], out["metric/update_norm"]      # metrics: host floats (names: kfac_compiler.contract)
    prog.run(store, data, results=True)["grad/fc1.weight"]   # results: numpy, only when asked

Every run binds (IOBinding): state inputs -> the slots' current buffers; data inputs -> the
store's pre-allocated device buffers (written here when `data` has them); `hp/<name>` -> the
store's device scalars; `new/<slot>` outputs -> the slots' spare buffers. After the run the
written slots are flipped. Metrics are bound to pre-allocated host scalars, so the only
device->host traffic of a steady-state step is a handful of 4-byte copies. With `capture`
(Trainer's cuda_graphs) the session replays CUDA graphs, one per set of bound buffers, and the
metrics go through device buffers of their own (docs/runtime.md, "CUDA graphs").
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from kfac_compiler import contract as C
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import ConfigError, DataError, ModelError, PlanError
from kfac_compiler.plan import Plan
from kfac_compiler.runtime.capture import split_wide_concats, unroll_static_loops
from kfac_compiler.runtime.device import (
    GRAPH_ID,
    CaptureRefused,
    Device,
    device_from_providers,
    every_step,
    get_device,
    make_session,
    release_heap,
)
from kfac_compiler.runtime.state import StateStore, init_value
from kfac_compiler.runtime.static_shapes import Shapes, with_static_dims
from kfac_compiler.runtime.subgraphs import resolved_request, subgraph

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
    "tensor(uint8)": np.uint8,
    "tensor(int8)": np.int8,
}


# ONNX Runtime's session setup grows ~L^1.5 in a graph's nodes (its sorts keep every ready
# node in one ordered queue): a graph of more nodes runs as a chain of sessions of at most
# STAGE_NODES nodes each (runtime/staged.py), whose setup grows linearly (docs/runtime.md,
# `kfac-compiler train`, what made setup superlinear; benchmarks/results/2026-11-30-staged-setup.md)
STAGED_ABOVE_NODES = 10_000
STAGE_NODES = 1_000


class ContractError(RuntimeError):
    """An emitted subgraph and its info disagree with docs/runtime_contract.md (a compiler bug)."""


def _as_device(device: str | Device | Sequence[Any]) -> Device:
    if isinstance(device, (list, tuple)):
        return device_from_providers(device)
    return get_device(device)


class SubgraphIO:
    """What a program reads and writes, from its SubgraphInfo: the interface Program,
    StagedProgram (runtime/staged.py) and DeclaredProgram share."""

    def __init__(self, info: SubgraphInfo, name: str) -> None:
        self.info, self.name = info, name
        self.data_inputs = list(info.data_inputs)
        self.hp_inputs = list(info.hp_inputs)
        self.state_inputs = list(info.state_inputs)
        self.state_outputs = dict(info.state_outputs)
        self.metrics = list(info.metrics)
        self.results = list(info.results)
        self._written = tuple(self.state_outputs.values())
        self.input_dtypes: dict[str, Any] = {}  # a session's inputs' numpy dtypes (none declared)

    @property
    def written_slots(self) -> list[str]:
        return list(self._written)

    def wanted_results(self, results: bool | Sequence[str]) -> tuple[str, ...]:
        """The results a run asks for (`results`: True for every one, or names), each one
        this subgraph returns."""
        if results is True:
            return tuple(self.results)
        unknown = [r for r in (results or []) if r not in self.results]
        if unknown:
            raise KeyError(f"subgraph {self.name!r} has no result {unknown[0]!r}; it returns {self.results}")
        return tuple(results or ())


class Program(SubgraphIO):
    """An executable subgraph. `device` is "cpu"/"cuda"/"auto", a Device or a providers list."""

    def __init__(self, model: onnx.ModelProto | bytes, info: SubgraphInfo, device: str | Device | Sequence[Any] = "cpu",
                 name: str | None = None, threads: int | None = None, carried: Sequence[str] = (),
                 spin: bool = True, capture: bool = False, graph_nodes: int | None = None) -> None:
        super().__init__(info, name or (model.graph.name if isinstance(model, onnx.ModelProto) else "subgraph"))
        self.device = _as_device(device)
        try:
            self.session = make_session(model, self.device, self.name, threads=threads, spin=spin, capture=capture,
                                        graph_nodes=graph_nodes)
        except CaptureRefused as e:  # e.g. a tied block's statistics Loop: this graph runs uncaptured
            warnings.warn(f"{e}; it runs uncaptured", stacklevel=2)
            capture = False
            self.session = make_session(model, self.device, self.name, threads=threads, spin=spin)
        # CUDA graph capture (Trainer's cuda_graphs): a replayed run writes only the buffers it
        # was recorded with, so the metrics go to device buffers of their own, read after the
        # run, and each set of bound buffer addresses gets a graph id of its own
        self.capture = bool(capture)
        self._graph_ids: dict[tuple, ort.RunOptions] = {}  # by the bound buffers' addresses
        self._graph_of: dict[tuple, tuple[int, ort.RunOptions]] = {}  # binding key -> (generation, graph)
        self._uncaptured_run: ort.RunOptions | None = None
        self.arena = every_step(self.name)  # memory_options: else its heap is trimmed after each run
        self.carried = list(carried)  # inputs the caller binds on every run (a stage's, runtime/stages.py)
        # a data-parallel run's agreement on metric/finite (every rank flips its state or none
        # does): the minimum over the ranks; None in one process
        self.agree: Callable[[float], float] | None = None
        self._check_contract()
        self.input_dtypes = {i.name: _ORT_TYPES.get(i.type) for i in self.session.get_inputs()}
        self._metric_bufs: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}
        for o in self.session.get_outputs():
            if o.name in self.metrics and isinstance(o.shape, list) and all(isinstance(d, int) for d in o.shape):
                buf: np.ndarray = np.zeros(o.shape, dtype=_ORT_TYPES.get(o.type, np.float32))
                where = (ort.OrtValue.ortvalue_from_shape_and_type(o.shape, buf.dtype, self.device.ort_device,
                                                                   self.device.device_id)
                         if self.capture else ort.OrtValue.ortvalue_from_numpy(buf))
                self._metric_bufs[o.name] = (buf, where)
        if self.capture and len(self._metric_bufs) < len(self.metrics):
            raise ContractError(f"subgraph {self.name!r}: CUDA graph capture needs every metric's shape static "
                                f"({[m for m in self.metrics if m not in self._metric_bufs]} are not)")
        # One IOBinding per (requested results, which buffer of each state slot is current):
        # ORT keeps a binding across runs, so once both parities of the double-buffered slots
        # have been seen a steady-state run binds nothing (re-binding every flipped slot each
        # step would cost host time in proportion to the number of slots).
        self._bindings: dict[tuple, ort.IOBinding] = {}
        # per binding: name -> the OrtValue bound last (only what changed is bound again)
        self._bound: dict[tuple, dict[str, ort.OrtValue]] = {}
        self._valid: dict[tuple, int] = {}  # per binding: the store generation it was made at
        self._slots = tuple(self.state_inputs) + self._written
        self._dynamic_metrics = [m for m in self.metrics if m not in self._metric_bufs]
        # (name, host buffer) of the pre-bound scalar metrics: read without a fetch
        self._scalar_metrics = [(m, self._metric_bufs[m][0]) for m in self.metrics
                                if m in self._metric_bufs and self._metric_bufs[m][0].size == 1]
        self.runs = 0
        self.session_seconds = 0.0
        self.last_seconds = 0.0

    # ------------------------------------------------------------------ checks
    def _check_contract(self) -> None:
        ins = [i.name for i in self.session.get_inputs()]
        outs = [o.name for o in self.session.get_outputs()]
        known_in = set(self.data_inputs) | set(self.hp_inputs) | set(self.state_inputs) | set(self.carried)
        known_out = set(self.state_outputs) | set(self.metrics) | set(self.results)
        missing = [n for n in ins if n not in known_in]
        extra = [n for n in known_in if n not in ins]
        if missing or extra:
            raise ContractError(f"subgraph {self.name!r}: graph inputs {ins} disagree with info "
                                f"(unclassified {missing}, absent {extra})")
        missing = [n for n in outs if n not in known_out]
        extra = [n for n in known_out if n not in outs]
        if missing or extra:
            raise ContractError(f"subgraph {self.name!r}: graph outputs {outs} disagree with info "
                                f"(unclassified {missing}, absent {extra})")
        for out, slot in self.state_outputs.items():
            if out != C.new(slot):
                raise ContractError(f"subgraph {self.name!r}: state output {out!r} must be named 'new/{slot}'")

    # ------------------------------------------------------------------ run
    def _binding(self, key: tuple) -> tuple[ort.IOBinding, dict[str, ort.OrtValue]]:
        # IOBinding keeps outputs in first-bound order, and rebinding a name replaces it in
        # place, so get_outputs() order is stable per binding.
        b = self._bindings.get(key)
        if b is None:
            b = self._bindings[key] = self.session.io_binding()
            self._bound[key] = {}
        return b, self._bound[key]

    def run(self, store: StateStore, data: Mapping[str, np.ndarray] | None = None,
            hp: Mapping[str, float] | None = None, results: bool | list[str] = False,
            channel: str = "train", carried: Mapping[str, ort.OrtValue] | None = None,
            keep: Sequence[str] = (), flip: bool = True,
            into: Mapping[str, ort.OrtValue] | None = None) -> dict[str, Any]:
        """Run once. `data`: arrays to write into the data inputs first (others must already be
        in the store's `channel`); `hp`: scalars to set first; `results`: True for every
        result, or a list of names. A stage of a cut step (runtime/staged.py) passes the
        tensors earlier stages made (`carried`), asks for results as device OrtValues without
        a copy (`keep`; those in `into` written into the caller's OrtValues, bound while they
        stay the same), and flips the state itself after the last stage (flip=False)."""
        write_inputs(store, data, hp, self.input_dtypes, channel)
        want = self.wanted_results(results)
        try:
            key = (want, store.parity(self._slots), channel)
        except KeyError as e:
            raise ContractError(f"subgraph {self.name!r} uses state slot {e.args[0]!r} that the store lacks") from None
        generation = store.generation
        b, bound = self._binding(key)
        # A binding already made for this parity and channel holds the right buffers as long
        # as the store replaced none (store.generation): steady-state runs skip ~100 checks
        if self._valid.get(key) != generation:
            for n in self.state_inputs:
                _bind(bound, b.bind_ortvalue_input, n, store.current(n))
            for n in self.data_inputs:
                _bind(bound, b.bind_ortvalue_input, n, store.data(n, channel))
            for n in self.hp_inputs:
                _bind(bound, b.bind_ortvalue_input, n, store.hp(n))
            for output, slot in self.state_outputs.items():
                _bind(bound, b.bind_ortvalue_output, output, store.spare(slot))
            for m in self.metrics:  # in order: get_outputs() follows the first-bound order
                pre = self._metric_bufs.get(m)
                if pre is not None:
                    _bind(bound, b.bind_ortvalue_output, m, pre[1])
                else:
                    b.bind_output(m, "cpu")
            self._valid[key] = generation
        else:
            for m in self._dynamic_metrics:  # re-bound in place: the order stays
                b.bind_output(m, "cpu")
        for r in want:
            b.bind_output(r, "cpu")
        for name, value in (carried or {}).items():  # a value bound last run is not bound again
            _bind(bound, b.bind_ortvalue_input, name, value)
        keep = [r for r in keep if r not in self.metrics]  # a metric a later stage reads: bound above
        for r in keep:  # in keep's order whether into or not: a rebound name keeps its place
            if into and r in into:
                _bind(bound, b.bind_ortvalue_output, r, into[r])
            else:
                bound.pop(r, None)
                b.bind_output(r, self.device.ort_device, self.device.device_id)
        run_options = None
        if self.capture:  # a run that returns results or carries tensors is not captured
            run_options = self._graph(key, bound) if not (want or keep or carried) else self._uncaptured()
        t0 = time.perf_counter()
        self.session.run_with_iobinding(b, run_options)
        if self.capture:  # the metrics' device buffers -> their host copies
            for buf, value in self._metric_bufs.values():
                buf[...] = value.numpy()
        dt = time.perf_counter() - t0
        self.last_seconds = dt
        self.session_seconds += dt
        self.runs += 1
        if not self.arena:
            release_heap()
        held = into or {}
        if want or any(r not in held for r in keep) or len(self._scalar_metrics) < len(self.metrics):
            out = self._collect(b, want, tuple(keep))
        else:  # the steady-state step: every metric a pre-bound host scalar, every kept result
            # the caller's own OrtValue (get_outputs() would wrap every output anew, ~10 us each)
            out = {m: float(buf.item()) for m, buf in self._scalar_metrics}
            out.update({r: held[r] for r in keep})
        if self.agree is not None and C.FINITE in out:
            out[C.FINITE] = self.agree(out[C.FINITE])
        # A rejected step (metric/finite == 0: NaN/Inf loss or update) wrote its outputs into
        # the spare buffers only; not flipping them keeps every state slot as it was.
        if flip and out.get(C.FINITE, 1.0) != 0.0:
            store.flip_all(self._written)
        return out

    def _graph(self, key: tuple, bound: Mapping[str, ort.OrtValue]) -> ort.RunOptions:
        """The RunOptions naming the captured graph of the buffers bound now: a replay reads and
        writes the addresses its capture was bound to, so each set of addresses (a parity of
        the state, a channel, a buffer the store reallocated) is a graph of its own id. ONNX
        Runtime records an id on its second run, after a warm-up run, and replays it from then
        on. Looked up once per binding and store generation."""
        generation = self._valid[key]
        cached = self._graph_of.get(key)
        if cached is not None and cached[0] == generation:
            return cached[1]
        addresses = tuple(sorted((name, value.data_ptr()) for name, value in bound.items()))
        ro = self._graph_ids.get(addresses)
        if ro is None:
            ro = self._graph_ids[addresses] = ort.RunOptions()
            ro.add_run_config_entry(GRAPH_ID, str(len(self._graph_ids) - 1))
        self._graph_of[key] = (generation, ro)
        return ro

    def _uncaptured(self) -> ort.RunOptions:
        if self._uncaptured_run is None:
            self._uncaptured_run = ort.RunOptions()
            self._uncaptured_run.add_run_config_entry(GRAPH_ID, "-1")
        return self._uncaptured_run

    def _collect(self, b: ort.IOBinding, want: tuple[str, ...], keep: tuple[str, ...] = ()) -> dict[str, Any]:
        """Metrics (host floats, or arrays when not scalar) and the requested results, as host
        copies; the `keep` results as the run's OrtValues."""
        out: dict[str, Any] = {}
        dynamic = self._dynamic_metrics + list(want)
        fetched = {}
        if dynamic or keep:
            names = list(self.state_outputs) + self.metrics + list(want) + list(keep)
            for name, v in zip(names, b.get_outputs()):
                if name in keep:
                    out[name] = v
                elif name in dynamic:
                    fetched[name] = np.array(v.numpy(), copy=True)
        for m in self.metrics:
            pre = self._metric_bufs.get(m)
            arr = pre[0] if pre is not None else fetched[m]
            out[m] = float(arr.reshape(-1)[0]) if arr.size == 1 else np.array(arr, copy=True)
        for r in want:
            out[r] = fetched[r]
        return out


def write_inputs(store: StateStore, data: Mapping[str, np.ndarray] | None, hp: Mapping[str, float] | None,
                 dtypes: Mapping[str, Any], channel: str) -> None:
    """Write a run's batch arrays (those named in `dtypes`, the inputs the run has, in their
    dtypes) into the store's `channel` and its hyper-parameters into the store's scalars."""
    for name, arr in (data or {}).items():
        if name in dtypes:
            store.write_data(name, arr, dtypes[name], channel)
    for name, v in (hp or {}).items():
        store.set_hp(name, v)


def _bind(bound: dict, how: Callable[[str, ort.OrtValue], None], name: str, value: ort.OrtValue) -> None:
    """Bind `value` to `name` with `how` (the binding's bind method) unless that binding
    already holds exactly that OrtValue (`bound`: what it was given last)."""
    if bound.get(name) is not value:
        how(name, value)
        bound[name] = value


def _model_value(plan: Plan, slot: str) -> np.ndarray:
    """A state slot initialized from the plan model's initializer of the same name (init
    "model": non-trained state such as BatchNormalization running statistics)."""
    from kfac_compiler.onnx_files import tensor_array

    for t in plan.model.graph.initializer:
        if t.name == slot:
            return tensor_array(t).copy()
    raise ContractError(f"state slot {slot!r} (init 'model') is not an initializer of the plan's model")


def _check_state_shapes(prog: Program, info: SubgraphInfo) -> None:
    """ValueError where a state slot's declared shape disagrees with the graph input it feeds
    (static dimensions only): ONNX Runtime would refuse the first run."""
    sessions = [p.session for p in getattr(prog, "programs", [prog])]  # a StagedProgram's stages
    dims = {i.name: i.shape for session in sessions for i in session.get_inputs()}
    for slot in prog.state_inputs:
        spec, shape = info.state_specs.get(slot), dims.get(slot)
        if spec is None or shape is None:
            continue
        if len(shape) != len(spec.shape) or any(isinstance(d, int) and d != int(s) for d, s in zip(shape, spec.shape)):
            raise ValueError(f"state slot {slot!r} is declared {list(spec.shape)} but the graph takes {list(shape)}")


class DeclaredProgram(SubgraphIO):
    """A subgraph's contract without a session: what a program reads and writes, for a caller
    that only asks which subgraphs a run needs (kfac_compiler.store_default_subgraphs)."""

    session_seconds = 0.0  # it runs nothing (Trainer.step sums its programs' session time)

    def run(self, *args: Any, **kwargs: Any) -> dict:
        raise ConfigError(f"subgraph {self.name!r} was only declared (a Trainer built with sessions=False "
                          "runs nothing): build the Trainer with sessions=True to train")


def forward_problem(plan: Plan) -> str | None:
    """The first line of ONNX Runtime's refusal of the plan's forward model (its canonical
    graph, CPU), or None where it loads: tells a model ONNX Runtime cannot run (an exporter's
    Conv with auto_pad SAME and dilations, an LSTM with a misshapen initial state) from a
    subgraph of ours it refuses. Only asked after a refusal: a session costs setup time."""
    from kfac_compiler.onnx_files import with_relative_data

    model, folder = with_relative_data(plan.model)
    options = ort.SessionOptions()
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - any refusal is the answer
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return " ".join(first.split())[:300]
    return None


def cached_program(programs: dict, store: StateStore, plan: Plan, device: Any, threads: int | None,
                   name: str, comm: Any = None, sessions: bool = True, shapes: Shapes | None = None,
                   spin: bool = True, capture: bool = False, **options: Any) -> Program:
    """The Program for subgraph `name` with `options`, created on first use (cached in
    `programs`), with every state slot it declares initialized in `store`. With `comm` (a
    data-parallel run's Communicator) a step with reduction points runs in stages
    (runtime/staged.py) and a program that writes state flips it only where every rank's
    run was finite. With `sessions` False nothing is built: a DeclaredProgram stands in.
    `shapes` (runtime/static_shapes.py: a batch's array shapes): the graph's symbolic dims
    fixed to that batch's, one session per shape (keyed (request, shapes)). `spin` False: the
    session's idle workers do not spin (one of several sessions that take turns running the
    step: a spinning pool steals the cores from the next one's run). `capture`: with `shapes`,
    a session with CUDA graph capture (Program; not a staged, data-parallel step's)."""
    req = resolved_request(plan, get_device(device).name, name, **options)
    key: Any = req if shapes is None else (req, shapes)
    prog = programs.get(key)
    if prog is None:
        model, info, stored = subgraph(plan, req)
        if get_device(device).name == "cuda":  # ONNX Runtime's slow (uncaptured) and refused (captured) form
            model = split_wide_concats(model)
        if not sessions:
            programs[key] = DeclaredProgram(info, name)
            return programs[key]
        if shapes is not None:
            try:
                model = with_static_dims(model, dict(shapes))
            except ValueError as e:  # a batch the graph cannot take: the caller's data
                raise DataError(f"subgraph {name!r}: {e}") from None
            if capture:  # a Loop over chunks of the now static batch: its iterations, capturable
                model = unroll_static_loops(model)
        try:
            if comm is not None and not info.reductions and set(info.state_outputs.values()) & set(plan.trainable):
                raise PlanError(f"subgraph {name!r} updates the parameters but marks no reduction points, so a "
                                "data-parallel run cannot average its gradients; recompile the plan")
            cut = len(model.graph.node) > STAGED_ABOVE_NODES and not capture
            prog = None
            if (comm is not None and info.reductions) or cut:
                from kfac_compiler.runtime.staged import StagedProgram
                from kfac_compiler.runtime.stages import StageError

                try:  # one process: its reduction markers are plain Identities, cut for size alone
                    prog = StagedProgram(model, info if comm is not None else replace(info, reductions={}), device,
                                         comm, name=name, threads=threads, max_nodes=STAGE_NODES if cut else None)
                except StageError:
                    if comm is not None and info.reductions:
                        raise
                    # a tensor that crosses a size cut and cannot be typed: the whole graph, slower to set up
            if prog is None:
                prog = Program(model, info, device, name=name, threads=threads, spin=spin,
                               capture=capture and shapes is not None)
                if comm is not None and C.FINITE in prog.metrics and prog.written_slots:
                    prog.agree = comm.minimum
            _check_state_shapes(prog, info)
            for slot, spec in info.state_specs.items():
                if slot not in store:
                    store.add(slot, _model_value(plan, slot) if spec.init == "model" else init_value(spec))
            for slot in prog.state_inputs + prog.written_slots:
                if slot not in store:
                    raise ContractError(f"subgraph {name!r}: no state_specs entry for slot {slot!r}")
        except Exception as e:
            if type(e).__module__.startswith("onnxruntime"):  # ONNX Runtime refused the graph
                problem = forward_problem(plan)
                if problem is not None:  # the user's model: not ours to fix, one line
                    raise ModelError(f"ONNX Runtime cannot run the model's own forward pass ({problem}); the "
                                     "compiled steps keep its nodes as they are: re-export the model so that ONNX "
                                     "Runtime loads it") from None
                raise  # the forward loads and a subgraph of ours does not: a compiler bug
            if not isinstance(e, (ContractError, ValueError, TypeError)):
                raise
            if not stored:  # TypeError: np.dtype of a garbled dtype name
                raise  # emitted just now: a compiler bug
            why = " ".join(str(e).split())
            raise PlanError(f"the plan's subgraph {name!r} disagrees with its entry in plan.json "
                            f"({why[:160]}{'...' if len(why) > 160 else ''}); recompile the plan") from None
        programs[key] = prog
    return prog
