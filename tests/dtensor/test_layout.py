"""In-process tests of the pure layout math (no process group)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from mf_dtensor import rank_order_chunks, split_sections, validate_chunk_layout
from mf_dtensor.layout import (
    check_placements,
    contiguous_stride,
    make_chunk,
    mesh_coordinates,
    narrow_chunk,
    sharding_mesh_dims,
)
from tests.dtensor._cases import chunk_slices, compositions, coverage_counts, layout_cases

MESH_SHAPES = [(1,), (2,), (3,), (2, 2), (1, 3), (3, 1), (2, 3), (2, 1, 2)]


@given(layout_cases(MESH_SHAPES))
def test_rank_order_chunks_tile_the_tensor(case) -> None:
    chunks = rank_order_chunks(
        case.global_shape, case.mesh_shape, case.placements, case.local_shapes
    )
    assert [tuple(c.sizes) for c in chunks] == list(case.local_shapes)
    # Independent of validate_chunk_layout: every element is covered exactly once.
    assert bool((coverage_counts(case.global_shape, chunks) == 1).all())
    validate_chunk_layout(
        case.global_shape, chunks, mesh_shape=case.mesh_shape, placements=case.placements
    )
    # Pieces follow mesh-coordinate order along every sharded dim.
    coordinates = mesh_coordinates(case.mesh_shape)
    for dim in range(len(case.global_shape)):
        mesh_dims = sharding_mesh_dims(case.placements, dim)
        order = sorted(
            range(len(chunks)), key=lambda rank: tuple(coordinates[rank][m] for m in mesh_dims)
        )
        offsets = [chunks[rank].offsets[dim] for rank in order]
        assert offsets == sorted(offsets)
        if not mesh_dims:
            assert set(offsets) <= {0}


@st.composite
def one_dim_layouts(draw: st.DrawFn) -> tuple[int, list]:
    total = draw(st.integers(1, 12))
    sizes = draw(compositions(total, draw(st.integers(2, 4))))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return total, [make_chunk([s], [n]) for s, n in zip(starts, sizes, strict=True)]


@given(one_dim_layouts(), st.data())
def test_validate_rejects_grown_and_shrunk_chunks(layout, data) -> None:
    total, chunks = layout
    validate_chunk_layout((total,), chunks)
    nonempty = [i for i, c in enumerate(chunks) if c.sizes[0] > 0]
    victim = data.draw(st.sampled_from(nonempty))
    offset, size = chunks[victim].offsets[0], chunks[victim].sizes[0]

    shrunk = list(chunks)
    shrunk[victim] = make_chunk([offset], [size - 1])
    with pytest.raises(ValueError, match=r"chunks cover \d+ of the \d+ elements .* leaving gaps"):
        validate_chunk_layout((total,), shrunk)

    grown = list(chunks)
    grown[victim] = make_chunk([offset], [size + 1])
    expected = "out of bounds" if offset + size == total else "overlap"
    with pytest.raises(ValueError, match=expected):
        validate_chunk_layout((total,), grown)


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([([0, 0], [3, 2]), ([2, 0], [3, 2])], r"rank 0 .* and rank 1 .* overlap"),
        ([([0, 0], [2, 2]), ([3, 0], [2, 2])], "cover 8 of the 10 elements"),
        ([([0, 0], [3, 2]), ([3, 0], [3, 2])], r"rank 1 .* out of bounds in dim 0"),
        ([([0, 0], [5, 2]), ([-1, 0], [0, 2])], "out of bounds"),
        ([([0], [5])], "does not have 2 dims"),
    ],
)
def test_validate_messages(chunks, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate_chunk_layout((5, 2), [make_chunk(o, s) for o, s in chunks])


def test_validate_replicas_must_agree() -> None:
    placements = (Shard(0), Replicate())
    good = [make_chunk([0], [2])] * 2 + [make_chunk([2], [3])] * 2
    validate_chunk_layout((5,), good, mesh_shape=(2, 2), placements=placements)
    bad = [good[0], make_chunk([0], [1]), *good[2:]]
    with pytest.raises(ValueError, match="ranks 0 and 1 are replicas"):
        validate_chunk_layout((5,), bad, mesh_shape=(2, 2), placements=placements)
    with pytest.raises(ValueError, match=r"one chunk per rank of mesh \(2, 2\)"):
        validate_chunk_layout((5,), good[:3], mesh_shape=(2, 2), placements=placements)


def test_rank_order_chunks_errors() -> None:
    with pytest.raises(ValueError, match="disagree on its size"):
        rank_order_chunks((5,), (2, 2), (Shard(0), Replicate()), [(2,), (3,), (3,), (3,)])
    with pytest.raises(ValueError, match=r"one shape per rank of mesh \(2,\) \(2\), got 3"):
        rank_order_chunks((5,), (2,), (Shard(0),), [(2,), (3,), (0,)])
    with pytest.raises(ValueError, match=r"local_shapes\[1\]: expected 1 dims"):
        rank_order_chunks((5,), (2,), (Shard(0),), [(2,), (3, 1)])


def test_nested_sharding_of_one_dim_is_outer_major() -> None:
    # Shard(0) on both mesh dims: mesh dim 0 picks the outer block, mesh dim 1 the inner piece.
    chunks = rank_order_chunks((10,), (2, 2), (Shard(0), Shard(0)), [(1,), (4,), (0,), (5,)])
    assert [c.offsets[0] for c in chunks] == [0, 1, 5, 5]


@pytest.mark.parametrize(
    ("placements", "match"),
    [
        ((Partial(),), r"placements\[0\]: expected Shard\(dim\) or Replicate\(\), got Partial"),
        ((Shard(2),), r"placements\[0\]: .* shards dim 2, but the tensor has 2 dims"),
        ((Shard(0), Shard(1)), r"one placement per mesh dim \(1\), got 2"),
    ],
)
def test_check_placements(placements, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_placements(placements, ndim=2, mesh_ndim=1)


@given(st.integers(0, 20), st.integers(1, 7))
def test_split_sections_int_matches_torch_split(size: int, step: int) -> None:
    expected = [piece.shape[0] for piece in torch.arange(size).split(step)]
    sections = split_sections(size, step)
    assert [length for _, length in sections] == expected
    assert [start for start, _ in sections] == [sum(expected[:i]) for i in range(len(expected))]


@given(st.integers(0, 20).flatmap(lambda n: compositions(n, 4).map(lambda s: (n, s))))
def test_split_sections_list_matches_torch_split(case) -> None:
    size, sizes = case
    expected = [piece.shape[0] for piece in torch.arange(size).split(sizes)]
    assert [length for _, length in split_sections(size, sizes)] == expected


@pytest.mark.parametrize(
    ("sections", "error", "match"),
    [
        ([2, 2], ValueError, r"sections \[2, 2\] sum to 4, but the split dim has size 5"),
        ([6, -1], ValueError, "expected non-negative ints"),
        (0, ValueError, "expected a positive int, got 0"),
        (True, TypeError, "expected an int or a list of ints"),
        (2.5, TypeError, "expected an int or a list of ints, got 2.5"),
    ],
)
def test_split_sections_bad_input(sections, error, match) -> None:
    with pytest.raises(error, match=match):
        split_sections(5, sections)


@given(layout_cases(MESH_SHAPES), st.data())
def test_narrow_chunk_extracts_the_right_data(case, data) -> None:
    full = case.full_tensor()
    dim = case.split_dim
    start = data.draw(st.integers(0, case.global_shape[dim]))
    length = data.draw(st.integers(0, case.global_shape[dim] - start))
    slab = full.narrow(dim, start, length)
    chunks = rank_order_chunks(
        case.global_shape, case.mesh_shape, case.placements, case.local_shapes
    )
    subs = []
    for chunk in chunks:
        sub, local_start, local_length = narrow_chunk(chunk, dim, start, length)
        local = full[chunk_slices(chunk)]
        assert torch.equal(local.narrow(dim, local_start, local_length), slab[chunk_slices(sub)])
        subs.append(sub)
    validate_chunk_layout(slab.shape, subs, mesh_shape=case.mesh_shape, placements=case.placements)


@given(st.lists(st.integers(0, 5), max_size=4))
def test_contiguous_stride_matches_torch(shape) -> None:
    assert contiguous_stride(shape) == torch.empty(shape).stride()
