"""A command run on many ranks (`mpirun -n P kfac-compiler train ...`): who prints, who
writes, and how an error on one rank stops all of them without a hang.

    comm = world()                      # None in one process
    code = on_ranks(comm, lambda: run(comm))

* Rank 0 alone prints and writes the outputs; the other ranks print nothing on success
  (their warnings are dropped: every rank would print the same ones).
* An error at an agreement point (runtime.comm's `agreed(comm, setup)`, the Trainer's data checks, the
  final outcome) is raised on every rank with its message led by `rank r:` (the rank that
  saw it); rank 0 prints it, every rank exits with its code.
* Anything else (an error only one rank sees while the others wait in a collective, a bug)
  is printed by that rank as `error: rank r: ...` (a bug with its traceback), and that rank
  calls MPI Abort so that mpirun stops the others.
"""
from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kfac_compiler.errors import ConfigError, KfacError, one_line

if TYPE_CHECKING:
    from kfac_compiler.runtime.comm import Communicator

def world() -> Communicator | None:
    """MPI.COMM_WORLD's ranks when launched under mpirun with more than one rank, else None."""
    from kfac_compiler.runtime.comm import as_communicator

    return as_communicator("auto")


def is_root(comm: Communicator | None) -> bool:
    return comm is None or comm.is_root


def stop_together(comm: Communicator | None, stop: bool) -> bool:
    """Whether any rank asks to stop here (an interrupt, rank 0's output failing): every rank
    gets the same answer, so all stop at the same step boundary."""
    return stop if comm is None else comm.agree(None, stop=stop)


def on_ranks(comm: Communicator | None, run: Callable[[], int]) -> int:
    """run()'s exit code on this rank, with the rules above (one process: run() as is)."""
    if comm is None:
        return run()
    try:
        with warnings.catch_warnings():
            if not comm.is_root:
                warnings.simplefilter("ignore")
            return run()
    except KfacError as e:
        if getattr(e, "agreed", False):
            if comm.is_root:
                raise  # the command line prints `error: rank r: ...`
            return e.exit_code
        abort(comm, f"error: rank {comm.rank}: {' '.join(str(e).split())}", e.exit_code)
    except KeyboardInterrupt as e:  # a second interrupt: stop now, wherever the ranks are
        from kfac_compiler.interrupt import exit_code, signal_of

        abort(comm, f"rank {comm.rank}: interrupted again; stopping every rank now", exit_code(signal_of(e)))
    except Exception as e:  # a bug, or an OSError nothing converted: this rank alone sees it
        traceback.print_exc()
        abort(comm, f"error: rank {comm.rank}: {one_line(e, 1000)}", KfacError.exit_code)
    raise AssertionError("unreachable")  # pragma: no cover


def check_same_on_ranks(comm: Communicator | None, values: Mapping[str, Any]) -> None:
    """Every rank runs the same command on the same plan and data: one all-gather compares
    `values` ({what: value}) with rank 0's. A difference is one ConfigError naming the first
    rank and what differs, raised on every rank: a rank with other --steps would wait
    forever in a collective the others left, and one with other data or --seed would train
    apart silently."""
    if comm is None:
        return
    gathered = comm.gather(dict(values))
    for rank, theirs in enumerate(gathered[1:], 1):
        for what, mine in gathered[0].items():
            if theirs.get(what) != mine:
                e = ConfigError(f"rank {rank}: {what} {theirs.get(what)!r} differs from rank 0's {mine!r}; every rank "
                                "must run the same command on the same data")
                e.agreed = True  # type: ignore[attr-defined]  # raised on every rank: printed once
                raise e


def abort(comm: Communicator, line: str, code: int) -> None:
    """Print `line` and make mpirun stop every rank (it adds its own MPI_ABORT report)."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    comm.comm.Abort(code)


def traffic(sent: Mapping[str, int], steps: int) -> str:
    """`gradients 33.1 KiB, loss 4 B, ...`: bytes each rank sent per step, by kind."""
    from kfac_compiler.errors import human_bytes

    per = sorted(((kind, total / max(steps, 1)) for kind, total in sent.items() if total), key=lambda kv: -kv[1])
    return ", ".join(f"{kind} {human_bytes(round(n))}" for kind, n in per) or "nothing"
