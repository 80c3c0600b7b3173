"""Where one bucket's weights live: one storage class per ZeRO strategy, picked once.

======================  ================================  ==============================
storage                 compute weights (``full``)        main weights (``main``)
======================  ================================  ==============================
``ReplicatedWeights``   the whole bucket, always          the whole bucket
(ZeRO-0)
``ShardOwnerWeights``   the whole bucket, always          this rank's shard of it
(ZeRO-1/2)
``ShardedWeights``      this rank's shard (``shard``);    this rank's shard (its
(ZeRO-3)                the whole bucket only while       sub-shard under hybrid HSDP)
                        gathered
``CastShardWeights``    the whole bucket only while       this rank's shard, the only
(ZeRO-3, main dtype     gathered; the gather casts the    copy kept between passes
of its own)             main shard into place
======================  ================================  ==============================

``main`` is what the optimizer steps: a view of the compute weights when the
dtypes agree, else a buffer of its own in the main dtype. ``install`` writes
the stepped main weights back into the compute weights: a copy (ZeRO-0), a
copy and an all-gather of the shards (ZeRO-1/2), a copy into the shard
(ZeRO-3; under hybrid HSDP followed by an all-gather of the sub-shards across
dp_outer). ZeRO-3's ``full`` is one tensor for the bucket's lifetime whose
storage is resized to zero when released, so every view of it (parameters'
``.data``, views autograd saved) always sees the current gather.

ZeRO-3 with main weights in a dtype of their own (bf16 compute, fp32 main)
keeps no compute-dtype shard: like FSDP2, it casts on the way into the
all-gather, so between passes a rank holds its fp32 shard and nothing else.

With ``offload`` (``offload_optimizer_state``) ``main`` is always a buffer of
its own in host memory (see [Note: optimizer state on the host] in
``buckets/host.py``): ZeRO-3 then keeps the compute-dtype shard on the device
(``ShardedWeights``, never ``CastShardWeights``), and ``install`` copies the
host weights into it (ZeRO-1/2: into this rank's part of the whole bucket).
"""

from __future__ import annotations

from typing import cast

import torch

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.grad_state import Gather, check_invariant
from mf_fsdp.buckets.host import host_zeros
from mf_fsdp.buckets.layout import BucketLayout
from mf_fsdp.buckets.param import FSDPParam
from mf_fsdp.config import ZeroDPStrategy
from mf_fsdp.distributed_index import FSDPDistributedIndex

__all__ = [
    "BucketGeometry",
    "CastShardWeights",
    "ReplicatedWeights",
    "ShardOwnerWeights",
    "ShardedWeights",
    "WeightStorage",
    "weight_storage_for",
]


class BucketGeometry:
    """Where this rank's pieces of one bucket are.

    Args:
        layout: the bucket's weights over the dp_shard ranks.
        main_layout: what the optimizer owns (main weights, reduced grads) over the
            ranks that split it: the same layout except under hybrid HSDP, where
            each inner shard is ``outer_size`` sub-shards.
        rank: this rank's shard of ``layout``.
        main_rank: this rank's shard of ``main_layout``.
    """

    __slots__ = ("hi", "layout", "lo", "main_layout", "main_rank", "rank", "sub_lo")

    def __init__(
        self, layout: BucketLayout, main_layout: BucketLayout, rank: int, main_rank: int
    ) -> None:
        self.layout = layout
        self.main_layout = main_layout
        self.rank = rank
        self.main_rank = main_rank
        self.lo, self.hi = layout.shard_range(rank)
        self.sub_lo = main_layout.shard_range(main_rank)[0]

    def owned_rows_view(self, fp: FSDPParam, buffer: torch.Tensor) -> torch.Tensor:
        """``fp``'s rows this rank owns (``main_rows``), viewed in its shape in ``buffer``."""
        begin, end = fp.main_rows
        row = fp.row_numel
        first = fp.start + begin * row - self.sub_lo if begin < end else 0
        return fp.view_rows(buffer[first : first + (end - begin) * row], end - begin)


class WeightStorage:
    """The compute and main weights of one bucket (the base: both always present).

    Args:
        geometry: where this rank's pieces are.
        compute: the compute dtype; main: the main-weights dtype.
        device: where the buffers live.
        index: the bucket's groups (the expert index for expert parameters).
        name: the bucket's name, for invariant errors.
        offload: the main weights live in host memory (a buffer of their own).
    """

    full: torch.Tensor
    main: torch.Tensor
    gather: Gather = Gather.GATHERED

    def __init__(
        self,
        geometry: BucketGeometry,
        compute: torch.dtype,
        main: torch.dtype,
        device: torch.device,
        index: FSDPDistributedIndex,
        name: str,
        offload: bool = False,
    ) -> None:
        self.geometry = geometry
        self.offload = offload
        self.index = index
        self.name = name
        self._hybrid = bool(index.hsdp_outer_dp_shard)
        self._main_dtype = main
        self._device = device
        self._allocate(compute)

    def _allocate(self, compute: torch.dtype) -> None:
        """Create ``full`` and ``main`` (and whatever else the strategy keeps)."""
        raise NotImplementedError

    def _whole_bucket(self, compute: torch.dtype) -> torch.Tensor:
        numel = self.geometry.layout.padded_numel
        return torch.zeros(numel, dtype=compute, device=self._device)

    def _main_over(self, own: torch.Tensor) -> torch.Tensor:
        """The main weights over ``own``.

        ``own`` itself when the dtypes agree and nothing is offloaded, else a zeroed
        buffer of its size in the main dtype (in host memory when offloaded).
        """
        if self.offload:
            return host_zeros(own.numel(), self._main_dtype, self._device)
        if self._main_dtype == own.dtype:
            return own
        return torch.zeros(own.numel(), dtype=self._main_dtype, device=self._device)

    @property
    def main_is_separate(self) -> bool:
        """True when the main weights are a buffer of their own (other dtype, or offloaded)."""
        return self.offload or self.main.dtype != self.full.dtype

    def _copy_main_piece(self, index: int, start: int, flat: torch.Tensor) -> None:
        """Write this rank's owned piece of parameter ``index`` into separate main weights."""
        g = self.geometry
        b, e = g.main_layout.local_piece(index, g.main_rank)
        if self.main_is_separate and b < e:
            self.main[start + b - g.sub_lo : start + e - g.sub_lo].copy_(flat[b:e])

    def copy_in(self, index: int, start: int, flat: torch.Tensor) -> None:
        """Write parameter ``index``'s whole flat value (bucket offset ``start``)."""
        self.full[start : start + flat.numel()].copy_(flat)
        self._copy_main_piece(index, start, flat)

    def owned_view(self, fp: FSDPParam, buffer: torch.Tensor) -> torch.Tensor:
        """``fp``'s part this rank's optimizer owns, viewed in ``buffer`` (main or grads)."""
        return self.geometry.owned_rows_view(fp, buffer)

    def unshard(self, async_op: bool) -> None:
        """Start gathering the whole bucket (nothing to do: it is always whole)."""

    def wait_unshard(self) -> None:
        """Finish the gather started by ``unshard`` (none here)."""

    def reshard(self) -> None:
        """Release the whole bucket (kept here)."""

    def hold_full_bytes(self) -> None:
        """Give ``full`` its bytes (for views of it); they are always there here."""

    def kept(self) -> torch.Tensor | None:
        """The compute weights this rank keeps between passes (None: only the main ones)."""
        return self.full

    def kept_bytes(self) -> int:
        """Bytes of what ``kept`` returns."""
        kept = self.kept()
        return 0 if kept is None else kept.numel() * kept.element_size()

    def install(self, async_op: bool) -> collectives.Handle | None:
        """Write the stepped main weights into the compute weights (see the module table)."""
        raise NotImplementedError

    def broadcast_replicas(self) -> None:
        """Make every replica of this rank's weights equal to the first replica's."""
        raise NotImplementedError


class ReplicatedWeights(WeightStorage):
    """ZeRO-0: every rank holds and steps the whole bucket."""

    def _allocate(self, compute: torch.dtype) -> None:
        self.full = self._whole_bucket(compute)
        self.main = self._main_over(self.full)

    def copy_in(self, index: int, start: int, flat: torch.Tensor) -> None:
        """Write the whole value into the whole-bucket weights (and main weights)."""
        self.full[start : start + flat.numel()].copy_(flat)
        if self.main_is_separate:
            self.main[start : start + flat.numel()].copy_(flat)

    def owned_view(self, fp: FSDPParam, buffer: torch.Tensor) -> torch.Tensor:
        """The whole parameter: every rank owns all of it."""
        return fp.view_rows(buffer[fp.start : fp.start + fp.numel], fp.shape[fp.row_dim])

    def install(self, async_op: bool) -> collectives.Handle | None:
        """Copy separate main weights into the compute weights."""
        if self.main is not self.full:
            self.full.copy_(self.main)
        return None

    def broadcast_replicas(self) -> None:
        """Broadcast the whole bucket over the dp group."""
        collectives.broadcast_from_first(self.full, self.index.get_dp_group())
        if self.main_is_separate:
            self.main.copy_(self.full)


class ShardOwnerWeights(WeightStorage):
    """ZeRO-1/2: every rank holds the whole bucket and steps its own shard."""

    def _allocate(self, compute: torch.dtype) -> None:
        self.full = self._whole_bucket(compute)
        # One view for the bucket's lifetime: ``main`` is this very object when the
        # dtypes agree, so ``install`` sees that there is nothing to copy.
        self._own = self.full[self.geometry.lo : self.geometry.hi]
        self.main = self._main_over(self._own)

    def install(self, async_op: bool) -> collectives.Handle | None:
        """Copy this rank's stepped shard in (unless it is the main weights), then all-gather."""
        own = self._own
        if self.main is not own:
            own.copy_(self.main, non_blocking=self.offload)
        return collectives.all_gather_into(self.full, own, self.index.fsdp_group, async_op=async_op)

    def broadcast_replicas(self) -> None:
        """Broadcast the whole bucket over the dp group."""
        collectives.broadcast_from_first(self.full, self.index.get_dp_group())
        if self.main_is_separate:
            self.main.copy_(self._own)


class ShardedWeights(WeightStorage):
    """ZeRO-3: every rank holds its shard; the whole bucket only while gathered."""

    def _allocate(self, compute: torch.dtype) -> None:
        layout = self.geometry.layout
        self.shard = torch.zeros(layout.shard_size, dtype=compute, device=self._device)
        self.main = self._main_over(self.own_sub_shard())
        self._allocate_released_full(compute)

    def _allocate_released_full(self, compute: torch.dtype) -> None:
        """``full`` without bytes: building the engine never holds every bucket at once."""
        self.full = torch.empty(
            self.geometry.layout.padded_numel, dtype=compute, device=self._device
        )
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.gather = Gather.RELEASED
        self._gathering: collectives.Handle | None = None

    def own_sub_shard(self) -> torch.Tensor:
        """The part of ``shard`` this rank's optimizer owns (all of it unless hybrid)."""
        g = self.geometry
        if not self._hybrid:
            return self.shard
        lo = g.sub_lo - g.lo
        return self.shard[lo : lo + g.main_layout.shard_size]

    def copy_in(self, index: int, start: int, flat: torch.Tensor) -> None:
        """Write this rank's pieces into the shard (and main weights)."""
        g = self.geometry
        b, e = g.layout.local_piece(index, g.rank)
        if b < e:
            self.shard[start + b - g.lo : start + e - g.lo].copy_(flat[b:e])
        self._copy_main_piece(index, start, flat)

    def unshard(self, async_op: bool) -> None:
        """Start (or do) the all-gather of the shards; a no-op unless released."""
        if self.gather is not Gather.RELEASED:
            return
        self.hold_full_bytes()
        self._gathering = (
            collectives.all_gather_into(
                self.full, self._gather_source(), self.index.fsdp_group, async_op=async_op
            )
            or _DONE
        )
        self.gather = Gather.GATHERING

    def _gather_source(self) -> torch.Tensor:
        """What this rank contributes to the all-gather (its compute-dtype shard)."""
        return self.shard

    def wait_unshard(self) -> None:
        """Finish the all-gather; views of ``full`` now hold the whole weights."""
        if self.gather is not Gather.GATHERING:
            return
        handle = self._gathering
        check_invariant(handle is not None, None, self.name, "gathering without an all-gather")
        cast(collectives.Handle, handle).wait()
        self._gathering = None
        self.gather = Gather.GATHERED

    def reshard(self) -> None:
        """Free the whole bucket; views of it keep their shapes, lose storage."""
        self.wait_unshard()
        self.gather = Gather.RELEASED
        self.full.untyped_storage().resize_(0)

    def hold_full_bytes(self) -> None:
        """Give ``full`` its bytes back (``reshard`` frees them again)."""
        if self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self._full_nbytes)

    def kept(self) -> torch.Tensor | None:
        """The shard: all a rank keeps between passes."""
        return self.shard

    def install(self, async_op: bool) -> collectives.Handle | None:
        """Copy the stepped main weights into the shard (all-gather sub-shards)."""
        own = self.own_sub_shard()
        if self.main_is_separate:
            own.copy_(self.main, non_blocking=self.offload)
        if not self._hybrid:
            return None
        # In-place all-gather across dp_outer: the sub-shards rebuild the inner shard.
        return collectives.all_gather_into(
            self.shard, own, self.index.outer_fsdp_group, async_op=async_op
        )

    def broadcast_replicas(self) -> None:
        """Broadcast the shard to its replicas across dp_outer (if any)."""
        pg = self.index.outer_fsdp_group
        if pg is None:  # shards have replicas only across dp_outer
            return
        collectives.broadcast_from_first(self.shard, pg)
        if not self.main_is_separate:
            return
        if self._hybrid:  # sub-shards have no replicas: refresh them from the shard
            self.main.copy_(self.own_sub_shard())
        else:
            collectives.broadcast_from_first(self.main, pg)


class CastShardWeights(ShardedWeights):
    """ZeRO-3 whose main weights have a dtype of their own: only they are kept.

    The gather casts the main shard into this rank's region of ``full`` and
    all-gathers in place, so no compute-dtype shard lives between passes (FSDP2
    casts on the way into its all-gather alike). Not under hybrid HSDP, where
    the main weights are a sub-shard of the gathered shard.
    """

    def _allocate(self, compute: torch.dtype) -> None:
        shard = self.geometry.layout.shard_size
        self.main = torch.zeros(shard, dtype=self._main_dtype, device=self._device)
        self._allocate_released_full(compute)

    def _gather_source(self) -> torch.Tensor:
        """This rank's region of ``full``, cast from the main shard."""
        own = self.full[self.geometry.lo : self.geometry.hi]
        own.copy_(self.main)
        return own

    def copy_in(self, index: int, start: int, flat: torch.Tensor) -> None:
        """Write this rank's piece into the main weights; a gathered bucket is dropped."""
        self.reshard()
        self._copy_main_piece(index, start, flat)

    def kept(self) -> torch.Tensor | None:
        """Nothing in the compute dtype: the main shard is all a rank keeps."""
        return None

    def install(self, async_op: bool) -> collectives.Handle | None:
        """Nothing to copy: the next gather casts the stepped weights (drops a gathered bucket)."""
        self.reshard()
        return None

    def broadcast_replicas(self) -> None:
        """Broadcast the main shard to its replicas across dp_outer (if any)."""
        pg = self.index.outer_fsdp_group
        if pg is not None:
            collectives.broadcast_from_first(self.main, pg)


def weight_storage_for(
    strategy: ZeroDPStrategy, alone: bool = False, cast_main: bool = False
) -> type[WeightStorage]:
    """The storage class of ``strategy`` (see the module table).

    ``cast_main``: the main weights have a dtype of their own and are not a
    hybrid-HSDP sub-shard; ZeRO-3 then keeps only them (``CastShardWeights``),
    even over one rank. Otherwise ``alone`` (the bucket is sharded over one
    rank, so its shard is the whole bucket) makes ZeRO-3 keep it whole, as
    ZeRO-1/2 do, and never gather or release (see [Note: a group of one] in
    ``transfers``).
    """
    if strategy.shards_params and cast_main:
        return CastShardWeights
    if strategy.shards_params and not alone:
        return ShardedWeights
    return ShardOwnerWeights if strategy.level > 0 else ReplicatedWeights


class _Done:
    """A finished collective (what a synchronous call returns in place of a Work)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()
