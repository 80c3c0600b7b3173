"""DSD's ``broadcast_from_rank0`` loads into uneven DTensors: each rank keeps its own rows.

[Note: loading a broadcast from rank 0]
``set_model_state_dict`` and ``set_optimizer_state_dict`` of torch's DSD, with
``full_state_dict=True, broadcast_from_rank0=True`` (how accelerate, and so the
Hugging Face Trainer, resumes a ``FULL_STATE_DICT`` checkpoint on several
processes), read the full state dict on rank 0 only and broadcast it one tensor
at a time: every rank then holds the whole tensor. torch's private
``torch.distributed._state_dict_utils._distribute_tensors`` keeps this rank's
piece of it: for a DTensor target it computes the piece from the placements
(``torch.chunk`` rows) and copies it into the target's ``to_local()``. That
runs before any module or optimizer hook, on the engine's own tensors (DSD
hands it the registered parameters and the optimizer's state), and nothing
about an ``UnevenDTensor`` can steer it: its placements say ``Shard(0)`` while
its rows are the bucket layout's (a ``[64, 64]`` weight may be 64 rows on rank
0 and none on rank 1). So the copy fails with a size mismatch, or, where this
rank's piece is a single row, silently repeats that row.

The first engine built therefore wraps that function, once per process (as the
optimizer step hooks are installed, not at import). The wrapper takes the
entries whose target is an ``UnevenDTensor`` on a real device and copies this
rank's own boxes of the whole tensor into the target's local piece: a local cut,
no communication beyond torch's broadcast, model and optimizer state alike.
Every other entry (plain DTensors, FSDP2's, a meta target) goes to torch's
function unchanged. A whole tensor whose shape is not the target's stops on
every rank (all of them received the same shape) with an error naming the key.
Should a torch release drop the function, nothing is wrapped and the load
fails as before: ``tests/fsdp/checkpoint/test_rank0_broadcast.py`` says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._state_dict_utils as torch_state_dict_utils

from mf_dtensor import UnevenDTensor, uneven_local_piece
from mf_fsdp.engine.megatron_fsdp import ENGINE_BUILT

__all__ = ["install_rank0_broadcast_load"]

_TORCH_NAME = "_distribute_tensors"
_WRAPPED_ATTR = "_mf_fsdp_keeps_uneven_rows"


def _keep_own_rows(local_state_dict: dict[str, Any], key: str) -> bool:
    """Fill an ``UnevenDTensor`` entry with this rank's boxes of the broadcast tensor.

    Returns:
        Whether the entry was one (it then holds the target itself, as torch's
        function leaves a filled target).

    Raises:
        RuntimeError: if the broadcast tensor's shape is not the target's.
    """
    entry = local_state_dict.get(key)
    if not isinstance(entry, tuple) or not isinstance(entry[0], UnevenDTensor):
        return False
    target, whole = entry
    if target.is_meta:
        return False
    if tuple(whole.shape) != tuple(target.shape):
        raise RuntimeError(
            f"broadcast_from_rank0: size mismatch for {key}: the state dict's tensor has shape "
            f"{tuple(whole.shape)}, expected {tuple(target.shape)} (the shape in the current "
            "model or optimizer)"
        )
    with torch.no_grad():
        target.to_local().copy_(uneven_local_piece(whole, target))
    local_state_dict[key] = target
    return True


def _keeping_uneven_rows(torch_distribute: Callable[..., None]) -> Callable[..., None]:
    """Wrap torch's ``_distribute_tensors``: ``UnevenDTensor`` targets get their own rows."""

    @functools.wraps(torch_distribute)
    def distribute(
        local_state_dict: dict[str, Any], keys: list[str], *args: Any, **kwargs: Any
    ) -> None:
        rest = [key for key in keys if not _keep_own_rows(local_state_dict, key)]
        if rest:
            torch_distribute(local_state_dict, rest, *args, **kwargs)

    setattr(distribute, _WRAPPED_ATTR, True)
    return distribute


def install_rank0_broadcast_load() -> None:
    """Wrap DSD's piece-keeping step, once per process (see the module note).

    Building an engine calls it (``ENGINE_BUILT``); importing mf_fsdp does not.
    """
    torch_distribute = getattr(torch_state_dict_utils, _TORCH_NAME, None)
    if torch_distribute is None or getattr(torch_distribute, _WRAPPED_ATTR, False):
        return
    setattr(torch_state_dict_utils, _TORCH_NAME, _keeping_uneven_rows(torch_distribute))


ENGINE_BUILT.append(install_rank0_broadcast_load)
