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
SPMD storage mesh instead and names which of its dims are the shard and the
replicate dims: the shard dims are joined (flattened when several) and the
replicate dim is the outer one. It is served where the parameters are plain
tensors and every other dim of the storage mesh has one rank (torchtitan's
default ``spmd_types`` backend for FSDP and HSDP); a storage mesh with a
tensor-parallel dim stops with one line naming it.

Nothing here shards or moves a parameter; ``mesh_roles`` may flatten dims
(``DeviceMesh._flatten``, which makes one group, on every rank of the mesh at
once, as every rank builds its engine at the same first use).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.fsdp2.placement import ExpertMesh
from mf_utils import get_group_device, is_expert_parallel_parameter

__all__ = ["EngineMesh", "call_mesh", "dist_index", "mesh_roles"]


@dataclass(frozen=True, slots=True)
class EngineMesh:
    """The engine's mesh and the names of its dims by role (see [Note: the engine mesh]).

    ``shard`` is None only for an unnamed 1-D mesh (its one dim shards).
    """

    mesh: DeviceMesh
    shard: str | None
    outer: str | None = None
    tp: str | None = None


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
) -> EngineMesh:
    """The engine mesh for FSDP2's ``mesh`` (and ``dp_mesh_dims``) and the model's parameters.

    Args:
        mesh: the call's mesh (``call_mesh``).
        params: the parameters the engine will shard (expert parameters, already
            marked by ``placement.place_params``, live on their own mesh).
        dp_mesh_dims: torch 2.15's ``DataParallelMeshDims``, or None.

    Raises:
        ValueError: for ``dp_mesh_dims`` naming dims the mesh lacks.
        NotImplementedError: one line naming the mesh, for a layout mf does not serve.
    """
    dense = [p for p in params if not is_expert_parallel_parameter(p)]
    if dp_mesh_dims is not None:
        return _storage_roles(mesh, dense, dp_mesh_dims)
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


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _storage_roles(mesh: DeviceMesh, params: list[nn.Parameter], dims: Any) -> EngineMesh:
    """``dp_mesh_dims``: the engine's shard and outer dims out of the full storage mesh."""
    names = tuple(mesh.mesh_dim_names or ())
    shard = _names(getattr(dims, "shard", None))
    replicate = _names(getattr(dims, "replicate", None))
    where = f"fully_shard: mesh {mesh} with dp_mesh_dims={dims!r}"
    unknown = [name for name in (*shard, *replicate) if name not in names]
    if not names or unknown:
        raise ValueError(
            f"{where}: {unknown or 'an unnamed mesh'} not among the mesh's dims {names}; "
            "expected names of the storage mesh's dims"
        )
    others = [name for name in names if name not in (*shard, *replicate) and mesh[name].size() > 1]
    if others or any(isinstance(p, DTensor) for p in params):
        raise NotImplementedError(
            f"{where}: parameters over the storage mesh's other dims {others} (tensor "
            "parallelism as an SPMD storage mesh) are not supported by mf_fsdp.fsdp2; "
            "expected plain parameters and dims of one rank besides the data-parallel ones, "
            "or torchtitan's partial_dtensor backend (a dp mesh and DTensors over a tp mesh)"
        )
    if not shard:
        raise NotImplementedError(
            f"{where}: replication alone (DDP) is not supported by mf_fsdp.fsdp2; expected a "
            "shard dim"
        )
    shard_mesh = _flat(mesh, shard)
    if not replicate:
        return EngineMesh(shard_mesh, _only_name(shard_mesh))
    joined = DeviceMesh._concatenate([_flat(mesh, replicate), shard_mesh])
    outer, inner = joined.mesh_dim_names or (None, None)
    return EngineMesh(joined, inner, outer)


def _flat(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh``'s dims ``names`` as one dim (the dim itself when there is one)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def _only_name(mesh: DeviceMesh) -> str | None:
    return (mesh.mesh_dim_names or (None,))[0]


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
