"""Units left gathered outside a pass: FSDP2's explicit ``unshard``/``reshard`` and its options.

A unit stays gathered after its backward with ``reshard_after_backward=False``,
and after an explicit ``unshard`` (FSDP2's ``FSDPModule.unshard``) until its next
release. ``HeldUnits`` remembers them, so that the optimizer step, which changes
their shards, releases them first (``release_held``). Between the explicit
``unshard`` (once its gather is done) and the unit's release the unit's modules
hold its compute forms, as FSDP2's hold the unsharded parameters then
(``show``: ``ParamForms.show_unit``). No collective of its own: releases and
gathers are the buckets'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mf_fsdp.config import TrainingState
from mf_fsdp.engine.unit import Unit

__all__ = ["HeldUnits"]


class HeldUnits:
    """The units left gathered after a pass, or by an explicit ``unshard``."""

    __slots__ = ("_held", "show")

    def __init__(self) -> None:
        self._held: list[Unit] = []
        # Let a unit's modules hold its compute forms (True) or sharded ones; the engine's.
        self.show: Callable[[Unit, bool], None] = lambda unit, compute: None

    def unshard(self, unit: Unit, async_op: bool) -> Callable[[], None]:
        """Gather ``unit`` now (FSDP2's ``unshard``); returns what waits for the gather.

        It stays gathered until its next release (its forward or backward per its
        options, ``reshard``, or the optimizer step).
        """
        for group in unit.groups:
            group.unshard(async_op=async_op)
        if unit.state is TrainingState.IDLE:
            self.hold(unit)

        def wait() -> None:
            for group in unit.groups:
                group.wait_unshard()
            if all(group.gathered for group in unit.groups):  # not released since
                self.show(unit, True)

        if not async_op:
            wait()
        return wait

    def reshard(self, unit: Unit) -> None:
        """Release ``unit``'s gathered weights now (FSDP2's ``reshard``)."""
        if unit.state is TrainingState.PRE_BACKWARD:
            raise RuntimeError(
                f"reshard of unit {unit.name!r} during its backward: its gathered weights "
                "are in use; call it after the backward"
            )
        for group in unit.groups:
            group.reshard()
        self._held = [u for u in self._held if u is not unit]
        self.show(unit, False)

    def show_gathered(self, units: Iterable[Unit]) -> None:
        """Let the modules of every unit of ``units`` that is gathered hold its compute forms."""
        for unit in units:
            if unit.groups and all(group.gathered for group in unit.groups):
                self.show(unit, True)

    def hold(self, unit: Unit) -> None:
        """Remember ``unit`` as gathered until ``release_held`` or its ``reshard``."""
        if not any(u is unit for u in self._held):
            self._held.append(unit)

    def release_held(self) -> None:
        """Release the idle units left gathered: the optimizer step is about to change them."""
        if not self._held:
            return
        held, self._held = self._held, []
        for unit in held:
            if unit.state is TrainingState.IDLE:
                for group in unit.groups:
                    group.reshard()
                self.show(unit, False)

    def release_after_backward(self, unit: Unit) -> None:
        """Release ``unit`` after its backward, or keep it (``reshard_after_backward=False``)."""
        if unit.reshard_after_backward:
            for group in unit.groups:
                group.reshard()
        else:
            self.hold(unit)
