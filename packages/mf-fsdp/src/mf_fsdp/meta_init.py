"""Meta-device initialisation: materialise one unit's parameters at a time.

With ``init_model_with_meta_device=True`` the engine calls
``materialize_meta_params`` for each unit just before copying the unit into
its shards, so no rank ever holds the whole model. Values come from each
module's own ``reset_parameters()``, or, for a module without one, from the
model's ``_init_weights(module)`` (how Hugging Face models initialise a
module: norms, ``Conv1D``, experts, rotary tables). The same RNG state on
every rank gives the same weights. Meta buffers of those modules are
allocated too and filled by the same call (a rotary embedding's
non-persistent ``inv_freq``, which no state dict restores). The
``Parameter`` objects are kept (``torch.utils.swap_tensors``) so optimizers
and tied weights still refer to them. No communication.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["materialize_meta_params"]


def _initialiser(model: nn.Module, module: nn.Module) -> Callable[[], object] | None:
    """``module.reset_parameters``, else ``model._init_weights(module)``, else None."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    init_weights = getattr(model, "_init_weights", None)
    return functools.partial(init_weights, module) if callable(init_weights) else None


def materialize_meta_params(
    model: nn.Module, root: nn.Module, params: set[nn.Parameter], device: torch.device
) -> None:
    """Allocate on ``device`` and initialise the meta parameters of ``params`` under ``root``.

    Meta buffers of the modules under ``root`` are allocated and initialised as well.

    Args:
        model: the wrapped model (whose ``_init_weights`` initialises modules without
            ``reset_parameters``).
        root: the unit's module (the model for the root unit).
        params: the unit's parameters.
        device: where the values go.

    Raises:
        ValueError: if a module holding such a parameter or buffer has no
            ``reset_parameters()`` and ``model`` no ``_init_weights``.
    """
    for module in root.modules():
        direct = [p for p in module.parameters(recurse=False) if p in params and p.is_meta]
        buffers = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not direct and not buffers:
            continue
        init = _initialiser(model, module)
        if init is None:
            raise ValueError(
                f"init_model_with_meta_device: {type(module).__name__} holds meta parameters or "
                "buffers but has no reset_parameters(), and the model no _init_weights(module); "
                "expected one of them to initialise it"
            )
        for p in direct:
            # swap_tensors keeps the Parameter object (optimizers and ties refer to it).
            real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
            torch.utils.swap_tensors(p, real)
        for name in buffers:  # replaced in place: persistence is kept by name
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        with torch.no_grad():
            init()
