"""Packing small collectives: the calls recorded inside ``coalescing()`` run as one each.

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

The packs run through ``buckets/transfers.py``; the engine records calls through
``buckets/collectives.py``'s entry points, which ask ``record_or_flush`` first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist

from mf_fsdp.buckets import transfers
from mf_fsdp.buckets.transfers import Handle, ReduceOp, Then

__all__ = ["coalescing", "record_or_flush"]


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


def record_or_flush(
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
            handle = transfers.all_gather_now(first.output, first.input, group, True)
        elif first.kind == "reduce_scatter":
            handle = transfers.reduce_scatter_now(first.output, first.input, op, group, True)
        else:
            handle = transfers.all_reduce_now(first.output, op, group, True)
        return cast(Handle, handle)
    numel = sum(call.numel for call in pack)
    if (
        first.kind == "all_gather" or not transfers.group_facts(group).gloo
    ) and not transfers.point_to_point(first.input, numel, group):
        return _run_coalesced(pack)
    # Packed buffers are fresh, not pooled: packs vary in size, and a pool would keep
    # one of each size for good (they are under the window: cheap for the allocator).
    rows = 1 if first.kind == "all_reduce" else len(transfers.group_facts(group).ranks)
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
        work = transfers.all_gather_now(packed_out, packed_in, group, True)
    elif first.kind == "reduce_scatter" and transfers.point_to_point(first.input, numel, group):
        packed_out = packed_in.new_empty((1, total))
        work = transfers.reduce_scatter_now(packed_out, packed_in, op, group, True)
    elif first.kind == "reduce_scatter":
        # gloo's reduce_scatter_tensor clones its input, all-reduces the clone and
        # copies the rank's piece out. The pack is mf's own copy already: all-reduce
        # (or average, on gloo's thread) it in place and copy out this rank's row.
        # The same bytes go over the wire, and gloo's clone, output and completion
        # callback go (2 gloo ranks, 3 small buckets: 115 us less of the main
        # thread's CPU per step on the tiny preset).
        me = transfers.group_facts(group).me
        packed_out = packed_in[me : me + 1]
        work = transfers.all_reduce_now(packed_in, op, group, True)
    else:
        packed_out = packed_in
        work = transfers.all_reduce_now(packed_in, op, group, True)

    def copy_out() -> None:
        columns = packed_out.split_with_sizes(widths, dim=1)
        torch._foreach_copy_(
            [c.output.view(s.shape) for c, s in zip(pack, columns, strict=True)], columns
        )

    return Then([cast(Handle, work)], copy_out)


def _run_coalesced(pack: list[_Call]) -> Handle:
    """Every call of ``pack`` as one coalesced collective: the backend does the packing."""
    first = pack[0]
    group, op = first.group, cast(ReduceOp, first.op)
    if first.kind == "all_gather" and transfers.group_facts(group).gloo:
        # torch's _coalescing_manager takes each call through torch.distributed's
        # Python wrappers, then makes this one call of the group (2 gloo ranks, 3
        # buckets: 66-83 us of the main thread's CPU called directly, 122-156 through it).
        work = group.allgather_into_tensor_coalesced(
            [call.output for call in pack], [call.input for call in pack]
        )
        return Then([work], lambda: None)
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
    return Then([manager], lambda: None)
