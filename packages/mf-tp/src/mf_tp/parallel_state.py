"""Tensor- and data-parallel process groups: build, look up, tear down.

Responsibility: own the one optional process-wide :class:`ModelParallelGroups`
set by :func:`initialize_model_parallel`, and resolve the ``group=`` /
``tp_group=`` argument every public op of mf-tp takes. An explicit group always
wins, so mf-tp also works inside a user's own mesh with no global state at all.

Layout over the default world (``W`` ranks, TP size ``t``): TP groups are runs
of consecutive ranks ``[k*t, (k+1)*t)``; DP groups take one rank from each TP
group, ``{j, j+t, j+2t, ...}``. From a ``DeviceMesh`` the groups are the
mesh's ``"tp"`` and ``"dp"`` dims.

It must not: guess a group when none is given and none is initialised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mf_rng import register_model_parallel_group

__all__ = [
    "ModelParallelGroups",
    "destroy_model_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_groups",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "resolve_tp_group",
    "use_model_parallel_groups",
]


@dataclass(frozen=True, slots=True)
class ModelParallelGroups:
    """The groups one process belongs to.

    Attributes:
        tp_group: this rank's tensor-parallel group.
        dp_group: this rank's data-parallel group.
        device_mesh: the mesh the groups came from, or None when built over the world.
        owns_groups: whether :func:`destroy_model_parallel` must destroy the groups
            (True for groups created here, False for a mesh's groups).
    """

    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device_mesh: DeviceMesh | None
    owns_groups: bool


_groups: ModelParallelGroups | None = None


def _build_world_groups(tensor_model_parallel_size: int) -> ModelParallelGroups:
    world_size = dist.get_world_size()
    if world_size % tensor_model_parallel_size != 0:
        raise ValueError(
            f"initialize_model_parallel: the world size {world_size} is not divisible by "
            f"tensor_model_parallel_size={tensor_model_parallel_size!r}"
        )
    rank = dist.get_rank()
    tp_size = tensor_model_parallel_size
    dp_size = world_size // tp_size
    tp_group = dp_group = None
    # Every rank must create every group, in the same order (new_group is collective).
    for k in range(dp_size):
        ranks = list(range(k * tp_size, (k + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:  # a member gets the group (others get NON_GROUP_MEMBER, typed with it)
            tp_group = cast(dist.ProcessGroup, group)
    for j in range(tp_size):
        ranks = list(range(j, world_size, tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = cast(dist.ProcessGroup, group)
    if tp_group is None or dp_group is None:
        raise RuntimeError(f"initialize_model_parallel: rank {rank} fell outside every group")
    return ModelParallelGroups(tp_group, dp_group, None, owns_groups=True)


def _groups_from_mesh(
    device_mesh: DeviceMesh, tensor_model_parallel_size: int | None
) -> ModelParallelGroups:
    names = tuple(device_mesh.mesh_dim_names or ())
    missing = [name for name in ("tp", "dp") if name not in names]
    if missing:
        raise ValueError(
            "initialize_model_parallel: device_mesh must name dims 'tp' and 'dp', "
            f"got mesh_dim_names={names!r} (missing {missing!r})"
        )
    tp_group = device_mesh.get_group("tp")
    if (
        tensor_model_parallel_size is not None
        and dist.get_world_size(tp_group) != tensor_model_parallel_size
    ):
        raise ValueError(
            f"initialize_model_parallel: tensor_model_parallel_size={tensor_model_parallel_size!r}"
            f" disagrees with the mesh's 'tp' dim of size {dist.get_world_size(tp_group)}"
        )
    return ModelParallelGroups(tp_group, device_mesh.get_group("dp"), device_mesh, False)


def initialize_model_parallel(
    tensor_model_parallel_size: int | None = None,
    *,
    device_mesh: DeviceMesh | None = None,
) -> ModelParallelGroups:
    """Build (or adopt) the TP and DP groups and make them the process-wide default.

    The TP group is also registered with mf_rng, so
    ``mf_rng.model_parallel_cuda_manual_seed(seed)`` picks up this rank's TP rank.

    Args:
        tensor_model_parallel_size: ranks per TP group; 1 when neither it nor a
            mesh is given. With a mesh it is only checked against the mesh.
        device_mesh: take the groups from this mesh's ``"tp"`` and ``"dp"`` dims
            instead of building them over the default world.

    Returns:
        The groups, also reachable through the getters of this module.

    Raises:
        RuntimeError: if torch.distributed is not initialised or groups already exist.
        ValueError: if the world size is not divisible by the TP size, the size is
            not a positive int, or the mesh lacks a ``"tp"``/``"dp"`` dim.
    """
    global _groups
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel: torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first"
        )
    if _groups is not None:
        raise RuntimeError(
            "initialize_model_parallel: model-parallel groups already exist; "
            "call destroy_model_parallel() first"
        )
    if tensor_model_parallel_size is not None and (
        not isinstance(tensor_model_parallel_size, int)
        or isinstance(tensor_model_parallel_size, bool)
        or tensor_model_parallel_size < 1
    ):
        raise ValueError(
            "initialize_model_parallel: tensor_model_parallel_size must be a positive int, "
            f"got {tensor_model_parallel_size!r}"
        )
    if device_mesh is not None:
        groups = _groups_from_mesh(device_mesh, tensor_model_parallel_size)
    else:
        groups = _build_world_groups(tensor_model_parallel_size or 1)
    _groups = groups
    register_model_parallel_group("tp", groups.tp_group)
    return groups


def destroy_model_parallel() -> None:
    """Forget the default groups (destroying those built here) and unregister TP from mf_rng.

    A no-op when nothing is initialised.
    """
    global _groups
    groups, _groups = _groups, None
    if groups is None:
        return
    register_model_parallel_group("tp", None)
    if groups.owns_groups and dist.is_initialized():
        for group in {groups.tp_group, groups.dp_group}:
            dist.destroy_process_group(group)


@contextlib.contextmanager
def use_model_parallel_groups(groups: ModelParallelGroups | None) -> Iterator[None]:
    """Make ``groups`` the default (None: no default) inside the block, then restore.

    The mf_rng TP registration follows the swap. Nothing is created or destroyed,
    so this is how a caller lends its own groups to code that reads the default.

    Raises:
        TypeError: if ``groups`` is neither a ModelParallelGroups nor None.
    """
    global _groups
    if groups is not None and not isinstance(groups, ModelParallelGroups):
        raise TypeError(
            f"use_model_parallel_groups: groups must be ModelParallelGroups or None, got {groups!r}"
        )
    previous, _groups = _groups, groups
    register_model_parallel_group("tp", None if groups is None else groups.tp_group)
    try:
        yield
    finally:
        _groups = previous
        register_model_parallel_group("tp", None if previous is None else previous.tp_group)


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` ran (and was not destroyed)."""
    return _groups is not None


def get_model_parallel_groups() -> ModelParallelGroups:
    """Return the default groups.

    Raises:
        RuntimeError: if :func:`initialize_model_parallel` has not run.
    """
    if _groups is None:
        raise RuntimeError(
            "mf_tp: model-parallel groups are not initialized; call "
            "initialize_model_parallel(...) or pass the group explicitly"
        )
    return _groups


def resolve_tp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """Return ``group`` itself, or the default TP group when it is None.

    Raises:
        TypeError: if ``group`` is neither a ProcessGroup nor None.
        RuntimeError: if ``group`` is None and no default groups exist.
    """
    if group is None:
        return get_model_parallel_groups().tp_group
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"mf_tp: group must be a ProcessGroup or None, got {group!r}")
    return group


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    """Return the default TP group."""
    return get_model_parallel_groups().tp_group


def get_data_parallel_group() -> dist.ProcessGroup:
    """Return the default DP group."""
    return get_model_parallel_groups().dp_group


def get_tensor_model_parallel_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (default: the TP group)."""
    return dist.get_world_size(resolve_tp_group(group))


def get_tensor_model_parallel_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the TP group)."""
    return dist.get_rank(resolve_tp_group(group))


def get_tensor_model_parallel_src_rank(group: dist.ProcessGroup | None = None) -> int:
    """Global rank of rank 0 of ``group`` (default: the TP group): the source of broadcasts."""
    return dist.get_global_rank(resolve_tp_group(group), 0)


def get_data_parallel_world_size() -> int:
    """Size of the default DP group."""
    return dist.get_world_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    """This process's rank in the default DP group."""
    return dist.get_rank(get_data_parallel_group())
