"""Host memory for ``offload_optimizer_state``: where the optimizer's tensors live then.

[Note: optimizer state on the host]
With ``offload_optimizer_state`` each bucket keeps, per rank, three things in
host memory instead of on the device: its main weights (the sharded
parameters the optimizer steps, ``WeightStorage.main``), a host copy of its
reduced gradients (``Bucket.host_grads``, what the sharded parameters'
``.grad`` are views of), and so the optimizer state that torch creates like
its parameters. The device keeps what the forward and backward read: the
compute weights (ZeRO-3's compute-dtype shard the all-gather reads, ZeRO-1/2's
whole bucket) and the gradient buffers the reduction writes.

When the grads are handed to the optimizer (the step, or a bucket's step
inside the backward) the reduced store is copied to the host grads
(``non_blocking`` from the device; one device sync before the host reads
them); the optimizer steps the host tensors on the CPU (torch's fused CPU
kernels for an accelerator's state, see ``optim/kernel_choice.py``);
``install`` copies the stepped main weights into the device's compute
weights, cast to the compute dtype, before the next forward. Inside the
backward the host steps run on a worker thread instead, each once its
bucket's copy is done, while the device goes on with the backward (see
``engine/backward_step.py``).

On a CPU-only machine host and device are the same memory, yet the buffers
are separate ones and every copy runs: the CPU tests exercise the same path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["device_copies_mark", "host_zeros", "wait_for_device_copies"]


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


def device_copies_mark(device: torch.device) -> Callable[[], None]:
    """A wait, callable from any thread, for the copies ``device`` has been given so far.

    On CUDA an event recorded now (waiting on it blocks that thread only, not the
    device's queue); on the CPU the copies are done already.
    """
    if device.type != "cuda":
        return _done
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


def _done() -> None:
    pass
