"""Grads no rank made: finding, after the reduction, the buckets and parameters no backward reached.

``UnusedGrads`` is a part of ``Bucket`` (``buckets/bucket.py``), kept in a module
of its own: see [Note: grads no rank made] on ``mark_unused``. It reads the
bucket's buffers and writes no collective.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mf_fsdp.buckets.grad_state import GradState, Reduced
from mf_fsdp.buckets.grad_storage import GradBuffers
from mf_fsdp.buckets.param import FSDPParam

__all__ = ["OwnedSpans", "UnusedGrads"]

OwnedSpans = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""Per parameter of a bucket: its last owned element, the one before its first (both
clamped to the store), whether that one exists, whether it owns rows here."""

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype a float's bits are read as, by element size (``-0.0`` is its minimum)."""


class _Marking(Protocol):
    """What the marks read and call of their ``Bucket``."""

    buffers: GradBuffers | None
    grads: GradState
    device: torch.device
    fsdp_params: list[FSDPParam]
    requires_grad: bool
    mark_unused_params: bool
    used: bool
    unused_mark: bool
    grads_handed_out: bool
    _owned_spans: OwnedSpans | None
    _rowless: list[FSDPParam] | None
    _rowless_index: list[int]
    _rowless_unused: torch.Tensor | None
    _probe: FSDPParam
    _reattach: bool
    _host_grads_current: bool

    def _grad_buffers(self) -> GradBuffers: ...

    def main_view(self, fp: FSDPParam, buffer: torch.Tensor) -> torch.Tensor: ...


class UnusedGrads:
    """The unused-gradient methods of ``Bucket`` (see the module docstring)."""

    # The Bucket attributes these methods assign, with Bucket's types (annotations only: a
    # type checker would otherwise take their type from the assignment here).
    _owned_spans: OwnedSpans | None
    _rowless: list[FSDPParam] | None
    _rowless_index: list[int]
    _rowless_unused: torch.Tensor | None

    def mark_used(self: _Marking) -> None:
        """This rank ran the bucket's unit in this step: its grads count as made here.

        Turns negative zeros left by an earlier ``mark_unused`` into zeros
        (``-0.0 + 0.0 == 0.0``; every other value is kept).
        """
        self.used = True
        if self.unused_mark and not self.mark_unused_params:
            self.unused_mark = False
            if self.buffers is not None and self.buffers.local is not None:
                self.buffers.local.add_(0.0)

    def mark_unused(self: _Marking) -> None:
        """This rank skipped the bucket's unit so far in this step: mark its zero grads.

        [Note: grads no rank made] Torch leaves ``.grad`` None on a parameter no
        backward reached, and its optimizers skip such a parameter (Adam moves it
        otherwise, by its momentum). Which ranks ran a unit is known only to each
        rank, and asking the others would cost a collective. Instead a rank that
        skipped the unit fills its local grads (and a store that holds nothing yet)
        with ``-0.0``, where a rank that ran it starts from ``+0.0``: IEEE sums keep
        ``-0.0`` only when every term is ``-0.0``, and ``+0.0 + -0.0 == +0.0``, so after
        the reduction (and any casts and scalings) the store is all ``-0.0`` exactly
        when no rank ran the unit in the step. Only ranks that skipped it look
        (``unused_everywhere``); ranks that ran it know the answer.

        Per parameter (``find_unused_parameters``, as DDP's): a parameter inside a
        unit that ran, or in the root, is reached or not by each backward on its
        own, and no hook tells the engine which (one per parameter would cost
        every step). With the option every empty grad buffer holds ``-0.0``:
        autograd's accumulation ``-0.0 + g`` is ``g``, so after the reduction a
        parameter's rows are all ``-0.0`` exactly when no rank's backward reached
        it (``unused_params``), and its grad is withheld from the optimizer. That
        check reads the store on every rank, one device sync per step: hence
        opt-in, like DDP's graph walk. A gradient that is ``-0.0`` in every
        element on every rank reads as unused too.
        """
        if not self.requires_grad or self.used or self.buffers is None:
            return
        buffers = self.buffers
        if buffers.local is None:
            return
        buffers.local.fill_(-0.0)
        if not buffers.aliases_local and self.grads.reduced is Reduced.NONE:
            buffers.store(zeroed=False).fill_(-0.0)
            self._host_grads_current = False
        self.unused_mark = True

    def unused_everywhere(self: _Marking) -> bool:
        """True when no rank ran the bucket's unit in this step (see [Note: grads no rank made]).

        Only meaningful once the step's grads are fully reduced; reads them (a
        device sync) only on a rank that skipped the unit.
        """
        if not self.unused_mark or self.buffers is None:
            return False
        store = self.buffers.store()
        return not bool(store.any()) and bool(torch.signbit(store).all())

    def unused_params(self: _Marking) -> torch.Tensor:
        """Per parameter, True where no rank's backward reached it in this step (on the device).

        Needs ``mark_unused_params`` and the step's grads fully reduced: with every
        empty grad ``-0.0``, a parameter's owned rows of the store are all ``-0.0``
        exactly when no rank added a gradient to them (see [Note: grads no rank
        made]). A parameter with no rows on this rank learns nothing from the store:
        it answers from this rank's own backwards (``note_rowless_use``), as each
        FSDP2 rank leaves ``.grad`` None when its own backward did not reach the
        parameter. A few ops for the whole bucket, no sync.
        """
        store = self._grad_buffers().store()
        if self._owned_spans is None:
            spans = []
            for fp in self.fsdp_params:
                view = self.main_view(fp, store)
                start = view.storage_offset() - store.storage_offset()
                spans.append((start, start + view.numel()))
            # Per parameter: its last and its first element's predecessor (clamped to the
            # store), whether it has a predecessor, whether it owns rows here.
            columns = list(zip(*spans, strict=True)) if spans else [(), ()]
            self._owned_spans = (
                torch.tensor([max(end - 1, 0) for end in columns[1]], device=self.device),
                torch.tensor([max(start - 1, 0) for start in columns[0]], device=self.device),
                torch.tensor([int(start > 0) for start in columns[0]], device=self.device),
                torch.tensor([end > start for start, end in spans], device=self.device),
            )
        last, before, has_before, owned = self._owned_spans
        if store.numel() == 0:
            unused = torch.zeros(len(self.fsdp_params), dtype=torch.bool, device=self.device)
        else:
            bits = store.view(_SAME_WIDTH_INT[store.element_size()])
            # made[i]: elements up to i that are not -0.0 (what some rank's backward added)
            made = torch.cumsum(bits != torch.iinfo(bits.dtype).min, 0)
            unused = (made[last] == made[before] * has_before) & owned
        if self._rowless_unused is not None:
            unused[self._rowless_index] = self._rowless_unused
        return unused

    def may_hold_unused(self: _Marking) -> torch.Tensor:
        """False (on the device) when ``unused_params`` would find nothing here.

        That is: the store holds no ``-0.0`` and every parameter with no rows here
        was reached, the usual step. Three ops, no sync. ``-0.0`` is the smallest
        value of the float's bits read as a signed integer.
        """
        store = self._grad_buffers().store()
        if store.numel() == 0:
            flag = torch.zeros((), dtype=torch.bool, device=self.device)
        else:
            bits = store.view(_SAME_WIDTH_INT[store.element_size()])
            flag = bits.amin() == torch.iinfo(bits.dtype).min
        if self._rowless_unused is not None:
            flag = flag | self._rowless_unused.any()
        return flag

    def note_rowless_use(self: _Marking, local: torch.Tensor) -> None:
        """Note which parameters with no rows here this rank's backward left unreached.

        Run before ``local`` (the bucket's local grads) is reduced: such a parameter's
        elements there are all ``-0.0``. ``unused_params`` answers for them from this,
        accumulated over the step's backwards. A few ops per reduction, only in buckets
        with such parameters.
        """
        if self._rowless is None:
            positions = [
                i for i, fp in enumerate(self.fsdp_params) if fp.main_rows[0] == fp.main_rows[1]
            ]
            self._rowless = [self.fsdp_params[i] for i in positions]
            self._rowless_index = positions
        if not self._rowless:
            return
        bits = local.view(_SAME_WIDTH_INT[local.element_size()])
        negative_zero = torch.iinfo(bits.dtype).min
        unreached = torch.stack(
            [(bits[fp.start : fp.start + fp.numel] == negative_zero).all() for fp in self._rowless]
        )
        if self._rowless_unused is not None:
            unreached &= self._rowless_unused
        self._rowless_unused = unreached

    def withhold_grads(self: _Marking, unused: list[FSDPParam]) -> None:
        """Give the optimizer no grad for ``unused`` parameters in this step, as torch does.

        Their store rows stay (all ``-0.0``) for a later accumulation; the next
        backward attaches the parameters' local grads again.
        """
        for fp in unused:
            fp.sharded.grad = None
        kept = [fp for fp in self.fsdp_params if fp.sharded.grad is not None]
        self._probe = kept[0] if kept else self.fsdp_params[0]
        self.grads_handed_out = bool(kept)
        self._reattach = True
