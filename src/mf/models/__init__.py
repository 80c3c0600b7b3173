"""Reference models used by mf's command-line jobs, benchmarks and tests."""

from __future__ import annotations

import torch.distributed as dist

from mf.models.gpt import GPT, PRESETS, Block, GPTConfig
from mf.models.gpt_tp import GPTTensorParallel, TensorParallelBlock
from mf.models.moe_gpt import (
    MOE_PRESETS,
    MoEBlock,
    MoEGPT,
    MoEGPTConfig,
    MoEGPTTensorParallel,
    RoutingStats,
)
from mf.models.optimizers import OPTIMIZER_RECIPES, build_optimizers, hidden_matrices

__all__ = [
    "GPT",
    "MODEL_PRESETS",
    "MOE_PRESETS",
    "OPTIMIZER_RECIPES",
    "PRESETS",
    "Block",
    "GPTConfig",
    "GPTTensorParallel",
    "MoEBlock",
    "MoEGPT",
    "MoEGPTConfig",
    "MoEGPTTensorParallel",
    "RoutingStats",
    "TensorParallelBlock",
    "build_optimizers",
    "config_from_dict",
    "hidden_matrices",
    "plain_model",
]

MODEL_PRESETS: dict[str, GPTConfig] = {**PRESETS, **MOE_PRESETS}
"""Every preset ``mf-train --model`` takes: the dense GPTs and the mixtures of experts."""


def plain_model(
    config: GPTConfig,
    ep_group: dist.ProcessGroup | None = None,
    etp_group: dist.ProcessGroup | None = None,
) -> GPT:
    """The model of ``config`` on one process (or its experts over ``ep_group`` x ``etp_group``)."""
    if isinstance(config, MoEGPTConfig):
        return MoEGPT(config, ep_group, etp_group)
    if ep_group is not None or etp_group is not None:
        name = "ep_group" if ep_group is not None else "etp_group"
        raise ValueError(f"plain_model: {name} needs a MoEGPTConfig, got {config!r}")
    return GPT(config)


def config_from_dict(fields: dict) -> GPTConfig:
    """The config a ``dataclasses.asdict`` of a ``GPTConfig`` or ``MoEGPTConfig`` came from."""
    return MoEGPTConfig(**fields) if "num_experts" in fields else GPTConfig(**fields)
