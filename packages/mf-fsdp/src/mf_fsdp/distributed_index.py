"""FSDPDistributedIndex: the meshes and process groups the engine communicates over.

Mesh facts (groups, sizes, ranks) are looked up once here and never recomputed
at call sites. The index accepts a ``dp_shard`` dim (required when the mesh has
more than one dim), an optional ``dp_outer`` dim (replication across it, HSDP,
or with ``hsdp_outer_dp_shard`` sharding across it too, hybrid-sharded HSDP)
and an optional ``tp`` dim; a mesh without a tp dim is fine.

A dim may be a flattened one (Megatron's ``dp_cp``: data and context
parallelism sharded together, ``mesh["dp", "cp"]._flatten("dp_cp")``). The
index never slices the root mesh by such a name, which torch deprecates: it
takes the flattened mesh the root records and joins it with the other dims
(see :func:`_sub_mesh`).

Hybrid-sharded layout: a bucket is cut into ``dp_outer x dp_shard`` sub-shards;
the rank at (outer ``o``, shard ``i``) owns sub-shard ``i * outer_size + o``
(its *logical hybrid rank*), so the ``outer_size`` sub-shards of inner shard
``i`` are contiguous and form exactly the ``dp_shard`` shard that ZeRO-3
gathers and reduce-scatters inside ``dp_shard``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mf_fsdp.config import ZeroDPStrategy
from mf_utils import get_mesh_names

__all__ = ["FSDPDistributedIndex"]


class FSDPDistributedIndex:
    """References to the device meshes and process groups used by the engine.

    Args:
        device_mesh: the mesh holding the data-parallel (and maybe tp) dims.
        dp_shard_dim: name of the dim parameters are sharded over; may be None only
            for a 1-D mesh (its single dim is used).
        dp_outer_dim: name of the outer data-parallel dim (replicas), or None.
        tp_dim: name of the tensor-parallel dim, or None.
        hybrid_fsdp_group: the flattened (dp_outer x dp_shard) group; built from the
            mesh when None and ``dp_outer_dim`` is set.
        hsdp_outer_dp_shard: shard main weights, gradient store and optimizer state
            across dp_outer too (hybrid-sharded HSDP); needs ``dp_outer_dim``.
        expt_device_mesh: mesh for expert parameters (marked with mf_utils'
            ``set_expert_parallel_attribute``), or None. It covers the same ranks as
            ``device_mesh`` and has a dim named like ``dp_shard_dim``: the
            expert-data-parallel group experts are sharded and reduced over; dims named
            like ``dp_outer_dim`` and ``tp_dim`` are used when present. Its other dims
            (expert-parallel) are the model's business.
        expt_dp_shard_dim: the expert mesh's expert-data-parallel dim when it is named
            otherwise than ``dp_shard_dim`` (torchtitan's ``efsdp``); None: the same name.
        expt_tp_dim: the expert mesh's dim the expert parameters are DTensors over when
            it is named otherwise than ``tp_dim`` (FSDP2's per-parameter mesh: experts as
            DTensors ``Shard(0)`` over an ``ep`` mesh); None: ``tp_dim`` where present.

    Raises:
        TypeError: if ``device_mesh`` is not a DeviceMesh.
        ValueError: if a named dim is not in the mesh, or the dims are ambiguous; if
            ``expt_device_mesh`` covers other ranks than ``device_mesh`` or lacks the
            ``dp_shard_dim``.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        dp_shard_dim: str | None = None,
        dp_outer_dim: str | None = None,
        tp_dim: str | None = None,
        hybrid_fsdp_group: dist.ProcessGroup | None = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: DeviceMesh | None = None,
        expt_dp_shard_dim: str | None = None,
        expt_tp_dim: str | None = None,
    ) -> None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(
                f"FSDPDistributedIndex: device_mesh must be a DeviceMesh, got {device_mesh!r}"
            )
        names = get_mesh_names(device_mesh)
        if dp_shard_dim is None:
            if device_mesh.ndim != 1:
                raise ValueError(
                    f"FSDPDistributedIndex: dp_shard_dim is required for a {device_mesh.ndim}-D "
                    f"mesh with dims {names!r}"
                )
            dp_shard_dim = names[0] if names else None
        for arg, value in (
            ("dp_shard_dim", dp_shard_dim),
            ("dp_outer_dim", dp_outer_dim),
            ("tp_dim", tp_dim),
        ):
            if value is not None and value not in names:
                raise ValueError(
                    f"FSDPDistributedIndex: {arg}={value!r} is not a dim of the mesh; "
                    f"expected one of {names!r}"
                )
        if tp_dim is not None and tp_dim in (dp_shard_dim, dp_outer_dim):
            raise ValueError(
                f"FSDPDistributedIndex: tp_dim={tp_dim!r} is also a data-parallel dim; "
                "expected a separate mesh dim for tensor parallelism"
            )
        if hsdp_outer_dp_shard and dp_outer_dim is None:
            raise ValueError(
                "FSDPDistributedIndex: hsdp_outer_dp_shard=True (hybrid-sharded HSDP) needs "
                "dp_outer_dim, got None; expected the name of the outer data-parallel dim"
            )
        flattened = [
            (arg, value)
            for arg, value in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim))
            if value is not None and value not in (device_mesh.mesh_dim_names or ())
        ]
        if hsdp_outer_dp_shard and flattened:
            arg, value = flattened[0]
            raise ValueError(
                f"FSDPDistributedIndex: hsdp_outer_dp_shard=True (hybrid-sharded HSDP) needs "
                f"dims of the mesh, got the flattened {arg}={value!r}; build the mesh with it "
                "as a dim (e.g. init_device_mesh(..., (outer, shard * cp), (..., 'dp_shard_cp')))"
            )
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.expt_device_mesh = expt_device_mesh
        self.fsdp_group = self._group(dp_shard_dim)
        self.outer_fsdp_group = self._group(dp_outer_dim) if dp_outer_dim else None
        self.tp_group = self._group(tp_dim) if tp_dim else None
        if dp_outer_dim is not None and hybrid_fsdp_group is None:
            pair = _sub_mesh(device_mesh, self._outer_and_shard_dims())
            hybrid_fsdp_group = pair._flatten().get_group()
        self.hybrid_fsdp_group = hybrid_fsdp_group
        self._swapped_mesh = self._build_swapped_mesh() if hsdp_outer_dp_shard else None
        self._logical_mesh = None
        if self._swapped_mesh is not None:
            outer, shard = self._outer_and_shard_dims()
            self._logical_mesh = self._swapped_mesh[(shard, outer)]
        # Dims across which this (expert) index's parameters are equal copies.
        self.replicated_dims: tuple[str | None, ...] = ()
        self.expert_index = (
            None
            if expt_device_mesh is None
            else self._build_expert_index(expt_device_mesh, expt_dp_shard_dim, expt_tp_dim)
        )
        self.expt_fsdp_group = None if self.expert_index is None else self.expert_index.fsdp_group

    @property
    def expert_parallel_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Groups of the mesh dims the engine does not shard over (the expert-parallel dims).

        Parameters differ across them (each expert-parallel rank holds other
        experts), so a norm over all parameters sums across them too. Empty for a
        mesh whose every dim is a dp or tp dim.
        """
        used = {self.dp_shard_dim, self.dp_outer_dim, self.tp_dim, *self.replicated_dims}
        if self.device_mesh.ndim == 1:
            return ()
        # A dim inside a used one (dp and cp under a flattened dp_cp) is no expert dim.
        covering = [self.get_dp_group(), *([self.tp_group] if self.tp_group else [])]
        covered = [set(dist.get_process_group_ranks(g)) for g in covering]
        groups = (
            self.device_mesh.get_group(name)
            for name in get_mesh_names(self.device_mesh)
            if name not in used
        )
        return tuple(
            group
            for group in groups
            if not any(set(dist.get_process_group_ranks(group)) <= ranks for ranks in covered)
        )

    def _build_expert_index(
        self, expt_device_mesh: DeviceMesh, shard_dim: str | None, tp_dim: str | None
    ) -> FSDPDistributedIndex:
        # The expert parameters' own index: the same dim names on the expert mesh, whose
        # dp_shard dim is the expert-data-parallel group (world / (EP x expert-TP) ranks).
        if not isinstance(expt_device_mesh, DeviceMesh):
            raise TypeError(
                "FSDPDistributedIndex: expt_device_mesh must be a DeviceMesh or None, got "
                f"{expt_device_mesh!r}"
            )
        dense = sorted(self.device_mesh.mesh.flatten().tolist())
        expert = sorted(expt_device_mesh.mesh.flatten().tolist())
        if dense != expert:
            raise ValueError(
                f"FSDPDistributedIndex: expt_device_mesh covers ranks {expert!r} but "
                f"device_mesh covers {dense!r}; expected an expert mesh over the same ranks "
                "(its dims: the expert-data-parallel dim, then expert-parallel and expert-TP)"
            )
        names = get_mesh_names(expt_device_mesh)
        arg = "expt_dp_shard_dim" if shard_dim else "dp_shard_dim"
        shard_dim = shard_dim or self.dp_shard_dim
        if shard_dim not in names:
            raise ValueError(
                f"FSDPDistributedIndex: expt_device_mesh has dims {names!r}, none named "
                f"{arg}={shard_dim!r}; expected the expert-data-parallel dim (named like "
                "dp_shard_dim unless expt_dp_shard_dim names it)"
            )
        outer = self.dp_outer_dim if self.dp_outer_dim in names else None
        index = FSDPDistributedIndex(
            expt_device_mesh,
            shard_dim,
            outer,
            tp_dim or (self.tp_dim if self.tp_dim in names else None),
            hsdp_outer_dp_shard=self.hsdp_outer_dp_shard and outer is not None,
        )
        if tp_dim is not None and tp_dim != self.tp_dim and self.tp_dim in names:
            # Experts split over another dim (ep) are whole on each rank of the dense tp
            # dim, and equal there: no expert-parallel spread for a norm to sum over.
            index.replicated_dims = (self.tp_dim,)
        return index

    def _build_swapped_mesh(self) -> DeviceMesh:
        # The root mesh with dp_shard and dp_outer swapped; sliced to (dp_shard, dp_outer)
        # its row-major order is the logical hybrid rank, so DTensor's Shard order over
        # [Shard(0), Shard(0)] is the hybrid layout (new groups, built once, collective).
        mesh = self.device_mesh
        names = list(get_mesh_names(mesh))
        outer, shard = self._outer_and_shard_dims()
        a, b = names.index(outer), names.index(shard)
        order = list(range(mesh.ndim))
        order[a], order[b] = b, a
        return DeviceMesh(
            mesh.device_type,
            mesh.mesh.permute(order),
            mesh_dim_names=tuple(names[i] for i in order),
        )

    def check_outer_strategy(self, outer: ZeroDPStrategy) -> None:
        """Check that the ddp config's outer strategy matches ``hsdp_outer_dp_shard``.

        Raises:
            ValueError: naming both when ``outer`` shards and the index does not, or
                the other way round.
        """
        wanted = outer is ZeroDPStrategy.OPTIM
        if wanted != self.hsdp_outer_dp_shard:
            raise ValueError(
                f"ddp_config: outer_dp_sharding_strategy={outer.value!r} needs a dist_index with "
                f"hsdp_outer_dp_shard={wanted}, got {self.hsdp_outer_dp_shard!r}"
            )

    def _outer_and_shard_dims(self) -> tuple[str, str]:
        """``(dp_outer_dim, dp_shard_dim)`` of an index with a dp_outer dim."""
        outer, shard = self.dp_outer_dim, self.dp_shard_dim
        # dp_outer_dim is a name of the mesh, so the mesh is named and dp_shard_dim is set
        assert outer is not None
        assert shard is not None
        return outer, shard

    def _group(self, dim: str | None) -> dist.ProcessGroup:
        if dim is None or self.device_mesh.ndim == 1:
            return self.device_mesh.get_group()
        return self.device_mesh.get_group(dim)

    def get_submesh(
        self, mesh_dim_names: str | Sequence[str], is_expert_parallel: bool = False
    ) -> DeviceMesh:
        """Return the sub-mesh of the (expert) mesh with the given dim name(s).

        Raises:
            ValueError: if a name is None or not a dim of that mesh.
        """
        mesh = self.get_root_mesh(is_expert_parallel)
        dims = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        names = get_mesh_names(mesh)
        missing = [d for d in dims if d not in names]
        if missing:
            raise ValueError(
                f"FSDPDistributedIndex.get_submesh: mesh_dim_names={mesh_dim_names!r} has dims "
                f"{missing!r} that are not in the mesh; expected names from {names!r}"
            )
        if mesh.ndim == 1 and dims == tuple(mesh.mesh_dim_names or ()):
            return mesh
        return _sub_mesh(mesh, dims)

    def get_dp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup:
        """The whole data-parallel group: the hybrid group under HSDP, else the FSDP group.

        With ``is_expert_parallel``, the expert-data-parallel group of the expert mesh.

        Raises:
            ValueError: for the expert group when no expert mesh was given.
        """
        if is_expert_parallel:
            return self.get_expert_index("get_dp_group").get_dp_group()
        return self.hybrid_fsdp_group or self.fsdp_group

    def get_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup:
        """The group parameters are sharded over (the ``dp_shard`` dim).

        Raises:
            ValueError: for the expert group when no expert mesh was given.
        """
        if is_expert_parallel:
            return self.get_expert_index("get_fsdp_group").fsdp_group
        return self.fsdp_group

    def get_expert_index(self, caller: str = "get_expert_index") -> FSDPDistributedIndex:
        """The index of the expert mesh: the groups expert parameters live on.

        Raises:
            ValueError: when no ``expt_device_mesh`` was given.
        """
        if self.expert_index is None:
            raise ValueError(
                f"FSDPDistributedIndex.{caller}: is_expert_parallel=True but no "
                "expt_device_mesh was given; expected FSDPDistributedIndex(..., "
                "expt_device_mesh=<mesh with the expert-data-parallel dim>)"
            )
        return self.expert_index

    def get_outer_fsdp_group(self) -> dist.ProcessGroup | None:
        """The ``dp_outer`` group (replicas under HSDP), or None without a dp_outer dim."""
        return self.outer_fsdp_group

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh:
        """The (expert) device mesh the index was built on.

        Raises:
            ValueError: for the expert mesh when none was given.
        """
        if is_expert_parallel:
            return self.get_expert_index("get_root_mesh").device_mesh
        return self.device_mesh

    def get_logical_hybrid_fsdp_rank(self) -> int:
        """This process's index in the hybrid group, shard-major: ``shard * outer_size + outer``.

        Raises:
            RuntimeError: when there is no dp_outer dim.
        """
        if self.outer_fsdp_group is None:
            raise RuntimeError(
                "FSDPDistributedIndex.get_logical_hybrid_fsdp_rank: needs a dp_outer_dim, got None"
            )
        outer = dist.get_rank(self.outer_fsdp_group)
        shard = dist.get_rank(self.fsdp_group)
        return shard * dist.get_world_size(self.outer_fsdp_group) + outer

    @property
    def shard_size(self) -> int:
        """Number of ranks in the ``dp_shard`` group."""
        return dist.get_world_size(self.fsdp_group)

    @property
    def shard_rank(self) -> int:
        """This rank's index in the ``dp_shard`` group."""
        return dist.get_rank(self.fsdp_group)

    @property
    def outer_size(self) -> int:
        """Number of ranks in the ``dp_outer`` group (1 without one)."""
        group = self.outer_fsdp_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (dp_outer x dp_shard)."""
        return dist.get_world_size(self.get_dp_group())

    def dp_mesh(self) -> DeviceMesh:
        """Mesh the optimizer's DTensors live on.

        (dp_shard,) without dp_outer; (dp_outer, dp_shard) under HSDP (replicas
        across dp_outer); (dp_shard, dp_outer) under hybrid-sharded HSDP, whose
        row-major order is the logical hybrid rank, so ``[Shard(0), Shard(0)]``
        in DTensor's Shard order describes the hybrid layout exactly.
        """
        if self._logical_mesh is not None:
            return self._logical_mesh
        if self.dp_outer_dim is None:
            return self.get_submesh(self.dp_shard_dim) if self.dp_shard_dim else self.device_mesh
        return self.get_submesh(self._outer_and_shard_dims())

    def dp_tp_mesh(self) -> DeviceMesh:
        """The data-parallel dims of :meth:`dp_mesh`, in its order, plus the tp dim last.

        The mesh of a checkpoint's tensor-parallel DTensors (no communication).

        Raises:
            ValueError: when the index has no tp dim.
        """
        if self.tp_dim is None:
            raise ValueError("FSDPDistributedIndex.dp_tp_mesh: needs a tp_dim, got None")
        root = self._swapped_mesh if self._swapped_mesh is not None else self.device_mesh
        dp_dims = tuple(self.dp_mesh().mesh_dim_names or ())
        return _sub_mesh(root, (*dp_dims, self.tp_dim))


def _sub_mesh(root: DeviceMesh, dims: Sequence[str]) -> DeviceMesh:
    """``root[dims]``, where a dim may be a flattened one the root records.

    torch deprecates slicing a root mesh by a flattened name and asks callers
    to keep the flattened mesh; the root keeps it, so it is taken from there
    and joined with the other dims by ``DeviceMesh._concatenate`` (their
    existing groups: no new ones).
    """
    names = tuple(root.mesh_dim_names or ())
    if all(d in names for d in dims):
        return root[tuple(dims) if len(dims) > 1 else dims[0]]
    parts = [root[d] if d in names else root._flatten_mapping[d] for d in dims]
    return parts[0] if len(parts) == 1 else DeviceMesh._concatenate(parts)
