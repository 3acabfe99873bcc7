"""`kfac-compiler train --resume`: what carries over from the checkpoint, what may change.

An option given anew on resuming is honoured from the resumed step on, or refused with one
line, never ignored (docs/runtime.md has the table):

* --seed: fixes the batch order, the estimator's noise (its stream is restored) and a zoo
  model's initial weights, so it cannot change: refused when it differs; by default the
  checkpoint's.
* --batch-size: by default the checkpoint's; another value is honoured (the batches from the
  resumed step on are drawn with it). So is --accumulate (a checkpoint is written between
  accumulation cycles; by default the checkpoint's).
* --optimizer: refused when it differs (the state slots are another optimizer's).
* --steps: the total; below the checkpoint's step it is refused.
* --learning-rate, --momentum, --damping, --l2, --knob: honoured (Trainer.load_checkpoint;
  K-FAC's adapted damping restarts from --damping); a combination the optimizer rejects (a
  fixed learning rate with the quadratic model) is refused like on a fresh run. A schedule's text
  is a stored knob: not given anew, it continues at the resumed step.

The metrics file is continued: the rows of the resumed step and later (written by a run killed
after its last checkpoint) are dropped, then the resumed run appends its own, so every step
has exactly one row, that of the trajectory that produced the final state.
"""
from __future__ import annotations

import csv
import functools
import io
import json
import os
from collections.abc import Sequence
from typing import Any

from kfac_compiler.atomic import write_file
from kfac_compiler.errors import ConfigError, DataError, os_reason
from kfac_compiler.parsing import nesting_checked

DEFAULT_SEED = 0
DEFAULT_BATCH_SIZE = 128


def resumed_step(meta: dict[str, Any]) -> int:
    """The step a run resumed from this checkpoint starts at (burn-in steps count)."""
    host = meta.get("host") or {}
    return int(host.get("step_count", 0)) + int(host.get("burn_in_count", 0))


def settle(args: Any, meta: dict[str, Any] | None) -> None:
    """Fill --seed, --batch-size, --accumulate and (on resuming) --optimizer (None: not given)
    from the checkpoint `meta` or the defaults, and args.resumed_data with the data record
    `meta` holds (None: none, or not resuming; check_resumed_data); refuse what cannot change
    on resuming."""
    args.resumed_data = None if meta is None else meta.get("data")
    if args.accumulate is None:  # a stored value that is no count is refused with the knobs (load_checkpoint)
        stored = (meta or {}).get("knobs", {}).get("accumulate", 1)
        args.accumulate = stored if isinstance(stored, int) and not isinstance(stored, bool) and stored >= 1 else 1
    if meta is None:
        args.seed = DEFAULT_SEED if args.seed is None else args.seed
        args.batch_size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
        return
    where = f"checkpoint {args.resume!r}"
    seed = meta.get("seed", DEFAULT_SEED)
    if args.seed is None:
        args.seed = seed
    elif args.seed != seed:
        raise ConfigError(f"--seed {args.seed} differs from the seed {seed} of {where} (it fixes the batch order and "
                          "the estimator's random stream); drop --seed to resume")
    if args.batch_size is None:
        args.batch_size = int((meta.get("host") or {}).get("batch_size") or DEFAULT_BATCH_SIZE)
    if args.optimizer and meta.get("optimizer") != args.optimizer:
        raise ConfigError(f"{where} was written by optimizer {meta.get('optimizer')!r}, not {args.optimizer!r}; "
                          "drop --optimizer to resume")
    args.optimizer = meta["optimizer"]  # check_meta: a registered optimizer
    done = resumed_step(meta)
    if args.steps < done:
        raise ConfigError(f"--steps {args.steps} is below step {done} of {where}; --steps is the total number of "
                          f"steps (>= {done})")


def check_resumed_data(args: Any, current: dict[str, Any]) -> None:
    """A resume trains on the data its checkpoint was written with (`current`: the loaded
    data's runtime.data.dataset_fingerprint): other data would give other batches than the
    uninterrupted run's. A checkpoint without a record (the API's, older ones) passes."""
    stored = args.resumed_data
    if stored is None or stored == current:
        return
    raise DataError(f"--data {args.data!r} is not the data checkpoint {args.resume!r} was trained on "
                    f"({stored['examples']} examples, sha256 {stored['sha256'][:12]}; this data: "
                    f"{current['examples']} examples, sha256 {current['sha256'][:12]}): resume with the same --data, "
                    "or start a new run without --resume")


def continue_metrics(path: str | None, step: int, columns: Sequence[str]) -> None:
    """Drop the rows of `step` and later from the metrics file at `path` (CSV with
    `columns`, or JSONL), atomically; a file that is not a metrics file is refused."""
    if not path or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--metrics {path!r}: cannot read it to continue it ({os_reason(e, writing=False)})") from None
    except UnicodeDecodeError:
        raise _bad(path, "not UTF-8 text") from None
    if os.path.splitext(path)[1].lower() == ".csv":
        kept = _csv_rows(path, text, step, columns)
    else:
        kept = _jsonl_rows(path, text, step)
    if kept != text:
        try:
            write_file(path, lambda f: f.write(kept.encode("utf-8")))
        except OSError as e:
            raise ConfigError(f"--metrics {path!r}: cannot rewrite it ({os_reason(e, writing=True)})") from None


def _bad(path: str, what: str) -> ConfigError:
    return ConfigError(f"--metrics {path!r} is not a metrics file of this run ({what}); give another path to resume")


def _csv_rows(path: str, text: str, step: int, columns: Sequence[str]) -> str:
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header != list(columns):
        raise _bad(path, "other columns")
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(header)
    for n, row in enumerate(reader, 2):
        if not row:
            continue
        try:
            s = int(float(row[0]))
        except (ValueError, IndexError):
            raise _bad(path, f"line {n} has no step") from None
        if s < step:
            w.writerow(row)
    return out.getvalue()


def _jsonl_rows(path: str, text: str, step: int) -> str:
    kept = []
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            s = int(float(nesting_checked(functools.partial(json.loads, line))["step"]))
        except (ValueError, KeyError, TypeError):
            raise _bad(path, f"line {n} has no step") from None
        if s < step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return "".join(kept)
