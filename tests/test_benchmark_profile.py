"""benchmarks/common.py's `hot_functions`: a profile's functions by own time, as table rows
(`suite.py --profile`)."""
from __future__ import annotations

import cProfile

from benchmarks.common import hot_functions


def busy() -> int:
    total = 0
    for i in range(300_000):
        total += i
    return total


def idle() -> int:
    return 1


def test_the_function_with_the_most_own_time_comes_first_with_its_file_and_calls():
    profile = cProfile.Profile()
    profile.enable()
    busy()
    for _ in range(3):
        idle()
    profile.disable()
    rows = hot_functions(profile, 2)
    assert rows[:2] == ["| function | calls | own s | with its callees s |", "|---|---|---|---|"]
    assert len(rows) == 4 and not any("_lsprof" in row for row in rows)
    assert rows[2].startswith("| `tests/test_benchmark_profile.py:10` busy | 1 | ")
    assert rows[3].startswith("| `tests/test_benchmark_profile.py:17` idle | 3 | ")
