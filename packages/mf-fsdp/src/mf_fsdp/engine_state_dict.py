"""``MegatronFSDP.state_dict()`` / ``load_state_dict()``: the engine's native state dict.

The native form is the optimizer's own tensors keyed by the wrapped module's
names (1-D uneven DTensors when sharded, full-shaped tensors under ZeRO-0)
plus the module's buffers: what ``dcp.save`` / ``dcp.load`` read and write in
the same layout. Loading also accepts full tensors (each rank copies its
piece). The strategy-independent checkpoint form that reshards across
strategies and world sizes lives in ``state_dict.py``, not here. Nothing here
communicates except ``install_optimized_model_weights`` after a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor

from mf_dtensor import attach_chunk_metadata

if TYPE_CHECKING:
    from mf_fsdp.megatron_fsdp import MegatronFSDP

__all__ = ["engine_state_dict", "load_engine_state_dict"]


def engine_state_dict(model: MegatronFSDP, prefix: str, keep_vars: bool) -> dict[str, Any]:
    """Optimizer parameters and module buffers of ``model``, keyed ``prefix + name``.

    With ``model.preproc_state_dict_for_dcp_ckpt`` each DTensor carries its true
    DCP chunk offset (``local_offset``), not DTensor's even-chunk guess.
    """
    out: dict[str, Any] = {}
    for name, opt in model.optimizer_named_parameters():
        value = opt if keep_vars else opt.detach()
        if model.preproc_state_dict_for_dcp_ckpt and isinstance(value, DTensor):
            start = torch.Size([opt.local_offset])  # type: ignore[attr-defined]
            attach_chunk_metadata(value, ChunkStorageMetadata(start, value.to_local().shape))
        out[prefix + name] = value
    for name, buf in model.module.named_buffers():
        out[prefix + name] = buf if keep_vars else buf.detach()
    return out


def load_engine_state_dict(
    model: MegatronFSDP, state_dict: Mapping[str, Any], strict: bool
) -> None:
    """Copy ``state_dict`` (native or full tensors) into ``model``, then install the weights.

    Raises:
        ValueError: for a missing/unexpected key (strict) or a shape mismatch.
    """
    expected = dict(model.optimizer_named_parameters())
    buffers = dict(model.module.named_buffers())
    missing = [k for k in (*expected, *buffers) if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected and k not in buffers]
    if strict and (missing or unexpected):
        raise ValueError(
            f"state_dict: missing keys {missing!r}, unexpected keys {unexpected!r}; "
            "expected the keys of MegatronFSDP.state_dict()"
        )
    with torch.no_grad():
        for name, opt in expected.items():
            if name in state_dict:
                _load_into(name, opt, state_dict[name])
        for name, buf in buffers.items():
            if name in state_dict:
                buf.copy_(state_dict[name])
    model.install_optimized_model_weights()


def _load_into(name: str, opt: nn.Parameter, value: Any) -> None:
    """Copy ``value`` into optimizer parameter ``opt``: a shard like it, or a full tensor."""
    target = opt.to_local() if isinstance(opt, DTensor) else opt.data
    sharded = isinstance(value, DTensor)
    if sharded or not isinstance(opt, DTensor):
        # Same form on both sides: a shard into the same sharding, or full into full (ZeRO-0).
        source = value.to_local() if sharded else value
        if source.shape != target.shape:
            raise ValueError(
                f"state_dict[{name!r}]: {'local shard' if sharded else 'tensor'} of shape "
                f"{tuple(source.shape)} does not match this rank's {tuple(target.shape)}; "
                "expected the same sharding and shape"
            )
        target.copy_(source)
        return
    shape = getattr(opt, "orig_shape", opt.shape)
    if value.numel() != opt.numel() or (value.dim() > 1 and value.shape != shape):
        raise ValueError(
            f"state_dict[{name!r}]: shape {tuple(value.shape)} does not match the parameter's "
            f"{tuple(shape)}"
        )
    start = opt.local_offset  # type: ignore[attr-defined]
    target.copy_(value.reshape(-1)[start : start + target.numel()])
