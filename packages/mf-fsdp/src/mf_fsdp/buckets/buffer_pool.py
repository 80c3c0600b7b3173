"""BufferPool: flat temporary tensors reused instead of allocated anew.

A fresh large CPU tensor costs page faults on first touch every time; the
engine's whole-bucket temporaries and the collectives' receive buffers come
from pools, so the units of one backward reuse each other's buffers. When a
forward starts the engine frees the pool's large idle buffers
(``release_large``): they would otherwise sit under that forward's
activations and raise the peak. When the gradients are dropped
(``zero_grad(set_to_none=True)``) it frees them all (``clear``): between steps
a rank holds its weights and optimizer state, nothing else.
"""

from __future__ import annotations

import torch

__all__ = ["KEEP_BELOW_BYTES", "BufferPool"]

KEEP_BELOW_BYTES = 1 << 20
"""Idle buffers smaller than this stay pooled across forwards: their bytes do not
move a peak, while making them (and views of them) again every step costs host
time that a small model's step is made of."""


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

    def release_large(self) -> None:
        """Free the waiting tensors of ``KEEP_BELOW_BYTES`` or more (taken ones stay taken)."""
        large = [k for k, ts in self._free.items() if ts and _nbytes(ts[0]) >= KEEP_BELOW_BYTES]
        for key in large:
            del self._free[key]

    def clear(self) -> None:
        """Free every waiting tensor (taken ones stay taken)."""
        self._free.clear()

    def held_bytes(self) -> int:
        """Bytes of the tensors waiting in the pool."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
