"""BufferPool: flat temporary tensors reused instead of allocated anew.

A fresh large CPU tensor costs page faults on first touch every time; the
engine's whole-bucket temporaries and the collectives' receive buffers come
from pools, so the units of one backward reuse each other's buffers. The
engine empties its pool when a forward starts: idle gradient buffers would
otherwise sit under that forward's activations and raise the peak.
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Free lists of flat tensors keyed by (numel, dtype, device), reused across steps."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return a flat tensor of ``numel`` elements (contents undefined)."""
        free = self._free.get((numel, dtype, device))
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        """Hand a tensor from ``take`` back for reuse."""
        self._free.setdefault((tensor.numel(), tensor.dtype, tensor.device), []).append(tensor)

    def clear(self) -> None:
        """Free every tensor waiting in the pool (those taken stay with their holders)."""
        self._free.clear()

    def held_bytes(self) -> int:
        """Bytes of the tensors waiting in the pool."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
