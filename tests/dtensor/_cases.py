"""Hypothesis strategies for uneven layouts, shared by the in-process and multi-rank tests.

A ``LayoutCase`` is picklable so the parent can draw cases with hypothesis
and hand a whole list to the rank functions (one process spawn for many
examples).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor.layout import mesh_coordinates, sharding_mesh_dims


@dataclass(frozen=True)
class LayoutCase:
    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    local_shapes: tuple[tuple[int, ...], ...]  # row-major mesh order
    seed: int
    split_dim: int
    split_sections: tuple[int, ...]
    load_shapes: tuple[tuple[int, ...], ...]  # another layout to load a checkpoint into

    def full_tensor(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randn(self.global_shape, generator=generator)


@st.composite
def compositions(draw: st.DrawFn, total: int, parts: int) -> list[int]:
    """``parts`` non-negative ints summing to ``total`` (repeated cuts give empty pieces)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return [high - low for low, high in itertools.pairwise(bounds)]


def _placement(ndim: int) -> st.SearchStrategy[Placement]:
    return st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))


@st.composite
def _local_shapes(
    draw: st.DrawFn,
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[tuple[int, ...], ...]:
    """Every rank's local shape for random piece sizes along each sharded dim."""
    coordinates = mesh_coordinates(mesh_shape)
    local_shapes = [list(global_shape) for _ in coordinates]
    for dim in range(len(global_shape)):
        mesh_dims = sharding_mesh_dims(placements, dim)
        if not mesh_dims:
            continue
        keys = sorted({tuple(c[m] for m in mesh_dims) for c in coordinates})
        sizes = draw(compositions(global_shape[dim], len(keys)))
        for rank, coordinate in enumerate(coordinates):
            local_shapes[rank][dim] = sizes[keys.index(tuple(coordinate[m] for m in mesh_dims))]
    return tuple(tuple(shape) for shape in local_shapes)


@st.composite
def layout_cases(draw: st.DrawFn, mesh_shapes: list[tuple[int, ...]]) -> LayoutCase:
    mesh_shape = draw(st.sampled_from(mesh_shapes))
    ndim = draw(st.integers(1, 3))
    global_shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    placements = tuple(draw(_placement(ndim)) for _ in mesh_shape)
    split_dim = draw(st.integers(0, ndim - 1))
    pieces = draw(st.integers(1, 3))
    return LayoutCase(
        global_shape=global_shape,
        mesh_shape=mesh_shape,
        placements=placements,
        local_shapes=draw(_local_shapes(global_shape, mesh_shape, placements)),
        seed=draw(st.integers(0, 2**16)),
        split_dim=split_dim,
        split_sections=tuple(draw(compositions(global_shape[split_dim], pieces))),
        load_shapes=draw(_local_shapes(global_shape, mesh_shape, placements)),
    )


def chunk_slices(chunk) -> tuple[slice, ...]:
    return tuple(
        slice(offset, offset + size)
        for offset, size in zip(chunk.offsets, chunk.sizes, strict=True)
    )


def coverage_counts(global_shape: tuple[int, ...], chunks) -> torch.Tensor:
    """How many distinct non-empty chunks cover each element (1 everywhere for a tiling)."""
    counts = torch.zeros(global_shape, dtype=torch.int64)
    seen = set()
    for chunk in chunks:
        key = (tuple(chunk.offsets), tuple(chunk.sizes))
        if math.prod(chunk.sizes) == 0 or key in seen:
            continue
        seen.add(key)
        counts[chunk_slices(chunk)] += 1
    return counts
