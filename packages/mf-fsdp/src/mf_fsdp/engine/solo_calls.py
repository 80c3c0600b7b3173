"""Units called by themselves: outside the root's forward and any backward.

[Note: a unit called by itself] A unit called outside the root's forward and
any backward (torchtitan's chunked loss runs the LM head per chunk, each with
its own backward, between the root's forward and backward) is a solo call: it
gathers the unit, runs it, releases it per ``reshard_after_forward``; its
output's backward gathers it again, accumulates, reduces (per the policy and
``requires_gradient_sync``), hands the grads out (``on_solo_end``, as FSDP2
after each backward) and releases per ``reshard_after_backward``. A root
forward waiting for its backward keeps its order and states. Units left
gathered (``reshard_after_backward=False``, ``unshard``) are released before
the optimizer step (``release_held``): the step changes their shards.

``SoloCalls`` is a part of ``UnitHooks`` (a base class of it, ``engine/hooks.py``):
the hooks of such calls, kept apart from the walk of a pass; the attributes and
the two methods it names are ``UnitHooks``' own.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

from mf_fsdp.config import TrainingState
from mf_fsdp.engine.comm_window import CommWindow
from mf_fsdp.engine.held_units import HeldUnits
from mf_fsdp.engine.nesting import Nesting
from mf_fsdp.engine.rank_paths import translated
from mf_fsdp.engine.unit import Unit, grad_tensors, on_first_grad, thread_inputs

__all__ = ["SoloCalls"]


_store = operator.attrgetter("store")  # the store a collective's failure is looked up in


class SoloCalls:
    """The hooks of a unit's calls by itself (see [Note: a unit called by itself])."""

    store: Any
    held: HeldUnits
    _root: Unit
    _nest: Nesting
    _comm: CommWindow
    _solo: list[Unit]
    _solo_reduced: list[Unit]
    _callback_queued: bool
    _reduce_now: Callable[[], bool]
    _on_compute: Callable[[], None]
    _on_backward_start: Callable[[], None]
    _on_backward_end: Callable[[], None]
    _on_idle: Callable[[], None]
    _on_solo_end: Callable[[list[Unit]], None]
    _gather: Callable[..., None]
    _ensure_callback: Callable[[], None]

    def _solo_pre_forward(
        self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A call of ``unit`` by itself (see [Note: a unit called by itself]): gather it."""
        self._on_compute()
        self._nest.solo_open += 1
        self._gather(unit, async_op=False)
        if not torch.is_grad_enabled():
            return None
        threaded = thread_inputs(functools.partial(self._solo_post_backward, unit), args, kwargs)
        if threaded is not None:
            unit.solo_pending += 1
        return threaded

    def _solo_post_forward(self, unit: Unit, output: Any) -> None:
        """Hook the call's backward; release ``unit`` per its ``reshard_after_forward``."""
        if torch.is_grad_enabled() and (tensors := grad_tensors(output)):
            on_first_grad(tensors, functools.partial(self._solo_pre_backward, unit))
        if unit.reshard_after_forward:
            for group in unit.groups:
                group.reshard()
        elif unit.state is TrainingState.IDLE:
            self.held.hold(unit)
        self._nest.solo_open -= 1
        if not self._nest.solo_open:  # not inside an outer unit's call by itself
            self._on_idle()

    @translated(_store)
    def _solo_pre_backward(self, unit: Unit, grad: torch.Tensor | None) -> None:
        self._ensure_callback()
        if any(u is unit for u in self._solo):
            return  # another call's backward started it
        self._solo.append(unit)
        self._on_backward_start()
        self._gather(unit, async_op=False, backward=True)
        for group in unit.groups:
            group.begin_accumulate()

    @translated(_store)
    def _solo_post_backward(self, unit: Unit) -> None:
        unit.solo_pending -= 1
        if unit.solo_pending <= 0 and any(u is unit for u in self._solo):
            self._finish_solo(unit)

    def _finish_solo(self, unit: Unit) -> None:
        """The backward of ``unit``'s solo calls ran: reduce (per policy), release."""
        self._solo = [u for u in self._solo if u is not unit]
        unit.solo_pending = 0
        for group in unit.groups:
            group.mark_used()
        if unit.requires_gradient_sync and self._reduce_now():
            self._comm.queue_reduction(unit)
            self._solo_reduced.append(unit)
        self.held.release_after_backward(unit)

    def _solo_backward_end(self) -> None:
        """The end of a backward only solo calls took part in: the pass stays as it was."""
        self._comm.finish_reductions()
        self._callback_queued = False
        reduced, self._solo_reduced = self._solo_reduced, []
        if self._root.state is TrainingState.IDLE:  # no forward waits for its backward
            self._on_backward_end()
        else:  # FSDP2 hands out .grad after each backward
            self._on_solo_end(reduced)
        self._on_idle()
