"""``mf-train --tensorboard``: each step's metrics as TensorBoard scalars, on rank 0.

The event files go to ``<out-dir>/tensorboard`` through ``torch.utils.tensorboard``
(``tensorboard`` is one of mf's dependencies): ``tensorboard --logdir
runs/mf-train/tensorboard`` shows them. A resumed run purges the steps after its
checkpoint from the view, so the curves show what the run kept, as
``metrics.jsonl`` does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["SCALARS", "TENSORBOARD_DIR", "TensorBoardWriter"]

TENSORBOARD_DIR = "tensorboard"

SCALARS = {
    "loss": "loss/train",
    "validation_loss": "loss/validation",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "memory_mib": "perf/memory_mib",
}
"""The metrics record's keys written as scalars, and their TensorBoard tags."""


class TensorBoardWriter:
    """Writes the scalars of each step's metrics record."""

    def __init__(self, out_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = out_dir / TENSORBOARD_DIR
        self._writer = SummaryWriter(
            str(self.path), purge_step=start_step + 1 if start_step else None, flush_secs=10
        )

    def write(self, record: dict[str, Any]) -> None:
        """The record's finite scalars at its step."""
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
