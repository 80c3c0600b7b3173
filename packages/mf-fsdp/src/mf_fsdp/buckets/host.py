"""Host memory for ``offload_optimizer_state``: where the optimizer's tensors live then.

[Note: optimizer state on the host]
With ``offload_optimizer_state`` each bucket keeps, per rank, three things in
host memory instead of on the device: its main weights (the sharded
parameters the optimizer steps, ``WeightStorage.main``), a host copy of its
reduced gradients (``ParamGroup.host_grads``, what the sharded parameters'
``.grad`` are views of), and so the optimizer state that torch creates like
its parameters. The device keeps what the forward and backward read: the
compute weights (ZeRO-3's compute-dtype shard the all-gather reads, ZeRO-1/2's
whole bucket) and the gradient buffers the reduction writes.

When the grads are handed to the optimizer (the step, or a bucket's step
inside the backward) the reduced store is copied to the host grads
(``non_blocking`` from the device; one device sync before the host reads
them); the optimizer steps the host tensors with torch's multi-tensor CPU
kernels; ``install`` copies the stepped main weights into the device's
compute weights, cast to the compute dtype, before the next forward.

On a CPU-only machine host and device are the same memory, yet the buffers
are separate ones and every copy runs: the CPU tests exercise the same path.
"""

from __future__ import annotations

import torch

__all__ = ["host_zeros", "wait_for_device_copies"]


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host buffer for a bucket whose device is ``device`` (pinned for CUDA).

    Pinned memory lets the device copy into it and out of it asynchronously.
    """
    pin = device.type == "cuda"
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)


def wait_for_device_copies(device: torch.device) -> None:
    """Block until ``device``'s pending copies into host buffers are done (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
