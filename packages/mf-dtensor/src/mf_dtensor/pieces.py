"""Piece maps: which boxes of a global tensor each rank holds, and the pure math on them.

A *box* is a ``ChunkStorageMetadata`` (global offsets and sizes). A
:class:`PieceMap` gives, for each rank of a device mesh (row-major index),
the boxes whose rows that rank's local tensor stacks along dim 0. This
module holds the protocol, an explicit implementation, and the local
checks and cuts an :class:`~mf_dtensor.uneven_tensor.UnevenDTensor` needs.

It never touches a process group: everything here can be tested in one
process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor.layout import check_chunk_fits, describe_chunk, make_chunk

__all__ = [
    "ExplicitPieces",
    "PieceMap",
    "box_slices",
    "boxes_numel",
    "check_local_boxes",
    "cut_boxes",
    "normalize_placements",
    "place_boxes",
    "same_pieces",
    "take_boxes",
]


@runtime_checkable
class PieceMap(Protocol):
    """Which boxes of the global tensor each rank of a device mesh holds.

    Implementations must be immutable and may compute boxes lazily; equal
    maps must compare equal (``==``), since ops mixing UnevenDTensors
    require their maps to be the same object or equal.
    """

    def boxes(self, mesh_index: int) -> Sequence[ChunkStorageMetadata]:
        """The boxes of the rank at row-major position ``mesh_index`` of the mesh.

        The rank's local tensor is its boxes of the global tensor stacked
        along dim 0 in this order; all its boxes have the same sizes in every
        dim but 0. An empty sequence (or only boxes with 0 rows) means an
        empty local piece.
        """
        ...


@dataclass(frozen=True, slots=True)
class ExplicitPieces:
    """A :class:`PieceMap` given as one list of boxes per rank (row-major mesh order).

    Attributes:
        boxes_per_rank: for each rank of the mesh, its boxes; stored as
            tuples of fresh ``ChunkStorageMetadata`` with ``torch.Size`` fields.

    Raises:
        ValueError: if a box has offsets and sizes of different lengths,
            negative entries, or a rank's boxes differ in ndim or in their
            sizes beyond dim 0.
    """

    boxes_per_rank: tuple[tuple[ChunkStorageMetadata, ...], ...]

    def __post_init__(self) -> None:
        normalized = []
        for rank, boxes in enumerate(self.boxes_per_rank):
            rank_boxes = tuple(make_chunk(box.offsets, box.sizes) for box in boxes)
            for box in rank_boxes:
                if (
                    len(box.offsets) != len(box.sizes)
                    or min((*box.offsets, *box.sizes), default=0) < 0
                ):
                    raise ValueError(
                        f"boxes_per_rank[{rank}]: expected offsets and sizes of one length with "
                        f"no negative entries, got {describe_chunk(box)}"
                    )
                if (len(box.sizes), box.sizes[1:]) != (
                    len(rank_boxes[0].sizes),
                    rank_boxes[0].sizes[1:],
                ):
                    raise ValueError(
                        f"boxes_per_rank[{rank}]: boxes are stacked along dim 0, so they must "
                        f"agree in every other dim; got {describe_chunk(rank_boxes[0])} and "
                        f"{describe_chunk(box)}"
                    )
            normalized.append(rank_boxes)
        object.__setattr__(self, "boxes_per_rank", tuple(normalized))

    def boxes(self, mesh_index: int) -> Sequence[ChunkStorageMetadata]:
        """The boxes of the rank at row-major position ``mesh_index``.

        Raises:
            ValueError: if ``mesh_index`` is not a rank of this map.
        """
        if not 0 <= mesh_index < len(self.boxes_per_rank):
            raise ValueError(
                f"mesh_index: expected 0 <= mesh_index < {len(self.boxes_per_rank)}, "
                f"got {mesh_index!r}"
            )
        return self.boxes_per_rank[mesh_index]


def box_slices(box: ChunkStorageMetadata) -> tuple[slice, ...]:
    """The index of ``box`` into the global tensor (``full[box_slices(box)]``)."""
    return tuple(
        slice(offset, offset + size) for offset, size in zip(box.offsets, box.sizes, strict=True)
    )


def normalize_placements(
    placements: Sequence[Placement], ndim: int, mesh_ndim: int
) -> tuple[Placement, ...]:
    """``placements`` with negative shard dims made positive; only Shard/Replicate accepted."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"placements: expected one placement per mesh dim ({mesh_ndim}), got "
            f"{len(placements)}: {placements!r}"
        )
    result: list[Placement] = []
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard:
            dim = placement.dim + ndim if placement.dim < 0 else placement.dim
            if not 0 <= dim < ndim:
                raise ValueError(
                    f"placements[{mesh_dim}]: {placement!r} shards a dim the {ndim}-D tensor "
                    "does not have"
                )
            result.append(Shard(dim))
        elif isinstance(placement, Replicate):
            result.append(placement)
        else:
            # Partial has no boxes at all; a strided shard interleaves pieces,
            # which the boxes express themselves (several boxes per rank).
            raise ValueError(
                f"placements[{mesh_dim}]: expected Shard(dim) or Replicate(), got {placement!r}; "
                "Partial has no pieces and strided layouts are described by the PieceMap's "
                "boxes instead"
            )
    return tuple(result)


def check_local_boxes(
    boxes: Sequence[ChunkStorageMetadata],
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    local_shape: Sequence[int],
) -> None:
    """Check what one rank can check alone about its ``boxes`` (no communication).

    Every box lies inside ``global_shape``; all boxes share their sizes
    beyond dim 0; dims that no placement shards are held whole; and
    ``local_shape`` is the boxes stacked along dim 0 (0 rows when there are
    no boxes).

    Args:
        boxes: this rank's boxes, from its PieceMap.
        global_shape: shape of the whole tensor.
        placements: normalised ``Shard``/``Replicate`` placements.
        local_shape: shape of the local tensor.

    Raises:
        ValueError: naming the box or the local shape and what was expected.
    """
    shape = tuple(global_shape)
    local = tuple(local_shape)
    ndim = len(shape)
    sharded = {p.dim for p in placements if isinstance(p, Shard)}
    for box in boxes:
        check_chunk_fits(box, shape, "pieces: a box of this rank")
        for dim, (offset, size) in enumerate(zip(box.offsets, box.sizes, strict=True)):
            if dim > 0 and dim not in sharded and (offset, size) != (0, shape[dim]):
                raise ValueError(
                    f"pieces: box {describe_chunk(box)} of this rank does not span dim {dim}, "
                    f"which placements {tuple(placements)!r} do not shard (expected offset 0, "
                    f"size {shape[dim]})"
                )
        if tuple(box.sizes[1:]) != tuple(boxes[0].sizes[1:]):
            raise ValueError(
                f"pieces: boxes of this rank are stacked along dim 0 and must agree in every "
                f"other dim, got {describe_chunk(boxes[0])} and {describe_chunk(box)}"
            )
    if 0 not in sharded and boxes and sum(box.sizes[0] for box in boxes) != shape[0]:
        raise ValueError(
            f"pieces: placements {tuple(placements)!r} do not shard dim 0, so this rank's boxes "
            f"must hold all {shape[0]} rows, got " + ", ".join(describe_chunk(b) for b in boxes)
        )
    if len(local) != ndim:
        raise ValueError(
            f"local_tensor: expected {ndim} dims like shape {shape}, got shape {local}"
        )
    if not boxes:
        if local[0] != 0:
            raise ValueError(
                f"local_tensor: this rank holds no boxes, so expected 0 rows, got shape {local}"
            )
        return
    expected = (sum(box.sizes[0] for box in boxes), *boxes[0].sizes[1:])
    if local != expected:
        raise ValueError(
            f"local_tensor: expected shape {expected} (this rank's boxes "
            + ", ".join(describe_chunk(b) for b in boxes)
            + f" stacked along dim 0), got {local}"
        )


def cut_boxes(
    full: torch.Tensor, boxes: Sequence[ChunkStorageMetadata], local_shape: Sequence[int]
) -> torch.Tensor:
    """The local piece of ``full`` for ``boxes``: the boxes stacked along dim 0.

    Args:
        full: the whole tensor.
        boxes: one rank's boxes.
        local_shape: the shape to give an empty piece when there are no boxes.

    Returns:
        A view of ``full`` for a single box, else a new tensor.
    """
    if not boxes:
        return full.new_empty(tuple(local_shape))
    if len(boxes) == 1:
        return full[box_slices(boxes[0])]
    return torch.cat([full[box_slices(box)] for box in boxes], dim=0)


def place_boxes(
    full: torch.Tensor, flat: torch.Tensor, boxes: Sequence[ChunkStorageMetadata]
) -> None:
    """Write the stacked boxes held (flattened, maybe padded) in ``flat`` into ``full``."""
    start = 0
    for box in boxes:
        numel = math.prod(box.sizes)
        if numel:
            full[box_slices(box)] = flat[start : start + numel].view(tuple(box.sizes))
        start += numel


def take_boxes(
    full: torch.Tensor, boxes: Sequence[ChunkStorageMetadata], flat: torch.Tensor
) -> None:
    """Write ``full``'s boxes, stacked and flattened, into ``flat`` (``place_boxes`` undone).

    One copy per box, converting to ``flat``'s dtype on the way.
    """
    start = 0
    for box in boxes:
        numel = math.prod(box.sizes)
        if numel:
            flat[start : start + numel].view(tuple(box.sizes)).copy_(full[box_slices(box)])
        start += numel


def boxes_numel(boxes: Sequence[ChunkStorageMetadata]) -> int:
    """How many elements ``boxes`` hold together (the numel of the local tensor)."""
    return sum(math.prod(box.sizes) for box in boxes)


def same_pieces(a: PieceMap, b: PieceMap) -> bool:
    """Whether two PieceMaps give every rank the same boxes: the same object, or equal."""
    return a is b or a == b
