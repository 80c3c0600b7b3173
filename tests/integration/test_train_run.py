"""mf-train end to end: the real per-rank ``train`` on 2 gloo ranks, resume, Ctrl-C, torchrun.

The in-process tests call ``mf.train.worker.train``, the function the
elastic launcher starts on each rank, on ranks from the test harness; the
subprocess test starts the real ``mf-train`` command and interrupts it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from mf.train.options import parse_options
from mf.train.worker import train
from tests._multiprocess import run_on_ranks

_TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-every", "3"]


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _rank_train_then_resume(rank: int, world_size: int, tmp: str, zero: str) -> None:
    tmp_path = Path(tmp)
    common = [*_TINY, "--zero", zero, "--ckpt-dir", str(tmp_path / "ckpt"), "--sample-tokens", "8"]
    full = parse_options([*common, "--steps", "6", "--save-every", "3", "--out-dir", tmp + "/a"])
    summary = train(full)
    assert dist.is_initialized()  # train leaves the caller's process group alone
    if rank == 0:
        losses = [record["loss"] for record in _metrics(tmp_path / "a")]
        assert len(losses) == 6
        assert losses[-1] < losses[0]  # it learns
        assert summary["checkpoint"].endswith("step_0000006")
        assert summary["sample"].startswith("The ")
        assert summary["final_validation_loss"] is not None
        assert (tmp_path / "a" / "sample.txt").read_text() == summary["sample"]
        shutil.rmtree(tmp_path / "ckpt" / "step_0000006")  # as if the run stopped at step 3
    dist.barrier()

    resumed = parse_options([*common, "--steps", "6", "--resume", "--out-dir", tmp + "/b"])
    train(resumed)
    if rank == 0:
        first, second = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
        assert [r["step"] for r in second] == [4, 5, 6]
        assert [r["loss"] for r in second] == [r["loss"] for r in first[3:]]
        assert second[-1]["validation_loss"] == first[-1]["validation_loss"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_and_resume_continue_exactly_zero0(tmp_path: Path) -> None:
    run_on_ranks(_rank_train_then_resume, 2, str(tmp_path), "0", timeout=100)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.xfail(reason="needs mf_fsdp.save_checkpoint from issue-ckpt", strict=False)
def test_train_and_resume_continue_exactly_zero3(tmp_path: Path) -> None:
    run_on_ranks(_rank_train_then_resume, 2, str(tmp_path), "3", timeout=100)
