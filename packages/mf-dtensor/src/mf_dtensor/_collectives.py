"""The one collective mf_dtensor needs: an all-gather over several dims of a DeviceMesh.

Gathering over a set of mesh dims is done one mesh dim at a time (innermost
first), each step an ``all_gather_into_tensor`` of equal-sized buffers on the
group's own device, so it works on gloo as well as nccl and never needs a
flattened process group. Callers pad uneven data to a common size first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mf_utils import get_group_device

__all__ = ["all_gather_over_mesh_dims"]


def all_gather_over_mesh_dims(
    tensor: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]
) -> torch.Tensor:
    """All-gather ``tensor`` (same shape on every rank) over ``mesh_dims`` of ``mesh``.

    Args:
        tensor: this rank's contribution; every rank passes the same shape and dtype.
        mesh: the device mesh.
        mesh_dims: mesh dims to gather over, in increasing order; ranks that
            differ in other mesh dims are not exchanged with.

    Returns:
        A tensor of shape ``[prod(sizes of mesh_dims), *tensor.shape]`` on the
        group device, indexed in row-major order of the coordinates on
        ``mesh_dims``. With no mesh dims, ``tensor.unsqueeze(0)``.
    """
    result = tensor.unsqueeze(0)
    for mesh_dim in reversed(mesh_dims):
        group = mesh.get_group(mesh_dim)
        group_size = dist.get_world_size(group)
        device = get_group_device(group)
        source = result.to(device).contiguous()
        gathered = source.new_empty((group_size * math.prod(source.shape),))
        dist.all_gather_into_tensor(gathered, source.reshape(-1), group=group)
        result = gathered.view(group_size * source.shape[0], *source.shape[1:])
    return result
