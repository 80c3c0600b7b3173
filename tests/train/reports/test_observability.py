"""``mf-train --tensorboard`` and ``--profile``: what they write, read back as their tools do.

A 4-step run of the ``tiny`` preset at world 2 writes each scalar for each step
(validation where it ran), read back with tensorboard's own ``EventAccumulator``;
the grad norm is the global one (a world-1 run over the same global batch gives it
to 1e-5); ``--profile 2:3`` writes one Chrome trace per rank that loads as JSON and
holds exactly those two optimizer steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mf.train.reports.tensorboard import SCALARS, TENSORBOARD_DIR
from mf.train.run.options import parse_options
from tests._multiprocess import run_on_ranks

STEPS = 4
_ARGV = ["--device", "cpu", "--model", "tiny", "--seq-len", "32", "--steps", str(STEPS)]
_ARGV += ["--eval-every", "2", "--save-every", "0", "--sample-tokens", "0", "--no-plot"]
_ARGV += ["--tensorboard", "--peak-tflops", "1", "--precision", "fp32"]


def _rank_train(rank: int, world: int, argv: list[str]) -> None:
    from mf.train.rank.worker import train

    train(parse_options(argv))


def _scalars(out_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / TENSORBOARD_DIR))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_tensorboard_scalars_and_profile_traces(tmp_path: Path) -> None:
    """Planted: the grad norm of this rank's local gradient shards alone fails it; a
    profiler stopped one step late fails the count of optimizer steps in the trace."""
    two = [*_ARGV, "--micro-batch", "2", "--profile", "2:3", "--out-dir", str(tmp_path / "a")]
    run_on_ranks(_rank_train, 2, [*two, "--ckpt-dir", str(tmp_path / "ca")], timeout=150)
    one = [*_ARGV, "--nproc", "1", "--micro-batch", "4", "--out-dir", str(tmp_path / "b")]
    run_on_ranks(_rank_train, 1, [*one, "--ckpt-dir", str(tmp_path / "cb")], timeout=150)

    scalars = _scalars(tmp_path / "a")
    wanted = {"loss", "validation_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_mib"}
    assert set(SCALARS) == wanted  # the seven: loss ... memory
    every_step = list(range(1, STEPS + 1))
    for key, tag in SCALARS.items():
        steps = [step for step, _ in scalars[tag]]
        assert steps == ([2, 4] if key == "validation_loss" else every_step), tag
    metrics = [
        json.loads(line)
        for line in (tmp_path / "a" / "metrics.jsonl").read_text().split("\n")
        if line
    ]
    assert [v for _, v in scalars["loss/train"]] == pytest.approx([r["loss"] for r in metrics])
    assert all(v > 0 for _, v in scalars["perf/mfu"] + scalars["optim/grad_norm"])
    reference = _scalars(tmp_path / "b")
    for tag in ("optim/grad_norm", "loss/train", "optim/lr"):
        assert [v for _, v in scalars[tag]] == pytest.approx(
            [v for _, v in reference[tag]], rel=1e-5
        ), tag

    for rank in (0, 1):
        trace = json.loads((tmp_path / "a" / "profile" / f"rank{rank}.json").read_text())
        names = [event.get("name", "") for event in trace["traceEvents"]]
        assert sum(name.startswith("Optimizer.step#AdamW") for name in names) == 2, rank
    assert not (tmp_path / "b" / "profile").exists()
