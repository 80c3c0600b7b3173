"""Loading state dicts into a wrapped module: parameter values in any layout, through its own hooks.

``MegatronFSDP.state_dict()`` is the wrapped module's own state dict taken
while the sharded forms are registered (see [Note: parameter forms] in
``buckets/param.py``), so it needs no code here, and the module's state-dict hooks
run on it as they would on the plain module.

[Note: loading through the module's hooks]
Loading is the wrapped module's own ``load_state_dict``, so every hook a model
registers runs: a fused QKV layer merging ``wq``/``wk``/``wv`` into ``wqkv``
(torchtitan), a Hugging Face pre-hook renaming old keys, ``_extra_state``. Only
the last step differs. ``nn.Module`` copies a value into the registered
parameter with ``param.copy_(value)``, which pairs this rank's rows with
whatever piece ``value`` holds locally: wrong for another layout, and for a
DTensor of the same placements it can even broadcast silently. So each module
that holds a managed parameter gets a load pre-hook, registered at wrap time
(after the model's own hooks, which therefore have already renamed and fused
its keys), that replaces the parameter's value by this rank's rows in the
engine's layout (``mf_dtensor.uneven_local_piece``: a view for the engine's
own tensors, a local cut of a full plain tensor, a gather for any other
DTensor). ``copy_`` then copies rows into rows. A post-hook on the wrapped
module installs the loaded weights into the compute buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from mf_dtensor import UnevenDTensor, uneven_local_piece
from mf_fsdp.buckets.extension import in_layout_of

if TYPE_CHECKING:
    from mf_fsdp.buckets.param import FSDPParam

__all__ = ["register_load_hooks"]


def _in_engine_layout(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (the parameter's global shape, any layout) laid out like ``target``."""
    with torch.no_grad():
        if isinstance(target, DTensor) and not isinstance(target, UnevenDTensor):
            return in_layout_of(value, target)  # an extension parameter's torch.chunk pieces
        if not isinstance(target, UnevenDTensor):
            return value.full_tensor() if isinstance(value, DTensor) else value
        if isinstance(value, UnevenDTensor) and value.pieces == target.pieces:
            return value
        return UnevenDTensor.from_local(
            uneven_local_piece(value, target),
            target.device_mesh,
            target.placements,
            shape=target.shape,
            pieces=target.pieces,
        )


def _to_engine_layout(
    params: Mapping[str, FSDPParam],
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Mapping[str, Any],
    *unused: Any,
) -> None:
    """Load pre-hook of a module holding managed parameters (see the module note)."""
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(
            f"load_state_dict: assign=True would replace the parameters of {prefix or 'the model'}"
            " that mf-fsdp manages with new tensors; expected assign=False (values are "
            "copied into the engine's buffers)"
        )
    for attr, fp in params.items():
        key = prefix + attr
        value = state_dict.get(key)
        # Anything else (no value, another shape, not a tensor) is nn.Module's to report.
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(fp.sharded.shape):
            state_dict[key] = _in_engine_layout(fp.sharded, value)


def register_load_hooks(
    module: nn.Module,
    fsdp_params: list[FSDPParam],
    install: Callable[[], Callable[[], object] | None],
) -> list[RemovableHandle]:
    """Make ``module.load_state_dict`` load into the engine (see the module note).

    ``install`` gives the engine's ``install_optimized_model_weights``, or None once
    the engine is gone (a ``weakref.WeakMethod``: the module must not keep its
    wrapper alive).

    Returns:
        The hooks' handles.
    """
    owned: dict[nn.Module, dict[str, FSDPParam]] = {}
    for fp in fsdp_params:
        for owner, attr in fp.slots:
            owned.setdefault(owner, {})[attr] = fp
    handles = [
        owner.register_load_state_dict_pre_hook(functools.partial(_to_engine_layout, params))
        for owner, params in owned.items()
    ]

    def installed(module: nn.Module, incompatible_keys: Any) -> None:
        method = install()
        if method is not None:
            method()

    handles.append(module.register_load_state_dict_post_hook(installed))
    return handles
