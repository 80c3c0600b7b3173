"""Where an elastic restart of ``mf-train`` resumes, and the unfinished folders saves leave.

No processes: the checkpoint folders are made by hand (a complete one is a
``step_NNNNNNN`` folder holding the record file), the environment is the
agent's, and the save is a stand-in, so each case costs milliseconds.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from mf.train.rank import checkpoints
from mf.train.rank.checkpoints import Checkpoints, restart_checkpoint
from mf.train.reports.report import LAST_CHECKPOINT_FILE
from mf.train.run.options import parse_options
from mf_fsdp import checkpoint as fsdp_checkpoint


def _complete(ckpt: Path, step: int, age: float = 0.0) -> Path:
    """A complete checkpoint folder of ``step`` whose record is ``age`` seconds old."""
    path = ckpt / f"step_{step:07d}"
    path.mkdir(parents=True)
    record = path / fsdp_checkpoint.RECORD_FILE
    record.write_text("{}")
    stamp = time.time() - age
    os.utime(record, (stamp, stamp))
    return path


def _report(out: Path, run_id: str, path: Path, step: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"run_id": run_id, "step": step, "path": str(path)}
    (out / LAST_CHECKPOINT_FILE).write_text(json.dumps(record))


@pytest.fixture
def restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "mf-train-run")
    return parse_options(["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")])


def test_a_restart_resumes_from_the_newest_complete_checkpoint_not_the_reported(
    tmp_path: Path, restarted: Any
) -> None:
    """Step 20's background save was published but the ranks died before reporting it."""
    reported = _complete(tmp_path / "ckpt", 10, age=5)
    newer = _complete(tmp_path / "ckpt", 20, age=1)
    (tmp_path / "ckpt" / ".step_0000030.partial").mkdir()  # killed mid-write: never picked
    _report(tmp_path / "out", "mf-train-run", reported, 10)
    assert restart_checkpoint(restarted) == newer


def test_a_restart_never_picks_an_earlier_runs_newer_step(tmp_path: Path, restarted: Any) -> None:
    _complete(tmp_path / "ckpt", 100, age=3600)  # another run's, before this one
    reported = _complete(tmp_path / "ckpt", 10)
    _report(tmp_path / "out", "mf-train-run", reported, 10)
    assert restart_checkpoint(restarted) == reported
    _report(tmp_path / "out", "another-run", reported, 10)
    assert restart_checkpoint(restarted) is None  # nothing this run saved: from the start


class _Reporter:
    def __init__(self) -> None:
        self.saved_steps: list[int] = []

    def saved(self, path: Path, step: int) -> None:
        self.saved_steps.append(step)


@pytest.mark.parametrize("in_background", [False, True])
def test_a_successful_save_removes_unfinished_folders_of_other_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_background: bool
) -> None:
    """``.step_0000030.partial`` (a save killed mid-write; the resumed run saves every 25
    steps, so never step 30 again) is gone after the next save, and the last."""
    ckpt = tmp_path / "ckpt"
    (ckpt / ".step_0000030.partial").mkdir(parents=True)
    (ckpt / ".step_0000030.partial" / "__0_0.distcp").write_bytes(b"half")

    def save(ckpt_dir: Path, *args: Any, step: int, async_save: bool, **kwargs: Any) -> Any:
        path = _complete(ckpt_dir, step)
        if not async_save:
            return path
        future: Future[Path] = Future()
        future.set_result(path)
        return future

    monkeypatch.setattr(checkpoints.fsdp_checkpoint, "save_checkpoint", save)
    monkeypatch.setattr(dist, "get_rank", lambda *args: 0)
    reporter = _Reporter()
    saves = Checkpoints(ckpt, None, [], {}, reporter)  # type: ignore[arg-type]
    saves.save(25, None, in_background=in_background)
    saves.settle()
    assert not (ckpt / ".step_0000030.partial").exists()
    (ckpt / ".step_0000045.partial").mkdir()  # killed again, then the run's last save
    saves.save(50, "at the end of the run", in_background=in_background)
    saves.settle()
    assert reporter.saved_steps == [25, 50]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_0000025", "step_0000050"]
