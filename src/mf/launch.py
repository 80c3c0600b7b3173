"""One machine's worth of ranks under torch's elastic launcher (mf-train, mf-bench, benchmarks).

Every local run here uses the same rendezvous: a c10d store on a free port of
127.0.0.1, one node; by default no restarts (a failed rank fails the run).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "LAUNCHER_PID_VARIABLE",
    "guarded_command",
    "leave_process_group",
    "local_launch_config",
    "new_run_id",
    "stop_with_launcher",
    "wake_stopped_workers",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

LAUNCHER_PID_VARIABLE = "MF_LAUNCHER_PID"
"""Set by ``mf-train``'s launcher to its own pid for the workers it starts."""

_armed: str | None = None  # how stop_with_launcher armed this process, once it did


def leave_process_group() -> None:
    """Destroy every process group and free the ones unreachable objects still hold.

    A gloo group that outlives this call (held by a model in a reference cycle)
    is otherwise torn down while the interpreter exits: its worker threads then
    release tensors without a live interpreter and the process aborts
    ("terminate called without an active exception") after a successful run.
    """
    import torch.distributed as dist

    dist.destroy_process_group()
    gc.collect()


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs: it exists and (where /proc tells) is no zombie.

    A launcher killed a moment ago stays a zombie until its own parent reaps it;
    it is dead all the same, and a worker that took it for alive would arm the
    parent-death signal against init and outlive it.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (macOS), or it just went
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _watch_parent(parent: int, sig: int, interval: float) -> None:
    """Signal this process once its parent is no longer ``parent`` (a daemon thread)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="mf-stop-with-launcher", daemon=True).start()


def stop_with_launcher(sig: int = signal.SIGTERM, *, interval: float = 0.5) -> str:
    """Have this process receive ``sig`` when its parent, the launcher, dies.

    A worker whose launcher was killed (SIGKILL, the OOM killer, a closed
    terminal) would otherwise train on as an orphan, holding its devices and
    writing into the run's folders, or wait out the rendezvous timeout on a dead
    store. ``mf.train.rank.worker`` stops on SIGTERM as on Ctrl-C: every rank saves a
    checkpoint and exits; before it joined the group, SIGTERM ends it at once.

    Call it first thing, before heavy imports: the parent is compared with the
    launcher's pid that ``mf-train``'s launcher passes down in
    ``MF_LAUNCHER_PID``, so a worker whose launcher died before this call (it is
    then a child of init or of a subreaper) gets ``sig`` at once instead of
    arming against its new parent. Without the variable (``torchrun``) the parent
    at the time of the call is the launcher.

    Returns how it is armed: ``"prctl"`` (Linux: the kernel's parent-death
    signal) or ``"thread"`` (elsewhere: a daemon thread polling the parent pid
    every ``interval`` seconds).
    """
    global _armed
    if _armed is not None:  # already armed, by the guarded start
        return _armed
    parent = os.getppid()
    launcher = int(os.environ.get(LAUNCHER_PID_VARIABLE, "0") or 0)
    if launcher and launcher != parent and not _alive(launcher):
        os.kill(os.getpid(), sig)  # the launcher is already gone
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
            if os.getppid() != parent:  # the launcher died before the request took effect
                os.kill(os.getpid(), sig)
            _armed = "prctl"
            return _armed
    _watch_parent(parent, sig, interval)
    _armed = "thread"
    return _armed


def guarded_command(module: str) -> list[str]:
    """The arguments after ``python`` that run ``-m module`` armed by ``stop_with_launcher``.

    This file runs as a script (``python launch.py -m module ...``): it imports
    nothing but the standard library, so the parent-death signal is armed in the
    interpreter's first milliseconds, not after the seconds ``import torch`` takes.
    """
    return ["-u", str(Path(__file__).resolve()), "-m", module]


def new_run_id(prefix: str) -> str:
    """A run id no other local run shares: ``prefix`` and 8 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def local_launch_config(
    nproc: int, run_id: str, *, monitor_interval: float = 0.1, max_restarts: int = 0
) -> LaunchConfig:
    """The launch config of ``nproc`` ranks on this machine, rendezvous on 127.0.0.1.

    ``max_restarts``: how often the agent restarts the whole group after a rank failed.
    """
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method="spawn",
    )


def _children(parent: int) -> dict[int, str]:
    """The state letter of each live (not zombie) child of ``parent``, by pid (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(parent) and fields[0] != "Z":
            found[int(entry.name)] = fields[0]
    return found


@contextlib.contextmanager
def wake_stopped_workers(interval: float = 0.5) -> Iterator[None]:
    """While open: once a child of this process has exited, resume the children a signal stopped.

    A rank frozen by SIGSTOP (or a job-control stop of that process alone) cannot
    take the SIGTERM the elastic agent sends when another rank ends the run: the
    signal waits, and the agent waits 30 s before its SIGKILL, whatever
    ``--timeout`` says. Resumed (SIGCONT), the rank takes the SIGTERM and ends at
    once, its peers being gone. Nothing is resumed while every rank runs, and a
    rank stopped by a debugger (tracing stop) is left alone. A thread polling
    ``/proc`` every ``interval`` seconds; Linux only (elsewhere it does nothing).
    """
    if not Path("/proc/self/stat").exists():
        yield
        return
    done = threading.Event()

    def watch() -> None:
        seen: set[int] = set()
        while not done.wait(interval):
            children = _children(os.getpid())
            ended = seen - children.keys()
            seen |= children.keys()
            if not ended:
                continue
            for pid, state in children.items():
                if state == "T":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=watch, name="mf-wake-stopped-workers", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _run_guarded(argv: list[str]) -> None:
    """``python launch.py -m MODULE ARGS``: arm ``stop_with_launcher``, then run MODULE."""
    import runpy

    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit(f"usage: python {__file__} -m MODULE [ARGS...]")
    sys.path.pop(0)  # this file's folder, which the script run put first
    stop_with_launcher()
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_guarded(sys.argv[1:])
