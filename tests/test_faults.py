"""The fault census of issue 24 as tests: every case of tests/faults/cases.py ends clean (one
line naming the culprit and exit 2, or the right result; nothing of the user's changed, no stray
files). `python benchmarks/fault_census.py` prints the same cases as a table.
The cases that need several runs or subprocesses are slow. Before issue 24's fixes 16 of the
73 were clean (benchmarks/results/2026-11-24-fault-census.md).
"""
from __future__ import annotations

import pytest

from faults.cases import CASES
from faults.census import run_case


def _param(case):
    marks = [] if case.fast else [pytest.mark.slow]
    return pytest.param(case, id=case.name, marks=marks)


def test_census_names_are_unique():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


@pytest.mark.slow
@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_fault_case(case, record_property):
    verdict = run_case(case)
    if verdict.mechanism:  # which fault mechanism ran (tmpfs / remount-ro / chmod / injected ...)
        record_property("mechanism", verdict.mechanism)
    assert verdict.clean, f"{case.category}: {verdict}"
