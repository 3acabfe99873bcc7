"""Set-up shared by every test file."""
from __future__ import annotations

import sys

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _fresh_case_rng(monkeypatch):
    """test_blocks' case builders draw from its module RNG, and other files import them: every
    test starts that RNG from the same seed, so the draws a test sees do not depend on which
    tests ran before it (-k, -m "not slow", one file alone). A file's own fixture may still
    replace it (test_block_variants)."""
    module = sys.modules.get("test_blocks")
    if module is not None:
        monkeypatch.setattr(module, "RNG", np.random.default_rng(1234))


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh generator for the test's own draws (tests/helpers.py's functions take it): the
    same stream whichever tests ran before."""
    return np.random.default_rng(20261128)
