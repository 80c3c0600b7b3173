"""Workers of ``mf-train`` never outlive their launcher, whenever in start-up it dies.

The launcher is SIGKILLed at three moments of the workers' start-up: as soon as
they exist (before their imports), one second later (inside ``import torch``)
and once a worker holds a socket (the rendezvous); every time no worker may be
alive 10 s later. Before the parent-death signal was armed first thing,
against the launcher's pid passed down, the first two left both workers
waiting 300 s on the dead launcher's rendezvous.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.train.rank.test_worker import _TINY, _alive, _worker_children


def _has_socket(pid: int) -> bool:
    """Whether ``pid`` holds a socket (a worker has reached the rendezvous)."""
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith("socket:"):
                    return True
    return False


def _at_once(workers: list[int]) -> bool:
    return True


def _a_second_later(workers: list[int], started: list[float] = []) -> bool:  # noqa: B006
    started.append(time.monotonic())
    return time.monotonic() - started[0] >= 1.0


def _in_rendezvous(workers: list[int]) -> bool:
    return any(_has_socket(pid) for pid in workers)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("moment", [_at_once, _a_second_later, _in_rendezvous])
def test_no_worker_outlives_a_launcher_killed_in_start_up(
    moment: Callable[[list[int]], bool], tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "mf.train.run.cli", *_TINY, "--steps", "3", "--no-plot"]
    command += ["--sample-tokens", "0", "--out-dir", str(tmp_path / "out")]
    command += ["--ckpt-dir", str(tmp_path / "ckpt")]
    run = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 or not moment(workers):
            assert run.poll() is None, "the launcher ended before it was killed"
            assert time.monotonic() < deadline, f"no moment {moment.__name__} in time"
            workers = sorted(set(workers) | set(_worker_children(run.pid)))
            time.sleep(0.01)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived their launcher"
    finally:
        for pid in [run.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
