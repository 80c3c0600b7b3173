"""Named scratch buffers that are allocated once and reused.

Collectives and fused kernels need large temporary tensors on every step
(gathered activations, flat communication buffers). Allocating them afresh
fragments the caching allocator and costs time, so callers ask this module
for a view of a named, grow-only buffer instead.

Invariants: a buffer only grows; a request for the same or a smaller size
returns a view of the existing storage and allocates nothing. The caller
guarantees that two users of the same name never hold views at the same time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch

__all__ = [
    "GlobalMemoryBuffer",
    "default_device",
    "get_global_memory_buffer",
    "use_global_memory_buffer",
]


def default_device() -> torch.device:
    """Return the current accelerator device when one is present, else the CPU."""
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None  # is_available() said there is one
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


class GlobalMemoryBuffer:
    """Grow-only scratch tensors keyed by ``(name, dtype, device)``.

    Args:
        device: where new buffers live; defaults to :func:`default_device` at
            the time of each allocation.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)
        self.buffer: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Sequence[int] | torch.Size,
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], AbstractContextManager[object]] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Return a tensor of ``tensor_shape`` that views the named buffer.

        The buffer is (re)allocated only when it is smaller than the request,
        inside ``mem_alloc_context()`` when given (e.g. a memory pool).

        Raises:
            TypeError: if ``dtype`` is not a ``torch.dtype`` or ``name`` not a str.
            ValueError: if ``tensor_shape`` holds a negative size.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"get_tensor: dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(name, str):
            raise TypeError(f"get_tensor: name must be a str, got {name!r}")
        shape = torch.Size(tensor_shape)
        if any(size < 0 for size in shape):
            raise ValueError(f"get_tensor: tensor_shape must be non-negative, got {tuple(shape)}")
        target = torch.device(device) if device is not None else self.device or default_device()
        key = (name, dtype, target)
        required = shape.numel()
        existing = self.buffer.get(key)
        if existing is None or existing.numel() < required:
            context = (
                mem_alloc_context() if mem_alloc_context is not None else contextlib.nullcontext()
            )
            with context:
                existing = torch.empty(required, dtype=dtype, device=target, requires_grad=False)
            self.buffer[key] = existing
        return existing[:required].view(shape)


_default_buffer = GlobalMemoryBuffer()


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """Return the process-wide buffer used when no explicit one is passed."""
    return _default_buffer


@contextlib.contextmanager
def use_global_memory_buffer(buffer: GlobalMemoryBuffer) -> Iterator[GlobalMemoryBuffer]:
    """Swap the process-wide buffer for ``buffer`` inside the block (for isolation in tests)."""
    global _default_buffer
    if not isinstance(buffer, GlobalMemoryBuffer):
        raise TypeError(f"use_global_memory_buffer: expected a GlobalMemoryBuffer, got {buffer!r}")
    previous, _default_buffer = _default_buffer, buffer
    try:
        yield buffer
    finally:
        _default_buffer = previous
