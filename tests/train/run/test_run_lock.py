"""One mf-train run per folder (``mf.train.run.run_lock``): a second run into a held --ckpt-dir
or --out-dir is refused in one line naming the holder; a dead holder's lock is taken over;
another host's is respected; the lock never looks like checkpoint data and goes at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mf.train.rank.worker import main as worker_main
from mf.train.run.cli import main
from mf.train.run.options import TrainOptions, parse_options
from mf.train.run.run_lock import (
    LAUNCHER_LOCKED_VARIABLE,
    LOCK_FILE,
    RunLockError,
    acquire_run_locks,
    launcher_holds_locks,
    worker_takes_locks,
)
from mf_fsdp import RECORD_FILE, latest_checkpoint
from tests.train.rank.test_worker import _TINY, _wait_for_first_step


def _options(ckpt: Path, out: Path, *extra: str) -> TrainOptions:
    return parse_options([*_TINY, "--ckpt-dir", str(ckpt), "--out-dir", str(out), *extra])


def _dead_pid() -> int:
    """The pid of a process that ran on this host and ended (and was reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def _write_lock(folder: Path, **record: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    path.write_text(json.dumps({"started": "2000-01-01T00:00:00+00:00", **record}))
    return path


def test_a_run_locks_both_folders_and_releases_them(tmp_path: Path) -> None:
    """The lock files name this host, pid and run; release removes them and the folders the
    lock created that stayed empty (an --out-dir the run wrote into stays)."""
    options = _options(tmp_path / "ckpt", tmp_path / "out")
    with acquire_run_locks(options, "run-a"):
        for folder in ("ckpt", "out"):
            record = json.loads((tmp_path / folder / LOCK_FILE).read_text())
            assert record["host"] == socket.gethostname()
            assert (record["pid"], record["run_id"]) == (os.getpid(), "run-a")
        (tmp_path / "out" / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["metrics.jsonl"]
    with acquire_run_locks(options, "run-b"):  # free again
        pass


def test_a_held_folder_is_refused_naming_the_option_and_the_holder(tmp_path: Path) -> None:
    held = acquire_run_locks(_options(tmp_path / "ckpt", tmp_path / "out"), "run-a")
    with held:
        for ckpt, out, name, folder in (
            ("ckpt", "other", "--ckpt-dir", "ckpt"),
            ("other", "out", "--out-dir", "out"),
        ):
            with pytest.raises(RunLockError) as refused:
                acquire_run_locks(_options(tmp_path / ckpt, tmp_path / out), "run-b")
            assert str(refused.value) == (
                f"{name} {str(tmp_path / folder)!r} is in use by another mf-train run "
                f"(host {socket.gethostname()}, pid {os.getpid()}, run run-a, since "
                f"{json.loads((tmp_path / folder / LOCK_FILE).read_text())['started']}); "
                "wait for it to end or choose another folder"
            )
            assert not (tmp_path / "other").exists()  # the refused run's folder is gone again
    assert not (tmp_path / "ckpt").exists()


def test_one_folder_for_both_and_nested_folders_lock_once_each(tmp_path: Path) -> None:
    """--ckpt-dir == --out-dir: one lock, named for both; --ckpt-dir inside --out-dir (the
    default layout, docs/training.md): two locks that do not block each other."""
    same = _options(tmp_path / "run", tmp_path / "run")
    with acquire_run_locks(same, None):
        assert [p.name for p in (tmp_path / "run").iterdir()] == [LOCK_FILE]
        with pytest.raises(RunLockError, match=r"^--ckpt-dir and --out-dir '"):
            acquire_run_locks(same, None)
    nested = _options(tmp_path / "run" / "ckpt", tmp_path / "run")
    with acquire_run_locks(nested, None):
        assert (tmp_path / "run" / LOCK_FILE).is_file()
        assert (tmp_path / "run" / "ckpt" / LOCK_FILE).is_file()
        with pytest.raises(RunLockError, match=r"^--out-dir '.*/run' is in use"):
            acquire_run_locks(_options(tmp_path / "elsewhere", tmp_path / "run"), None)
    assert not (tmp_path / "run").exists()


def test_a_dead_holders_lock_is_taken_over_with_a_note(tmp_path: Path, capsys) -> None:
    """A lock of this host whose pid no longer runs (a killed run) is taken over with one
    note; a restarted rank 0 takes its own run's lock back silently."""
    dead = _dead_pid()
    host = socket.gethostname()
    _write_lock(tmp_path / "ckpt", host=host, pid=dead, run_id="run-a")
    options = _options(tmp_path / "ckpt", tmp_path / "ckpt")
    with acquire_run_locks(options, "run-b"):
        assert json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err == (
        f"mf-train: note: --ckpt-dir and --out-dir {str(tmp_path / 'ckpt')!r} was locked by a "
        f"run that no longer runs (host {host}, pid {dead}, run run-a, since "
        "2000-01-01T00:00:00+00:00); taking the lock over\n"
    )
    _write_lock(tmp_path / "ckpt", host=host, pid=dead, run_id="run-a")
    with acquire_run_locks(options, "run-a", restarted=True):
        pass
    assert capsys.readouterr().err == ""
    _write_lock(tmp_path / "ckpt", host=host, pid=dead, run_id="run-a")
    with acquire_run_locks(options, "run-a"):  # a new run with the same id (torchrun's "none")
        pass
    assert "mf-train: note:" in capsys.readouterr().err
    (tmp_path / "ckpt" / LOCK_FILE).write_text("")  # its creator died before writing it
    with acquire_run_locks(options, None):
        pass
    assert "(an unfinished lock); taking the lock over" in capsys.readouterr().err


def test_a_lock_of_a_live_pid_or_another_host_is_respected(tmp_path: Path) -> None:
    """No flock tells of a holder (written by hand here) yet its pid runs: refused. Another
    host's lock cannot be checked: refused, saying which file to remove if it is stale."""
    options = _options(tmp_path / "ckpt", tmp_path / "out")
    _write_lock(tmp_path / "ckpt", host=socket.gethostname(), pid=os.getppid())
    with pytest.raises(RunLockError, match=rf"pid {os.getppid()}, since .*; wait for it to end"):
        acquire_run_locks(options, None)
    path = _write_lock(tmp_path / "ckpt", host="other-host", pid=_dead_pid(), run_id="r")
    with pytest.raises(RunLockError) as refused:
        acquire_run_locks(options, None)
    assert str(refused.value).startswith(
        f"--ckpt-dir {str(tmp_path / 'ckpt')!r} is in use by another mf-train run "
        "(host other-host, pid "
    )
    assert str(refused.value).endswith(
        f"mf-train cannot check a process of another host: if that run has ended, remove {path}"
    )
    assert path.is_file()  # untouched
    assert not (tmp_path / "out").exists()  # the refused run left nothing behind


def test_the_lock_file_is_no_checkpoint_data(tmp_path: Path) -> None:
    """latest_checkpoint, --resume's check and mf-sample's reader see past a held lock."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_0000003").mkdir(parents=True)
    (ckpt / "step_0000003" / RECORD_FILE).write_text(json.dumps({"step": 3, "extra": {}}))
    with acquire_run_locks(_options(ckpt, tmp_path / "out"), None):
        assert latest_checkpoint(ckpt) == ckpt / "step_0000003"
        resumed = _options(ckpt, tmp_path / "out", "--resume", "--steps", "6")
        assert resumed.resume


def test_locks_are_released_on_an_error(tmp_path: Path) -> None:
    with (
        pytest.raises(KeyboardInterrupt),
        acquire_run_locks(_options(tmp_path / "ckpt", tmp_path / "out"), None),
    ):
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_only_rank_0_without_the_launcher_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAUNCHER_LOCKED_VARIABLE, raising=False)
    monkeypatch.setenv("RANK", "1")
    assert not worker_takes_locks()
    monkeypatch.setenv("RANK", "0")
    assert worker_takes_locks()
    with launcher_holds_locks():
        assert os.environ[LAUNCHER_LOCKED_VARIABLE] == "1"
        assert not worker_takes_locks()
    assert LAUNCHER_LOCKED_VARIABLE not in os.environ
    assert worker_takes_locks()


def test_launcher_and_worker_refuse_a_held_folder_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """In process: mf-train's main refuses before launching anything, and a torchrun rank 0
    before joining a process group; both exit with code 2 and one line."""

    def no_launch(*args: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr("mf.train.run.cli._launch", no_launch)
    monkeypatch.setattr("mf.train.rank.worker.train", no_launch)
    monkeypatch.delenv(LAUNCHER_LOCKED_VARIABLE, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*_TINY, "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out")]
    with acquire_run_locks(parse_options(argv), "run-a"):
        for entry in (main, worker_main):
            assert entry(argv) == 2
            lines = capsys.readouterr().err.splitlines()
            assert len(lines) == 1
            assert lines[0].startswith(f"mf-train: error: --ckpt-dir {str(tmp_path / 'ckpt')!r}")
            assert f"pid {os.getpid()}, run run-a" in lines[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_second_mf_train_into_a_running_runs_folder_exits_with_2(tmp_path: Path, capsys) -> None:
    """The real ``mf-train``: while one run trains, a second into its --ckpt-dir exits with
    code 2 and one line naming the first run's launcher pid; Ctrl-C ends the first (130)
    and its lock files are gone. (The second run is ``mf-train``'s main in this process:
    the same code as ``python -m mf.train.run.cli`` without another torch import.)"""
    common = [*_TINY, "--save-every", "0", "--no-plot", "--ckpt-dir", str(tmp_path / "ckpt")]
    command = [sys.executable, "-m", "mf.train.run.cli", *common, "--steps", "100000"]
    first = subprocess.Popen(
        [*command, "--out-dir", str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_first_step(first, tmp_path / "out" / "metrics.jsonl", time.monotonic() + 100)
        assert (tmp_path / "out" / LOCK_FILE).is_file()
        capsys.readouterr()
        code = main([*common, "--steps", "2", "--out-dir", str(tmp_path / "out2")])
        second = capsys.readouterr().err
        os.killpg(first.pid, signal.SIGINT)
        _, err = first.communicate(timeout=40)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert code == 2, second
    assert second.count("\n") == 1, second
    assert second.startswith(
        f"mf-train: error: --ckpt-dir {str(tmp_path / 'ckpt')!r} is in use by another "
        f"mf-train run (host {socket.gethostname()}, pid {first.pid}, run mf-train-"
    ), second
    assert not (tmp_path / "out2").exists()  # no worker started
    assert first.returncode == 130, err
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
    assert not (tmp_path / "out" / LOCK_FILE).exists()
