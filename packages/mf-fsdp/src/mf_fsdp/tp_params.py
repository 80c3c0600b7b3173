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
``sequence_parallel=True`` only sees its rank's rows; ``ParamGroup`` sums
those grads over the tp group before the dp reduction.

This module also writes the TP facts a checkpoint needs onto each optimizer
parameter (``annotate_optimizer_param``). It must not communicate.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_utils import get_mcore_tensor_parallel_partition_dim

__all__ = [
    "annotate_optimizer_param",
    "local_shape",
    "local_value",
    "set_local_data",
    "validate_tp_params",
    "wrap_grad",
]


def local_value(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: the local tensor of a DTensor, else itself (detached)."""
    if isinstance(param, DTensor):
        return param._local_tensor.detach()
    return param.detach()


def local_shape(param: torch.Tensor) -> torch.Size:
    """Shape of this rank's part of ``param`` (the TP-local shape of a DTensor)."""
    return param._local_tensor.shape if isinstance(param, DTensor) else param.shape


def set_local_data(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param``'s values (its local tensor, for a DTensor) a view of an engine buffer."""
    if isinstance(param, DTensor):
        # The Parameter object (placements, mesh, global shape) stays what the module
        # holds. ``.data`` updates the wrapper's dtype (bf16 compute buffers) but keeps
        # the old local tensor, so the local tensor is swapped as well (as FSDP2 does).
        param.data = wrap_grad(param, view)
        param._local_tensor = view
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
    named_params: Iterable[tuple[str, nn.Parameter]], index: FSDPDistributedIndex, meta_init: bool
) -> None:
    """Refuse TP parameters the engine cannot shard along dp only.

    Raises:
        ValueError: for a sequence-parallel parameter without a ``tp_dim``, and for a
            DTensor parameter without a ``tp_dim``, with more than one
            placement, with a placement other than ``Shard``/``Replicate``, on a mesh
            other than the tp sub-mesh, or on the meta device with
            ``init_model_with_meta_device``.
    """
    tp_ranks = None
    if index.tp_dim is not None:
        tp_ranks = index.get_submesh(index.tp_dim).mesh.flatten().tolist()
    for name, param in named_params:
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


def annotate_optimizer_param(
    opt: torch.Tensor, param: nn.Parameter, index: FSDPDistributedIndex
) -> None:
    """Attach the TP facts that reassemble ``param``'s full tensor onto its optimizer param.

    Attributes (set only for a DTensor parameter or when the engine has a tp dim):
    ``tp_mesh`` (the 1-D tp DeviceMesh), ``tp_size``, ``tp_rank``,
    ``tp_partition_dim`` (``-1``: duplicated on every TP rank), ``tp_partition_stride``,
    ``tp_global_shape`` (the full tensor's shape) and, for DTensor parameters,
    ``tp_placements``. ``opt.orig_shape`` stays the TP-local shape.
    """
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        placement = param.placements[0]
        dim = placement.dim % param.dim() if isinstance(placement, Shard) else -1
        stride = 1
        global_shape = tuple(param.shape)
        opt.tp_placements = tuple(param.placements)  # type: ignore[attr-defined]
    elif index.tp_dim is not None:
        mesh = index.get_submesh(index.tp_dim)
        found = get_mcore_tensor_parallel_partition_dim(param)
        dim = -1 if found is None else found % max(param.dim(), 1)
        stride = int(getattr(param, "partition_stride", 1)) if dim >= 0 else 1
        global_shape = tuple(n * mesh.size() if d == dim else n for d, n in enumerate(param.shape))
    else:
        return
    opt.tp_mesh = mesh  # type: ignore[attr-defined]
    opt.tp_size = mesh.size()  # type: ignore[attr-defined]
    opt.tp_rank = mesh.get_local_rank()  # type: ignore[attr-defined]
    opt.tp_partition_dim = dim  # type: ignore[attr-defined]
    opt.tp_partition_stride = stride  # type: ignore[attr-defined]
    opt.tp_global_shape = global_shape  # type: ignore[attr-defined]
