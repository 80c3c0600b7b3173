"""Bad global shapes at mf_dtensor's public entry points: clear errors naming the argument.

Pure layout functions are checked in-process; the DTensor constructors on two
gloo ranks, where both ranks raise before any communication (so neither waits
on the other) and the group stays usable afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from mf_dtensor import (
    ExplicitPieces,
    UnevenDTensor,
    assemble_full_tensor_from_uneven_chunks,
    attach_chunk_metadata,
    gather_uneven_dtensor_to_full_tensor,
    rank_order_chunks,
    uneven_dtensor_from_local,
    validate_chunk_layout,
)
from mf_dtensor.layout import check_shape, make_chunk
from tests._multiprocess import cpu_mesh, run_on_ranks

# (bad shape, error type, message for an argument called "global_shape")
BAD_SHAPES = [
    ((-4,), ValueError, r"global_shape: expected non-negative sizes, got \(-4,\)"),
    ((2, -1), ValueError, r"global_shape: expected non-negative sizes, got \(2, -1\)"),
    (
        (4.5,),
        TypeError,
        r"global_shape: expected a sequence of non-negative ints .*4\.5 is a float",
    ),
    (("4",), TypeError, r"global_shape: expected a sequence of non-negative ints .*'4' is a str"),
    (
        (True,),
        TypeError,
        r"global_shape: expected a sequence of non-negative ints .*True is a bool",
    ),
    (4, TypeError, r"global_shape: expected a sequence of non-negative ints \(a shape\), got 4"),
    (None, TypeError, r"global_shape: expected a sequence .*, got None"),
    ("4", TypeError, r"global_shape: expected a sequence .*, got '4'"),
]


@pytest.mark.parametrize(("shape", "error", "match"), BAD_SHAPES)
def test_check_shape_names_argument_and_value(shape, error, match) -> None:
    with pytest.raises(error, match=match):
        check_shape(shape, "global_shape")


def test_check_shape_accepts_integer_likes_and_empty_dims() -> None:
    assert check_shape(torch.Size([3, 0]), "s") == (3, 0)
    assert check_shape([torch.tensor(4), 2], "s") == (4, 2)
    assert check_shape((x for x in (1, 2)), "s") == (1, 2)
    assert check_shape((), "s") == ()


@pytest.mark.parametrize(("shape", "error", "match"), BAD_SHAPES[:4])
def test_rank_order_chunks_rejects_bad_global_shape(shape, error, match) -> None:
    with pytest.raises(error, match=match):
        rank_order_chunks(shape, (1,), [Shard(0)], [(4,)])


@pytest.mark.parametrize(("shape", "error", "match"), BAD_SHAPES[:4])
def test_validate_chunk_layout_rejects_bad_global_shape(shape, error, match) -> None:
    with pytest.raises(error, match=match):
        validate_chunk_layout(shape, [make_chunk((0,), (4,))])


def _rank_bad_global_shape(rank: int, world_size: int) -> None:
    mesh = cpu_mesh((world_size,), ("dp",))
    local = torch.zeros(2)
    pieces = ExplicitPieces(tuple((make_chunk((2 * r,), (2,)),) for r in range(world_size)))
    for shape, error, match in BAD_SHAPES:
        with pytest.raises(error, match=match):  # with a collective after the check
            uneven_dtensor_from_local(local, mesh, [Shard(0)], global_shape=shape)
        with pytest.raises(error, match=match):  # local only
            uneven_dtensor_from_local(
                local,
                mesh,
                [Shard(0)],
                global_shape=shape,
                global_offset=(2 * rank,),
                validate=False,
            )
        with pytest.raises(error, match=match.replace("global_shape", "shape")):
            UnevenDTensor.from_local(local, mesh, [Shard(0)], shape=shape, pieces=pieces)
    # Nothing was left half-done: valid calls (one with a collective) still work.
    dtensor = uneven_dtensor_from_local(local, mesh, [Shard(0)], global_shape=(4,))
    assert tuple(dtensor.shape) == (4,)
    uneven = UnevenDTensor.from_local(local, mesh, [Shard(0)], shape=(4,), pieces=pieces)
    assert tuple(uneven.shape) == (4,)


@pytest.mark.multiprocess
def test_bad_global_shape_on_ranks() -> None:
    run_on_ranks(_rank_bad_global_shape, 2, timeout=120)


def _rank_dtype_differs(rank: int, world_size: int) -> None:
    mesh = cpu_mesh((world_size,), ("dp",))
    local = torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    match = r"dtensors: ranks of the mesh hold local pieces of different dtypes \(this rank: "
    with pytest.raises(ValueError, match=match + str(local.dtype)):  # the layout exchanged
        uneven_dtensor_from_local(local, mesh, [Shard(0)], global_shape=(4,))
    dtensor = uneven_dtensor_from_local(
        local, mesh, [Shard(0)], global_shape=(4,), global_offset=(2 * rank,), validate=False
    )
    with pytest.raises(ValueError, match=match):  # the gather exchanges it first
        gather_uneven_dtensor_to_full_tensor(dtensor)
    # Every rank's chunk given, so no layout is exchanged: the gather agrees on dtypes first
    # (gloo aborted the process in C++ here, EnforceNotMet).
    chunks = [make_chunk((0,), (2,)), make_chunk((2,), (2,))]
    with pytest.raises(ValueError, match=match):
        assemble_full_tensor_from_uneven_chunks(dtensor, chunks)
    attach_chunk_metadata(dtensor, chunks[rank], chunks)
    with pytest.raises(ValueError, match=match):
        gather_uneven_dtensor_to_full_tensor(dtensor)
    # The group is still usable: the same dtype everywhere gathers.
    same = uneven_dtensor_from_local(
        torch.full((2,), float(rank)), mesh, [Shard(0)], global_shape=(4,)
    )
    full = gather_uneven_dtensor_to_full_tensor(same).to_local()
    assert full.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.multiprocess
def test_pieces_of_different_dtypes_stop_with_one_line() -> None:
    """Pieces whose dtype differs across ranks raise on every rank, not gloo's abort."""
    run_on_ranks(_rank_dtype_differs, 2, timeout=120)
