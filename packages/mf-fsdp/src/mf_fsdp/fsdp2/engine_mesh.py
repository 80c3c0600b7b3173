"""The mesh mf's engine runs over, with the names of its dims by role (``meshes.py``'s answer)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["EngineMesh"]


@dataclass(frozen=True, slots=True)
class EngineMesh:
    """The engine's mesh and the names of its dims by role (see [Note: the engine mesh]).

    ``shard`` is None only for an unnamed 1-D mesh (its one dim shards).
    """

    mesh: DeviceMesh
    shard: str | None
    outer: str | None = None
    tp: str | None = None
