"""A forward of a meta-device model before its values arrive stops with FSDP2's message.

torch's FSDP2 checks at its lazy init that no sharded parameter is left on the
meta device and names those of the first group that has any (the root's first,
then the units in module order). mf's engine holds storage from its build, so
it tracks what has no value yet; its message opens with FSDP2's two lines (the
same names) and adds one of its own saying what it saw. Each model runs through
torch's ``fully_shard`` and mf's in the same two gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import distribute_tensor

from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD

preload_in_ranks(*RANK_MODULES)


def _unmaterialized_message(shard, units: tuple[int, ...], loaded: int) -> list[str]:
    """The message of a first forward of a meta model, sharded per ``units`` then the root.

    ``loaded``: how many parameters (in ``named_parameters`` order) a
    ``load_state_dict(assign=True, strict=False)`` gives a value first; 0 leaves
    the whole model on the meta device.
    """
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    for index in units:
        shard(model[index])
    shard(model)
    named = list(model.named_parameters())[:loaded]
    torch.manual_seed(0)
    piece = {
        name: distribute_tensor(torch.randn(p.size()), p.device_mesh, p.placements)
        for name, p in named
    }
    if piece:
        model.load_state_dict(piece, assign=True, strict=False)
    with pytest.raises(RuntimeError) as raised:
        model(torch.rand((2, 4)))
    return str(raised.value).splitlines()


def _rank_meta_message(rank: int, world: int) -> None:
    for units, loaded in (((), 0), ((1,), 0), ((0, 1, 2), 0), ((1,), 2), ((0, 1, 2), 2)):
        theirs = _unmaterialized_message(torch_fully_shard, units, loaded)
        ours = _unmaterialized_message(mf_fully_shard, units, loaded)
        assert ours[:2] == theirs, (units, loaded, ours, theirs)
        assert ours[2].startswith("mf_fsdp: FSDPSequential was "), ours[2]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_unmaterialized_meta_params_raise_fsdp2s_message() -> None:
    """Whole-meta and partly loaded models, root-only and with units: FSDP2's two lines."""
    run_on_ranks(_rank_meta_message, WORLD)
