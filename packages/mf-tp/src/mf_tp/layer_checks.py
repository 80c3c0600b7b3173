"""Argument checks shared by the tensor-parallel layers and their linear functions.

Responsibility: the sizes a layer is built with (positive, divisible by the TP
size, a stride dividing the per-partition size), the config's TP size against
the group's, and an input's last dim. Each raises a ``ValueError`` naming the
caller and the argument.

It must not: communicate, allocate, or hold state.
"""

from __future__ import annotations

import torch

from mf_tp.config import ModelParallelConfig

__all__ = [
    "check_config_tp_size",
    "check_last_dim",
    "check_positive_size",
    "check_stride",
    "per_partition_size",
]


def per_partition_size(size: int, world_size: int, argument: str, where: str) -> int:
    """``size / world_size``, or a ValueError naming ``argument`` when it does not divide."""
    if not isinstance(size, int) or size < 1 or size % world_size != 0:
        raise ValueError(
            f"{where}: {argument}={size!r} must be a positive int divisible by the "
            f"tensor-parallel size {world_size}"
        )
    return size // world_size


def check_positive_size(size: object, argument: str, where: str) -> int:
    """``size`` itself, or a ValueError naming ``argument`` unless it is an int >= 1."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{where}: {argument} must be a positive int, got {size!r}")
    return size


def check_config_tp_size(config: ModelParallelConfig, tp_size: int, where: str) -> None:
    """Raise a ValueError unless ``config`` was built for a TP group of ``tp_size`` ranks.

    The layers split their weights over the group they are given; a config
    that says another size means the model was set up for another layout
    (e.g. a checkpoint's), which would otherwise go unnoticed.
    """
    if config.tensor_model_parallel_size != tp_size:
        raise ValueError(
            f"{where}: config.tensor_model_parallel_size={config.tensor_model_parallel_size} "
            f"but the tensor-parallel group (tp_group) has {tp_size} ranks; expected them "
            "equal (build the config with tensor_model_parallel_size="
            "torch.distributed.get_world_size(tp_group))"
        )


def check_stride(per_partition: int, stride: int, where: str) -> None:
    """Raise a ValueError unless ``stride`` is a positive int dividing ``per_partition``."""
    if not isinstance(stride, int) or stride < 1 or per_partition % stride != 0:
        raise ValueError(
            f"{where}: stride={stride!r} must be a positive int dividing the per-partition "
            f"size {per_partition}"
        )


def check_last_dim(tensor: torch.Tensor, expected: int, argument: str, where: str) -> None:
    """Raise a ValueError naming ``argument`` unless ``tensor``'s last dim is ``expected``."""
    if tensor.dim() == 0 or tensor.shape[-1] != expected:
        raise ValueError(
            f"{where}: {argument} must have last dim {expected}, got shape {tuple(tensor.shape)}"
        )
