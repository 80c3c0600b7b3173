"""Crash-safe training checkpoints through ``torch.distributed.checkpoint``.

A checkpoint is either whole or not there: every rank writes into
``.step_NNNNNNN.partial``; only after all ranks finished (and DCP wrote its
metadata) does rank 0 drop a ``COMPLETE`` marker in and rename the folder to
``step_NNNNNNN`` (an atomic rename on one file system). A run killed
mid-save leaves only a ``.partial`` folder, which :func:`latest_checkpoint`
ignores and the next save of that step replaces.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

_MARKER = "COMPLETE"


def _final_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:07d}"


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """Return the newest complete checkpoint folder in ``ckpt_dir``, or None."""
    if not ckpt_dir.is_dir():
        return None
    complete = [
        path for path in ckpt_dir.glob("step_*") if path.is_dir() and (path / _MARKER).is_file()
    ]
    return max(complete, key=lambda path: path.name, default=None)


def save_checkpoint(ckpt_dir: Path, step: int, state: dict[str, Any], info: dict[str, Any]) -> Path:
    """Save ``state`` (a DCP state dict) as the checkpoint of ``step``; every rank calls this.

    ``info`` (JSON-serialisable: step, model preset, world size...) goes into
    the completion marker and is checked on load.
    """
    rank = dist.get_rank()
    partial = ckpt_dir / f".step_{step:07d}.partial"
    final = _final_path(ckpt_dir, step)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(partial))
    dist.barrier()
    if rank == 0:
        marker = partial / _MARKER
        with open(marker, "w") as out:
            json.dump(info, out)
            out.flush()
            os.fsync(out.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
    dist.barrier()
    return final


def load_checkpoint(path: Path, state: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """Load ``path`` into ``state`` in place and return the info saved with it.

    Raises:
        ValueError: if ``path`` is not a complete checkpoint, or it was saved for
            another model (any key of ``expected`` differs).
    """
    marker = path / _MARKER
    if not marker.is_file():
        raise ValueError(f"checkpoint {str(path)!r} is incomplete (no {_MARKER} marker)")
    info = json.loads(marker.read_text())
    for key, value in expected.items():
        if info.get(key) != value:
            raise ValueError(
                f"checkpoint {str(path)!r} was saved with {key}={info.get(key)!r}, "
                f"this run has {key}={value!r}"
            )
    dcp.load(state, checkpoint_id=str(path))
    return info
