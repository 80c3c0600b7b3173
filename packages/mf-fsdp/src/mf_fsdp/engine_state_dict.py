"""``MegatronFSDP.load_state_dict``: load parameters from any layout into the engine's rows.

``MegatronFSDP.state_dict()`` is the wrapped module's own state dict taken
while the sharded forms are registered (see [Note: parameter forms] in
``param.py``), so it needs no code here. Loading cannot be left to
``nn.Module``: its ``param.copy_(value)`` would pair this rank's rows with
whatever piece ``value`` holds locally, which for another layout is wrong and
for DTensors of the same placements can even broadcast silently. Here every
parameter value is cut to this rank's rows by ``mf_dtensor.uneven_local_piece``
(a view of itself for the engine's own tensors, a local cut of a full plain
tensor, a gather for any other DTensor); buffers and extra state go through
the module's own loader. Collective when a value is a DTensor of another
layout; installs the weights at the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from mf_dtensor import UnevenDTensor, uneven_local_piece

if TYPE_CHECKING:
    from mf_fsdp.megatron_fsdp import MegatronFSDP
    from mf_fsdp.param import FSDPParam

__all__ = ["load_engine_state_dict", "load_param_value"]


def load_param_value(fp: FSDPParam, name: str, value: Any) -> None:
    """Copy ``value`` (any layout of the parameter's global shape) into ``fp``'s sharded form.

    Raises:
        RuntimeError: if ``value`` is not a tensor of the parameter's global shape.
    """
    target = fp.sharded
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeError(
            f"state_dict[{name!r}]: got {got}, expected a tensor of the parameter's shape "
            f"{tuple(target.shape)}"
        )
    with torch.no_grad():
        if isinstance(target, UnevenDTensor):
            local = uneven_local_piece(value, target)
            target.to_local().copy_(local)
        else:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            target.copy_(full)


def load_engine_state_dict(
    model: MegatronFSDP, state_dict: Mapping[str, Any], strict: bool
) -> _IncompatibleKeys:
    """Load ``state_dict`` into ``model`` (sharded forms registered), then install the weights.

    Raises:
        RuntimeError: for missing/unexpected keys (``strict``) or a shape mismatch.
    """
    by_name = {name: fp for fp in model.fsdp_params for name in fp.fqns}
    expected = list(model.module.state_dict(keep_vars=True))
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in set(expected)]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model.module).__name__}: missing keys "
            f"{missing!r}, unexpected keys {unexpected!r}; expected the keys of "
            "model.state_dict()"
        )
    for name, value in state_dict.items():
        fp = by_name.get(name)
        if fp is not None:
            load_param_value(fp, name, value)
    rest = {k: v for k, v in state_dict.items() if k not in by_name and k not in unexpected}
    model.module.load_state_dict(rest, strict=False)
    model.install_optimized_model_weights()
    return _IncompatibleKeys(missing, unexpected)
