"""Reruns repeat: the same seed, data, machine and thread count give bit-identical
trajectories, and on the CPU the thread count does not change them either. (A K-FAC byte-LM
run ended at held-out losses 1.62, 1.33 and 1.46 in three identical runs: the embedding
gradient's ScatterND lost updates on ONNX Runtime's threads, tests/test_scatter_add.py.)"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer


def trajectory(name: str, optimizer: str, threads: int, steps: int = 12) -> tuple[list[float], str]:
    e = ZOO[name]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    inputs, y = e.make_data(None, seed=0)
    knobs = {"learning_rate": 3e-3} if optimizer == "adam" else {}
    tr = Trainer(plan, optimizer=optimizer, threads=threads, seed=0, **knobs)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        idx = rng.choice(len(y), 128, replace=False)
        losses.append(tr.step({k: v[idx] for k, v in inputs.items()}, y[idx])["loss"])
    digest = hashlib.sha256(b"".join(v.tobytes() for v in tr.parameters().values())).hexdigest()
    return losses, digest


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["kfac", "adam"])
def test_a_rerun_is_bit_identical_and_the_thread_count_does_not_matter(optimizer):
    """The transformer block's token embedding (a Gather) has repeated tokens in every batch."""
    first = trajectory("transformer_block", optimizer, threads=2)
    assert trajectory("transformer_block", optimizer, threads=2) == first
    assert trajectory("transformer_block", optimizer, threads=1) == first
    assert first[0][-1] < first[0][0]
