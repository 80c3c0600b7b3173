"""Tests of the multi-rank harness itself: results, fast failure, and timeouts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._multiprocess import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _rank_allreduce(rank: int, world_size: int, base: float) -> None:
    value = torch.tensor([base + rank])
    dist.all_reduce(value)
    expected = base * world_size + sum(range(world_size))
    assert value.item() == expected, (value.item(), expected)


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded on purpose")
    dist.barrier()  # the healthy rank waits here for a peer that never comes


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_collective_result(world_size: int) -> None:
    run_on_ranks(_rank_allreduce, world_size, 10.0)


def test_raising_rank_fails_fast_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank one exploded on purpose") as info:
        run_on_ranks(_rank_one_raises, 2, timeout=60.0)
    assert "--- rank 1 ---" in str(info.value)
    assert "ValueError" in str(info.value)
    assert time.monotonic() - start < 15.0  # well under the 60 s deadline


def test_hanging_rank_fails_at_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 3\.0s \(ranks \[0, 1\]|timed out"):
        run_on_ranks(_rank_one_hangs, 2, timeout=3.0)
    assert time.monotonic() - start < 20.0


def test_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_on_ranks(_rank_allreduce, 0, 1.0)


def _rank_gloo_setup_fails_once(rank: int, world_size: int, marker: str) -> None:
    if not os.path.exists(marker):
        dist.barrier()  # both ranks see the first attempt before the marker exists
        if rank == 0:
            open(marker, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer")
    dist.barrier()


def _rank_gloo_setup_always_fails(rank: int, world_size: int) -> None:
    raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer")


def test_a_run_lost_in_gloo_setup_is_made_once_more(tmp_path) -> None:
    run_on_ranks(_rank_gloo_setup_fails_once, 2, str(tmp_path / "first-attempt"))


def test_a_run_lost_in_gloo_setup_twice_fails() -> None:
    with pytest.raises(AssertionError, match="connectFullMesh failed"):
        run_on_ranks(_rank_gloo_setup_always_fails, 2, timeout=60.0)
