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
import torch
import torch.distributed as dist

from mf.models import GPT, PRESETS
from mf.train.options import parse_options
from mf.train.worker import train
from mf_fsdp import RECORD_FILE, checkpoint_to_full_state_dict, latest_checkpoint
from tests._multiprocess import run_on_ranks

_TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-every", "3"]


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _rank_train_then_resume(rank: int, world_size: int, tmp: str, zero: str, *extra: str) -> None:
    tmp_path = Path(tmp)
    common = [*_TINY, "--zero", zero, "--ckpt-dir", str(tmp_path / "ckpt"), "--sample-tokens", "8"]
    common += extra
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
def test_train_and_resume_continue_exactly_zero3(tmp_path: Path) -> None:
    run_on_ranks(_rank_train_then_resume, 2, str(tmp_path), "3", timeout=100)


def _rank_muon_then_resume(rank: int, world_size: int, tmp: str) -> None:
    _rank_train_then_resume(rank, world_size, tmp, "3", "--optimizer", "muon")
    adamw = parse_options([*_TINY, "--ckpt-dir", tmp + "/ckpt", "--resume", "--out-dir", tmp])
    with pytest.raises(ValueError, match="holds the state of Muon, AdamW, not of AdamW"):
        train(adamw)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_and_resume_continue_exactly_muon(tmp_path: Path) -> None:
    """``--optimizer muon`` (Muon on the blocks' matrices, AdamW on the rest) learns and
    resumes exactly; resuming it with ``--optimizer adamw`` is refused by name."""
    run_on_ranks(_rank_muon_then_resume, 2, str(tmp_path), timeout=100)


def _rank_train(rank: int, world_size: int, argv: list[str]) -> None:
    train(parse_options(argv))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_tp2_with_zero3_trains_like_one_process(tmp_path: Path) -> None:
    """``--tp 2``: the TP GPT starts from the plain GPT's weights and follows its losses.

    Its final checkpoint exports (offline) to the plain GPT's state dict, which the
    plain module loads with ``strict=True``: the fused qkv (partition stride 3) and
    the vocab-parallel embedding come back in their full shapes. And the plain run's
    checkpoint resumes at ``--tp 2``.
    """

    def run(out: str, ckpt: str, steps: int, *extra: str) -> list[dict]:
        argv = [*_TINY, "--steps", str(steps), "--save-every", "0", "--sample-tokens", "0"]
        argv += ["--out-dir", str(tmp_path / out), "--ckpt-dir", str(tmp_path / ckpt), *extra]
        run_on_ranks(_rank_train, 1 if "--nproc" in extra else 2, argv)
        return _metrics(tmp_path / out)

    tp, one = run("tp", "a", 4, "--tp", "2"), run("one", "b", 4, "--nproc", "1")
    assert [r["loss"] for r in tp] == pytest.approx([r["loss"] for r in one], abs=2e-5)
    assert tp[-1]["validation_loss"] == pytest.approx(one[-1]["validation_loss"], abs=2e-5)
    exported = checkpoint_to_full_state_dict(latest_checkpoint(tmp_path / "a"))
    plain = checkpoint_to_full_state_dict(latest_checkpoint(tmp_path / "b"))
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in plain.items()}
    for name, value in plain.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=2e-5, msg=name)
    GPT(PRESETS["tiny"]).load_state_dict(exported, strict=True)
    # The one-process checkpoint resumes at --tp 2 (same data: dp is 1 in both) like
    # the one-process run itself.
    shutil.copytree(tmp_path / "b", tmp_path / "b2")  # each continuation saves its own
    resumed = run("c", "b", 6, "--tp", "2", "--resume")
    reference = run("d", "b2", 6, "--nproc", "1", "--resume")
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in reference], abs=2e-5)


def _wait_for_first_step(proc: subprocess.Popen, metrics: Path, deadline: float) -> None:
    while not (metrics.is_file() and metrics.read_text().strip()):
        if proc.poll() is not None:
            pytest.fail(f"mf-train exited early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail("mf-train did not finish a step in time")
        time.sleep(0.2)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path: Path) -> None:
    """Ctrl-C reaches the launcher and the ranks (one process group, as in a terminal)."""
    command = [sys.executable, "-m", "mf.train.cli", *_TINY, "--steps", "100000"]
    command += ["--save-every", "0", "--ckpt-dir", str(tmp_path / "ckpt")]
    command += ["--out-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _wait_for_first_step(proc, tmp_path / "out" / "metrics.jsonl", time.monotonic() + 100)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    saved = sorted((tmp_path / "ckpt").glob("step_*"))
    assert len(saved) == 1
    assert (saved[0] / RECORD_FILE).is_file()
    assert f"mf-train: interrupted; checkpoint {saved[0]} (continue with --resume)" in err
    assert "Traceback" not in err


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_worker_module_runs_under_torchrun(tmp_path: Path) -> None:
    """The multi-node entry (README): ``torchrun ... -m mf.train.worker <options>``, here 1 node."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", "127.0.0.1:0", "-m", "mf.train.worker", *_TINY]
    command += ["--steps", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "final train loss" in done.stdout
    assert (tmp_path / "ckpt" / "step_0000002" / RECORD_FILE).is_file()
