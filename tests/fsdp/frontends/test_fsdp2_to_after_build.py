"""``model.to(...)`` after the model's first use: no-op moves served, dtype changes refused.

Training scripts move or cast a model after wrapping it (``model.to(device)``,
``model.float()``); FSDP2 serves every such call through its ``_apply``. mf built
its buckets at the model's first use and refused any ``_apply`` after it. Now a
conversion that leaves every parameter as it is (the buckets' device, the
parameters' own dtype) is served and converts the buffers, as FSDP2 does: both
engines run the same script in two gloo ranks (``on_both``) and train on with
equal losses, weights and buffers. One that changes a parameter's dtype
(``model.to(torch.float64)``), which FSDP2 serves, stays refused by mf in one line
naming the parameter and what to do (docs/fsdp2.md says why), and leaves the
model training as before.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, broadcast_params, torch_case
from tests.fsdp._fsdp2_port_common import full, on_both

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")


class _Scaled(nn.Module):
    """Two linears and a half-precision buffer the forward reads (a cast converts it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 8)
        self.outer = nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), 0.5, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x))) * self.scale.float()


def _sharded(fully_shard) -> tuple[_Scaled, _Scaled, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Scaled()
    broadcast_params(model)
    reference = copy.deepcopy(model)
    fully_shard(model.inner)
    fully_shard(model)
    return model, reference, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> torch.Tensor:
    torch.manual_seed(step)
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _no_op_moves_after_use(fully_shard) -> list:
    """``.to("cpu")``, ``.float()``, ``.to(torch.float32)`` after a step: served, training on."""
    model, _, optim = _sharded(fully_shard)
    losses = [_step(model, optim, 0)]
    assert model.to("cpu") is model
    assert model.float() is model
    assert model.to(torch.float32) is model  # the fp16 buffer becomes fp32, as nn.Module's
    assert model.scale.dtype == torch.float32
    losses += [_step(model, optim, step) for step in (1, 2)]
    return [losses, [full(p) for p in model.parameters()], model.scale]


def _rank_to_after_build(rank: int, world: int) -> None:
    case = torch_case()
    on_both(case, _no_op_moves_after_use)
    model, reference, optim = _sharded(mf_fully_shard)
    losses = [_step(model, optim, 0)]
    with pytest.raises(NotImplementedError, match=r"would change parameter 'inner.weight', wh"):
        model.to(torch.float64)
    with pytest.raises(NotImplementedError, match=r"FSDPLinear.to\(\) .* parameter 'weight'"):
        model.inner.double()
    losses.append(_step(model, optim, 1))  # the refusal changed nothing
    # Every rank drew the same batch, so the mean of their gradients is one process's.
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = [_step(reference, ref_optim, step) for step in (0, 1)]
    torch.testing.assert_close(losses, ref_losses)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(full(param), ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_no_op_moves_after_use_are_served_and_dtype_changes_refused() -> None:
    """No-op ``.to()`` after a step as FSDP2; ``.to(float64)`` refused naming the parameter."""
    run_on_ranks(_rank_to_after_build, WORLD)
