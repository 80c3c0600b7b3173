"""The checkpoint cost report (benchmarks/checkpoint_cost.py) measures every phase and prints it."""

from __future__ import annotations

import pytest

from benchmarks.checkpoint_cost import measure, report
from tests._multiprocess import run_on_ranks


def _rank_measure(rank: int, world: int, folder: str) -> None:
    result = measure("tiny", folder, repeats=1)
    assert result["bytes"] > 0
    phases = ("save", "hash", "load verified", "async blocked", "async total")
    assert all(result[phase] > 0 for phase in phases)
    lines = report("tiny", world, result)
    assert lines[0].startswith("== preset tiny, world 2: checkpoint")
    firsts = [line.split()[0] for line in lines[1:7]]
    assert firsts == ["save", "hash", "load", "load", "async", "async"]
    assert lines[-2].startswith("verification adds")
    assert lines[-1].startswith("an asynchronous save blocks training for")


@pytest.mark.multiprocess
def test_report_times_save_hash_and_both_loads(tmp_path) -> None:
    run_on_ranks(_rank_measure, 2, str(tmp_path), timeout=120)
