"""``mf.launch.stop_with_launcher`` in a process of its own: both ways it arms, and a
launcher that is already gone. Plain interpreters, no torch: each case costs a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mf.launch import LAUNCHER_PID_VARIABLE

_ARM = (
    "import sys, time; from mf import launch; "
    "{patch}print(launch.stop_with_launcher(), flush=True); time.sleep(60)"
)


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_worker_whose_launcher_is_already_gone_ends_at_once() -> None:
    env = {**os.environ, LAUNCHER_PID_VARIABLE: str(_dead_pid())}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _ARM.format(patch="")], env=env, capture_output=True, timeout=30
    )
    assert done.returncode == -signal.SIGTERM, done
    assert time.monotonic() - started < 20


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("platform", ["linux", "elsewhere"])
def test_a_worker_ends_soon_after_its_launcher_dies(platform: str) -> None:
    """A launcher (an interpreter) starts the worker, then SIGKILLs itself."""
    patch = "" if platform == "linux" else "launch.sys.platform = 'other'; "
    worker = [sys.executable, "-c", _ARM.format(patch=patch)]
    launcher = (
        "import os, signal, subprocess, sys; "
        f"os.environ[{LAUNCHER_PID_VARIABLE!r}] = str(os.getpid()); "
        f"w = subprocess.Popen({worker!r}, stdout=subprocess.PIPE, text=True); "
        "print(w.pid, w.stdout.readline().strip(), flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    done = subprocess.run(
        [sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60
    )
    pid, how = done.stdout.split()
    assert how == ("prctl" if platform == "linux" else "thread"), done
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(int(pid), signal.SIGKILL)
        raise AssertionError("the worker outlived its launcher")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_launcher_not_yet_reaped_counts_as_gone() -> None:
    """A launcher SIGKILLed a moment ago is a zombie until its parent reaps it: the
    guarded start must take it for dead, or it arms against init and outlives it
    (seen once under load: a worker alive 10 s after its launcher was killed)."""
    from mf.launch import _alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        assert not _alive(child.pid)  # exited, not reaped: gone
        assert _alive(os.getpid())
    finally:
        child.wait()
    assert not _alive(child.pid)
