"""Pure math of mf-tp, in-process: last-dim splits, vocab ranges, config, sharded init."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mf_rng
import mf_tp


@given(
    leading=st.lists(st.integers(0, 3), max_size=2),
    parts=st.integers(1, 4),
    width=st.integers(1, 3),
    contiguous=st.booleans(),
)
def test_split_tensor_along_last_dim(
    leading: list[int], parts: int, width: int, contiguous: bool
) -> None:
    tensor = torch.arange(torch.Size([*leading, parts * width]).numel()).view(
        *leading, parts * width
    )
    chunks = mf_tp.split_tensor_along_last_dim(tensor, parts, contiguous)
    assert len(chunks) == parts
    assert all(chunk.shape == (*leading, width) for chunk in chunks)
    assert torch.equal(torch.cat(chunks, dim=-1), tensor)
    if contiguous:
        assert all(chunk.is_contiguous() for chunk in chunks)


def test_split_tensor_along_last_dim_rejects_uneven() -> None:
    with pytest.raises(ValueError, match="7 is not divisible by 2"):
        mf_tp.split_tensor_along_last_dim(torch.zeros(3, 7), 2)


@given(per_partition=st.integers(0, 50), world=st.integers(1, 8), data=st.data())
def test_vocab_ranges_tile_the_vocab(per_partition: int, world: int, data: st.DataObject) -> None:
    ranges = [
        mf_tp.VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, r, world)
        for r in range(world)
    ]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == per_partition * world
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    rank = data.draw(st.integers(0, world - 1))
    global_range = mf_tp.VocabUtility.vocab_range_from_global_vocab_size(
        per_partition * world, rank, world
    )
    assert tuple(global_range) == tuple(ranges[rank])


def test_vocab_range_errors() -> None:
    with pytest.raises(ValueError, match="10 is not divisible by 3"):
        mf_tp.VocabUtility.vocab_range_from_global_vocab_size(10, 0, 3)
    with pytest.raises(ValueError, match="rank must be in"):
        mf_tp.VocabUtility.vocab_range_from_per_partition_vocab_size(4, 2, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_model_parallel_size": 0}, ValueError, "tensor_model_parallel_size must be"),
        ({"sequence_parallel": True}, ValueError, "sequence_parallel=True needs"),
        ({"params_dtype": torch.int32}, TypeError, "params_dtype must be a floating"),
        ({"wgrad_deferral_limit": -1}, ValueError, "wgrad_deferral_limit must be"),
        ({"layernorm_epsilon": 0.0}, ValueError, "layernorm_epsilon must be positive"),
    ],
)
def test_config_validation(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        mf_tp.ModelParallelConfig(**kwargs)


def test_config_is_frozen() -> None:
    config = mf_tp.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sequence_parallel = False  # type: ignore[misc]


@given(
    world=st.sampled_from([1, 2, 4]),
    stride=st.sampled_from([1, 2, 3]),
    partition_dim=st.sampled_from([0, 1]),
    block=st.integers(1, 2),
)
def test_cpu_init_shards_reassemble_the_master(
    world: int, stride: int, partition_dim: int, block: int
) -> None:
    """Any TP size and stride: the shards interleave back into the same full weight."""
    per_partition = stride * block
    full_shape = [5, 5]
    full_shape[partition_dim] = per_partition * world
    shards, masters = [], []
    for rank in range(world):
        shard_shape = list(full_shape)
        shard_shape[partition_dim] = per_partition
        weight = torch.empty(shard_shape)
        torch.manual_seed(0)
        masters.append(
            mf_tp.initialize_affine_weight_cpu(
                weight,
                *full_shape,
                per_partition,
                partition_dim,
                torch.nn.init.normal_,
                stride,
                return_master_weight=True,
                rank=rank,
                world_size=world,
            )
        )
        shards.append(weight)
        assert weight.partition_dim == partition_dim
    torch.manual_seed(0)
    expected = torch.nn.init.normal_(torch.empty(full_shape))
    assert all(torch.equal(m, expected) for m in masters)
    # Piece k of rank r is piece k * world + r of the master.
    piece = per_partition // stride
    master_pieces = expected.split(piece, dim=partition_dim)
    for rank, shard in enumerate(shards):
        for k, got in enumerate(shard.split(piece, dim=partition_dim)):
            assert torch.equal(got, master_pieces[k * world + rank])


def test_init_errors() -> None:
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        mf_tp.initialize_affine_weight_cpu(
            torch.empty(2, 2), 4, 2, 2, 0, torch.nn.init.normal_, rank=2, world_size=2
        )
    with pytest.raises(ValueError, match="does not equal the full size"):
        mf_tp.initialize_affine_weight_cpu(
            torch.empty(3, 2), 4, 2, 3, 0, torch.nn.init.normal_, rank=0, world_size=2
        )


def test_group_is_required_without_initialisation() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        mf_tp.copy_to_tensor_model_parallel_region(torch.zeros(1))
    with pytest.raises(TypeError, match="group must be a ProcessGroup or None"):
        mf_tp.copy_to_tensor_model_parallel_region(torch.zeros(1), group="tp")


def test_on_device_init_needs_a_seeded_tracker() -> None:
    with mf_rng.use_rng_tracker(mf_rng.RNGStatesTracker(device="cpu")):
        with pytest.raises(RuntimeError, match="call mf_rng.model_parallel_cuda_manual_seed"):
            mf_tp.initialize_affine_weight_on_device(
                torch.empty(2, 2), 2, 2, 2, 0, torch.nn.init.normal_, rank=0, world_size=1
            )
        mf_rng.model_parallel_cuda_manual_seed(0, device="cpu")
        weight = torch.empty(2, 2)
        mf_tp.initialize_affine_weight_on_device(
            weight, 2, 2, 2, 0, torch.nn.init.normal_, rank=0, world_size=1
        )
        assert weight.tensor_model_parallel
