"""Meta-device initialisation: materialise one unit's parameters at a time.

With ``init_model_with_meta_device=True`` the engine calls
``materialize_meta_params`` for each unit just before copying the unit into
its shards, so no rank ever holds the whole model. Values come from each
module's own ``reset_parameters()`` (same RNG state on every rank gives the
same weights). The ``Parameter`` objects are kept (``torch.utils.swap_tensors``)
so optimizers and tied weights still refer to them. No communication.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["materialize_meta_params"]


def materialize_meta_params(
    root: nn.Module, params: set[nn.Parameter], device: torch.device
) -> None:
    """Allocate on ``device`` and initialise the meta parameters of ``root`` that are in ``params``.

    Raises:
        ValueError: if a module directly holding such a parameter has no
            ``reset_parameters()``.
    """
    for module in root.modules():
        direct = [p for p in module.parameters(recurse=False) if p in params and p.is_meta]
        if not direct:
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"init_model_with_meta_device: {type(module).__name__} holds meta parameters but "
                "has no reset_parameters(); expected every module with parameters to define it"
            )
        for p in direct:
            # swap_tensors keeps the Parameter object (optimizers and ties refer to it).
            real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
            torch.utils.swap_tensors(p, real)
        with torch.no_grad():
            reset()
