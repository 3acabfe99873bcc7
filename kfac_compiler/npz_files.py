"""Reading .npz files (data files, checkpoints) whose contents may lie.

numpy allocates the shape an entry's .npy header declares before it reads the data: a header
claiming 51 TB ends in a MemoryError traceback, or worse, in an allocation that takes the
machine's memory before the short read fails. `read_entry` checks the declared size against
the bytes the entry holds first; a lie is a CorruptEntry (a ValueError), which the readers
already turn into their one-line error naming the file.
"""
from __future__ import annotations

import math

import numpy as np
from numpy.lib import format as npy_format

from kfac_compiler.errors import CorruptEntry, human_bytes

HEADER_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def read_entry(z: np.lib.npyio.NpzFile, key: str) -> np.ndarray:
    """z[key], once the array its header declares is known to fit in the entry's bytes."""
    name = key if key in z.zip.namelist() else f"{key}.npy"
    info = z.zip.getinfo(name)
    with z.zip.open(info) as f:
        version = npy_format.read_magic(f)
        reader = HEADER_READERS.get(version)
        if reader is not None:
            shape, _, dtype = reader(f)
            if dtype.hasobject:  # pickled: numpy refuses it without allocating
                return z[key]
            declared = math.prod(int(d) for d in shape) * dtype.itemsize
            held = info.file_size - f.tell()
            if declared > held:
                raise CorruptEntry(f"entry {key!r} declares a {'x'.join(map(str, shape)) or 'scalar'} {dtype} array "
                                 f"({human_bytes(declared)}) but holds {human_bytes(held)}")
    return z[key]
