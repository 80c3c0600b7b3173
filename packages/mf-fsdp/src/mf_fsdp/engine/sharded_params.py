"""The sharded parameters the optimizer steps on, built once over the engine's buffers.

For each managed parameter (see [Note: parameter forms] in ``buckets/param.py``):

- ZeRO-1/2/3, or any strategy for a tensor-parallel parameter: an
  ``mf_dtensor.UnevenDTensor`` of the parameter's global shape whose local
  piece is a view of this rank's whole rows of the bucket's main weights, on
  the data-parallel mesh (``FSDPDistributedIndex.dp_mesh()``; plus the tp dim,
  ``dp_tp_mesh()``, for a TP parameter), and a gradient of the same kind over
  the reduced grad store;
- ZeRO-0 without TP: the compute parameter itself, or a plain full-shaped
  view of the main weights when they are a separate (mixed-precision) buffer;
- a parameter that implements FSDP2's all-gather extension: a DTensor of
  ``torch.chunk`` pieces whose local tensor is the subclass shard itself, as
  FSDP2 builds it (see [Note: the all-gather extension] in
  ``buckets/extension.py``).

Placements say which mesh dims split the parameter: ``Shard(0)`` on
``dp_shard`` (and on ``dp_outer`` when hybrid-sharded; ``Shard(1)`` for a
weight whose rows run along a later dim, ``FSDPParam.row_dim``), ``Replicate()`` on
``dp_outer`` under HSDP and on every dp dim under ZeRO-0, ``Shard(d)`` /
``Replicate()`` on tp. The pieces themselves are whole rows of the bucket
layout, not ``torch.chunk`` pieces; ``UnevenDTensor`` keeps DTensor's
collectives right for them. Compute parameters are marked as managed
(``MANAGED_ATTR``, for the unwrapped-optimizer guard) and sharded ones point
back to their engine (``OWNER_ATTR``). Views only: nothing is copied or
communicated here.
"""

from __future__ import annotations

import weakref
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor import UnevenDTensor
from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.extension import ExtensionWeights
from mf_fsdp.buckets.param import FSDPParam, ParamPieces
from mf_fsdp.config import ZeroDPStrategy
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_utils import is_expert_parallel_parameter, set_expert_parallel_attribute

__all__ = ["MANAGED_ATTR", "OWNER_ATTR", "SPREAD_ATTR", "build_sharded_params"]

MANAGED_ATTR = "_mf_fsdp_managed"
"""Set on compute parameters, whose values the optimizer must not step directly."""


OWNER_ATTR = "_mf_fsdp_owner"
"""Weak reference from a managed parameter (either form) to the engine managing it."""

SPREAD_ATTR = "_mf_fsdp_spread_over"
"""On an expert's sharded parameter: the expert-parallel groups across which ranks hold
other experts (a norm over all parameters sums across them as well)."""


def _dp_layout(
    index: FSDPDistributedIndex, strategy: ZeroDPStrategy
) -> tuple[list[Placement], tuple[int, ...]]:
    """Placements of the dp mesh dims, and the dims whose coordinate names the row owner."""
    mesh_ndim = index.dp_mesh().ndim
    if strategy.level == 0:
        return [Replicate()] * mesh_ndim, ()
    if index.hsdp_outer_dp_shard:  # (dp_shard, dp_outer), row-major = logical rank
        return [Shard(0), Shard(0)], (0, 1)
    if index.dp_outer_dim is not None:  # (dp_outer, dp_shard): replicas across dp_outer
        return [Replicate(), Shard(0)], (1,)
    return [Shard(0)], (0,)


def build_sharded_params(owner: nn.Module, groups: list[Bucket], strategy: ZeroDPStrategy) -> None:
    """Create every managed parameter's sharded form and its gradient (``fp.sharded``/``fp.grad``).

    Each group's parameters live on its own index's meshes (``dp_mesh()``, and
    ``dp_tp_mesh()`` for TP parameters): the expert index for expert parameters.

    Args:
        owner: the engine; parameters keep a weak reference to it.
        groups: the engine's buckets, in order.
        strategy: the ZeRO strategy inside dp_shard.
    """
    owner_ref = weakref.ref(owner)
    for group in groups:
        index = group.dist_index
        dp_placements, member_dims = _dp_layout(index, strategy)
        with group.optimizer_grads_for_views() as grads:  # the store is not held
            for fp in group.fsdp_params:
                setattr(fp.compute, OWNER_ATTR, owner_ref)
                if strategy.level == 0 and fp.tp is None and not group.main_is_separate:
                    fp.sharded = fp.compute  # the model's own parameter; its bucket attaches grads
                    continue
                setattr(fp.compute, MANAGED_ATTR, True)
                grad = None
                if grads is not None:
                    grad = group.main_view(fp, grads)
                values: torch.Tensor
                if isinstance(group.weights, ExtensionWeights):
                    values, grad = _chunked(group.weights, fp, index.dp_mesh(), dp_placements, grad)
                else:
                    values = group.main_view(fp, group.weights.main)
                    if strategy.level > 0 or fp.tp is not None:
                        mesh = index.dp_mesh() if fp.tp is None else index.dp_tp_mesh()
                        placements, pieces = _placements_and_pieces(
                            group, fp, tuple(mesh.shape), dp_placements, member_dims
                        )
                        shape = fp.global_shape
                        values = UnevenDTensor.from_local(
                            values, mesh, placements, shape=shape, pieces=pieces
                        )
                        if grad is not None:
                            grad = UnevenDTensor.from_local(
                                grad, mesh, placements, shape=shape, pieces=pieces
                            )
                fp.sharded = nn.Parameter(values, requires_grad=fp.compute.requires_grad)
                fp.grad = grad
                setattr(fp.sharded, OWNER_ATTR, owner_ref)
                if is_expert_parallel_parameter(fp.compute):
                    set_expert_parallel_attribute(fp.sharded)
                    setattr(fp.sharded, SPREAD_ATTR, index.expert_parallel_groups)


def _chunked(
    weights: ExtensionWeights,
    fp: FSDPParam,
    mesh: DeviceMesh,
    placements: list[Placement],
    grad: torch.Tensor | None,
) -> tuple[DTensor, DTensor | None]:
    """An extension parameter's sharded form and grad: DTensors of ``torch.chunk`` pieces.

    The local tensor is the subclass shard itself (FSDP2's form, which torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` recognises); the grad's is a view
    of the bucket's grad store.
    """
    shape = fp.global_shape
    stride = torch.empty(shape, device="meta").stride()

    def form(local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )

    return form(cast(torch.Tensor, weights.local)), None if grad is None else form(grad)


def _placements_and_pieces(
    group: Bucket,
    fp: FSDPParam,
    mesh_shape: tuple[int, ...],
    dp_placements: list[Placement],
    member_dims: tuple[int, ...],
) -> tuple[list[Placement], ParamPieces]:
    """The sharded form's placements (dp dims, then tp) and where every rank's rows lie.

    The dp dims shard the dim the parameter's rows run along (``fp.row_dim``), which
    ``units.cut_dim`` keeps apart from the dims tensor parallelism splits, so every
    placement is a plain ``Shard`` of its own dim.
    """
    placements = [Shard(fp.row_dim) if isinstance(p, Shard) else p for p in dp_placements]
    tp_mesh_dim = None
    trailing: list[tuple[int, int]] = []
    if fp.tp is not None:
        tp_mesh_dim = len(placements)
        placements.append(Replicate() if fp.tp.dim is None else Shard(fp.tp.dim))
        for dim, _ in fp.tp.trailing:  # further tp dims (expert TP), one mesh dim each
            trailing.append((len(placements), dim))
            placements.append(Shard(dim))
    pieces = ParamPieces(
        group.main_layout,
        fp.index,
        mesh_shape,
        member_dims,
        tp_mesh_dim,
        None if fp.tp is None else fp.tp.dim,
        1 if fp.tp is None else fp.tp.size,
        1 if fp.tp is None else fp.tp.stride,
        tuple(fp.shape),
        tuple(trailing),
        fp.row_dim,
    )
    return placements, pieces
