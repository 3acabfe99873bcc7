"""Batches for the real-export fixtures (models/real_exports.py, tests/test_real_exports.py,
benchmarks/bench_to_target.py real-exports), and their gradients against torch's; numpy only.

* "image": 16x16 RGB digits (the 8x8 digits scaled up by pixel repetition, three equal
  channels, values in [0, 1]) and their labels;
* "waveform": the 16x16 image read row by row as a 256-sample signal, centred (-0.5),
  with the digit's label;
* "tokens": a row of a digit's pixel intensities (0..16) as SEQ tokens with the next pixels as
  next-token targets (example i takes rows starting at row 1 + i % 6: a learnable task).
"""
from __future__ import annotations

import numpy as np

from kfac_compiler.models.data import MAX_PIXEL, digits

VOCAB, SEQ = 32, 8


def batch(kind: str, n: int | None = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input, targets) for `kind` ("image" or "tokens") from the first `n` digits of the
    zoo's seeded order (models.data.digits; None: all 1797)."""
    pixels, labels = digits(n, seed)
    if kind == "image":
        img = pixels.reshape(-1, 8, 8)
        x = np.repeat(np.repeat(img, 2, axis=1), 2, axis=2)
        return np.ascontiguousarray(np.broadcast_to(x[:, None], (len(x), 3, 16, 16))).astype(np.float32), labels
    if kind == "waveform":
        img = np.repeat(np.repeat(pixels.reshape(-1, 8, 8), 2, axis=1), 2, axis=2)
        return (img.reshape(len(img), 256) - 0.5).astype(np.float32), labels
    if kind != "tokens":
        raise ValueError(f"kind must be 'image', 'waveform' or 'tokens', got {kind!r}")
    tokens = np.rint(pixels * MAX_PIXEL).astype(np.int64)
    rows = 8 + 8 * (np.arange(len(tokens)) % 6)  # start of rows 1..6
    seq = np.take_along_axis(tokens, rows[:, None] + np.arange(SEQ + 1)[None], axis=1)
    return seq[:, :SEQ].copy(), seq[:, 1:].copy()


def gradient_errors(fixture: dict, grads: dict[str, np.ndarray],
                    retied=()) -> tuple[dict[str, tuple[float, float]], float]:
    """({torch parameter: (|ours - torch's|, |torch's|)}, |torch's gradient| over all held
    elements) for a real-export fixture's .npz contents (models/real_exports.py documents its
    keys) and the gradients of its initializers (`grads`; lowered recurrent pieces already
    folded back): each initializer's gradient is summed into the reference elements it holds.
    `retied`: copies computed from their original, whose gradient has both uses."""
    sizes = fixture["ref_sizes"]
    owner = np.repeat(np.arange(len(sizes)), sizes)
    want = fixture["ref_grads"]
    got, held = np.zeros_like(want), np.zeros(want.shape, bool)
    for i, name in enumerate(str(n) for n in fixture["init_names"]):
        idx = fixture[f"init_index_{i}"]
        held[idx] = True
        if name in retied:
            continue
        if name not in grads:
            raise KeyError(f"no gradient for the initializer {name!r}")
        np.add.at(got, idx, grads[name].ravel().astype(np.float32))
    out = {}
    for o, name in enumerate(fixture["ref_names"]):
        sel = held & (owner == o)
        if sel.any():
            out[str(name)] = (float(np.linalg.norm(got[sel] - want[sel])), float(np.linalg.norm(want[sel])))
    return out, float(np.linalg.norm(want[held]))
