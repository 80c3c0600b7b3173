"""The engine's gloo collectives against torch's own: same results, fewer bytes.

``mf_fsdp.buckets.collectives`` replaces gloo's reduce-scatter (an all-reduce of the
whole bucket) and all-gather with point-to-point transfers (buckets of 1 MiB
and more; smaller ones keep the native calls, AVG summed then divided). Each must give
what ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` give, for sum and
avg, shards of any size (1 and odd ones: the tail of a bucket), in place (the
output a view of the input) or not, synchronous or not, on 2, 3 and 4 ranks.
Inside ``collectives.coalescing``, small asynchronous calls share one
collective: the same results, one ``torch.distributed`` call per pack.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from mf.bench import bytes_written
from mf.bench.comm_counter import CommCounter
from mf_fsdp.buckets import collectives, transfers
from tests._multiprocess import run_on_ranks

SHARD_SIZES = (1, 7, 64, 1001)


def _rank_against_torch(rank: int, world: int) -> None:
    # Point-to-point for every size (the threshold lowered to 0), then the default:
    # these small shards take the native path (gloo's reduce-scatter has no AVG).
    default = transfers.POINT_TO_POINT_MIN_BYTES
    for threshold in (0, default):
        transfers.POINT_TO_POINT_MIN_BYTES = threshold
        point_to_point = collectives.uses_point_to_point(torch.zeros(1001), dist.group.WORLD)
        assert point_to_point == (threshold == 0)
        _check_against_torch(rank, world)
    transfers.POINT_TO_POINT_MIN_BYTES = default


def _check_against_torch(rank: int, world: int) -> None:
    group = dist.group.WORLD
    for shard in SHARD_SIZES:
        g = torch.Generator().manual_seed(100 * rank + shard)
        # Integer values: every summation order gives the same bits (checked exactly);
        # float64 noise: equal up to the order of the additions.
        exact = torch.randint(-1000, 1000, (world * shard,), generator=g).float()
        noisy = torch.randn(world * shard, generator=g, dtype=torch.float64)
        for source in (exact, noisy):
            expected = torch.empty(shard, dtype=source.dtype)
            dist.reduce_scatter_tensor(expected, source.clone(), group=group)
            kept = source.clone()
            for op, divisor in ((dist.ReduceOp.SUM, 1), (dist.ReduceOp.AVG, world)):
                got = torch.full((shard,), float("nan"), dtype=source.dtype)
                collectives.reduce_scatter_into(got, source, op, group)
                torch.testing.assert_close(got, expected / divisor, rtol=1e-12, atol=1e-15)
                handle = collectives.reduce_scatter_into(got.fill_(0), source, op, group, True)
                assert handle is not None
                handle.wait()
                handle.wait()  # a second wait does nothing
                torch.testing.assert_close(got, expected / divisor, rtol=1e-12, atol=1e-15)
                if source is exact:
                    assert torch.equal(got, expected / divisor)
                # In place: the output is this rank's own piece of the input.
                whole = source.clone()
                own = whole[rank * shard : (rank + 1) * shard]
                handle = collectives.reduce_scatter_into(own, whole, op, group, True)
                assert handle is not None
                handle.wait()
                torch.testing.assert_close(own, expected / divisor, rtol=1e-12, atol=1e-15)
                if source is exact:
                    assert torch.equal(own, expected / divisor)
            assert torch.equal(source, kept)  # the input is not changed
            # All-gather: into a separate output, and in place (the shard is a view of it).
            mine = source[:shard]
            expected_full = torch.empty(world * shard, dtype=source.dtype)
            dist.all_gather_into_tensor(expected_full, mine, group=group)
            full = torch.full_like(expected_full, float("nan"))
            collectives.all_gather_into(full, mine, group)
            assert torch.equal(full, expected_full)
            in_place = torch.full_like(expected_full, float("nan"))
            in_place[rank * shard : (rank + 1) * shard] = mine
            handle = collectives.all_gather_into(
                in_place, in_place[rank * shard : (rank + 1) * shard], group, async_op=True
            )
            assert handle is not None
            handle.wait()
            assert torch.equal(in_place, expected_full)


def _rank_minimum_bytes(rank: int, world: int) -> None:
    """Each rank writes (N-1)/N of the bucket per reduce-scatter and per all-gather;
    torch's gloo reduce-scatter writes 2 (N-1)/N, an all-reduce's worth."""
    group = dist.group.WORLD
    shard = 2**20
    source = torch.ones(world * shard)
    out = torch.empty(shard)
    minimum = (world - 1) * shard * 4

    def written(call) -> float:
        dist.barrier()
        before = bytes_written()
        call()
        dist.barrier()
        return (bytes_written() - before) / minimum

    ours = written(lambda: collectives.reduce_scatter_into(out, source, dist.ReduceOp.SUM, group))
    gathered = written(lambda: collectives.all_gather_into(source, out, group))
    theirs = written(lambda: dist.reduce_scatter_tensor(out, source, group=group))
    assert 1.0 <= ours < 1.01, ours
    assert 1.0 <= gathered < 1.01, gathered
    assert theirs > 1.9, theirs  # what the engine moved before


def _rank_coalescing(rank: int, world: int) -> None:
    group = dist.group.WORLD
    window = 64 * world  # whole-bucket elements: shards of 1, 7 and 40 pack; 64 does not
    shards = (64, 1, 7, 40)
    g = torch.Generator().manual_seed(rank)
    sources = [torch.randint(-1000, 1000, (world * n,), generator=g).float() for n in shards]
    mine = [source[:n] for source, n in zip(sources, shards, strict=True)]
    gathered = [torch.full((world * n,), float("nan")) for n in shards]
    summed = [torch.full((n,), float("nan")) for n in shards]
    averaged = [torch.full((n,), float("nan")) for n in shards]
    reduced = [source.clone() for source in sources]
    counter = CommCounter()
    with counter.installed():
        counter.enabled = True
        with collectives.coalescing(window):
            handles = [
                collectives.all_gather_into(out, shard, group, async_op=True)
                for out, shard in zip(gathered, mine, strict=True)
            ]
            with pytest.raises(RuntimeError, match="before it was issued"):
                handles[1].wait()
            for out, source in zip(summed, sources, strict=True):
                handles.append(
                    collectives.reduce_scatter_into(out, source, dist.ReduceOp.SUM, group, True)
                )
            # A synchronous call issues what was recorded first (program order kept).
            collectives.all_reduce(torch.ones(3), dist.ReduceOp.SUM, group)
            for out, source in zip(averaged, sources, strict=True):
                handles.append(
                    collectives.reduce_scatter_into(out, source, dist.ReduceOp.AVG, group, True)
                )
            handles += [
                collectives.all_reduce(t, dist.ReduceOp.SUM, group, async_op=True) for t in reduced
            ]
        for handle in handles:
            assert handle is not None
            handle.wait()
        counter.enabled = False
    # Each call on 64 elements per rank alone (it flushes what was recorded), then one
    # pack per kind for 1, 7 and 40 (sums and averages apart); the synchronous all-reduce.
    # gloo's reduce-scatter packs run as all-reduces of the pack (see _run_pack).
    assert counter.calls == {
        "all_gather_single": 2,
        "reduce_scatter_single": 2,
        "all_reduce": 5,
    }, counter.calls
    for n, source, shard, out, total, mean, all_sum in zip(
        shards, sources, mine, gathered, summed, averaged, reduced, strict=True
    ):
        expected_full = torch.empty(world * n)
        dist.all_gather_into_tensor(expected_full, shard, group=group)
        assert torch.equal(out, expected_full)
        expected = torch.empty(n)
        dist.reduce_scatter_tensor(expected, source.clone(), group=group)
        assert torch.equal(total, expected)
        assert torch.equal(mean, expected / world)
        expected_all = source.clone()
        dist.all_reduce(expected_all)
        assert torch.equal(all_sum, expected_all)
    # A block left by an exception issues nothing: its handles say so.
    lost = []

    def fail_inside() -> None:
        with collectives.coalescing(window):
            lost.append(collectives.all_gather_into(gathered[1], mine[1], group, async_op=True))
            raise KeyError("boom")

    with pytest.raises(KeyError):
        fail_inside()
    with pytest.raises(RuntimeError, match="ended with an exception"):
        lost[0].wait()


def _rank_group_dies_when_destroyed(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    for numel in (16, collectives.POINT_TO_POINT_MIN_BYTES):  # native and point-to-point
        out = torch.empty(world * numel)
        collectives.all_gather_into(out, torch.full((numel,), float(rank)), group)
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert alive() is None, "the collectives' group cache keeps a destroyed group alive"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_paths_equal_torch(world: int) -> None:
    run_on_ranks(_rank_against_torch, world, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_collectives_equal_torch_in_fewer_calls(world: int) -> None:
    run_on_ranks(_rank_coalescing, world, timeout=120)


@pytest.mark.multiprocess
def test_gloo_paths_send_the_minimum() -> None:
    run_on_ranks(_rank_minimum_bytes, 2, timeout=120)


@pytest.mark.multiprocess
def test_a_destroyed_group_is_not_kept_alive() -> None:
    """A group kept until interpreter exit is torn down mid-finalisation (gloo then aborts
    the process after a successful run): the engine's caches must not hold one."""
    run_on_ranks(_rank_group_dies_when_destroyed, 2, timeout=120)
