"""One machine's worth of ranks under torch's elastic launcher (mf-train, mf-bench, benchmarks).

Every local run here uses the same rendezvous: a c10d store on a free port of
127.0.0.1, one node; by default no restarts (a failed rank fails the run).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "leave_process_group",
    "local_launch_config",
    "new_run_id",
    "stop_with_launcher",
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
