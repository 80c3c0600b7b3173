"""``clip_grad_norm_`` with an infinity norm on a rank holding no rows of a parameter (issue 57).

mf shards whole rows of a flat bucket, so at world 2 one rank may hold an empty
piece of a small parameter (here a bias), where torch's kernels refuse the
infinity norms of an empty tensor. The norms and the clipped gradients must
equal torch's FSDP2 on the same script, foreach and per-tensor, ``inf`` and
``-inf``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks

ENGINES = (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard))


def _norms(shard, rank: int) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """For each (norm, foreach): the total norm and the clipped grads, as whole tensors."""
    out = []
    for norm_type in (math.inf, -math.inf):
        for foreach in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 24))
            shard(model)
            torch.manual_seed(1 + rank)
            model(torch.randn(2, 24)).sum().backward()
            total = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm=0.5, norm_type=norm_type, foreach=foreach
            )
            grads = [p.grad.full_tensor() for p in model.parameters()]
            out.append((total.full_tensor(), grads))
    return out


def _rank_clip_inf(rank: int, world: int) -> None:
    _check_empty_piece()
    runs = {name: _norms(shard, rank) for name, shard in ENGINES}
    for (mf_total, mf_grads), (ref_total, ref_grads) in zip(runs["mf"], runs["torch"], strict=True):
        torch.testing.assert_close(mf_total, ref_total)
        for got, expected in zip(mf_grads, ref_grads, strict=True):
            torch.testing.assert_close(got, expected)


def _check_empty_piece() -> None:
    """The scenario holds: some rank's piece of some parameter is empty under mf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 24))
    fsdp2.fully_shard(model)
    empty = torch.tensor([sum(p.to_local().numel() == 0 for p in model.parameters())])
    dist.all_reduce(empty)
    assert empty.item() > 0


@pytest.mark.multiprocess
def test_clip_grad_norm_inf_with_an_empty_piece() -> None:
    """inf and -inf norms, foreach and not: FSDP2's norm and clipped grads, no kernel error."""
    run_on_ranks(_rank_clip_inf, 2)
