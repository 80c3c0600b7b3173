"""The benchmark's measuring tools: the collective counter and the model-state byte count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mf.bench import CommCounter, model_state_bytes
from mf_fsdp.buckets import collectives, transfers
from tests._multiprocess import run_on_ranks


def _rank_counts(rank: int, world_size: int) -> None:
    counter = CommCounter()
    original = dist.all_reduce
    shard = torch.ones(6)
    full = torch.empty(6 * world_size)
    with counter.installed():
        dist.all_gather_into_tensor(full, shard)  # not counted: disabled
        counter.enabled = True
        dist.all_gather_into_tensor(full, shard)  # deprecated alias -> all_gather_single
        dist.reduce_scatter_tensor(shard, full)
        dist.all_reduce(shard)
        work = dist.all_reduce(shard, async_op=True)
        work.wait()
        # Uneven: rank r sends r + 1 elements to every rank, its own segment stays.
        splits = [rank + 1] * world_size
        received = torch.empty(sum(r + 1 for r in range(world_size)))
        dist.all_to_all_single(
            received, torch.ones(sum(splits)), [r + 1 for r in range(world_size)], splits
        )
        # Splits count dim-0 rows: rows of 3 elements send 3 times the bytes (MoE dispatch).
        dist.all_to_all_single(
            received.repeat(3).view(-1, 3),
            torch.ones(sum(splits), 3),
            [r + 1 for r in range(world_size)],
            splits,
        )
        # mf's gloo reduce-scatter: point-to-point sends, counted exactly (24 bytes per peer);
        # a bucket this small would take the native call, so the threshold is lowered.
        default, transfers.POINT_TO_POINT_MIN_BYTES = transfers.POINT_TO_POINT_MIN_BYTES, 0
        collectives.reduce_scatter_into(shard, full, dist.ReduceOp.SUM, dist.group.WORLD)
        transfers.POINT_TO_POINT_MIN_BYTES = default
    dist.all_reduce(shard)  # uninstalled: not counted
    assert counter.calls == {
        "all_gather_single": 1,
        "reduce_scatter_single": 1,
        "all_reduce": 2,
        "all_to_all_single": 2,
        "batch_isend_irecv": 1,
    }
    scale = (world_size - 1) / world_size
    element = 4
    expected = (6 * world_size * element) * scale * 2 + 2 * (6 * element) * scale * 2
    expected += (rank + 1) * (world_size - 1) * element * (1 + 3)
    expected += 6 * element * (world_size - 1)
    assert counter.bytes_sent == pytest.approx(expected)
    assert counter.bytes_by_group == {"0": pytest.approx(expected)}  # all on the default group
    assert dist.all_reduce is original  # the originals are back
    # The group's own coalesced all-gather works again once uninstalled (it once lost its self).
    group = dist.group.WORLD
    group.allgather_into_tensor_coalesced([full], [shard]).wait()
    # A collective over another group is tallied under that group's name.
    pair, _ = dist.new_subgroups_by_enumeration([list(range(world_size))])
    with counter.installed():
        counter.enabled = True
        dist.all_reduce(shard, group=pair)
    assert counter.bytes_by_group[pair.group_name] == pytest.approx(
        2 * 6 * element * (world_size - 1) / world_size
    )


@pytest.mark.multiprocess
def test_counter_counts_ring_bytes() -> None:
    run_on_ranks(_rank_counts, 2)


def test_model_state_bytes_counts_weights_grads_and_adam() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    # Adam keeps two fp32 moments plus a scalar step tensor per parameter.
    step_bytes = sum(s["step"].untyped_storage().nbytes() for s in optimizer.state.values())
    assert model_state_bytes(model, optimizer) == 16 * params + step_bytes
