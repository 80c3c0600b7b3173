"""Optimizer integration: rebind to sharded parameters, finish reductions, install weights.

``fully_shard_optimizer`` swaps each model parameter in the optimizer's param
groups for the engine's optimizer parameter (a 1-D uneven DTensor over the
owned shard, or the full parameter for ``no_shard``), keeping groups and
options. A step pre-hook finishes every pending gradient reduction (so no
strategy steps on unreduced grads), a step post-hook installs the updated
weights into the model buffers, and ``zero_grad`` also zeroes the engine's
buffers. (An optimizer that still holds the wrapped model's original
parameters is rejected at step time by a hook that ``MegatronFSDP`` installs.)
"""

from __future__ import annotations

import torch

from mf_fsdp.megatron_fsdp import MegatronFSDP

__all__ = ["fully_shard_optimizer"]


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
            model = MegatronFSDP.owner_of(param)
            if model is not None:
                return model
    raise ValueError(
        "fully_shard_optimizer: none of the optimizer's parameters belongs to a MegatronFSDP "
        "model; pass model= or build the optimizer on the wrapped model's parameters"
    )
