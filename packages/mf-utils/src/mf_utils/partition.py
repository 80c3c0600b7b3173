"""Exact division and the 1-D equal-chunk split/gather pair.

Unlike the reference, nothing here rounds down silently: a size that does
not divide is an error naming both numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["divide", "gather_split_1d_tensor", "split_tensor_into_1d_equal_chunks"]


def divide(numerator: int, denominator: int) -> int:
    """Return ``numerator // denominator``, which must be exact.

    Raises:
        TypeError: if either argument is not an int.
        ValueError: if ``denominator`` is not positive or does not divide ``numerator``.
    """
    for argument, value in (("numerator", numerator), ("denominator", denominator)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"divide: {argument} must be an int, got {value!r}")
    if denominator <= 0:
        raise ValueError(f"divide: denominator must be positive, got {denominator}")
    if numerator % denominator != 0:
        raise ValueError(f"divide: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Return this rank's equal 1-D chunk of ``tensor`` flattened over ``group``.

    Args:
        tensor: any contiguous tensor whose numel divides by the group size.
        new_buffer: copy the chunk into fresh memory instead of returning a view.
        group: the group to split over; the default group when ``None``.

    Raises:
        ValueError: if ``tensor.numel()`` is not divisible by the group size.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"split_tensor_into_1d_equal_chunks: expected a tensor, got {tensor!r}")
    rank, world_size = _group_rank_and_size(group)
    if tensor.numel() % world_size != 0:
        raise ValueError(
            f"split_tensor_into_1d_equal_chunks: tensor.numel()={tensor.numel()} is not "
            f"divisible by the group size {world_size}"
        )
    chunk = tensor.numel() // world_size
    view = tensor.reshape(-1)[rank * chunk : (rank + 1) * chunk]
    return view.clone() if new_buffer else view


def gather_split_1d_tensor(
    tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather equal 1-D chunks from every rank of ``group`` into one flat tensor.

    The inverse of :func:`split_tensor_into_1d_equal_chunks`.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"gather_split_1d_tensor: expected a tensor, got {tensor!r}")
    _, world_size = _group_rank_and_size(group)
    gathered = torch.empty(tensor.numel() * world_size, dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(gathered, tensor.contiguous().reshape(-1), group=group)
    return gathered
