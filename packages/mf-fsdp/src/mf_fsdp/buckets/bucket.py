"""Bucket: the parameters of one flat bucket, its buffers and its collectives.

A bucket owns, for the parameters of one FSDP unit with one dtype (or one
row-size group of them), its weights (``weights``, see ``buckets/weight_storage.py``)
and its gradient buffers (``buffers``, see ``buckets/grad_storage.py``): each the
class of its ZeRO strategy, picked once when the bucket is built. The bucket
decides when to accumulate, reduce, set aside and zero; the classes keep the
buffers and their lifetimes.

The layout cuts shards between dim-0 rows only, so each parameter's rows on
this rank (its ``FSDPParam.main_rows``) are viewed in the main weights and
``grad_store`` with the parameter's trailing shape (``main_view``): the
sharded form the optimizer steps. Compute parameters' ``.data`` and ``.grad``
are views of the whole-bucket weights / local grads; between passes a
ZeRO-3 parameter keeps its view of a whole bucket whose storage is resized to
zero. Where the gradients are in their reduction, and whether the weights are
gathered, are explicit states (``buckets/grad_state.py``).
Temporary whole-bucket tensors come from a shared ``BufferPool`` and go back
to it, so the units of one backward reuse each other's buffers. Its reduction
(``buckets/bucket_reduction.py``) and its marks of gradients no rank made
(``buckets/unused_grads.py``) are parts of the class kept in modules of their
own.

With ``offload`` (``offload_optimizer_state``) the main weights live in host
memory and the sharded parameters' gradients are views of ``host_grads``, a
host copy of the store refreshed by ``offload_grads`` whenever the grads are
handed to the optimizer (see [Note: optimizer state on the host] in
``buckets/host.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.bucket_reduction import BucketReduction
from mf_fsdp.buckets.buffer_pool import BufferPool
from mf_fsdp.buckets.dtypes import BucketDtypes
from mf_fsdp.buckets.extension import ExtensionWeights, torch_policy
from mf_fsdp.buckets.grad_state import Gather, GradState, Local, Reduced, check_invariant
from mf_fsdp.buckets.grad_storage import GradBuffers, grad_buffers_for
from mf_fsdp.buckets.host import host_zeros
from mf_fsdp.buckets.layout import BucketLayout
from mf_fsdp.buckets.param import FSDPParam
from mf_fsdp.buckets.reduce_spec import ReduceSpec
from mf_fsdp.buckets.tp_params import (
    TPInfo,
    local_shape,
    local_value,
    set_local_data,
    wrap_grad,
)
from mf_fsdp.buckets.transforms import outside_transforms
from mf_fsdp.buckets.unused_grads import OwnedSpans, UnusedGrads
from mf_fsdp.buckets.weight_storage import BucketGeometry, WeightStorage, weight_storage_for
from mf_fsdp.config import ZeroDPStrategy
from mf_fsdp.distributed_index import FSDPDistributedIndex

__all__ = ["Bucket", "ParamSource"]


@dataclass(frozen=True, slots=True)
class ParamSource:
    """What the engine knows of a parameter before it enters a bucket.

    Attributes:
        fqns: every name of the parameter in the wrapped module (canonical first).
        slots: every ``(module, attribute)`` registering it.
        tp: its tensor-parallel facts, or None.
    """

    fqns: tuple[str, ...]
    slots: tuple[tuple[nn.Module, str], ...]
    tp: TPInfo | None


class Bucket(BucketReduction, UnusedGrads):
    """The parameters of one bucket and everything needed to shard, gather and reduce them.

    Args:
        params: the parameters, in bucket order (their current values initialise it;
            meta parameters are left for ``materialize``).
        sources: per parameter: its names, registrations and TP facts.
        layout: the bucket layout over the shard group (over the whole dp group,
            ``outer x inner`` shards, under hybrid-sharded HSDP).
        strategy: the ZeRO strategy.
        dtypes: the group's dtypes.
        dist_index: groups and meshes (the expert index for expert parameters).
        device: where the buffers live.
        pool: the shared pool of temporary whole-bucket tensors.
        reduce_spec: how this group's gradients are scaled and reduced.
        late_grads: (ZeRO-2/3) let autograd keep the parameters' own ``.grad`` during
            backward and copy them into a local buffer only when the reduction starts.
            For the root bucket: its first gradient (a tied LM head's) arrives when
            the activations peak, and a whole-bucket buffer taken then would add to
            that peak; its reduction comes last, when the activations are freed.
        mark_unused_params: find, per parameter, those no rank's backward reached
            (``unused_params``; see [Note: grads no rank made]).
        offload: keep the main weights and a copy of the reduced grads in host
            memory (``offload_optimizer_state``; ZeRO-1/2/3).
        row_dims: per parameter, the dim the layout's rows run along (see
            ``units.cut_dim``); empty: all 0.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        sources: list[ParamSource],
        layout: BucketLayout,
        strategy: ZeroDPStrategy,
        dtypes: BucketDtypes,
        dist_index: FSDPDistributedIndex,
        device: torch.device,
        pool: BufferPool,
        reduce_spec: ReduceSpec,
        late_grads: bool = False,
        mark_unused_params: bool = False,
        offload: bool = False,
        extension: bool = False,
        row_dims: Sequence[int] = (),
    ) -> None:
        self.params = params
        self.extension = extension
        self.replaced: weakref.ref[nn.Parameter] | None = None  # see _adopt
        self.offload = offload
        self.late_grads = late_grads
        self.mark_unused_params = mark_unused_params
        self.reduce_spec = reduce_spec
        self.strategy = strategy
        self.dtypes = dtypes
        self.dist_index = dist_index
        self.device = device
        self.pool = pool
        self.requires_grad = params[0].requires_grad
        self.rank = dist_index.shard_rank
        self.outer = dist_index.outer_fsdp_group
        self.hybrid = dist_index.hsdp_outer_dp_shard
        # ``main_layout`` shards what the optimizer owns (main weights, grad store);
        # ``layout`` shards the weights over dp_shard. They differ only when hybrid:
        # inner shard i is the outer_size contiguous sub-shards of logical ranks i*M..
        self.main_layout = layout
        self.main_rank = self.rank
        if self.hybrid:
            outer = dist_index.outer_size
            layout = dataclasses.replace(
                layout, world_size=layout.world_size // outer, shard_size=layout.shard_size * outer
            )
            self.main_rank = dist_index.get_logical_hybrid_fsdp_rank()
        self.layout = layout
        self.geometry = BucketGeometry(layout, self.main_layout, self.rank, self.main_rank)
        self._slices = [
            (s, s + n, local_shape(p))
            for s, n, p in zip(layout.starts, layout.numels, params, strict=True)
        ]
        self.replicated = strategy.level == 0  # ZeRO-0: every rank owns the whole bucket
        self.fsdp_params = [
            FSDPParam(
                param,
                source.fqns,
                source.slots,
                index,
                layout.starts[index],
                local_shape(param),
                source.tp,
                self.main_layout.local_rows(index, self.main_rank)
                if not self.replicated
                else (0, math.prod(layout.shapes[index][:1]) if param.dim() else 1),
                row_dims[index] if row_dims else 0,
            )
            for index, (param, source) in enumerate(zip(params, sources, strict=True))
        ]
        # Sequence-parallel duplicated params: each TP rank's grad covers only its
        # rows, so their local grads are summed over TP before the dp reduction.
        self._sp_slices = [
            (s, e)
            for (s, e, _), p in zip(self._slices, params, strict=True)
            if getattr(p, "sequence_parallel", False)
        ]
        self._view_cache: dict[tuple[int, bool], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.name = f"the bucket of {sources[0].fqns[0]!r} ({len(params)} parameters)"
        self.grads = GradState(dist.get_rank(), self.name)
        self._pending: tuple[collectives.Handle | None, torch.Tensor, torch.Tensor] | None = None
        # The optimizer's parameters hold this group's grads (attach_grad_to_optimizer_state).
        self.grads_handed_out = False
        # Hybrid HSDP: dp_shard-reduced grads waiting for the dp_outer reduce-scatter.
        self.pending_inner: torch.Tensor | None = None
        # Reduced grads set aside, by how far they are reduced, while newer grads are being
        # reduced (accumulating after a reduction); merged once both are reduced alike.
        self._aside: dict[Reduced, torch.Tensor] = {}
        # [Note: micro-batches in the reduction dtype] Local grads of earlier backwards
        # since the last reduction, summed in the communication dtype, when the local
        # grads are in another (bf16 compute, fp32 reduction): FSDP2 accumulates
        # unreduced grads in ``reduce_dtype`` and Megatron in its fp32 main grads; a
        # bf16 sum over micro-batches would round away what each adds.
        self._folded: torch.Tensor | None = None
        # [Note: grads no rank made] This rank's backward reached the bucket's unit since
        # the grads were last dropped (``used``); it did not, and its local grads (and an
        # empty store) hold negative zeros (``unused_mark``).
        self.used = False
        self.unused_mark = False
        # mark_unused_params: each parameter's owned rows of the grad store, as device
        # tensors (see ``unused_params``); the parameter whose ``.grad`` tells
        # whether the optimizer dropped the grads it was given (one it was given);
        # grads were withheld, so the local grads must be attached again.
        self._owned_spans: OwnedSpans | None = None
        # mark_unused_params: the parameters with no rows here (None: not looked up
        # yet), and per such parameter whether this rank's backwards left it unreached.
        self._rowless: list[FSDPParam] | None = None
        self._rowless_index: list[int] = []  # their positions in the bucket
        self._rowless_unused: torch.Tensor | None = None
        self._probe = self.fsdp_params[0]
        self._reattach = False
        self._allocate()

    # ------------------------------------------------------------------ buffers
    def _check(self, condition: bool, what: str) -> None:
        check_invariant(condition, self.grads.rank, self.name, what)

    @property
    def whole_on_every_rank(self) -> bool:
        """The weights are sharded over one rank: the shard is the whole bucket, always here."""
        return self.layout.world_size == 1 and not self.hybrid

    @property
    def untouched(self) -> bool:
        """No backward added a gradient here since the grads were zeroed (the optimizer gets None).

        A step after ``zero_grad`` with no backward of this bucket in between (a unit
        called by itself, FSDP2's ``model[0](x)``, leaves the other units alone) must
        not hand out zeros: torch's optimizers step a zero grad (momentum, Adam's
        moments), and leave a ``None`` grad alone.
        """
        return (
            self.grads.local is Local.CLEAN
            and self.grads.reduced is Reduced.NONE
            and not self._aside
            and self.pending_inner is None
        )

    @property
    def released(self) -> bool:
        """True while the bucket's whole weights are neither here nor being gathered."""
        return self.weights.gather is Gather.RELEASED

    @property
    def gathered(self) -> bool:
        """True while the whole bucket of weights is present on this rank."""
        return self.weights.gather is Gather.GATHERED

    def _allocate(self) -> None:
        d, dev = self.dtypes, self.device
        if self.extension:
            self.weights: WeightStorage = self._extension_weights()
        else:
            # Offloaded main weights are no source for the gather: ZeRO-3 keeps a compute shard.
            cast_main = d.main != d.compute and not self.hybrid and not self.offload
            storage = weight_storage_for(self.strategy, self.whole_on_every_rank, cast_main)
            self.weights = storage(
                self.geometry, d.compute, d.main, dev, self.dist_index, self.name, self.offload
            )
        self.buffers: GradBuffers | None = None
        self.host_grads: torch.Tensor | None = None
        self._host_grads_current = False  # host_grads hold the store's current values
        if self.offload and self.requires_grad:
            self.host_grads = host_zeros(self.main_layout.shard_size, d.grads, dev)
        if self.requires_grad:
            store_is_local = (
                self.whole_on_every_rank
                and self.outer is None
                and d.grads == d.compute
                and not self.extension
            )
            self.buffers = grad_buffers_for(self.strategy, store_is_local)(
                self.geometry,
                d.compute,
                d.grads,
                dev,
                self.pool,
                self.params,
                self._views,
                self.replicated,
                self.late_grads,
                self.name,
                self.mark_unused_params,
            )

    def _extension_weights(self) -> ExtensionWeights:
        """The subclass shard of this bucket's one parameter and its gather."""
        index, fp = self.dist_index, self.fsdp_params[0]
        mesh = index.get_submesh(index.dp_shard_dim) if index.dp_shard_dim else index.device_mesh
        param_dtype = self.params[0].dtype
        return ExtensionWeights(
            self.geometry,
            fp,
            index,
            mesh,
            fp.slots[0][0],
            torch_policy(self.dtypes.compute, self.dtypes.comm, param_dtype),
            self.dtypes.compute,
            keep=not self.strategy.shards_params,
            adopt=self._adopt,
            name=self.name,
        )

    def _adopt(self, compute: nn.Parameter) -> None:
        """Make ``compute`` (what the first gather built) the parameter's compute form.

        The parameter it replaces is remembered weakly (``replaced``): an optimizer
        built on the model before wrapping holds it, and is rebound through it.
        """
        fp = self.fsdp_params[0]
        self.replaced = weakref.ref(fp.compute)
        fp.compute = compute
        self.params[0] = compute  # the grad buffers read this very list
        self._view_cache.clear()

    def _grad_buffers(self) -> GradBuffers:
        self._check(self.buffers is not None, "the grad buffers are missing")
        return cast(GradBuffers, self.buffers)

    @property
    def grad_local(self) -> torch.Tensor | None:
        """The local (unreduced) grads of the bucket, flat; None while none are held."""
        return None if self.buffers is None else self.buffers.local

    @property
    def grad_store(self) -> torch.Tensor | None:
        """The reduced grads (the optimizer's ``.grad`` are views of it); None without grads.

        Reading it gives a released store its bytes back (zeros): a view of a
        store without bytes must never escape.
        """
        return None if self.buffers is None else self.buffers.store()

    @property
    def optimizer_grads(self) -> torch.Tensor | None:
        """What the sharded parameters' ``.grad`` view: ``host_grads``, or the store."""
        return self.host_grads if self.offload else self.grad_store

    @contextlib.contextmanager
    def optimizer_grads_for_views(self) -> Iterator[torch.Tensor | None]:
        """``optimizer_grads`` only to make views of them: a released store stays released.

        See [Note: grads held from the first backward] in ``grad_storage.py``.
        """
        if self.offload or self.buffers is None:
            yield self.optimizer_grads
            return
        with self.buffers.store_for_views() as store:
            yield store

    def offload_grads(self) -> None:
        """Copy the reduced grads into ``host_grads`` (asynchronous from a device; see host.py).

        Only when the store changed since the last copy: grads handed out again
        (``finish_grad_sync`` before the step, after ``clip_grad_norm_`` scaled the
        host copy) keep what was done to them.
        """
        if self.host_grads is not None and not self._host_grads_current:
            self.host_grads.copy_(self._grad_buffers().store(), non_blocking=True)
            self._host_grads_current = True

    def hold_grads(self) -> None:
        """Give a released grad store its bytes back (zeros) before views of it are handed out."""
        if self.buffers is not None:
            self.buffers.store()

    @property
    def main_is_separate(self) -> bool:
        """True when main weights are their own buffer (their dtype differs from compute)."""
        return self.weights.main_is_separate

    def copy_in(self, index: int, value: torch.Tensor) -> None:
        """Write parameter ``index``'s full value into this rank's buffers (init and load)."""
        if isinstance(self.weights, ExtensionWeights):
            self.weights.set_value(value)
            return
        start, _, _ = self._slices[index]
        flat = self.fsdp_params[index].stored_flat(local_value(value))
        self.weights.copy_in(index, start, flat)

    def _views(
        self, buffer: torch.Tensor, as_grads: bool = False, cache: bool = True
    ) -> list[torch.Tensor]:
        # as_grads: wrapped for assignment to .grad (DTensor params get DTensor grads).
        key = (id(buffer), as_grads)
        hit = self._view_cache.get(key)
        if hit is not None and hit[0] is buffer:
            return hit[1]
        views = [
            fp.view_rows(buffer[s:e], shape[fp.row_dim]) if fp.row_dim else buffer[s:e].view(shape)
            for (s, e, shape), fp in zip(self._slices, self.fsdp_params, strict=True)
        ]
        if as_grads:
            views = [wrap_grad(p, v) for p, v in zip(self.params, views, strict=True)]
        if not cache:
            return views
        if len(self._view_cache) > 8:
            self._view_cache.clear()
        self._view_cache[key] = (buffer, views)
        return views

    def main_view(self, fp: FSDPParam, buffer: torch.Tensor) -> torch.Tensor:
        """``fp``'s rows this rank's optimizer owns, viewed in ``buffer`` in ``fp``'s shape.

        ``buffer`` is the main weights or the grad store: the whole bucket under
        ZeRO-0 (the whole parameter), else this rank's shard (its ``main_rows``).
        """
        return self.weights.owned_view(fp, buffer)

    # ------------------------------------------------------------------ ZeRO-3 gather
    @outside_transforms
    def unshard(self, async_op: bool) -> None:
        """Start (or do) the all-gather of the bucket's weights; no-op when gathered."""
        self.weights.unshard(async_op)

    @outside_transforms
    def wait_unshard(self) -> None:
        """Finish the all-gather; the parameters' views now hold the whole weights."""
        self.weights.wait_unshard()

    def reshard(self) -> None:
        """Free the gathered bucket (ZeRO-3); parameters keep their shapes, lose storage."""
        self.weights.reshard()

    def point_params_at_buffer(self) -> None:
        """Make every parameter's ``.data`` a view of the whole-bucket weights (once).

        A released bucket gets its bytes for the views; the caller releases them
        again with ``reshard()``. An extension bucket is gathered instead: that
        builds its compute form (see [Note: the all-gather extension]).
        """
        if self.extension:
            self.weights.unshard(async_op=False)
            self.weights.wait_unshard()
            return
        self.weights.hold_full_bytes()
        for p, v in zip(self.params, self._views(self.weights.full), strict=True):
            set_local_data(p, v)

    # ------------------------------------------------------------------ gradients
    def begin_accumulate(self) -> None:
        """Get the local grad buffer ready before autograd accumulates into it."""
        if not self.requires_grad:
            return
        self.finish_reduce()
        self.forget_dropped_grads()
        buffers = self._grad_buffers()
        if buffers.aliases_local and self.grads.reduced is not Reduced.NONE:
            self._set_store_aside()
        if self.grads.local is Local.ACCUMULATED and self._folds_micro_batches(buffers):
            self._fold_local(buffers)
        buffers.prepare()
        if self._reattach:
            self._reattach = False
            buffers.attach()
        self.grads.accumulate()

    def _folds_micro_batches(self, buffers: GradBuffers) -> bool:
        return buffers.local_dtype != self.dtypes.comm and not buffers.aliases_local

    def _fold_local(self, buffers: GradBuffers) -> None:
        """Move an earlier backward's unreduced local grads into ``_folded`` (see the Note)."""
        local = buffers.local_for_reduction()
        if self._folded is None:
            self._folded = self.pool.take(local.numel(), self.dtypes.comm, self.device)
            self._folded.copy_(local)
        else:
            self._folded.add_(local)
        buffers.after_reduction()

    def _drop_folded(self) -> None:
        if self._folded is not None:
            self.pool.give(self._folded)
            self._folded = None

    def forget_dropped_grads(self) -> None:
        """Zero the grads if the optimizer dropped those it was given, as torch starts from zero.

        ``zero_grad()`` of an optimizer built on the sharded parameters sets their
        ``.grad`` to None without telling the engine; seen here (before a backward
        accumulates, or before grads are handed out again).
        """
        if self.grads_handed_out and self._probe.sharded.grad is None:
            self.zero_grad(release=True)

    def attach_local_grads(self) -> None:
        """Point every parameter's ``.grad`` at its view of the local grad buffer."""
        if self.buffers is not None:
            self.buffers.attach()

    def zero_grad(self, release: bool = False) -> None:
        """Drop every gradient held for this group (local and reduced).

        ``release`` (the optimizer set its grads to None): a ZeRO-2/3 grad store
        also gives its bytes back until the next reduction, so it does not sit
        under the next forward's activations (FSDP2 frees sharded grads alike).
        """
        if not self.requires_grad:
            return
        self.finish_reduce()
        self._host_grads_current = False
        buffers = self._grad_buffers()
        buffers.zero_store(release)
        if self.pending_inner is not None:
            self.pool.give(self.pending_inner)
            self.pending_inner = None
        for held in self._aside.values():
            self.pool.give(held)
        self._aside.clear()
        self._drop_folded()
        buffers.zero_local()
        self.grads_handed_out = False
        self._probe = self.fsdp_params[0]
        self.used = self.unused_mark = False
        self._rowless_unused = None
        self.grads.reset()

    def scale_gradients(self, factor: float) -> None:
        """Multiply the reduced and any unreduced local grads by ``factor``."""
        if self.buffers is None:
            return
        store = None if self.buffers.released else self.buffers.store()
        handed = self.host_grads if self._host_grads_current else None  # the store's copy
        for held in (store, handed, self.pending_inner, self._folded, *self._aside.values()):
            if held is not None:
                held.mul_(factor)
        self.buffers.scale_local(factor)

    # ------------------------------------------------------------------ weights
    @outside_transforms
    def install_main_weights(self, async_op: bool) -> collectives.Handle | None:
        """Copy updated main weights into the compute weights (all-gather for ZeRO-1/2)."""
        return self.weights.install(async_op)

    def owned_bytes(self) -> dict[str, int]:
        """Bytes of the persistent buffers this group holds now, by kind (pool excluded).

        A released grad store (ZeRO-2/3 after ``zero_grad(set_to_none=True)``) counts 0.
        With ``offload``, ``main_params`` are host bytes, and so are ``host_grads``.
        """

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        params = self.weights.kept_bytes()
        main = nbytes(self.weights.main) if self.main_is_separate else 0
        grads = 0 if self.buffers is None else self.buffers.held_bytes()
        grads += nbytes(self._folded)
        held = {"params": params, "main_params": main, "grads": grads}
        if self.offload:
            held["host_grads"] = nbytes(self.host_grads)
        return held
