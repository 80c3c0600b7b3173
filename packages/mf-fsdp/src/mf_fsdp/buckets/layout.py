"""Pure layout math: where each tensor sits in a flat bucket and which whole rows each rank owns.

A bucket packs tensors one after another (each starting at a multiple of
``alignment`` elements where it can) and is cut into ``W`` equal shards of
``S`` elements, rank ``r`` owning ``[r*S, (r+1)*S)``::

    bucket  |--p0--|pad|----------p1----------|gap|-----p2-----|  tail pad  |
    shards  |    rank 0     |    rank 1    |    rank 2    |    rank 3     |
                                  ^ p1's rows end exactly on a boundary

[Note: row-aligned shards]
Every shard boundary that falls inside a tensor falls between two of its dim-0
rows, so each rank's piece of each tensor is a whole number of rows (possibly
zero) and can be viewed with the tensor's own trailing shape: that is what
lets the optimizer see parameter-shaped pieces. Tensors stay contiguous in the
bucket, so the gathered bucket still holds every parameter as a plain view.
Two facts follow, and they are all the padding this costs:

- a tensor that crosses one boundary may have to start up to one row later;
- a tensor that crosses two or more boundaries needs ``S`` to be a multiple of
  its row size (two boundaries ``S`` apart both fall between its rows).

So ``S`` is the smallest size, from ``ceil(numel / W)`` upward, that is a
multiple of the row sizes of the tensors longer than ``S`` and for which the
packing with those shifts fits in ``W * S``. That never costs more than the
reference's rule (pad every bucket to ``W x`` the LCM of *all* its row
sizes), and usually much less. Where the LCM of the long tensors' row sizes
is itself what costs (Llama's 4096 and 14336 at 1024 ranks),
:func:`partition_bucket` splits the tensors into buckets of compatible row
sizes, but only when that saves more padding than an extra collective costs
(``SPLIT_COST_ELEMENTS``).

This module only computes numbers (no process groups, no tensors), so a scale
simulation can call it for any world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_ALIGNMENT",
    "SPLIT_COST_ELEMENTS",
    "BucketLayout",
    "chunk_layout",
    "compute_bucket_layout",
    "partition_bucket",
    "row_numel",
]

DEFAULT_ALIGNMENT = 16
"""Default per-tensor start alignment in elements (64 bytes of fp32)."""

SPLIT_COST_ELEMENTS = 1 << 18
"""Padding (elements over the whole bucket) one extra bucket must save to be worth its collective.

One more all-gather / reduce-scatter per unit costs a collective's latency,
about what moving a few hundred thousand elements costs on a fast
interconnect; splitting a unit's bucket pays off only above that.
"""


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one dim-0 row of a tensor of ``shape`` (1 for a 0-d or 1-d tensor)."""
    if len(shape) <= 1:
        return 1
    return max(math.prod(shape[1:]), 1)


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """Where each tensor of one bucket lives and which rows each rank owns.

    Attributes:
        shapes: the tensors' shapes, in bucket order.
        world_size: number of shards (the shard-group size).
        alignment: preferred start alignment of a tensor, in elements.
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

        The range is relative to the tensor (0 = its first element), covers whole
        rows, and may be empty (``begin == end``); empty pieces sit at the closest
        row so that the pieces of all ranks stay ordered and tile the tensor.
        """
        self._check_rank(rank)
        start, numel = self.starts[index], self.numels[index]
        lo, hi = self.shard_range(rank)
        begin = min(max(lo - start, 0), numel)
        end = min(max(hi - start, 0), numel)
        return begin, end

    def local_rows(self, index: int, rank: int) -> tuple[int, int]:
        """The dim-0 rows ``[begin, end)`` of tensor ``index`` owned by ``rank`` (may be empty)."""
        begin, end = self.local_piece(index, rank)
        row = row_numel(self.shapes[index])
        return begin // row, end // row

    def rank_numel(self, rank: int) -> int:
        """Elements of real data (padding excluded) that ``rank`` owns."""
        return sum(e - b for b, e in (self.local_piece(i, rank) for i in range(len(self.shapes))))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")


def _normalize(shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    norm: list[tuple[int, ...]] = []
    for shape in shapes:
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shapes: negative dimension in {tuple(shape)!r}")
        norm.append(dims)
    return norm


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pack(
    shapes: list[tuple[int, ...]], shard: int, alignment: int
) -> tuple[list[int], int] | None:
    """Starts of every tensor for shard size ``shard``, and the packed end; None if impossible.

    Tensors go one after another; one that crosses a boundary starts where a row
    ends exactly on it, and the gap that leaves is offered to later tensors that
    fit in it whole (first fit). Impossible means a tensor would cross two
    boundaries while ``shard`` is not a multiple of its row size.
    """
    starts: list[int] = []
    gaps: list[list[int]] = []  # [begin, end) left free before a shifted tensor, in one shard
    cursor = 0
    for shape in shapes:
        numel, row = math.prod(shape), row_numel(shape)
        start = _fit_in_gap(gaps, numel, alignment) if numel else None
        if start is None:
            start = _round_up(cursor, alignment)
            while numel:
                boundary = (start // shard + 1) * shard
                if start + numel <= boundary:
                    break
                gap = (boundary - start) % row
                if gap == 0:
                    if start + numel > boundary + shard and shard % row:
                        return None
                    break
                gaps.append([start, start + gap])
                start += gap  # start so that a row ends exactly on the boundary
            cursor = start + numel
        starts.append(start)
    return starts, cursor


def _fit_in_gap(gaps: list[list[int]], numel: int, alignment: int) -> int | None:
    """Take room for ``numel`` elements from the first gap that holds them whole, or None."""
    for gap in gaps:
        start = _round_up(gap[0], alignment)
        if start + numel <= gap[1]:
            gap[0] = start + numel
            return start
    return None


def _long_rows_lcm(shapes: list[tuple[int, ...]], shard: int) -> int:
    """LCM of the row sizes of the tensors longer than ``shard`` (1 if there are none)."""
    multiple = 1
    for shape in shapes:
        if math.prod(shape) > shard:
            multiple = math.lcm(multiple, row_numel(shape))
    return multiple


def compute_bucket_layout(
    shapes: Sequence[Sequence[int]], world_size: int, alignment: int = DEFAULT_ALIGNMENT
) -> BucketLayout:
    """Lay tensors of the given shapes into one flat bucket with row-aligned shards.

    See [Note: row-aligned shards]. Tensors keep their order.

    Args:
        shapes: tensor shapes in bucket order (zero-size tensors allowed).
        world_size: number of shards, >= 1.
        alignment: preferred start alignment of every tensor in elements, >= 1
            (a tensor crossing a boundary starts where its rows meet the boundary,
            which is aligned whenever its row size is a multiple of ``alignment``).

    Returns:
        The layout with the smallest shard size this packing allows.

    Raises:
        ValueError: on a non-positive ``world_size`` or ``alignment`` or a negative dim.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    norm = _normalize(shapes)
    if sum(math.prod(shape) for shape in norm) == 0:
        return BucketLayout(tuple(norm), world_size, alignment, (0,) * len(norm), 0)
    # Model order first; widest rows first as well (it packs tighter when a small
    # tensor would otherwise push a long one off its row boundary); the smaller wins.
    orders = [list(range(len(norm))), sorted(range(len(norm)), key=lambda i: -row_numel(norm[i]))]
    best: tuple[int, list[int]] | None = None
    for order in orders:
        shard, starts = _smallest_shard([norm[i] for i in order], world_size, alignment)
        if best is None or shard < best[0]:
            best = (shard, [0] * len(norm))
            for position, index in enumerate(order):
                best[1][index] = starts[position]
    assert best is not None  # internal invariant: orders is not empty
    return BucketLayout(tuple(norm), world_size, alignment, tuple(best[1]), best[0])


def _smallest_shard(
    shapes: list[tuple[int, ...]], world_size: int, alignment: int
) -> tuple[int, list[int]]:
    """The smallest row-aligned shard size for tensors packed in this order, and their starts."""
    shard = -(-sum(math.prod(shape) for shape in shapes) // world_size)
    while True:
        multiple = _long_rows_lcm(shapes, shard)
        if shard % multiple:
            # The long tensors' rows fit in whole shards only at a multiple of their sizes.
            shard = _round_up(shard, multiple)
            continue
        packed = _pack(shapes, shard, alignment)
        if packed is not None and packed[1] <= world_size * shard:
            return shard, packed[0]
        shard += multiple


def chunk_layout(shape: Sequence[int], world_size: int) -> BucketLayout:
    """One tensor cut as ``torch.chunk`` cuts dim 0, every piece padded to the first one's rows.

    Rank ``r`` owns rows ``[r * c, min((r + 1) * c, rows))`` with ``c = ceil(rows /
    world_size)`` (none past the end): the pieces FSDP2 gives a parameter, which a
    tensor subclass's all-gather extension expects (see ``buckets/extension.py``).

    Raises:
        ValueError: on a non-positive ``world_size``, a 0-d shape or a negative dim.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    (norm,) = _normalize([shape])
    if not norm:
        raise ValueError("shape: a 0-d tensor has no rows to cut; expected at least one dim")
    rows = -(-norm[0] // world_size)
    return BucketLayout((norm,), world_size, 1, (0,), rows * row_numel(norm))


def partition_bucket(
    shapes: Sequence[Sequence[int]], world_size: int, alignment: int = DEFAULT_ALIGNMENT
) -> list[tuple[tuple[int, ...], BucketLayout]]:
    """Split one unit's tensors into buckets of compatible row sizes where padding demands it.

    A split costs ``SPLIT_COST_ELEMENTS`` per extra bucket (the collective it adds)
    and pays back the padding it saves. Candidates: everything in one bucket, and
    the groups of equal row size merged greedily (cheapest merge first) while a
    merge costs less than that price; the cheaper one wins. Most models end with
    one bucket; a bucket whose long tensors have row sizes with a large LCM
    (Llama's MLP at hundreds of ranks) ends as a few.

    Args:
        shapes: tensor shapes in model order.
        world_size: number of shards.
        alignment: per-tensor start alignment.

    Returns:
        ``(tensor indices, layout)`` per bucket, each in model order, buckets ordered
        by their first tensor.
    """
    norm = _normalize(shapes)
    layouts: dict[tuple[int, ...], BucketLayout] = {}

    def layout_of(indices: tuple[int, ...]) -> BucketLayout:
        if indices not in layouts:
            layouts[indices] = compute_bucket_layout(
                [norm[i] for i in indices], world_size, alignment
            )
        return layouts[indices]

    def cost(groups: list[tuple[int, ...]]) -> int:
        padded = sum(layout_of(group).padded_numel for group in groups)
        return padded + SPLIT_COST_ELEMENTS * (len(groups) - 1)

    by_row: dict[int, list[int]] = {}
    for index, shape in enumerate(norm):
        by_row.setdefault(row_numel(shape), []).append(index)
    groups = [tuple(indices) for indices in by_row.values()]
    while len(groups) > 1:
        merges = [
            (cost([tuple(sorted(groups[a] + groups[b]))]) - cost([groups[a], groups[b]]), a, b)
            for a in range(len(groups))
            for b in range(a + 1, len(groups))
        ]
        extra, a, b = min(merges)
        if extra > 0:
            break
        merged = tuple(sorted(groups[a] + groups[b]))
        groups = [g for i, g in enumerate(groups) if i not in (a, b)] + [merged]
    single = [tuple(range(len(norm)))] if norm else []
    if not groups or cost(single) <= cost(groups):
        groups = single
    groups.sort(key=lambda group: group[0])
    return [(group, layout_of(group)) for group in groups]
