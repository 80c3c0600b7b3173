"""Optimizer integration: rebind to sharded parameters, finish reductions, install weights.

``fully_shard_optimizer`` swaps each model parameter in the optimizer's param
groups for the engine's optimizer parameter (a 1-D uneven DTensor over the
owned shard, or the full parameter for ``no_shard``), keeping groups and
options. A step pre-hook finishes every pending gradient reduction (so no
strategy steps on unreduced grads), a step post-hook installs the updated
weights into the model buffers, and ``zero_grad`` also zeroes the engine's
buffers.

An optimizer that still holds the wrapped model's original parameters is
rejected at step time by a global step pre-hook
(``install_unwrapped_optimizer_guard``, installed by ``MegatronFSDP``).
This module never builds the optimizer parameters (``optimizer_params.py``
does) and imports the engine for type hints only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mf_fsdp.optimizer_params import MANAGED_ATTR, owner_of

if TYPE_CHECKING:
    from mf_fsdp.megatron_fsdp import MegatronFSDP

__all__ = ["fully_shard_optimizer", "install_unwrapped_optimizer_guard"]

_GUARD_INSTALLED = False


def install_unwrapped_optimizer_guard() -> None:
    """Register (once per process) the step pre-hook that rejects unwrapped optimizers."""
    global _GUARD_INSTALLED
    if not _GUARD_INSTALLED:
        register_optimizer_step_pre_hook(_reject_unwrapped)
        _GUARD_INSTALLED = True


def _reject_unwrapped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        params = group["params"]
        if params and getattr(params[0], MANAGED_ATTR, False):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): this optimizer holds the original parameters "
                "of a model wrapped by mf_fsdp, whose values and grads live in the engine's "
                "buffers; stepping it would silently train nothing. Pass it through "
                "mf_fsdp.fully_shard_optimizer(optimizer) (or fully_shard(model, optimizer))."
            )


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer, model: MegatronFSDP | None = None
) -> torch.optim.Optimizer:
    """Rebind ``optimizer`` (built on the model's original parameters) to the engine.

    Args:
        optimizer: any ``torch.optim.Optimizer`` whose params are the wrapped model's
            parameters and which has not stepped yet.
        model: the ``MegatronFSDP`` owning them; found from the parameters when None.

    Returns:
        The same optimizer object, now stepping on the engine's parameters.

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer.
        ValueError: if it already has state, was already rebound, or holds a parameter
            that no ``MegatronFSDP`` manages.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fully_shard_optimizer: optimizer must be a torch.optim.Optimizer, got {optimizer!r}"
        )
    if getattr(optimizer, "_mf_fsdp_model", None) is not None:
        raise ValueError("fully_shard_optimizer: optimizer was already passed through it once")
    if optimizer.state:
        raise ValueError(
            "fully_shard_optimizer: optimizer already has state (it has stepped); expected a "
            "fresh optimizer built on the model's parameters"
        )
    if model is None:
        model = _find_model(optimizer)
    for group in optimizer.param_groups:
        group["params"] = [model.optimizer_param(p) for p in group["params"]]
    optimizer._mf_fsdp_model = model  # type: ignore[attr-defined]
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: model.finish_grad_sync())
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: model.install_optimized_model_weights()
    )
    plain_zero_grad = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        plain_zero_grad(set_to_none)
        model.zero_grad_buffer()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    return optimizer


def _find_model(optimizer: torch.optim.Optimizer) -> MegatronFSDP:
    for group in optimizer.param_groups:
        for param in group["params"]:
            model = owner_of(param)
            if model is not None:
                return model
    raise ValueError(
        "fully_shard_optimizer: none of the optimizer's parameters belongs to a MegatronFSDP "
        "model; pass model= or build the optimizer on the wrapped model's parameters"
    )
