"""DCP round trips of unevenly sharded DTensors, and the state-dict helpers.

One checkpoint is saved on 2 ranks and loaded back into the same layout, a
different uneven layout, 1 rank and 3 ranks. Values must come back
bit-exact (``torch.equal``): a checkpoint only moves bytes.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from mf_dtensor import (
    filter_unflattened_state_dict,
    gather_uneven_dtensor_to_full_tensor,
    get_chunk_metadata,
    get_unflattened_state_dict,
    preprocess_state_dict_for_uneven_dtensor,
    rank_order_chunks,
    uneven_dtensor_from_local,
)
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.dtensor._cases import chunk_slices

# name: (global shape, shard dim, dtype)
TENSORS: dict[str, tuple[tuple[int, ...], int, torch.dtype]] = {
    "weight": ((10, 3), 0, torch.float32),
    "bias": ((7,), 0, torch.float32),  # flat-parameter style 1-D shard
    "emb": ((4, 9), 1, torch.float32),  # sharded along dim 1
    "half": ((5, 2), 0, torch.bfloat16),
    "nothing": ((0, 3), 0, torch.float32),  # no elements at all
}
# Local sizes along the shard dim, per world size and layout (zeros = empty shards).
LAYOUTS: dict[str, dict[str, list[int]]] = {
    "save2": {"weight": [7, 3], "bias": [0, 7], "emb": [9, 0], "half": [2, 3], "nothing": [0, 0]},
    "other2": {"weight": [2, 8], "bias": [7, 0], "emb": [4, 5], "half": [5, 0], "nothing": [0, 0]},
    "one": {"weight": [10], "bias": [7], "emb": [9], "half": [5], "nothing": [0]},
    "three": {
        "weight": [0, 4, 6],
        "bias": [3, 0, 4],
        "emb": [1, 7, 1],
        "half": [1, 1, 3],
        "nothing": [0, 0, 0],
    },
}


def _full(name: str, scale: float = 1.0) -> torch.Tensor:
    shape, _, dtype = TENSORS[name]
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _piece(full: torch.Tensor, dim: int, sizes: list[int], rank: int) -> tuple[torch.Tensor, int]:
    offset = sum(sizes[:rank])
    return full.narrow(dim, offset, sizes[rank]).clone(), offset


def _state_dict(rank: int, world_size: int, layout: str, *, filled: bool) -> dict[str, Any]:
    """Model + optimizer-like nested state dict; ``filled=False`` gives zeros and wrong scalars."""
    mesh = cpu_mesh((world_size,), ("dp",))
    model: dict[str, Any] = {}
    exp_avg: dict[str, Any] = {}
    for name, (shape, dim, _) in TENSORS.items():
        sizes = LAYOUTS[layout][name]
        full = _full(name) if filled else torch.zeros_like(_full(name))
        piece, offset = _piece(full, dim, sizes, rank)
        global_offset = [0] * len(shape)
        global_offset[dim] = offset
        # Parameters: offsets known locally, no communication.
        model[name] = uneven_dtensor_from_local(
            piece,
            mesh,
            [Shard(dim)],
            global_shape=shape,
            global_offset=global_offset,
            validate=False,
        )
        # Optimizer state made the way optimizers make it: a fresh DTensor, no metadata.
        state = _full(name, 2.0) if filled else torch.zeros_like(full)
        exp_avg[name] = DTensor.from_local(
            _piece(state, dim, sizes, rank)[0],
            mesh,
            [Shard(dim)],
            run_check=False,
            shape=state.shape,
            stride=state.stride(),
        )
    return {
        "model": model,
        "optim": {
            "state": {
                0: {"exp_avg": exp_avg["weight"], "step": torch.tensor(5.0 if filled else 0.0)},
                1: {"exp_avg": exp_avg["bias"], "exp_avg_sq": exp_avg["emb"]},
                2: {"exp_avg": exp_avg["half"], "exp_avg_sq": exp_avg["nothing"]},
            },
            "param_groups": [{"lr": 0.01 if filled else 0.0, "params": [0, 1, 2]}],
        },
        "iteration": 42 if filled else 0,
    }


def _expected_pieces(rank: int, layout: str) -> dict[tuple[Any, ...], torch.Tensor]:
    placements = {("model", name): (name, 1.0) for name in TENSORS} | {
        ("optim", "state", 0, "exp_avg"): ("weight", 2.0),
        ("optim", "state", 1, "exp_avg"): ("bias", 2.0),
        ("optim", "state", 1, "exp_avg_sq"): ("emb", 2.0),
        ("optim", "state", 2, "exp_avg"): ("half", 2.0),
        ("optim", "state", 2, "exp_avg_sq"): ("nothing", 2.0),
    }
    expected = {}
    for key, (name, scale) in placements.items():
        _, dim, _ = TENSORS[name]
        expected[key] = _piece(_full(name, scale), dim, LAYOUTS[layout][name], rank)[0]
    return expected


def _rank_save(rank: int, world_size: int, path: str) -> None:
    state_dict = preprocess_state_dict_for_uneven_dtensor(
        _state_dict(rank, world_size, "save2", filled=True)
    )
    weight = state_dict["model"]["weight"]
    assert get_chunk_metadata(weight).all_chunks == tuple(
        rank_order_chunks((10, 3), (2,), (Shard(0),), [(7, 3), (3, 3)])
    )
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path))
    # Alone in a checkpoint, rank 0's empty piece of "bias" starts at the same
    # offset as rank 1's real one: DCP must never see it (its chunk name would
    # collide with rank 1's and de-duplication could keep the empty one).
    alone = {"bias": state_dict["model"]["bias"]}
    dcp.save(alone, storage_writer=dcp.FileSystemWriter(f"{path}/alone"))


def _load_and_check(rank: int, world_size: int, path: str, layout: str) -> None:
    state_dict = preprocess_state_dict_for_uneven_dtensor(
        _state_dict(rank, world_size, layout, filled=False)
    )
    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path))
    for key, piece in _expected_pieces(rank, layout).items():
        loaded = get_unflattened_state_dict(state_dict, list(key))
        assert loaded.to_local().dtype == piece.dtype
        assert torch.equal(loaded.to_local(), piece), key
    for name in TENSORS:
        full = gather_uneven_dtensor_to_full_tensor(state_dict["model"][name]).to_local()
        assert torch.equal(full, _full(name)), name
    assert torch.equal(state_dict["optim"]["state"][0]["step"], torch.tensor(5.0))
    assert state_dict["optim"]["param_groups"] == [{"lr": 0.01, "params": [0, 1, 2]}]
    assert state_dict["iteration"] == 42


def _rank_load_two(rank: int, world_size: int, path: str) -> None:
    _load_and_check(rank, world_size, path, "save2")
    _load_and_check(rank, world_size, path, "other2")
    # Ranks holding different DTensors get the same clear error (no hang).
    state_dict = _state_dict(rank, world_size, "save2", filled=False)
    if rank == 1:
        del state_dict["model"]["bias"]
    with pytest.raises(ValueError, match="ranks of the mesh passed different DTensors"):
        preprocess_state_dict_for_uneven_dtensor(state_dict)


def _rank_load_one(rank: int, world_size: int, path: str) -> None:
    _load_and_check(rank, world_size, path, "one")
    # Consolidation: the same checkpoint loads into plain tensors too.
    plain = {"model": {name: torch.zeros_like(_full(name)) for name in TENSORS}}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(path))
    for name in TENSORS:
        assert torch.equal(plain["model"][name], _full(name)), name
    alone = {"bias": torch.zeros(7)}
    dcp.load(alone, storage_reader=dcp.FileSystemReader(f"{path}/alone"))
    assert torch.equal(alone["bias"], _full("bias"))


def _rank_load_three(rank: int, world_size: int, path: str) -> None:
    _load_and_check(rank, world_size, path, "three")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("uneven_ckpt"))
    run_on_ranks(_rank_save, 2, path)
    return path


@pytest.mark.multiprocess
def test_load_on_two_ranks_same_and_other_layout(checkpoint_dir: str) -> None:
    run_on_ranks(_rank_load_two, 2, checkpoint_dir)


@pytest.mark.multiprocess
def test_load_on_one_rank(checkpoint_dir: str) -> None:
    run_on_ranks(_rank_load_one, 1, checkpoint_dir)


@pytest.mark.multiprocess
def test_load_on_three_ranks(checkpoint_dir: str) -> None:
    run_on_ranks(_rank_load_three, 3, checkpoint_dir)


def _rank_two_dim_mesh_round_trip(rank: int, world_size: int, path: str) -> None:
    # Save Shard(0) x Replicate on a 2x2 mesh (replicas write once), load into
    # Replicate x Shard(1) with other sizes, then into a 1-D mesh of 4.
    mesh = cpu_mesh((2, 2), ("a", "b"))
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    layouts = [
        ((Shard(0), Replicate()), [(6, 5), (6, 5), (0, 5), (0, 5)]),
        ((Replicate(), Shard(1)), [(6, 2), (6, 3), (6, 2), (6, 3)]),
    ]

    def build(placements, shapes, values, device_mesh=mesh):
        chunks = rank_order_chunks((6, 5), device_mesh.shape, placements, shapes)
        piece = values[chunk_slices(chunks[rank])].clone()
        return uneven_dtensor_from_local(piece, device_mesh, placements, global_shape=(6, 5))

    saved = {"w": build(*layouts[0], full)}
    dcp.save(preprocess_state_dict_for_uneven_dtensor(saved), checkpoint_id=path)
    loaded = {"w": build(*layouts[1], torch.zeros_like(full))}
    dcp.load(preprocess_state_dict_for_uneven_dtensor(loaded), checkpoint_id=path)
    assert torch.equal(gather_uneven_dtensor_to_full_tensor(loaded["w"]).to_local(), full)
    flat_mesh = cpu_mesh((4,), ("dp",))
    shapes = [(1, 5), (0, 5), (5, 5), (0, 5)]
    loaded = {"w": build((Shard(0),), shapes, torch.zeros_like(full), flat_mesh)}
    dcp.load(preprocess_state_dict_for_uneven_dtensor(loaded), checkpoint_id=path)
    assert torch.equal(gather_uneven_dtensor_to_full_tensor(loaded["w"]).to_local(), full)
    dist.barrier()


@pytest.mark.multiprocess
def test_two_dim_mesh_round_trip(tmp_path) -> None:
    run_on_ranks(_rank_two_dim_mesh_round_trip, 4, str(tmp_path), timeout=180)


def test_filter_and_get_unflattened_state_dict() -> None:
    marker = torch.ones(1)
    state_dict = {
        "model": {"a": marker, "b": 3},
        "optim": {"state": {0: {"m": marker}}, "groups": [{"x": marker}, "y"]},
    }
    found = filter_unflattened_state_dict(state_dict, visit_condition=lambda v: v is marker)
    assert found == [["model", "a"], ["optim", "state", 0, "m"], ["optim", "groups", 0, "x"]]
    for chain in found:
        assert get_unflattened_state_dict(state_dict, chain) is marker
    assert filter_unflattened_state_dict(state_dict) == []  # default: DTensors only
    prefixed = filter_unflattened_state_dict(
        state_dict["model"], ["model"], lambda v: isinstance(v, int)
    )
    assert prefixed == [["model", "b"]]
    assert get_unflattened_state_dict(state_dict, []) is state_dict
    with pytest.raises(KeyError, match=r"no entry 'c' under \['model'\] \(a dict\)"):
        get_unflattened_state_dict(state_dict, ["model", "c"])
    with pytest.raises(KeyError, match=r"no entry 5 under \['optim', 'groups'\] \(a list\)"):
        get_unflattened_state_dict(state_dict, ["optim", "groups", 5])
