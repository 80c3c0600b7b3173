"""The 0.88B plan against the peak docs/benchmarks.md publishes for it on one H200.

The published peak (20,040 MiB, mf ZeRO-3, 4 x 2048 tokens, world 1) comes at the
forward's end; the plan's forward peak is held to 5% of it and its model state to
the published 13,383 MiB exactly (to the MiB). The plan's backward peak is above the
published number (the gradients are held whole; docs/planning.md says why).
"""

from __future__ import annotations

import json

import pytest

from mf.plan.cli import main

_MIB = 2**20
_PUBLISHED_PEAK_MIB = 20_040
_PUBLISHED_STATE_MIB = 13_383


def test_880m_plan_matches_the_published_h200_peak(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "880m", "--gpus", "1", "--micro-batch", "4", "--seq-len", "2048", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert round(plan["model_state"]["held"] / _MIB) == _PUBLISHED_STATE_MIB
    forward = plan["phases"]["forward"] / _MIB
    assert abs(forward - _PUBLISHED_PEAK_MIB) < 0.05 * _PUBLISHED_PEAK_MIB
