"""Pure layout math for unevenly sharded tensors: chunks, offsets, validation, splits.

A *chunk* is the box one rank holds of a global tensor: a global offset and a
size per tensor dim, expressed as torch's own ``ChunkStorageMetadata`` so the
same objects feed torch.distributed.checkpoint unchanged. A *layout* is the
list of chunks of every rank of a device mesh, in row-major mesh-coordinate
order (the order of ``device_mesh.mesh.flatten()``).

Invariants of a valid layout (checked by :func:`validate_chunk_layout`):
every chunk lies inside the global shape, distinct non-empty chunks never
overlap, their union covers the whole tensor, and ranks that differ only in
mesh dims with a ``Replicate`` placement hold the same chunk.

This module never touches a process group or tensor data: everything here is
cheap integer math that can be tested in one process.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

__all__ = [
    "check_chunk_fits",
    "check_placements",
    "check_shape",
    "contiguous_stride",
    "describe_chunk",
    "make_chunk",
    "mesh_coordinates",
    "narrow_chunk",
    "rank_order_chunks",
    "sharding_mesh_dims",
    "split_sections",
    "validate_chunk_layout",
]

Shape = tuple[int, ...]


def make_chunk(offsets: Sequence[int], sizes: Sequence[int]) -> ChunkStorageMetadata:
    """Build a ``ChunkStorageMetadata`` from plain integer sequences."""
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def check_shape(shape: object, argument: str) -> Shape:
    """``shape`` as a tuple of ints, checked: a sequence of non-negative integer sizes.

    Sizes may be any integer-like value (``int``, a 0-dim integer tensor, a
    NumPy integer); zero sizes are allowed (empty tensors are fine).

    Args:
        shape: the value passed by the caller.
        argument: its parameter name, for the error message.

    Raises:
        TypeError: if ``shape`` is not a sequence, or a size is not an integer
            (a ``float``, a ``str``, a ``bool``, ...).
        ValueError: if a size is negative.
    """
    if isinstance(shape, str | bytes) or not isinstance(shape, Iterable):
        raise TypeError(
            f"{argument}: expected a sequence of non-negative ints (a shape), got {shape!r}"
        )
    items = tuple(shape)
    sizes = []
    for size in items:
        try:
            if isinstance(size, bool):
                raise TypeError
            sizes.append(operator.index(size))
        except TypeError:
            raise TypeError(
                f"{argument}: expected a sequence of non-negative ints (a shape), got {items!r} "
                f"(size {size!r} is a {type(size).__name__})"
            ) from None
    if any(size < 0 for size in sizes):
        raise ValueError(f"{argument}: expected non-negative sizes, got {tuple(sizes)!r}")
    return tuple(sizes)


def contiguous_stride(shape: Sequence[int]) -> Shape:
    """Row-major (C-contiguous) strides of ``shape``, as ``torch.empty(shape).stride()``."""
    stride: list[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def mesh_coordinates(mesh_shape: Sequence[int]) -> list[Shape]:
    """Every coordinate of a mesh of ``mesh_shape``, in row-major order."""
    return list(itertools.product(*(range(size) for size in mesh_shape)))


def check_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int) -> None:
    """Check that ``placements`` describe a tensor of ``ndim`` dims on a mesh of ``mesh_ndim``.

    Only plain ``Shard(dim)`` and ``Replicate()`` are supported: ``Partial``
    values have no defined chunks (DCP refuses them too), and strided shards
    interleave pieces, which no contiguous chunk can describe.

    Raises:
        ValueError: on a count mismatch, an unsupported placement or a shard
            dim outside the tensor.
    """
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"placements: expected one placement per mesh dim ({mesh_ndim}), "
            f"got {len(placements)}: {tuple(placements)!r}"
        )
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard:
            if not 0 <= placement.dim < ndim:
                raise ValueError(
                    f"placements[{mesh_dim}]: {placement!r} shards dim {placement.dim}, "
                    f"but the tensor has {ndim} dims (normalise negative dims first)"
                )
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"placements[{mesh_dim}]: expected Shard(dim) or Replicate(), got {placement!r}"
            )


def sharding_mesh_dims(placements: Sequence[Placement], tensor_dim: int) -> list[int]:
    """Mesh dims whose placement is ``Shard(tensor_dim)``, outermost first."""
    return [
        mesh_dim
        for mesh_dim, placement in enumerate(placements)
        if type(placement) is Shard and placement.dim == tensor_dim
    ]


def rank_order_chunks(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    local_shapes: Sequence[Sequence[int]],
) -> list[ChunkStorageMetadata]:
    """Chunks of every rank when pieces follow DTensor's ``Shard`` order, with any sizes.

    Along a tensor dim sharded by mesh dims ``m1 < m2 < ...`` (DTensor's
    default left-to-right nesting), pieces are ordered by the coordinates
    ``(c[m1], c[m2], ...)``; a rank's offset is the total size of the pieces
    before its own. Unsharded dims start at 0.

    Args:
        global_shape: shape of the whole tensor.
        mesh_shape: shape of the device mesh.
        placements: one ``Shard``/``Replicate`` per mesh dim.
        local_shapes: every rank's local shape, row-major mesh order.

    Returns:
        One chunk per rank, row-major mesh order.

    Raises:
        TypeError: if ``global_shape`` is not a sequence of ints.
        ValueError: if ``global_shape`` has a negative size, the shapes do not
            fit the mesh, or two ranks that hold the same piece along a sharded
            dim disagree on its size.
    """
    global_shape = check_shape(global_shape, "global_shape")
    ndim = len(global_shape)
    check_placements(placements, ndim, len(mesh_shape))
    coordinates = mesh_coordinates(mesh_shape)
    if len(local_shapes) != len(coordinates):
        raise ValueError(
            f"local_shapes: expected one shape per rank of mesh {tuple(mesh_shape)} "
            f"({len(coordinates)}), got {len(local_shapes)}"
        )
    for rank, shape in enumerate(local_shapes):
        if len(shape) != ndim:
            raise ValueError(
                f"local_shapes[{rank}]: expected {ndim} dims like the global shape "
                f"{tuple(global_shape)}, got {tuple(shape)}"
            )
    offsets = [[0] * ndim for _ in coordinates]
    for tensor_dim in range(ndim):
        mesh_dims = sharding_mesh_dims(placements, tensor_dim)
        if not mesh_dims:
            continue
        piece_sizes: dict[Shape, int] = {}
        for rank, coordinate in enumerate(coordinates):
            key = tuple(coordinate[m] for m in mesh_dims)
            size = local_shapes[rank][tensor_dim]
            if piece_sizes.setdefault(key, size) != size:
                raise ValueError(
                    f"local_shapes: ranks at mesh coordinates {key} of mesh dims {mesh_dims} "
                    f"share one piece of dim {tensor_dim} but disagree on its size "
                    f"({piece_sizes[key]} vs {size} on rank {rank})"
                )
        starts: dict[Shape, int] = {}
        running = 0
        for key in sorted(piece_sizes):
            starts[key] = running
            running += piece_sizes[key]
        for rank, coordinate in enumerate(coordinates):
            offsets[rank][tensor_dim] = starts[tuple(coordinate[m] for m in mesh_dims)]
    return [make_chunk(offsets[rank], local_shapes[rank]) for rank in range(len(coordinates))]


def describe_chunk(chunk: ChunkStorageMetadata) -> str:
    """``chunk`` for error messages: ``offsets=(...) sizes=(...)``."""
    return f"offsets={tuple(chunk.offsets)} sizes={tuple(chunk.sizes)}"


def check_chunk_fits(chunk: ChunkStorageMetadata, shape: Shape, what: str) -> None:
    """Raise unless ``chunk`` has ``shape``'s dims and lies inside it.

    Raises:
        ValueError: starting with ``what`` (e.g. ``"all_chunk_info: chunk of rank 1"``).
    """
    if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
        raise ValueError(
            f"{what} ({describe_chunk(chunk)}) does not have {len(shape)} dims like the "
            f"global shape {shape}"
        )
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        if offset < 0 or size < 0 or offset + size > shape[dim]:
            raise ValueError(
                f"{what} ({describe_chunk(chunk)}) is out of bounds in dim {dim} of global "
                f"shape {shape}"
            )


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        max(a_off, b_off) < min(a_off + a_size, b_off + b_size)
        for a_off, a_size, b_off, b_size in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def validate_chunk_layout(
    global_shape: Sequence[int],
    chunks: Sequence[ChunkStorageMetadata],
    *,
    mesh_shape: Sequence[int] | None = None,
    placements: Sequence[Placement] | None = None,
    name: str = "tensor",
) -> None:
    """Check that ``chunks`` tile ``global_shape`` exactly (duplicates allowed).

    Args:
        global_shape: shape of the whole tensor.
        chunks: one chunk per rank (row-major mesh order when mesh info is given).
        mesh_shape: with ``placements``, also check that ranks differing only in
            ``Replicate`` mesh dims hold identical chunks.
        placements: see ``mesh_shape``.
        name: what to call the tensor in error messages.

    Raises:
        TypeError: if ``global_shape`` is not a sequence of ints.
        ValueError: if ``global_shape`` has a negative size; naming the
            offending chunk(s) when a chunk has the wrong rank, lies outside the
            tensor, overlaps another chunk, leaves part of the tensor uncovered,
            or differs from its replica.
    """
    shape = check_shape(global_shape, "global_shape")
    for rank, chunk in enumerate(chunks):
        check_chunk_fits(chunk, shape, f"{name}: chunk of rank {rank}")
    if mesh_shape is not None and placements is not None:
        _check_replicas(chunks, mesh_shape, placements, name)
    distinct: dict[tuple[Shape, Shape], int] = {}
    for rank, chunk in enumerate(chunks):
        if math.prod(chunk.sizes) > 0:
            distinct.setdefault((tuple(chunk.offsets), tuple(chunk.sizes)), rank)
    boxes = [(rank, make_chunk(*key)) for key, rank in distinct.items()]
    for (rank_a, a), (rank_b, b) in itertools.combinations(boxes, 2):
        if _overlap(a, b):
            raise ValueError(
                f"{name}: chunks of rank {rank_a} ({describe_chunk(a)}) and rank {rank_b} "
                f"({describe_chunk(b)}) overlap"
            )
    covered = sum(math.prod(chunk.sizes) for _, chunk in boxes)
    if covered != math.prod(shape):
        raise ValueError(
            f"{name}: chunks cover {covered} of the {math.prod(shape)} elements of global "
            f"shape {shape}, leaving gaps; chunks: "
            + ", ".join(f"rank {rank}: {describe_chunk(c)}" for rank, c in enumerate(chunks))
        )


def _check_replicas(
    chunks: Sequence[ChunkStorageMetadata],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    name: str,
) -> None:
    coordinates = mesh_coordinates(mesh_shape)
    if len(chunks) != len(coordinates):
        raise ValueError(
            f"{name}: expected one chunk per rank of mesh {tuple(mesh_shape)} "
            f"({len(coordinates)}), got {len(chunks)}"
        )
    shard_dims = [m for m, p in enumerate(placements) if type(p) is Shard]
    first: dict[Shape, int] = {}
    for rank, coordinate in enumerate(coordinates):
        key = tuple(coordinate[m] for m in shard_dims)
        other = first.setdefault(key, rank)
        if chunks[other] != chunks[rank]:
            raise ValueError(
                f"{name}: ranks {other} and {rank} are replicas (same coordinates on the "
                f"sharded mesh dims {shard_dims}) but hold different chunks: "
                f"{describe_chunk(chunks[other])} vs {describe_chunk(chunks[rank])}"
            )


def split_sections(
    dim_size: int, split_size_or_sections: int | Sequence[int]
) -> list[tuple[int, int]]:
    """``(start, length)`` of each piece of ``torch.split`` over a dim of ``dim_size``.

    Raises:
        ValueError: if an int split size is not positive, a section is
            negative, or the sections do not sum to ``dim_size``.
        TypeError: if ``split_size_or_sections`` is neither an int nor a
            sequence of ints.
    """
    if isinstance(split_size_or_sections, bool) or not isinstance(
        split_size_or_sections, int | Sequence
    ):
        raise TypeError(
            "split_size_or_sections: expected an int or a list of ints, "
            f"got {split_size_or_sections!r}"
        )
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0:
            raise ValueError(f"split_size_or_sections: expected a positive int, got {step!r}")
        if dim_size == 0:
            return [(0, 0)]
        return [(start, min(step, dim_size - start)) for start in range(0, dim_size, step)]
    sections = list(split_size_or_sections)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sections):
        raise ValueError(f"split_size_or_sections: expected non-negative ints, got {sections!r}")
    if sum(sections) != dim_size:
        raise ValueError(
            f"split_size_or_sections: sections {sections!r} sum to {sum(sections)}, "
            f"but the split dim has size {dim_size}"
        )
    starts = itertools.accumulate([0, *sections[:-1]])
    return list(zip(starts, sections, strict=True))


def narrow_chunk(
    chunk: ChunkStorageMetadata, dim: int, start: int, length: int
) -> tuple[ChunkStorageMetadata, int, int]:
    """Restrict ``chunk`` to the slab ``[start, start + length)`` of ``dim``.

    Returns:
        ``(sub_chunk, local_start, local_length)``: the part of ``chunk`` inside
        the slab, with its ``dim`` offset relative to ``start`` (the slab is
        the new global tensor), and where that part sits in the rank's local
        piece along ``dim`` (``local_length`` is 0 when they do not meet).
    """
    offset, size = chunk.offsets[dim], chunk.sizes[dim]
    low = min(max(offset, start), offset + size)
    high = max(min(offset + size, start + length), low)
    new_offset = min(max(low - start, 0), length)
    offsets = list(chunk.offsets)
    sizes = list(chunk.sizes)
    offsets[dim], sizes[dim] = new_offset, high - low
    return make_chunk(offsets, sizes), low - offset, high - low
