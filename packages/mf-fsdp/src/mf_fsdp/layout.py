"""Pure layout math: where each tensor sits in a flat bucket and which ranks own what.

A bucket packs tensors one after another, each starting at a multiple of
``alignment`` elements (not one LCM of row sizes for the whole bucket, which
can cost tens of percent of padding). The bucket is then padded to a multiple
of the shard-group size ``W`` and cut into ``W`` equal shards::

    bucket  |--p0--|pad|-------p1-------|pad|--p2--|  tail pad  |
    shards  |   rank 0    |    rank 1     |   rank 2   |  rank 3  |

so a rank's piece of a tensor is an arbitrary contiguous range of the
tensor's flattened elements, possibly empty. This module only computes
numbers (no process groups, no tensors), so a scale simulation can call it
for any world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_ALIGNMENT", "BucketLayout", "compute_bucket_layout"]

DEFAULT_ALIGNMENT = 16
"""Default per-tensor start alignment in elements (64 bytes of fp32)."""


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """Where each tensor of one bucket lives and what each rank owns.

    Attributes:
        shapes: the tensors' shapes, in bucket order.
        world_size: number of shards (the shard-group size).
        alignment: per-tensor start alignment in elements.
        starts: each tensor's first element in the bucket.
        shard_size: elements per rank (``S``); rank ``r`` owns ``[r*S, (r+1)*S)``.
    """

    shapes: tuple[tuple[int, ...], ...]
    world_size: int
    alignment: int
    starts: tuple[int, ...]
    shard_size: int

    @property
    def numels(self) -> tuple[int, ...]:
        """Element count of each tensor."""
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def numel(self) -> int:
        """Elements of real data (sum over tensors)."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        """Size of the whole bucket, padding included (``world_size * shard_size``)."""
        return self.shard_size * self.world_size

    @property
    def padding_fraction(self) -> float:
        """Share of the bucket that is padding, in [0, 1)."""
        return 0.0 if self.padded_numel == 0 else 1.0 - self.numel / self.padded_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Bucket range ``[begin, end)`` owned by ``rank``."""
        self._check_rank(rank)
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def local_piece(self, index: int, rank: int) -> tuple[int, int]:
        """The range ``[begin, end)`` of tensor ``index``'s flat elements owned by ``rank``.

        The range is relative to the tensor (0 = its first element) and may be empty
        (``begin == end``); empty pieces are placed at the closest valid offset so
        that the pieces of all ranks stay ordered and tile the tensor.
        """
        self._check_rank(rank)
        start, numel = self.starts[index], self.numels[index]
        lo, hi = self.shard_range(rank)
        begin = min(max(lo - start, 0), numel)
        end = min(max(hi - start, 0), numel)
        return begin, end

    def rank_numel(self, rank: int) -> int:
        """Elements of real data (padding excluded) that ``rank`` owns."""
        return sum(e - b for b, e in (self.local_piece(i, rank) for i in range(len(self.shapes))))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")


def compute_bucket_layout(
    shapes: Sequence[Sequence[int]], world_size: int, alignment: int = DEFAULT_ALIGNMENT
) -> BucketLayout:
    """Lay tensors of the given shapes into one flat bucket sharded over ``world_size`` ranks.

    Args:
        shapes: tensor shapes in bucket order (zero-size tensors allowed).
        world_size: number of shards, >= 1.
        alignment: start alignment of every tensor in elements, >= 1.

    Returns:
        The layout; its padding is below ``alignment`` elements per tensor plus
        fewer than ``world_size * alignment`` elements at the tail.

    Raises:
        ValueError: on a non-positive ``world_size`` or ``alignment`` or a negative dim.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    norm: list[tuple[int, ...]] = []
    for shape in shapes:
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shapes: negative dimension in {tuple(shape)!r}")
        norm.append(dims)
    starts: list[int] = []
    cursor = 0
    for dims in norm:
        starts.append(cursor)
        cursor += _round_up(math.prod(dims), alignment)
    # Shards are whole multiples of the alignment too, so every shard starts aligned.
    shard_size = _round_up(-(-cursor // world_size), alignment) if cursor else 0
    return BucketLayout(tuple(norm), world_size, alignment, tuple(starts), shard_size)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
