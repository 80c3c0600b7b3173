"""FSDP2's ``shard_placement_fn`` on mf: which parameters live on another mesh, and that mesh.

FSDP2 asks ``shard_placement_fn(param)`` for each parameter a ``fully_shard`` call
manages and gets ``None`` (``Shard(0)`` on the call's mesh), a ``Shard(dim)``, or
(torch 2.15's ``ShardPlacementResult``) a ``Shard`` and the ``FSDPMeshInfo`` of
the mesh to shard over. mf serves both halves of that answer on its flat buckets:

- **the dim.** mf shards a unit's flat buckets by whole dim-0 rows, whatever dim
  is asked for (see [Note: row-aligned shards] in ``buckets/layout.py``). Which
  rows each rank holds is its own; no value a user computes changes
  (``full_tensor()``, state-dict values, DCP checkpoints, losses, gradients).
- **the mesh.** A parameter placed on a mesh whose shard group is not the call's,
  or a DTensor parameter placed on another mesh than the call's even over the same
  ranks (torchtitan's EP 2 beside TP 2: ``efsdp`` and ``fsdp`` are one group there),
  is an expert parameter to the engine (Megatron's ``allreduce = False`` mark, set
  here on the parameter): its buckets are sharded and reduced over that mesh's
  group, and averaged over it (FSDP2's rule). That mesh plus the mesh the
  parameter is a DTensor over (torchtitan: experts ``Shard(0)`` over ``ep``, on
  the ``efsdp`` mesh) must cover the ranks of the engine's dense mesh
  (``meshes.py``): joined, they are the engine's expert mesh. One such mesh per
  model; anything else stops with one line.

torch 2.11 has ``shard_placement_fn`` with ``Shard`` answers only; torch 2.15 adds
``ShardPlacementResult``. The function runs when the engine is built (the model's
first use), not inside ``fully_shard`` as in FSDP2. Nothing here communicates
or builds groups: the expert mesh reuses the groups of the meshes it joins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mf_utils import set_expert_parallel_attribute

try:  # torch 2.15; torch 2.11 has Shard answers only
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        HSDPMeshInfo,
        ShardPlacementResult,
    )
except ImportError:  # pragma: no cover - the floor of mf's torch range
    HSDPMeshInfo = ShardPlacementResult = None  # type: ignore[assignment,misc]

__all__ = ["ExpertMesh", "check_answer", "check_placement_fn", "place_params"]


@dataclass(frozen=True, slots=True)
class ExpertMesh:
    """The engine's expert mesh: (expert-data-parallel dim, the experts' DTensor dim)."""

    mesh: DeviceMesh
    shard_dim: str
    tp_dim: str


def check_placement_fn(fn: object) -> None:
    """Refuse a ``shard_placement_fn`` that is neither None nor callable.

    Raises:
        TypeError: naming the value.
    """
    if fn is not None and not callable(fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be a callable or None, got {fn!r}")


def place_params(
    calls: Iterable[tuple[Callable[[nn.Parameter], Any], Iterable[tuple[str, nn.Parameter]]]],
    dense_mesh: DeviceMesh,
) -> ExpertMesh | None:
    """Ask each call's ``shard_placement_fn``; mark and return what lives on another mesh.

    Args:
        calls: per ``fully_shard`` call with a ``shard_placement_fn``: the function and
            the (name, parameter) pairs the call manages.
        dense_mesh: the mesh the engine shards the other parameters over.

    Returns:
        The expert mesh, or None when every parameter stays on ``dense_mesh``.

    Raises:
        AssertionError: for an answer that is not None, a ``Shard`` or a
            ``ShardPlacementResult``, or a ``Shard`` dim out of range.
        NotImplementedError: naming the parameter, for another mesh mf cannot
            serve (see the module docstring).
    """
    dense = _ranks(dense_mesh)
    found: ExpertMesh | None = None
    for fn, params in calls:
        for name, param in params:
            mesh = _answer_mesh(name, param, fn(param), dense_mesh)
            if mesh is None or _same_as_dense(param, mesh, dense_mesh, dense):
                continue
            expert = _expert_mesh(name, param, mesh)
            if found is not None and _key(found) != _key(expert):
                raise NotImplementedError(
                    f"fully_shard: shard_placement_fn puts parameter {name!r} on a mesh over "
                    f"{_key(expert)} but another parameter on one over {_key(found)}; "
                    "mf_fsdp.fsdp2 serves one mesh besides the call's per model"
                )
            found = found or expert
            set_expert_parallel_attribute(param)
    return found


def check_answer(name: str, param: nn.Parameter, answer: object) -> Any:
    """Check ``shard_placement_fn``'s ``answer`` for ``param`` as FSDP2 does; its mesh info.

    Returns:
        The ``ShardPlacementResult``'s mesh info, or None (the call's mesh).

    Raises:
        AssertionError: (FSDP2's type) for an answer that is not None, a ``Shard`` or a
            ``ShardPlacementResult`` of one, or a ``Shard`` dim the parameter lacks.
    """
    mesh_info = None
    placement = answer
    if ShardPlacementResult is not None and isinstance(answer, ShardPlacementResult):
        placement, mesh_info = answer.placement, answer.mesh_info
    if placement is not None and not isinstance(placement, Shard):
        raise AssertionError(
            f"fully_shard: shard_placement_fn returned {answer!r} for parameter {name!r}; "
            "expected None, a Shard(dim) or a ShardPlacementResult"
        )
    if placement is not None and not -param.dim() <= placement.dim < param.dim():
        raise AssertionError(
            f"fully_shard: shard_placement_fn returned Shard({placement.dim}) for parameter "
            f"{name!r} of shape {tuple(param.shape)}: Shard dim {placement.dim} is invalid "
            f"for {param.dim()}D tensor; expected a dim of the parameter"
        )
    return mesh_info


def _answer_mesh(
    name: str, param: nn.Parameter, answer: object, dense_mesh: DeviceMesh
) -> DeviceMesh | None:
    """The mesh ``answer`` names for ``param`` (None: the call's); check its placement."""
    mesh_info = check_answer(name, param, answer)
    if mesh_info is None or mesh_info.mesh is dense_mesh:
        return None
    if dense_mesh.ndim != 1 or (HSDPMeshInfo is not None and isinstance(mesh_info, HSDPMeshInfo)):
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn puts parameter {name!r} on mesh "
            f"{mesh_info.mesh} (the call's mesh: {dense_mesh}); mf_fsdp.fsdp2 serves another mesh "
            "with one (shard) dim beside a 1-D call mesh"
        )
    return mesh_info.mesh


def _expert_mesh(name: str, param: nn.Parameter, mesh: DeviceMesh) -> ExpertMesh:
    """``mesh`` joined with the mesh ``param`` is a DTensor over: the expert mesh."""
    where = f"fully_shard: shard_placement_fn puts parameter {name!r} on mesh {mesh}"
    if not isinstance(param, DTensor) or param.device_mesh.ndim != 1 or mesh.ndim != 1:
        raise NotImplementedError(
            f"{where}; mf_fsdp.fsdp2 serves another 1-D mesh for a DTensor parameter over "
            "a 1-D mesh (experts over ep) that together cover the dense mesh's ranks"
        )
    if not mesh.mesh_dim_names or not param.device_mesh.mesh_dim_names:
        raise NotImplementedError(f"{where}; expected named meshes (init_device_mesh names)")
    try:
        joined = DeviceMesh._concatenate([mesh, param.device_mesh])
    except RuntimeError as error:
        raise NotImplementedError(
            f"{where}, and it is a DTensor over {param.device_mesh}; expected both sliced "
            f"from one device mesh ({error})"
        ) from None
    return ExpertMesh(joined, mesh.mesh_dim_names[0], param.device_mesh.mesh_dim_names[0])


def _same_as_dense(
    param: nn.Parameter, mesh: DeviceMesh, dense_mesh: DeviceMesh, dense: list[int]
) -> bool:
    """Whether ``mesh`` is the call's mesh to the engine.

    It is when equal to it or, for a plain parameter, another 1-D mesh over the same
    ranks. A DTensor parameter on another mesh over the same ranks is an expert:
    torchtitan's EP 2 beside TP 2 (world 4) puts the experts, DTensors over ``ep``, on
    ``efsdp``, whose ranks are those of ``fsdp`` there, while the dense parameters are
    DTensors over ``tp``; taken as dense, the model's DTensors would lie on two meshes.
    """
    if mesh == dense_mesh:
        return True
    return (
        not isinstance(param, DTensor)
        and mesh.ndim == dense_mesh.ndim == 1
        and _ranks(mesh) == dense
    )


def _key(expert: ExpertMesh) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in expert.mesh.mesh.tolist())


def _ranks(mesh: DeviceMesh) -> list[int]:
    return sorted(mesh.mesh.flatten().tolist())
