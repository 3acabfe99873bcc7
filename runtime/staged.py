"""StagedProgram: a step cut at its reduction points (runtime/stages.py), run stage by stage
with the ranks' all-reduces in between; a drop-in for Program in a data-parallel run. Also a
large graph cut every `max_nodes` nodes, in one process or many: ONNX Runtime's session setup
grows faster than its nodes, a chain of bounded stages' linearly (runtime/program.py's
STAGED_ABOVE_NODES).

    stage 0 -> mean over ranks of its locals (loss, gradients) -> stage 1 -> mean (the
    quadratic model's terms) -> stage 2 -> mean (the loss after the update) -> stage 3

Tensors a stage hands to a later one stay device OrtValues; only the reduced values travel
through the host. On the CPU a cut's locals are written by their stage straight into one
packed float32 buffer (`HostCut`) that is all-reduced in place and that the later stages read
as the reduced tensors: no copy and no allocation per step (a fresh 45 MB of gradients a step
on ResNet-18 cost some 30,000 page faults, each step, in copies the fused step does not make). The state is flipped after the last stage, when every rank agrees that the
step is finite (metric/finite's minimum over the ranks), so a rejected step is rejected on
every rank.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from kfac_compiler import contract as C
from kfac_compiler import progress
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import PlanError
from kfac_compiler.runtime.comm import Communicator
from kfac_compiler.runtime.program import _ORT_TYPES, ContractError, Program, SubgraphIO, _as_device, write_inputs
from kfac_compiler.runtime.stages import Stage, split_stages
from kfac_compiler.runtime.state import StateStore


class HostCut:
    """The buffer of one reduction cut on the CPU: its locals (float32, static shapes) as views
    of one packed host buffer that their stage writes as outputs, all-reduced in place, then
    read as the reduced tensors by the later stages (the same memory: a local no later stage
    reads can be overwritten by its mean). Kept across steps."""

    def __init__(self, reduce_after: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]],
                 kinds: Mapping[str, str]) -> None:
        sizes = [int(np.prod(shapes[local], dtype=np.int64)) for local in reduce_after.values()]
        self.buffer = np.zeros(sum(sizes), np.float32)
        self.outputs: dict[str, ort.OrtValue] = {}  # local -> its OrtValue over the buffer
        self.values: dict[str, ort.OrtValue] = {}   # reduced -> the same OrtValue
        self.nbytes: dict[str, int] = {}            # what the buffer holds, bytes by kind
        start = 0
        for (reduced, local), size in zip(reduce_after.items(), sizes):
            view = self.buffer[start:start + size].reshape(shapes[local])
            start += size
            self.outputs[local] = self.values[reduced] = ort.OrtValue.ortvalue_from_numpy(view)
            self.nbytes[kinds[reduced]] = self.nbytes.get(kinds[reduced], 0) + 4 * size

    @staticmethod
    def shapes(stage: Stage, session: ort.InferenceSession, later: set[str]) -> dict[str, tuple[int, ...]] | None:
        """The static shapes of the cut's locals when every one can be written into the buffer
        (made by the stage, float32, static, neither a later stage (`later`: what they read)
        nor a metric or state output reading it), else None."""
        locals_ = list(stage.reduce_after.values())
        outputs = {o.name: o for o in session.get_outputs()}
        excluded = set(stage.carried_in) | later | set(stage.info.metrics) | set(stage.info.state_outputs)
        if len(set(locals_)) != len(locals_) or any(n in excluded or n not in outputs for n in locals_):
            return None
        shapes = {}
        for n in locals_:
            o = outputs[n]
            if o.type != "tensor(float)" or not all(isinstance(d, int) for d in o.shape):
                return None
            shapes[n] = tuple(int(d) for d in o.shape)
        return shapes


class HandOn:
    """The buffers a stage writes the tensors it hands on into (CPU), kept across steps. ONNX
    Runtime gives a result bound by device alone fresh memory on every run, outside the
    session's arena: ResNet-18's stage 0 hands on 100 MB of activations a step, some 25,000
    fresh pages (page faults) a step that the fused step, which keeps them in its arena, never
    touches. Their shapes may follow the batch (a symbolic batch dimension), so there is one
    set per batch shape, made like the first run's outputs at that shape."""

    MAX_SHAPES = 4  # batch shapes held at most (a run's batch size is usually fixed)

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.by_batch: dict[tuple, dict[str, ort.OrtValue]] = {}
        self.off = False  # a run refused the buffers: a shape that the batch alone does not fix

    def get(self, batch: tuple) -> dict[str, ort.OrtValue]:
        return {} if self.off else self.by_batch.get(batch, {})

    def remember(self, batch: tuple, got: Mapping[str, Any]) -> None:
        """Buffers like this run's outputs, for the next runs at the same batch shape."""
        if self.off or batch in self.by_batch or len(self.by_batch) >= self.MAX_SHAPES:
            return
        held = {}
        for n in self.names:
            dtype = _ORT_TYPES.get(got[n].data_type())
            if dtype is not None:  # np.empty: its pages are touched once, by the first run writing them
                held[n] = ort.OrtValue.ortvalue_from_numpy(np.empty(got[n].shape(), dtype))
        self.by_batch[batch] = held


class StagedProgram(SubgraphIO):
    """The Program interface (run, info, inputs, written slots, timings) over the stages of
    one step graph. `comm` None: one process (a reduction's mean is the local value);
    `max_nodes`: also a cut every max_nodes nodes (runtime/stages.py)."""

    def __init__(self, model: onnx.ModelProto, info: SubgraphInfo, device, comm: Communicator | None,
                 name: str | None = None, threads: int | None = None, max_nodes: int | None = None) -> None:
        super().__init__(info, name or model.graph.name)
        self.device = _as_device(device)
        self.comm = comm
        nodes = len(model.graph.node)
        with progress.stage(f"cut {self.name} ({nodes:,} nodes) in stages"):
            self.stages = split_stages(model, info, max_nodes)
        if info.reductions:
            self.results.clear()  # a data-parallel step cut at its reductions returns no results
            self._check_rank_averages(info)
        # a graph cut for its size: every stage takes the whole graph's session options
        # (memory reuse, optimizations: runtime/device.py), so only the sorts get shorter
        whole = nodes if max_nodes else None
        with progress.stage(f"ONNX Runtime sessions {self.name} ({nodes:,} nodes in {len(self.stages)} stages)"):
            self.programs = [Program(s.model, s.info, self.device, name=f"{self.name}/stage{k}", threads=threads,
                                     carried=s.carried_in, graph_nodes=whole) for k, s in enumerate(self.stages)]
        self.input_dtypes: dict[str, Any] = {}
        for prog in self.programs:
            self.input_dtypes.update(prog.input_dtypes)
        # what each reduced tensor is, for the byte counts: its reduction point's name
        self._kinds = {r: point for point, pairs in info.reductions.items() for r in pairs}
        # per stage: its cut's host buffer (CPU), or None (the locals copied out and back)
        self.cuts: list[HostCut | None] = []
        for k, (stage, prog) in enumerate(zip(self.stages, self.programs)):
            shapes = None
            if stage.reduce_after and self.device.name == "cpu":
                later = {n for s in self.stages[k + 1:] for n in s.carried_in}
                shapes = HostCut.shapes(stage, prog.session, later)
            self.cuts.append(None if shapes is None else HostCut(stage.reduce_after, shapes, self._kinds))
        # per stage: the buffers of the tensors it hands on (CPU), or None
        self.hand_on: list[HandOn | None] = []
        for stage, cut in zip(self.stages, self.cuts):
            names = [n for n in stage.carried_out if n in stage.info.results and not (cut and n in cut.outputs)]
            self.hand_on.append(HandOn(names) if names and self.device.name == "cpu" else None)
        self.runs = 0
        self.session_seconds = 0.0
        self.last_seconds = 0.0

    def _check_rank_averages(self, info: SubgraphInfo) -> None:
        """A data-parallel step's stages read averages over the ranks only: ekfac's S (a
        per-step average every rank's update reads) must have its reduction point, and no
        later stage may read a factor slot, which holds this rank's own moving average."""
        for slot in info.state_outputs.values():
            parsed = C.parse_slot(slot)
            if parsed.kind == C.INVERSE and C.STATE_STATISTICS_POINT not in info.reductions:
                raise PlanError(f"layer {parsed.owner!r}: its block re-estimates inverse state {parsed.item!r} on "
                                "statistics steps (ekfac), inside the If of periodic statistics, where a data-parallel "
                                "step cannot average it over the ranks; use cov_update_period 1, another "
                                "approximation for it, or one process")
        reduced = False  # whether a cut before this stage averaged over the ranks
        for k, stage in enumerate(self.stages):
            if not reduced:
                reduced = bool(stage.reduce_after)
                continue
            # (a stage may fold a statistic into a factor's average: it reads the slot it writes)
            folded = set(stage.info.state_outputs.values())
            local = [s for s in stage.info.state_inputs if C.parse_slot(s).kind == C.FACTOR and s not in folded]
            if local:
                raise ContractError(f"subgraph {self.name!r}: stage {k} reads factor slot {local[0]!r}, which "
                                    "holds this rank's moving average until it is averaged over the ranks")

    def _handed_on(self, store: StateStore, stage: Stage, name: str, got: Mapping[str, Any]) -> ort.OrtValue:
        """The value of `name`, made by `stage`, for a later stage: a state output is in its
        slot's spare buffer (flipped after the last stage), a metric a host float."""
        slot = stage.info.state_outputs.get(name)
        if slot is not None:
            return store.spare(slot)
        value = got[name]
        if isinstance(value, ort.OrtValue):
            return value
        return ort.OrtValue.ortvalue_from_numpy(np.asarray(value, np.float32), self.device.ort_device,
                                                self.device.device_id)

    @property
    def session(self):
        return self.programs[0].session

    def run(self, store: StateStore, data: Mapping[str, np.ndarray] | None = None,
            hp: Mapping[str, float] | None = None, results: bool | list[str] = False,
            channel: str = "train") -> dict[str, Any]:
        if results and self.info.reductions:
            raise ValueError(f"subgraph {self.name!r} runs in stages and returns metrics only")
        want = set(self.wanted_results(results))
        write_inputs(store, data, hp, self.input_dtypes, channel)  # once: every stage reads the store
        values: dict[str, ort.OrtValue] = {}
        out: dict[str, Any] = {}
        seconds = 0.0
        batch = tuple(tuple(store.data(n, channel).shape()) for n in self.data_inputs)  # what the shapes follow
        for stage, prog, cut, kept in zip(self.stages, self.programs, self.cuts, self.hand_on):
            held = kept.get(batch) if kept is not None else {}
            carried = {n: values[n] for n in stage.carried_in}
            try:
                got = prog.run(store, channel=channel, carried=carried, keep=stage.info.results, flip=False,
                               into={**(cut.outputs if cut else {}), **held})
            except Exception:  # noqa: BLE001 - ONNX Runtime's shape mismatch has several types
                if not held or kept is None:
                    raise
                kept.off = True  # a shape the batch does not fix: fresh outputs from now on (the
                # stage wrote spare buffers and carried values only, so running it again is safe)
                got = prog.run(store, channel=channel, carried=carried, keep=stage.info.results, flip=False,
                               into=cut.outputs if cut else None)
            if kept is not None and not held:
                kept.remember(batch, got)
            seconds += prog.last_seconds
            out.update({m: got[m] for m in prog.metrics})
            out.update({r: got[r].numpy() for r in stage.info.results if r in want})
            for n in stage.carried_out:
                values[n] = self._handed_on(store, stage, n, got)
            if not stage.reduce_after:
                continue
            if cut is not None:
                if self.comm is not None:  # without, one rank: the mean is the local value
                    self.comm.mean_in_place(cut.buffer, cut.nbytes)
                values.update(cut.values)
            elif self.comm is None:
                values.update({r: got[local] for r, local in stage.reduce_after.items()})
            else:
                reduced = list(stage.reduce_after)
                means = self.comm.mean([got[stage.reduce_after[r]].numpy() for r in reduced],
                                       [self._kinds[r] for r in reduced])
                for r, mean in zip(reduced, means):
                    values[r] = ort.OrtValue.ortvalue_from_numpy(mean, self.device.ort_device,
                                                                  self.device.device_id)
        if C.FINITE in out and self.comm is not None:  # every rank takes the same decision
            out[C.FINITE] = self.comm.minimum(out[C.FINITE])
        if out.get(C.FINITE, 1.0) != 0.0:
            store.flip_all(self._written)
        self.last_seconds = seconds
        self.session_seconds += seconds
        self.runs += 1
        return out
