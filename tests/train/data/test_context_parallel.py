"""``mf-train --cp``: each data-parallel rank's sequences split over its cp ranks.

``--micro-batch`` counts one data-parallel rank's sequences, which its cp
ranks share, so ``--nproc 2 --cp 2`` trains the batches of ``--nproc 1``
and ``--nproc 4 --cp 2`` those of ``--nproc 2``: the losses must agree to
rtol 2e-4 over 8 steps (fp32; only the order of sums differs, and AdamW
turns rounding into slightly different steps), and so must the validation
loss, which runs under CP too. A checkpoint saved at one cp size resumes at
another and continues as the run that never stopped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mf.train.rank.worker import train
from mf.train.run.options import parse_options
from tests._multiprocess import run_on_ranks

_TINY = ["--device", "cpu", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2"]
_TINY += ["--eval-every", "4", "--save-every", "0", "--sample-tokens", "0", "--no-plot"]
RTOL = 2e-4


def _rank_train(rank: int, world_size: int, argv: list[str]) -> None:
    train(parse_options(argv))


def _run(tmp: Path, name: str, nproc: int, steps: int, *extra: str) -> list[dict]:
    argv = [*_TINY, "--nproc", str(nproc), "--steps", str(steps), *extra]
    argv += ["--out-dir", str(tmp / name), "--ckpt-dir", str(tmp / f"{name}-ckpt")]
    run_on_ranks(_rank_train, nproc, argv, timeout=150)
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _assert_same_run(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for key in ("loss", "validation_loss"):
        mine = [r[key] for r in got if key in r]
        theirs = [r[key] for r in expected if key in r]
        assert mine == pytest.approx(theirs, rel=RTOL), key


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_cp2_trains_the_batches_of_one_process(tmp_path: Path) -> None:
    _assert_same_run(_run(tmp_path, "cp", 2, 8, "--cp", "2"), _run(tmp_path, "one", 1, 8))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dp2_cp2_trains_the_batches_of_dp2(tmp_path: Path) -> None:
    _assert_same_run(_run(tmp_path, "cp", 4, 8, "--cp", "2"), _run(tmp_path, "dp", 2, 8))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_checkpoints_resume_across_cp_sizes(tmp_path: Path) -> None:
    """3 steps saved at --cp 1 and at --cp 2, each resumed at the other size to step 6.

    Both continue as the one-process run resumed from its own checkpoint (the
    learning-rate schedule spans the 3-step run's steps, so that resumed run,
    not a 6-step run, is the reference).
    """

    def resumed(saved: str, nproc: int, *extra: str) -> list[dict]:
        name = f"{saved}-then-{nproc}"
        shutil.copytree(tmp_path / f"{saved}-ckpt", tmp_path / f"{name}-ckpt")
        shutil.copytree(tmp_path / saved, tmp_path / name)
        return _run(tmp_path, name, nproc, 6, *extra, "--resume")[3:]

    _run(tmp_path, "one", 1, 3)
    _run(tmp_path, "cp", 2, 3, "--cp", "2")
    reference = resumed("one", 1)
    assert [r["step"] for r in reference] == [4, 5, 6]
    _assert_same_run(resumed("cp", 1), reference)
    _assert_same_run(resumed("one", 2, "--cp", "2"), reference)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "2", "--cp", "3"], r"--cp 3 does not divide the 2 processes per tensor-"),
        (["--nproc", "4", "--tp", "2", "--cp", "4"], r"--cp 4 does not divide the 2 processes"),
        (["--nproc", "2", "--cp", "2", "--seq-len", "30"], r"--seq-len 30 does not split into 4"),
        (["--nproc", "2", "--cp", "2", "--model", "moe-tiny"], r"--cp 2 is for dense models"),
        (["--nproc", "2", "--cp", "0"], r"--cp must be at least 1, got 0"),
    ],
)
def test_bad_cp_options_are_refused_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(["--device", "cpu", "--model", "tiny", "--seq-len", "32", *argv])
