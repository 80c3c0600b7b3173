"""A bucket's gradient reduction: inside dp_shard as often as asked, across dp_outer once a step.

Reduction contract (see docs/sharding.md): after ``reduce_outer`` the store holds
``f * sum over data-parallel ranks of the local grads``, with ``f = scale / dp``
(mean) or ``f = scale`` (sum); ``average_in_collective`` only moves the
division into the collective. Grads of parameters marked
``sequence_parallel=True`` are first summed over the tp group (one
all-reduce of their slices), since each TP rank's grad covers only its rows.

Under HSDP the reduction has two stages: inside ``dp_shard`` (``start_reduce`` /
``finish_reduce``, as often as the engine asks) and across ``dp_outer``
(``reduce_outer``, once per optimizer step). Replicated HSDP keeps the
inner-reduced shard in the store and all-reduces it across dp_outer;
hybrid-sharded HSDP (``hsdp_outer_dp_shard``, ZeRO-3 only) accumulates the
inner-reduced shard in a pooled ``pending`` buffer and reduce-scatters it across
dp_outer into a store of ``1 / (outer x inner)`` of the bucket; after the
optimizer step the updated sub-shards are all-gathered across dp_outer back
into the inner weight shard.

Reduced grads set aside while newer ones are accumulated (a store that shares
the local buffer) rejoin the store once the new ones are reduced as far.

``BucketReduction`` is a part of ``Bucket`` (``buckets/bucket.py``), kept in a
module of its own: it reads the bucket's buffers, states and pool, and issues
every reduction collective through ``buckets/collectives.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.buffer_pool import BufferPool
from mf_fsdp.buckets.dtypes import BucketDtypes
from mf_fsdp.buckets.grad_state import GradState, Local, Reduced
from mf_fsdp.buckets.grad_storage import GradBuffers
from mf_fsdp.buckets.layout import BucketLayout
from mf_fsdp.buckets.reduce_spec import ReduceSpec
from mf_fsdp.distributed_index import FSDPDistributedIndex

__all__ = ["BucketReduction"]


class _Reducing(Protocol):
    """What the reduction reads and calls of its ``Bucket``."""

    grads: GradState
    pool: BufferPool
    device: torch.device
    dtypes: BucketDtypes
    reduce_spec: ReduceSpec
    dist_index: FSDPDistributedIndex
    layout: BucketLayout
    outer: dist.ProcessGroup | None
    hybrid: bool
    replicated: bool
    requires_grad: bool
    mark_unused_params: bool
    pending_inner: torch.Tensor | None
    _pending: tuple[collectives.Handle | None, torch.Tensor, torch.Tensor] | None
    _aside: dict[Reduced, torch.Tensor]
    _folded: torch.Tensor | None
    _sp_slices: list[tuple[int, int]]
    _host_grads_current: bool

    @property
    def whole_on_every_rank(self) -> bool: ...

    def _grad_buffers(self) -> GradBuffers: ...

    def _drop_folded(self) -> None: ...

    def _put_aside(self, reduced: torch.Tensor, level: Reduced) -> None: ...

    def _merge_aside(self, level: Reduced, store: torch.Tensor) -> None: ...

    def _sum_sequence_parallel_grads(self, src: torch.Tensor) -> None: ...

    def finish_reduce(self) -> None: ...

    def note_rowless_use(self, local: torch.Tensor) -> None: ...

    @property
    def outer_due(self) -> bool: ...

    def launch_outer(self, async_op: bool) -> collectives.Handle | None: ...

    def land_outer(self, work: collectives.Handle | None) -> None: ...


class BucketReduction:
    """The reduction methods of ``Bucket`` (see the module docstring)."""

    # The Bucket attributes these methods assign, with Bucket's types (annotations only:
    # a type checker would otherwise take their type from the first assignment here).
    _pending: tuple[collectives.Handle | None, torch.Tensor, torch.Tensor] | None
    pending_inner: torch.Tensor | None

    def _set_store_aside(self: _Reducing) -> None:
        """Move the reduced grads out of a store that shares the local buffer, and clear it.

        New local grads are about to be accumulated there; the reduced ones wait
        aside and rejoin the store once the new ones are reduced as far.
        """
        buffers = self._grad_buffers()
        self._put_aside(buffers.store(), self.grads.reduced)
        buffers.clear(buffers.local_for_reduction())
        self._host_grads_current = False
        self.grads.set_aside()

    def _put_aside(self: _Reducing, reduced: torch.Tensor, level: Reduced) -> None:
        held = self._aside.get(level)
        if held is None:
            self._aside[level] = self.pool.take(reduced.numel(), reduced.dtype, self.device)
            self._aside[level].copy_(reduced)
        else:
            held.add_(reduced)

    def _merge_aside(self: _Reducing, level: Reduced, store: torch.Tensor) -> None:
        """Add the grads set aside at ``level`` into ``store`` (which now holds that level)."""
        held = self._aside.pop(level, None)
        if held is not None:
            store.add_(held)
            self.pool.give(held)

    def start_reduce(self: _Reducing, async_op: bool) -> None:
        """Launch the reduction of the accumulated local grads (one collective)."""
        spec = self.reduce_spec
        if not self.requires_grad or self.grads.local is not Local.ACCUMULATED:
            return
        buffers = self._grad_buffers()
        local = buffers.local_for_reduction()
        if self.mark_unused_params:
            self.note_rowless_use(local)
        # The result may land in the store itself while it holds nothing (a store that
        # views the local buffer is this rank's piece of it: an in-place reduce-scatter).
        into_store = (
            self.grads.reduced is Reduced.NONE
            and not self.hybrid
            and buffers.store_dtype == self.dtypes.comm
        )
        if self.dtypes.comm == local.dtype:
            src = local
        elif into_store and (self.replicated or self.whole_on_every_rank):
            # The reduction runs in place (an all-reduce, or the identity over a group
            # of one): cast the local grads into the store, not into a temporary.
            src = buffers.store(zeroed=False).copy_(local)
        else:
            src = self.pool.take(local.numel(), self.dtypes.comm, self.device).copy_(local)
        if self._folded is not None:
            src.add_(self._folded)
            self._drop_folded()
        if spec.pre != 1.0:
            src.mul_(spec.pre)
        self._sum_sequence_parallel_grads(src)
        index = self.dist_index
        if self.replicated:
            work = collectives.all_reduce(src, spec.op, index.fsdp_group, async_op=async_op)
            out = src
        else:
            out = (
                buffers.store(zeroed=False)  # the reduction overwrites all of it
                if into_store
                else self.pool.take(self.layout.shard_size, src.dtype, self.device)
            )
            work = collectives.reduce_scatter_into(
                out, src, spec.op, index.fsdp_group, async_op=async_op
            )
        self._pending = (work, src, out)
        self.grads.launch()

    def _sum_sequence_parallel_grads(self: _Reducing, src: torch.Tensor) -> None:
        """All-reduce the sequence-parallel params' local grads over TP (one collective)."""
        if not self._sp_slices:
            return
        flat = torch.cat([src[s:e] for s, e in self._sp_slices])
        collectives.all_reduce(flat, dist.ReduceOp.SUM, self.dist_index.tp_group)
        offset = 0
        for start, end in self._sp_slices:
            src[start:end].copy_(flat[offset : offset + end - start])
            offset += end - start

    def finish_reduce(self: _Reducing) -> None:
        """Wait for the pending dp_shard reduction and fold its result into the grad store.

        Under HSDP the result still lacks the dp_outer reduction (``reduce_outer``).
        """
        if self._pending is None:
            return
        work, src, out = self._pending
        self._pending = None
        self._host_grads_current = False
        if work is not None:
            work.wait()
        buffers = self._grad_buffers()
        store = buffers.store()
        local = buffers.local_for_reduction()
        if self.hybrid:
            if self.pending_inner is None:
                self.pending_inner = out  # the pooled result is kept until reduce_outer
            else:
                self.pending_inner.add_(out)
        elif buffers.aliases_local:
            if out is not local and out is not store:  # it arrived in a temporary
                store.copy_(out)
        else:
            if self.grads.reduced is Reduced.FULL and self.outer is not None:
                # Fully reduced grads must not go through the dp_outer stage again.
                self._put_aside(store, Reduced.FULL)
                self._grad_buffers().clear(store)
            if out is not store:
                store.add_(out)
        buffers.after_reduction()
        self.grads.land(outer_due=self.outer is not None, hybrid=self.hybrid)
        if not self.hybrid:
            self._merge_aside(self.grads.reduced, store)
        keep = (local, store, self.pending_inner)
        temporaries = {id(t): t for t in (src, out) if all(t is not k for k in keep)}
        for tensor in temporaries.values():
            self.pool.give(tensor)

    @property
    def outer_due(self: _Reducing) -> bool:
        """Replicated HSDP whose store is reduced over dp_shard only: its dp_outer stage is due."""
        return self.outer is not None and not self.hybrid and self.grads.reduced is Reduced.INNER

    def launch_outer(self: _Reducing, async_op: bool) -> collectives.Handle | None:
        """Start the dp_outer all-reduce of a replicated HSDP store (``outer_due``; in place).

        ``land_outer`` with the handle finishes it; inside ``coalescing()`` several
        buckets' all-reduces go out as one.
        """
        assert self.outer is not None  # internal invariant: outer_due
        self._host_grads_current = False
        if self.dist_index.outer_size == 1:  # one replica has nothing to reduce
            return None
        store = self._grad_buffers().store()
        return collectives.all_reduce(store, self.reduce_spec.outer_op, self.outer, async_op)

    def land_outer(self: _Reducing, work: collectives.Handle | None) -> None:
        """Wait for ``launch_outer``'s all-reduce: the store holds the fully reduced grads."""
        if work is not None:
            work.wait()
        self.grads.reduce_outer()
        self._merge_aside(Reduced.FULL, self._grad_buffers().store())

    def reduce_outer(self: _Reducing) -> None:
        """Finish the dp_shard reduction, then run the dp_outer one (once per step).

        Replicated HSDP all-reduces the store across dp_outer; hybrid-sharded HSDP
        reduce-scatters the accumulated inner shard into this rank's sub-shard of the
        store. A no-op without dp_outer or when nothing new was reduced.
        """
        self.finish_reduce()
        if self.outer is None:
            return
        if not self.hybrid:
            if self.outer_due:
                self.land_outer(self.launch_outer(async_op=False))
            return
        pending, buffers = self.pending_inner, self._grad_buffers()
        if pending is None:
            return
        self._host_grads_current = False
        direct = self.grads.reduced is Reduced.NONE and buffers.store_dtype == pending.dtype
        store = buffers.store(zeroed=not direct)
        sub = store if direct else self.pool.take(store.numel(), pending.dtype, self.device)
        collectives.reduce_scatter_into(sub, pending, self.reduce_spec.outer_op, self.outer)
        if sub is not store:
            store.add_(sub)
            self.pool.give(sub)
        self.pool.give(pending)
        self.pending_inner = None
        self.grads.reduce_outer()
