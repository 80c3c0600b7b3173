"""mf-train end to end: the real per-rank ``train`` on 2 gloo ranks, resume, Ctrl-C, torchrun,
and runs that must stop (a NaN loss, a failed final save) in one line on every rank.

The in-process tests call ``mf.train.rank.worker.train``, the function the
elastic launcher starts on each rank, on ranks from the test harness; the
subprocess test starts the real ``mf-train`` command and interrupts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mf.train.rank.worker
import mf_fsdp.checkpoint
from mf.models import GPT, PRESETS
from mf.train.exports.export import CONFIG_FILE, load_model
from mf.train.exports.sample import main as sample_main
from mf.train.rank.worker import RunStoppedError, train
from mf.train.reports.report import last_saved_checkpoint
from mf.train.run.options import parse_options
from mf_fsdp import RECORD_FILE, checkpoint_to_full_state_dict, latest_checkpoint, save_checkpoint
from tests._multiprocess import run_on_ranks
from tests.train.run.test_options import strict_json

# The CPU runs of this module name the CPU: with a GPU visible, mf-train's defaults
# pick CUDA with one process per GPU.
_TINY = ["--device", "cpu", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2"]
_TINY += ["--eval-every", "3"]


def test_these_runs_mean_the_cpu_on_any_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine with a GPU: the options this module trains with still mean 2 CPU ranks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    options = parse_options(_TINY)
    assert (options.use_cuda, options.nproc) == (False, 2)


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


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_layer_drop_trains_and_resumes_exactly(tmp_path: Path) -> None:
    """``--layer-drop 0.5``: the ranks skip different blocks (FSDP units) in a step, and
    the run learns, and resumes exactly (the draws follow the seed, step and rank)."""
    run_on_ranks(_rank_train_then_resume, 2, str(tmp_path), "3", "--layer-drop", "0.5", timeout=100)


def _rank_muon_then_resume(rank: int, world_size: int, tmp: str) -> None:
    _rank_train_then_resume(rank, world_size, tmp, "3", "--optimizer", "muon")
    argv = [*_TINY, "--ckpt-dir", tmp + "/ckpt", "--resume", "--out-dir", tmp]
    with pytest.raises(ValueError, match="saved with --optimizer muon, this run has --opt"):
        parse_options(argv)  # the launcher's line
    muon = parse_options([*argv, "--optimizer", "muon"])
    with pytest.raises(ValueError, match="holds the state of Muon, AdamW, not of AdamW"):
        train(dataclasses.replace(muon, optimizer="adamw"))  # and the load's, past the launcher


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
    # Every finished run exports itself: a --tp 2 --zero 3 run's model.safetensors loads
    # into the plain GPT (strict) on one process and equals its checkpoint's export.
    model = load_model(tmp_path / "tp")
    for name, value in model.state_dict().items():
        if name in exported:
            assert torch.equal(value, exported[name]), name
    assert json.loads((tmp_path / "tp" / CONFIG_FILE).read_text())["preset"] == "tiny"
    assert (tmp_path / "tp" / "loss.png").stat().st_size > 0  # drawn by default
    # The one-process checkpoint resumes at --tp 2 (same data: dp is 1 in both) like
    # the one-process run itself.
    shutil.copytree(tmp_path / "b", tmp_path / "b2")  # each continuation saves its own
    resumed = run("c", "b", 6, "--tp", "2", "--resume")
    reference = run("d", "b2", 6, "--nproc", "1", "--resume")
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in reference], abs=2e-5)


def _train_capturing_stderr(argv: list[str]) -> tuple[BaseException | None, str]:
    """Run ``train`` with stderr captured; return what it raised (or None) and the text."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train(parse_options(argv))
        except RunStoppedError as error:
            return error, err.getvalue()
    return None, err.getvalue()


def _stop_lines(err: str) -> list[str]:
    """The ``mf-train: ...`` lines of captured stderr (not the progress bar's)."""
    return [line for line in err.replace("\r", "\n").splitlines() if line.startswith("mf-train:")]


def _rank_diverge(rank: int, world_size: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    argv = [*_TINY, "--lr", "1e30", "--steps", "3", "--save-every", "1", "--sample-tokens", "0"]
    argv += ["--ckpt-dir", tmp + "/ckpt", "--out-dir", tmp + "/out"]
    error, err = _train_capturing_stderr(argv)
    first = tmp_path / "ckpt" / "step_0000001"
    expected = "the loss is (nan|inf) at step 2; " + re.escape(
        f"stopping without saving a checkpoint (the newest checkpoint of this run is {first})"
    )
    assert re.fullmatch(expected, str(error)), (error, err)
    assert _stop_lines(err) == ([f"mf-train: {error}"] if rank == 0 else [])
    dist.barrier()
    if rank == 0:
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_0000001"]
        lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
        records = [strict_json(line) for line in lines]
        assert [r["step"] for r in records] == [1, 2]
        assert records[0]["loss"] > 5
        assert records[1]["loss"] is None
        assert last_saved_checkpoint(tmp_path / "out", None) == first


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_non_finite_loss_stops_every_rank_without_saving(tmp_path: Path) -> None:
    """``--lr 1e30`` is finite but diverges: after step 1 the loss is NaN. Every rank
    stops at step 2 (the loss is the mean over ranks), rank 0 prints one line, no
    checkpoint of step 2 is written, and metrics.jsonl stays strict JSON (null)."""
    run_on_ranks(_rank_diverge, 2, str(tmp_path), timeout=100)


_NO_SPACE = "save_checkpoint: No space left on device while writing /x/step_{:07d}"


def _failing_saves(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """Make ``save_checkpoint`` fail at ``steps`` on every rank, as a full disk does."""

    def save(*args, step: int, **kwargs):
        if step in steps:
            raise RuntimeError(_NO_SPACE.format(step) + "\n<details>")
        return save_checkpoint(*args, step=step, **kwargs)

    monkeypatch.setattr(mf_fsdp.checkpoint, "save_checkpoint", save)


def _rank_save_failures(rank: int, world_size: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    common = [*_TINY, "--save-every", "2", "--sample-tokens", "0"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        # A periodic save fails: a warning; training goes on, the next save retries.
        _failing_saves(monkeypatch, {4})
        argv = [*common, "--steps", "6", "--ckpt-dir", tmp + "/a", "--out-dir", tmp + "/a-out"]
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            summary = train(parse_options(argv))
        warning = (
            f"mf-train: warning: the checkpoint of step 4 was not saved ({_NO_SPACE.format(4)}); "
            "training goes on and the next save retries"
        )
        assert _stop_lines(err.getvalue()) == ([warning] if rank == 0 else [])
        assert "<details>" not in err.getvalue()
        if rank == 0:
            assert summary["checkpoint"] == str(tmp_path / "a" / "step_0000006")
            assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
                "step_0000002",  # the older checkpoint stays
                "step_0000006",
            ]
        # The final save fails: the run stops with the cause, naming what it did save.
        _failing_saves(monkeypatch, {6})
        argv = [*common, "--steps", "6", "--ckpt-dir", tmp + "/b", "--out-dir", tmp + "/b-out"]
        error, err = _train_capturing_stderr(argv)
    newest = tmp_path / "b" / "step_0000004"
    expected = (
        f"could not save the checkpoint of step 6 at the end of the run: {_NO_SPACE.format(6)}; "
        f"the newest checkpoint of this run is {newest}"
    )
    assert str(error) == expected, (error, err)
    assert _stop_lines(err) == ([f"mf-train: {expected}"] if rank == 0 else [])
    dist.barrier()
    if rank == 0:
        assert last_saved_checkpoint(tmp_path / "b-out", None) == newest


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failed_periodic_save_warns_and_a_failed_final_save_stops(tmp_path: Path) -> None:
    """save_checkpoint raises RuntimeError on every rank (first line: the cause) when
    writing fails: mf-train warns and goes on after a periodic save, and stops with
    the cause in one line after the final one."""
    run_on_ranks(_rank_save_failures, 2, str(tmp_path), timeout=100)


def _rank_real_save_fails(rank: int, world_size: int, tmp: str) -> None:
    blocker = Path(tmp) / "a-file"
    if rank == 0:
        blocker.write_text("not a folder")
    dist.barrier()
    argv = [*_TINY, "--steps", "2", "--sample-tokens", "0", "--out-dir", tmp + "/out"]
    error, err = _train_capturing_stderr([*argv, "--ckpt-dir", str(blocker / "ckpt")])
    first_line = rf"save_checkpoint: [^\n]* while writing {re.escape(str(blocker))}/ckpt/[^\n]*"
    expected = rf"could not save the checkpoint of step 2 at the end of the run: {first_line}"
    assert re.fullmatch(rf"{expected}; this run saved none", str(error)), (error, err)
    assert _stop_lines(err) == ([f"mf-train: {error}"] if rank == 0 else [])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_real_failed_save_stops_with_its_first_line(tmp_path: Path) -> None:
    """mf_fsdp's own failure (the checkpoint folder cannot be created: a file is in
    the way), not a stand-in: its first line reaches the one-line stop message."""
    run_on_ranks(_rank_real_save_fails, 2, str(tmp_path), timeout=100)


def _rank_interrupt_then_save_fails(rank: int, world_size: int, tmp: str) -> None:
    real_step = mf.train.rank.worker.train_step

    def step_then_interrupt(*args, **kwargs) -> float:
        loss = real_step(*args, **kwargs)
        if rank == 0:  # Ctrl-C seen by one rank: the ranks agree on it after the step
            signal.raise_signal(signal.SIGINT)
        return loss

    argv = [*_TINY, "--steps", "100", "--ckpt-dir", tmp + "/ckpt", "--out-dir", tmp + "/out"]
    handler = signal.getsignal(signal.SIGINT)  # whatever this process inherited
    with pytest.MonkeyPatch.context() as monkeypatch:
        _failing_saves(monkeypatch, {1})
        monkeypatch.setattr(mf.train.rank.worker, "train_step", step_then_interrupt)
        error, err = _train_capturing_stderr(argv)
    expected = (
        f"could not save the checkpoint of step 1 after the interrupt: {_NO_SPACE.format(1)}; "
        "this run saved none"
    )
    assert str(error) == expected, (error, err)
    assert _stop_lines(err) == ([f"mf-train: {expected}"] if rank == 0 else [])
    assert signal.getsignal(signal.SIGINT) is handler  # handlers restored


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failed_save_after_ctrl_c_stops_with_the_cause(tmp_path: Path) -> None:
    """The save after Ctrl-C (SIGINT on one rank) is the run's last: when it fails, the
    run stops with the cause instead of claiming a checkpoint."""
    run_on_ranks(_rank_interrupt_then_save_fails, 2, str(tmp_path), timeout=100)


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
    """Ctrl-C reaches the launcher and the ranks (one process group, as in a terminal).

    The launcher names the checkpoint this run saved, not the newest in --ckpt-dir
    (here another run's), and says that --resume would pick that one.
    """
    other = tmp_path / "ckpt" / "step_9999999"
    other.mkdir(parents=True)
    (other / RECORD_FILE).write_text("{}")
    command = [sys.executable, "-m", "mf.train.run.cli", *_TINY, "--steps", "100000"]
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
    assert len(saved) == 2
    assert saved[1] == other
    assert (saved[0] / RECORD_FILE).is_file()
    assert (
        f"mf-train: interrupted; checkpoint {saved[0]}; --resume would continue from the newer "
        f"{other}\n"
    ) in err
    assert "Traceback" not in err
    assert "\r" not in err  # off a terminal, progress is whole lines


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_diverging_run_ends_with_one_line_and_exit_code_1(tmp_path: Path) -> None:
    """The real ``mf-train``: the workers stop on a NaN loss, rank 0 prints why in one
    line, and the launcher adds neither a traceback nor a "worker failed" dump."""
    command = [sys.executable, "-m", "mf.train.run.cli", *_TINY, "--lr", "1e30", "--steps", "3"]
    command += ["--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("train: ")]  # the progress bar
    assert len(lines) == 1, done.stderr  # no agent log, no traceback, no "a worker failed"
    assert re.fullmatch(
        r"mf-train: the loss is (nan|inf) at step 2; stopping without saving a checkpoint "
        r"\(this run saved none\)",
        lines[0],
    ), done.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mf_train_on_a_gpu(tmp_path: Path, precision: str) -> None:
    """The real ``mf-train --device cuda`` on one GPU (NCCL): it learns, saves and exports."""
    command = [sys.executable, "-m", "mf.train.run.cli", "--device", "cuda", "--nproc", "1"]
    command += ["--model", "tiny", "--precision", precision, "--steps", "40", "--lr", "3e-3"]
    command += ["--eval-every", "20", "--save-every", "20", "--sample-tokens", "16", "--no-plot"]
    command += ["--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr
    losses = [record["loss"] for record in _metrics(tmp_path / "out")]
    assert len(losses) == 40
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses  # it learns
    assert (tmp_path / "ckpt" / "step_0000040" / RECORD_FILE).is_file()
    model = load_model(tmp_path / "out")  # the export loads into a one-process GPT on the CPU
    assert isinstance(model, GPT)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_worker_module_runs_under_torchrun(tmp_path: Path) -> None:
    """The multi-node entry (docs/training.md): ``torchrun ... -m mf.train.rank.worker``, 1 node."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", "127.0.0.1:0", "-m", "mf.train.rank.worker", *_TINY]
    command += ["--steps", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "final train loss" in done.stdout
    assert (tmp_path / "ckpt" / "step_0000002" / RECORD_FILE).is_file()
    assert not list(tmp_path.rglob(".mf-train.lock"))  # rank 0 locked the folders, and released


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_mf_sample_continues_a_prompt_from_the_export_or_a_checkpoint(tmp_path, capsys) -> None:
    """After a run (1 process here), ``mf-sample`` reads its --out-dir (the export), its
    --ckpt-dir (the newest checkpoint) or one checkpoint folder, on one process; both
    forms hold the same model, so the same seed gives the same text."""
    argv = [*_TINY, "--steps", "2", "--nproc", "1", "--sample-tokens", "0", "--no-plot"]
    argv += ["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    run_on_ranks(_rank_train, 1, argv)
    assert not (tmp_path / "out" / "loss.png").exists()  # --no-plot
    texts = []
    for path in (tmp_path / "out", tmp_path / "ckpt", tmp_path / "ckpt" / "step_0000002"):
        assert sample_main([str(path), "--prompt", "Hello", "--tokens", "12"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0].startswith("Hello")
    assert len(texts[0].encode()) >= 12
    assert texts[0] == texts[1] == texts[2]
    assert sample_main([str(tmp_path / "missing")]) == 2
    assert "is not a folder; expected an mf-train --out-dir" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert sample_main([str(tmp_path / "empty")]) == 2
    assert "holds no model.safetensors and no complete checkpoint" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_node_loopback_run_equals_one_node(tmp_path: Path) -> None:
    """Two torchrun agents (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous on
    127.0.0.1) train the same run as one 2-process node, with the same losses."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    options = [*_TINY, "--steps", "3", "--sample-tokens", "0", "--no-plot"]

    def worker_args(name: str) -> list[str]:
        out = ["--ckpt-dir", str(tmp_path / name / "ckpt"), "--out-dir", str(tmp_path / name)]
        return ["-m", "mf.train.rank.worker", *options, *out]

    agent = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    agent += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "loopback"]
    nodes = [
        subprocess.Popen(
            [*agent, *worker_args("two")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err
    one = [torchrun, "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    one += ["--rdzv-endpoint", "127.0.0.1:0", *worker_args("one")]
    done = subprocess.run(one, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    two, single = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2, 3]
    # Each node's one process takes both cores (mf-train gives each process the cores of
    # its node over its local ranks), the single node's two take one each: intra-op
    # threads sum in other orders, so the losses agree to float rounding, not bit for bit.
    torch.testing.assert_close(
        [r["loss"] for r in two], [r["loss"] for r in single], rtol=1e-5, atol=0
    )


def _rank_different_settings(rank: int, world_size: int, tmp: str) -> None:
    model = ["--model", "tiny"] if rank == 0 else ["--model", "small", "--seq-len", "32"]
    options = parse_options([*_TINY, *model, "--steps", "2", "--out-dir", tmp])
    with pytest.raises(RunStoppedError, match=r"rank 1 has --model small \(rank 0: tiny\)"):
        train(options)


@pytest.mark.multiprocess
def test_ranks_with_different_settings_stop_before_any_collective_differs(tmp_path) -> None:
    run_on_ranks(_rank_different_settings, 2, str(tmp_path))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_torchrun_nodes_with_different_models_end_in_one_line(tmp_path: Path) -> None:
    """torchrun on two loopback nodes, ``--model tiny`` on one and ``small`` on the
    other: both end (no abort), rank 0's node printing the one line that says why."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    agent = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    agent += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "mismatch"]
    options = [*_TINY, "--steps", "2", "--sample-tokens", "0", "--no-plot"]
    options += ["--out-dir", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt")]
    nodes = [
        subprocess.Popen(
            [*agent, "-m", "mf.train.rank.worker", *options, *model],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for model in (["--model", "tiny"], ["--model", "small"])
    ]
    errors = [node.communicate(timeout=100)[1] for node in nodes]
    assert all(node.returncode not in (0, None) for node in nodes), errors
    # c10d's rendezvous, not --node-rank, orders the nodes: either may hold rank 0.
    line = "mf-train: error: the ranks were started with different settings: rank 1 has --model"
    assert sum(err.count(line) for err in errors) == 1, errors
    for err in errors:
        assert "SIGABRT" not in err, err
        assert "terminate called" not in err, err


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("stop", "sign"),
    [(signal.SIGSTOP, "Timed out"), (signal.SIGKILL, "(Connection|Timed out)")],
    ids=["hung", "killed"],
)
def test_a_lost_peer_ends_the_survivor_within_the_timeout(
    stop: signal.Signals, sign: str, tmp_path: Path
) -> None:
    """Two ranks started by hand (no elastic agent to stop the rest): rank 1 stops
    answering (SIGSTOP) or dies (SIGKILL) after the first step; rank 0 exits within
    ``--timeout`` (plus one step) with one line naming the problem, instead of
    waiting for gloo's 30-minute default."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    command = [sys.executable, "-m", "mf.train.rank.worker", *_TINY, "--steps", "100000"]
    command += ["--timeout", "5", "--save-every", "0", "--no-plot"]
    command += ["--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path)]
    ranks = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        _wait_for_first_step(ranks[0], tmp_path / "metrics.jsonl", time.monotonic() + 90)
        ranks[1].send_signal(stop)
        stopped = time.monotonic()
        _, err = ranks[0].communicate(timeout=60)
        waited = time.monotonic() - stopped
    finally:
        for process in ranks:
            process.kill()
            process.communicate()
    assert ranks[0].returncode == 1, err
    assert waited < 5 + 40, waited  # the timeout, one step and the exit (a loaded machine)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("mf-train")]
    assert len(lines) == 1, err
    assert re.fullmatch(
        r"mf-train: error: rank 0 lost contact with the other ranks \(one died or stopped "
        rf"answering for --timeout 5 s\): .*{sign}.*",
        lines[0],
    ), err


def _worker_children(parent: int) -> list[int]:
    """The ``mf.train.rank.worker`` processes whose parent is ``parent`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"mf.train.rank.worker" in command:
            found.append(int(entry.name))
    return sorted(found)


def _launcher(kind: str, tmp_path: Path, name: str, restarts: int) -> list[str]:
    options = [*_TINY, "--steps", "60", "--save-every", "10", "--eval-every", "20"]
    options += ["--sample-tokens", "0", "--no-plot", "--out-dir", str(tmp_path / name)]
    options += ["--ckpt-dir", str(tmp_path / name / "ckpt")]
    if kind == "mf-train":
        return [sys.executable, "-m", "mf.train.run.cli", *options, "--max-restarts", str(restarts)]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        torchrun,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "-m",
        "mf.train.rank.worker",
        *options,
    ]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["torchrun", "mf-train"])
def test_a_killed_worker_restarts_and_the_run_ends_as_if_uninterrupted(
    kind: str, tmp_path: Path
) -> None:
    """SIGKILL one worker mid-training under ``--max-restarts 1`` (torchrun's, or
    mf-train's own launcher's): the group restarts,
    every worker resumes from the run's newest checkpoint by itself, the steps since it
    are recomputed, and the losses equal an uninterrupted run's."""
    reference = subprocess.run(
        _launcher(kind, tmp_path, "whole", 0), capture_output=True, text=True, timeout=240
    )
    assert reference.returncode == 0, reference.stderr
    run = subprocess.Popen(
        _launcher(kind, tmp_path, "killed", 1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 25):
        assert run.poll() is None, run.communicate()[1]
        assert time.monotonic() < deadline, "no 25 steps in time"
        time.sleep(0.05)
    workers = _worker_children(run.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    _, err = run.communicate(timeout=240)
    assert run.returncode == 0, err
    assert "mf-train: note" not in err  # a restarted rank 0 takes its run's lock back quietly
    killed, whole = _metrics(tmp_path / "killed"), _metrics(tmp_path / "whole")
    assert [r["step"] for r in killed] == list(range(1, 61))
    assert [r["loss"] for r in killed] == [r["loss"] for r in whole]
    validations = [r.get("validation_loss") for r in killed]
    assert validations == [r.get("validation_loss") for r in whole]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no reaper collected counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["torchrun", "mf-train"])
def test_workers_stop_when_their_launcher_is_killed(kind: str, tmp_path: Path) -> None:
    """SIGKILL the launcher (mf-train's, or torchrun) mid-run: no worker lives 10 s
    later, and the run's newest checkpoint is complete."""
    command = _launcher(kind, tmp_path, "run", 0)
    command[command.index("60")] = "100000"  # --steps: a run that would not end by itself
    run = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_first_step(run, tmp_path / "run" / "metrics.jsonl", time.monotonic() + 120)
        workers = _worker_children(run.pid)
        assert len(workers) == 2, workers
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived their launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.stderr.close()
    newest = latest_checkpoint(tmp_path / "run" / "ckpt")
    if newest is not None:  # the ranks saved on their way out: it loads whole
        assert checkpoint_to_full_state_dict(newest)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_moe_trains_the_same_at_any_ep_or_tp_and_reports_its_routing(tmp_path: Path) -> None:
    """``--model moe-tiny``: ``--ep 2`` (each rank holds 2 of the 4 experts), ``--ep 1`` and
    ``--tp 2`` train the same model with the same losses; the loss falls; every step
    records the load-balance loss and the tokens each expert received; the export holds
    every expert and loads into a one-process ``MoEGPT`` with ``strict=True``."""

    def run(out: str, *extra: str) -> list[dict]:
        argv = [*_TINY, "--model", "moe-tiny", "--steps", "6", "--save-every", "0"]
        argv += ["--sample-tokens", "0", "--out-dir", str(tmp_path / out)]
        argv += ["--ckpt-dir", str(tmp_path / out / "ckpt"), *extra]
        run_on_ranks(_rank_train, 1 if "--nproc" in extra else 2, argv, timeout=150)
        return _metrics(tmp_path / out)

    def losses(records: list[dict]) -> list[float]:
        return [r["loss"] for r in records]

    ep2, ep1 = run("ep2", "--ep", "2"), run("ep1")
    assert losses(ep2)[-1] < losses(ep2)[0]
    assert losses(ep1) == pytest.approx(losses(ep2), abs=2e-5)
    tp2, one = run("tp2", "--tp", "2"), run("one", "--nproc", "1")  # one data-parallel rank
    assert losses(tp2) == pytest.approx(losses(one), abs=2e-5)
    for records, dp_ranks in ((ep2, 2), (tp2, 1)):
        for record in records:
            assert record["load_balance_loss"] > 0
            counts = record["tokens_per_expert"]  # per block: dp ranks x 2 x 32 tokens, top-2
            assert [len(block) for block in counts] == [4, 4]
            assert [sum(block) for block in counts] == [dp_ranks * 2 * 32 * 2] * 2
    model = load_model(tmp_path / "ep2")
    assert type(model).__name__ == "MoEGPT"
    assert model.blocks[0].moe.experts.fc_weight.shape[0] == 4  # every expert, grouped
