"""Per-unit hooks and the TrainingState machine that drive gathers, releases and reductions.

Hooks (per unit, registered once):

- forward pre-hook: gather the unit's bucket(s) (ZeRO-3), prefetch the next units
  in last iteration's forward order, and (ZeRO-0/1, the walk's first unit) thread
  its inputs through ``RegisterFSDPBackwardFunction`` (its backward end observed);
- forward post-hook: release the bucket (ZeRO-3; not the units the backward starts
  with: the last unit, and those before it in its communication window) and hook
  the outputs' grads (pre-backward: gather unless ``unit.unshard_in_backward`` is off,
  prefetch the previous units that gather there, grad buffer);
- post-backward (the identity's backward, or under ZeRO-2/3 the pre-backward of the
  unit before it, [Note: where a unit's backward ends]): reduce the unit's grads
  (overlapped with the rest of backward) and release its bucket;
- a callback queued on the autograd engine at the first pre-backward finishes the
  root and any unit whose post-backward did not fire, then hands over to the
  engine's end-of-backward step (micro-batch count, auto-sync).

Ranks may skip units (see [Note: ranks that skip units] in ``engine/unit_order.py``):
every rank walks the units in one order and issues a skipped unit's collectives in its
place, in the forward (``_stand_in_forward``) and in the backward (``_finish_before``).
Units nested in one another follow [Note: nested units in the walk] (``engine/nesting.py``).
The order starts as the registration order; a unit called before units the walk has
passed makes the ranks agree on a new one (``_reorder``, ``engine/unit_order.py``); an
order they cannot agree on stops every rank (``engine/rank_paths.py``).

[Note: where a unit's backward ends] Under ZeRO-2/3 a unit's backward ends
where the backward reaches the unit before it in the walk (that unit's
pre-backward finishes it, ``_finish_before``), or at the backward's end: on one
device autograd runs a graph's nodes latest-created first (leaves' grad
accumulation as soon as ready), so a unit's nodes, weight grads included, all
run before those of a unit that ran before it. That spares each unit an
identity node and a Python call in the backward (FSDP2 threads every unit's
inputs through one): about 45 of the 230 us a unit cost the host at world 1
(``benchmarks/host_cost.py --layers 16``). The walk's first unit keeps its
identity (no pre-backward comes after its backward), and so do ZeRO-0/1 units.

A forward while a unit is in backward is activation recomputation: the gathered
weights are reused, so recompute and backward share one gather.

A unit called outside the root's forward and any backward is a solo call
(``engine/solo_calls.py``, [Note: a unit called by itself]).

This module owns only the per-iteration order and states; it does not build buckets,
decide *whether* to reduce (the engine's ``SyncPolicy`` does), or touch the optimizer.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.config import DistributedDataParallelConfig, TrainingState, ZeroDPStrategy
from mf_fsdp.engine.comm_window import CommWindow
from mf_fsdp.engine.held_units import HeldUnits
from mf_fsdp.engine.nesting import Nesting, in_backward
from mf_fsdp.engine.rank_paths import default_store, stop_out_of_order, translated
from mf_fsdp.engine.solo_calls import SoloCalls
from mf_fsdp.engine.unit import Unit, eager, grad_tensors, on_first_grad, thread_inputs
from mf_fsdp.engine.unit_order import OrderAgreement

__all__ = ["UnitHooks"]


_store = operator.attrgetter("store")  # the store a collective's failure is looked up in


class UnitHooks(SoloCalls):
    """The hooks of every unit and the root, and the state they share across one iteration.

    Args:
        root: the root unit (parameters outside every unit); driven by ``forward``.
        units: the FSDP units, in registration order (the walk's first order, see [Note:
            ranks that skip units], ``unit_order.py``); a forward pre- and post-hook on each.
        groups: every bucket of the engine (ZeRO-0/1 accumulate all at the root).
        strategy: the engine's ZeRO strategy.
        ddp_config: overlap options (read at each use, so later edits take effect).
        reduce_now: the engine's policy (``SyncPolicy.reduce_at_unit_end``): reduce at a
            unit's backward end (else accumulate).
        on_backward_start: run once per backward, before any gradient is accumulated
            (and before any recomputed forward, which needs the compute forms).
        on_backward_end: run once per backward, after every unit is back to IDLE.
        on_idle: run after every forward and backward: between passes the modules
            hold the sharded parameters (released compute views have no storage).
        step: the optimizer step the engine is in (for error messages).
        peers: the data-parallel group's global ranks, which agree on a new order.
        on_compute: run before a unit called by itself (modules hold compute params).
        on_reduced: run with the units whose reductions just finished (their grads
            are final for this backward), or None (``optimizer_step_in_backward``).
        on_solo_end: run with the units reduced in a backward of solo calls only.
    """

    def __init__(
        self,
        root: Unit,
        units: list[Unit],
        groups: list[Bucket],
        strategy: ZeroDPStrategy,
        ddp_config: DistributedDataParallelConfig,
        reduce_now: Callable[[], bool],
        on_backward_start: Callable[[], None],
        on_backward_end: Callable[[], None],
        on_idle: Callable[[], None],
        step: Callable[[], int] = lambda: 0,
        peers: Sequence[int] | None = None,
        on_compute: Callable[[], None] = lambda: None,
        on_reduced: Callable[[list[Unit]], None] | None = None,
        on_solo_end: Callable[[list[Unit]], None] = lambda units: None,
    ) -> None:
        self._root = root
        self._units = units
        self._order = list(units)  # the walk order
        self._reversed = units[::-1]
        self._groups = groups
        self._strategy = strategy
        self._ddp_config = ddp_config
        self._reduce_now = reduce_now
        self._on_backward_start = on_backward_start
        self._on_backward_end = on_backward_end
        self._on_idle = on_idle
        self._on_compute = on_compute
        self._on_solo_end = on_solo_end
        self._step = step
        self.store = default_store()  # see [Note: stopping every rank]
        if peers is None:
            peers = range(dist.get_world_size()) if dist.is_initialized() else [0]
        self._agreement = OrderAgreement(self.store, peers)
        self._callback_queued = False
        self._pass_backward = False  # the root's pass takes part in the running backward
        self._solo: list[Unit] = []  # units called by themselves, in the running backward
        self._solo_reduced: list[Unit] = []  # of those, the ones reduced
        self._again: list[Unit] = []  # served again after the walk passed them (see _serve_again)
        self.held = HeldUnits()  # left gathered after a pass or by FSDP2's unshard
        self.unshard, self.reshard = self.held.unshard, self.held.reshard  # FSDP2's methods
        self.release_held = self.held.release_held
        self._fwd_order: list[Unit] = []
        self._prev_order: list[Unit] = []
        self._next = 0  # the units' order: where the forward is (units before it are done)
        self._in_forward = False  # between the root's pre- and post-forward
        self._back = 0  # the reversed order: where the backward is (see _finish_before)
        self._kept: list[Unit] = []  # left gathered after their forward (see root_pre_forward)
        self._last: Unit | None = None  # the last unit that ran, gathered until the next
        self._handles: list[RemovableHandle] = []
        self._all_whole = all(g.whole_on_every_rank for g in groups)  # nothing to prefetch
        self._comm = CommWindow(strategy, ddp_config, self._all_whole, on_reduced)
        self._nest = Nesting(units)  # see [Note: nested units in the walk]
        for index, unit in enumerate(units):
            assert unit.module is not None  # internal invariant
            unit.index = index
            for member in unit.members or (unit.module,):
                self._handles.append(
                    member.register_forward_pre_hook(
                        eager(functools.partial(self._unit_pre_forward, unit)), with_kwargs=True
                    )
                )
                self._handles.append(
                    member.register_forward_hook(
                        eager(functools.partial(self._unit_post_forward, unit))
                    )
                )

    def _out_of_order(self, unit: Unit, what: str) -> NoReturn:
        """Stop every rank: ``unit`` cannot be fitted into the units' order (see rank_paths)."""
        stop_out_of_order(self.store, self._step(), unit.name, [u.name for u in self._order], what)

    # ------------------------------------------------------------------ forward
    @translated(_store)
    def root_pre_forward(self, pipelined: bool = False) -> None:
        """Start an iteration: gather the root bucket(s) with the first units (prefetch).

        ``pipelined``: a pipeline stage's (manual backward finalization), whose
        micro-batches run several forwards before their backwards: the units a
        forward left gathered for their backward (``reshard_after_forward=False``)
        stay gathered for the next forward, as FSDP2's, not gathered again.
        """
        if self._root.state is TrainingState.FORWARD and self._strategy.shards_params:
            self._agree(self._root, "(the root) ran a forward again before its backward")
        self._forget_pass(pipelined)  # a forward whose backward never ran (or has not yet)
        self._in_forward = True
        self._kept = self._comm.kept_for_backward(self._prev_order)  # kept for the backward
        self._fwd_order = []
        self._root.state = TrainingState.FORWARD
        self._root.forwarded = True
        ahead = self._prev_order if self._comm.prefetching else []
        self._comm.start_gathers(self._root, ahead, 0, +1)
        for group in self._root.groups:
            group.wait_unshard()

    def _forget_pass(self, keep_unresharded: bool = False) -> None:
        """Release the units a forward left gathered and restart the walk of the units.

        With ``keep_unresharded``, those with ``reshard_after_forward=False`` stay gathered.
        """
        for unit in (self._root, *self._units):
            kept = keep_unresharded and not unit.reshard_after_forward
            if unit.state is TrainingState.FORWARD and not kept:
                for group in unit.groups:
                    group.reshard()
            unit.forwarded, unit.ran, unit.pending = False, False, 0
        self._next, self._last, self._in_forward, self._nest.solo_open = 0, None, False, 0

    def reset_iteration(self) -> None:
        """Forget a pass an exception cut short (FSDP2's ``reset_iter_state``)."""
        # After a cut forward the modules get the sharded forms (never mid-backward).
        idle = all(u.state in (TrainingState.FORWARD, TrainingState.IDLE) for u in self._units)
        self._forget_pass()
        if idle and self._root.state is not TrainingState.PRE_BACKWARD:
            self._on_idle()

    @translated(_store)
    def root_post_forward(self, out: Any) -> Any:
        """Hook the root's pre-backward on ``out`` (or release the root without grad)."""
        self._release_last()
        self._stand_in_forward(len(self._units))  # the units this rank skipped at the end
        self._in_forward = False
        for unit in self._units:  # group units stay gathered until the forward's end
            if unit.members and unit.state is TrainingState.FORWARD:
                self._release_after_forward(unit)
        self._prev_order = self._fwd_order
        tensors = grad_tensors(out)
        if torch.is_grad_enabled() and tensors:
            on_first_grad(tensors, self._root_pre_backward)
        else:
            for unit in (self._root, *self._units):
                for group in unit.groups:
                    group.reshard()
                unit.state = TrainingState.IDLE
        self._on_idle()  # until a backward starts, the modules hold the sharded forms
        return out

    @translated(_store)
    def _unit_pre_forward(
        self, unit: Unit, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if in_backward(unit) or self._nest.recomputed(unit):
            self._gather(unit, async_op=False)  # recomputation: reuse or regather
            return None
        if not self._in_forward and not self._callback_queued:
            return self._solo_pre_forward(unit, args, kwargs)
        if unit.ran and unit.state is TrainingState.FORWARD and self._may_run_again(unit):
            # Run again while gathered (a layer applied twice in a row, a later member
            # of a group unit): no collective, so the ranks may differ in how often.
            self._gather(unit, async_op=False)  # waits for a prefetch still in flight
        else:
            self._release_last()
            if self._in_forward and unit.index < self._next and unit.ran:
                self._agree(unit, "ran again after other units")  # see _serve_again
                self._gather(unit, async_op=False)
            else:
                if unit.index != self._next and self._in_forward:  # a skip (or a new order)
                    if unit.index < self._next:
                        self._reorder(unit)
                    self._stand_in_forward(unit.index)
                self._next = unit.index + 1
                unit.ran = True
                self._forward_collectives(unit)
        if not unit.members and not self._nest.inner_count(unit):
            self._last = unit  # an outer unit is released at its own post-forward
        if not torch.is_grad_enabled() or (self._strategy.shards_grads and unit.index > 0):
            return None  # see [Note: where a unit's backward ends]
        unit.pending += 1  # undone by this call's backward, if its inputs thread one
        return thread_inputs(functools.partial(self._call_post_backward, unit), args, kwargs)

    def _may_run_again(self, unit: Unit) -> bool:
        """Whether ``unit``, run already in this forward, may run again with no collective.

        Its buckets must be gathered and, under ZeRO-2/3, its backward stay in its
        place: a group's member, or a run right after its previous one.
        """
        if not (self._all_whole or not any(group.released for group in unit.groups)):
            return False
        return not self._strategy.shards_grads or bool(unit.members) or unit is self._last

    def _release_last(self) -> None:
        """Release the last unit that ran (if not kept): another unit runs, or the forward ends."""
        last, self._last = self._last, None
        if last is not None and last.state is TrainingState.FORWARD:
            self._release_after_forward(last)

    def _forward_collectives(self, unit: Unit) -> None:
        """What a unit's forward starts: the same whether it runs or is stood in for."""
        unit.state = TrainingState.FORWARD
        unit.forwarded = True
        self._fwd_order.append(unit)
        if self._strategy.shards_params:
            self._gather(unit, async_op=False)
            if self._comm.prefetching:
                self._comm.prefetch(unit, self._prev_order, +1)

    def _release_after_forward(self, unit: Unit) -> None:
        """Release ``unit``'s bucket unless the backward starts with it (see ``_kept``).

        The last units of the forward are the first of the backward: they stay
        gathered when a backward may come (torchtitan leaves the last block
        unresharded too). Decided from the grad mode alone, so a rank that skipped
        the unit keeps it exactly when one that ran it does. A unit with
        ``reshard_after_forward=False`` stays gathered for the backward too.
        """
        kept = not unit.reshard_after_forward or any(unit is k for k in self._kept)
        if not (torch.is_grad_enabled() and kept):
            for group in unit.groups:
                group.reshard()

    def _stand_in_forward(self, upto: int) -> None:
        """Issue the forward collectives of the units this rank skipped before index ``upto``.

        See [Note: ranks that skip units] in ``engine/unit_order.py``.
        """
        while self._next < upto:
            unit = self._order[self._next]
            self._next += 1
            self._forward_collectives(unit)
            self._release_after_forward(unit)

    def _reorder(self, unit: Unit) -> None:
        """``unit`` is called after the walk passed it: agree on a new order, or stop every rank.

        Every rank that meets such a unit posts its chain (the units it ran in this
        forward, then ``unit``) and takes the order all chains merge into ([Note:
        agreeing on an order]); the walk goes on from the end of the units any rank ran.
        """
        passed = self._order[self._next - 1].name
        chain = (*(u.name for u in self._fwd_order if u.ran), unit.name)
        merged = self._agreement.new_order([u.name for u in self._order], (self._next, chain))
        if isinstance(merged, str):
            self._out_of_order(unit, f"ran after unit {passed!r}, which comes after it{merged}")
        names, done = merged
        by_name = {u.name: u for u in self._units}
        self._order = [by_name[name] for name in names]
        self._reversed = self._order[::-1]
        for index, walked in enumerate(self._order):
            walked.index = index
        self._next = done
        self._fwd_order = self._order[:done]
        if (split := self._nest.misplaced(self._order)) is not None:
            self._out_of_order(split, "is no longer right before the units inside it")

    @translated(_store)
    def _unit_post_forward(
        self, unit: Unit, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        if in_backward(unit):
            return
        if not self._in_forward and not self._callback_queued:
            self._solo_post_forward(unit, output)
            return
        # Released when another unit runs (a group unit: at the forward's end).
        if self._in_forward and self._nest.inner_count(unit):
            self._release_after_forward(unit)
        grads = self._strategy.shards_grads and torch.is_grad_enabled()
        if grads and (tensors := grad_tensors(output)):
            on_first_grad(tensors, functools.partial(self._unit_pre_backward, unit))

    def _gather(self, unit: Unit, async_op: bool, backward: bool = False) -> None:
        if backward and not unit.unshard_in_backward:
            return  # FSDP2's set_unshard_in_backward(False): autograd needs none of its weights
        for group in unit.groups:
            group.unshard(async_op=async_op)
        for group in unit.groups:
            group.wait_unshard()

    # ------------------------------------------------------------------ backward
    def _ensure_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._root_post_backward)

    @translated(_store)
    def _root_pre_backward(self, grad: torch.Tensor | None) -> None:
        if self._root.state is TrainingState.PRE_BACKWARD:
            return  # the output of another forward before this backward (_serve_again)
        self._on_backward_start()
        self._ensure_callback()
        self._pass_backward = True
        self._back = 0
        self._root.state = TrainingState.PRE_BACKWARD
        self._gather(self._root, async_op=False, backward=True)
        accumulate = self._groups if not self._strategy.shards_grads else self._root.groups
        for group in accumulate:
            group.begin_accumulate()
        if self._comm.prefetching:
            self._comm.start_gathers(None, self._fwd_order, len(self._fwd_order) - 1, -1)

    @translated(_store)
    def _unit_pre_backward(self, unit: Unit, grad: torch.Tensor | None) -> None:
        self._ensure_callback()
        self._pass_backward = True
        if unit.state is TrainingState.PRE_BACKWARD:
            return  # another call of the unit (or member of the group) started its backward
        place = len(self._units) - 1 - unit.index
        if unit.state is TrainingState.POST_BACKWARD or place < self._back:
            self._serve_again(unit)
            return
        place -= self._nest.inner_count(unit)  # the units inside it come first
        if place != self._back:
            self._finish_before(place)
        self._back = place
        self._backward_collectives(unit)

    def _agree(self, unit: Unit, what: str) -> None:
        """Check that every rank serves ``unit`` again here; else stop every rank (no gather)."""
        odd = self._agreement.odd((self._next, (what, unit.name, f"backward at {self._back}")))
        if odd:
            self._out_of_order(unit, f"{what} on this rank, not at this place on rank(s) {odd}")

    def _serve_again(self, unit: Unit) -> None:
        """Gather ``unit`` on demand for a backward that comes after the walk passed it.

        [Note: a unit served again] FSDP2 gathers at every call and reduces at every
        backward, so its programs may run a unit again after others in one forward
        (gathered again, ``_unit_pre_forward``), run two forwards before one backward,
        or put a unit at both ends of the model. The backward then meets a unit whose
        reduction was issued (or that the walk finished early): it is gathered and
        accumulates again; those grads are reduced at the end of its threaded call or
        of the backward, added to the ones reduced before, as FSDP2 adds them. The
        ranks check on the store that all of them do it here (``_agree``).
        """
        for outer in self._nest.around(unit):
            if outer.state is TrainingState.POST_BACKWARD:
                self._serve_again(outer)
        self._agree(unit, "started its backward again after the backward had passed it")
        unit.state = TrainingState.PRE_BACKWARD
        unit.forwarded = unit.ran = True
        self._gather(unit, async_op=False, backward=True)
        for group in unit.groups:
            group.begin_accumulate()
        self._again.append(unit)

    def _backward_collectives(self, unit: Unit) -> None:
        """What a unit's backward starts with: the same whether it runs or is stood in for."""
        for outer in self._nest.around(unit):  # [Note: nested units in the walk]
            if not in_backward(outer):
                self._backward_collectives(outer)
                if not outer.ran:
                    for group in outer.groups:
                        group.mark_unused()
        unit.state = TrainingState.PRE_BACKWARD
        if self._strategy.shards_params:
            self._gather(unit, async_op=False, backward=True)
            if self._comm.prefetching:
                self._comm.prefetch(unit, self._fwd_order, -1)
        if self._strategy.shards_grads:
            for group in unit.groups:
                group.begin_accumulate()

    def _call_post_backward(self, unit: Unit) -> None:
        """The backward of one forward call of ``unit`` ran; the last one ends the unit's."""
        unit.pending -= 1
        if unit.pending == 0:
            self._unit_post_backward(unit)

    def _finish_before(self, place: int) -> None:
        """Finish every unit before ``place`` in the reversed order that is not finished yet.

        A unit this rank skipped, or whose backward did not reach it (its output was
        unused), is stood in for: gathered, given zero grads, reduced and released where
        a rank that ran it does that (see [Note: ranks that skip units]). A unit whose
        backward started and whose post-backward has not fired (none is threaded, or no
        input requires grad) is finished here on every rank alike: its grads are
        complete, since autograd runs a later unit's backward before an earlier unit's
        (see [Note: where a unit's backward ends]).
        """
        while self._back < place:
            unit = self._reversed[self._back]
            self._back += 1
            if unit.state is TrainingState.POST_BACKWARD or not unit.forwarded:
                continue  # done, or not part of this pass (a unit called by itself)
            if unit.state is not TrainingState.PRE_BACKWARD:
                self._backward_collectives(unit)
                if not unit.ran:
                    for group in unit.groups:
                        group.mark_unused()
            self._finish(unit)

    @translated(_store)
    def _unit_post_backward(self, unit: Unit) -> None:
        if any(u is unit for u in self._again):
            self._finish(unit)
            return
        if unit.state is TrainingState.POST_BACKWARD or not unit.forwarded:
            return  # no grad reached it since its reduction (see _serve_again)
        place = len(self._units) - 1 - unit.index
        if place != self._back:
            self._finish_before(place)
        self._finish(unit)
        self._back = place + 1

    def _finish(self, unit: Unit) -> None:
        """The end of a unit's backward: queue its reduction (per policy), release it."""
        unit.state = TrainingState.POST_BACKWARD
        if self._again:
            self._again = [u for u in self._again if u is not unit]
        if unit.ran:
            for group in unit.groups:
                group.mark_used()
        if unit.requires_gradient_sync and self._reduce_now():
            self._comm.queue_reduction(unit)
        self.held.release_after_backward(unit)

    @translated(_store)
    def _root_post_backward(self) -> None:
        while self._solo:  # solo calls whose post-backward did not fire
            self._finish_solo(self._solo[0])
        if not self._pass_backward:
            self._solo_backward_end()
            return
        self._pass_backward, self._solo_reduced = False, []
        self._finish_before(len(self._units))  # in the reversed order, as if they ran
        while self._again:
            self._finish(self._again[0])
        self._root.forwarded = True
        if self._root.state is not TrainingState.POST_BACKWARD:
            self._finish(self._root)
        self._comm.hand_over_reductions()
        sharded = self._strategy.shards_params  # prefetched, or gathered after its backward:
        for unit in self._units:  # released, or held for the optimizer step to release
            done = unit.state is TrainingState.POST_BACKWARD
            if not done or (sharded and not all(g.released for g in unit.groups)):
                self.held.release_after_backward(unit)
        for unit in (self._root, *self._units):  # a retained graph may run backward again
            unit.state = TrainingState.IDLE
            unit.pending = 0
        self._back = 0
        self._callback_queued = False
        self._on_backward_end()
        self._on_idle()
