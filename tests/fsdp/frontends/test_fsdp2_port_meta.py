"""A meta-device model under ``fully_shard``: ``to_empty``, init, then training (FSDP2's flow).

torch's ``test_meta_device_1d_init`` builds the model on the meta device, shards
it, calls ``to_empty`` and ``reset_parameters``, and trains. One deliberate
difference (docs/fsdp2.md): before ``to_empty`` FSDP2's parameters are meta
DTensors, mf's already report the engine's device (they are views of its
buffers, whose values arrive with the model's init). No value differs: after
``to_empty`` and the init, both engines load the same initial state and train
equal to one process and to each other, as asserted here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, torch_case
from tests.fsdp._fsdp2_port_common import full, train_pairs

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _meta_flow(shard) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """Shard a meta model, ``to_empty``, ``reset_parameters``, load one state, train 3 steps.

    Returns the devices the parameters report before ``to_empty``, the losses and
    the whole weights after training.
    """
    case = torch_case()
    torch.manual_seed(0)
    ref = _mlp()
    with torch.device("meta"):
        model = _mlp()
    shard(model[0])
    shard(model[2])
    shard(model)
    before = [p.device.type for p in model.parameters()]
    model.to_empty(device="cpu")
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    for param in model.parameters():
        case.assertFalse(param.is_meta)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, ref.state_dict(), options=options)
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        case.assertTrue(torch.equal(full(param), ref_param.detach()))  # type: ignore[arg-type]
    pairs = [
        (net, torch.optim.Adam(net.parameters(), lr=1e-2, foreach=True)) for net in (ref, model)
    ]
    torch.manual_seed(1)  # the same batches on every rank: the mean is one process's grad
    batches = [torch.randn(4, 16) for _ in range(3)]
    losses = train_pairs(case, pairs, lambda step: (batches[step],), 3)
    weights = [full(p) for p in model.parameters()]
    for whole, ref_param in zip(weights, ref.parameters(), strict=True):
        case.assertEqual(whole, ref_param.detach())
    return before, losses, weights  # type: ignore[return-value]


def _rank_meta_flow(rank: int, world: int) -> None:
    case = torch_case()
    torch_before, *torch_values = _meta_flow(torch_fully_shard)
    mf_before, *mf_values = _meta_flow(mf_fully_shard)
    case.assertEqual(torch_before, ["meta"] * 4)
    case.assertEqual(mf_before, ["cpu"] * 4)  # the deliberate difference (docs/fsdp2.md)
    case.assertEqual(mf_values, torch_values)


@pytest.mark.multiprocess
def test_meta_device_init_then_training_matches_torch() -> None:
    """torch's meta-device flow on both engines: equal losses and weights after to_empty."""
    run_on_ranks(_rank_meta_flow, WORLD)
