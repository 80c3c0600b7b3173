"""``mf-train``'s progress: tqdm's bar on a terminal, plain lines in a log file or CI.

A bar redraws itself with carriage returns: written to a file it becomes one
line that grows with every step. Where stderr is not a terminal, progress is a
plain line on the first step, then at most one every ``LINE_EVERY_S`` seconds,
and one at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["LINE_EVERY_S", "LineProgress", "progress_bar"]

LINE_EVERY_S = 10.0
"""Seconds between two progress lines when stderr is not a terminal."""


class LineProgress:
    """The part of tqdm's interface ``mf-train`` uses, printing whole lines only."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "train",
        every_s: float = LINE_EVERY_S,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.n = initial
        self.desc = desc
        self.every_s = every_s
        self.stream = stream
        self.clock = clock
        self.postfix: dict[str, Any] = {}
        self._printed_at: float | None = None
        self._printed_n = initial

    def write(self, text: str, file: TextIO | None = None) -> None:
        """Print ``text`` as its own line (stdout unless ``file``), as ``tqdm.write``."""
        print(text, file=file or sys.stdout, flush=True)

    def set_postfix(self, postfix: dict[str, Any]) -> None:
        """The values shown after the step count on the next line."""
        self.postfix = dict(postfix)

    def update(self, steps: int = 1) -> None:
        """Count ``steps`` more; print a line on the first step and once per interval."""
        self.n += steps
        now = self.clock()
        if self._printed_at is None or now - self._printed_at >= self.every_s:
            self._print(now)

    def close(self) -> None:
        """Print the last line, unless the last step is already on one."""
        if self.n != self._printed_n:
            self._print(self.clock())

    def _print(self, now: float) -> None:
        values = "".join(f", {key}={value}" for key, value in self.postfix.items())
        print(f"{self.desc}: step {self.n}/{self.total}{values}", file=self.stream or sys.stderr)
        (self.stream or sys.stderr).flush()
        self._printed_at, self._printed_n = now, self.n


def progress_bar(total: int, initial: int, desc: str = "train") -> Any:
    """The progress display: tqdm's bar where stderr is a terminal, else ``LineProgress``."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="step")
    return LineProgress(total, initial, desc)
