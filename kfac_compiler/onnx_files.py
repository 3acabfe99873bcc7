"""Paths inside a folder, and ONNX files whose external data must stay in theirs.

A plan's plan.json names its model and subgraph files, and an ONNX model names the files of
its external data: both are hand-editable, so a name like `../../home/me/secret` or an
absolute path would make loading read a file outside the folder the user handed us. Every
such name is resolved here (symbolic links followed) and refused unless it lies inside.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import BinaryIO

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import TensorProto


def inside(folder: str | os.PathLike, name: str) -> str | None:
    """The real path of `name` (relative to `folder`) if it lies inside `folder`, else None."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return None
    base = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(base, name))
    if target == base or os.path.commonpath([base, target]) != base:
        return None
    return target


def external_locations(model: onnx.ModelProto) -> Iterator[str]:
    """The `location` of every tensor stored as external data (initializers, attributes)."""
    for t in onnx.external_data_helper._get_all_tensors(model):
        if t.HasField("data_location") and t.data_location == TensorProto.EXTERNAL:
            for entry in t.external_data:
                if entry.key == "location":
                    yield entry.value


def external_files(model_path: str | os.PathLike) -> list[str]:
    """The real paths of the external-data files the model at `model_path` names inside its
    folder (sorted); [] where it cannot be read (whoever loads it says why, in one line).
    Reads the graph without its data: about a second for a big model."""
    folder = os.path.dirname(os.path.realpath(model_path))
    try:
        names = set(external_locations(onnx.load(os.fspath(model_path), load_external_data=False)))
    except Exception:  # noqa: BLE001 - any unreadable model: reported by the caller's own load
        return []
    return sorted({p for p in (inside(folder, name) for name in names) if p is not None})


def outside_locations(model: onnx.ModelProto, folder: str | os.PathLike) -> list[str]:
    """The external-data locations of `model` that do not lie inside `folder` (sorted)."""
    return sorted({loc for loc in external_locations(model) if inside(folder, loc) is None})


LAZY_EXTERNAL_BYTES = 1 << 30
"""External data over this many bytes in total stays on disk after loading: protobuf cannot
hold a message over 2 GiB, so a ModelProto with such values inside could not be copied, checked
or written (it failed with an `EncodeError` after 27 s and 6.4 GB of memory)."""


def _entries(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _external_tensors(model: onnx.ModelProto) -> list[TensorProto]:
    return [t for t in onnx.external_data_helper._get_all_tensors(model)
            if t.HasField("data_location") and t.data_location == TensorProto.EXTERNAL]


def _nbytes(t: TensorProto) -> int:
    return int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def load_external(model: onnx.ModelProto, folder: str, replaced: Collection[str] = ()) -> None:
    """Read `model`'s external data from `folder` (its locations already checked to lie inside):
    into the tensors when it totals LAZY_EXTERNAL_BYTES at most; else the initializers' stay on
    disk, each tensor's location made the real absolute path of its file (`on_disk`, its size
    checked), read by `tensor_array` and copied by `write_onnx` (a Constant node's is read in).
    `replaced`: initializers the caller replaces before anything reads them (an export's
    trained values), which are not read in (a 0.55 GB table: 2.7 s of a 10 s export)."""
    tensors = _external_tensors(model)
    if sum(_nbytes(t) for t in tensors) <= LAZY_EXTERNAL_BYTES:
        skipped = {id(t) for t in model.graph.initializer if t.name in replaced}
        for t in tensors:
            if id(t) not in skipped:
                _read_in(t, folder)
        return
    initializers = {id(t) for t in model.graph.initializer}
    for t in tensors:
        if id(t) not in initializers:
            _read_in(t, folder)
            continue
        _relocate(t, os.path.realpath(os.path.join(folder, _entries(t)["location"])))
        _region(t)


def _read_in(t: TensorProto, folder: str) -> None:
    """`t`'s external data read into it (what onnx's load_external_data_for_model does per tensor)."""
    onnx.external_data_helper.load_external_data_for_tensor(t, folder)
    del t.external_data[:]
    t.data_location = TensorProto.DEFAULT


def _relocate(t: TensorProto, location: str) -> None:
    for e in t.external_data:
        if e.key == "location":
            e.value = location


def on_disk(t: TensorProto) -> bool:
    """Whether `t`'s values were left on disk by load_external (an absolute location)."""
    return (t.HasField("data_location") and t.data_location == TensorProto.EXTERNAL
            and os.path.isabs(_entries(t).get("location", "")))


def has_data_on_disk(model: onnx.ModelProto) -> bool:
    return any(on_disk(t) for t in model.graph.initializer)


def stored_bytes(model: onnx.ModelProto) -> int:
    """The bytes of `model` written out: its proto and its values left on disk."""
    return model.ByteSize() + sum(_nbytes(t) for t in model.graph.initializer if on_disk(t))


def with_relative_data(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """(a copy of `model` whose tensors left on disk name their files relative to one folder,
    that folder): what ONNX Runtime, which refuses absolute external-data paths, loads from
    bytes with its `session.model_external_initializers_file_folder_path`. (`model`, None)
    when it has none on disk; an error when they lie in several folders."""
    folders = {os.path.dirname(_entries(t)["location"]) for t in model.graph.initializer if on_disk(t)}
    if not folders:
        return model, None
    if len(folders) > 1:
        from kfac_compiler.errors import ModelError

        raise ModelError(f"the model's external data lies in {len(folders)} folders ({', '.join(sorted(folders))}); "
                         "put its data files in one folder")
    folder = folders.pop()
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if on_disk(t):
            _relocate(t, os.path.basename(_entries(t)["location"]))
    return m, folder


def _region(t: TensorProto) -> tuple[str, int, int]:
    """(file, offset, bytes) of a tensor left on disk, its file checked to hold them."""
    from kfac_compiler.errors import ModelError

    e = _entries(t)
    path, offset, need = e["location"], int(e.get("offset") or 0), _nbytes(t)
    size = os.path.getsize(path) if os.path.isfile(path) else -1
    if size < 0:
        raise ModelError(f"initializer {t.name!r}: its external data file {path!r} is gone; reload the model")
    if "length" in e and int(e["length"]) != need or offset + need > size:
        raise ModelError(f"initializer {t.name!r}: dims {list(t.dims)} need {need} bytes of external data, "
                         f"{path!r} holds {max(size - offset, 0)} from offset {offset}"
                         + (f" (length says {e['length']})" if "length" in e else "") + "; re-export the model")
    return path, offset, need


def tensor_array(t: TensorProto) -> np.ndarray:
    """numpy_helper.to_array, also for a tensor left on disk (read from its file)."""
    if not on_disk(t):
        return onnx.numpy_helper.to_array(t)
    path, offset, need = _region(t)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    return np.fromfile(path, dtype=dtype, count=need // dtype.itemsize, offset=offset).reshape(tuple(t.dims))


def tensor_view(t: TensorProto) -> np.ndarray:
    """tensor_array, but a tensor left on disk is mapped (copy-on-write) rather than read: its
    pages are read when used, so a caller going through a model's tensors one by one never
    holds them all in memory."""
    if not on_disk(t) or not t.dims or not _nbytes(t):
        return tensor_array(t)
    path, offset, _ = _region(t)
    return np.memmap(path, dtype=onnx.helper.tensor_dtype_to_np_dtype(t.data_type), mode="c", offset=offset,
                     shape=tuple(t.dims))


def write_onnx(model: onnx.ModelProto, out: BinaryIO, data_path: str, data_name: str,
               values: Mapping[str, np.ndarray] | None = None) -> dict[str, tuple[int, int]]:
    """Write `model` to the open `out`, with `values` replacing its initializers' (each keeping
    its dtype). Tensors left on disk and, where `needs_external`, values over LIGHT_VALUE_BYTES
    go to the file `data_path` instead, which the model names `data_name` (its name relative to
    the model's folder): with them inside, a model could pass protobuf's 2 GiB. Returns where each tensor
    written there lies in it, {name: (offset, length)} ({}: no data file written)."""
    values = values or {}
    big = {t.name for t in model.graph.initializer if on_disk(t)}
    if needs_external(model, values):
        big |= {n for n, v in values.items() if np.asarray(v).nbytes > LIGHT_VALUE_BYTES}
    regions: dict[str, tuple[int, int]] = {}
    if not big and not values:
        out.write(model.SerializeToString())
        return regions
    m = onnx.ModelProto()
    m.CopyFrom(model)
    set_values(m, {n: v for n, v in values.items() if n not in big})
    if big:
        data = open(data_path, "wb")
    try:
        offset = 0
        for t in m.graph.initializer:
            if t.name in big:
                offset += -offset % 64  # aligned, as onnx's own writer does
                data.seek(offset)
                if t.name in values:
                    v = np.ascontiguousarray(np.asarray(values[t.name]),
                                             onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
                    data.write(v.reshape(-1).view(np.uint8))  # bytes (a bfloat16 array has no buffer format)
                    length = v.nbytes
                else:
                    length = _copy_region(t, data)
                _point(t, data_name, offset, length)
                regions[t.name] = (offset, length)
                offset += length
        if big:
            data.flush()
            os.fsync(data.fileno())
    finally:
        if big:
            data.close()
    out.write(m.SerializeToString())
    return regions


def set_values(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
    """Replace the model's initializers named in `values`, each keeping its dtype."""
    for t in model.graph.initializer:
        if t.name in values:
            v = np.asarray(values[t.name]).astype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type), copy=False)
            t.CopyFrom(onnx.numpy_helper.from_array(v, t.name))


def write_with_values(out: BinaryIO, model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
    """Write `model` with `values` replacing its initializers of those names, as ONE protobuf
    (what set_values + SerializeToString write), the values over LIGHT_VALUE_BYTES streamed
    from their arrays: copying a 0.55 GB table into a TensorProto, the model and its bytes
    took 6.4 of a 9.3 s export and three copies of memory. Each initializer, in the model's
    order, is written as a fragment ModelProto {graph {initializer: the tensor}} (a streamed
    one's header serialized by protobuf, its raw_data written from the array), then the model
    without them: a parser merges a message field that occurs twice and appends to a repeated
    one in the order met (protobuf's encoding rules), so this reads as the model with its
    initializers in their order. `model` is changed: it ends without initializers."""
    inits = {t.name: t for t in model.graph.initializer}
    streamed = {}
    for name, v in values.items():
        if name in inits and np.asarray(v).nbytes > LIGHT_VALUE_BYTES:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(inits[name].data_type)
            if dtype.kind in "fiub" or inits[name].data_type == TensorProto.BFLOAT16:  # written as raw_data
                streamed[name] = np.ascontiguousarray(np.asarray(v).astype(dtype.newbyteorder("<"), copy=False))
    set_values(model, {k: v for k, v in values.items() if k not in streamed})
    for t in model.graph.initializer:
        array = streamed.get(t.name)
        if array is None:
            _write_initializer(out, t.SerializeToString())
            continue
        header = TensorProto(name=t.name, dims=array.shape, data_type=t.data_type).SerializeToString()
        _write_initializer(out, header + _tag(9) + _varint(array.nbytes), array.reshape(-1).view(np.uint8))
    del model.graph.initializer[:]
    out.write(model.SerializeToString())


def _write_initializer(out: BinaryIO, head: bytes, tail: np.ndarray | None = None) -> None:
    """A fragment ModelProto.graph (field 7) {GraphProto.initializer (field 5): head + tail}."""
    size = len(head) + (0 if tail is None else tail.nbytes)
    initializer = _tag(5) + _varint(size)
    out.write(_tag(7) + _varint(len(initializer) + size) + initializer + head)
    if tail is not None:
        out.write(tail)


def _tag(field: int) -> bytes:
    """A length-delimited field's key (wire type 2)."""
    return _varint(field << 3 | 2)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _point(t: TensorProto, location: str, offset: int, length: int) -> None:
    t.ClearField("raw_data")
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, val in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, val


def pointing_into(model: onnx.ModelProto, regions: Mapping[str, tuple[int, int]], data_name: str) -> onnx.ModelProto:
    """`model` (a subgraph of a plan) with its tensors left on disk naming their copies that
    write_onnx put in `data_name` (`regions`) instead: the plan's subgraphs share its model's
    data file."""
    if not has_data_on_disk(model):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if on_disk(t):
            if t.name not in regions:
                raise ValueError(f"initializer {t.name!r} lies on disk but not in the plan model's data")
            _point(t, data_name, *regions[t.name])
    return m


LIGHT_VALUE_BYTES = 1 << 20
"""In a model written with external data, the values over this size go there."""


def needs_external(model: onnx.ModelProto, values: Mapping[str, np.ndarray] | None = None) -> bool:
    """Whether `model` with `values` must be written with external data: some of its values
    were left on disk, or the values total over LAZY_EXTERNAL_BYTES in the types of the
    initializers they replace (a float32 value written into a float16 model counts half)."""
    if has_data_on_disk(model):
        return True
    values = values or {}
    itemsize = {t.name: onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                for t in model.graph.initializer if t.name in values}
    return sum(np.asarray(v).size * itemsize.get(n, np.asarray(v).itemsize)
               for n, v in values.items()) > LAZY_EXTERNAL_BYTES


def load_onnx(path: str, outside_error: Callable[[list[str]], Exception] | None = None,
              replaced: Collection[str] = ()) -> onnx.ModelProto:
    """onnx.load of an ONNX file, its external data (from its folder) loaded or left on disk as
    load_external decides. With `outside_error` (a file we did not write or check before: a
    plan's, a user's) its external data must lie inside its folder: otherwise
    outside_error(outside_locations) is raised before anything is read. `replaced`: as
    load_external's."""
    model = onnx.load(path, load_external_data=False)
    folder = os.path.dirname(os.path.abspath(path))
    if outside_error is not None:
        outside = outside_locations(model, folder)
        if outside:
            raise outside_error(outside)
    load_external(model, folder, replaced)
    return model


def _copy_region(t: TensorProto, data: BinaryIO) -> int:
    path, offset, need = _region(t)
    with open(path, "rb") as src:
        src.seek(offset)
        left = need
        while left:
            chunk = src.read(min(left, 64 << 20))
            if not chunk:
                raise OSError(f"{path!r} ended early")
            data.write(chunk)
            left -= len(chunk)
    return need
