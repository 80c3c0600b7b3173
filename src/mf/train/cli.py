r"""``mf-train``: check the options, start the ranks with torch's elastic launcher, report.

User mistakes (bad sizes, a missing data file, a seq-len the corpus cannot
fill, --resume with nothing to resume) are found before any worker starts
and printed as one line with exit code 2. For several machines, run the
worker module under torchrun instead::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 -m mf.train.worker --nproc 16 --tp 2
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Sequence

from mf.train.data import TextData, load_corpus
from mf.train.options import TrainOptions, parse_options

__all__ = ["main"]


def _check_data(options: TrainOptions) -> None:
    text, _ = load_corpus(options.data)
    TextData.from_text(text, options.seq_len)


def _launch(options: TrainOptions) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mf.train.worker import train

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=options.nproc,
        run_id=f"mf-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    return elastic_launch(config, train)(options)[0]


def _print_summary(summary: dict) -> None:
    print(f"final train loss      {summary['final_train_loss']:.4f}")
    if summary["final_validation_loss"] is not None:
        print(f"final validation loss {summary['final_validation_loss']:.4f}")
    rate = f"{summary['tokens_per_s']:,.0f} tokens/s"
    print(f"time                  {summary['seconds']:.1f} s ({rate})")
    print(f"checkpoint            {summary['checkpoint']}")
    print(f"metrics               {summary['metrics']}")
    print(f"loss curve            {summary['loss_curve']}")
    if summary.get("sample"):
        print("sample:\n" + summary["sample"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mf-train``; returns the process exit code."""
    try:
        options = parse_options(argv)
        _check_data(options)
    except ValueError as error:
        print(f"mf-train: error: {error}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        summary = _launch(options)
    except SignalException:
        print("mf-train: interrupted; the last checkpoint is complete", file=sys.stderr)
        return 130
    except ChildFailedError as error:
        failure = next(iter(error.failures.values()))
        print(f"mf-train: error: a worker failed: {failure.message}", file=sys.stderr)
        return 1
    _print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
