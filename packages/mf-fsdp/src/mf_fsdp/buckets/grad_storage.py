"""Where a bucket's gradients live: one buffer class per ZeRO strategy, picked once.

=====================  ==================================  ================================
buffers                local grads (``local``)             reduced grads (``store``)
=====================  ==================================  ================================
``PersistentGrads``    the whole bucket, from the first    this rank's owned part: a view
(ZeRO-0/1; ZeRO-2/3    backward until the grads are        of ``local`` when the dtypes
over a group of one    dropped; the parameters' ``.grad``  agree (ZeRO-0, and ZeRO-2/3
in one dtype)          are views of it                     here: ``local`` itself), else
                                                           its own buffer
``TransientGrads``     a whole bucket from a unit's        its own buffer (this rank's
(ZeRO-2/3)             backward until its reduction (its   shard), whose bytes are freed
                       own, released between uses; a       by ``release_store`` until the
                       pooled one when large on the CPU);  next reduction
                       late (the root): the parameters'
                       own ``.grad`` until the reduction
                       starts
=====================  ==================================  ================================

A buffer "released" keeps its tensor object (and every view of it) with its
storage resized to zero: dropped grads (``zero_grad(set_to_none=True)``) hold no
bytes until the next backward, under every strategy.

[Note: grads held from the first backward]
Every buffer starts released: wrapping a model allocates no gradient bytes (nor
touches any page), and the first backward holds them as after any
``zero_grad(set_to_none=True)``. So a rank that wraps a model and then loads its
weights (``mf-train --model``) never holds a gradient beside them; the peak of a
training step is unchanged, only reached at the first backward instead of at the
wrap. The cost is the check a backward makes anyway (``released``), no more.

The classes keep the buffers and their lifetimes; when to accumulate, reduce
and zero is the ``Bucket``'s (and its ``GradState``'s) business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import nn

from mf_fsdp.buckets.buffer_pool import KEEP_BELOW_BYTES, BufferPool
from mf_fsdp.buckets.grad_state import check_invariant
from mf_fsdp.buckets.tp_params import local_grad
from mf_fsdp.buckets.weight_storage import BucketGeometry
from mf_fsdp.config import ZeroDPStrategy

__all__ = ["GradBuffers", "PersistentGrads", "TransientGrads", "grad_buffers_for"]

Views = Callable[[torch.Tensor, bool, bool], list[torch.Tensor]]


class GradBuffers:
    """A bucket's local and reduced gradient buffers (the base: the store's bytes).

    Args:
        geometry: where this rank's pieces are.
        compute: the dtype autograd accumulates in; grads: the reduced grads' dtype.
        device: where the buffers live.
        pool: the engine's pool of temporary whole-bucket tensors.
        params: the bucket's compute parameters (their ``.grad`` are attached here).
        views: the bucket's per-parameter views of a flat buffer: ``views(buffer,
            as_grads, cache)`` (``as_grads`` wraps them as the parameters' grads;
            ``cache`` keeps them for the next call with the same buffer).
        replicated: every rank owns the whole bucket (ZeRO-0).
        late: (ZeRO-2/3) take the local buffer only when the reduction starts.
        name: the bucket's name, for invariant errors.
        mark_unused: empty grads are ``-0.0``, not ``0.0``, so that a parameter no
            backward reached on any rank shows after the reduction (see [Note: grads
            no rank made] in ``bucket.py``).
    """

    local: torch.Tensor | None = None
    aliases_local = False
    """The store is a view of ``local`` (reduced grads must be set aside before
    new ones accumulate there)."""

    def __init__(
        self,
        geometry: BucketGeometry,
        compute: torch.dtype,
        grads: torch.dtype,
        device: torch.device,
        pool: BufferPool,
        params: list[nn.Parameter],
        views: Views,
        replicated: bool,
        late: bool,
        name: str,
        mark_unused: bool = False,
    ) -> None:
        self.geometry = geometry
        self.name = name
        self.marks_unused = mark_unused
        self._compute = compute
        self._device = device
        self._pool = pool
        self._params = params
        self._views = views
        self._store = self._allocate(grads, replicated, late)
        self._store_nbytes = self._store.untyped_storage().nbytes()
        self._release_at_start()

    def _release_at_start(self) -> None:
        """Free the new buffers' bytes (see [Note: grads held from the first backward])."""
        self._take_bytes()
        self._released = True

    def _take_bytes(self) -> None:
        """Resize the released buffers' storage to zero (the values are dropped)."""
        self._store.untyped_storage().resize_(0)

    def _give_bytes(self) -> None:
        """Give the released buffers their bytes back, uninitialised."""
        self._store.untyped_storage().resize_(self._store_nbytes)

    @contextlib.contextmanager
    def store_for_views(self) -> Iterator[torch.Tensor]:
        """The store, only to make views of it: a released store stays released.

        A view cannot be cut from a tensor without bytes, so a released store gets
        uninitialised ones while the views are made (untouched: no resident memory
        on the CPU) and loses them after. The views see the store's bytes once a
        later ``store()`` holds it again.
        """
        released = self._released
        if released:
            self._give_bytes()
        try:
            yield self._store
        finally:
            if released:
                self._take_bytes()

    def _allocate(self, grads: torch.dtype, replicated: bool, late: bool) -> torch.Tensor:
        """Create the buffers, their bytes released (untouched); return the store."""
        raise NotImplementedError

    def _separate_store(self, grads: torch.dtype, replicated: bool) -> torch.Tensor:
        """The store as a buffer of its own (uninitialised: it starts released)."""
        g = self.geometry
        numel = g.layout.padded_numel if replicated else g.main_layout.shard_size
        return torch.empty(numel, dtype=grads, device=self._device)

    def clear(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fill ``tensor`` with the empty grad value (``zero_()`` unless marking); return it."""
        return tensor.fill_(-0.0) if self.marks_unused else tensor.zero_()

    # ------------------------------------------------------------------ reduced grads
    @property
    def released(self) -> bool:
        """True while the store holds no bytes (its grads are zeros by definition)."""
        return self._released

    @property
    def local_dtype(self) -> torch.dtype:
        """The local grads' dtype (the compute dtype autograd accumulates in)."""
        return self._compute

    @property
    def store_dtype(self) -> torch.dtype:
        """The reduced grads' dtype."""
        return self._store.dtype

    def store(self, zeroed: bool = True) -> torch.Tensor:
        """The store with its bytes present.

        A released store comes back zeroed, or uninitialised when ``zeroed`` is
        False (the caller overwrites all of it).
        """
        if self._released:
            self._give_bytes()
            self._released = False
            if zeroed:
                self.clear(self._store)
        return self._store

    def zero_store(self, release: bool) -> None:
        """Zero the reduced grads; ``release``: free the store's bytes where it may."""
        if not self._released:
            self.clear(self._store)

    # ------------------------------------------------------------------ local grads
    def attach(self) -> None:
        """Point every parameter's ``.grad`` at its view of the local buffer."""
        if self.local is not None:
            views = self._views(self.local, True, self._cache_views(self.local))
            for p, v in zip(self._params, views, strict=True):
                p.grad = v

    def _cache_views(self, buffer: torch.Tensor) -> bool:
        """Whether views of ``buffer`` may be kept (here: it lives as long as the bucket)."""
        return True

    def prepare(self) -> None:
        """Have the local buffer ready before autograd accumulates into it."""
        raise NotImplementedError

    def local_for_reduction(self) -> torch.Tensor:
        """The local grads, flat, for the reduction about to start."""
        check_invariant(self.local is not None, None, self.name, "no local grads")
        return cast(torch.Tensor, self.local)

    def after_reduction(self) -> None:
        """The local grads were reduced: clear them for the next accumulation."""
        raise NotImplementedError

    def zero_local(self) -> None:
        """Drop the local grads (``zero_grad``)."""
        raise NotImplementedError

    def scale_local(self, factor: float) -> None:
        """Multiply the local grads that are not also reduced ones by ``factor``."""
        if self.local is not None:
            self.local.mul_(factor)

    def held_bytes(self) -> int:
        """Bytes held now outside the pool: persistent local grads and a store with bytes."""
        return 0 if self._released else self._store.numel() * self._store.element_size()


class PersistentGrads(GradBuffers):
    """ZeRO-0/1: the local buffer lives as long as the bucket, the parameters' grads view it."""

    def _allocate(self, grads: torch.dtype, replicated: bool, late: bool) -> torch.Tensor:
        g = self.geometry
        self.local = torch.empty(g.layout.padded_numel, dtype=self._compute, device=self._device)
        self._local_nbytes = self.local.untyped_storage().nbytes()
        self.aliases_local = grads == self._compute
        self._own = (0, g.layout.padded_numel) if replicated else (g.lo, g.hi)
        if self.aliases_local:
            return self.local[self._own[0] : self._own[1]]
        return self._separate_store(grads, replicated)

    def _take_bytes(self) -> None:
        """The local buffer's bytes, and a separate store's."""
        self._local().untyped_storage().resize_(0)
        if not self.aliases_local:
            self._store.untyped_storage().resize_(0)

    def _give_bytes(self) -> None:
        self._local().untyped_storage().resize_(self._local_nbytes)
        if not self.aliases_local:
            self._store.untyped_storage().resize_(self._store_nbytes)

    def _local(self) -> torch.Tensor:
        return self.local_for_reduction()

    def store(self, zeroed: bool = True) -> torch.Tensor:
        """The store with its bytes present (a released bucket is held again, zeroed)."""
        if self._released:
            self._hold()
        return self._store

    def zero_store(self, release: bool) -> None:
        """Zero the grads; ``release`` frees the local buffer and a separate store."""
        if not release:
            super().zero_store(release)
            return
        if self._released:
            return
        for p in self._params:
            p.grad = None
        self._take_bytes()
        self._released = True

    def _hold(self) -> None:
        """Give the released buffers their bytes back, zeroed, and attach the grads."""
        self._give_bytes()
        self.clear(self._local())
        if not self.aliases_local:
            self.clear(self._store)
        self._released = False
        self.attach()

    def prepare(self) -> None:
        """Hold released buffers; attach the parameters' grads again if something dropped them."""
        if self._released:
            self._hold()
        elif self._params[0].grad is None:
            self.attach()

    def after_reduction(self) -> None:
        """Zero the local buffer unless it also holds the reduced grads."""
        if not self.aliases_local:
            self.clear(self._local())

    def zero_local(self) -> None:
        """Zero the buffer and attach the parameters' grads to it (released: nothing held)."""
        if self._released:
            return
        self.clear(self._local())
        self.attach()

    def scale_local(self, factor: float) -> None:
        """Scale what is not this rank's store: all of it, or (aliased) outside its region."""
        if self._released:
            return
        local = self._local()
        if not self.aliases_local:
            local.mul_(factor)
            return
        lo, hi = self._own
        local[:lo].mul_(factor)
        local[hi:].mul_(factor)

    def held_bytes(self) -> int:
        """The local buffer, and the store unless it is a view of it (released: none)."""
        if self._released:
            return 0
        local = self._local()
        held = local.numel() * local.element_size()
        return held if self.aliases_local else held + super().held_bytes()


class TransientGrads(GradBuffers):
    """ZeRO-2/3: a local buffer per backward, a store freed when the grads are dropped.

    The local buffer is the bucket's own tensor, its storage resized to zero
    between uses: the parameters' grad views of it are made once, not every
    backward (a host cost per parameter), and between uses it holds nothing.
    Large buffers on the CPU come from the pool instead: there a fresh large
    allocation page-faults on first touch, while a CUDA caching allocator
    recycles the freed bytes.
    """

    def _cache_views(self, buffer: torch.Tensor) -> bool:
        """Only for the own buffer: cached views of a pooled one would keep it alive."""
        return buffer is self._own

    def _allocate(self, grads: torch.dtype, replicated: bool, late: bool) -> torch.Tensor:
        self._late = late
        numel = self.geometry.layout.padded_numel
        self._own: torch.Tensor | None = None
        if self._device.type != "cpu" or numel * self._compute.itemsize < KEEP_BELOW_BYTES:
            self._own = torch.empty(numel, dtype=self._compute, device=self._device)
            self._own_nbytes = self._own.untyped_storage().nbytes()
            self._own.untyped_storage().resize_(0)
        return self._separate_store(grads, replicated)

    def _whole_bucket(self) -> torch.Tensor:
        if self._own is None:
            return self._pool.take(self.geometry.layout.padded_numel, self._compute, self._device)
        self._own.untyped_storage().resize_(self._own_nbytes)
        return self._own

    def zero_store(self, release: bool) -> None:
        """Free the store's bytes on ``release`` (nothing reads it before the next reduction)."""
        if release:
            self._take_bytes()
            self._released = True
        else:
            super().zero_store(release)

    def prepare(self) -> None:
        """Take a zeroed buffer from the pool and attach the grads (not when late)."""
        if self.local is None and not self._late:
            self.local = self.clear(self._whole_bucket())
            self.attach()

    def local_for_reduction(self) -> torch.Tensor:
        """Late: copy the parameters' own grads into a pooled buffer and drop them."""
        if self._late and self.local is None:
            local = self.clear(self._whole_bucket())
            views = self._views(local, False, self._cache_views(local))
            made = [
                (view, p, p.grad)
                for p, view in zip(self._params, views, strict=True)
                if p.grad is not None
            ]
            if made:  # one multi-tensor copy, not one op per parameter
                torch._foreach_copy_(
                    [v for v, _, _ in made], [local_grad(p, g) for _, p, g in made]
                )
            for _, p, _ in made:
                p.grad = None
            self.local = local
        return super().local_for_reduction()

    def after_reduction(self) -> None:
        """Detach the parameters and return the buffer to the pool."""
        self.zero_local()

    def zero_local(self) -> None:
        """Detach the parameters' grads; the local buffer is released (or goes back to the pool)."""
        for p in self._params:
            p.grad = None
        local, self.local = self.local, None
        if local is self._own and local is not None:
            local.untyped_storage().resize_(0)
        elif local is not None:
            self._pool.give(local)

    def held_bytes(self) -> int:
        """The store's bytes and the local buffer's while it is out."""
        local = 0 if self.local is None else self.local.untyped_storage().nbytes()
        if self._own is not None and self.local is not self._own:
            local += self._own.untyped_storage().nbytes()  # held when it should not be
        return super().held_bytes() + local

    def scale_local(self, factor: float) -> None:
        """Scale the local buffer, or the late grads still on the parameters."""
        if self.local is not None:
            self.local.mul_(factor)
            return
        for p in self._params:
            if p.grad is not None:
                p.grad.mul_(factor)


def grad_buffers_for(strategy: ZeroDPStrategy, store_is_local: bool) -> type[GradBuffers]:
    """The buffer class of ``strategy`` (see the module table).

    ``store_is_local``: the grads are reduced over a group of one and kept in the
    dtype autograd makes them in (world 1 with fp32 compute and grads), so the
    reduced grads are the local ones. ZeRO-2/3 then keep them in one buffer, as
    ZeRO-0/1 do, instead of a local buffer per backward copied into a store that
    holds the same values: each backward saves a zeroing and a copy of every
    bucket, and the peak one bucket (see [Note: a group of one] in ``transfers.py``).
    """
    return TransientGrads if strategy.shards_grads and not store_is_local else PersistentGrads
