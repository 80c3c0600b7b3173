"""torch 2.15's ``dp_mesh_dims``: the engine mesh out of an SPMD storage mesh, and its parameters.

``dp_mesh_dims`` (``DataParallelMeshDims``) hands FSDP2 the whole dense storage
mesh and names which of its dims are the shard and the replicate dims. The shard
dims are joined (flattened when several) and the replicate dim is the outer one.
The storage mesh's other dim of more than one rank, if any, is the
tensor-parallel dim: the engine mesh is then (replicate, shard, tp), joined by
``DeviceMesh._concatenate`` as FSDP2 joins a dp mesh with a tp mesh, so the
engine's groups are the storage mesh's own.

torchtitan's default ``spmd_types`` backend gives plain parameters (each rank's
tensor-parallel piece) annotated with spmd_types' per-axis types, and its model
code runs its own tensor-parallel collectives on plain tensors. mf serves that
with the mf-tp attribute protocol (``mf_utils``), which the engine already
shards and reduces plain tensor-parallel parameters by. Each parameter's type on
the tp dim says how, following spmd_types' typed backward as FSDP2 does:

- ``S(d)`` (or a ``PartitionSpec`` naming the tp axis at dim ``d``): split along
  ``d``; its gradient is its own piece's;
- ``R``: the same value on every tp rank, and a *partial* gradient (``R``'s
  backward type is ``P``): marked ``sequence_parallel`` so the engine sums it
  over the tp group before the data-parallel reduction;
- ``I``: the same value and the same gradient on every tp rank: no tp sum.

The annotations are read at the ``fully_shard`` call (``read_annotations``), as
FSDP2 reads them there: ``to_empty`` on a model built on the meta device makes
new parameter objects without them before mf's engine is built. At the build
each parameter gets its marks and its annotation back (``storage_roles``). The
parameters stay plain tensors, so the module computes with plain tensors that
carry their annotation (the engine swaps ``.data``, never the parameter object),
as FSDP2 restores it on its unsharded parameters. Every other annotated axis
must be ``R`` (FSDP2 owns the data-parallel reduction). A parameter without a
tp type and a storage mesh with more than one such dim stop with one line
naming the mesh.

torchtitan's ``full_dtensor`` backend gives DTensors over the whole storage
mesh, ``Replicate()`` on the dp dims and the tp placement on the tp dim, and
its activations are such DTensors too (inputs ``Shard(0)`` on the dp dims, the
loss a sum ``Partial()`` there). Read at the call (``_check_storage_dtensors``:
every parameter one, over the mesh, ``Replicate()`` on each dp dim); a DTensor
keeps its placements through ``to_empty``, so nothing is kept for the build.
At the build each gets ``DP_DIMS_ATTR`` (the dims the engine reduces itself:
the dp dims, and any of one rank) and a grad hook (``dp_partial_grad``), and
the engine's DTensor path (``buckets/tp_params.py``) serves the rest: the
module computes with the parameter object itself, a storage-mesh DTensor whose
local tensor is a view of the gathered bucket, as FSDP2's unsharded parameter;
the hook redistributes a grad's other dims only (the tp sum a ``Replicate()``
weight's ``Partial()`` grad needs) and hands the engine its local tensor as
``Partial()`` on the dp dims, whatever it said there, as FSDP2 reads it, so
autograd's accumulation into the engine's buffer adds local tensors and the
engine's reduce-scatter (and replicate all-reduce) is the only dp reduction.
The tp dim is that of the spmd_types path (the engine mesh above), so the
sharded parameters lie on the same meshes as FSDP2's.

Nothing here communicates or makes a group except ``_flat`` (``DeviceMesh._flatten``,
on every rank of the mesh at once, as every rank builds its engine at its first use).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from mf_fsdp.buckets.tp_params import DP_DIMS_ATTR, dp_partial_grad
from mf_fsdp.fsdp2.engine_mesh import EngineMesh
from mf_utils import set_tensor_model_parallel_attributes

__all__ = ["SpmdAnnotation", "read_annotations", "storage_roles"]

_SERVED = (
    "mf_fsdp.fsdp2 serves plain parameters there, spmd_types-annotated on the one other "
    "dim of several ranks if any (torchtitan's default spmd_types backend), DTensors over "
    "the storage mesh Replicate() on its data-parallel dims (full_dtensor), and a dp mesh "
    "beside DTensors over a tp mesh (partial_dtensor)"
)


@dataclass(frozen=True, slots=True)
class SpmdAnnotation:
    """One parameter's spmd_types annotation, as read at its ``fully_shard`` call.

    ``tp`` is its type on the tp dim: the dim it is split along, ``"R"`` or ``"I"``;
    ``local_type`` and ``partition_spec`` are the annotation itself, put back on the
    parameter the engine shards (a new object after ``to_empty``).
    """

    tp: int | Literal["R", "I"]
    local_type: dict[Any, Any]
    partition_spec: Any


def read_annotations(
    mesh: DeviceMesh, dims: Any, modules: Iterable[nn.Module], ignored: AbstractSet[int]
) -> list[tuple[nn.Module, str, SpmdAnnotation]]:
    """Each parameter's annotation and type on the storage mesh's tp dim, at the call.

    Read then, as FSDP2 reads them: ``to_empty`` (a model built on the meta device)
    makes new parameter objects without the annotations, before mf's engine is built.
    Empty without exactly one tp dim, or for dims the mesh lacks (``storage_roles``
    judges those meshes).

    Raises:
        NotImplementedError: one line naming the mesh (and the parameter): for DTensor
            parameters (torchtitan's ``full_dtensor``) beside plain ones, over another
            mesh, or not ``Replicate()`` on a data-parallel dim; for a plain parameter
            without ``S(dim)``, ``R`` or ``I`` on the tp dim, or typed other than ``R``
            elsewhere.
    """
    where = f"fully_shard: mesh {mesh} with dp_mesh_dims={dims!r}"
    params = [found for m in modules for found in _named(m) if id(found[-1]) not in ignored]
    if any(isinstance(param, DTensor) for *_, param in params):
        _check_storage_dtensors(mesh, dims, params, where)
        return []  # a DTensor keeps its mesh and placements through to_empty
    tp = _tp_dims(mesh, dims)
    named = (*_names(getattr(dims, "shard", None)), *_names(getattr(dims, "replicate", None)))
    if len(tp) != 1 or any(name not in (mesh.mesh_dim_names or ()) for name in named):
        return []
    spmd = _spmd_types(where)
    tp_axis = spmd.MeshAxis.of(mesh.get_group(tp[0]))
    found = []
    for owner, path, name, param in params:
        fqn = f"{path}.{name}" if path else name
        what = f"{where}: parameter {fqn!r}"
        local_type = dict(spmd.get_local_type(param))
        spec = spmd.get_partition_spec(param)
        kind = _tp_type(spmd, local_type, spec, param.dim(), tp_axis, what)
        found.append((owner, name, SpmdAnnotation(kind, local_type, spec)))
    return found


def _check_storage_dtensors(
    mesh: DeviceMesh,
    dims: Any,
    params: list[tuple[nn.Module, str, str, nn.Parameter]],
    where: str,
) -> None:
    """Refuse DTensor parameters mf cannot serve as storage-mesh DTensors (``full_dtensor``).

    Each must be a DTensor over ``mesh`` itself (equal: torchtitan slices one
    storage mesh for the model and the call), ``Replicate()`` on every dim
    ``dims`` names, as FSDP2 requires.
    """
    names = tuple(mesh.mesh_dim_names or ())
    data_parallel = _data_parallel(dims)
    for _, path, name, param in params:
        fqn = f"{path}.{name}" if path else name
        what = f"{where}: parameter {fqn!r}"
        if not isinstance(param, DTensor):
            problem = "is a plain tensor beside DTensor parameters"
        elif param.device_mesh != mesh:
            problem = f"is a DTensor over {param.device_mesh}, not over the storage mesh"
        else:
            placed = [
                f"{dim}={placement!r}"
                for dim, placement in zip(names, param.placements, strict=True)
                if dim in data_parallel and not isinstance(placement, Replicate)
            ]
            if not placed:
                continue
            problem = f"is placed {', '.join(placed)} on a data-parallel dim"
        raise NotImplementedError(
            f"{what} {problem}; expected Replicate() there (FSDP shards it); {_SERVED}"
        )


def _tp_type(
    spmd: Any, local_type: dict[Any, Any], spec: Any, ndim: int, tp_axis: Any, what: str
) -> int | Literal["R", "I"]:
    """A parameter's annotated type on ``tp_axis``: its split dim, ``"R"`` or ``"I"``."""
    types = dict(local_type)
    if spec is not None:
        types.update(
            importlib.import_module("spmd_types.types").partition_spec_to_shard_types(spec)
        )
    kind = types.pop(tp_axis, None)
    if any(other is not spmd.PerMeshAxisLocalSpmdType.R for other in types.values()):
        raise NotImplementedError(
            f"{what} is typed {types} off the tp dim; expected R there (FSDP reduces the "
            f"data-parallel grads); {_SERVED}"
        )
    if isinstance(kind, spmd.Shard):
        return kind.dim % max(ndim, 1)
    if kind is spmd.PerMeshAxisLocalSpmdType.R:
        return "R"
    if kind is spmd.PerMeshAxisLocalSpmdType.I:
        return "I"
    raise NotImplementedError(
        f"{what} is typed {kind} on the tp dim; expected S(dim), R or I; {_SERVED}"
    )


def storage_roles(
    mesh: DeviceMesh,
    params: list[nn.Parameter],
    dims: Any,
    annotations: dict[int, SpmdAnnotation],
) -> EngineMesh:
    """The engine mesh for a storage ``mesh`` with ``dp_mesh_dims=dims``; marks the parameters.

    Args:
        mesh: the storage mesh (named dims).
        params: the dense parameters the engine will shard.
        dims: the ``DataParallelMeshDims``.
        annotations: by ``id`` of the parameter, what ``read_annotations`` read for it.

    Raises:
        ValueError: for dims the mesh lacks.
        NotImplementedError: one line naming the mesh, for a layout mf does not serve.
    """
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
    if not shard:
        raise NotImplementedError(
            f"{where}: replication alone (DDP) is not supported by mf_fsdp.fsdp2; expected a "
            "shard dim"
        )
    others = _tp_dims(mesh, dims)
    if len(others) > 1:
        raise NotImplementedError(f"{where}: the dims {others} are not supported; {_SERVED}")
    tp = others[0] if others else None
    left_out = frozenset(
        i for i, name in enumerate(names) if name in (*shard, *replicate) or mesh[name].size() == 1
    )
    for param in params:  # full_dtensor: the engine leaves these dims to itself
        if isinstance(param, DTensor) and not hasattr(param, DP_DIMS_ATTR):  # once
            setattr(param, DP_DIMS_ATTR, left_out)
            param.register_hook(dp_partial_grad(param))
    if tp is not None:
        for param in params:
            if isinstance(param, DTensor):
                continue
            if id(param) not in annotations:
                raise NotImplementedError(
                    f"{where}: a parameter of shape {tuple(param.shape)} was not under a "
                    f"fully_shard call (its spmd_types type is read there); {_SERVED}"
                )
            _mark(param, annotations[id(param)])
    shard_mesh = _flat(mesh, shard)
    parts = [_flat(mesh, replicate)] if replicate else []
    parts += [shard_mesh, mesh[tp]] if tp is not None else [shard_mesh]
    if len(parts) == 1:
        return EngineMesh(shard_mesh, _only_name(shard_mesh))
    joined = DeviceMesh._concatenate(parts)
    outer = (joined.mesh_dim_names or (None,))[0] if replicate else None
    return EngineMesh(joined, _only_name(shard_mesh), outer, tp)


def _data_parallel(dims: Any) -> tuple[str, ...]:
    """The dims ``dims`` names: its shard dims, then its replicate dim."""
    return (*_names(getattr(dims, "shard", None)), *_names(getattr(dims, "replicate", None)))


def _tp_dims(mesh: DeviceMesh, dims: Any) -> list[str]:
    """The storage mesh's dims of more than one rank that ``dims`` does not name."""
    data_parallel = _data_parallel(dims)
    names = mesh.mesh_dim_names or ()
    return [name for name in names if name not in data_parallel and mesh[name].size() > 1]


def _mark(param: nn.Parameter, annotation: SpmdAnnotation) -> None:
    """The mf-tp marks ``annotation``'s tp type means, and the annotation itself, put back.

    Both once: a second engine over the same parameters finds them set.
    """
    if hasattr(param, "tensor_model_parallel"):
        return
    kind = annotation.tp
    dim = kind if isinstance(kind, int) else -1
    set_tensor_model_parallel_attributes(param, dim >= 0, dim, 1)
    if kind == "R":  # backward type P: partial grads, summed over the tp group
        param.sequence_parallel = True  # type: ignore[attr-defined]
    spmd = _spmd_types("fully_shard")
    if annotation.local_type and not spmd.get_local_type(param):  # to_empty dropped it
        spmd.assert_type(param, annotation.local_type, partition_spec=annotation.partition_spec)


def _spmd_types(where: str) -> Any:
    """spmd_types, imported only for a storage mesh with a tp dim (it is torchtitan's)."""
    try:
        return importlib.import_module("spmd_types")
    except ImportError as error:
        raise NotImplementedError(
            f"{where}: a tensor-parallel dim needs spmd_types' annotations on the parameters, "
            f"and spmd_types does not import ({error})"
        ) from None


def _named(module: nn.Module) -> Iterable[tuple[nn.Module, str, str, nn.Parameter]]:
    """Each parameter under ``module``: its owner, the owner's path, its name, itself."""
    for path, owner in module.named_modules():
        for name, param in owner._parameters.items():
            if param is not None:
                yield owner, path, name, param


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _flat(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh``'s dims ``names`` as one dim (the dim itself when there is one)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def _only_name(mesh: DeviceMesh) -> str | None:
    return (mesh.mesh_dim_names or (None,))[0]
