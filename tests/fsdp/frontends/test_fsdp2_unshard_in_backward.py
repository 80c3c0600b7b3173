"""``set_unshard_in_backward(False)``: a unit of embeddings is not gathered for its backward.

FSDP2's method tells a unit that its backward reads none of its weights (an
embedding's weight gradient needs only the indices): the backward skips its
all-gather. mf serves it per unit: the backward (and its prefetch) passes the unit
over, its gradients are accumulated and reduced as always. Run in two gloo ranks
with torch's ``fully_shard`` and mf's on the same script (``on_both``): losses and
whole gradients equal one process's and each other's over SGD steps, and mf's
backward gathers exactly the embedding unit's bucket fewer elements than with the
flag on. torch's activation-checkpointing test with this grouping (``mem_eff``)
runs in ``test_fsdp2_port_training.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mf_fsdp import fsdp2
from mf_fsdp.fsdp2.records import record_of
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, broadcast_params, torch_case
from tests.fsdp._fsdp2_port_common import full, on_both
from tests.fsdp._issued import spy_collectives

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")

_VOCAB, _SEQ, _DIM = 16, 6, 8


class _Embedded(nn.Module):
    """Token and position embeddings, a linear body and a head: torch's ``mem_eff`` shape."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(_VOCAB, _DIM)
        self.pos = nn.Embedding(_SEQ, _DIM)
        self.body = nn.Linear(_DIM, _DIM)
        self.head = nn.Linear(_DIM, _VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(torch.relu(self.body(hidden)))


def _shard(fully_shard, model: _Embedded, unshard_in_backward: bool) -> None:
    fully_shard([model.tok, model.pos])
    model.tok.set_unshard_in_backward(unshard_in_backward)
    fully_shard(model.body)
    fully_shard(model)


def _trains_without_unshard(fully_shard) -> list[torch.Tensor]:
    """3 SGD steps with the embeddings' unit not gathered in backward: one process's values."""
    torch.manual_seed(0)
    model = _Embedded()
    broadcast_params(model)
    reference = copy.deepcopy(model)
    _shard(fully_shard, model, unshard_in_backward=False)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(1)
    batches = torch.randint(0, _VOCAB, (3, WORLD, 2, _SEQ))
    out = []
    for batch in batches:
        ref_loss = sum(reference(tokens).sum() for tokens in batch) / WORLD
        ref_loss.backward()
        loss = model(batch[dist.get_rank()]).sum()
        loss.backward()
        for (name, param), ref_param in zip(
            model.named_parameters(), reference.parameters(), strict=True
        ):
            # fp32: the ranks' halves of the batch are summed in another order
            torch.testing.assert_close(
                full(param.grad), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name
            )
        for one in (optim, ref_optim):
            one.step()
            one.zero_grad()
        out.append(loss.detach())
    out += [full(param) for param in model.parameters()]
    return out


def _gathered_in_backward(unshard_in_backward: bool) -> tuple[int, int]:
    """Elements mf's backward gathers, and the embeddings unit's bucket elements."""
    torch.manual_seed(0)
    model = _Embedded()
    _shard(fsdp2.fully_shard, model, unshard_in_backward)
    engine = record_of(model).engine
    assert engine is None  # built at the first use, below
    list(model.parameters())
    engine = record_of(model).engine
    assert engine is not None
    engine.ddp_config.suggested_communication_unit_size = 1  # each unit gathers by itself
    loss = model(torch.randint(0, _VOCAB, (2, _SEQ))).sum()
    with spy_collectives() as issued:
        loss.backward()
    unit = record_of(model.tok).unit
    assert unit is not None
    return sum(call.numel for call in issued if call.kind == "all_gather"), unit.numel


def _rank_unshard_in_backward(rank: int, world: int) -> None:
    case = torch_case()
    on_both(case, _trains_without_unshard)
    gathered, embeddings = _gathered_in_backward(unshard_in_backward=True)
    skipped, _ = _gathered_in_backward(unshard_in_backward=False)
    assert gathered - skipped == embeddings > 0, (gathered, skipped, embeddings)
    with pytest.raises(TypeError, match="unshard_in_backward must be a bool"):
        _shard(fsdp2.fully_shard, _Embedded(), unshard_in_backward=1)  # type: ignore[arg-type]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_unshard_in_backward_false_skips_the_gather_with_fsdp2s_values() -> None:
    """Equal to one process and to torch's FSDP2; the embeddings' gather left out of backward."""
    run_on_ranks(_rank_unshard_in_backward, WORLD)
