"""Names of the sub-meshes and flattened meshes of a ``DeviceMesh``.

A mesh axis is addressed by name everywhere in mf. torch keeps flattened
axes (``mesh["dp", "cp"]._flatten("dp_cp")``) on the root mesh only, so a
flattened name is reported for the root mesh, which is the one that can be
sliced by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["contains_submesh", "get_mesh_names"]


def _check_mesh(device_mesh: object, function: str) -> None:
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"{function}: device_mesh must be a torch.distributed.DeviceMesh or None, "
            f"got {type(device_mesh)!r}"
        )


def get_mesh_names(
    device_mesh: DeviceMesh | None = None, only_submesh_dims: bool = False
) -> list[str]:
    """Return the axis names of ``device_mesh``, then the flattened names it can be sliced by.

    Args:
        device_mesh: the mesh; ``None`` gives an empty list.
        only_submesh_dims: leave out flattened names.

    Raises:
        TypeError: if ``device_mesh`` is not a DeviceMesh.
    """
    _check_mesh(device_mesh, "get_mesh_names")
    if device_mesh is None:
        return []
    names = list(device_mesh.mesh_dim_names or ())
    if not only_submesh_dims and device_mesh._get_root_mesh() is device_mesh:
        flattened = getattr(device_mesh, "_flatten_mapping", {})
        names.extend(name for name in flattened if name not in names)
    return names


def contains_submesh(
    device_mesh: DeviceMesh | None, submesh_names: str | Sequence[str] | None
) -> bool:
    """Tell whether every name in ``submesh_names`` is an axis (or flattened axis) of the mesh.

    ``None`` for either argument gives False.

    Raises:
        TypeError: if ``device_mesh`` is not a DeviceMesh or a name is not a str.
    """
    _check_mesh(device_mesh, "contains_submesh")
    if device_mesh is None or submesh_names is None:
        return False
    names = (submesh_names,) if isinstance(submesh_names, str) else tuple(submesh_names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"contains_submesh: submesh_names must hold str, got {name!r}")
    available = get_mesh_names(device_mesh)
    return all(name in available for name in names)
