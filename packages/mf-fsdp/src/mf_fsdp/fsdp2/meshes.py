"""The mesh an FSDP2 call hands over, as the mesh mf's engine runs over and the roles of its dims.

FSDP2 takes the data-parallel mesh as ``mesh``: 1-D (shard) or 2-D (replicate,
shard), over every rank or over part of them, and reads each DTensor
parameter's own mesh (tensor parallelism) beside it. torch builds these meshes
in more than one way, and mf serves them alike:

- ``init_device_mesh`` of an N-D world mesh, sliced (``world["dp"]``);
- torchtitan's way: one 1-D world mesh unflattened into several views
  (``world._unflatten(0, (pp, dp, tp), ...)``), so the dp mesh and the tp mesh
  handed over are slices of *different* N-D meshes over one 1-D root;
- a flattened dim (torchtitan's ``fsdp`` is ``dp_shard x cp``, its ``batch``
  ``dp_replicate x dp_shard``).

[Note: the engine mesh] The engine needs one named mesh whose dims are its
shard dim, its replicate (outer) dim and the tp dim of the model's DTensor
parameters. FSDP2 itself joins the dp mesh with a parameter's tp mesh by
``DeviceMesh._concatenate`` (both are views of one root, and the join reuses
their process groups: nothing is created or communicated); mf does the same
once per model, so the engine's groups are those of the meshes handed over.
Without DTensor parameters the engine runs over the user's own mesh object,
named or not, so the sharded parameters' DTensors carry it. A mesh over part of
the ranks is a pipeline stage's or a tp rank's data-parallel group: the engine
runs only collectives of its own groups, so ranks outside them never take part.

torch 2.15's ``dp_mesh_dims`` (``DataParallelMeshDims``) hands over the whole
SPMD storage mesh instead: ``storage_mesh.py`` reads it (torchtitan's default
``spmd_types`` backend, with or without a tp dim, and its ``full_dtensor`` one).

Nothing here shards or moves a parameter; ``mesh_roles`` may flatten dims
(``DeviceMesh._flatten``, which makes one group, on every rank of the mesh at
once, as every rank builds its engine at the same first use).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.fsdp2.engine_mesh import EngineMesh
from mf_fsdp.fsdp2.placement import ExpertMesh
from mf_fsdp.fsdp2.storage_mesh import SpmdAnnotation, storage_roles
from mf_utils import get_group_device, is_expert_parallel_parameter

__all__ = ["EngineMesh", "call_mesh", "dist_index", "mesh_roles"]


def call_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """The call's mesh; None is FSDP2's default, a 1-D mesh over the world.

    Raises:
        RuntimeError: before ``init_process_group``.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first"
        )
    if mesh is not None:
        return mesh
    world = dist.get_world_size()
    return init_device_mesh(get_group_device(None).type, (world,), mesh_dim_names=("dp_shard",))


def mesh_roles(
    mesh: DeviceMesh,
    params: Iterable[nn.Parameter],
    dp_mesh_dims: Any = None,
    annotations: dict[int, SpmdAnnotation] | None = None,
) -> EngineMesh:
    """The engine mesh for FSDP2's ``mesh`` (and ``dp_mesh_dims``) and the model's parameters.

    Args:
        mesh: the call's mesh (``call_mesh``).
        params: the parameters the engine will shard (expert parameters, already
            marked by ``placement.place_params``, live on their own mesh).
        dp_mesh_dims: torch 2.15's ``DataParallelMeshDims``, or None.
        annotations: with ``dp_mesh_dims``, each parameter's spmd_types annotation by
            ``id`` (``storage_mesh.read_annotations``).

    Raises:
        ValueError: for ``dp_mesh_dims`` naming dims the mesh lacks.
        NotImplementedError: one line naming the mesh, for a layout mf does not serve.
    """
    dense = [p for p in params if not is_expert_parallel_parameter(p)]
    if dp_mesh_dims is not None:
        return storage_roles(mesh, dense, dp_mesh_dims, annotations or {})
    tp_meshes = _tp_meshes(mesh, dense)
    names = mesh.mesh_dim_names
    if not tp_meshes:
        if names is None:
            return EngineMesh(mesh, None)
        return EngineMesh(mesh, names[-1], names[0] if mesh.ndim == 2 else None)
    (tp_mesh,) = tp_meshes
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    if names is None or tp_name is None or tp_mesh.ndim != 1 or tp_name in names:
        raise NotImplementedError(
            f"fully_shard: mesh {mesh} beside DTensor parameters over {tp_mesh}; mf_fsdp.fsdp2 "
            "serves a named dp mesh beside parameters over one named 1-D tp mesh of another "
            "dim (init_device_mesh or _unflatten names)"
        )
    joined = _joined(mesh, tp_mesh)
    return EngineMesh(joined, names[-1], names[0] if mesh.ndim == 2 else None, tp_name)


def _tp_meshes(mesh: DeviceMesh, params: list[nn.Parameter]) -> list[DeviceMesh]:
    """The distinct meshes the DTensor parameters lie on (one expected: the tp mesh)."""
    meshes: list[DeviceMesh] = []
    for param in params:
        if isinstance(param, DTensor) and all(param.device_mesh != m for m in meshes):
            meshes.append(param.device_mesh)
    if len(meshes) > 1:
        raise NotImplementedError(
            f"fully_shard: DTensor parameters lie on {len(meshes)} meshes "
            f"({', '.join(str(m) for m in meshes)}) beside mesh {mesh}; mf_fsdp.fsdp2 serves one "
            "tp mesh per model (experts on another mesh through shard_placement_fn)"
        )
    return meshes


def _joined(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp) mesh over both meshes' ranks, with their groups (FSDP2's join)."""
    try:
        joined = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except (RuntimeError, ValueError, AssertionError) as error:
        raise NotImplementedError(
            f"fully_shard: mesh {dp_mesh} and the DTensor parameters' mesh {tp_mesh} are not "
            f"views of one device mesh ({error}); mf_fsdp.fsdp2 needs both sliced or "
            "unflattened from one world mesh, as FSDP2 does"
        ) from None
    dp_ranks = set(dp_mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    if len(dp_ranks & tp_ranks) != 1 or joined.size() != dp_mesh.size() * tp_mesh.size():
        raise NotImplementedError(
            f"fully_shard: mesh {dp_mesh} and the DTensor parameters' mesh {tp_mesh} do not "
            "cross in this rank alone; mf_fsdp.fsdp2 needs the tp mesh over other dims than "
            "the dp mesh"
        )
    return joined


def dist_index(roles: EngineMesh, experts: ExpertMesh | None) -> FSDPDistributedIndex:
    """The engine's index over ``roles``' mesh, with the expert mesh where there is one.

    Raises:
        NotImplementedError: for an expert mesh over other ranks than the dense mesh.
    """
    expert_args: dict[str, Any] = {}
    if experts is not None:
        dense, expert = (sorted(m.mesh.flatten().tolist()) for m in (roles.mesh, experts.mesh))
        if dense != expert:
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn's mesh joined with the experts' DTensor mesh "
                f"is {experts.mesh}, over ranks {expert}, but the dense parameters' mesh is "
                f"{roles.mesh}, over ranks {dense}; expected both over the same ranks"
            )
        expert_args = {
            "expt_device_mesh": experts.mesh,
            "expt_dp_shard_dim": experts.shard_dim,
            "expt_tp_dim": experts.tp_dim,
        }
    return FSDPDistributedIndex(
        roles.mesh,
        dp_shard_dim=roles.shard,
        dp_outer_dim=roles.outer,
        tp_dim=roles.tp,
        **expert_args,
    )
