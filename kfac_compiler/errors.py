"""User-facing errors.

Every error a user can provoke (bad model file, unsupported op, bad config, bad data, stale
plan) is a `KfacError` whose message is ONE line naming the culprit (file, node, op,
parameter, layer) and what to do. The CLI prints `error: <message>` and exits with code 2;
anything else escaping is a bug in kfac_compiler.
"""
from __future__ import annotations


class KfacError(Exception):
    """Base class: a one-line, actionable message for the user."""

    exit_code = 2


class ModelError(KfacError):
    """The ONNX model cannot be used (missing, corrupt, unsupported opset, bad output name)."""


class UnsupportedOpError(KfacError):
    """An op on the loss path has no gradient rule (or other per-op knowledge) for its opset."""


class ConfigError(KfacError):
    """A compile or training option is invalid (unknown block kind, bad regex, bad value)."""


class PlanError(KfacError):
    """A plan directory is missing, of another schema version, or stale w.r.t. its model."""


class DataError(KfacError):
    """Training or evaluation data has the wrong shape, dtype, range or contains NaN."""


class DeviceError(KfacError):
    """The requested execution device is not available (e.g. CUDA asked, CPU fallback found)."""


class CheckpointError(KfacError):
    """A checkpoint is unreadable or belongs to another plan."""


class DivergedError(KfacError):
    """Training ended with a non-finite loss (what was asked for is still written)."""

    exit_code = 1


class OutputError(KfacError):
    """An output cannot or must not be written: unwritable, the same file as another output or
    an input, no room on its disk, or being written by another run."""
