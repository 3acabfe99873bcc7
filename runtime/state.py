"""Device-resident training state: double-buffered slots, pre-allocated data, hp scalars.

ONNX Runtime cannot bind one buffer as both the input and the output of a run, so every
state slot (a parameter, a velocity, a factor, an inverse, ...) owns TWO OrtValues on the
device: `current(slot)` is what the next run reads, `spare(slot)` is where a run that writes
`new/<slot>` puts the result; `flip(slot)` then swaps the roles. Nothing is copied. A slot
made with `keep_previous` owns THREE, taken in turn: the value before the last flip stays in
the third until the next flip, through any number of runs that are not flipped (rejected
steps), so `step_back` restores it exactly (K-FAC's roll-back of an update many times the
parameters' size, which theta + u - u cannot give back in float32).

Data inputs (the batch, targets, noise, `vec/<p>`) live in pre-allocated device buffers that
are overwritten in place each step (`OrtValue.update_inplace`: a memcpy on CPU, a host->device
copy on CUDA) and reallocated only when the shape or dtype changes (e.g. a last, smaller
batch). Hyper-parameters `hp/<name>` are float32 device scalars rewritten only when the host
value changes.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnxruntime as ort

from kfac_compiler.contract import RANKS, SlotSpec
from kfac_compiler.runtime.device import Device, get_device

_GENERATIONS = itertools.count(1)
# data buffers of shapes other than their inputs' current ones kept for reuse (all inputs and
# channels together): an epoch's last batch and an evaluation's remainder, a few inputs each
DATA_SHAPES_KEPT = 16


def _alloc(shape, dtype, dev: Device) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype).type, dev.ort_device, dev.device_id)


def _contig(array: Any, dtype: Any = None) -> np.ndarray:
    a = np.asarray(array, dtype=dtype)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def init_value(spec: SlotSpec) -> np.ndarray:
    """The initial value of a state slot from its SubgraphInfo.state_specs entry."""
    shape = tuple(int(d) for d in spec.shape)
    dtype = np.dtype(spec.dtype)
    init = spec.init
    if init == "identity":
        if len(shape) == 2 and shape[0] == shape[1]:
            return np.eye(shape[0], dtype=dtype)
        if len(shape) >= 2 and shape[-1] == shape[-2]:  # a stack of square matrices
            return np.broadcast_to(np.eye(shape[-1], dtype=dtype), shape).copy()
        return np.ones(shape, dtype)  # a diagonal (vector) inverse
    if init in ("zeros", "param"):
        return np.zeros(shape, dtype)
    if init == "ones":
        return np.ones(shape, dtype)
    raise ValueError(f"unknown state init {init!r} (expected zeros, identity, ones or param; 'model' slots "
                     "are read from the plan by the program that declares them)")


class StateStore:
    """Named device buffers for one training run (shared by all its subgraph programs)."""

    def __init__(self, device: str | Device = "cpu", ranks: int = 1) -> None:
        """`ranks`: a data-parallel run's number of ranks, the hp/ranks its statistics read."""
        self.device = get_device(device)
        self._buf: dict[str, list[ort.OrtValue]] = {}
        self._cur: dict[str, int] = {}
        # keep_previous slots whose third buffer does not hold the value before the last flip
        # (a host write or a step_back since): step_back refuses them
        self._stale: set[str] = set()
        self._spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        # data buffers per channel ("train", "eval", ...): evaluating on a big batch between
        # training steps must not reallocate the training batch's buffers.
        self._data: dict[tuple[str, str], tuple[ort.OrtValue, tuple[int, ...], np.dtype]] = {}
        self._views: dict[tuple[str, str], np.ndarray] = {}  # host_buffer's, per data buffer: numpy() is not free
        # the last few buffers of other shapes per data input (DATA_SHAPES_KEPT): an epoch's
        # last, smaller batch and the full ones after it take turns without reallocating, so
        # a captured CUDA graph bound to a full batch's buffer stays valid (runtime/program.py)
        self._other_shapes: dict[tuple, ort.OrtValue] = {}
        # name -> (float32 value on the device, its OrtValue, the Python float last passed or None)
        self._hp: dict[str, tuple[np.float32, ort.OrtValue, float | None]] = {}
        self.uploads = 0  # host->device writes of data/hp (for tests and benchmarks)
        self.upload_bytes = 0  # and their bytes
        # renewed whenever a buffer object is created or replaced (add, a reallocated data
        # input, a new hp): a program's IOBinding made at the same generation is still valid.
        # Drawn from one process-wide counter, so two stores never share a generation.
        self.generation = next(_GENERATIONS)
        self.set_hp(RANKS, float(ranks))

    # ------------------------------------------------------------ state slots
    def add(self, slot: str, array: Any, buffers: int = 2) -> None:
        """Create (or replace) slot `slot` holding `array`; every buffer gets the value (3
        buffers: see keep_previous)."""
        a = _contig(array)
        shape, dtype = tuple(a.shape), a.dtype
        bufs = [_alloc(shape, dtype, self.device) for _ in range(buffers)]
        for buf in bufs:
            buf.update_inplace(a)
        self._buf[slot] = bufs
        self._stale.discard(slot)
        self._cur[slot] = 0
        self.generation = next(_GENERATIONS)
        self._spec[slot] = (shape, dtype)

    def __contains__(self, slot: str) -> bool:
        return slot in self._buf

    def slots(self) -> list[str]:
        return list(self._buf)

    def spec(self, slot: str) -> tuple[tuple[int, ...], np.dtype]:
        return self._spec[slot]

    def current(self, slot: str) -> ort.OrtValue:
        return self._buf[slot][self._cur[slot]]

    def spare(self, slot: str) -> ort.OrtValue:
        bufs = self._buf[slot]
        return bufs[(self._cur[slot] + 1) % len(bufs)]

    def parity(self, slots: Iterable[str]) -> tuple[int, ...]:
        """Which buffer of each slot is current (it names the spare too)."""
        return tuple(map(self._cur.__getitem__, slots))

    def flip(self, slot: str) -> None:
        self.flip_all((slot,))

    def flip_all(self, slots: Iterable[str]) -> None:
        """flip() each slot (a step writes ~40 slots: one call, not 40)."""
        cur, buf = self._cur, self._buf
        for slot in slots:
            cur[slot] = (cur[slot] + 1) % len(buf[slot])
        if self._stale:
            self._stale.difference_update(slots)

    def keep_previous(self, slots: Iterable[str]) -> None:
        """Give each slot a third buffer (its current value), so that the value before its
        last flip survives runs that write the spare without flipping (module docstring)."""
        for slot in slots:
            if len(self._buf[slot]) == 2:
                self.add(slot, self.to_numpy(slot), buffers=3)

    def has_previous(self, slots: Iterable[str]) -> bool:
        """Whether every slot keeps the value before its last flip (keep_previous, and no host
        write or step_back since that flip)."""
        return all(len(self._buf[slot]) == 3 and slot not in self._stale for slot in slots)

    def step_back(self, slots: Iterable[str]) -> None:
        """Make the value before each slot's last flip current again, exactly (has_previous);
        flip_all undoes it while no run has written the spare since."""
        slots = list(slots)
        if not self.has_previous(slots):
            raise ValueError("step_back: a slot keeps no previous value")
        for slot in slots:
            self._cur[slot] = (self._cur[slot] - 1) % 3
        self._stale.update(slots)

    def to_numpy(self, slot: str) -> np.ndarray:
        """A host copy of the slot's current value (never aliases device memory)."""
        return np.array(self.current(slot).numpy(), copy=True)

    def read_only(self, slot: str) -> np.ndarray:
        """The slot's current value on the host without a copy where it already lives there
        (CPU): read-only, and valid only until the next program run or set()."""
        view = self.current(slot).numpy()
        view.flags.writeable = False
        return view

    def set(self, slot: str, array: Any) -> None:
        """Overwrite the slot's current value in place (same shape); adds the slot if new."""
        if slot not in self._buf:
            self.add(slot, array)
            return
        shape, dtype = self._spec[slot]
        a = _contig(array, dtype)
        if tuple(a.shape) != shape:
            raise ValueError(f"state slot {slot!r} has shape {list(shape)}, got {list(a.shape)}")
        self.current(slot).update_inplace(a)
        if len(self._buf[slot]) == 3:
            self._stale.add(slot)

    def set_parameters(self, params: Iterable[str], values: Mapping[str, Any]) -> None:
        """Overwrite trainable parameters from host arrays, all checked before any is written:
        a wrong name or shape is a one-line ConfigError, NaN/Inf or a value beyond the slot's
        dtype a DataError naming the parameter."""
        from kfac_compiler.errors import ConfigError, DataError
        from kfac_compiler.runtime.data import check_range

        if not isinstance(values, Mapping):
            raise ConfigError(f"set_parameters expects a dict {{parameter name: array}}, got {type(values).__name__}")
        known = set(params)
        checked = {}
        for p, v in values.items():
            if p not in known:
                raise ConfigError(f"{p!r} is not a trainable parameter of the plan")
            shape, dtype = self._spec[p]
            try:
                a = np.asarray(v)
            except (TypeError, ValueError):
                a = np.asarray(None)
            if a.dtype.kind not in "biuf":
                raise ConfigError(f"parameter {p!r}: expected numbers, got {type(v).__name__}")
            if tuple(a.shape) != tuple(shape):
                raise ConfigError(f"parameter {p!r} has shape {list(shape)}; got {list(a.shape)}")
            if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise DataError(f"parameter {p!r} holds {int(np.sum(~np.isfinite(a)))} NaN/Inf value(s)")
            check_range(a, dtype, f"parameter {p!r}")
            checked[p] = a.astype(dtype)
        for p, a in checked.items():
            self.set(p, a)

    def state_dict(self, slots: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        return {s: self.to_numpy(s) for s in (self.slots() if slots is None else slots)}

    def nbytes(self, buffers: bool = True) -> int:
        """The device bytes of every slot's buffers, or (buffers=False) of one value each."""
        return sum((len(self._buf[slot]) if buffers else 1) * int(np.prod(s, dtype=np.int64)) * d.itemsize
                   for slot, (s, d) in self._spec.items())

    # ------------------------------------------------------------ data inputs
    def write_data(self, name: str, array: Any, dtype: Any = None, channel: str = "train") -> ort.OrtValue:
        """Write a batch array into the pre-allocated device input `name` (of `channel`)."""
        a = _contig(array, dtype)
        key = (channel, name)
        entry = self._data.get(key)
        if entry is None or entry[1] != a.shape or entry[2] != a.dtype:
            if entry is not None:
                self._other_shapes[(key, entry[1], entry[2])] = entry[0]
            ov = self._other_shapes.pop((key, tuple(a.shape), a.dtype), None)
            if ov is None:
                ov = _alloc(a.shape, a.dtype, self.device)
            while len(self._other_shapes) > DATA_SHAPES_KEPT:
                del self._other_shapes[next(iter(self._other_shapes))]
            self._data[key] = (ov, tuple(a.shape), a.dtype)
            self._views.pop(key, None)
            self.generation = next(_GENERATIONS)
        else:
            ov = entry[0]
        ov.update_inplace(a)
        self.uploads += 1
        self.upload_bytes += a.nbytes
        return ov

    def host_buffer(self, name: str, shape: Any, dtype: Any, channel: str = "train") -> np.ndarray | None:
        """A writable host view of data input `name`'s buffer where it lives in host memory
        (CPU) with exactly `shape` and `dtype`, else None: a caller that fills it in place
        (the sampled-Fisher noise) writes the batch's next value without allocating an
        array and copying it over. Counted as one upload of its bytes, as write_data."""
        key = (channel, name)
        entry = self._data.get(key)
        if self.device.name != "cpu" or entry is None or entry[1] != tuple(shape) or entry[2] != np.dtype(dtype):
            return None
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = entry[0].numpy()
        self.uploads += 1
        self.upload_bytes += view.nbytes
        return view

    def has_data(self, name: str, channel: str = "train") -> bool:
        return (channel, name) in self._data

    def data(self, name: str, channel: str = "train") -> ort.OrtValue:
        try:
            return self._data[(channel, name)][0]
        except KeyError:
            raise KeyError(f"data input {name!r} was never written (channel {channel!r})") from None

    # ------------------------------------------------------------ hyper-parameters
    def set_hp(self, name: str, value: float) -> ort.OrtValue:
        """Set float32 scalar `name` (e.g. "hp/damping"); the device copy is rewritten only on change."""
        entry = self._hp.get(name)
        # most hp are the same Python float step after step: skip the float32 round trip
        is_float = isinstance(value, float)
        if is_float and entry is not None and entry[2] == value:
            return entry[1]
        host = value if is_float and value == value else None  # NaN never matches
        v = np.float32(value)
        if entry is None:
            ov = _alloc((), np.float32, self.device)
            self.generation = next(_GENERATIONS)
            upload = True
        else:
            old, ov, _ = entry
            upload = old != v or (np.isnan(old) != np.isnan(v))
        if upload:
            ov.update_inplace(np.asarray(v))
            self.uploads += 1
            self.upload_bytes += 4
        else:
            v = old
        self._hp[name] = (v, ov, host)
        return ov

    def hp(self, name: str) -> ort.OrtValue:
        try:
            return self._hp[name][1]
        except KeyError:
            raise KeyError(f"hyper-parameter {name!r} was never set") from None

    def has_hp(self, name: str) -> bool:
        return name in self._hp

    def hp_value(self, name: str) -> float:
        return float(self._hp[name][0])
