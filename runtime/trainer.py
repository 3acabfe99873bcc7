"""Trainer: trains a compiled plan with any registered optimizer (kfac_compiler.optimizers:
K-FAC, SGD, Adam, or a plugin of your own), with ONNX Runtime.

    from kfac_compiler.runtime import Trainer
    trainer = Trainer(plan, optimizer="kfac", device="cpu", seed=0)
    for inputs, targets in batches:
        metrics = trainer.step(inputs, targets)       # {"loss": ..., "damping": ..., ...}
    trainer.evaluate(inputs, targets)                 # {"loss": ..., and the loss's metrics}
    trainer.export("trained.onnx")                    # the model with the trained weights

All state (parameters, velocities, Kronecker factors, inverses, Adam moments) stays on the
device as double-buffered OrtValues (runtime/state.py); a step writes the batch into
pre-allocated inputs, runs one or a few subgraphs and reads back a handful of scalars. The
Trainer owns what every optimizer needs (the plan, the device state, the sessions, the
random stream, the step counters, checks, evaluation, export, checkpoints); the optimizer
plugin (`trainer.policy`) decides what a step runs. Its host state reads through the
trainer: `trainer.damping` is `trainer.policy.damping` for K-FAC.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import onnx

from kfac_compiler import contract as C
from kfac_compiler.errors import CheckpointError, ConfigError, DataError, KfacError, OutputError, PlanError
from kfac_compiler.graph import SOURCE_FLOAT_KEY, with_float_type
from kfac_compiler.onnx_files import load_onnx, needs_external, set_values, write_with_values
from kfac_compiler.optimizers import make_config, optimizer_class
from kfac_compiler.parsing import check_int
from kfac_compiler.plan import Plan
from kfac_compiler.requests import Request
from kfac_compiler.runtime.best_model import BestModel
from kfac_compiler.runtime.comm import agreed, as_communicator
from kfac_compiler.runtime.data import BatchChecker, convert_input, draw_noise, noise_shape
from kfac_compiler.runtime.device import capped_threads, get_device
from kfac_compiler.runtime.distributed import SharedRefresher, cpu_share, mean_factors
from kfac_compiler.runtime.inverses import InverseRefresher
from kfac_compiler.runtime.program import DeclaredProgram, Program, SubgraphIO, cached_program
from kfac_compiler.runtime.state import StateStore
from kfac_compiler.runtime.static_shapes import Shapes, batch_shapes

F = TypeVar("F", bound=Callable[..., Any])
# what Trainer.export writes: "auto" (the source graph where it holds every trained value), "source", "plan"
EXPORT_GRAPHS = ("auto", "source", "plan")
LAYOUTS = ("source", "plan")  # parameters(): the user's model's names and shapes, or the plan's


def _request(key: Request | tuple[Request, Shapes]) -> Request:
    """The request of a session key (a static-shape session's is (request, shapes))."""
    return key if isinstance(key, Request) else key[0]


def _serialized(method: F) -> F:
    """One call at a time per Trainer, from any thread: a step reads and flips the
    double-buffered state, so two threads stepping at once would mix their buffers silently.
    The calls then run as if made one after another."""

    @functools.wraps(method)
    def run(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def _holding_state(method: F) -> F:
    """A method that reads or writes the parameters or state: a Trainer built with
    sessions=False (it only declares its subgraphs) holds none, which is one line, not a KeyError."""

    @functools.wraps(method)
    def run(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if not self.sessions:
            raise ConfigError(f"Trainer.{method.__name__}: a Trainer built with sessions=False holds no parameters "
                              "or state (it only declares its subgraphs); build it with sessions=True")
        return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class Trainer:
    """Train `plan` with `optimizer` (a registered name: "kfac", "adam", "sgd", ...) on
    `device` ("cpu", "cuda", "auto").

    Knobs (keyword arguments) per optimizer: see kfac_compiler.optimizers and
    docs/runtime.md. `threads` sets ONNX Runtime's intra-op thread count (default: all cores).
    `batch_size` (optional): the training batch size, so that every session the steps use is
    built here and not during the first step (any batch size still works).

    `cuda_graphs=True`: every step's graph is built with the batch's shapes fixed (K-FAC's
    static_steps) and, on CUDA, captured as a CUDA graph on its second run and replayed from
    then on (docs/runtime.md, "CUDA graphs"); on the CPU the same static graphs, no capture.

    `sessions=False` builds no session and runs nothing: the trainer only asks for the
    subgraphs its steps need (kfac_compiler.store_default_subgraphs stores them in the plan).

    `comm`: the ranks of a data-parallel run ("auto": MPI.COMM_WORLD when launched under an
    MPI launcher with more than one rank; None: one process; or an mpi4py communicator).
    Every rank passes the same global batch to `step` and takes its own equal share of the
    rows; the step averages what STAGES lists over the ranks, so every rank takes the same
    step. Saving a checkpoint is collective and rank 0 writes it (docs/distributed.md).
    """

    def __init__(self, plan: Plan | str | os.PathLike, optimizer: str = "kfac", device: str = "cpu",
                 learning_rate: float | None = None, momentum: float | None = None, seed: int = 0,
                 threads: int | None = None, batch_size: int | None = None, comm: Any = "auto",
                 sessions: bool = True, cuda_graphs: bool = False, **knobs: Any) -> None:
        if isinstance(plan, (str, os.PathLike)):
            from kfac_compiler.plan import load_plan

            if os.path.isfile(plan) and os.fspath(plan).endswith(".onnx"):
                raise PlanError(f"{os.fspath(plan)!r} is an ONNX model, not a plan: compile it first "
                                "(kfac_compiler.compile or `kfac-compiler compile`)")
            plan = load_plan(plan)
        if not isinstance(plan, Plan):
            raise PlanError(f"Trainer takes a compiled plan (kfac_compiler.compile(...)) or a plan folder's path, "
                            f"got {type(plan).__name__}")
        if learning_rate is not None:
            knobs["learning_rate"] = learning_rate
        if momentum is not None:
            knobs["momentum"] = momentum
        self.plan = plan
        self.optimizer = optimizer
        self._lock = threading.RLock()  # _serialized's
        self.config = make_config(optimizer, plan, **knobs)
        self.device = get_device(device)
        self.comm = as_communicator(comm)
        self.rank: int
        self.ranks: int
        self.rank, self.ranks = (self.comm.rank, self.comm.size) if self.comm else (0, 1)
        self.threads = None if threads is None else _check_threads(threads)
        if self.threads is None and self.comm is not None and self.device.name == "cpu":
            self.threads = cpu_share(self.comm)  # ranks on one machine share its cores
        self.seed = check_int(seed, "seed", low=0)
        self.rng = np.random.default_rng(self.seed)
        self.store = StateStore(self.device, self.ranks)
        self.sessions = bool(sessions)
        # the every-step graphs built with the batch's shapes fixed and, on CUDA, captured and
        # replayed as CUDA graphs (docs/runtime.md, "CUDA graphs")
        self.cuda_graphs = bool(cuda_graphs)
        self.params = list(plan.trainable)
        self.loss = plan.loss.build()
        self._check_batch = BatchChecker(plan, self.loss)
        self.input_specs = self._check_batch.input_specs
        # host-side state every optimizer shares (the optimizer's own is in self.policy)
        self.step_count = 0        # optimizer steps taken (rejected ones included)
        self.applied_steps = 0     # steps whose update was applied (Adam's t)
        # what the caller trains on (data.dataset_fingerprint; kfac-compiler train sets it):
        # stored in checkpoints and restored with them, so that a resume can compare its data
        self.data_fingerprint: dict[str, Any] | None = None
        # the best held-out evaluation's model (fit's keep_best, train --keep-best): checkpoints carry it
        self.best_model: BestModel | None = None
        self._programs: dict[Any, Program] = {}  # by Request, or (Request, shapes) for a static-shape session
        # the current batch: whether its loss has per-example weights, and its rows (the
        # batch_size hint lets the sessions for it be built here rather than in the first step)
        self.weighted = False
        self.batch_size = 0 if batch_size is None else check_int(batch_size, "batch_size", low=0) // self.ranks
        if self.sessions:  # a Trainer that only declares its requests holds no values
            for p, value in plan.parameter_values().items():
                self.store.add(p, value)
        self.policy = optimizer_class(optimizer)(self)
        self.policy.build()

    def __getattr__(self, name: str) -> Any:
        """The optimizer's public host state and methods (e.g. trainer.damping for K-FAC)."""
        policy = self.__dict__.get("policy")
        if policy is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(policy, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object (optimizer {self.optimizer!r}) has no attribute "
                                 f"{name!r}") from None

    # ------------------------------------------------------------------ programs
    def program(self, name: str, threads: int | None = None, shapes: Shapes | None = None,
                spin: bool = True, **options: Any) -> Program:
        """The Program for subgraph `name` (created on first use; its state slots initialized);
        `threads` overrides the trainer's intra-op thread count for this session; `shapes` (a
        batch's, static_shapes.batch_shapes) fixes its symbolic dims to that batch's; `spin`
        False keeps its idle workers from spinning (see cached_program)."""
        return cached_program(self._programs, self.store, self.plan, self.device, threads or self.threads, name,
                              comm=self.comm, sessions=self.sessions, shapes=shapes, spin=spin,
                              capture=self.cuda_graphs, **options)

    @staticmethod
    def batch_shapes(data: Mapping[str, np.ndarray]) -> Shapes:
        """A batch's array shapes, the `shapes` key of program() (static_shapes.batch_shapes)."""
        return batch_shapes(data)

    def declared(self, name: str, **options: Any) -> DeclaredProgram:
        """What subgraph `name` with `options` reads and writes, without a session (and not
        among requests()): for a caller that builds its sessions later, per batch shape."""
        return cast(DeclaredProgram, cached_program({}, self.store, self.plan, self.device, self.threads, name,
                                                    sessions=False, **options))

    def requests(self) -> list[Request]:
        """The resolved requests of the sessions built so far (kfac_compiler.store_default_subgraphs
        stores their graphs); a request with sessions for several batch shapes once."""
        return list(dict.fromkeys(_request(k) for k in self._programs))

    def programs(self) -> dict[str, Program]:
        """The sessions built so far, by subgraph name; where one name has several, labelled
        with the options that tell them apart ("kfac_step[with_stats=False]"; a label depends on
        which sessions exist, so it may change as more are built)."""
        out = {}
        for key, prog in self._programs.items():
            req = _request(key)
            others = [_request(r).options.to_json() for r in self._programs if _request(r).name == req.name and r != key]
            mine = req.options.to_json()
            differ = sorted({k for o in others for k in mine if o.get(k) != mine[k]})
            shapes = f"[static {dict(key[1]).get(C.TARGETS, ())}]" if key is not req else ""
            out[req.name + "".join(f"[{k}={mine[k]}]" for k in differ) + shapes] = prog
        return out

    def session_seconds(self) -> float:
        return sum(p.session_seconds for p in self._programs.values())

    # ------------------------------------------------------------------ services for optimizers
    def draw_noise(self, prog: Program, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The noise inputs of `prog` (a sampled estimator's) for this batch, from the trainer's
        random stream (checkpointed, so a resumed run draws what an uninterrupted one would).
        In a data-parallel run every rank draws the global batch's noise and keeps its rows,
        so that the ranks sample what one process would. Written into the store's "train"
        channel here and returned empty: a feed holding the arrays kept a second copy alive
        through the run (noise of one value per output entry is output-sized)."""
        store, filled = self.store, set()

        def into(name: str, shape: list[int]) -> np.ndarray | None:
            # one process on the CPU: drawn straight into the input's buffer (a data-parallel
            # rank keeps only its share of what it draws)
            buf = None if self.comm is not None else store.host_buffer(name, shape, np.float32)
            if buf is not None:
                filled.add(name)
            return buf

        noise = draw_noise(self.rng, prog.info, prog.data_inputs, data[C.TARGETS], prog.name, shares=self.ranks,
                           into=into)
        for name in list(noise):
            value = noise.pop(name)
            if name not in filled:
                store.write_data(name, value if self.comm is None else self._share(value),
                                 prog.input_dtypes.get(name))
            del value
        return {}

    def noise_placeholders(self, prog: Program, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Buffers for the noise inputs of a run that does not read them (a step whose `If`
        skips its statistics) where none was written yet, e.g. right after a checkpoint load:
        zeros, so that the random stream stays that of an uninterrupted run."""
        missing = [n for n in prog.data_inputs if C.is_noise(n) and not self.store.has_data(n)]
        if not missing:
            return {}
        shape = noise_shape(prog.info, data[C.TARGETS], prog.name)
        return {n: np.zeros(shape, np.float32) for n in missing}

    def inverse_refresher(self, emitted: SubgraphIO | Sequence[SubgraphIO | None], reader: Program, method: str,
                          groups: Sequence[Sequence[str]] | None = None,
                          owners: Mapping[str, int] | None = None,
                          power: float = -1.0) -> InverseRefresher | SharedRefresher:
        """Refreshes the inverse slots `reader` uses: `emitted` (an inverse_update program, or
        one per group of layers `groups`) for the blocks it writes, the blocks' numpy twins on
        the host for the rest. In a data-parallel run the programs cover this rank's blocks
        (`owners`; None where a group has none) and the refresh shares the work. `power`:
        the slots hold (F + damping)^power's state (power_update programs for power != -1)."""
        if self.comm is None:
            return InverseRefresher(self.plan, emitted, reader, method, groups, power=power)
        return SharedRefresher(self.plan, emitted, reader, method, groups, owners, self.comm, power=power)

    # ------------------------------------------------------------------ steps
    def _prepare(self, inputs: Mapping[str, Any], targets: Any, weights: Any = None) -> dict[str, np.ndarray]:
        """The checked batch; sets the current batch's weighting and rows."""
        data = self._check_batch(inputs, targets, weights)
        if self.comm is not None:
            n = int(data[C.TARGETS].shape[0])
            if n % self.ranks:
                raise DataError(f"a batch of {n} rows does not split evenly over {self.ranks} ranks; use a batch size "
                                f"divisible by {self.ranks}")
            data = {k: self._share(v) for k, v in data.items()}
        self.weighted = C.EXAMPLE_WEIGHTS in data
        self.batch_size = int(data[C.TARGETS].shape[0])
        return data

    def _share(self, array: np.ndarray) -> np.ndarray:
        """This rank's equal share of the rows of a global batch's array."""
        rows = array.shape[0] // self.ranks
        return array[self.rank * rows:(self.rank + 1) * rows]

    @_serialized
    def step(self, inputs: Mapping[str, Any], targets: Any, weights: Any = None) -> dict[str, float]:
        """One optimizer step on a batch; returns host-float metrics. `weights`: optional loss
        weights or a 0/1 mask, one per example ([N]) or per position (shaped like the targets
        of softmax cross-entropy, or the output of an elementwise loss, or their leading
        axes): L = 1/N sum_n sum_t w_nt l_nt; masked positions count for nothing in the loss,
        the gradients and the curvature (docs/runtime.md, "Weights and masks"). With the knob
        `accumulate=k` a call takes one micro-batch and every k-th call updates, as one step on
        the k micro-batches together (optimizers/accumulate.py); the others report
        `accumulating: 1`."""
        data = agreed(self.comm, lambda: self._prepare(inputs, targets, weights))
        t0 = time.perf_counter()
        s0 = self.session_seconds()
        metrics = self.policy.cycle.run(self.policy, data, ("loss", *self.loss.metrics))
        if "loss" not in metrics:  # the CLI, fit and the progress line read it
            raise ConfigError(f"optimizer {self.optimizer!r}: its step returned no 'loss' metric (it returned "
                              f"{sorted(metrics)}); a registered optimizer's step reports the batch's loss "
                              "(docs/extending.md)")
        self._mean_loss_metrics(metrics)
        wall = time.perf_counter() - t0
        metrics["step_time"] = wall
        metrics["host_time"] = max(wall - (self.session_seconds() - s0), 0.0)
        return metrics

    def _mean_loss_metrics(self, metrics: dict[str, float]) -> None:
        """The loss's own step metrics (each head's loss) as means over the ranks, like the loss."""
        names = [k for k in self.loss.metrics if k in metrics]
        if self.comm is not None and names:
            means = self.comm.mean([np.float32(metrics[k]) for k in names], "metrics")
            metrics.update({k: float(v) for k, v in zip(names, means)})

    @_serialized
    def burn_in(self, inputs: Mapping[str, Any], targets: Any, weights: Any = None) -> dict[str, float]:
        """A statistics-only step (K-FAC: no parameter update, the factors absorb the batch);
        `weights` as step's."""
        self.policy.cycle.check_boundary("burn_in")
        return self.policy.burn_in(agreed(self.comm, lambda: self._prepare(inputs, targets, weights)))

    # ------------------------------------------------------------------ evaluation
    @_serialized
    def evaluate(self, inputs: Mapping[str, Any], targets: Any, batch_size: int | None = None,
                 weights: Any = None) -> dict[str, float]:
        """Mean loss and the loss's metrics (Loss.metrics, e.g. softmax cross-entropy's
        accuracy) at the current parameters; `weights` as step's, over all the examples
        given (chunking by batch_size does not change the result, except on a model that
        normalizes by its batch's statistics, a training-mode BatchNormalization: its output
        depends on the rows evaluated together, so there each chunk is its own batch)."""
        if batch_size is not None and check_int(batch_size, "evaluate: batch_size") < 1:
            raise ConfigError(f"evaluate: batch_size must be >= 1, got {batch_size}")
        data = self._check_batch(inputs, targets, weights)
        weighted = C.EXAMPLE_WEIGHTS in data
        prog = self.program(C.LOSS_GRAPH, weighted=weighted)
        n = data[C.TARGETS].shape[0]
        bs = n if not batch_size else int(batch_size)
        result = prog.results[0] if prog.results and self.loss.metrics else None
        if result and weighted and not self.loss.metrics_take_weights():
            raise ConfigError(f"evaluate: loss {self.loss.kind!r} computes its metrics with metric_totals(outputs, "
                              "targets), without weights: a weighted evaluation needs metric_totals(outputs, targets, "
                              "weights=None) (docs/extending_losses.md); evaluate without weights")
        total = 0.0
        sums: dict[str, list] = {}  # metric: [sum, count]
        for s in range(0, n, bs):
            chunk = {k: v[s:s + bs] for k, v in data.items()}
            out = prog.run(self.store, chunk, results=[result] if result else False, channel="eval")
            m = chunk[C.TARGETS].shape[0]
            total += out[C.LOSS] * m
            if result:
                extra = (chunk[C.EXAMPLE_WEIGHTS],) if weighted else ()
                for name, (value, count) in self.loss.metric_totals(out[result], chunk[C.TARGETS], *extra).items():
                    acc = sums.setdefault(name, [0, 0])
                    acc[0] += value
                    acc[1] += count
        metrics = {"loss": total / n}
        # a metric over nothing (every target masked) is NaN, as torch's mean over no element
        metrics.update({name: value / count if count else float("nan") for name, (value, count) in sums.items()})
        return metrics

    @_serialized
    @_holding_state
    def predict(self, inputs: Mapping[str, Any]) -> np.ndarray:
        """The model output at the current parameters (runs the plan's model with them); with
        several loss heads a dict {head output: array}."""
        specs = self._check_batch.input_specs
        if not isinstance(inputs, Mapping):
            raise DataError(f"predict: inputs must be a dict keyed by the model inputs {list(specs)}")
        missing = [n for n in specs if n not in inputs]
        unknown = [n for n in inputs if n not in specs]
        if missing or unknown:
            raise DataError(f"predict: inputs must be exactly the model's {list(specs)} "
                            f"(missing {missing}, unknown {unknown})")
        bounds = self._check_batch.index_bounds
        feeds = {k: convert_input(k, *specs[k], v, "predict", bounds.get(k)) for k, v in inputs.items()}
        prog = self.program(C.PREDICT)  # the plan's graph in float32, as trained, on the trainer's device
        return self.loss.prediction(prog.run(self.store, feeds, results=True, channel="eval")[prog.results[0]])

    # ------------------------------------------------------------------ parameters
    @_serialized
    @_holding_state
    def parameters(self, layout: str = "source") -> dict[str, np.ndarray]:
        """The trainable parameters. `layout` "source" (the default): in the names and shapes
        of the user's model (Plan.source_trainable: an LSTM's W [D, 4H, I] whole, not the
        plan's per-direction pieces); "plan": the plan's own (Plan.trainable, the names
        gradients and the plan's graph use). The two are the same where the plan holds every
        parameter as the model does."""
        values = {p: self.store.to_numpy(p) for p in self.params}
        return self.plan.to_source_layout(values) if _layout(layout) == "source" else values

    @_serialized
    @_holding_state
    def set_parameters(self, values: Mapping[str, np.ndarray], layout: str = "source") -> None:
        """Overwrite some or all trainable parameters, given in `layout` as parameters() gives
        them; every name and shape is checked before any value is written."""
        if _layout(layout) == "source" and isinstance(values, Mapping):  # else set_parameters says what it takes
            values = self.plan.to_plan_layout(values, {p: self.store.to_numpy(p) for p in self.params})
        self.store.set_parameters(self.params, values)

    @_serialized
    @_holding_state
    def state(self) -> dict[str, np.ndarray]:
        """Every device state slot, copied to the host."""
        return self.store.state_dict()

    @property
    def learning_rate(self) -> float | None:
        """The learning rate the next step uses (a schedule's value at step_count); None where
        the optimizer chooses it (K-FAC's quadratic model)."""
        if getattr(self.config, "learning_rate", None) is None:
            return None
        return self.config.at("learning_rate", self.step_count)

    def trained_names(self) -> list[str]:
        """The names trained_values() gives: the plan's parameters, then the non-trained state
        the steps update (BatchNormalization running statistics: every other state slot named
        after an initializer of the model)."""
        params = set(self.params)
        return [*self.params, *(t.name for t in self.plan.model.graph.initializer
                                if t.name not in params and t.name in self.store)]

    @_serialized
    @_holding_state
    def trained_values(self, copy: bool = True) -> dict[str, np.ndarray]:
        """The trained parameters and the non-trained state the steps update (trained_names).
        `copy` False: read-only views of the state where it lives on the host, valid until the
        next run (an export, which writes them out at once: a 2.2 GB table's copy is 2.2 GB)."""
        read = self.store.to_numpy if copy else self.store.read_only
        return {n: read(n) for n in self.trained_names()}

    @_serialized
    @_holding_state
    def set_trained_values(self, values: Mapping[str, np.ndarray]) -> None:
        """Write back values trained_values() gave (all or some): the model of an earlier step,
        e.g. fit's keep_best. The optimizer's own state (moments, factors, step count) stays."""
        self.store.set_parameters(self.trained_names(), values)

    @_holding_state
    def exported_model(self, graph: str = "auto") -> onnx.ModelProto:
        """The trained model: `graph` "source", the user's model file itself (its nodes, names,
        fused recurrent ops and outputs) with the trained values written into its initializers
        (Plan.source_values); "plan", the plan's (canonical) graph with the trained values;
        "auto" (the default), the source where it holds every trained value (the plan was
        compiled from a file that is still there, unchanged, and untied no parameter), else
        the plan's."""
        model, values = self._export_parts(graph)
        if needs_external(model, values):
            raise OutputError("the trained model is over 1 GiB, too large for one ONNX protobuf: write it with "
                              "Trainer.export(path), which puts its values in external data beside it")
        set_values(model, values)
        return model

    def _export_parts(self, graph: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        """The model exported_model(graph) writes the trained values into, and those values
        (the plan's graph of a converted model in its source's float type, the values' own
        initializers retyped without data: the writers cast each value as they write it)."""
        if graph not in EXPORT_GRAPHS:
            raise ConfigError(f"export: graph must be one of {', '.join(map(repr, EXPORT_GRAPHS))}, got {graph!r}")
        if graph == "source":
            return self._trained_source()
        if graph == "auto":
            why = self.source_problem()
            if why is None:
                values = self.plan.source_values(self.trained_values(copy=False))
                source = load_onnx(cast(str, self.plan.source_path), replaced=values)
                if not self._untied_copies(source):
                    return self._trained_source(source, values)
                why = "it untied parameters"
            self._warn_layout(why)
        model = onnx.ModelProto()
        model.CopyFrom(self.plan.model)
        _expose_outputs(model, self.loss.output_names(self.plan.output))
        values = self.trained_values(copy=False)
        return _in_source_float_type(model, values), values

    def _warn_layout(self, why: str) -> None:
        """Warn that the plan's graph is written instead of the source (`why`): where it holds
        parameters of the user's model in its own layout (graph.held_elsewhere), naming the
        first; else, where the plan came from a file, that the file's other outputs, inputs and
        nodes are not in it (a moved or deleted source, or untied parameters, had written the
        canonical graph without a word)."""
        import warnings

        from kfac_compiler.graph import held_elsewhere

        held = held_elsewhere(self.plan.model)
        if held:
            name, h = next(iter(held.items()))
            where = ", ".join(f"{k} {list(v)}" for k, v in h["holders"].items())
            warnings.warn(f"export: the plan's graph is written ({why}); it holds {len(held)} of the source's "
                          f"initializers in its own layout ({name} {list(h['shape'])} as {where}); export from a plan "
                          "compiled from the unchanged source file to get them back in the source's", stacklevel=4)
        elif self.plan.source_path:
            warnings.warn(f"export: the plan's graph is written, not the source model {self.plan.source_path!r} "
                          f"({why}): it holds the trained output and what feeds it, none of the source's other "
                          "outputs, inputs or nodes; export with the unchanged source in place to get them",
                          stacklevel=4)

    def source_problem(self) -> str | None:
        """Why the source graph cannot take the trained values (None: it can)."""
        from kfac_compiler.plan import source_change

        src = self.plan.source_path
        if not src:
            return "the plan was compiled from an in-memory model"
        if not os.path.isfile(src):
            return f"its source {src!r} is gone"
        return source_change(src, self.plan.source_sha256, self.plan.source_external)

    def _untied_copies(self, model: onnx.ModelProto) -> list[str]:
        names = {t.name for t in model.graph.initializer}
        return [p for p in self.params if p not in names and p not in self.plan.holders_of_pieces()]

    def _trained_source(self, model: onnx.ModelProto | None = None,
                        values: dict[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        """The source model (`model`, already loaded without the external data of `values`, or
        the plan's source file) and the trained values of its initializers (`values`: the
        source's names, plan.source_values)."""
        import warnings

        if values is None:
            values = self.plan.source_values(self.trained_values(copy=False))
        if model is None:
            why = self.source_problem()
            if why is not None:
                raise PlanError(f"cannot export the source graph: {why}; export the plan's graph (graph='plan')")
            model = load_onnx(cast(str, self.plan.source_path), replaced=values)
        left = self._untied_copies(model)
        if left:
            warnings.warn(f"{len(left)} trained initializers have no place in the source graph (untied copies: "
                          f"{', '.join(left[:3])}{', ...' if len(left) > 3 else ''}); the source keeps each original's "
                          "first copy, export graph='plan' keeps them all", stacklevel=3)
        names = {t.name for t in model.graph.initializer}
        return model, {name: v for name, v in values.items() if name in names}

    @_serialized
    @_holding_state
    def export(self, path: str | os.PathLike, graph: str = "auto") -> str:
        """Write the trained model (exported_model(graph): by default the user's own graph
        where it can hold every trained value, else the plan's) with the trained weights and
        the running statistics the steps updated as initializers (atomic)."""
        from kfac_compiler.runtime.checkpoint import atomic_write, write_with_external_data

        path = os.fspath(path)

        def write() -> str:
            self._check_not_an_input(path, "the trained model")
            model, values = self._export_parts(graph)
            if needs_external(model, values):
                write_with_external_data(path, model, values)
            else:  # the large values streamed from their arrays into the protobuf's bytes
                atomic_write(path, lambda f: write_with_values(f, model, values), what="the trained model")
            return path

        return self._written_by_rank_0(write, "the trained model", path)

    # ------------------------------------------------------------------ checkpoints
    @_serialized
    @_holding_state
    def save_checkpoint(self, path: str | os.PathLike) -> str:
        from kfac_compiler.runtime.checkpoint import save_checkpoint

        self.policy.cycle.check_boundary("save_checkpoint")  # the running gradient sum is not stored
        self._check_not_an_input(os.fspath(path), "the checkpoint")
        if self.comm is not None:  # collective: the moving averages are the ranks' mean
            self.reduce_moving_averages()
        return self._written_by_rank_0(lambda: save_checkpoint(self, path), "the checkpoint", os.fspath(path))

    def _written_by_rank_0(self, write: Callable[[], str], what: str, path: str) -> str:
        """write() on rank 0 (every rank holds the same state), `path` on the others; in a
        data-parallel run every rank learns whether rank 0's write failed (a folder given, a
        full disk): rank 0 raises its own error, the others an OutputError saying so. They had
        returned as if written and then waited in the next step's collective for ever."""
        failure: BaseException | None = None
        result = path
        try:
            if self.rank == 0:
                result = write()
        except (KfacError, OSError) as e:
            if self.comm is None:
                raise
            failure = e
        if self.comm is not None:
            reports = self.comm.gather(None if failure is None else " ".join(str(failure).split()))
            if failure is not None:
                raise failure
            if reports[0] is not None:
                raise OutputError(f"rank 0 could not write {what} {path!r}: {reports[0]}")
        return result

    def _check_not_an_input(self, path: str, what: str) -> None:
        """An API output never overwrites what the plan reads (the command line's outputs are
        checked the same way: plan.plan_inputs)."""
        from kfac_compiler.plan import input_problem

        hit = input_problem(self.plan, path)
        if hit is not None:
            raise OutputError(f"cannot write {what} {path!r}: it would overwrite {hit}; give another path")

    def reduce_moving_averages(self) -> None:
        """Replace every factor slot by its mean over the ranks. Each rank
        keeps the moving average of its own examples' statistics; the average is linear in
        them, so the mean of the ranks' averages is the moving average of the whole batches'
        statistics, exactly. Collective; nothing to do in one process."""
        if self.comm is not None:
            mean_factors(self.store, self.comm)

    def mean_over_ranks(self, value: float) -> float:
        """A host scalar's mean over the ranks (itself in one process)."""
        return value if self.comm is None else float(self.comm.mean([np.float32(value)], "scalars")[0])

    @_serialized
    @_holding_state
    def restore(self, path: str | os.PathLike) -> Trainer:
        from kfac_compiler.runtime.checkpoint import restore_checkpoint

        restore_checkpoint(self, path)
        self.policy.cycle.reset()  # a cycle in progress is dropped with the state it summed into
        return self

    @classmethod
    def load_checkpoint(cls, path: str | os.PathLike, plan: Plan, device: str = "cpu", batch_size: int | None = None,
                        cuda_graphs: bool = False, **overrides: Any) -> Trainer:
        """A new Trainer for `plan` with the optimizer, knobs and state stored in `path`;
        `overrides` (knobs) apply from the restored step on (a given damping replaces the
        adapted one); a seed other than the checkpoint's is refused."""
        from kfac_compiler.optimizers import ALIASES
        from kfac_compiler.optimizers.schedules import CALLABLE
        from kfac_compiler.runtime.checkpoint import read_meta

        meta = read_meta(path)  # checked: check_meta
        wanted = overrides.pop("optimizer", meta["optimizer"])  # the checkpoint's own, or refused
        if wanted != meta["optimizer"]:
            raise ConfigError(f"checkpoint {os.fspath(path)!r} was written by optimizer {meta['optimizer']!r}, not "
                              f"{wanted!r}; resume it without optimizer= (its state is {meta['optimizer']}'s)")
        stored = dict(meta["knobs"])
        given = {ALIASES.get(k, k): v for k, v in overrides.items()}
        for k, v in stored.items():  # a callable schedule is not storable: it is passed again
            if v == CALLABLE:
                if k not in given:
                    raise ConfigError(f"checkpoint {os.fspath(path)!r} was written with a callable {k} schedule, "
                                      f"which it cannot store; pass it again ({k}=...)")
                stored[k] = given[k]
        threads = stored.pop("threads", None)
        try:  # the stored options alone, so that an error in them names the checkpoint
            make_config(meta["optimizer"], plan, **stored)
            if threads is not None:
                threads = _check_threads(threads)
        except ConfigError as e:
            raise CheckpointError(f"checkpoint {os.fspath(path)!r}: knobs: {e}") from None
        seed = meta["seed"]
        if "seed" in overrides and overrides["seed"] != seed:
            # the random stream is restored from the checkpoint: another seed could not apply
            raise ConfigError(f"seed {overrides['seed']!r} differs from the seed {seed!r} of checkpoint "
                              f"{os.fspath(path)!r}; resume with the checkpoint's seed")
        overrides = {k: v for k, v in overrides.items() if k != "seed"}
        # an alias replaces the stored knob; the optimizer drops stored knobs an override re-derives
        knobs = optimizer_class(meta["optimizer"]).Config.resumed_knobs(stored, {k: v for k, v in given.items()
                                                                             if k != "seed"})
        threads = knobs.pop("threads", threads)
        knobs.pop("seed", None)
        trainer = cls(plan, optimizer=meta["optimizer"], device=device, seed=seed, threads=threads,
                      batch_size=batch_size, cuda_graphs=cuda_graphs, **knobs)
        trainer.restore(path)
        trainer.policy.resumed({ALIASES.get(k, k) for k in overrides})
        return trainer

    def host_state(self) -> dict[str, Any]:
        """Host counters for checkpoints; batch_size (the last step's rows: every rank's, every
        micro-batch's of an accumulation cycle) lets a resumed command line default to the
        batch size the run used."""
        return {"step_count": self.step_count, "applied_steps": self.applied_steps,
                "batch_size": self.batch_size * self.ranks * self.policy.cycle.count,
                **self.policy.host_state()}

    def set_host_state(self, st: Mapping[str, Any]) -> None:
        self.step_count = int(st["step_count"])
        self.applied_steps = int(st["applied_steps"])
        self.policy.set_host_state(st)

    def __repr__(self) -> str:
        damping = self.policy.host_state().get("damping")
        return (f"Trainer(optimizer={self.optimizer!r}, device={self.device.name!r}, params={len(self.params)}, "
                f"step={self.step_count}" + (f", damping={damping:.3g})" if damping is not None else ")"))


def _in_source_float_type(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """`model` (ours to change) in the float type its source came in (the front end trains a
    float16, bfloat16 or float64 model in float32: frontend._as_float32; only the plan's graph
    records it), its initializers named in `values` retyped without data: the writers cast each
    trained value to its initializer's type as they write it, so no float32 or converted copy
    of the weights is made."""
    props = {p.key: p.value for p in model.metadata_props}
    source = props.pop(SOURCE_FLOAT_KEY, None)
    if source is None:
        return model
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    to, float32 = onnx.TensorProto.DataType.Value(source), onnx.TensorProto.FLOAT
    for t in model.graph.initializer:  # retyped, their data dropped before with_float_type copies the model
        if t.name in values:
            t.CopyFrom(onnx.TensorProto(name=t.name, dims=t.dims, data_type=to if t.data_type == float32 else t.data_type))
    return with_float_type(model, to, {float32})


def _layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def _check_threads(threads: Any) -> int:
    return capped_threads(check_int(threads, "threads", low=1))


def _expose_outputs(model: onnx.ModelProto, names: list[str]) -> None:
    """Put the tensors `names` (a plan with several heads: the heads' outputs) before the
    model's graph outputs, so that an exported model answers with them."""
    g = model.graph
    have = [o.name for o in g.output]
    if names == have:
        return
    known = {vi.name: vi for vi in list(g.value_info) + list(g.output)}
    extra = [known.get(n) or onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in have]
    outputs = [onnx.ValueInfoProto() for _ in extra] + list(g.output)
    for vi, src in zip(outputs, extra):
        vi.CopyFrom(src)
    del g.output[:]
    g.output.extend(outputs)
