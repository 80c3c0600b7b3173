"""The attribute protocol by which a parameter says it belongs to an expert.

Expert parameters (the weights of a mixture-of-experts layer's experts) are
distributed over the expert-parallel group: each expert-parallel rank holds
different experts, so their gradients must be reduced over the
expert-data-parallel group only, never over the whole data-parallel group.
The mark is Megatron-Core's: ``allreduce = False`` on the parameter. mf-tp's
expert layers set it; mf-fsdp reads it without importing mf-tp (and so
recognises Megatron-Core's expert parameters as they are).
"""

from __future__ import annotations

import torch

__all__ = ["is_expert_parallel_parameter", "set_expert_parallel_attribute"]

EXPERT_PARALLEL_ATTRIBUTE = "allreduce"


def set_expert_parallel_attribute(tensor: torch.Tensor) -> None:
    """Mark ``tensor`` as an expert parameter (``allreduce = False``).

    Raises:
        TypeError: if ``tensor`` is not a torch.Tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"set_expert_parallel_attribute: tensor must be a torch.Tensor, got {type(tensor)!r}"
        )
    setattr(tensor, EXPERT_PARALLEL_ATTRIBUTE, False)


def is_expert_parallel_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries the expert mark (``allreduce is False``)."""
    return getattr(tensor, EXPERT_PARALLEL_ATTRIBUTE, True) is False
