"""Which units sit inside which: FSDP2's nested ``fully_shard`` calls in the units' walk.

[Note: nested units in the walk] ``fully_shard(layer.attention)``, then
``fully_shard(layer)``: the outer unit holds the layer's own parameters (its norms),
the inner one the attention's ([Note: nested units] in ``buckets/units.py``). In the
walk (``engine/hooks.py``) an outer unit comes right before the units inside it, so
in the backward's reversed walk it comes right after them. The hooks then keep
FSDP2's timing:

- forward: the outer unit is gathered at its pre-forward and stays gathered while
  the units inside it gather and release, until its own post-forward releases it
  (per ``reshard_after_forward``); it is never the "last unit" the next unit's
  pre-forward releases;
- backward: the outer unit is gathered and accumulates from its pre-backward on
  (before any unit inside it: every unit's ancestors start first, whichever hook
  fires first), and its backward ends after theirs: where the reversed walk passes
  it, once the backward reached a unit before it, or at the backward's end, when
  its own parameters' grads all exist; a forward of a unit inside an outer unit in
  backward is recomputation (activation checkpointing around the outer unit): the
  unit is gathered and its state left alone;
- a call of an outer unit by itself (outside the root's forward): the units inside
  it are called by themselves too, and the modules keep their compute forms until
  the outer call's forward ends (``solo_open``);
- ranks that skip units: a rank standing in for a unit inside an outer unit starts
  the outer unit first, as a rank that ran it did at its pre-backward, so every
  rank issues the gathers and reductions in one order.

The walk keeps each outer unit right before the units inside it; an agreed new
order (``_reorder``) that splits them stops every rank in one line naming the unit.

Relations (computed once from the modules) and one count; no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mf_fsdp.config import TrainingState
from mf_fsdp.engine.unit import Unit

__all__ = ["Nesting", "in_backward"]

_IN_BACKWARD = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


def in_backward(unit: Unit) -> bool:
    """Whether ``unit``'s backward started in the running backward (finished or not)."""
    return unit.state in _IN_BACKWARD


class Nesting:
    """The units around each unit and the number inside it (see the Note).

    Args:
        units: the engine's units, in registration order (outer units before the
            units inside them).
    """

    def __init__(self, units: Sequence[Unit]) -> None:
        inside: dict[int, set[int]] = {}  # id(unit) -> ids of the modules below it
        for unit in units:
            tops: tuple[nn.Module, ...] = unit.members or ((unit.module,) if unit.module else ())
            inside[id(unit)] = {id(m) for top in tops for m in top.modules()}
        self._around: dict[int, list[Unit]] = {}
        self._count: dict[int, int] = {}
        for unit in units:
            outer = [
                o for o in units if o is not unit and id(unit.module) in inside[id(o)]
            ]  # outermost first: the larger module trees
            outer.sort(key=lambda o: -len(inside[id(o)]))
            if outer:
                self._around[id(unit)] = outer
            for o in outer:
                self._count[id(o)] = self._count.get(id(o), 0) + 1
        self.any = bool(self._around)
        self.solo_open = 0  # calls by themselves whose forward runs (reset by a root forward)

    def around(self, unit: Unit) -> list[Unit]:
        """The units ``unit`` sits inside, outermost first."""
        return self._around.get(id(unit), []) if self.any else []

    def inner_count(self, unit: Unit) -> int:
        """How many units sit inside ``unit`` (they follow it in the walk)."""
        return self._count.get(id(unit), 0) if self.any else 0

    def recomputed(self, unit: Unit) -> bool:
        """Whether a forward of ``unit`` now is a recomputation inside an outer unit's backward."""
        return self.any and any(in_backward(o) for o in self.around(unit))

    def misplaced(self, order: Sequence[Unit]) -> Unit | None:
        """The first outer unit of ``order`` not followed right away by the units inside it."""
        if not self.any:
            return None
        for index, unit in enumerate(order):
            count = self.inner_count(unit)
            following = order[index + 1 : index + 1 + count]
            if len(following) != count or not all(unit in self.around(u) for u in following):
                return unit
        return None
