"""The handles FSDP2's asynchronous methods return, for the work mf's engine does.

``unshard(async_op=True)`` returns an ``UnshardHandle`` whose ``wait()`` finishes
the unit's gather; ``finalize_backward(async_op=True)`` a ``GradientReductionHandle``
(torch 2.15) whose work is already done when it is returned. Nothing here
communicates itself: a gather handle calls the engine's own waits.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.fsdp import UnshardHandle

try:  # torch 2.15; torch 2.11 has no manual backward finalization
    from torch.distributed.fsdp import GradientReductionHandle
except ImportError:  # pragma: no cover - the floor of mf's torch range
    GradientReductionHandle = object  # type: ignore[assignment,misc]

__all__ = ["FinishedReduction", "GatherHandle", "GradientReductionHandle"]


class FinishedReduction(GradientReductionHandle):
    """FSDP2's ``GradientReductionHandle`` for a reduction mf finished before returning it."""

    def wait(self) -> None:
        """Nothing is left to wait for: ``finalize_backward`` reduced before returning."""


class GatherHandle(UnshardHandle):
    """FSDP2's ``UnshardHandle`` for mf: ``wait()`` finishes the unit's gather."""

    def __init__(self, waits: list[Callable[[], None]]) -> None:
        self._waits = waits

    def wait(self) -> None:
        """Finish the gather (once); the unit's parameters hold the whole weights."""
        waits, self._waits = self._waits, []
        for wait in waits:
            wait()
