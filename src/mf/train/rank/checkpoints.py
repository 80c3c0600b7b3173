"""Checkpoints of an ``mf-train`` run: where it resumes from, and when and how it saves.

Periodic saves go to host memory and are written in the background (``--sync-save``:
before training goes on); the last save is always written in the foreground.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mf.train.reports.report import Reporter, last_saved_checkpoint
from mf.train.run.options import TrainOptions
from mf.train.run.resume import resume_checkpoint
from mf.train.run.stopping import newest, stop
from mf_fsdp import checkpoint as fsdp_checkpoint

__all__ = ["Checkpoints", "last_save_reason", "restart_checkpoint", "resume"]


def resume(options: TrainOptions, model, optimizers) -> int:
    """Load the checkpoint --resume continues from; return the step it was saved at.

    ``--resume-from``'s, else the newest complete one in ``--ckpt-dir``
    (``resume_checkpoint``), which the launcher verified. Any ``--zero``, ``--tp`` or
    world size may resume (the checkpoint reshards); the optimizer state is built
    from the checkpoint, never by a synthetic step.
    """
    return fsdp_checkpoint.load_checkpoint(resume_checkpoint(options), model, optimizers)["step"]


def restart_checkpoint(options: TrainOptions) -> Path | None:
    """After an elastic restart: the newest complete checkpoint this run wrote, else None.

    ``last_checkpoint.json`` names the newest checkpoint the run *reported*
    (the launcher's run id survives restarts); a background save published
    after it (the ranks were killed before the next save reported it) is
    newer and complete, so the restart resumes from the newest complete
    checkpoint in ``--ckpt-dir`` written after the reported one. A newer
    checkpoint of another, earlier run in the same folder is never picked: its
    record is older than this run's report. Every rank reads the same files,
    so all resume from the same step by themselves.
    """
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return None
    reported = last_saved_checkpoint(Path(options.out_dir), os.environ.get("TORCHELASTIC_RUN_ID"))
    if reported is None:
        return None
    newest = fsdp_checkpoint.latest_checkpoint(options.ckpt_dir)
    if newest is None or newest.resolve() == reported.resolve():
        return reported
    record = fsdp_checkpoint.RECORD_FILE
    try:
        later = (newest / record).stat().st_mtime_ns >= (reported / record).stat().st_mtime_ns
    except OSError:
        return reported
    return newest if later else reported


def last_save_reason(step: int, steps: int, interrupted: bool) -> str | None:
    """Why the save after ``step`` is the run's last, or None when training goes on."""
    if interrupted:
        return "after the interrupt"
    if step == steps:
        return "at the end of the run"
    return None


class Checkpoints:
    """This run's saves: periodic ones written in the background, the last in the foreground.

    fsdp_checkpoint.save_checkpoint raises RuntimeError on every rank when a save fails (first
    line: the cause); a background save's future raises it. A periodic save
    that fails is a warning: training goes on, the next save retries and the
    older checkpoints stay. A final save that fails stops the run with that
    cause. A background save is reported (and becomes the newest checkpoint)
    once it is published, at the next save at the latest.
    """

    def __init__(
        self, ckpt_dir: Path, model, optimizers, info: dict[str, Any], reporter: Reporter
    ) -> None:
        self.ckpt_dir, self.model, self.optimizers = ckpt_dir, model, optimizers
        self.info, self.reporter = info, reporter
        self.newest: Path | None = None
        self._pending: tuple[int, Future[Path]] | None = None

    def save(self, step: int, final: str | None, in_background: bool) -> None:
        """Save the checkpoint of ``step``; ``final``: why it is the run's last, else None."""
        self.settle()
        try:
            if final is None and in_background:
                self._pending = (step, self._save(step, async_save=True))
                return
            path = self._save(step, async_save=False)
        except RuntimeError as error:
            self._failed(step, error, final)
            return
        self._published(path, step)

    def _published(self, path: Path, step: int) -> None:
        """Report a complete checkpoint; remove the unfinished folders saves left behind.

        A save killed mid-write leaves ``.step_NNNNNNN.partial``; a later save
        of the same step reuses it, but one of a step never saved again would
        stay forever. No save is in flight here, and the run holds the folder's
        lock, so every partial folder is debris: global rank 0 removes them.
        """
        self.reporter.saved(path, step)
        self.newest = path
        if dist.get_rank() == 0:
            for debris in self.ckpt_dir.glob(".step_*.partial"):
                shutil.rmtree(debris, ignore_errors=True)

    def _save(self, step: int, async_save: bool) -> Any:
        return fsdp_checkpoint.save_checkpoint(
            self.ckpt_dir,
            self.model,
            self.optimizers,
            step=step,
            extra=self.info,
            async_save=async_save,
        )

    def settle(self) -> None:
        """Wait for the background save, and report how it ended."""
        if self._pending is None:
            return
        (step, future), self._pending = self._pending, None
        try:
            path = future.result()
        except RuntimeError as error:
            self._failed(step, error, None)
            return
        self._published(path, step)

    def _failed(self, step: int, error: RuntimeError, final: str | None) -> None:
        cause = (str(error).splitlines() or [type(error).__name__])[0]
        if final is None:
            self.reporter.save_failed(step, cause)
            return
        stop(
            self.reporter,
            f"could not save the checkpoint of step {step} {final}: {cause}; {newest(self.newest)}",
        )
