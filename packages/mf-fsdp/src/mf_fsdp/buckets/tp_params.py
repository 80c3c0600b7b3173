"""Tensor-parallel parameters inside the engine: DTensor params and the mf-tp attribute protocol.

FSDP shards only along the data-parallel dims; what a TP rank holds of a
parameter is, to the engine, just its local tensor:

- a DTensor parameter (torch's ``parallelize_module``) on the tp sub-mesh with
  one placement (``Shard(d)`` or ``Replicate()``): its flat buffers hold
  ``to_local()`` (shapes always come from the local tensor, never the global
  one: the rowwise shape bugs NVIDIA/Megatron-LM#5786/#5787), and the module
  keeps seeing a DTensor whose ``_local_tensor`` is a view of the gathered
  buffer and whose ``.grad`` is a DTensor over a view of the grad buffer, so
  autograd accumulates straight into the engine's buffer;
- a plain parameter marked by mf-tp (``tensor_model_parallel``,
  ``partition_dim``, ``partition_stride`` from ``mf_utils``): a plain local
  tensor, recognised by its attributes; mf-fsdp never imports mf-tp;
- a DTensor over a whole SPMD storage mesh (torchtitan's ``full_dtensor``
  backend, torch 2.15's ``dp_mesh_dims``): ``DP_DIMS_ATTR`` names its mesh dims
  that are data-parallel. They are ``Replicate()`` in the compute form and the
  engine reduces over them itself, so a gradient keeps what it has there (a
  ``Partial()`` sum) and only its other dims, the tp dim, are redistributed
  to the parameter's placements (the tp sum of a ``Replicate()`` weight's
  ``Partial()`` gradient included), as FSDP2 does.

Gradients of TP-duplicated parameters (LayerNorm weights, a row-parallel
bias, ``Replicate()`` DTensors) are equal on every TP rank when every TP rank
sees the same data, so reducing over the dp group alone keeps them equal.
Under sequence parallelism a duplicated parameter marked
``sequence_parallel=True`` only sees its rank's rows; ``Bucket`` sums
those grads over the tp group before the dp reduction.

This module also reads the TP facts the optimizer's parameter-shaped DTensors
need (``tp_info``: tp mesh, rank, partition dim, stride). It must not communicate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_utils import get_mcore_tensor_parallel_partition_dim

__all__ = [
    "DP_DIMS_ATTR",
    "TPInfo",
    "dp_partial_grad",
    "local_shape",
    "local_value",
    "set_local_data",
    "tp_info",
    "tp_layout",
    "validate_tp_params",
    "wrap_grad",
]


DP_DIMS_ATTR = "_mf_fsdp_dp_mesh_dims"
"""On a DTensor parameter over a whole storage mesh: the indices of its mesh dims that are
data-parallel (a frozenset), left out of every redistribution (see the module docstring)."""


def dp_dims(param: torch.Tensor) -> frozenset[int]:
    """The data-parallel dims of a storage-mesh DTensor ``param``'s mesh; empty for others."""
    return getattr(param, DP_DIMS_ATTR, frozenset())


def dp_partial_grad(param: DTensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A grad hook for a storage-mesh DTensor ``param``: the grad as the engine takes it.

    Its other dims are redistributed to the parameter's placements (a
    ``Replicate()`` weight's ``Partial()`` tp grad is summed over tp here, as
    FSDP2 does), and its local tensor is then this rank's part on the
    data-parallel dims whatever the grad says there (``Partial()``, or
    ``Replicate()`` after a ``to_local()`` in the model), as FSDP2 reads it: the
    result is ``Partial()`` there, so accumulating it into the ``Partial()`` grad
    view (``wrap_grad``) adds local tensors, and the engine does the reduction.
    Registered once per parameter (``Tensor.register_hook``); it holds no
    reference to the parameter.
    """
    mesh, shape, stride, skip = param.device_mesh, param.shape, param.stride(), dp_dims(param)
    wanted = tuple(param.placements)
    partial = tuple(Partial() if i in skip else p for i, p in enumerate(wanted))

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor) or grad.placements == partial:
            return grad
        placements = tuple(grad.placements[i] if i in skip else p for i, p in enumerate(wanted))
        if grad.placements != placements:
            grad = grad.redistribute(mesh, placements)
        local = grad._local_tensor
        if isinstance(local, AsyncCollectiveTensor):
            local = local.wait()
        return DTensor.from_local(local, mesh, partial, run_check=False, shape=shape, stride=stride)

    return hook


def local_value(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: the local tensor of a DTensor, else itself (detached)."""
    if isinstance(param, DTensor):
        return param._local_tensor.detach()
    return param.detach()


def local_grad(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``grad``, laid out like ``param``.

    A DTensor grad is redistributed to the parameter's placements first, as
    accumulating it into ``param.grad`` would, except on a storage mesh's
    data-parallel dims, which keep the grad's own (the engine reduces them).
    """
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        placements = param.placements
        skip = dp_dims(param)
        if skip:
            placements = tuple(
                grad.placements[i] if i in skip else p for i, p in enumerate(placements)
            )
        if grad.placements != placements:
            grad = grad.redistribute(param.device_mesh, placements)
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    # A grad needs no detaching unless a double backward built a graph for it (an aten
    # op saved per parameter and step).
    return grad.detach() if grad.requires_grad else grad


def local_shape(param: torch.Tensor) -> torch.Size:
    """Shape of this rank's part of ``param`` (the TP-local shape of a DTensor)."""
    return param._local_tensor.shape if isinstance(param, DTensor) else param.shape


def set_local_data(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param``'s values (its local tensor, for a DTensor) a view of an engine buffer."""
    if isinstance(param, DTensor):
        # The Parameter object (placements, mesh, global shape) stays what the module
        # holds. ``.data`` updates the wrapper's dtype (bf16 compute buffers) but keeps
        # the old local tensor, so the local tensor is swapped as well (as FSDP2 does).
        # The local tensor aliases the buffer's storage with a version counter of its own,
        # as ``.data`` gives a plain parameter: gathering into the buffer again before the
        # backward (same values) must not invalidate what autograd saved of it, such as
        # a view of ``to_local()`` (mf-tp's grouped experts save their weights so).
        param.data = _wrapped(param, view, param.placements)
        param._local_tensor = view.new_empty(0).set_(
            view.untyped_storage(), view.storage_offset(), view.shape, view.stride()
        )
    else:
        param.data = view


def wrap_grad(param: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """``view`` laid out like ``param``: a DTensor with its placements for a DTensor param.

    Assigned to ``param.grad``, autograd accumulates straight into ``view``. On a
    storage mesh's data-parallel dims the grad is ``Partial()``: this rank's sum,
    which the engine reduces, so autograd adds the incoming ``Partial()`` grad
    without an all-reduce of its own.
    """
    if not isinstance(param, DTensor):
        return view
    placements = param.placements
    skip = dp_dims(param)
    if skip:
        placements = tuple(Partial() if i in skip else p for i, p in enumerate(placements))
    return _wrapped(param, view, placements)


def _wrapped(param: DTensor, view: torch.Tensor, placements: Sequence[Placement]) -> DTensor:
    return DTensor.from_local(
        view,
        param.device_mesh,
        placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def validate_tp_params(
    named_params: Iterable[tuple[str, nn.Parameter]],
    index_of: Callable[[nn.Parameter], FSDPDistributedIndex],
    meta_init: bool,
) -> None:
    """Refuse TP parameters the engine cannot shard along dp only.

    ``index_of`` gives the index a parameter lives on (the expert one for experts).

    Raises:
        ValueError: for a sequence-parallel parameter without a ``tp_dim``, and for a
            DTensor parameter without a ``tp_dim``, with more than one
            placement, with a placement other than ``Shard``/``Replicate``, on a mesh
            other than the tp sub-mesh, or on the meta device with
            ``init_model_with_meta_device``.
    """
    for name, param in named_params:
        index = index_of(param)
        tp_ranks = None
        tp_dims = () if index.tp_dim is None else (index.tp_dim, *index.extra_tp_dims)
        if tp_dims:
            tp_ranks = index.get_submesh(tp_dims).mesh.flatten().tolist()
        if getattr(param, "sequence_parallel", False) and tp_ranks is None:
            raise ValueError(
                f"tp_dim=None but parameter {name!r} is marked sequence_parallel=True (its "
                "grads must be summed over the TP group); expected tp_dim naming that mesh dim"
            )
        if not isinstance(param, DTensor):
            continue
        where = f"parameter {name!r} (DTensor, placements {tuple(param.placements)!r})"
        layout = tp_layout(param)
        if layout is not None:
            _check_tp_layout(where, param, layout, index, tp_dims, tp_ranks)
        if meta_init and param.is_meta:
            raise ValueError(
                f"init_model_with_meta_device: {where} is on the meta device; meta "
                "initialisation of DTensor parameters is not supported, expected real values"
            )


def tp_layout(param: DTensor) -> tuple[DeviceMesh, tuple[Placement, ...]] | None:
    """A DTensor parameter's tensor-parallel mesh and placements.

    Its own, less a storage mesh's data-parallel dims (``DP_DIMS_ATTR``); None
    when no other dim is left (a storage mesh of data-parallel dims only).
    """
    skip = dp_dims(param)
    if not skip:
        return param.device_mesh, tuple(param.placements)
    keep = [i for i in range(param.device_mesh.ndim) if i not in skip]
    if not keep:
        return None
    names = param.device_mesh.mesh_dim_names or ()
    mesh = param.device_mesh[tuple(names[i] for i in keep)]
    return mesh, tuple(param.placements[i] for i in keep)


def _check_tp_layout(
    where: str,
    param: DTensor,
    layout: tuple[DeviceMesh, tuple[Placement, ...]],
    index: FSDPDistributedIndex,
    tp_dims: tuple[str, ...],
    tp_ranks: list[int] | None,
) -> None:
    """Refuse a tensor-parallel layout the engine cannot shard along dp only."""
    mesh, placements = layout
    if tp_ranks is None:
        raise ValueError(
            f"tp_dim=None but {where} is tensor-parallel; expected tp_dim naming the "
            "device_mesh dim its placements live on"
        )
    if len(placements) != len(tp_dims):
        raise ValueError(
            f"{where}: expected one placement per tp dim {tp_dims!r}, got {len(placements)}"
        )
    if not all(isinstance(p, (Shard, Replicate)) for p in placements):
        raise ValueError(f"{where}: expected a Shard(dim) or Replicate() placement per tp dim")
    later = [p.dim % param.dim() for p in placements[1:] if isinstance(p, Shard)]
    first = placements[0]
    if any(d == 0 or (isinstance(first, Shard) and d == first.dim % param.dim()) for d in later):
        raise ValueError(
            f"{where}: a second tp dim may split only a dim other than 0 and the first's"
        )
    ranks = mesh.mesh.flatten().tolist()
    if ranks != tp_ranks:
        raise ValueError(
            f"{where}: lives on a mesh over ranks {ranks!r} but the tp dim "
            f"{index.tp_dim!r} of device_mesh covers {tp_ranks!r} here; expected "
            "parallelize_module on device_mesh[tp_dim]"
        )


@dataclass(frozen=True, slots=True)
class TPInfo:
    """How a parameter is split over the tensor-parallel group.

    Attributes:
        mesh: the tp DeviceMesh (2-D for a split over two tp dims).
        size: number of tp ranks of the first tp mesh dim.
        rank: this process's rank on it.
        dim: the partition dim, or None for a parameter duplicated on every tp rank.
        stride: interleaved blocks per tp rank along ``dim`` (mf-tp's fused QKV: 3).
        trailing: ``(dim, size)`` of each further tp mesh dim's split, along a dim other
            than 0 and ``dim`` (expert tensor parallelism: grouped experts split over
            ``(ep, etp)``, ``Shard(0)`` then ``Shard(1)`` or ``Shard(2)``).
    """

    mesh: DeviceMesh
    size: int
    rank: int
    dim: int | None
    stride: int = 1
    trailing: tuple[tuple[int, int], ...] = ()

    def global_shape(self, local: Sequence[int]) -> torch.Size:
        """The full (tp-gathered) shape of a parameter whose tp-local shape is ``local``."""
        full = list(local)
        if self.dim is not None:
            full[self.dim] *= self.size
        for dim, size in self.trailing:
            full[dim] *= size
        return torch.Size(full)


def tp_info(name: str, param: nn.Parameter, index: FSDPDistributedIndex) -> TPInfo | None:
    """The tensor-parallel facts of ``param``, or None when the engine sees no tp split.

    A DTensor parameter brings its own tp mesh and placement; a plain parameter
    is read through the mf_utils attribute protocol when the engine has a tp dim.

    Raises:
        ValueError: for a split the engine cannot describe as parameter-shaped pieces:
            a DTensor ``Shard`` dim not divisible by the tp size, an interleaving stride
            on a dim other than 0, or a stride that does not divide the local rows.
    """
    trailing: list[tuple[int, int]] = []
    if isinstance(param, DTensor):
        layout = tp_layout(param)
        if layout is None:  # a storage mesh of data-parallel dims only: no tp split
            return None
        mesh, placements = layout
        splits = []
        for mesh_dim, placement in enumerate(placements):
            dim = placement.dim % param.dim() if isinstance(placement, Shard) else None
            size = mesh.size(mesh_dim)
            if dim is not None and param.shape[dim] % size:
                raise ValueError(
                    f"parameter {name!r}: DTensor of shape {tuple(param.shape)} is split "
                    f"unevenly over {size} tp ranks along dim {dim}; expected a dim divisible "
                    "by the tp size"
                )
            splits.append((dim, size))
        dim, stride = splits[0][0], 1
        trailing = [(d, size) for d, size in splits[1:] if d is not None]
    elif index.tp_dim is not None:
        mesh = index.get_submesh(index.tp_dim)
        found = get_mcore_tensor_parallel_partition_dim(param)
        dim = None if found is None else found % max(param.dim(), 1)
        stride = int(getattr(param, "partition_stride", 1)) if dim is not None else 1
    else:
        return None
    shape = local_shape(param)
    if stride != 1 and (dim != 0 or shape[0] % stride):
        raise ValueError(
            f"parameter {name!r}: partition_stride={stride} along dim {dim} with local shape "
            f"{tuple(shape)}; expected the stride on dim 0, dividing its rows"
        )
    size, rank = mesh.size(0), mesh.get_local_rank(0)  # the first tp mesh dim's
    return TPInfo(mesh, size, rank, dim, stride, tuple(trailing))
