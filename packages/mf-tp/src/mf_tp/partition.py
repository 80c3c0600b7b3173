"""Pure tensor/range helpers of tensor parallelism: last-dim splits and vocab ranges.

Responsibility: math that needs no collective (``split_tensor_along_last_dim``,
:class:`VocabUtility`) plus the TP-defaulting 1-D chunk split/gather pair over
mf_utils. It must not hold state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mf_tp.parallel_state import resolve_tp_group
from mf_utils import divide
from mf_utils import gather_split_1d_tensor as _gather_split_1d
from mf_utils import split_tensor_into_1d_equal_chunks as _split_1d

__all__ = [
    "VocabUtility",
    "gather_split_1d_tensor",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> list[torch.Tensor]:
    """Split ``tensor`` into ``num_partitions`` equal pieces of its last dim.

    Returns views unless ``contiguous_split_chunks``.

    Raises:
        ValueError: if the last dim is not divisible by ``num_partitions``.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError(
            f"split_tensor_along_last_dim: tensor must have at least one dim, got {tensor!r}"
        )
    size = divide(tensor.shape[-1], num_partitions)
    chunks = torch.split(tensor, size, dim=-1)
    if contiguous_split_chunks:
        return [chunk.contiguous() for chunk in chunks]
    return list(chunks)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's equal 1-D chunk of ``tensor`` over ``tp_group`` (default: the TP group)."""
    return _split_1d(tensor, new_buffer, group=resolve_tp_group(tp_group))


def gather_split_1d_tensor(
    tensor: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks` over ``tp_group``."""
    return _gather_split_1d(tensor, group=resolve_tp_group(tp_group))


class VocabUtility:
    """The ``[first, last)`` vocab range a rank owns when the vocab is split in equal blocks."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> Sequence[int]:
        """Range of ``rank`` given each rank's ``per_partition_vocab_size``.

        Raises:
            ValueError: if ``rank`` is not in ``[0, world_size)`` or a size is negative.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"VocabUtility: rank must be in [0, {world_size}), got rank={rank!r}")
        if per_partition_vocab_size < 0:
            raise ValueError(
                "VocabUtility: per_partition_vocab_size must be >= 0, "
                f"got {per_partition_vocab_size!r}"
            )
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> Sequence[int]:
        """Range of ``rank`` for a ``global_vocab_size`` divisible by ``world_size``.

        Raises:
            ValueError: if ``global_vocab_size`` is not divisible by ``world_size``.
        """
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )
