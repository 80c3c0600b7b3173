r"""``mf-train``: check the options, then start the ranks with torch's elastic launcher.

User mistakes (bad sizes or numbers, an unknown preset, a missing or empty
data file, a seq-len the corpus cannot fill, --resume with nothing to
resume or from a damaged, hostile or foreign checkpoint: ``mf.train.run.resume``,
more CUDA processes than GPUs, a --ckpt-dir or --out-dir another run holds:
``mf.train.run.run_lock``) are found here, before any worker starts, and
printed as one line with exit code 2; more CPU processes than cores is a
one-line warning. The launcher holds the locks of both folders until the run
ends. Ctrl-C reaches every rank: each finishes its step, saves a checkpoint and
exits; the launcher then names the checkpoint this run saved, never another
run's (exit code 130). A run that cannot go on (a non-finite loss, a failed
final save) ends with rank 0's one line and exit code 1; an exception in a
worker with one line per cause, naming the log of its traceback
(``mf.train.run.failures``), exit code 1.

For several machines, run the worker module under torchrun on each node
(``--nproc`` is then torchrun's world size)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 -m mf.train.rank.worker --tp 2
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mf.launch import (
    LAUNCHER_PID_VARIABLE,
    guarded_command,
    local_launch_config,
    new_run_id,
    wake_stopped_workers,
)
from mf.train.data.run_data import training_data
from mf.train.reports.report import last_saved_checkpoint
from mf.train.run.failures import failure_lines
from mf.train.run.options import TrainOptions, local_cpu_cores, parse_options
from mf.train.run.resume import verify_resume
from mf.train.run.run_lock import RunLockError, acquire_run_locks, launcher_holds_locks

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = [
    "STOPPED_EXIT_CODE",
    "check_data",
    "check_local_processes",
    "main",
    "print_summary",
    "user_error",
    "user_warning",
]

STOPPED_EXIT_CODE = 3
"""A worker's exit code when the run stopped and rank 0 already printed why (one line)."""


def user_error(error: Exception | str) -> None:
    """Print a user's mistake as the one line ``mf-train: error: ...`` on stderr."""
    print(f"mf-train: error: {error}", file=sys.stderr, flush=True)


def user_warning(message: str) -> None:
    """Print the one line ``mf-train: warning: ...`` on stderr; the run goes on."""
    print(f"mf-train: warning: {message}", file=sys.stderr, flush=True)


def check_data(options: TrainOptions) -> None:
    """Raise a one-line ValueError for data the run cannot train on.

    A missing, empty or non-UTF-8 file, a bad JSONL line, a corpus too short for
    --seq-len, or a model folder's tokenizer that cannot serve.
    """
    training_data(options)


def check_local_processes(options: TrainOptions) -> None:
    """Refuse more CUDA processes than GPUs; warn about more CPU processes than cores.

    Only the launcher checks: under torchrun, ``--nproc`` is the world size of all
    nodes, not this machine's share.

    Raises:
        ValueError: ``--nproc`` exceeds the GPUs of this machine on a CUDA run.
    """
    if options.use_cuda:
        gpus = torch.cuda.device_count()
        if options.nproc > gpus:
            raise ValueError(
                f"--nproc {options.nproc} is more than the CUDA GPUs of this machine ({gpus}); "
                f"one process per GPU: use --nproc {gpus} or fewer, or --device cpu"
            )
        return
    cores = local_cpu_cores()
    if options.nproc > cores:
        user_warning(
            f"--nproc {options.nproc} is more than the CPU cores this process may use "
            f"({cores}); the ranks will share them and every step will be slower"
        )


def _launch(options: TrainOptions, run_id: str, argv: Sequence[str]) -> None:
    """Run ``mf.train.rank.worker <argv>`` on ``--nproc`` local processes.

    Each starts through ``mf.launch.guarded_command``: it stops with this launcher
    from its first milliseconds, not only once torch is imported.

    The ranks are commands, as under torchrun, not functions: rank 0 prints
    the summary itself, and a rank that saved its checkpoint after Ctrl-C
    exits at once instead of waiting for the interrupted launcher to collect
    a return value.
    """
    from torch.distributed.launcher.api import elastic_launch

    config = local_launch_config(
        options.nproc, run_id, monitor_interval=0.2, max_restarts=options.max_restarts
    )
    # The agent's own lines (worker groups, signals, "failed (exitcode: N)") are not for
    # users: main reports a failed worker in one line, or rank 0 already did. Its modules
    # set their loggers' levels themselves, so each one is quieted.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # A rank frozen by a signal would hold the end of a failed run for the agent's 30 s.
    # Each rank arms its parent-death signal before importing torch, against this pid.
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())
    with launcher_holds_locks(), wake_stopped_workers():  # the ranks do not lock again
        elastic_launch(config, sys.executable)(*guarded_command("mf.train.rank.worker"), *argv)


def print_summary(summary: dict[str, Any]) -> None:
    """Print what rank 0's ``train`` returned: losses, speed, sample and where files went."""
    print(f"final train loss       {summary['final_train_loss']:.4f}")
    if summary["final_validation_loss"] is not None:
        print(f"final validation loss  {summary['final_validation_loss']:.4f}")
    rate = f"{summary['tokens_per_s']:,.0f} tokens/s"
    print(f"training time          {summary['seconds']:.1f} s ({rate})")
    if summary.get("mfu") is not None:
        print(f"MFU                    {summary['mfu']:.3f} (mf.mfu: the GPU's dense peak)")
    print(f"checkpoint             {summary['checkpoint']}")
    print(f"model export           {summary['export']} (try: mf-sample {summary['out_dir']})")
    print(f"metrics                {summary['metrics']}")
    print(f"loss curve             {summary['loss_curve']}")
    if summary.get("sample"):
        print("sample (temperature 0.8):\n" + summary["sample"])


def _interrupted(options: TrainOptions, run_id: str | None) -> int:
    """Name the checkpoint this run saved last (never another run's); return exit code 130.

    When a newer checkpoint (another run's) shares the folder, say that --resume
    would continue from it instead.
    """
    from mf_fsdp import checkpoint as fsdp_checkpoint

    saved = last_saved_checkpoint(Path(options.out_dir), run_id)
    if saved is None:
        where = "this run saved no checkpoint"
    else:
        where = f"checkpoint {saved} (continue with --resume)"
        newest = fsdp_checkpoint.latest_checkpoint(saved.parent)
        if newest is not None and newest.resolve() != saved.resolve():
            where = f"checkpoint {saved}; --resume would continue from the newer {newest}"
    print(f"mf-train: interrupted; {where}", file=sys.stderr)
    return 130


def _worker_failed(error: ChildFailedError, options: TrainOptions) -> int:
    """Report failed workers, each cause in one line, unless rank 0 already did; return 1.

    See ``mf.train.run.failures``: the tracebacks and the agent's report go to logs.
    """
    if not any(failure.exitcode == STOPPED_EXIT_CODE for failure in error.failures.values()):
        for line in failure_lines(error, options.out_dir):
            user_error(line)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mf-train``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options = parse_options(argv)
        check_local_processes(options)
        check_data(options)
    except ValueError as error:
        user_error(error)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    run_id = new_run_id("mf-train")
    try:
        locks = acquire_run_locks(options, run_id)
    except RunLockError as error:
        user_error(error)
        return 2
    with locks:
        try:
            if options.resume:  # under the lock: no other run saves into the folder meanwhile
                verify_resume(options)
        except ValueError as error:
            user_error(error)
            return 2
        try:
            _launch(options, run_id, ["--nproc", str(options.nproc), *argv])
        except (SignalException, KeyboardInterrupt):
            return _interrupted(options, run_id)
        except ChildFailedError as error:
            return _worker_failed(error, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
