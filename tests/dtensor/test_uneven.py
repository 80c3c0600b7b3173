"""Multi-rank tests: building, validating, gathering and splitting uneven DTensors.

Property tests draw whole lists of layouts with hypothesis in the parent and
check them all inside one spawn of the ranks; each case is also saved with
DCP and loaded into a second random layout of the same mesh. Every comparison is exact
(``torch.equal``): gathering and splitting only move data, so any
difference at all is a bug.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from mf_dtensor import (
    assemble_full_tensor_from_uneven_chunks,
    attach_chunk_metadata,
    gather_and_compute_chunk_metadata,
    gather_uneven_dtensor_to_full_tensor,
    get_chunk_metadata,
    preprocess_state_dict_for_uneven_dtensor,
    rank_order_chunks,
    split_dtensor,
    uneven_dtensor_from_local,
    validate_uneven_dtensor,
)
from mf_dtensor.chunk_metadata import local_mesh_index
from mf_dtensor.layout import make_chunk
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.dtensor._cases import LayoutCase, chunk_slices, layout_cases

MESH_SHAPES = {2: [(2,), (1, 2), (2, 1)], 3: [(3,), (1, 3)], 4: [(2, 2), (4,)]}


def _replicated_full(dtensor: DTensor) -> torch.Tensor:
    gathered = gather_uneven_dtensor_to_full_tensor(dtensor)
    assert isinstance(gathered, DTensor)
    assert all(isinstance(p, Replicate) for p in gathered.placements)
    assert gathered.shape == dtensor.shape
    return gathered.to_local()


def _check_case(case: LayoutCase, mesh, path: str) -> None:
    full = case.full_tensor()
    chunks = rank_order_chunks(
        case.global_shape, case.mesh_shape, case.placements, case.local_shapes
    )
    mine = chunks[local_mesh_index(mesh)]
    local = full[chunk_slices(mine)].clone()

    by_order = uneven_dtensor_from_local(
        local, mesh, case.placements, global_shape=case.global_shape
    )
    assert get_chunk_metadata(by_order).local == mine
    assert get_chunk_metadata(by_order).all_chunks == tuple(chunks)
    empty_here = math.prod(mine.sizes) == 0 and full.numel() > 0
    assert by_order.__create_chunk_list__() == ([] if empty_here else [mine])

    by_offset = uneven_dtensor_from_local(
        local.clone(),
        mesh,
        case.placements,
        global_shape=case.global_shape,
        global_offset=mine.offsets,
    )
    assert gather_and_compute_chunk_metadata(by_offset) == mine
    validate_uneven_dtensor(by_offset)

    bare = DTensor.from_local(
        local, mesh, case.placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    for dtensor in (by_order, by_offset, bare):
        assert torch.equal(_replicated_full(dtensor), full)
    assert get_chunk_metadata(bare).all_chunks == tuple(chunks)  # cached by the gather

    sections = list(case.split_sections)
    expected = full.split(sections, dim=case.split_dim)
    fresh = DTensor.from_local(
        local, mesh, case.placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    for source, attach in ((fresh, False), (by_order, True)):
        pieces = list(split_dtensor(source, sections, case.split_dim, attach))
        assert len(pieces) == len(expected)
        for piece, reference in zip(pieces, expected, strict=True):
            assert piece.shape == reference.shape
            assert piece.placements == source.placements
            assert (get_chunk_metadata(piece) is not None) == attach
            if piece.to_local().numel() > 0:  # a view of the source: nothing materialised
                storage = piece.to_local().untyped_storage().data_ptr()
                assert storage == local.untyped_storage().data_ptr()
            assert torch.equal(_replicated_full(piece), reference)

    # DCP: save this layout, load into another random layout, bit-exact.
    dcp.save(preprocess_state_dict_for_uneven_dtensor({"x": fresh}), checkpoint_id=path)
    load_chunks = rank_order_chunks(
        case.global_shape, case.mesh_shape, case.placements, case.load_shapes
    )
    target_chunk = load_chunks[local_mesh_index(mesh)]
    target = DTensor.from_local(
        torch.zeros(target_chunk.sizes),
        mesh,
        case.placements,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )
    dcp.load(preprocess_state_dict_for_uneven_dtensor({"x": target}), checkpoint_id=path)
    assert torch.equal(target.to_local(), full[chunk_slices(target_chunk)])


def _rank_property_cases(
    rank: int, world_size: int, cases: list[LayoutCase], directory: str
) -> None:
    meshes = {}
    for index, case in enumerate(cases):
        if case.mesh_shape not in meshes:
            names = tuple(f"m{i}" for i in range(len(case.mesh_shape)))
            meshes[case.mesh_shape] = cpu_mesh(case.mesh_shape, names)
        _check_case(case, meshes[case.mesh_shape], f"{directory}/case{index}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3, 4])
@settings(
    max_examples=1,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_uneven_layout_properties(world_size: int, data) -> None:
    cases = data.draw(
        st.lists(layout_cases(MESH_SHAPES[world_size]), min_size=16, max_size=16), label="cases"
    )
    with tempfile.TemporaryDirectory(prefix="mf-dtensor-") as directory:
        run_on_ranks(_rank_property_cases, world_size, cases, directory, timeout=240)


def _rank_1d_flat_params(rank: int, world_size: int) -> None:
    # The FSDP use: a flat bucket cut at arbitrary element offsets, each
    # parameter a 1-D DTensor of shape (numel,) with the overlap as its piece.
    mesh = cpu_mesh((world_size,), ("dp",))
    numels = [5, 1, 7, 3]
    shard = math.ceil(sum(numels) / world_size)
    low, high = rank * shard, (rank + 1) * shard
    start = 0
    for numel in numels:
        full = torch.arange(numel, dtype=torch.float64) + 100 * start
        # This rank's range of the parameter, in parameter coordinates (maybe empty).
        lo = min(max(low - start, 0), numel)
        hi = min(max(high - start, 0), numel)
        dtensor = uneven_dtensor_from_local(
            full[lo:hi], mesh, [Shard(0)], global_shape=(numel,), global_offset=(lo,)
        )
        assert torch.equal(_replicated_full(dtensor), full)
        target = gather_uneven_dtensor_to_full_tensor(dtensor, target_device=torch.device("cpu"))
        assert target.to_local().device == torch.device("cpu")
        start += numel


@pytest.mark.multiprocess
def test_flat_bucket_parameters() -> None:
    run_on_ranks(_rank_1d_flat_params, 3)


def _rank_bad_input(rank: int, world_size: int) -> None:
    mesh = cpu_mesh((2,), ("dp",))
    full = torch.arange(10.0).reshape(5, 2)

    def build(offset: int, size: int, *, validate: bool = True) -> DTensor:
        return uneven_dtensor_from_local(
            full[offset : offset + size].clone(),
            mesh,
            [Shard(0)],
            global_shape=(5, 2),
            global_offset=(offset, 0),
            validate=validate,
        )

    overlap = [(0, 3), (2, 3)][rank]
    with pytest.raises(ValueError, match=r"chunks of rank 0 .* and rank 1 .* overlap"):
        build(*overlap)
    gap = [(0, 2), (3, 2)][rank]
    with pytest.raises(ValueError, match=r"cover 8 of the 10 elements .* leaving gaps"):
        build(*gap)
    unchecked = build(*gap, validate=False)  # no communication, no check...
    with pytest.raises(ValueError, match="leaving gaps"):
        validate_uneven_dtensor(unchecked)  # ...until asked
    with pytest.raises(ValueError, match="leaving gaps"):
        gather_uneven_dtensor_to_full_tensor(unchecked)

    # Shard-order offsets from local sizes that do not sum to the dim.
    short = torch.zeros([2, 2][rank], 2)
    with pytest.raises(ValueError, match="cover 8 of the 10 elements"):
        uneven_dtensor_from_local(short, mesh, [Shard(0)], global_shape=(5, 2))
    long = torch.zeros([3, 3][rank], 2)
    with pytest.raises(ValueError, match=r"rank 1 .* out of bounds in dim 0"):
        uneven_dtensor_from_local(long, mesh, [Shard(0)], global_shape=(5, 2))

    low, high = [(0, 1), (1, 5)][rank]
    good = uneven_dtensor_from_local(full[low:high].clone(), mesh, [Shard(0)], global_shape=(5, 2))
    with pytest.raises(
        ValueError, match=r"sections \[2, 2\] sum to 4, but the split dim has size 5"
    ):
        split_dtensor(good, [2, 2])  # raised at call time, not on first iteration
    with pytest.raises(ValueError, match="dim: expected a dim of a 2-D DTensor, got 2"):
        split_dtensor(good, 1, dim=2)
    with pytest.raises(TypeError, match="dtensor: expected a DTensor, got Tensor"):
        gather_uneven_dtensor_to_full_tensor(full)

    with pytest.raises(ValueError, match=r"placements\[0\]: expected Shard\(dim\) or Replicate"):
        uneven_dtensor_from_local(full, mesh, [Partial()], global_shape=(5, 2))
    local_only = {"device_mesh": mesh, "placements": [Shard(0)], "global_shape": (5, 2)}
    with pytest.raises(ValueError, match=r"dim 1 is not sharded, so its size must equal"):
        uneven_dtensor_from_local(full[:, :1], **local_only, global_offset=(0, 0), validate=False)
    with pytest.raises(ValueError, match=r"global_offset: dim 1 is not sharded, so its offset"):
        uneven_dtensor_from_local(full[:1], **local_only, global_offset=(0, 1), validate=False)
    with pytest.raises(ValueError, match=r"global_offset: expected 2 offsets, got \(0,\)"):
        uneven_dtensor_from_local(full[:1], **local_only, global_offset=(0,))
    # A mistake on one rank only, with validation: every rank raises, none hangs.
    piece, offset = [(full[:2], (0, 0)), (full[2:, :1], (2, 0))][rank]
    with pytest.raises(ValueError, match="cover 7 of the 10 elements"):
        uneven_dtensor_from_local(piece, **local_only, global_offset=offset)
    with pytest.raises(ValueError, match=r"chunk of rank 0 \(offsets=\(4, 0\) .* out of bounds"):
        uneven_dtensor_from_local(
            full[:2], mesh, [Shard(0)], global_shape=(5, 2), global_offset=(4, 0)
        )
    with pytest.raises(ValueError, match=r"offsets \(4, 0\) put the local piece .* outside"):
        uneven_dtensor_from_local(
            full[:2], mesh, [Shard(0)], global_shape=(5, 2), global_offset=(4, 0), validate=False
        )
    with pytest.raises(TypeError, match="local_tensor: expected a plain torch.Tensor"):
        uneven_dtensor_from_local(good, mesh, [Shard(0)], global_shape=(5, 2))

    # Attached metadata on one rank only: both ranks see the same gathered flags.
    low, high = [(0, 1), (1, 5)][rank]
    mixed = DTensor.from_local(
        full[low:high].clone(),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )
    if rank == 0:
        attach_chunk_metadata(mixed, make_chunk((0, 0), (1, 2)))
    with pytest.raises(ValueError, match=r"ranks \[1\] of the mesh give no chunk offsets"):
        validate_uneven_dtensor(mixed)

    # Explicit offsets need not follow mesh order: rank 0 holds the tail here.
    low, high = [(3, 5), (0, 3)][rank]
    reversed_order = uneven_dtensor_from_local(
        full[low:high].clone(), mesh, [Shard(0)], global_shape=(5, 2), global_offset=(low, 0)
    )
    assert torch.equal(_replicated_full(reversed_order), full)
    # gather_and_compute_chunk_metadata is about mesh order only: rank 0 first.
    assert gather_and_compute_chunk_metadata(reversed_order).offsets[0] == [0, 2][rank]

    chunks = [make_chunk((0, 0), (1, 2)), make_chunk((1, 0), (4, 2))]
    with pytest.raises(ValueError, match="all_chunk_info: expected 2 chunks"):
        assemble_full_tensor_from_uneven_chunks(good, chunks[:1], dist.group.WORLD)
    swapped = chunks[::-1]
    with pytest.raises(ValueError, match=r"pieces of members \[0, 1\] do not have the sizes"):
        assemble_full_tensor_from_uneven_chunks(good, swapped, dist.group.WORLD)
    full_dt = assemble_full_tensor_from_uneven_chunks(good, chunks, dist.group.WORLD)
    assert torch.equal(full_dt.to_local(), full)


@pytest.mark.multiprocess
def test_bad_input_is_rejected_clearly() -> None:
    run_on_ranks(_rank_bad_input, 2)


def _rank_two_dim_mesh(rank: int, world_size: int) -> None:
    # Shard on one mesh dim and Replicate on the other, both orders, plus a
    # 2-D Shard(0) x Shard(1) layout: gather through the hierarchical path.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    layouts = [
        ((Shard(0), Replicate()), [(0, 5), (0, 5), (7, 5), (7, 5)]),
        ((Replicate(), Shard(1)), [(7, 1), (7, 4), (7, 1), (7, 4)]),
        ((Shard(0), Shard(1)), [(3, 0), (3, 5), (4, 0), (4, 5)]),
    ]
    for placements, shapes in layouts:
        chunks = rank_order_chunks((7, 5), (2, 2), placements, shapes)
        mine = chunks[rank]
        dtensor = uneven_dtensor_from_local(
            full[chunk_slices(mine)].clone(), mesh, placements, global_shape=(7, 5)
        )
        assert torch.equal(_replicated_full(dtensor), full)
        for piece, reference in zip(
            split_dtensor(dtensor, 2, 1, True), full.split(2, 1), strict=True
        ):
            assert torch.equal(_replicated_full(piece), reference)
    bad = [(2,), (3,), (2,), (2,)][rank]
    with pytest.raises(ValueError, match="disagree on its size"):
        uneven_dtensor_from_local(
            torch.zeros(bad), mesh, (Shard(0), Replicate()), global_shape=(5,)
        )
    offsets = [(0,), (1,), (2,), (2,)][rank]
    with pytest.raises(ValueError, match="are replicas .* but hold different chunks"):
        uneven_dtensor_from_local(
            torch.zeros(([2, 1, 3, 3])[rank]),
            mesh,
            (Shard(0), Replicate()),
            global_shape=(5,),
            global_offset=offsets,
        )


@pytest.mark.multiprocess
def test_two_dim_mesh() -> None:
    run_on_ranks(_rank_two_dim_mesh, 4, timeout=180)
