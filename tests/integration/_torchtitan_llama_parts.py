"""What the torchtitan Llama parity tests on meshes and pipelines share.

Both build torchtitan's Llama 3 debugmodel cut to a few blocks (SDPA attention
for the CPU, ``test_torchtitan_llama``'s config) with torchtitan's own tensor
parallel plan, run torch's FSDP2 and mf through torchtitan's code in the same
ranks, and compare with one process. Importing this module imports torchtitan:
a test module imports it inside the guard that skips where torchtitan does not
import.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from mf_fsdp import fsdp2
from tests.integration.test_torchtitan_llama import _config, _initialised

__all__ = ["ENGINES", "force_sum", "full", "model_config", "one_process"]

ENGINES = (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard))
"""The two engines a parity run compares, torch's first."""


def model_config(layers: int):
    """The debugmodel's first ``layers`` blocks with torchtitan's TP plan (sequence parallel)."""
    config = _config()
    config = dataclasses.replace(config, layers=config.layers[:layers])
    set_llama3_sharding_config(config, enable_sp=True)
    return config


def one_process(layers: int) -> nn.Module:
    """The plain model with torchtitan's init: one process's initial weights."""
    with torch.device("meta"):
        model = model_config(layers).build()
    return _initialised(model)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (maybe sharded) tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def force_sum(model: nn.Module, shard) -> None:
    """torch's FSDP2 asks gloo for PREMUL_SUM, which it lacks: sum, then divide."""
    if shard is torch_fully_shard:
        for module in model.modules():
            if isinstance(module, TorchFSDPModule):
                module.set_force_sum_reduction_for_comms(True)
