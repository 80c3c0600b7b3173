"""Per-DTensor chunk metadata: computing it across ranks, attaching it, exposing it to DCP.

DTensor assumes ``torch.chunk``-style even shards when it tells
torch.distributed.checkpoint (DCP) where its local piece lies
(``compute_local_shape_and_global_offset``). For an unevenly sharded DTensor
that answer is wrong, so this module attaches the true chunk to the DTensor
instance and overrides, on that instance only, the two hooks DCP consults:
``__create_chunk_list__`` (load and save planning) and
``__create_write_items__`` (save). Nothing in torch is patched globally; a
DTensor without metadata behaves exactly as before.

[Note: empty chunks] An empty local piece contributes no write item and no
read item when the global tensor is non-empty. DCP names a stored chunk by
its offset only, so an empty chunk at offset k would collide with the
neighbour's real chunk at k and could replace it during de-duplication.

Metadata is gathered with one all-gather of small integer tensors per mesh
dim for a whole batch of DTensors (see :func:`gather_chunk_layouts`), not one
object collective per tensor.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mf_dtensor._collectives import all_gather_over_mesh_dims
from mf_dtensor.layout import (
    check_placements,
    make_chunk,
    rank_order_chunks,
    validate_chunk_layout,
)

__all__ = [
    "ChunkLayout",
    "attach_chunk_metadata",
    "attach_gathered_layouts",
    "claimed_chunk",
    "full_layout",
    "gather_and_compute_chunk_metadata",
    "gather_chunk_layouts",
    "get_chunk_metadata",
    "local_mesh_index",
    "require_dtensor",
    "update_uneven_dtensor_chunk_metadata",
    "validate_uneven_dtensor",
]

_METADATA_ATTR = "_mf_chunk_metadata"


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Where the pieces of one unevenly sharded DTensor lie.

    Attributes:
        local: this rank's chunk (global offsets and sizes of its local piece).
        all_chunks: every rank's chunk in row-major mesh order, or ``None``
            when only the local chunk is known (enough for DCP; gathering and
            validation fetch the rest on demand).
    """

    local: ChunkStorageMetadata
    all_chunks: tuple[ChunkStorageMetadata, ...] | None = None


def require_dtensor(dtensor: Any, argument: str = "dtensor") -> DTensor:
    """Return ``dtensor`` if it is a DTensor, else raise a TypeError naming ``argument``."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"{argument}: expected a DTensor, got {type(dtensor).__name__}")
    return dtensor


def local_mesh_index(mesh: DeviceMesh) -> int:
    """Row-major index of this rank's coordinate in ``mesh``.

    Raises:
        ValueError: if this rank is not part of ``mesh``.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"device_mesh: this rank is not part of {mesh!r}")
    index = 0
    for size, position in zip(mesh.shape, coordinate, strict=True):
        index = index * size + position
    return index


def get_chunk_metadata(dtensor: DTensor) -> ChunkLayout | None:
    """The chunk metadata attached to ``dtensor``, or ``None`` if it has none."""
    return getattr(require_dtensor(dtensor), _METADATA_ATTR, None)


def _chunk_list(layout: ChunkLayout, global_numel: int) -> list[ChunkStorageMetadata]:
    # See [Note: empty chunks].
    if math.prod(layout.local.sizes) == 0 and global_numel > 0:
        return []
    return [layout.local]


def _write_items(layout: ChunkLayout, fqn: str, dtensor: DTensor) -> list[WriteItem]:
    local = dtensor.to_local()
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(local),
                size=dtensor.size(),
            ),
        )
        for chunk in _chunk_list(layout, dtensor.numel())
    ]


def attach_chunk_metadata(
    dtensor: DTensor,
    local_chunk: ChunkStorageMetadata,
    all_chunks: Sequence[ChunkStorageMetadata] | None = None,
) -> DTensor:
    """Attach ``local_chunk`` (and optionally every rank's chunk) to ``dtensor`` for DCP.

    Only local checks are made (no communication): the chunk must describe
    the local piece's shape and lie inside the global shape. Use
    :func:`validate_uneven_dtensor` for the cross-rank checks.

    Returns:
        ``dtensor`` itself, modified in place.

    Raises:
        ValueError: if the chunk does not match the local piece or the DTensor
            has unsupported placements.
    """
    require_dtensor(dtensor)
    mesh = dtensor.device_mesh
    check_placements(dtensor.placements, dtensor.ndim, mesh.ndim)
    local_shape = tuple(dtensor.to_local().shape)
    if tuple(local_chunk.sizes) != local_shape:
        raise ValueError(
            f"local_chunk: sizes {tuple(local_chunk.sizes)} do not match the local piece's "
            f"shape {local_shape}"
        )
    global_shape = tuple(dtensor.shape)
    for dim, (offset, size) in enumerate(zip(local_chunk.offsets, local_chunk.sizes, strict=True)):
        if offset < 0 or offset + size > global_shape[dim]:
            raise ValueError(
                f"local_chunk: offsets {tuple(local_chunk.offsets)} put the local piece of shape "
                f"{local_shape} outside the global shape {global_shape} in dim {dim}"
            )
    layout = ChunkLayout(
        local=make_chunk(local_chunk.offsets, local_chunk.sizes),
        all_chunks=None if all_chunks is None else tuple(all_chunks),
    )
    setattr(dtensor, _METADATA_ATTR, layout)
    # Instance attributes shadow DTensor's methods for this object only (setattr: a type
    # checker refuses an assignment to a method).
    chunk_list = functools.partial(_chunk_list, layout, dtensor.numel())
    setattr(dtensor, "__create_chunk_list__", chunk_list)  # noqa: B010
    setattr(dtensor, "__create_write_items__", functools.partial(_write_items, layout))  # noqa: B010
    return dtensor


def gather_chunk_layouts(
    dtensors: Sequence[DTensor], claimed: Sequence[ChunkStorageMetadata | None]
) -> list[tuple[ChunkStorageMetadata, ...]]:
    """Every rank's chunk of each DTensor, with one all-gather per mesh dim for the batch.

    All ``dtensors`` must share one device mesh, and every rank of it must
    call this with the same DTensors in the same order (collective).

    Args:
        dtensors: DTensors on one mesh.
        claimed: for each DTensor, this rank's chunk when the caller knows it
            (e.g. from attached metadata), else ``None``. A DTensor whose
            chunk no rank claims gets offsets from the local shapes in
            DTensor's ``Shard`` order. Nothing is checked here, so that bad
            input raises the same error on every rank once the layout is
            validated.

    Returns:
        For each DTensor, one chunk per rank in row-major mesh order.

    Raises:
        ValueError: if the ranks disagree on the batch or on a tensor's dtype, some
            but not all ranks have attached metadata, or the local shapes cannot form a
            layout.
    """
    if not dtensors:
        return []
    mesh = dtensors[0].device_mesh
    payload: list[int] = []
    signature: list[int] = [len(dtensors)]
    if len(claimed) != len(dtensors):
        raise ValueError(f"claimed: expected {len(dtensors)} entries, got {len(claimed)}")
    for dtensor, chunk in zip(dtensors, claimed, strict=True):
        if dtensor.device_mesh != mesh:
            raise ValueError(
                f"dtensors: expected one device mesh, got {mesh!r} and {dtensor.device_mesh!r}"
            )
        check_placements(dtensor.placements, dtensor.ndim, mesh.ndim)
        shape = tuple(dtensor.to_local().shape)
        if chunk is None:
            payload += [0, *([0] * dtensor.ndim), *shape]
        else:
            payload += [1, *chunk.offsets, *shape]
        signature += [dtensor.ndim, *dtensor.shape]
    check = zlib.crc32(repr(signature).encode())
    dtypes = [str(dtensor.to_local().dtype) for dtensor in dtensors]
    dtype_check = zlib.crc32(repr(dtypes).encode())
    all_mesh_dims = list(range(mesh.ndim))
    header = all_gather_over_mesh_dims(
        torch.tensor([len(payload), check, dtype_check]), mesh, all_mesh_dims
    )
    if not bool((header[:, :2] == header[0, :2]).all()):
        raise ValueError(
            "dtensors: ranks of the mesh passed different DTensors (count, ranks or global "
            f"shapes differ); per-rank [payload length, signature]: {header[:, :2].tolist()}"
        )
    if not bool((header[:, 2] == header[0, 2]).all()):
        # Checked here, before any rank gathers the pieces themselves: gloo's all-gather
        # of buffers of different dtypes aborts the process instead of raising.
        raise ValueError(
            f"dtensors: ranks of the mesh hold local pieces of different dtypes (this rank: "
            f"{', '.join(dtypes)}); expected the same dtype for each tensor on every rank"
        )
    gathered = all_gather_over_mesh_dims(torch.tensor(payload), mesh, all_mesh_dims).tolist()
    layouts = []
    position = 0
    for dtensor in dtensors:
        ndim = dtensor.ndim
        rows = [row[position : position + 1 + 2 * ndim] for row in gathered]
        position += 1 + 2 * ndim
        flags = {row[0] for row in rows}
        if flags == {1}:
            layouts.append(tuple(make_chunk(row[1 : 1 + ndim], row[1 + ndim :]) for row in rows))
            continue
        if flags != {0}:
            missing = [rank for rank, row in enumerate(rows) if row[0] == 0]
            raise ValueError(
                f"dtensor: ranks {missing} of the mesh give no chunk offsets while others do; "
                "attach chunk metadata on all ranks or on none"
            )
        local_shapes = [row[1 + ndim :] for row in rows]
        layouts.append(
            tuple(rank_order_chunks(dtensor.shape, mesh.shape, dtensor.placements, local_shapes))
        )
    return layouts


def claimed_chunk(dtensor: DTensor) -> ChunkStorageMetadata | None:
    """This rank's attached chunk of ``dtensor``, or ``None`` when nothing is attached."""
    layout = get_chunk_metadata(dtensor)
    return None if layout is None else layout.local


def _gather_validated(
    dtensors: Sequence[DTensor],
    claimed: Sequence[ChunkStorageMetadata | None],
    names: Sequence[str],
) -> list[tuple[ChunkStorageMetadata, ...]]:
    """Gather the layouts and validate each (every rank sees the same data: same errors)."""
    layouts = gather_chunk_layouts(dtensors, claimed)
    for dtensor, chunks, name in zip(dtensors, layouts, names, strict=True):
        validate_chunk_layout(
            dtensor.shape,
            chunks,
            mesh_shape=dtensor.device_mesh.shape,
            placements=dtensor.placements,
            name=name,
        )
    return layouts


def attach_gathered_layouts(
    dtensors: Sequence[DTensor],
    claimed: Sequence[ChunkStorageMetadata | None],
    names: Sequence[str],
) -> None:
    """Gather, validate and attach the full layouts of DTensors sharing a mesh (collective)."""
    if not dtensors:
        return
    index = local_mesh_index(dtensors[0].device_mesh)
    for dtensor, chunks in zip(dtensors, _gather_validated(dtensors, claimed, names), strict=True):
        attach_chunk_metadata(dtensor, chunks[index], chunks)


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """This rank's chunk of ``dtensor``, computed from every rank's local shape (collective).

    Pieces are taken to follow DTensor's ``Shard`` order (mesh coordinate
    order) with whatever sizes the ranks hold, including zero. Attached
    metadata is ignored and nothing is attached.

    Raises:
        TypeError: if ``dtensor`` is not a DTensor.
        ValueError: if the local shapes cannot be laid out on the mesh.
    """
    require_dtensor(dtensor)
    (layout,) = gather_chunk_layouts([dtensor], [None])
    return layout[local_mesh_index(dtensor.device_mesh)]


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> DTensor:
    """Compute ``dtensor``'s chunks in ``Shard`` order and attach them for DCP (collective).

    After this, ``dcp.save``/``dcp.load`` see the true offset of this rank's
    uneven piece. The full layout is validated and cached too, so later
    gathers need no metadata exchange.

    Returns:
        ``dtensor`` itself, modified in place.

    Raises:
        TypeError: if ``dtensor`` is not a DTensor.
        ValueError: (on every rank) if the local shapes do not tile the tensor.
    """
    require_dtensor(dtensor)
    attach_gathered_layouts([dtensor], [None], ["dtensor"])
    return dtensor


def full_layout(dtensor: DTensor) -> tuple[ChunkStorageMetadata, ...]:
    """Every rank's chunk of ``dtensor``: cached, else gathered, validated and cached.

    Collective when nothing is cached. The cached layout is always one that
    passed :func:`~mf_dtensor.layout.validate_chunk_layout`.
    """
    layout = get_chunk_metadata(dtensor)
    if layout is None or layout.all_chunks is None:
        attach_gathered_layouts([dtensor], [claimed_chunk(dtensor)], ["dtensor"])
        layout = get_chunk_metadata(dtensor)
    assert layout is not None  # attached just above, with every rank's chunk
    assert layout.all_chunks is not None
    return layout.all_chunks


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """Check that the ranks' pieces of ``dtensor`` tile its global shape exactly (collective).

    Uses the attached chunk metadata when present (e.g. from
    ``uneven_dtensor_from_local`` with explicit offsets), else the ``Shard``
    order of the local shapes. Checks that every chunk lies inside the
    tensor, no two chunks overlap, nothing is left uncovered, and replicas
    (ranks differing only in ``Replicate`` mesh dims) hold the same chunk.
    The exchanged layout is always fresh (never a cached one), and every
    rank raises the same error.

    Raises:
        TypeError: if ``dtensor`` is not a DTensor.
        ValueError: describing the first violation found, with the chunks involved.
    """
    require_dtensor(dtensor)
    attach_gathered_layouts([dtensor], [claimed_chunk(dtensor)], ["dtensor"])
