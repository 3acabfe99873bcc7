"""The 2.2 GB model of 2026-11-30-large-table.md (tests/test_large_models.py's slow-test model),
written into the current folder with its data: run it in an empty folder.

    python benchmarks/results/2026-11-30-large-table.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import test_large_models as T  # noqa: E402

ROWS, WIDTH, USED = 540_000, 1024, 1000


def main() -> None:
    rng = np.random.default_rng(0)

    def sparse(f):
        f.write((rng.standard_normal((USED, WIDTH)) * 0.5).astype(np.float32).tobytes())
        f.truncate(ROWS * WIDTH * 4)

    path = T.write_model(".", (ROWS, WIDTH), sparse)
    head = (rng.standard_normal((WIDTH, T.CLASSES)) * 0.1).astype(np.float32)
    m = onnx.load(path, load_external_data=False)
    m.graph.initializer[1].CopyFrom(numpy_helper.from_array(head, "W"))
    onnx.save(m, path)
    np.savez("data.npz", ids=rng.integers(0, USED, (256, 4)), targets=rng.integers(0, T.CLASSES, 256))
    print(f"big.onnx, big.data ({os.path.getsize('big.data'):,} bytes), data.npz")


if __name__ == "__main__":
    main()
