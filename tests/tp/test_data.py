"""broadcast_data: zero-size and zero-dim tensors, the group passed in, dtype errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mf_tp
from tests._multiprocess import run_on_ranks

KEYS = ["tokens", "empty_rows", "empty_middle", "scalar"]


def _batch(value: int) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.arange(6).view(2, 3) + value,
        "empty_rows": torch.zeros(0, 3, dtype=torch.long),
        "empty_middle": torch.zeros(2, 0, 4, dtype=torch.long),
        "scalar": torch.tensor(value),
    }


def _check_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == KEYS
    for key in KEYS:
        assert got[key].shape == expected[key].shape, key
        assert torch.equal(got[key], expected[key]), key


def _rank_broadcast(rank: int, world: int) -> None:
    # Over the whole world: rank 0's batch reaches everyone; others pass None.
    got = mf_tp.broadcast_data(KEYS, _batch(0) if rank == 0 else None, torch.long, dist.group.WORLD)
    _check_equal(got, _batch(0))
    # One group per rank: each keeps its own batch (the group is honoured, not the world).
    singles = [dist.new_group([r]) for r in range(world)]
    _check_equal(mf_tp.broadcast_data(KEYS, _batch(rank), torch.long, singles[rank]), _batch(rank))
    with pytest.raises(ValueError, match=r"data\['tokens'\] must be a tensor of dtype torch.int32"):
        mf_tp.broadcast_data(KEYS, _batch(rank), torch.int32, singles[rank])
    with pytest.raises(ValueError, match="key 'missing' is missing"):
        mf_tp.broadcast_data(["missing"], _batch(rank), torch.long, singles[rank])
    assert mf_tp.broadcast_data([], None, torch.long, singles[rank]) == {}
    # The default TP group after initialize_model_parallel.
    mf_tp.initialize_model_parallel(world)
    try:
        got = mf_tp.broadcast_data(KEYS, _batch(7) if rank == 0 else None, torch.long)
        _check_equal(got, _batch(7))
    finally:
        mf_tp.destroy_model_parallel()


@pytest.mark.multiprocess
def test_broadcast_data() -> None:
    run_on_ranks(_rank_broadcast, 2)
