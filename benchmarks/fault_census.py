"""The fault census of issue 24 (tests/faults): per category, how many cases end clean.

    python benchmarks/fault_census.py [--fast] [--only NAME ...] [-v] [--fuzz N]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from faults.census import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
