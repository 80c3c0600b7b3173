"""A step whose backwards reached no trainable parameter stops every rank in one line.

mf's gradients are autograd's accumulation into the engine's buffers. A backward
that computes input gradients only (``torch.autograd.grad(loss, inputs=...)``)
accumulates nothing; stepping after it alone would go on with gradients that
never came (``engine/weight_reach.py``). Checked at world 2 through the FSDP2
front end (ZeRO-3), on a two-layer model fed a float input that requires grad:

- input grads only, then the step: every rank raises one ``UnitOrderError`` line
  (planted: without the check the step runs, and the test fails).

A step whose backwards include one that reaches the weights is not refused:
torch's pipeline stages infer their shapes with an input-only backward before
the first step, and a zero-bubble schedule's input passes are followed by
weight passes that write the grads in place
(``tests/integration/test_torchtitan_pipeline.py`` trains both).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mf_fsdp
from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks

STEPS = 3


def _model(shard: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if shard:
        fsdp2.fully_shard(model[0])
        fsdp2.fully_shard(model)
    return model


def _input(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g).requires_grad_(True)


def _rank_input_only(rank: int, world: int) -> None:
    model = _model(shard=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = _input(0, rank)
    torch.autograd.grad(model(x).square().mean(), inputs=[x])
    with pytest.raises(mf_fsdp.UnitOrderError) as caught:
        opt.step()
    message = str(caught.value)
    assert message.startswith("mf_fsdp: the backwards since the last step computed no gradient")
    assert "\n" not in message


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_step_after_input_grads_only_stops_every_rank() -> None:
    run_on_ranks(_rank_input_only, 2, timeout=100)
