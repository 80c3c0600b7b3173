"""Which of torch's optimizer kernels a step runs, where the user left the choice to torch.

torch's elementwise optimizers have three implementations with the same
arithmetic: a loop over parameters, multi-tensor (``foreach``) kernels, and
fused kernels (one pass over each parameter's weights, grads and state). With
``foreach=None`` and ``fused=None`` torch picks the loop on the CPU and
``foreach`` on CUDA. mf steps its local shards, plain tensors, with:

- torch's fused kernels on CUDA for SGD, Adam and AdamW. The ``foreach`` Adam
  reads and writes the state once per op (about ten passes). On an H200 a 0.88B
  GPT's AdamW step took 22 ms of a 110 ms step that way; fused takes one pass.
  The result equals torch's ``fused=True`` bit for bit, and ``foreach`` to rounding.
- torch's fused CPU kernels for the same three when the parameters are the
  host-side state of an engine that computes on an accelerator
  (``offload_optimizer_state``). There the host step is the step's whole cost:
  on an H200 a 0.88B GPT's multi-tensor AdamW step took 987 ms of a 1,140 ms
  step. The fused CPU kernel makes one pass without temporaries (3-7x faster
  than the multi-tensor one on this project's CPU, at every size).
- the multi-tensor kernels everywhere else. On the CPU the loop dispatches every
  op once per parameter (3 ms of a 17 ms step on the tiny preset); the
  multi-tensor path dispatches once per op, with the same result bit for bit.
  (The fused CPU kernels round differently from the loop, by an ulp that Adam's
  division can magnify past 1e-6 where a gradient is near zero; a CPU-only run
  keeps plain PyTorch's result.)

A group that chose keeps its choice (``fused=False`` alone still gets the
multi-tensor path); so does a differentiable one.
"""

from __future__ import annotations

import torch

from mf_fsdp.engine.megatron_fsdp import owner_of
from mf_fsdp.optim.local_step import ELEMENTWISE

__all__ = ["FUSED_DEVICES", "HOST_DEVICES", "prefer_fast_kernels"]

FUSED_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Devices whose parameters step with torch's fused kernels when the choice is left to mf."""

HOST_DEVICES: frozenset[str] = frozenset({"cpu"})
"""Engine devices that are the host: the state they offload stays on multi-tensor kernels."""

_FUSED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def prefer_fast_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Pick fused or multi-tensor kernels for ``optimizer``'s groups that left both unset.

    Called when the optimizer is bound, after its state is created, and after each
    state load (a loaded group brings its saved choice). Every group on fused
    kernels gets its step counters on its parameters' device, where those kernels
    read them (state created or loaded for another kernel has them on the CPU).
    """
    if type(optimizer) not in ELEMENTWISE:  # each has a multi-tensor path
        return
    fusable = type(optimizer) in _FUSED
    for group in optimizer.param_groups:
        if group.get("foreach", False) is None and not group.get("differentiable", False):
            fused = group.get("fused", False)
            if fused is None and fusable and _all_on_fused_devices(group["params"]):
                group["fused"] = True
            elif not fused:
                group["foreach"] = True
        if group.get("fused"):
            _steps_on_param_device(optimizer, group)


def _all_on_fused_devices(params: list[torch.Tensor]) -> bool:
    return bool(params) and all(
        p.is_floating_point() and (p.device.type in FUSED_DEVICES or _host_side_state(p))
        for p in params
    )


def _host_side_state(param: torch.Tensor) -> bool:
    """Whether ``param`` lives on the host for an engine that computes on an accelerator."""
    engine = owner_of(param)
    return (
        param.device.type == "cpu"
        and engine is not None
        and engine.offloads_optimizer_state
        and engine.device.type not in HOST_DEVICES
    )


def _steps_on_param_device(optimizer: torch.optim.Optimizer, group: dict) -> None:
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if isinstance(step, torch.Tensor) and step.device != param.device:
            optimizer.state[param]["step"] = step.to(param.device, torch.float32)
