"""``mf-train --profile START:END``: a torch.profiler trace of those steps, on every rank.

Steps are counted from 1, as in ``metrics.jsonl``; the window includes both ends.
Each rank writes ``<out-dir>/profile/rank<R>.json``, a Chrome trace (load it in
``chrome://tracing`` or Perfetto) of the host's operators and, on a GPU, the
device's kernels. A resumed run that starts inside the window profiles from its
first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["PROFILE_DIR", "StepProfiler", "parse_window"]

PROFILE_DIR = "profile"


def parse_window(text: str, steps: int) -> tuple[int, int]:
    """``"START:END"`` as (start, end), 1 <= start <= end <= steps.

    Raises:
        ValueError: one line naming ``--profile``, the value and what is expected.
    """
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(
            f"--profile {text!r}: expected START:END, two step numbers such as 3:5"
        ) from None
    if not 1 <= start <= end <= steps:
        raise ValueError(f"--profile {text!r}: expected 1 <= START <= END <= --steps {steps}")
    return start, end


class StepProfiler:
    """Starts torch's profiler before the window's first step, writes the trace after its last."""

    def __init__(self, window: tuple[int, int] | None, out_dir: Path, rank: int) -> None:
        self.window = window
        self.path = out_dir / PROFILE_DIR / f"rank{rank}.json"
        self._profiler: Any = None

    def before(self, step: int) -> None:
        """Called before step ``step`` (counted from 1) runs."""
        if self.window is None or self._profiler is not None:
            return
        start, end = self.window
        if start <= step <= end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def after(self, step: int) -> None:
        """Called after step ``step``; writes the trace at the window's end."""
        if self._profiler is not None and self.window is not None and step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop a running profiler and write its trace (the run ended inside the window)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
