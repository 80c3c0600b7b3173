"""What a module registers after ``unshard()`` outside a pass: FSDP2's unsharded parameters.

FSDP2's ``unshard()`` registers the unit's unsharded parameters (plain
``nn.Parameter``s with the whole values) on its modules until ``reshard()``, and
a state dict read registers the sharded ones again (its pre-hook). mf's modules
held the sharded ``DTensor``s throughout (the reason torch's
``test_unshard_without_lazy_init`` was a strict xfail). Each step's view of
``model.named_parameters()`` (class, shape, whole value) is taken on torch's
``fully_shard`` and on mf's in the same two gloo ranks (``on_both``) and compared:
``unshard()`` before the first forward, on one unit and on the root, then
``reshard()``, ``state_dict()``, a training step after ``unshard()``, and
``unshard()`` again after the step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, broadcast_params, torch_case
from tests.fsdp._fsdp2_port_common import full, on_both

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")


def _view(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], torch.Tensor]]:
    """Each registered parameter: name, whether it is a DTensor, shape, whole value."""
    return [
        (name, "DTensor" if isinstance(p, DTensor) else type(p).__name__, tuple(p.shape), full(p))
        for name, p in model.named_parameters()
    ]


def _registered_after_unshard(fully_shard) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    broadcast_params(model)
    reference = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    views = []
    model[0].unshard()  # before the first forward: only the unit's own parameters
    views.append(_view(model))
    for (_, kind, _, value), ref in zip(views[-1][:2], reference[0].parameters(), strict=True):
        assert kind == "Parameter"
        torch.testing.assert_close(value, ref)
    model.unshard()  # the root's own parameters too
    views.append(_view(model))
    model[0].reshard()
    views.append(_view(model))
    model.state_dict()  # FSDP2's pre-hook registers the sharded parameters again
    views.append(_view(model))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].unshard()
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    optim.step()
    views.append(_view(model))
    model[0].unshard()  # the stepped weights, gathered again
    views.append(_view(model))
    model[0].reshard()
    model.reshard()
    views.append(_view(model))
    return [loss.detach(), views]


def _rank_registration(rank: int, world: int) -> None:
    case = torch_case()
    on_both(case, _registered_after_unshard)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_unshard_registers_the_unsharded_parameters_as_fsdp2() -> None:
    """Parameters registered after unshard(), reshard(), state_dict() and a step: FSDP2's."""
    run_on_ranks(_rank_registration, WORLD)
