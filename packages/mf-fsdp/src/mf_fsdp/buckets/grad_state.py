"""Per-bucket state: where its gradients are in their reduction, whether its weights are here.

A bucket's gradients live in two places: the *local* buffer, where autograd
accumulates this rank's micro-batches, and the *store*, which holds what the
reductions produced and what the optimizer steps on. Each has its own state;
:class:`GradState` holds both and changes them only through its methods, each
of which refuses a transition the table does not list (naming the rank and the
bucket), so a wrong call order fails loudly instead of reducing twice or
dropping a micro-batch.

Reduced and unreduced gradients never share memory while both matter:
accumulating after a reduction sets the reduced values aside (the bucket's
``_aside`` buffers, by how far they are reduced) and adds them back once the
new grads are reduced as far, so no value is ever rescaled to survive a
second reduction.

=================  ==================  ===========================  ==========================
method             local               store                        when
=================  ==================  ===========================  ==========================
``accumulate``     CLEAN/ACCUMULATED   unchanged, or NONE after     a unit's backward starts
                   -> ACCUMULATED      ``set_aside``                adding local grads
``launch``         ACCUMULATED         unchanged                    the dp_shard reduction
                   -> REDUCING                                      starts (``no_sync``
                                                                    skips it)
``land``           REDUCING -> CLEAN   -> INNER (dp_outer due) or   the reduction finished
                                       FULL; hybrid HSDP keeps the  and was folded into the
                                       store (the result waits in   store
                                       the pending buffer)
``reduce_outer``   unchanged           INNER -> FULL; hybrid:       once per optimizer step
                                       -> FULL                      (HSDP)
``set_aside``      unchanged           INNER/FULL -> NONE           the store shares memory
                                                                    with the local buffer and
                                                                    more grads are about to
                                                                    be accumulated there: its
                                                                    values wait aside
``reset``          -> CLEAN            -> NONE                      ``zero_grad``
=================  ==================  ===========================  ==========================

:class:`Gather` is whether a bucket's full weights are present: ZeRO-0/1/2
buckets are always ``GATHERED``; a ZeRO-3 bucket goes ``RELEASED`` ->
``GATHERING`` (all-gather in flight) -> ``GATHERED`` -> ``RELEASED``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Gather", "GradState", "Local", "Reduced", "check_invariant"]


def check_invariant(condition: bool, rank: int | None, bucket: str, what: str) -> None:
    """Raise RuntimeError naming the rank and the bucket unless ``condition`` holds.

    For the engine's internal invariants: a failure is a bug in mf (or a call
    order the public API does not allow), never a user's bad input. ``rank``
    None names this process's global rank, looked up only when raising (the
    checks run on every step's hot path).
    """
    if not condition:
        if rank is None:
            rank = dist.get_rank()
        raise RuntimeError(f"mf_fsdp internal error on rank {rank}, {bucket}: {what}")


class Local(enum.Enum):
    """The local gradient buffer of a bucket."""

    CLEAN = "clean"  # nothing accumulated since the last reduction or zero_grad
    ACCUMULATED = "accumulated"  # this rank's grads, not reduced yet
    REDUCING = "reducing"  # their reduction is in flight


class Reduced(enum.Enum):
    """The reduced gradient store of a bucket."""

    NONE = "none"  # zeros: nothing reduced since zero_grad
    INNER = "inner"  # reduced over dp_shard; the dp_outer all-reduce is due (replicated HSDP)
    FULL = "full"  # fully reduced: what the optimizer steps on


class Gather(enum.Enum):
    """Whether a bucket's full weights are present on this rank."""

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(slots=True)
class GradState:
    """Both gradient states of one bucket and their transitions (see the module table)."""

    rank: int
    bucket: str
    local: Local = Local.CLEAN
    reduced: Reduced = Reduced.NONE

    def _require(self, allowed: bool, transition: str) -> None:
        if allowed:  # the message is built only for a failure (every step passes here)
            return
        check_invariant(
            allowed,
            self.rank,
            self.bucket,
            f"{transition} with local grads {self.local.value} and store {self.reduced.value}",
        )

    def accumulate(self) -> None:
        """Local grads are being added (a unit's backward)."""
        self._require(self.local is not Local.REDUCING, "accumulate")
        self.local = Local.ACCUMULATED

    def launch(self) -> None:
        """The local grads' reduction starts."""
        self._require(self.local is Local.ACCUMULATED, "launch")
        self.local = Local.REDUCING

    def land(self, outer_due: bool, hybrid: bool) -> None:
        """The reduction finished; its result is in the store (or the hybrid pending buffer)."""
        self._require(self.local is Local.REDUCING, "land")
        self.local = Local.CLEAN
        if not hybrid:
            self.reduced = Reduced.INNER if outer_due else Reduced.FULL

    def reduce_outer(self) -> None:
        """The dp_outer stage ran (replicated: the store's all-reduce; hybrid: its scatter)."""
        self._require(self.local is not Local.REDUCING, "reduce_outer")
        self.reduced = Reduced.FULL

    def set_aside(self) -> None:
        """The store's values were moved aside (its memory is needed for local grads)."""
        self._require(self.reduced is not Reduced.NONE, "set_aside")
        self.reduced = Reduced.NONE

    def reset(self) -> None:
        """Every gradient was dropped."""
        self._require(self.local is not Local.REDUCING, "reset")
        self.local = Local.CLEAN
        self.reduced = Reduced.NONE
