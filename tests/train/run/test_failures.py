"""A rank's exception reaches the user as one line, once for all ranks that raised it,
with the path of a per-rank log holding the traceback (``mf.train.run.failures``); out of
memory names ``--micro-batch``.

The line-building is tested on made-up failures; two real ``mf-train`` runs raise in
their workers: out of memory on both ranks (a micro-batch no address space can hold,
refused at once by the allocator, never filling memory) and an export that fails on
rank 0 alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from mf.train.run.failures import RankFailure, describe, failure_lines, report_rank_failure
from mf.train.run.options import parse_options
from tests.train.rank.test_worker import _wait_for_first_step, _worker_children

_RUN = ["--device", "cpu", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2"]
_RUN += ["--eval-every", "100", "--sample-tokens", "0", "--no-plot"]


def _raised(error: BaseException) -> BaseException:
    """``error`` with a traceback, as a rank would catch it."""
    try:
        raise error
    except BaseException as caught:
        return caught


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"),
    ],
    ids=["torch.OutOfMemoryError", "MemoryError", "cpu-allocator"],
)
def test_out_of_memory_names_the_micro_batch(error: BaseException) -> None:
    options = parse_options([*_RUN, "--micro-batch", "64"])
    line, peer = describe(error, options)
    assert not peer
    assert line.startswith("out of CPU memory (")
    assert "lower --micro-batch (now 64)" in line
    # Also when the allocation failure caused another error.
    wrapped = ValueError("while building")
    wrapped.__cause__ = error
    assert describe(wrapped, options)[0].startswith("out of CPU memory")


def test_other_errors_and_lost_peers_are_one_line() -> None:
    options = parse_options([*_RUN, "--timeout", "10"])
    assert describe(KeyError("x"), options) == ("KeyError: 'x'", False)
    assert describe(ValueError("first\nsecond"), options) == ("ValueError: first", False)
    line, peer = describe(RuntimeError("[gloo] Timed out waiting 10000ms\nmore"), options)
    assert peer
    assert line == (
        "lost contact with the other ranks (one died or stopped answering for --timeout 10 s): "
        "[gloo] Timed out waiting 10000ms"
    )


def _failure(tmp_path: Path, rank: int, message: str | None, exitcode: int = 1) -> ProcessFailure:
    error_file = tmp_path / f"error-{rank}.json"
    error_file.unlink(missing_ok=True)  # a signal leaves none
    if message is not None:
        error_file.write_text(json.dumps({"message": message, "timestamp": 100 + rank}))
    return ProcessFailure(
        local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file)
    )


def _recorded(
    tmp_path: Path, rank: int, line: str, lost_peer: bool = False, when: float = 0.0
) -> ProcessFailure:
    log = tmp_path / f"rank-{rank}.log"
    log.write_text("Traceback ...\n")
    failure = RankFailure(line, lost_peer, str(log), when)
    return _failure(tmp_path, rank, failure.to_message())


def test_the_launcher_prints_each_cause_once(tmp_path: Path) -> None:
    lost = "lost contact with the other ranks (...): Connection closed by peer"
    boom = "ValueError: boom"
    log0, log1 = tmp_path / "rank-0.log", tmp_path / "rank-1.log"

    def failed(*failures: ProcessFailure) -> ChildFailedError:
        return ChildFailedError("mf.train.rank.worker", dict(enumerate(failures)))

    both = failed(_recorded(tmp_path, 0, boom), _recorded(tmp_path, 1, boom))
    expected = f"ranks 0 and 1 raised {boom} (traceback: {log0})"
    assert failure_lines(both, str(tmp_path)) == [expected]
    assert "torch elastic's report of the run" in log0.read_text()  # the dump goes to the log
    # The rank that raised is the cause; the one that lost it is not reported.
    one = failed(_recorded(tmp_path, 0, lost, True), _recorded(tmp_path, 1, boom))
    assert failure_lines(one, str(tmp_path)) == [f"rank 1 raised {boom} (traceback: {log1})"]
    # Different causes: one line each.
    two = failed(_recorded(tmp_path, 0, "KeyError: 'a'"), _recorded(tmp_path, 1, boom))
    assert len(failure_lines(two, str(tmp_path))) == 2
    # A rank killed by a signal outranks the peers that lost it.
    killed = failed(_recorded(tmp_path, 0, lost, True), _failure(tmp_path, 1, None, exitcode=-9))
    [line] = failure_lines(killed, str(tmp_path / "out"))
    assert line.startswith("rank 1 was killed by SIGKILL; the kernel's out-of-memory killer")
    assert line.endswith(f"(torch elastic's report: {tmp_path / 'out' / 'logs' / 'launcher.log'})")
    # Only lost peers: the first to lose them is the line (a frozen rank, once resumed,
    # finds its peer gone after the survivor's timeout).
    timed_out = "lost contact with the other ranks (...): Timed out"
    alone = failed(
        _recorded(tmp_path, 0, lost, True, 5.0), _recorded(tmp_path, 1, timed_out, True, 4.0)
    )
    assert failure_lines(alone, str(tmp_path)) == [f"rank 1 {timed_out} (traceback: {log1})"]
    # The agent's SIGTERM is its own doing, never the cause.
    stopped = failed(_recorded(tmp_path, 0, lost, True), _failure(tmp_path, 1, None, exitcode=-15))
    assert failure_lines(stopped, str(tmp_path)) == [f"rank 0 {lost} (traceback: {log0})"]


def test_under_torchrun_the_rank_prints_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    options = parse_options([*_RUN, "--out-dir", str(tmp_path / "out")])
    assert report_rank_failure(_raised(ValueError("boom")), options, gathered=False) == 1
    log = tmp_path / "out" / "logs" / "rank-1.log"
    err = capsys.readouterr().err
    assert err == f"mf-train: error: rank 1 raised ValueError: boom (traceback: {log})\n"
    assert "Traceback (most recent call last)" in log.read_text()
    # An --out-dir that cannot hold the log (a file): the log goes to a temporary folder.
    (tmp_path / "file").write_text("x")
    options = parse_options([*_RUN, "--out-dir", str(tmp_path / "file")])
    report_rank_failure(_raised(ValueError("boom")), options, gathered=False)
    logged = Path(re.search(r"\(traceback: (.*)\)$", capsys.readouterr().err.strip()).group(1))
    assert "ValueError: boom" in logged.read_text()
    logged.unlink()


def _mf_train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mf.train.run.cli", *_RUN, "--steps", "1", *extra]
    command += ["--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out")]
    return subprocess.run(command, capture_output=True, text=True, timeout=150, check=False)


def _one_line(done: subprocess.CompletedProcess) -> tuple[str, Path]:
    """The run's one stderr line (progress lines aside) and the log it names."""
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("train: ")]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    log = Path(re.search(r"\(traceback: (.*)\)$", lines[0]).group(1))
    return lines[0], log


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_out_of_memory_in_the_workers_is_one_line_naming_the_micro_batch(tmp_path: Path) -> None:
    """2**44 sequences per micro-batch: 256 TiB of start offsets, more than any address
    space, so the allocator refuses at once on every overcommit setting."""
    done = _mf_train(tmp_path, "--micro-batch", str(2**44))
    line, log = _one_line(done)
    assert re.fullmatch(
        r"mf-train: error: ranks? [01]( and 1)? raised out of CPU memory \(RuntimeError: .*"
        r"can't allocate memory.*\); lower --micro-batch \(now 17592186044416\) and raise "
        r"--grad-accum \(now 1\) .*\(traceback: .*/out/logs/rank-[01]\.log\)",
        line,
    ), line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text
    assert "torch elastic's report of the run" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_an_exception_in_one_worker_is_one_line_with_its_log(tmp_path: Path) -> None:
    """Rank 0 alone exports; a folder where the export's file belongs makes it raise."""
    (tmp_path / "out" / "model.safetensors").mkdir(parents=True)
    line, log = _one_line(_mf_train(tmp_path))
    assert re.fullmatch(r"mf-train: error: rank 0 raised \w+Error: .*\(traceback: .*\)", line)
    assert log == tmp_path / "out" / "logs" / "rank-0.log"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text
    assert "export_model" in text
    assert "torch elastic's report of the run" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_frozen_rank_ends_the_run_within_the_timeout_in_one_line(tmp_path: Path) -> None:
    """SIGSTOP on one rank of a real ``mf-train --timeout 10``: the other times out,
    and the launcher wakes the frozen one (which then takes the agent's SIGTERM)
    instead of waiting 30 s for the agent's SIGKILL; one line, exit code 1."""
    command = [sys.executable, "-m", "mf.train.run.cli", *_RUN, "--steps", "100000"]
    command += ["--timeout", "10", "--save-every", "0", "--out-dir", str(tmp_path / "out")]
    command += ["--ckpt-dir", str(tmp_path / "ckpt")]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        _wait_for_first_step(launcher, tmp_path / "out" / "metrics.jsonl", time.monotonic() + 120)
        workers = _worker_children(launcher.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGSTOP)
        frozen = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        waited = time.monotonic() - frozen
    finally:
        launcher.kill()
        for pid in workers:  # none should be left; never a stopped one
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == 1, err
    # Rank 0's collective times out (10 s, after the step in flight). The woken rank may
    # then wait out a timeout of its own before it sees its peer gone (measured on this
    # 2-core machine: 12.7 to 29.3 s in all); the agent's SIGKILL path took 44 s.
    assert waited < 2 * 10 + 15, waited
    lines = [line for line in err.splitlines() if not line.startswith("train: ")]
    assert len(lines) == 1, err
    assert re.fullmatch(
        r"mf-train: error: rank [01] lost contact with the other ranks \(one died or stopped "
        r"answering for --timeout 10 s\): .*\(traceback: .*/out/logs/rank-[01]\.log\)",
        lines[0],
    ), err
