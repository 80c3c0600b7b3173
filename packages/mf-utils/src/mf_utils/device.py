"""Which device a process group computes on, from its backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["get_group_device"]

_CPU_BACKENDS = frozenset({"gloo", "mpi"})


def get_group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Return the device whose tensors ``group``'s backend communicates.

    gloo (and mpi) give the CPU; nccl and the other accelerator backends give
    the current accelerator device. A mixed backend such as ``"cpu:gloo,cuda:nccl"``
    gives the accelerator when one is present.

    Raises:
        RuntimeError: if torch.distributed is not initialized, or the backend
            needs an accelerator that is not there.
    """
    if not dist.is_initialized():
        raise RuntimeError("get_group_device: torch.distributed is not initialized")
    backend = str(dist.get_backend(group)).lower()
    backends = {part.split(":")[-1] for part in backend.split(",")}
    if backends <= _CPU_BACKENDS:
        return torch.device("cpu")
    if not torch.accelerator.is_available():
        if backends & _CPU_BACKENDS:
            return torch.device("cpu")
        raise RuntimeError(
            f"get_group_device: backend {backend!r} needs an accelerator, but none is available"
        )
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None  # is_available() said there is one
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
