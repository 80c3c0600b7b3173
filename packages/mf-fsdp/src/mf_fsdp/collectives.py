"""Every collective the engine runs, as free functions with backend-aware paths.

The engine never calls ``torch.distributed`` directly for its buckets: it calls
these, and each picks the implementation that moves the fewest bytes on the
group's backend.

- NCCL (and any backend but gloo): the native call.
- gloo, CPU tensors of ``POINT_TO_POINT_MIN_BYTES`` or more: torch's
  ``reduce_scatter_tensor`` is an all-reduce of the whole input followed by a
  copy, and ``all_gather_into_tensor`` stages through a list. Both are
  replaced by point-to-point transfers between every
  pair of ranks, posted together so they overlap: each rank sends exactly its
  peers' pieces, ``(N - 1) / N`` of the bucket, the minimum any reduce-scatter
  or all-gather can send. The all-gather receives straight into the output;
  the reduce-scatter receives the first peer's piece of this rank's shard into
  the output and the others into a reused workspace (none on 2 ranks), and
  sums them in rank order.

Asynchronous calls return a handle whose ``wait()`` finishes the transfer and
the local work after it (the sum of a reduce-scatter); synchronous calls return
None, as ``torch.distributed`` does.

All ranks of a group must call these in the same order (as for any collective):
point-to-point messages between two ranks are matched in the order they were
posted.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from mf_fsdp.buffer_pool import BufferPool

__all__ = [
    "POINT_TO_POINT_MIN_BYTES",
    "Handle",
    "all_gather_into",
    "all_reduce",
    "all_to_all",
    "broadcast_from_first",
    "reduce_scatter_into",
    "uses_point_to_point",
    "workspace_bytes",
]

ReduceOp = dist.ReduceOp.RedOpType
_SUMMING = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class Handle(Protocol):
    """What an asynchronous collective returns: ``wait()`` finishes it."""

    def wait(self) -> object:
        """Block until the collective and its local completion are done."""
        ...


class _Then:
    """Transfers in flight and the local work that completes them, run once on ``wait``."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None]) -> None:
        self._works = works
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        if self._finish is not None:
            for work in self._works:
                work.wait()
            finish, self._finish = self._finish, None
            finish()
        return True


@dataclass(frozen=True, slots=True)
class _GroupFacts:
    """What the collectives need of a group, looked up once per group."""

    gloo: bool
    me: int
    ranks: list[int]


_WORKSPACES = BufferPool()
# Weak: a group must die when its owner destroys it. A gloo group kept alive until
# interpreter exit is torn down while Python finalizes, which can abort the process.
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupFacts] = weakref.WeakKeyDictionary()


def workspace_bytes() -> int:
    """Bytes of the receive buffers the gloo reduce-scatter keeps for reuse (this process)."""
    return _WORKSPACES.held_bytes()


def _facts(group: dist.ProcessGroup) -> _GroupFacts:
    facts = _GROUPS.get(group)
    if facts is None:
        facts = _GroupFacts(
            "gloo" in str(dist.get_backend(group)),
            dist.get_rank(group),
            dist.get_process_group_ranks(group),
        )
        _GROUPS[group] = facts
    return facts


POINT_TO_POINT_MIN_BYTES = 1 << 20
"""Below this size a gloo transfer costs its latency, not its bytes: one native call
beats the 2 (N - 1) point-to-point messages (measured on the tiny preset: 2.5 ms of
a 17 ms step), and the bytes it sends beyond the minimum are a few kilobytes."""


def uses_point_to_point(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """True when the bucket collectives on ``group`` run as point-to-point transfers.

    That is gloo with CPU tensors of at least ``POINT_TO_POINT_MIN_BYTES``; other
    backends keep their native collectives.
    """
    return (
        tensor.device.type == "cpu"
        and _facts(group).gloo
        and tensor.numel() * tensor.element_size() >= POINT_TO_POINT_MIN_BYTES
    )


def _exchange(
    sends: list[tuple[torch.Tensor, int]],
    receives: list[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup,
) -> list[dist.Work]:
    """Post every send and receive (global peer ranks) at once; their handles."""
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in receives]
    return dist.batch_isend_irecv(ops) if ops else []


def _finish(works: list[dist.Work], finish: Callable[[], None], async_op: bool) -> Handle | None:
    handle = _Then(works, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Gather every rank's ``shard`` into ``output`` (rank order); like ``all_gather_into_tensor``.

    ``shard`` may be this rank's own region of ``output`` (an in-place gather).
    """
    if not uses_point_to_point(output, group):
        return dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)
    facts = _facts(group)
    me, ranks = facts.me, facts.ranks
    pieces = output.view(len(ranks), -1).unbind(0)
    if pieces[me].data_ptr() != shard.data_ptr():
        pieces[me].copy_(shard.view(-1))
    others = [(i, peer) for i, peer in enumerate(ranks) if i != me]
    works = _exchange(
        [(pieces[me], peer) for _, peer in others],
        [(pieces[i], peer) for i, peer in others],
        group,
    )
    return _finish(works, lambda: None, async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Sum (or average) ``input`` over the ranks; this rank's shard lands in ``output``.

    Like ``reduce_scatter_tensor``: ``input`` has ``N x output.numel()`` elements and
    rank ``i`` gets the reduction of every rank's piece ``i``. ``input`` is not
    changed. On gloo the peers' pieces are summed in rank order, so every rank's
    result is bitwise reproducible.
    """
    if op not in _SUMMING or not uses_point_to_point(input, group):
        return _native_reduce_scatter(output, input, op, group, async_op)
    facts = _facts(group)
    me, ranks = facts.me, facts.ranks
    size = len(ranks)
    pieces = input.view(size, -1).unbind(0)
    flat = output.view(-1)
    peers = [(i, peer) for i, peer in enumerate(ranks) if i != me]
    # The first peer's piece lands in the output itself, the others in a reused
    # workspace: (N - 2) / N of the bucket, none on 2 ranks.
    extra = max(size - 2, 0)
    spare = _WORKSPACES.take(extra * flat.numel(), input.dtype, input.device)
    slots = [flat, *spare.view(extra, flat.numel()).unbind(0)]
    received = {i: slot for (i, _), slot in zip(peers, slots, strict=False)}
    works = _exchange(
        [(pieces[i], peer) for i, peer in peers],
        [(received[i], peer) for i, peer in peers],
        group,
    )

    def combine() -> None:
        ordered = [pieces[i] if i == me else received[i] for i in range(size)]
        if size == 1:
            flat.copy_(ordered[0])
        else:  # ``flat`` is one of the first two (elementwise, so in place is fine)
            torch.add(ordered[0], ordered[1], out=flat)
            for piece in ordered[2:]:
                flat.add_(piece)
        if op == dist.ReduceOp.AVG:
            flat.div_(size)
        _WORKSPACES.give(spare)

    return _finish(works, combine, async_op)


def _native_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool,
) -> Handle | None:
    """``reduce_scatter_tensor``; gloo has no ``AVG``, so there it sums and divides."""
    if op != dist.ReduceOp.AVG or not _facts(group).gloo:
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    work = dist.reduce_scatter_tensor(
        output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )
    size = len(_facts(group).ranks)
    return _finish([] if work is None else [work], lambda: output.div_(size), async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``tensor`` in place over ``group`` (the native call on every backend)."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``input``'s i-th split to rank i, receive rank i's into ``output``'s i-th split."""
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)


def broadcast_from_first(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Overwrite ``tensor`` on every rank of ``group`` with the first member's."""
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
