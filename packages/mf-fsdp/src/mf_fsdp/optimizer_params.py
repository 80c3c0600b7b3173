"""The parameters the optimizer steps on, built once over the engine's buffers.

For each model parameter the optimizer gets:

- ZeRO-1/2/3: a 1-D uneven DTensor of global shape ``(numel,)`` over the data-
  parallel mesh (``FSDPDistributedIndex.dp_mesh()``) whose local tensor is a
  view of this rank's piece of the bucket's main weights, with
  ``local_offset`` (its start in the flat parameter) and a gradient DTensor
  over the same piece of the reduced grad store;
- ZeRO-0: the model's own parameter, or, when the main weights are a
  separate buffer or the parameter is a DTensor (TP), a plain view of the
  main weights with a view of the grad store.

Every one carries ``orig_shape`` (the TP-local shape) and the TP facts of
``annotate_optimizer_param``. The model parameters are marked as managed
(``MANAGED_ATTR``, for the unwrapped-optimizer guard) and point back to their
engine (``OWNER_ATTR``, read by ``owner_of``). Views only: nothing is copied
or communicated here.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from mf_dtensor import uneven_dtensor_from_local
from mf_fsdp.config import ZeroDPStrategy
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.param_group import ParamGroup
from mf_fsdp.tp_params import annotate_optimizer_param, local_shape

if TYPE_CHECKING:
    from mf_fsdp.megatron_fsdp import MegatronFSDP

__all__ = ["MANAGED_ATTR", "OWNER_ATTR", "build_optimizer_params", "owner_of"]

MANAGED_ATTR = "_mf_fsdp_managed"
"""Set on model parameters whose values the optimizer must not step directly."""


OWNER_ATTR = "_mf_fsdp_owner"
"""Weak reference from a model parameter to the engine managing it."""


def owner_of(param: nn.Parameter) -> MegatronFSDP | None:
    """The engine managing model parameter ``param``, or None."""
    ref = getattr(param, OWNER_ATTR, None)
    return None if ref is None else ref()


def build_optimizer_params(
    owner: MegatronFSDP,
    groups: list[ParamGroup],
    strategy: ZeroDPStrategy,
    dist_index: FSDPDistributedIndex,
) -> tuple[dict[nn.Parameter, nn.Parameter], list[tuple[nn.Parameter, torch.Tensor]]]:
    """Create the optimizer parameters of every bucket and their gradient views.

    Args:
        owner: the engine; model parameters keep a weak reference to it.
        groups: the engine's buckets, in order.
        strategy: the ZeRO strategy inside dp_shard.
        dist_index: meshes (the optimizer DTensors live on ``dist_index.dp_mesh()``).

    Returns:
        ``(optimizer parameter by model parameter, [(optimizer parameter, its grad)])``;
        a ZeRO-0 parameter that is its own optimizer parameter has no grad pair (its
        ``.grad`` is attached by its bucket).
    """
    opt_params: dict[nn.Parameter, nn.Parameter] = {}
    grad_pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
    mesh = dist_index.dp_mesh()
    placements = [Shard(0)] * mesh.ndim
    if dist_index.dp_outer_dim and not dist_index.hsdp_outer_dp_shard:
        placements = [Replicate(), Shard(0)]
    owner_ref = weakref.ref(owner)
    for group in groups:
        for index, param in enumerate(group.params):
            if strategy.level == 0:
                # The model's own parameter, unless it is a DTensor (TP): then a
                # plain view of its local values, as the optimizer contract says.
                if not group.main_is_separate and not isinstance(param, DTensor):
                    setattr(param, OWNER_ATTR, owner_ref)
                    annotate_optimizer_param(param, param, dist_index)
                    opt_params[param] = param
                    continue
                start, end, shape = group.param_range(index)
                opt = nn.Parameter(group.main[start:end].view(shape), param.requires_grad)
                grad = group.grad_store[start:end].view(shape) if group.requires_grad else None
            else:
                numel = local_shape(param).numel()
                local, offset = group.local_main_piece(index, group.main)
                opt = nn.Parameter(
                    _flat_shard(local, mesh, placements, numel, offset), param.requires_grad
                )
                grad = None
                if group.requires_grad:
                    glocal, _ = group.local_main_piece(index, group.grad_store)
                    grad = _flat_shard(glocal, mesh, placements, numel, offset)
                opt.local_offset = offset  # type: ignore[attr-defined]
            opt.orig_shape = local_shape(param)  # type: ignore[attr-defined]
            annotate_optimizer_param(opt, param, dist_index)
            setattr(param, MANAGED_ATTR, True)
            setattr(param, OWNER_ATTR, owner_ref)
            opt_params[param] = opt
            if grad is not None:
                grad_pairs.append((opt, grad))
    return opt_params, grad_pairs


def _flat_shard(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: list[Placement],
    numel: int,
    offset: int,
) -> DTensor:
    """``local`` as the piece at ``offset`` of a 1-D uneven DTensor of ``numel`` elements."""
    return uneven_dtensor_from_local(
        local, mesh, placements, global_shape=(numel,), global_offset=(offset,), validate=False
    )
