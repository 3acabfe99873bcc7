"""Data helpers: scikit-learn's 8x8 digits (1797 images, pixels 0..16, 10 classes).

Every ``make_*`` function has the signature ``(n=None, seed=0)`` and returns
``(inputs, targets)`` where ``inputs`` maps graph-input names to arrays.
Samples are always taken in the order of ``default_rng(seed).permutation``
of the 1797 images; ``n=None`` means all of them, otherwise the first ``n``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

NUM_IMAGES = 1797
NUM_CLASSES = 10
MAX_PIXEL = 16


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    images = d.data.astype(np.int64)  # [1797, 64], integer values 0..16
    labels = d.target.astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def _select(n: int | None, seed: int) -> tuple[np.ndarray, np.random.Generator]:
    rng = np.random.default_rng(seed)
    idx = rng.permutation(NUM_IMAGES)
    if n is not None:
        if not 0 <= n <= NUM_IMAGES:
            raise ValueError(f"n must be in [0, {NUM_IMAGES}], got {n}")
        idx = idx[:n]
    return idx, rng


def digits(n: int | None = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(pixels float32 [n,64] scaled to [0,1], labels int64 [n])."""
    idx, _ = _select(n, seed)
    images, labels = _digits()
    x = (images[idx].astype(np.float32) / np.float32(MAX_PIXEL)).astype(np.float32)
    return x, labels[idx].copy()


def make_flat_classification(n: int | None = None, seed: int = 0):
    """inputs {"input": float32 [n,64]}, targets int64 class labels [n]."""
    x, y = digits(n, seed)
    return {"input": x}, y


def make_image_classification(n: int | None = None, seed: int = 0):
    """inputs {"input": float32 [n,1,8,8]}, targets int64 class labels [n]."""
    x, y = digits(n, seed)
    return {"input": x.reshape(-1, 1, 8, 8)}, y


def make_sequence_classification(n: int | None = None, seed: int = 0):
    """inputs {"input": float32 [n,8,8]} (rows = time steps), targets int64 [n]."""
    x, y = digits(n, seed)
    return {"input": x.reshape(-1, 8, 8)}, y


def make_reconstruction(n: int | None = None, seed: int = 0):
    """inputs {"input": float32 [n,64]}, targets = the same pixels, float32 [n,64]."""
    x, _ = digits(n, seed)
    return {"input": x}, x.copy()


def make_row_tokens(n: int | None = None, seed: int = 0):
    """Next-token data for the tiny causal LM.

    For each selected image one row r ~ Uniform{0..7} is drawn (from the same
    generator, after the permutation).  tokens = the 8 raw pixel intensities
    of that row (int64, vocabulary 0..16).  targets = tokens rotated left by
    one: position t predicts token t+1, and the last position predicts token
    0 of the same row (``np.roll(tokens, -1, axis=1)``).
    """
    idx, rng = _select(n, seed)
    images, _ = _digits()
    rows = rng.integers(0, 8, size=len(idx))
    grid = images[idx].reshape(-1, 8, 8)
    tokens = grid[np.arange(len(idx)), rows].astype(np.int64)  # [n, 8]
    targets = np.roll(tokens, -1, axis=1).astype(np.int64)
    return {"input": tokens}, targets
