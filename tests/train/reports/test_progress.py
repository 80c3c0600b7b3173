"""mf-train's progress off a terminal: whole lines, on the first step, each interval, at the end."""

from __future__ import annotations

import io
import sys

import pytest

from mf.train.reports.progress import LineProgress, progress_bar


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_on_the_first_step_once_per_interval_and_at_the_end() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = LineProgress(total=100, initial=10, every_s=5.0, stream=out, clock=clock)
    for _ in range(30):  # one step per second
        clock.now += 1.0
        progress.set_postfix({"loss": "1.234", "tok_s": "5,000"})
        progress.update(1)
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "train: step 11/100, loss=1.234, tok_s=5,000"
    assert [line.split()[2] for line in lines] == [
        "11/100,",
        "16/100,",
        "21/100,",
        "26/100,",
        "31/100,",
        "36/100,",
        "40/100,",
    ]


def test_the_last_step_is_not_printed_twice() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = LineProgress(total=1, every_s=5.0, stream=out, clock=clock)
    progress.update(1)
    progress.close()
    assert out.getvalue() == "train: step 1/1\n"


def test_a_terminal_keeps_tqdm_and_a_file_gets_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from tqdm import tqdm

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = progress_bar(10, 0)
    try:
        assert isinstance(bar, tqdm)
    finally:
        bar.close()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert isinstance(progress_bar(10, 0), LineProgress)
