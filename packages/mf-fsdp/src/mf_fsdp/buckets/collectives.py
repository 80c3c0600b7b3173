"""Every collective the engine runs on its buckets, as free functions with backend-aware paths.

The engine never calls ``torch.distributed`` directly for its buckets: it calls
these, and each picks the implementation that moves the fewest bytes on the
group's backend (``buckets/transfers.py``: native on NCCL, point to point for
large gloo buckets), or records the call to pack it with others inside
``coalescing()`` (``buckets/coalescing.py``).

Under ``torch.compile`` these run eagerly (dynamo breaks the graph around
each): they manage buffers and handles that a traced graph cannot hold, and
torch 2.11's dynamo rewrites a traced ``all_gather_into_tensor`` into a
functional collective that returns a tensor, not a handle.

All ranks of a group must call these in the same order (as for any collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mf_fsdp.buckets import transfers
from mf_fsdp.buckets.coalescing import coalescing, record_or_flush
from mf_fsdp.buckets.transfers import (
    POINT_TO_POINT_MIN_BYTES,
    Handle,
    ReduceOp,
    release_workspaces,
    uses_point_to_point,
    workspace_bytes,
)

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


@torch.compiler.disable
def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Gather every rank's ``shard`` into ``output`` (rank order); like ``all_gather_into_tensor``.

    ``shard`` may be this rank's own region of ``output`` (an in-place gather).
    A one-byte float (fp8) travels as its bytes: a gather copies bits, and gloo
    has no fp8 type.
    """
    if shard.element_size() == 1 and shard.is_floating_point():
        output, shard = output.view(torch.uint8), shard.view(torch.uint8)
    if transfers.alone(group):
        return transfers.copy_alone(output, shard, async_op)
    recorded = record_or_flush("all_gather", output, shard, None, group, async_op)
    if recorded is not None:
        return recorded
    return transfers.all_gather_now(output, shard, group, async_op)


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
    if transfers.alone(group) and op in transfers.SUMMING:
        return transfers.copy_alone(output, input, async_op)
    recorded = record_or_flush("reduce_scatter", output, input, op, group, async_op)
    if recorded is not None:
        return recorded
    return transfers.reduce_scatter_now(output, input, op, group, async_op)


@torch.compiler.disable
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``tensor`` in place over ``group`` (the native call on every backend)."""
    if transfers.alone(group):
        return transfers.DONE if async_op else None
    recorded = record_or_flush("all_reduce", tensor, tensor, op, group, async_op)
    if recorded is not None:
        return recorded
    return transfers.all_reduce_now(tensor, op, group, async_op)


@torch.compiler.disable
def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``input``'s i-th split to rank i, receive rank i's into ``output``'s i-th split."""
    if group is not None and transfers.alone(group):
        transfers.copy_alone(output, input, False)
        return
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)


@torch.compiler.disable
def broadcast_from_first(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Overwrite ``tensor`` on every rank of ``group`` with the first member's."""
    if transfers.alone(group):
        return
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def divides_after_reduction(group: dist.ProcessGroup) -> bool:
    """Whether averaging in the reduction (``ReduceOp.AVG``) spares the caller a pass.

    True on gloo: it divides after summing, on its own thread for the packs of
    small buckets (all-reduced whole, see ``coalescing._run_pack``) and otherwise only this
    rank's shard, where dividing the input first is a pass over the whole bucket
    on the caller's thread.
    """
    return transfers.group_facts(group).gloo
