"""torch's FSDP2 tests of answers checked at the call and state dicts loaded piece by piece.

Each scenario runs through torch's ``fully_shard`` and then mf's (``on_both``) in
two gloo ranks. mf alone: a meta-device model loaded only in part stops at its
first forward in one line (FSDP2 would compute with meta tensors and fail deeper).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_utils import TestCase

from mf_fsdp import fsdp2
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, torch_case
from tests.fsdp._fsdp2_port_common import on_both

preload_in_ranks(*RANK_MODULES)


def _invalid_shard_dim(fully_shard, case: TestCase) -> None:
    """``Shard(1)`` for a 1-D bias: ``AssertionError`` from ``fully_shard`` itself."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    with case.assertRaisesRegex(AssertionError, "Shard dim 1 is invalid for 1D tensor"):
        fully_shard(model, shard_placement_fn=lambda param: Shard(1))


def _dp_state_dict_cpu_offload(fully_shard, case: TestCase) -> None:
    """A meta model with CPU offload loads a host state dict piece by piece (``strict=False``)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    policy = CPUOffloadPolicy(pin_memory=False)
    for module in (model[0], model[1], model):
        fully_shard(module, offload_policy=policy)
    torch.manual_seed(0)
    pieces = [
        {name: distribute_tensor(torch.randn(p.size()), p.device_mesh, p.placements).cpu()}
        for name, p in model.named_parameters()
    ]
    for piece in pieces:
        model.load_state_dict(piece, assign=True, strict=False)
    model(torch.rand((4, 4))).sum()
    for value in model.state_dict().values():
        case.assertEqual(value.device.type, "cpu")


def _partly_loaded_stops_at_the_forward() -> None:
    """mf: a piece of the state dict given, the rest not: the forward names a missing one."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model)
    name, param = next(iter(model.named_parameters()))
    piece = {name: distribute_tensor(torch.ones(param.size()), param.device_mesh, param.placements)}
    model.load_state_dict(piece, assign=True, strict=False)
    with pytest.raises(RuntimeError, match=r"has not given '1.weight' a value yet \(1 tensors"):
        model(torch.rand((4, 4)))
    with pytest.raises(KeyError, match="'1.weight'"):  # strict: every tensor at once
        model.load_state_dict(piece, assign=True)


def _rank_invalid_shard_dim(rank: int, world: int) -> None:
    case = torch_case()
    on_both(case, _invalid_shard_dim, case)


def _rank_cpu_offload(rank: int, world: int) -> None:
    case = torch_case()
    on_both(case, _dp_state_dict_cpu_offload, case)
    _partly_loaded_stops_at_the_forward()


@pytest.mark.multiprocess
def test_invalid_shard_dim() -> None:
    """``TestFullyShardShardPlacementFn::test_invalid_shard_dim``."""
    run_on_ranks(_rank_invalid_shard_dim, WORLD)


@pytest.mark.multiprocess
def test_dp_state_dict_cpu_offload() -> None:
    """``TestFullyShardStateDictMultiProcess::test_dp_state_dict_cpu_offload`` (host half)."""
    run_on_ranks(_rank_cpu_offload, WORLD)
