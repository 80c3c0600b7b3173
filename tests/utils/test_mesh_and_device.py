from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mf_utils import contains_submesh, get_group_device, get_mesh_names
from tests._multiprocess import cpu_mesh, run_on_ranks


def test_no_mesh() -> None:
    assert get_mesh_names(None) == []
    assert contains_submesh(None, "dp") is False


@pytest.mark.parametrize("function", [get_mesh_names, contains_submesh])
def test_mesh_must_be_a_device_mesh(function) -> None:
    args = ("mesh",) if function is get_mesh_names else ("mesh", "dp")
    with pytest.raises(TypeError, match="device_mesh must be a torch.distributed.DeviceMesh"):
        function(*args)


def test_device_needs_initialized_distributed() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        get_group_device()


def _rank_mesh_names(rank: int, world_size: int) -> None:
    one_d = cpu_mesh((world_size,), ("dp",))
    assert get_mesh_names(one_d) == ["dp"]
    assert contains_submesh(one_d, "dp")
    assert not contains_submesh(one_d, "tp")

    two_d = cpu_mesh((2, world_size // 2), ("dp", "tp"))
    assert get_mesh_names(two_d) == ["dp", "tp"]
    assert contains_submesh(two_d, ["dp", "tp"])
    assert not contains_submesh(two_d, ("dp", "cp"))
    assert get_mesh_names(two_d["tp"]) == ["tp"]

    two_d["dp", "tp"]._flatten("dp_tp")
    assert get_mesh_names(two_d) == ["dp", "tp", "dp_tp"]
    assert get_mesh_names(two_d, only_submesh_dims=True) == ["dp", "tp"]
    assert contains_submesh(two_d, "dp_tp")
    assert two_d["dp_tp"].size() == world_size
    with pytest.raises(TypeError, match="submesh_names must hold str"):
        contains_submesh(two_d, [0])

    assert get_group_device() == torch.device("cpu")
    assert get_group_device(two_d.get_group("tp")) == torch.device("cpu")
    assert dist.get_backend() == "gloo"


@pytest.mark.multiprocess
def test_mesh_names_on_real_meshes() -> None:
    run_on_ranks(_rank_mesh_names, 4)
