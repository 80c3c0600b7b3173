r"""``mf-train``: check the options, then start the ranks with torch's elastic launcher.

User mistakes (bad sizes or numbers, an unknown preset, a missing or empty
data file, a seq-len the corpus cannot fill, --resume with nothing to
resume) are found here, before any worker starts, and printed as one line
with exit code 2. Ctrl-C reaches every rank: each finishes its step, saves a
checkpoint and exits; the launcher then names the checkpoint (exit code 130).

For several machines, run the worker module under torchrun on each node
(``--nproc`` is then torchrun's world size)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 -m mf.train.worker --tp 2
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mf.train.data import TextData, load_corpus
from mf.train.options import TrainOptions, parse_options

__all__ = ["check_data", "main", "print_summary", "user_error"]


def user_error(error: Exception) -> None:
    """Print a user's mistake as the one line ``mf-train: error: ...`` on stderr."""
    print(f"mf-train: error: {error}", file=sys.stderr, flush=True)


def check_data(options: TrainOptions) -> None:
    """Raise a one-line ValueError if the corpus is missing, empty or too short for --seq-len."""
    text, _ = load_corpus(options.data)
    TextData.from_text(text, options.seq_len)


def _check_local_gpus(options: TrainOptions) -> None:
    if options.use_cuda and torch.cuda.device_count() < options.nproc:
        raise ValueError(
            f"--nproc {options.nproc}: one process per GPU, and this machine has "
            f"{torch.cuda.device_count()}"
        )


def _launch(options: TrainOptions, argv: Sequence[str]) -> None:
    """Run ``python -m mf.train.worker <argv>`` on ``--nproc`` local processes.

    The ranks are commands, as under torchrun, not functions: rank 0 prints
    the summary itself, and a rank that saved its checkpoint after Ctrl-C
    exits at once instead of waiting for the interrupted launcher to collect
    a return value.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=options.nproc,
        run_id=f"mf-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
    )
    # The agent's own INFO/WARNING lines (worker groups, signals) are not for users; its
    # modules set their loggers' levels themselves, so each one is quieted.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    elastic_launch(config, sys.executable)("-u", "-m", "mf.train.worker", *argv)


def print_summary(summary: dict[str, Any]) -> None:
    """Print what rank 0's ``train`` returned: losses, speed, sample and where files went."""
    print(f"final train loss       {summary['final_train_loss']:.4f}")
    if summary["final_validation_loss"] is not None:
        print(f"final validation loss  {summary['final_validation_loss']:.4f}")
    rate = f"{summary['tokens_per_s']:,.0f} tokens/s"
    print(f"training time          {summary['seconds']:.1f} s ({rate})")
    print(f"checkpoint             {summary['checkpoint']}")
    print(f"metrics                {summary['metrics']}")
    print(f"loss curve             {summary['loss_curve']}")
    if summary.get("sample"):
        print("sample (temperature 0.8):\n" + summary["sample"])


def _interrupted(options: TrainOptions) -> int:
    from mf_fsdp import latest_checkpoint

    path = latest_checkpoint(Path(options.ckpt_dir))
    where = f"checkpoint {path} (continue with --resume)" if path else "no checkpoint saved"
    print(f"mf-train: interrupted; {where}", file=sys.stderr)
    return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mf-train``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options = parse_options(argv)
        _check_local_gpus(options)
        check_data(options)
    except ValueError as error:
        user_error(error)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        _launch(options, ["--nproc", str(options.nproc), *argv])
    except (SignalException, KeyboardInterrupt):
        return _interrupted(options)
    except ChildFailedError as error:
        failure = next(iter(error.failures.values()))
        user_error(f"a worker failed: {failure.message}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
