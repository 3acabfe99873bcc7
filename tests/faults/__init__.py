"""Fault cases shared by the tests (tests/test_faults.py, tests/test_fault_injection.py) and the
census (`python benchmarks/fault_census.py`).

* `harness`: run the CLI in-process or as a subprocess, judge the outcome (one-line error,
  user files byte-identical, no stray temp files) into a Verdict.
* `inject`: full disks and read-only folders (a tmpfs mount where we may mount, else an
  injected OSError at the lowest write functions), and kill -9 at a chosen write event.
* `cases`: the census, one small function per case of issue 24, grouped by its bullets.
* `mutate`: seeded mutations of checkpoints, plans and data files for the fuzz tests.
"""
