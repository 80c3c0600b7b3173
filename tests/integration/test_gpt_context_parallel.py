"""mf's GPT under mf_tp.context_parallel: each rank's share of the sequence, one process's result.

Each of 2 ranks holds 16 of a batch's 32 positions (the head-tail chunks),
passes them as ``positions`` and runs the unchanged model; its attention goes
through the same ``F.scaled_dot_product_attention`` call, served by CP. The
mean of the ranks' losses is one process's loss (equal token counts), the sum
of their parameter gradients over the cp group is ``cp`` times one process's
(each local loss is a mean over ``1/cp`` of the tokens), and the unsharded
logits are one process's. fp32: rtol 1e-5 (only the order of sums differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mf_tp
from mf.models import GPT, PRESETS
from tests._multiprocess import cpu_mesh, run_on_ranks


def _rank_gpt_parity(rank: int, world: int) -> None:
    mesh = cpu_mesh((world,), ("cp",))
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (2, 33), generator=gen)
    inputs, targets = data[:, :-1].clone(), data[:, 1:].clone()

    expected_loss = model(inputs, targets)
    expected_loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    expected_logits = model(inputs).detach()
    model.zero_grad()

    positions = torch.arange(inputs.shape[1])
    with mf_tp.context_parallel(
        mesh, buffers=[inputs, targets, positions], buffer_seq_dims=[1, 1, 0]
    ):
        loss = model(inputs, targets, positions=positions)
        loss.backward()
        with torch.no_grad():
            (logits,) = mf_tp.context_parallel_unshard(
                mesh, [model(inputs, positions=positions)], [1]
            )
    assert inputs.shape == (2, 32), "the buffers were not restored"
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    torch.testing.assert_close(mean_loss / world, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / world, expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_gpt_under_cp2_equals_one_process() -> None:
    run_on_ranks(_rank_gpt_parity, 2, timeout=120)
