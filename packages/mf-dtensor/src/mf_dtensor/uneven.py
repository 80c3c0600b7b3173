"""Build, gather and split unevenly sharded DTensors.

An *uneven* DTensor is an ordinary ``DTensor`` built with
``DTensor.from_local(..., shape=global_shape, stride=...)`` whose local
pieces have arbitrary sizes (zero included) along their ``Shard`` dims.
Elementwise DTensor ops work on it unchanged; what torch cannot do for it
is gather it (``full_tensor``/``redistribute`` assume ``torch.chunk``
sizes), split it without replicating, or checkpoint it (see
``chunk_metadata``). This module supplies those, driven by the chunk
layout: gathers pad every piece to the largest and use
``all_gather_into_tensor`` (equal sizes, so gloo works too), then place each
piece at its chunk.

It never materialises a replicated copy except where the caller asks for
the full tensor.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor._collectives import all_gather_over_mesh_dims
from mf_dtensor.chunk_metadata import (
    ChunkLayout,
    attach_chunk_metadata,
    attach_gathered_layouts,
    full_layout,
    get_chunk_metadata,
    local_mesh_index,
    require_dtensor,
)
from mf_dtensor.layout import (
    check_placements,
    check_shape,
    contiguous_stride,
    make_chunk,
    mesh_coordinates,
    narrow_chunk,
    split_sections,
    validate_chunk_layout,
)
from mf_utils import get_group_device

__all__ = [
    "assemble_full_tensor_from_uneven_chunks",
    "gather_uneven_dtensor_to_full_tensor",
    "split_dtensor",
    "uneven_dtensor_from_local",
]


def uneven_dtensor_from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    global_shape: Sequence[int],
    global_offset: Sequence[int] | None = None,
    validate: bool = True,
) -> DTensor:
    """Wrap this rank's piece of a tensor as an unevenly sharded DTensor, ready for DCP.

    Args:
        local_tensor: this rank's piece (any size along its ``Shard`` dims,
            possibly empty; full size along the others).
        device_mesh: the mesh the tensor lives on.
        placements: one ``Shard(dim)`` or ``Replicate()`` per mesh dim.
        global_shape: shape of the whole tensor.
        global_offset: where the piece starts in the whole tensor. When given,
            no communication is needed to attach the chunk metadata; when
            ``None``, offsets follow DTensor's ``Shard`` order (mesh
            coordinate order) and are computed with one small all-gather.
        validate: only matters with ``global_offset``. True: exchange every
            rank's chunk (one small all-gather) and check that the pieces
            tile the tensor. False: no communication; only this rank's piece
            is checked, locally. Without ``global_offset`` the layout is
            always exchanged and validated.

    Returns:
        A DTensor of shape ``global_shape`` whose chunk metadata is attached.

    Raises:
        TypeError: if ``local_tensor`` is not a plain tensor, or ``global_shape``
            is not a sequence of ints.
        ValueError: if a placement is unsupported, ``global_shape`` has a
            negative size, or ``global_shape`` / ``global_offset`` have the
            wrong length; if the exchanged pieces
            overlap, leave gaps, stick out or disagree between replicas
            (raised on every rank alike, so no rank is left waiting); or,
            with ``validate=False``, if this rank's piece does not fit
            ``global_shape`` at ``global_offset``.
    """
    if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
        raise TypeError(
            f"local_tensor: expected a plain torch.Tensor, got {type(local_tensor).__name__}"
        )
    shape = check_shape(global_shape, "global_shape")
    if len(shape) != local_tensor.ndim:
        raise ValueError(
            f"global_shape: expected {local_tensor.ndim} dims like the local piece "
            f"{tuple(local_tensor.shape)}, got {shape!r}"
        )
    placements = tuple(placements)
    check_placements(placements, len(shape), device_mesh.ndim)
    offset = None if global_offset is None else tuple(int(o) for o in global_offset)
    if offset is not None and len(offset) != len(shape):
        raise ValueError(f"global_offset: expected {len(shape)} offsets, got {offset!r}")
    if offset is not None and not validate:
        # Nothing is exchanged, so check what this rank can check alone. When
        # a layout is exchanged, its validation catches the same mistakes on
        # every rank at once (a local raise would strand the other ranks).
        _check_piece_alone(local_tensor, shape, placements, offset)
    dtensor = DTensor.from_local(
        local_tensor,
        device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_stride(shape),
    )
    if offset is None:
        attach_gathered_layouts([dtensor], [None], ["dtensor"])
    elif validate:
        attach_gathered_layouts([dtensor], [make_chunk(offset, local_tensor.shape)], ["dtensor"])
    else:
        attach_chunk_metadata(dtensor, make_chunk(offset, local_tensor.shape))
    return dtensor


def _check_piece_alone(
    local_tensor: torch.Tensor,
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    offset: tuple[int, ...],
) -> None:
    sharded = {p.dim for p in placements if isinstance(p, Shard)}
    for dim in range(len(shape)):
        if dim in sharded:
            continue
        if local_tensor.shape[dim] != shape[dim]:
            raise ValueError(
                f"local_tensor: dim {dim} is not sharded, so its size must equal global_shape"
                f"[{dim}]={shape[dim]}, got local shape {tuple(local_tensor.shape)}"
            )
        if offset[dim] != 0:
            raise ValueError(
                f"global_offset: dim {dim} is not sharded, so its offset must be 0, "
                f"got {offset!r} for placements {placements!r}"
            )


def _sharded_mesh_dims(placements: Sequence[Placement]) -> list[int]:
    return [mesh_dim for mesh_dim, p in enumerate(placements) if isinstance(p, Shard)]


def _replicated(
    full: torch.Tensor, mesh: DeviceMesh, target_device: torch.device | None
) -> DTensor:
    result = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if target_device is not None and torch.device(target_device) != full.device:
        # cast: Tensor.to on a DTensor returns a DTensor; torch's stubs say Tensor
        result = cast(DTensor, result.to(target_device))
    return result


def assemble_full_tensor_from_uneven_chunks(
    dtensor: DTensor,
    all_chunk_info: Sequence[ChunkStorageMetadata],
    process_group: dist.ProcessGroup | None = None,
    target_device: torch.device | None = None,
) -> DTensor:
    """All-gather the uneven pieces of ``dtensor`` and place each at its chunk.

    Args:
        dtensor: the unevenly sharded DTensor.
        all_chunk_info: where each member's piece lies. With a
            ``process_group``: one chunk per member, in group-rank order.
            Without: one chunk per rank of the DTensor's mesh, row-major.
        process_group: the group whose members' pieces together cover the
            tensor. ``None`` gathers over the mesh's ``Shard`` dims only
            (replicas are not exchanged with).
        target_device: device of the result; default the gather device.

    Returns:
        The full tensor as a DTensor replicated over the same mesh.

    Raises:
        ValueError: if the chunk list has the wrong length, this rank's chunk
            does not match its local piece, or the chunks do not tile the tensor.
    """
    require_dtensor(dtensor)
    mesh = dtensor.device_mesh
    chunks = list(all_chunk_info)
    if process_group is None:
        expected, position = mesh.size(), local_mesh_index(mesh)
    else:
        expected, position = dist.get_world_size(process_group), dist.get_rank(process_group)
    if len(chunks) != expected:
        raise ValueError(
            f"all_chunk_info: expected {expected} chunks (one per "
            f"{'mesh rank' if process_group is None else 'group member'}), got {len(chunks)}"
        )
    local = dtensor.to_local()
    if process_group is None:
        # Replicas must agree, or the members gathered below might not cover the tensor.
        validate_chunk_layout(
            dtensor.shape,
            chunks,
            mesh_shape=mesh.shape,
            placements=dtensor.placements,
            name="all_chunk_info",
        )
        mesh_dims = _sharded_mesh_dims(dtensor.placements)
        members = _members_sharing_replicate_coordinates(mesh, mesh_dims)
        position = members.index(position)
        chunks = [chunks[index] for index in members]
        device = get_group_device(mesh.get_group(0))
    else:
        validate_chunk_layout(dtensor.shape, chunks, name="all_chunk_info")
        device = get_group_device(process_group)
        mesh_dims = []  # unused: the group's members are gathered
    # First a small header per member, "my piece matches my chunk" and its dtype, so a
    # rank whose piece disagrees with the list, or whose dtype differs (gloo aborts the
    # process on a gather of mixed dtypes), makes every rank raise instead of leaving
    # its peers in the gather. Then the pieces, each padded to the largest chunk.
    matches = tuple(chunks[position].sizes) == tuple(local.shape)
    header = torch.tensor(
        [int(matches), zlib.crc32(str(local.dtype).encode())], dtype=torch.int64, device=device
    )
    headers = _gather_rows(header, mesh, mesh_dims, process_group, len(chunks)).tolist()
    if any(dtype != headers[0][1] for _, dtype in headers):
        raise ValueError(
            f"dtensors: ranks of the mesh hold local pieces of different dtypes (this rank: "
            f"{local.dtype}); expected the same dtype on every rank"
        )
    mismatched = [i for i, (flag, _) in enumerate(headers) if flag != 1]
    if mismatched:
        raise ValueError(
            f"all_chunk_info: the local pieces of members {mismatched} do not have the sizes "
            f"of their chunks (this rank: chunk sizes {tuple(chunks[position].sizes)}, local "
            f"piece {tuple(local.shape)})"
        )
    width = max(math.prod(chunk.sizes) for chunk in chunks)
    row = torch.zeros(width, dtype=local.dtype, device=device)
    row[: local.numel()] = local.reshape(-1)
    gathered = _gather_rows(row, mesh, mesh_dims, process_group, len(chunks))
    full = torch.empty(dtensor.shape, dtype=local.dtype, device=device)
    for data, chunk in zip(gathered, chunks, strict=True):
        slices = tuple(
            slice(offset, offset + size)
            for offset, size in zip(chunk.offsets, chunk.sizes, strict=True)
        )
        full[slices] = data[: math.prod(chunk.sizes)].view(chunk.sizes)
    return _replicated(full, mesh, target_device)


def _gather_rows(
    row: torch.Tensor,
    mesh: DeviceMesh,
    mesh_dims: Sequence[int],
    process_group: dist.ProcessGroup | None,
    members: int,
) -> torch.Tensor:
    """Every member's ``row``, one per line: over ``mesh_dims`` of ``mesh``, or the group."""
    if process_group is None:
        return all_gather_over_mesh_dims(row, mesh, mesh_dims)
    gathered = row.new_empty((members, row.numel()))
    dist.all_gather_into_tensor(gathered.view(-1), row, group=process_group)
    return gathered


def _members_sharing_replicate_coordinates(mesh: DeviceMesh, mesh_dims: Sequence[int]) -> list[int]:
    """Row-major indices of the ranks that differ from this one only on ``mesh_dims``."""
    me = mesh.get_coordinate()
    assert me is not None  # the caller's local_mesh_index(mesh) checked this rank is in it
    return [
        index
        for index, coordinate in enumerate(mesh_coordinates(mesh.shape))
        if all(coordinate[m] == me[m] for m in range(mesh.ndim) if m not in mesh_dims)
    ]


def gather_uneven_dtensor_to_full_tensor(
    dtensor: DTensor, target_device: torch.device | None = None
) -> DTensor:
    """Reconstruct the full tensor of an unevenly sharded DTensor on every rank (collective).

    The layout comes from the attached chunk metadata, or is gathered (and
    attached) when missing. Each piece is padded to the largest and
    exchanged with ``all_gather_into_tensor`` over the ``Shard`` mesh dims.

    Args:
        dtensor: DTensor with uneven (or even) ``Shard``/``Replicate`` placements.
        target_device: if given, the result's local tensor is moved there;
            otherwise it stays on the process group's device.

    Returns:
        A DTensor replicated over ``dtensor``'s mesh holding the full tensor.

    Raises:
        TypeError: if ``dtensor`` is not a DTensor.
        ValueError: if the pieces do not tile the tensor.
    """
    require_dtensor(dtensor)
    return assemble_full_tensor_from_uneven_chunks(
        dtensor, full_layout(dtensor), None, target_device
    )


def split_dtensor(
    dtensor: DTensor,
    split_size_or_sections: int | Sequence[int],
    dim: int = 0,
    update_uneven_dtensor_chunk_meta: bool = False,
) -> Iterator[DTensor]:
    """Split a (possibly uneven) DTensor along ``dim`` like ``torch.split``, without gathering.

    Each piece is a DTensor on the same mesh with the same placements whose
    local tensor is a view of this rank's part of the piece (possibly
    empty). ``Replicate`` dims stay replicated and are never redistributed,
    so no rank ever holds more than its own data.

    Arguments are checked, and the local chunk is found (a collective if
    ``dtensor`` carries no metadata and it is needed), when this is called;
    the pieces are then produced lazily.

    Args:
        dtensor: the DTensor to split.
        split_size_or_sections: piece size (last piece may be smaller), or the
            list of piece sizes, which must sum to the size of ``dim``.
        dim: the global dim to split (negative counts from the end).
        update_uneven_dtensor_chunk_meta: attach chunk metadata to each piece
            so it can be checkpointed or gathered without communication.

    Yields:
        DTensor: the pieces in order.

    Raises:
        TypeError: on a non-DTensor or a malformed split.
        ValueError: on a dim out of range or sections that do not sum to the dim size.
    """
    require_dtensor(dtensor)
    ndim = dtensor.ndim
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: expected a dim of a {ndim}-D DTensor, got {dim!r}")
    dim %= ndim
    sections = split_sections(dtensor.shape[dim], split_size_or_sections)
    mesh = dtensor.device_mesh
    check_placements(dtensor.placements, ndim, mesh.ndim)
    dim_is_sharded = any(isinstance(p, Shard) and p.dim == dim for p in dtensor.placements)
    layout = get_chunk_metadata(dtensor)
    if layout is None and (dim_is_sharded or update_uneven_dtensor_chunk_meta):
        full_layout(dtensor)
        layout = get_chunk_metadata(dtensor)
    return _split_pieces(dtensor, sections, dim, layout, update_uneven_dtensor_chunk_meta)


def _split_pieces(
    dtensor: DTensor,
    sections: list[tuple[int, int]],
    dim: int,
    layout: ChunkLayout | None,
    attach: bool,
) -> Iterator[DTensor]:
    local = dtensor.to_local()
    for start, length in sections:
        shape = list(dtensor.shape)
        shape[dim] = length
        if layout is None:  # dim is not sharded: every rank holds all of it.
            local_start, local_length = start, length
        else:
            sub_chunk, local_start, local_length = narrow_chunk(layout.local, dim, start, length)
        piece = DTensor.from_local(
            local.narrow(dim, local_start, local_length),
            dtensor.device_mesh,
            dtensor.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )
        if attach and layout is not None:
            all_chunks = None
            if layout.all_chunks is not None:
                all_chunks = [narrow_chunk(c, dim, start, length)[0] for c in layout.all_chunks]
            attach_chunk_metadata(piece, sub_chunk, all_chunks)
        yield piece
