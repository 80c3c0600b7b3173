"""How every rank of an ``mf-train`` run stops together: on a signal, a bad loss or a failure.

A rank that must stop tells the others through a flag it all-reduces at the
same step on every rank, so no rank is left waiting in a collective; rank 0
prints the one line that says why.
"""

from __future__ import annotations

import math
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mf.train.reports.report import Reporter
from mf.train.run.options import TrainOptions

__all__ = ["RunStoppedError", "StopFlag", "join", "newest", "stop", "stop_if_diverged"]


class RunStoppedError(RuntimeError):
    """The run cannot go on (a non-finite loss, a failed final save); raised on every rank.

    Rank 0 has already printed the message as the one line ``mf-train: <message>``.
    """


class StopFlag:
    """Set by SIGINT/SIGTERM; ranks agree on it with one all-reduce per step.

    A context manager: the previous signal handlers come back on exit.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it each step)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def join(options: TrainOptions) -> None:
    """Join the default process group from the launcher's environment.

    After an elastic restart the agent's store still holds the previous
    attempt's keys (the ranks' old addresses), so each attempt's group lives
    under its own prefix.
    """
    from torch.distributed.rendezvous import rendezvous

    backend = "nccl" if options.use_cuda else "gloo"
    timeout = timedelta(seconds=options.timeout)
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"mf-train/attempt-{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def newest(saved: Path | None) -> str:
    """The end of a stop message: which checkpoint a user can --resume from."""
    return f"the newest checkpoint of this run is {saved}" if saved else "this run saved none"


def stop(reporter: Reporter, message: str) -> NoReturn:
    """End the run on every rank (collective): rank 0 prints ``message``, then all raise.

    The barrier keeps every rank alive until rank 0's line is out: the launcher
    stops the other ranks as soon as one exits.
    """
    reporter.stopped(message)
    dist.barrier()
    raise RunStoppedError(message)


def stop_if_diverged(reporter: Reporter, loss: float, step: int, saved: Path | None) -> None:
    """Stop every rank, before any save, when the loss is NaN or infinite.

    The loss is the mean over all ranks, the same number everywhere, so every rank
    stops at the same step and none waits in a collective.
    """
    if not math.isfinite(loss):
        message = f"the loss is {loss} at step {step}; stopping without saving a checkpoint"
        stop(reporter, f"{message} ({newest(saved)})")
