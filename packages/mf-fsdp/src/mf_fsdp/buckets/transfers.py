"""How one collective runs on each backend: native, or point to point between every pair.

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
None, as ``torch.distributed`` does. A group of one moves nothing (see [Note:
a group of one]). The engine reaches these through ``buckets/collectives.py``;
what a process group is (gloo or not, this rank, its members) is looked up once
per group (``group_facts``: the one place a test may make gloo take the
native branches). All ranks of a group must call these in the same order:
point-to-point messages between two ranks are matched in the order they were
posted.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from mf_fsdp.buckets.buffer_pool import BufferPool

__all__ = [
    "DONE",
    "POINT_TO_POINT_MIN_BYTES",
    "SUMMING",
    "GroupFacts",
    "Handle",
    "ReduceOp",
    "Then",
    "all_gather_now",
    "all_reduce_now",
    "alone",
    "copy_alone",
    "group_facts",
    "point_to_point",
    "reduce_scatter_now",
    "release_workspaces",
    "uses_point_to_point",
    "workspace_bytes",
]

ReduceOp = dist.ReduceOp.RedOpType
SUMMING = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class Handle(Protocol):
    """What an asynchronous collective returns: ``wait()`` finishes it."""

    def wait(self) -> object:
        """Block until the collective and its local completion are done."""
        ...


class Then:
    """Transfers in flight and the local work that completes them, run once on ``wait``."""

    def __init__(self, works: Sequence[Handle], finish: Callable[[], None]) -> None:
        self._works = works
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        """Wait for the transfers, then run the local work once."""
        if self._finish is not None:
            for work in self._works:
                work.wait()
            finish, self._finish = self._finish, None
            finish()
        return True


@dataclass(frozen=True, slots=True)
class GroupFacts:
    """What the collectives need of a group, looked up once per group."""

    gloo: bool
    me: int
    ranks: list[int]


WORKSPACES = BufferPool()
# Weak: a group must die when its owner destroys it. A gloo group kept alive until
# interpreter exit is torn down while Python finalizes, which can abort the process.
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, GroupFacts] = weakref.WeakKeyDictionary()


def workspace_bytes() -> int:
    """Bytes of the receive buffers the gloo reduce-scatter keeps for reuse (this process)."""
    return WORKSPACES.held_bytes()


def release_workspaces() -> None:
    """Free the receive buffers kept for reuse (between steps, nothing else is held)."""
    WORKSPACES.clear()


def group_facts(group: dist.ProcessGroup) -> GroupFacts:
    """What the collectives need of ``group``, looked up once per group.

    The one fact of a group every branch reads: the native-branch test switch
    (``tests/fsdp/_issued.py``) replaces this function.
    """
    facts = _GROUPS.get(group)
    if facts is None:
        facts = GroupFacts(
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
    return point_to_point(tensor, tensor.numel(), group)


def point_to_point(like: torch.Tensor, numel: int, group: dist.ProcessGroup) -> bool:
    """Whether ``numel`` elements of ``like``'s dtype and device go point to point on ``group``."""
    return (
        like.device.type == "cpu"
        and group_facts(group).gloo
        and numel * like.element_size() >= POINT_TO_POINT_MIN_BYTES
    )


def exchange(
    sends: list[tuple[torch.Tensor, int]],
    receives: list[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup,
) -> list[dist.Work]:
    """Post every send and receive (global peer ranks) at once; their handles."""
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in receives]
    return dist.batch_isend_irecv(ops) if ops else []


def finish(works: list[dist.Work], finish: Callable[[], None], async_op: bool) -> Handle | None:
    handle = Then(works, finish)
    if async_op:
        return handle
    handle.wait()
    return None


DONE = Then([], lambda: None)
"""The handle of work that finished when it was issued."""


def alone(group: dist.ProcessGroup) -> bool:
    """A group of one: its collectives move nothing (see [Note: a group of one])."""
    return len(group_facts(group).ranks) == 1


def copy_alone(output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Handle | None:
    """[Note: a group of one] A collective over one rank is ``output = input``.

    At world 1, and along any mesh dimension of size 1 (an HSDP replica group of
    one, a one-rank expert group), every gather and reduction of one rank's data
    is that data: nothing is sent, no backend is called, and nothing is copied
    when the two tensors are the same memory. The engine arranges that they are:
    a bucket sharded over one rank keeps its weights whole (``weight_storage``),
    and its grads, when kept in the compute dtype, are reduced where autograd
    accumulated them (``grad_buffers_for``).
    """
    if output.data_ptr() != input.data_ptr():
        output.view(-1).copy_(input.view(-1))
    return DONE if async_op else None


def all_gather_now(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Handle | None:
    """Gather every rank's ``shard`` into ``output`` now: native, or point to point on gloo."""
    if not uses_point_to_point(output, group):
        return dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)
    facts = group_facts(group)
    me, ranks = facts.me, facts.ranks
    pieces = output.view(len(ranks), -1).unbind(0)
    if pieces[me].data_ptr() != shard.data_ptr():
        pieces[me].copy_(shard.view(-1))
    others = [(i, peer) for i, peer in enumerate(ranks) if i != me]
    works = exchange(
        [(pieces[me], peer) for _, peer in others],
        [(pieces[i], peer) for i, peer in others],
        group,
    )
    return finish(works, lambda: None, async_op)


def reduce_scatter_now(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool,
) -> Handle | None:
    """Reduce ``input`` and scatter this rank's shard into ``output`` now (see the module)."""
    if op not in SUMMING or not uses_point_to_point(input, group):
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    facts = group_facts(group)
    me, ranks = facts.me, facts.ranks
    size = len(ranks)
    pieces = input.view(size, -1).unbind(0)
    flat = output.view(-1)
    peers = [(i, peer) for i, peer in enumerate(ranks) if i != me]
    # The first peer's piece lands in the output itself, the others in a reused
    # workspace: (N - 2) / N of the bucket, none on 2 ranks. An output that is this
    # rank's own piece of the input (in place) holds that piece until the sum, so
    # every peer's piece goes to the workspace.
    in_place = flat.data_ptr() == pieces[me].data_ptr()
    extra = size - 1 if in_place else max(size - 2, 0)
    spare = WORKSPACES.take(extra * flat.numel(), input.dtype, input.device)
    slots = [*([] if in_place else [flat]), *spare.view(extra, flat.numel()).unbind(0)]
    received = {i: slot for (i, _), slot in zip(peers, slots, strict=False)}
    works = exchange(
        [(pieces[i], peer) for i, peer in peers],
        [(received[i], peer) for i, peer in peers],
        group,
    )

    def combine() -> None:
        ordered = [pieces[i] if i == me else received[i] for i in range(size)]
        # Summed in rank order into ``flat``, which is one of the first two terms
        # (elementwise, so in place is fine), or in place this rank's piece further
        # on: the terms before it add up in the first peer's workspace slot first.
        start = me if in_place and me >= 2 else 1
        for piece in ordered[1:start]:
            ordered[0].add_(piece)
        torch.add(ordered[0], ordered[start], out=flat)
        for piece in ordered[start + 1 :]:
            flat.add_(piece)
        if op == dist.ReduceOp.AVG:
            flat.div_(size)
        WORKSPACES.give(spare)

    return finish(works, combine, async_op)


def all_reduce_now(
    tensor: torch.Tensor, op: ReduceOp, group: dist.ProcessGroup, async_op: bool
) -> Handle | None:
    """All-reduce ``tensor`` in place now (the native call on every backend)."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
