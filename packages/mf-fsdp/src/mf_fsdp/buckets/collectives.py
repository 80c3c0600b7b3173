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

Inside ``coalescing(max_numel)``, asynchronous calls on tensors of fewer than
``max_numel`` elements are recorded, not issued: when the block ends, the
recorded calls of one kind, group, dtype and op run as one collective, so
several small buckets cost one collective's latency instead of one each.
That is what a small model's ZeRO-3 step is made of on gloo, where each
collective costs a few hundred microseconds however few its bytes. A pack is
one coalesced call (torch's ``_coalescing_manager``: one NCCL group, gloo's
coalesced all-gather), where the backend packs and unpacks in its own thread
and nothing is copied on the main thread; else (gloo's reductions, and packs
gloo sends point to point, see above) mf packs the tensors into one flat
buffer, runs one collective and copies out (a gloo reduce-scatter pack runs as
an all-reduce of the pack, as gloo's own reduce-scatter does, see
``_run_pack``; gloo averages it on its own thread). gloo's threads so touch
mf's pack, never the engine's grad buffers: one coalesced all-reduce of those
buffers in place would spare the main thread both copies, but a torch 2.11 CI
run of it aborted with heap corruption (once, unexplained), so it is not
done. Measured on 2 gloo ranks, three small buckets, main-thread CPU / wall:
all-gather 129 / 1046 us coalesced against 299 / 1443 us packed by mf;
reduce-scatter 314 / 4657 against 470 / 1962 us; all-reduce 108 / 2771
against 268 / 1581 us. A synchronous call, or one on a larger tensor, first
issues what was recorded, so calls still go out in program order.

Under ``torch.compile`` these run eagerly (dynamo breaks the graph around
each): they manage buffers and handles that a traced graph cannot hold, and
torch 2.11's dynamo rewrites a traced ``all_gather_into_tensor`` into a
functional collective that returns a tensor, not a handle.

All ranks of a group must call these in the same order (as for any collective):
point-to-point messages between two ranks are matched in the order they were
posted.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist

from mf_fsdp.buckets.buffer_pool import BufferPool

__all__ = [
    "POINT_TO_POINT_MIN_BYTES",
    "Handle",
    "all_gather_into",
    "all_reduce",
    "all_to_all",
    "broadcast_from_first",
    "coalescing",
    "divides_after_reduction",
    "reduce_scatter_into",
    "release_workspaces",
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

    def __init__(self, works: list[dist.Work] | list[Handle], finish: Callable[[], None]) -> None:
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


def release_workspaces() -> None:
    """Free the receive buffers kept for reuse (between steps, nothing else is held)."""
    _WORKSPACES.clear()


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
    return _point_to_point(tensor, tensor.numel(), group)


def _point_to_point(like: torch.Tensor, numel: int, group: dist.ProcessGroup) -> bool:
    """Whether ``numel`` elements of ``like``'s dtype and device go point to point on ``group``."""
    return (
        like.device.type == "cpu"
        and _facts(group).gloo
        and numel * like.element_size() >= POINT_TO_POINT_MIN_BYTES
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


_DONE = _Then([], lambda: None)
"""The handle of work that finished when it was issued."""


def _alone(group: dist.ProcessGroup) -> bool:
    """A group of one: its collectives move nothing (see [Note: a group of one])."""
    return len(_facts(group).ranks) == 1


def _copy_alone(output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Handle | None:
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
    return _DONE if async_op else None


@torch.compiler.disable
def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Gather every rank's ``shard`` into ``output`` (rank order); like ``all_gather_into_tensor``.

    ``shard`` may be this rank's own region of ``output`` (an in-place gather).
    """
    if _alone(group):
        return _copy_alone(output, shard, async_op)
    recorded = _record_or_flush("all_gather", output, shard, None, group, async_op)
    if recorded is not None:
        return recorded
    return _all_gather_now(output, shard, group, async_op)


def _all_gather_now(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Handle | None:
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


@torch.compiler.disable
def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Sum (or average) ``input`` over the ranks; this rank's shard lands in ``output``.

    Like ``reduce_scatter_tensor``: ``input`` has ``N x output.numel()`` elements and
    rank ``i`` gets the reduction of every rank's piece ``i``. ``output`` may be this
    rank's own piece of ``input`` (in place, as NCCL allows); otherwise ``input`` is
    not changed. On gloo the peers' pieces are summed in rank order, so every rank's
    result is bitwise reproducible.
    """
    if _alone(group) and op in _SUMMING:
        return _copy_alone(output, input, async_op)
    recorded = _record_or_flush("reduce_scatter", output, input, op, group, async_op)
    if recorded is not None:
        return recorded
    return _reduce_scatter_now(output, input, op, group, async_op)


def _reduce_scatter_now(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool,
) -> Handle | None:
    if op not in _SUMMING or not uses_point_to_point(input, group):
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    facts = _facts(group)
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
    spare = _WORKSPACES.take(extra * flat.numel(), input.dtype, input.device)
    slots = [*([] if in_place else [flat]), *spare.view(extra, flat.numel()).unbind(0)]
    received = {i: slot for (i, _), slot in zip(peers, slots, strict=False)}
    works = _exchange(
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
        _WORKSPACES.give(spare)

    return _finish(works, combine, async_op)


@torch.compiler.disable
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``tensor`` in place over ``group`` (the native call on every backend)."""
    if _alone(group):
        return _DONE if async_op else None
    recorded = _record_or_flush("all_reduce", tensor, tensor, op, group, async_op)
    if recorded is not None:
        return recorded
    return _all_reduce_now(tensor, op, group, async_op)


def _all_reduce_now(
    tensor: torch.Tensor, op: ReduceOp, group: dist.ProcessGroup, async_op: bool
) -> Handle | None:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@torch.compiler.disable
def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``input``'s i-th split to rank i, receive rank i's into ``output``'s i-th split."""
    if group is not None and _alone(group):
        _copy_alone(output, input, False)
        return
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)


@torch.compiler.disable
def broadcast_from_first(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Overwrite ``tensor`` on every rank of ``group`` with the first member's."""
    if _alone(group):
        return
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


# ---------------------------------------------------------------------- coalescing
class _Deferred:
    """The handle of a call recorded inside ``coalescing()``; bound when the block issues it."""

    __slots__ = ("issued",)

    def __init__(self) -> None:
        self.issued: Handle | None = None

    def wait(self) -> object:
        if self.issued is None:
            raise RuntimeError(
                "collectives: a collective recorded inside coalescing() was waited on before "
                "it was issued (the block has not ended, or it ended with an exception)"
            )
        return self.issued.wait()


class _Call:
    """One recorded call: ``output`` receives, ``input`` is sent (one tensor for an all-reduce).

    ``key``: calls with equal keys can share one collective. ``numel``: the
    call's size, its whole bucket (the gathered output, the reduced input).
    Both are fixed at recording: packing reads them several times per call.
    """

    __slots__ = ("group", "handle", "input", "key", "kind", "numel", "op", "output")

    def __init__(
        self,
        kind: str,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp | None,
        group: dist.ProcessGroup,
    ) -> None:
        self.kind, self.output, self.input, self.op, self.group = kind, output, input, op, group
        self.handle = _Deferred()
        self.key = (kind, group, input.dtype, input.device, op)
        self.numel = max(output.numel(), input.numel())


class _Batch:
    """The calls recorded by an open ``coalescing()`` block.

    A plain class, not a dataclass: torch 2.11's dynamo takes an instance of a
    dataclass it meets while tracing a hook for a constant and fails to guard on it.
    """

    __slots__ = ("calls", "max_numel")

    def __init__(self, max_numel: int) -> None:
        self.max_numel = max_numel
        self.calls: list[_Call] = []


class _OpenBatch(threading.local):
    """The batch ``coalescing()`` has open on this thread (autograd may run hooks on its own)."""

    batch: _Batch | None = None


_OPEN = _OpenBatch()


@contextlib.contextmanager
def coalescing(max_numel: int) -> Iterator[None]:
    """Pack the small asynchronous collectives issued inside the block (see the module doc).

    A call's size is its whole bucket: an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor. Calls of ``max_numel``
    elements or more are issued at once; packs hold at most ``max_numel``
    elements. Handles of recorded calls may be waited on only after the block.
    A block inside another joins it; ``max_numel`` 0 records nothing.
    """
    if _OPEN.batch is not None:
        yield
        return
    _OPEN.batch = batch = _Batch(max_numel)
    try:
        yield
    except BaseException:
        batch.calls.clear()  # never issued: their handles say so when waited on
        raise
    finally:
        _OPEN.batch = None
    _issue(batch.calls, max_numel)


def _record_or_flush(
    kind: str,
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | None,
    group: dist.ProcessGroup,
    async_op: bool,
) -> Handle | None:
    """Record the call in the open batch and return its handle; else issue what was recorded."""
    batch = _OPEN.batch
    if batch is None:
        return None
    call = _Call(kind, output, input, op, group)
    if async_op and call.numel < batch.max_numel:
        batch.calls.append(call)
        return call.handle
    recorded, batch.calls = batch.calls, []
    _issue(recorded, batch.max_numel)
    return None


def _issue(calls: list[_Call], max_numel: int) -> None:
    """Issue recorded calls, packing those of one key up to ``max_numel`` elements together."""
    if not calls:
        return
    outer, _OPEN.batch = _OPEN.batch, None  # the packed calls are issued, not recorded
    try:
        _issue_packs(calls, max_numel)
    finally:
        _OPEN.batch = outer


def _issue_packs(calls: list[_Call], max_numel: int) -> None:
    open_packs: dict[tuple[object, ...], list[_Call]] = {}
    open_numel: dict[tuple[object, ...], int] = {}  # elements in each open pack so far
    packs: list[list[_Call]] = []
    for call in calls:
        key, numel = call.key, call.numel
        pack = open_packs.get(key)
        if pack is None or open_numel[key] + numel > max_numel:
            pack = open_packs[key] = []
            open_numel[key] = 0
            packs.append(pack)
        pack.append(call)
        open_numel[key] += numel
    for pack in packs:
        handle = _run_pack(pack)
        for call in pack:
            call.handle.issued = handle


def _run_pack(pack: list[_Call]) -> Handle:
    """One collective for every call of ``pack`` (the call itself when it is alone)."""
    first = pack[0]
    group, op = first.group, cast(ReduceOp, first.op)
    if len(pack) == 1:
        if first.kind == "all_gather":
            handle = _all_gather_now(first.output, first.input, group, True)
        elif first.kind == "reduce_scatter":
            handle = _reduce_scatter_now(first.output, first.input, op, group, True)
        else:
            handle = _all_reduce_now(first.output, op, group, True)
        return cast(Handle, handle)
    numel = sum(call.numel for call in pack)
    if (first.kind == "all_gather" or not _facts(group).gloo) and not _point_to_point(
        first.input, numel, group
    ):
        return _run_coalesced(pack)
    # Packed buffers are fresh, not pooled: packs vary in size, and a pool would keep
    # one of each size for good (they are under the window: cheap for the allocator).
    rows = 1 if first.kind == "all_reduce" else len(_facts(group).ranks)
    widths = [call.numel // rows for call in pack]
    total = sum(widths)
    packed_in = torch.empty(
        (rows if first.kind == "reduce_scatter" else 1, total),
        dtype=first.input.dtype,
        device=first.input.device,
    )
    torch.cat([call.input.view(len(packed_in), -1) for call in pack], dim=1, out=packed_in)
    if first.kind == "all_gather":
        packed_out = packed_in.new_empty((rows, total))
        work = _all_gather_now(packed_out, packed_in, group, True)
    elif first.kind == "reduce_scatter" and _point_to_point(first.input, numel, group):
        packed_out = packed_in.new_empty((1, total))
        work = _reduce_scatter_now(packed_out, packed_in, op, group, True)
    elif first.kind == "reduce_scatter":
        # gloo's reduce_scatter_tensor clones its input, all-reduces the clone and
        # copies the rank's piece out. The pack is mf's own copy already: all-reduce
        # (or average, on gloo's thread) it in place and copy out this rank's row.
        # The same bytes go over the wire, and gloo's clone, output and completion
        # callback go (2 gloo ranks, 3 small buckets: 115 us less of the main
        # thread's CPU per step on the tiny preset).
        me = _facts(group).me
        packed_out = packed_in[me : me + 1]
        work = _all_reduce_now(packed_in, op, group, True)
    else:
        packed_out = packed_in
        work = _all_reduce_now(packed_in, op, group, True)

    def copy_out() -> None:
        columns = packed_out.split_with_sizes(widths, dim=1)
        torch._foreach_copy_(
            [c.output.view(s.shape) for c, s in zip(pack, columns, strict=True)], columns
        )

    return _Then([cast(Handle, work)], copy_out)


def _run_coalesced(pack: list[_Call]) -> Handle:
    """Every call of ``pack`` as one coalesced collective: the backend does the packing."""
    first = pack[0]
    group, op = first.group, cast(ReduceOp, first.op)
    if first.kind == "all_gather" and _facts(group).gloo:
        # torch's _coalescing_manager takes each call through torch.distributed's
        # Python wrappers, then makes this one call of the group (2 gloo ranks, 3
        # buckets: 66-83 us of the main thread's CPU called directly, 122-156 through it).
        work = group.allgather_into_tensor_coalesced(
            [call.output for call in pack], [call.input for call in pack]
        )
        return _Then([work], lambda: None)
    with dist._coalescing_manager(group=group, async_ops=True) as manager:
        for call in pack:
            if call.kind == "all_gather":
                dist.all_gather_into_tensor(call.output, call.input, group=group, async_op=True)
            elif call.kind == "reduce_scatter":
                dist.reduce_scatter_tensor(
                    call.output, call.input, op=op, group=group, async_op=True
                )
            else:
                dist.all_reduce(call.output, op=op, group=group, async_op=True)
    return _Then([manager], lambda: None)


def divides_after_reduction(group: dist.ProcessGroup) -> bool:
    """Whether averaging in the reduction (``ReduceOp.AVG``) spares the caller a pass.

    True on gloo: it divides after summing, on its own thread for the packs of
    small buckets (all-reduced whole, see ``_run_pack``) and otherwise only this
    rank's shard, where dividing the input first is a pass over the whole bucket
    on the caller's thread.
    """
    return _facts(group).gloo
