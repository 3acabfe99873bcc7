"""StagedProgram: a step cut at its reduction points (runtime/stages.py), run stage by stage
with the ranks' all-reduces in between; a drop-in for Program in a data-parallel run.

    stage 0 -> mean over ranks of its locals (loss, gradients) -> stage 1 -> mean (the
    quadratic model's terms) -> stage 2 -> mean (the loss after the update) -> stage 3

Tensors a stage hands to a later one stay device OrtValues; only the reduced values travel
through the host. The state is flipped after the last stage, when every rank agrees that the
step is finite (metric/finite's minimum over the ranks), so a rejected step is rejected on
every rank.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from kfac_compiler import contract as C
from kfac_compiler.contract import SubgraphInfo
from kfac_compiler.errors import PlanError
from kfac_compiler.runtime.comm import Communicator
from kfac_compiler.runtime.program import ContractError, Program, SubgraphIO, _as_device, write_inputs
from kfac_compiler.runtime.stages import Stage, split_stages
from kfac_compiler.runtime.state import StateStore


class StagedProgram(SubgraphIO):
    """The Program interface (run, info, inputs, written slots, timings) over the stages of
    one step graph."""

    def __init__(self, model: onnx.ModelProto, info: SubgraphInfo, device, comm: Communicator,
                 name: str | None = None, threads: int | None = None) -> None:
        super().__init__(info, name or model.graph.name)
        self.results: list[str] = []  # a step cut in stages returns no results
        self.device = _as_device(device)
        self.comm = comm
        for slot in info.state_outputs.values():  # ekfac's S: a per-step average every rank's update reads
            parsed = C.parse_slot(slot)
            if parsed.kind == C.INVERSE and C.STATE_STATISTICS_POINT not in info.reductions:
                raise PlanError(f"layer {parsed.owner!r}: its block re-estimates inverse state {parsed.item!r} on "
                                "statistics steps (ekfac), inside the If of periodic statistics, where a data-parallel "
                                "step cannot average it over the ranks; use cov_update_period 1, another "
                                "approximation for it, or one process")
        self.stages: list[Stage] = split_stages(model, info)
        for k, stage in enumerate(self.stages[1:], 1):  # a rank's own factor averages feed no update
            # (a stage may fold a statistic into a factor's average: it reads the slot it writes)
            folded = set(stage.info.state_outputs.values())
            local = [s for s in stage.info.state_inputs if C.parse_slot(s).kind == C.FACTOR and s not in folded]
            if local:
                raise ContractError(f"subgraph {self.name!r}: stage {k} reads factor slot {local[0]!r}, which "
                                    "holds this rank's moving average until it is averaged over the ranks")
        self.programs = [Program(s.model, s.info, self.device, name=f"{self.name}/stage{k}", threads=threads,
                                 carried=s.carried_in) for k, s in enumerate(self.stages)]
        self.input_dtypes: dict[str, Any] = {}
        for prog in self.programs:
            self.input_dtypes.update(prog.input_dtypes)
        # what each reduced tensor is, for the byte counts: its reduction point's name
        self._kinds = {r: point for point, pairs in info.reductions.items() for r in pairs}
        self.runs = 0
        self.session_seconds = 0.0
        self.last_seconds = 0.0

    @property
    def session(self):
        return self.programs[0].session

    def run(self, store: StateStore, data: Mapping[str, np.ndarray] | None = None,
            hp: Mapping[str, float] | None = None, results: bool | list[str] = False,
            channel: str = "train") -> dict[str, Any]:
        if results:
            raise ValueError(f"subgraph {self.name!r} runs in stages and returns metrics only")
        write_inputs(store, data, hp, self.input_dtypes, channel)  # once: every stage reads the store
        values: dict[str, ort.OrtValue] = {}
        out: dict[str, Any] = {}
        seconds = 0.0
        for stage, prog in zip(self.stages, self.programs):
            got = prog.run(store, channel=channel, carried={n: values[n] for n in stage.carried_in},
                           keep=stage.info.results, flip=False)
            seconds += prog.last_seconds
            out.update({m: got[m] for m in prog.metrics})
            values.update({n: got[n] if isinstance(got[n], ort.OrtValue) else  # a metric (host) a later stage reads
                           ort.OrtValue.ortvalue_from_numpy(np.asarray(got[n], np.float32), self.device.ort_device,
                                                            self.device.device_id)
                           for n in stage.carried_out})
            if stage.reduce_after:
                reduced = list(stage.reduce_after)
                means = self.comm.mean([got[stage.reduce_after[r]].numpy() for r in reduced],
                                       [self._kinds[r] for r in reduced])
                for r, mean in zip(reduced, means):
                    values[r] = ort.OrtValue.ortvalue_from_numpy(mean, self.device.ort_device,
                                                                  self.device.device_id)
        if C.FINITE in out:  # every rank takes the same decision
            out[C.FINITE] = self.comm.minimum(out[C.FINITE])
        if out.get(C.FINITE, 1.0) != 0.0:
            store.flip_all(self._written)
        self.last_seconds = seconds
        self.session_seconds += seconds
        self.runs += 1
        return out
