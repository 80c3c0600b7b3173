"""Named accelerators ``mf-plan --device`` takes, with the figures a plan states.

Figures are the vendors' published ones for dense bf16 work and the usual
server builds (8 GPUs a node joined by NVLink, one 400 Gb/s InfiniBand port per
GPU between nodes), so every plan says which numbers it assumed. The memory
decides what fits; the FLOP/s and link figures feed the step-time estimate
(``mf.plan.step_time``). This module computes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "Device", "GiB", "custom_device"]

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator as a plan sees it.

    Attributes:
        name: how ``--device`` names it (``"custom"`` for ``--gpu-memory`` alone).
        memory_bytes: memory one GPU has for the run.
        peak_tflops: dense bf16 TFLOP/s (None: not known).
        nvlink_gbps: GB/s one way between GPUs of a node (None: not known).
        network_gbps: GB/s one way per GPU between nodes (None: not known).
    """

    name: str
    memory_bytes: int
    peak_tflops: float | None = None
    nvlink_gbps: float | None = None
    network_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"Device: memory_bytes must be positive, got {self.memory_bytes}")


DEVICES: dict[str, Device] = {
    "h100": Device("h100", 80 * 10**9, peak_tflops=989.0, nvlink_gbps=450.0, network_gbps=50.0),
    "h200": Device("h200", 141 * 10**9, peak_tflops=989.0, nvlink_gbps=450.0, network_gbps=50.0),
    "a100": Device("a100", 80 * 10**9, peak_tflops=312.0, nvlink_gbps=300.0, network_gbps=25.0),
}
"""H100 SXM 80 GB, H200 SXM 141 GB and A100 SXM 80 GB, as their data sheets give them."""


def custom_device(memory_gib: float) -> Device:
    """A GPU known only by its memory (``--gpu-memory GiB``)."""
    return Device("custom", round(memory_gib * GiB))
