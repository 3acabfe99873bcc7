"""A Trainer shared by threads: calls are serialized, so concurrent steps give what the same
steps give one after another (a step reads and flips double-buffered state: two at once
would mix their buffers silently); thread counts beyond the CPUs are capped with a warning."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import kfac_compiler as kc
from kfac_compiler.models import ZOO
from kfac_compiler.runtime import Trainer
from kfac_compiler.runtime.device import usable_cpus


@pytest.fixture(scope="module")
def case():
    e = ZOO["mlp_classifier"]
    plan = kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False)
    inputs, y = e.make_data(None, seed=0)
    return plan, {"input": inputs["input"][:64]}, y[:64]


@pytest.mark.parametrize("optimizer", ["sgd", "kfac"])
def test_two_threads_stepping_one_trainer_equal_the_same_steps_in_sequence(case, optimizer):
    """Every step takes the same batch, so any interleaving of the 2 x 10 steps is the same
    20 steps; without serialization the parameters differ."""
    plan, x, y = case
    knobs = {"learning_rate": 0.1} if optimizer == "sgd" else {}
    sequential = Trainer(plan, optimizer=optimizer, threads=1, **knobs)
    for _ in range(20):
        sequential.step(x, y)
    shared = Trainer(plan, optimizer=optimizer, threads=1, **knobs)
    go = threading.Barrier(2)

    def work():
        go.wait()
        for _ in range(10):
            shared.step(x, y)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert shared.step_count == 20
    want, got = sequential.parameters(), shared.parameters()
    for p in want:
        np.testing.assert_array_equal(got[p], want[p], err_msg=p)


def test_threads_beyond_the_cpus_are_capped_with_a_warning(case):
    plan, _, _ = case
    cpus = usable_cpus()
    with pytest.warns(UserWarning, match=f"threads 1000000 exceeds the {cpus} CPUs this process may run on; "
                                          f"using {cpus}"):
        tr = Trainer(plan, optimizer="sgd", learning_rate=0.1, threads=10**6)
    assert tr.threads == cpus
