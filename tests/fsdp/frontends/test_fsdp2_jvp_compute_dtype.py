"""``torch.func.jvp`` through a model sharded with a compute dtype (``param_dtype``).

Under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` mf's gather first casts
each rank's fp32 main weights into its bf16 shard, in place. Run inside the
forward hooks of a call under ``jvp``, that copy was refused by functorch as a
mutation of a captured tensor ("attempted to call in-place operation
(aten::copy_)"), with ``reshard_after_forward`` False or True. The engine now does
its buffer work outside the transform (``buckets/transforms.py``). Each case runs
through torch's ``fully_shard`` and mf's in the same two gloo ranks (``on_both``;
torch 2.11's FSDP2 fails ``jvp`` itself, so there mf runs alone): the first forward
inside ``jvp``, then an SGD step, then ``jvp`` again (the stepped weights cast in
under the transform); outputs and tangents equal a plain bf16 copy's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, broadcast_params, torch_case
from tests.fsdp._fsdp2_port_common import NEWER_FSDP2, full, on_both

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")


def _plain_jvp(
    model: nn.Module, inp: torch.Tensor, tangent: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The jvp of a bf16 copy of ``model`` (whole weights from the sharded ones)."""
    plain = copy.deepcopy(model).to(torch.bfloat16)
    return torch.func.jvp(plain, (inp.bfloat16(),), (tangent.bfloat16(),))


def _jvp_in_compute_dtype(fully_shard, reshard: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    broadcast_params(model)
    plain = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for index in (0, 2):
        fully_shard(model[index], reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    # Before any forward: FSDP2's modules register the unsharded parameters while
    # reshard_after_forward=False keeps them gathered, and an optimizer built on those
    # would not step the sharded ones.
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    inp, tangent = torch.randn(2, 4), torch.randn(2, 4)
    out = list(torch.func.jvp(model, (inp,), (tangent,)))  # the first forward, inside jvp
    for got, want in zip(out, _plain_jvp(plain, inp, tangent), strict=True):
        torch.testing.assert_close(got, want)
    model(inp).sum().backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        for param, whole in zip(plain.parameters(), model.parameters(), strict=True):
            param.copy_(full(whole))
    again = torch.func.jvp(model, (inp,), (tangent,))  # the stepped weights cast in under it
    for got, want in zip(again, _plain_jvp(plain, inp, tangent), strict=True):
        torch.testing.assert_close(got, want)
    return [*out, *again]


def _rank_jvp(rank: int, world: int) -> None:
    case = torch_case()
    for reshard in (False, True):
        on_both(case, _jvp_in_compute_dtype, reshard, torch_runs=NEWER_FSDP2)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_jvp_through_a_bf16_compute_dtype_matches_fsdp2() -> None:
    """jvp first and after a step, reshard_after_forward False and True: FSDP2's values."""
    run_on_ranks(_rank_jvp, WORLD)
