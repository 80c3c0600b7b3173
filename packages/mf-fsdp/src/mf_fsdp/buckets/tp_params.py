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
  tensor, recognised by its attributes; mf-fsdp never imports mf-tp.

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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_utils import get_mcore_tensor_parallel_partition_dim

__all__ = [
    "TPInfo",
    "local_shape",
    "local_value",
    "set_local_data",
    "tp_info",
    "validate_tp_params",
    "wrap_grad",
]


def local_value(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: the local tensor of a DTensor, else itself (detached)."""
    if isinstance(param, DTensor):
        return param._local_tensor.detach()
    return param.detach()


def local_grad(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``grad``, laid out like ``param``.

    A DTensor grad is redistributed to the parameter's placements first, as
    accumulating it into ``param.grad`` would.
    """
    if (
        isinstance(grad, DTensor)
        and isinstance(param, DTensor)
        and grad.placements != param.placements
    ):
        grad = grad.redistribute(param.device_mesh, param.placements)
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
        param.data = wrap_grad(param, view)
        param._local_tensor = view.new_empty(0).set_(
            view.untyped_storage(), view.storage_offset(), view.shape, view.stride()
        )
    else:
        param.data = view


def wrap_grad(param: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """``view`` laid out like ``param``: a DTensor with its placements for a DTensor param.

    Assigned to ``param.grad``, autograd accumulates straight into ``view``.
    """
    if not isinstance(param, DTensor):
        return view
    return DTensor.from_local(
        view,
        param.device_mesh,
        param.placements,
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
        if index.tp_dim is not None:
            tp_ranks = index.get_submesh(index.tp_dim).mesh.flatten().tolist()
        if getattr(param, "sequence_parallel", False) and tp_ranks is None:
            raise ValueError(
                f"tp_dim=None but parameter {name!r} is marked sequence_parallel=True (its "
                "grads must be summed over the TP group); expected tp_dim naming that mesh dim"
            )
        if not isinstance(param, DTensor):
            continue
        where = f"parameter {name!r} (DTensor, placements {tuple(param.placements)!r})"
        if tp_ranks is None:
            raise ValueError(
                f"tp_dim=None but {where} is tensor-parallel; expected tp_dim naming the "
                "device_mesh dim its placements live on"
            )
        if len(param.placements) != 1:
            raise ValueError(
                f"{where}: expected one placement on the 1-D tp sub-mesh, got "
                f"{len(param.placements)}"
            )
        if not isinstance(param.placements[0], (Shard, Replicate)):
            raise ValueError(f"{where}: expected a Shard(dim) or Replicate() placement")
        ranks = param.device_mesh.mesh.flatten().tolist()
        if ranks != tp_ranks:
            raise ValueError(
                f"{where}: lives on a mesh over ranks {ranks!r} but the tp dim "
                f"{index.tp_dim!r} of device_mesh covers {tp_ranks!r} here; expected "
                "parallelize_module on device_mesh[tp_dim]"
            )
        if meta_init and param.is_meta:
            raise ValueError(
                f"init_model_with_meta_device: {where} is on the meta device; meta "
                "initialisation of DTensor parameters is not supported, expected real values"
            )


@dataclass(frozen=True, slots=True)
class TPInfo:
    """How a parameter is split over the tensor-parallel group.

    Attributes:
        mesh: the 1-D tp DeviceMesh.
        size: number of tp ranks.
        rank: this process's tp rank.
        dim: the partition dim, or None for a parameter duplicated on every tp rank.
        stride: interleaved blocks per tp rank along ``dim`` (mf-tp's fused QKV: 3).
    """

    mesh: DeviceMesh
    size: int
    rank: int
    dim: int | None
    stride: int = 1

    def global_shape(self, local: Sequence[int]) -> torch.Size:
        """The full (tp-gathered) shape of a parameter whose tp-local shape is ``local``."""
        full = list(local)
        if self.dim is not None:
            full[self.dim] *= self.size
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
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        placement = param.placements[0]
        dim = placement.dim % param.dim() if isinstance(placement, Shard) else None
        stride = 1
        if dim is not None and param.shape[dim] % mesh.size():
            raise ValueError(
                f"parameter {name!r}: DTensor of shape {tuple(param.shape)} is split unevenly "
                f"over {mesh.size()} tp ranks along dim {dim}; expected a dim divisible by "
                "the tp size"
            )
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
    return TPInfo(mesh, mesh.size(), mesh.get_local_rank(), dim, stride)
