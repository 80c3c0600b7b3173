"""SyncPolicy: when an engine reduces its gradients, in one place.

Four facts decide it: whether the block is inside ``no_sync()``, whether the
engine waits at every backward's end (``model_auto_sync``, also turned on by
``sync()``), whether this backward is flagged as the step's last micro-batch,
and whether the strategy frees a unit's local grads after its reduction
(ZeRO-2/3 must reduce every micro-batch: they have nowhere to accumulate).

==========================  ======================  ===========================  ==========
situation                   a unit's backward ends  the whole backward ends      before the
                                                                                 step
==========================  ======================  ===========================  ==========
inside ``no_sync()``        nothing: grads stay     nothing                      reduce all
                            local                                                that is
                                                                                 local
ZeRO-2/3, or the last       launch the unit's       with ``model_auto_sync``:    reduce what
micro-batch, or             reduction (async when   wait for every reduction;    is left,
``model_auto_sync``         overlapping)            on the last micro-batch      wait, run
                                                    also the dp_outer stage      dp_outer
                                                    (HSDP), and hand the grads   once, hand
                                                    to the optimizer             out grads
ZeRO-0/1, other micro-      nothing: grads stay     nothing                      as above
batches                     local
==========================  ======================  ===========================  ==========

"Before the step" is ``finish_grad_sync``, which the wrapped optimizer's
``step`` runs, so no strategy ever steps on unreduced gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["SyncPolicy"]


@dataclass(slots=True)
class SyncPolicy:
    """The engine's sync switches and the decisions derived from them (see the table).

    Attributes:
        shards_grads: the strategy frees a unit's local grads once reduced (ZeRO-2/3).
        auto_sync: wait for the reductions at the end of every backward.
        last_microbatch: the current backward is the step's last micro-batch.
        suppressed: inside ``no_sync()``.
        microbatch_count: backwards since the last ``step_finished``.
        steps: steps finished (``step_finished`` after at least one backward); names
            the step in error messages.
        outer_each_backward: every backward that waits also runs the dp_outer stage
            (HSDP), so ``.grad`` is fully reduced when ``backward()`` returns, as FSDP2
            gives it (``mf_fsdp.fsdp2``); else once per step.
        manual_finalization: no backward's end waits; the caller finishes the grads
            (FSDP2's ``set_manual_backward_finalization``, torch's pipeline stages).
    """

    shards_grads: bool
    auto_sync: bool
    last_microbatch: bool = False
    suppressed: bool = False
    microbatch_count: int = 0
    steps: int = 0
    outer_each_backward: bool = False
    manual_finalization: bool = False

    def reduce_at_unit_end(self) -> bool:
        """Whether a unit's backward end launches its reduction (else grads stay local)."""
        if self.suppressed:
            return False
        return self.auto_sync or self.last_microbatch or self.shards_grads

    def wait_at_backward_end(self) -> bool:
        """Whether the backward's end waits for the reductions and hands out the grads."""
        return self.auto_sync and not self.manual_finalization and self.reduce_at_unit_end()

    def outer_at_backward_end(self) -> bool:
        """Whether that wait also runs the dp_outer stage (the step's last backward, or each)."""
        return self.last_microbatch or self.outer_each_backward

    def backward_ended(self) -> None:
        """Count a micro-batch."""
        self.microbatch_count += 1

    def step_finished(self) -> None:
        """The grads were reduced for a step: the next backward starts a new one."""
        if self.microbatch_count:
            self.steps += 1
        self.last_microbatch = False
        self.microbatch_count = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep grads local inside the block; the backward after it is the last micro-batch."""
        previous = self.suppressed
        self.suppressed = True
        self.last_microbatch = False
        try:
            yield
        finally:
            self.suppressed = previous
            self.last_microbatch = True

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Wait at the end of every backward inside the block."""
        previous = self.auto_sync
        self.auto_sync = True
        try:
            yield
        finally:
            self.auto_sync = previous
