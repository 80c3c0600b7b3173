"""Gathering an UnevenDTensor's boxes into the full tensor.

``UnevenDTensor.full_tensor`` and ``UnevenDTensor.redistribute`` gather through
:func:`gather_full`: each rank's piece is padded to the largest piece of the
ranks it gathers from (known from the PieceMap, so no size is exchanged),
all-gathered over the mesh dims that are not ``Replicate``, and every rank's
boxes are placed into a tensor of the global shape.

Invariants: every rank computes the same width and the same order of ranks
from the mesh and the PieceMap alone. It must not communicate beyond that one
all-gather, and works on the local tensor, mesh, placements, shape and
PieceMap, never on the UnevenDTensor class.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor._collectives import all_gather_over_mesh_dims
from mf_dtensor.pieces import PieceMap, boxes_numel, place_boxes

__all__ = ["gather_full", "gather_members"]


def gather_members(mesh: DeviceMesh, mesh_dims: Sequence[int]) -> list[int]:
    """Row-major mesh indices of the ranks differing from this one only on ``mesh_dims``.

    In the order :func:`all_gather_over_mesh_dims` stacks their contributions.
    """
    me = mesh.get_coordinate()
    if me is None:
        raise ValueError(f"gather_members: this rank is not part of {mesh!r}")
    coordinate = list(me)
    mesh_shape = tuple(mesh.shape)
    members = []
    for values in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims)):
        for mesh_dim, value in zip(mesh_dims, values, strict=True):
            coordinate[mesh_dim] = value
        index = 0
        for size, position in zip(mesh_shape, coordinate, strict=True):
            index = index * size + position
        members.append(index)
    return members


def gather_full(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    pieces: PieceMap,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The full tensor on ``local``'s device (collective over the non-Replicate mesh dims)."""
    mesh_dims = [m for m, p in enumerate(placements) if not isinstance(p, Replicate)]
    members = gather_members(mesh, mesh_dims)
    member_boxes = [pieces.boxes(index) for index in members]
    # Every rank computes the same width from the PieceMap: no size exchange.
    width = max((boxes_numel(boxes) for boxes in member_boxes), default=0)
    if width == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=local.device)
    row = torch.empty(width, dtype=dtype, device=local.device)
    row[: local.numel()] = local.reshape(-1)
    row[local.numel() :].zero_()
    gathered = all_gather_over_mesh_dims(row, mesh, mesh_dims)  # [len(members), width]
    full = torch.empty(tuple(shape), dtype=dtype, device=gathered.device)
    for flat, boxes in zip(gathered, member_boxes, strict=True):
        place_boxes(full, flat, boxes)
    return full.to(local.device)
