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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "leave_process_group",
    "local_launch_config",
    "new_run_id",
    "stop_with_launcher",
    "wake_stopped_workers",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def stop_with_launcher(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent, the launcher, dies.

    A worker whose launcher was killed (SIGKILL, the OOM killer, a closed
    terminal) would otherwise train on as an orphan, holding its devices and
    writing into the run's folders. ``mf.train.worker`` stops on SIGTERM as on
    Ctrl-C: every rank saves a checkpoint and exits. Linux only (the parent-death
    signal); returns whether it is armed.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), sig)
    return True


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
