"""The ranks of a data-parallel run: an MPI communicator and the few collectives training needs.

    comm = world()              # None in one process; MPI.COMM_WORLD's ranks under mpirun
    comm.mean([g1, g2], "gradients")   # one packed float32 all-reduce, means over the ranks
    comm.agree(error)           # every rank raises the first failing rank's error, or none does

mpi4py (with an MPI that pip installs: `pip install 'kfac_compiler[mpi]'`) is imported only
when a run is launched under MPI with more than one rank or a communicator is passed. Every
collective counts its payload bytes by kind (`sent`), for the benchmarks and `--verbose`.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from kfac_compiler.errors import ConfigError, KfacError

# environment variables a launcher sets to the number of ranks (Open MPI, MPICH/Hydra, PMIx)
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")  # ... to this rank
T = TypeVar("T")
INSTALL_HINT = "pip install 'kfac_compiler[mpi]' (mpi4py and Open MPI from PyPI)"


class RankError(KfacError):
    """Another rank of a data-parallel run failed; the message names it."""


def _launcher_value(variables: Sequence[str], default: int) -> int:
    """The first of the launcher's environment `variables` holding a number, else `default`."""
    for var in variables:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return default


def launched_ranks() -> int:
    """The number of ranks the MPI launcher started this process among (1 when not under one)."""
    return _launcher_value(SIZE_VARIABLES, 1)


def launched_rank() -> int:
    """This process's rank among those the MPI launcher started (0 when not under one)."""
    return _launcher_value(RANK_VARIABLES, 0)


def mpi():
    """The mpi4py.MPI module, or a one-line ConfigError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(f"data-parallel training needs mpi4py: {INSTALL_HINT}") from None
    return MPI


class Communicator:
    """A data-parallel run's ranks (an mpi4py communicator) and its collectives: means of
    float arrays, scalar minima and sums, broadcasts from an owner, and agreement on errors."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self.sent: dict[str, int] = defaultdict(int)  # payload bytes per rank, by kind
        self.seconds = 0.0  # wall time in collectives (waiting for the slowest rank included)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def _timed(self, call, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def _count(self, kind: str, nbytes: int) -> None:
        self.sent[kind] += int(nbytes)

    def mean(self, arrays: Sequence[np.ndarray], kind: str | Sequence[str]) -> list[np.ndarray]:
        """Every array's mean over the ranks (float32), in one all-reduce of their packed
        concatenation; `kind` names what they are for the byte counts (one per array, or one
        for all)."""
        arrays = [np.asarray(a, np.float32) for a in arrays]
        if not arrays:
            return []
        buf = _packed(arrays)
        kinds = [kind] * len(arrays) if isinstance(kind, str) else list(kind)
        self.mean_in_place(buf, {k: sum(a.nbytes for a, ak in zip(arrays, kinds) if ak == k)
                                 for k in dict.fromkeys(kinds)})
        return _unpacked(buf, arrays)

    def mean_in_place(self, buf: np.ndarray, nbytes: Mapping[str, int]) -> None:
        """Replace the float32 buffer `buf` by its mean over the ranks (one all-reduce);
        `nbytes`: what it holds, bytes by kind, for the counts. A caller that keeps one packed
        buffer across steps (runtime/staged.py) allocates and copies nothing per call."""
        self._timed(self.comm.Allreduce, mpi().IN_PLACE, buf, op=mpi().SUM)
        if self.size > 1:  # one rank's sum is its mean: a pass over the buffer saved
            buf /= np.float32(self.size)
        for k, n in nbytes.items():
            self._count(k, n)

    def minimum(self, value: float, kind: str = "flags") -> float:
        self._count(kind, 8)
        return float(self._timed(self.comm.allreduce, float(value), op=mpi().MIN))

    def broadcast(self, arrays: Sequence[np.ndarray], root: int, kind: str) -> list[np.ndarray]:
        """`arrays` as the rank `root` holds them (every rank passes arrays of the same shapes),
        in one broadcast of their packed concatenation."""
        arrays = [np.asarray(a, np.float32) for a in arrays]
        if not arrays:
            return []
        buf = _packed(arrays)
        self._timed(self.comm.Bcast, buf, root=root)
        self._count(kind, buf.nbytes)
        return _unpacked(buf, arrays)

    def agree(self, error: BaseException | None = None, stop: bool = False) -> bool:
        """Every rank's outcome of a local step (an error, a stop request): the first failing
        rank's error is raised on every rank, its message led by `rank r:`; otherwise whether
        any rank asked to stop. One small all-gather."""
        report = None if error is None else (type(error), str(error))
        outcomes = self.gather((report, bool(stop)))
        self._count("flags", 8)
        for rank, (failed, _) in enumerate(outcomes):
            if failed is not None:
                cls, message = failed
                if not (isinstance(cls, type) and issubclass(cls, KfacError)):
                    cls = RankError
                raised = cls(f"rank {rank}: {message}")
                raised.agreed = True  # raised on every rank: a command prints it once (kfac_compiler.ranks)
                raise raised
        return any(s for _, s in outcomes)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (a small picklable object), in rank order."""
        return self._timed(self.comm.allgather, value)


def _packed(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """One contiguous float32 buffer of the arrays, flattened in order (a copy: the
    collectives work in place)."""
    return np.concatenate([a.reshape(-1) for a in arrays])


def _unpacked(buf: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Views of `buf` shaped like the arrays `like`, in order (_packed's inverse)."""
    ends = np.cumsum([a.size for a in like])
    return [part.reshape(a.shape) for part, a in zip(np.split(buf, ends[:-1]), like)]


def agreed(comm: Communicator | None, work: Callable[[], T]) -> T:
    """work(), where in a data-parallel run a KfacError on any rank is raised on every rank
    (Communicator.agree: led by `rank r:`) instead of leaving the others waiting. `work` must
    not enter a collective: a rank that failed before it would leave the others waiting there."""
    if comm is None:
        return work()
    result, error = None, None
    try:
        result = work()
    except KfacError as e:
        error = e
    comm.agree(error)  # raises where work() did on any rank: result is work()'s here
    return cast(T, result)


def as_communicator(comm: Any = "auto") -> Communicator | None:
    """The Trainer's `comm` argument resolved: "auto" is MPI.COMM_WORLD when launched under an
    MPI launcher with more than one rank (else None, one process); None is one process; a
    Communicator or an mpi4py communicator is used as given (one rank too: the step then
    runs in stages, as benchmarks/bench_mpi.py measures)."""
    if comm is None:
        return None
    if isinstance(comm, str):
        if comm != "auto":
            raise ConfigError(f"comm must be 'auto', None or an mpi4py communicator, got {comm!r}")
        if launched_ranks() <= 1:
            return None
        comm = mpi().COMM_WORLD
        if comm.Get_size() <= 1:
            return None
    if not isinstance(comm, Communicator):
        if not (hasattr(comm, "Get_rank") and hasattr(comm, "Allreduce")):
            raise ConfigError(f"comm must be 'auto', None or an mpi4py communicator, got {type(comm).__name__}")
        comm = Communicator(comm)
    return comm
