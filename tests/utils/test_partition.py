from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from mf_utils import divide, gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from tests._multiprocess import run_on_ranks


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_divide_exact(quotient: int, denominator: int) -> None:
    assert divide(quotient * denominator, denominator) == quotient


@pytest.mark.parametrize(
    ("numerator", "denominator", "error", "match"),
    [
        (10, 3, ValueError, "10 is not divisible by 3"),
        (10, 0, ValueError, "denominator must be positive, got 0"),
        (10.0, 2, TypeError, "numerator must be an int, got 10.0"),
        (10, "2", TypeError, "denominator must be an int"),
    ],
)
def test_divide_bad_input(numerator, denominator, error, match) -> None:
    with pytest.raises(error, match=match):
        divide(numerator, denominator)


def test_split_needs_initialized_distributed() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        split_tensor_into_1d_equal_chunks(torch.zeros(4))


def _rank_split_gather(rank: int, world_size: int) -> None:
    full = torch.arange(world_size * 6, dtype=torch.float32).reshape(world_size * 2, 3)
    chunk = split_tensor_into_1d_equal_chunks(full)
    assert torch.equal(chunk, full.reshape(-1)[rank * 6 : (rank + 1) * 6])
    assert chunk.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    copy = split_tensor_into_1d_equal_chunks(full, new_buffer=True)
    assert copy.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    assert torch.equal(gather_split_1d_tensor(chunk), full.reshape(-1))

    # An explicit subgroup: every rank is its own group of one.
    groups = [dist.new_group([r]) for r in range(world_size)]
    mine = groups[rank]
    assert torch.equal(split_tensor_into_1d_equal_chunks(full, group=mine), full.reshape(-1))
    assert torch.equal(gather_split_1d_tensor(full, group=mine), full.reshape(-1))

    with pytest.raises(ValueError, match=f"not divisible by the group size {world_size}"):
        split_tensor_into_1d_equal_chunks(torch.zeros(world_size * 2 + 1))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_split_gather_roundtrip(world_size: int) -> None:
    run_on_ranks(_rank_split_gather, world_size)
