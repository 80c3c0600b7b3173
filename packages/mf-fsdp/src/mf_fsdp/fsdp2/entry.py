"""FSDP2's ``fully_shard`` on mf: check the call's options, mark its modules, swap their class.

``fully_shard(module, *, mesh=..., ...)`` does at the call only what FSDP2 does
eagerly and mf can honour: it refuses an option mf cannot honour, naming it (see
[Note: what is honoured]); leaves a ``CallRecord`` on each module it was given and
links the pending records below it (``records.py``); registers the policy's input
and output casts (``mixed_precision.py``); and makes each module's class an
``FSDPModule`` subclass (``module.py``); and lists each module under ``fully_shard``
in torch's composable registry, as FSDP2's ``contract`` does, so torch's
``replicate()`` leaves its parameters to mf. The engine is built later, at the
model's first use.

Invariants: a module is passed to ``fully_shard`` once; every check that needs no
engine runs here, before anything is marked, so a refused call leaves the module
as it was. This module builds no engine, moves no parameter and runs no
collective.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from mf_fsdp.engine.megatron_fsdp import check_module_to_wrap
from mf_fsdp.fsdp2.mixed_precision import cast_inputs, cast_output
from mf_fsdp.fsdp2.module import fsdp_class
from mf_fsdp.fsdp2.placement import check_answer, check_placement_fn
from mf_fsdp.fsdp2.records import RECORD_ATTR, CallRecord, link_pending
from mf_fsdp.fsdp2.storage_mesh import read_annotations

if TYPE_CHECKING:  # torch 2.15 has it; the floor of mf's range (2.11) does not
    from torch.distributed.fsdp import DataParallelMeshDims

__all__ = ["fully_shard", "reshard_flag"]

_COMPOSABLE_NAME = "fully_shard"
"""The name under which torch's composable registry lists a module sharded by FSDP2.

torch's ``replicate()`` leaves such a module's parameters to it (its DDP reducer
never takes them), and tools that read the registry see the module as FSDP2's.
"""


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen, as torch's)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen, as torch's)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module`` with mf's flat-bucket engine, in place, as FSDP2's ``fully_shard``.

    Call it on each block, then on the root (torchtitan's order); a list of modules
    makes one unit (gathered and released together). The module's class becomes a
    subclass of torch's ``FSDPModule``. Build the optimizer afterwards on
    ``model.parameters()``.

    Args:
        module: a module, or a list of modules forming one unit.
        mesh: a 1-D mesh (shard), or a named 2-D one ``(replicate, shard)`` for
            HSDP, over every rank or part of them; None: a 1-D mesh over the world.
            DTensor parameters' tp mesh is joined to it (see ``meshes.py``).
        reshard_after_forward: True frees the unit's gathered weights after its
            forward (gathered again in backward); False keeps them until the
            backward. None means True. The root always keeps its own (as FSDP2's).
            An int is the group size to reshard to, as FSDP2's: the shard group's
            size means True, 1 means False; other sizes are not supported.
        shard_placement_fn: FSDP2's, asked for each parameter of the call when the
            engine is built (its first use): None or ``Shard(dim)`` keeps the parameter
            on ``mesh``, sharded by mf's whole rows whatever the dim (the values users
            see are the same); torch 2.15's ``ShardPlacementResult`` naming another
            1-D mesh puts a DTensor parameter (experts over an ``ep`` mesh) on that
            mesh's group, sharded, reduced and averaged there (see ``placement.py``).
        mp_policy: torch's ``MixedPrecisionPolicy``: ``param_dtype`` (compute),
            ``reduce_dtype`` (gradient reduction; default ``param_dtype``),
            ``output_dtype`` and ``cast_forward_inputs`` as in FSDP2; torch 2.15's
            ``param_dtype_override_fn`` too, called on each parameter of the call when
            the engine is built (its first use), as long as it picks one compute dtype
            for all of them: mf computes a unit in one dtype (call ``fully_shard``
            separately on the modules whose parameters keep their dtype).
        offload_policy: torch's ``OffloadPolicy()`` (no offload) or
            ``CPUOffloadPolicy``: mf's ``offload_optimizer_state``, the sharded
            parameters (fp32 main weights), their grads and the optimizer state in
            host memory, the step on the host; the device keeps the compute-dtype
            shard the all-gather reads. Host buffers are pinned on CUDA whatever
            ``pin_memory`` says. The same policy for every call on one model.
        ignored_params: parameters left out of sharding, as FSDP2's: plain tensors
            on every rank, never gathered or reduced (their grads are each rank's
            own; syncing them, e.g. with DDP, is the caller's). The calls on one
            model may each pass some; the engine ignores all of them.
        dp_mesh_dims: torch 2.15's ``DataParallelMeshDims``: ``mesh`` is then the whole
            SPMD storage mesh and this names its shard dims (joined into one) and its
            replicate dim. Served for plain parameters, spmd_types-annotated on a
            tensor-parallel dim if the mesh has one (torchtitan's default backend), and for
            DTensors over the mesh, ``Replicate()`` on the dims it names (``full_dtensor``):
            see ``storage_mesh.py``.

    Returns:
        ``module``, now an ``FSDPModule`` (each module of a list).

    Raises:
        TypeError: for a module that is not an ``nn.Module`` (or a list of them), or a
            policy of another type.
        AssertionError: for a module already passed to ``fully_shard``, or a 2-D mesh
            without dim names (FSDP2's types).
        ValueError: for a module another engine manages, a ``ModuleList``/``ModuleDict``
            without a forward, a scalar parameter, or a mesh of 3 or more dims.
        NotImplementedError: for a non-contiguous parameter, or naming an option mf
            cannot honour yet.
    """
    modules = tuple(module) if isinstance(module, list | tuple) else (module,)
    if not modules:
        raise ValueError("fully_shard: module is an empty list; expected modules to shard")
    for item in modules:
        if not isinstance(item, nn.Module):
            raise TypeError(
                f"fully_shard: module must be an nn.Module or a list of them, got {item!r}"
            )
        if RECORD_ATTR in item.__dict__ or _COMPOSABLE_NAME in (_get_registry(item) or {}):
            # FSDP2's type (torch's composable ``contract`` asserts it), mf's line.
            raise AssertionError(
                f"fully_shard: {type(item).__name__} was already passed to fully_shard; "
                "expected each module once. Each distinct composable distributed API can only "
                "be applied to a module once."
            )
        check_module_to_wrap(item)
        _check_container(item)
    _check_options(mesh, shard_placement_fn, mp_policy, offload_policy, dp_mesh_dims)
    reshard = reshard_flag(reshard_after_forward, mesh)
    ignored = _ignored_tuple(ignored_params)
    for item in modules:
        _check_param_shapes(item, ignored, shard_placement_fn)
    record = CallRecord(modules, mesh, reshard, mp_policy)
    record.ignored_params = ignored
    record.offload = isinstance(offload_policy, CPUOffloadPolicy)
    record.shard_placement_fn = shard_placement_fn
    record.dp_mesh_dims = dp_mesh_dims
    if mesh is not None and dp_mesh_dims is not None:  # read before to_empty drops them
        record.annotations = read_annotations(mesh, dp_mesh_dims, modules, {id(p) for p in ignored})
    registry_item = RegistryItem()  # one per call, as torch's composable contract shares it
    for item in modules:
        item.__dict__[RECORD_ATTR] = record
        item.__dict__.setdefault(REGISTRY_KEY, OrderedDict())[_COMPOSABLE_NAME] = registry_item
        # Only the casts the policy asks for: a hook that does nothing still costs a call.
        if mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None:
            record.hooks.append(
                item.register_forward_pre_hook(cast_inputs(mp_policy), with_kwargs=True)
            )
        if mp_policy.output_dtype is not None:
            record.hooks.append(item.register_forward_hook(cast_output(mp_policy)))
        item.__class__ = fsdp_class(type(item))
    link_pending(record)  # the pending calls below now reach their root through it
    return module


def _check_container(module: nn.Module) -> None:
    """Refuse a ``ModuleList``/``ModuleDict`` without a forward, as FSDP2 does.

    Such a container is never called, so no hook of its unit would ever run.

    Raises:
        ValueError: naming the container's class (FSDP2's type).
    """
    if (
        isinstance(module, nn.ModuleList | nn.ModuleDict)
        and type(module).forward is nn.Module.forward
    ):
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: got a "
            f"{type(module).__name__}; expected a module with a forward (shard its items, or "
            "pass them as a list)"
        )


def _state(module: nn.Module) -> Any:
    """``fully_shard.state(module)``, as torch's composable API gives FSDP2's state.

    The state of the ``fully_shard`` call ``module`` was given to (one per call,
    the view torch's free functions read through ``_get_fsdp_state``), or None for
    a module no call was given. Building it builds the model's engine.
    """
    if RECORD_ATTR not in module.__dict__:
        return None
    return module._get_fsdp_state()  # type: ignore[operator]


fully_shard.state = _state  # type: ignore[attr-defined]


def _check_param_shapes(
    module: nn.Module,
    ignored: tuple[nn.Parameter, ...],
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
) -> None:
    """Refuse a parameter ``module``'s call would shard as FSDP2 does, at the call.

    mf's buckets hold whole dim-0 rows of contiguous tensors: a 0-d parameter has no
    row and a strided one no row-major layout to cut (FSDP2 refuses both too). FSDP2
    also asks ``shard_placement_fn`` here, for the parameters the call manages (not
    those of a module already passed to ``fully_shard``), and refuses an answer it
    cannot shard by; mf asks again when it builds the engine, where the mesh is used.

    Raises:
        ValueError: for a scalar parameter (FSDP2's type).
        NotImplementedError: for a non-contiguous one (FSDP2's type).
        AssertionError: for a ``shard_placement_fn`` answer FSDP2 refuses (its type).
    """
    skip = {id(param) for param in ignored}
    for sub in module.modules():
        if sub is not module and RECORD_ATTR in sub.__dict__:
            skip.update(id(param) for _, param in nn.Module.named_parameters(sub))
    for name, param in nn.Module.named_parameters(module):
        if id(param) in skip:
            continue
        if param.ndim == 0:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters: {name} has shape (); "
                f"expected at least 1 dim. Change {name} to a 1D tensor with numel equal to 1."
            )
        if not param.is_contiguous():
            raise NotImplementedError(
                f"fully_shard: FSDP does not support non-contiguous parameters: {name} has "
                f"shape {tuple(param.shape)} and stride {param.stride()}; expected a "
                "contiguous tensor (call .contiguous() on it before fully_shard)"
            )
        if shard_placement_fn is not None:
            check_answer(name, param, shard_placement_fn(param))


def _ignored_tuple(ignored_params: object) -> tuple[nn.Parameter, ...]:
    """``ignored_params`` as a tuple (None: none).

    Raises:
        TypeError: if it is not a collection of tensors.
    """
    if ignored_params is None:
        return ()
    if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, Collection):
        raise TypeError(
            f"fully_shard: ignored_params must be a set of parameters, got {ignored_params!r}"
        )
    params = tuple(ignored_params)
    wrong = next((p for p in params if not isinstance(p, torch.Tensor)), None)
    if wrong is not None:
        raise TypeError(f"fully_shard: ignored_params holds {wrong!r}; expected parameters")
    return params


def _check_options(
    mesh: object,
    shard_placement_fn: object,
    mp_policy: object,
    offload_policy: object,
    dp_mesh_dims: object,
) -> None:
    """Raise naming the first option mf cannot honour (see [Note: what is honoured])."""
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh or None, got {mesh!r}")
    if mesh is not None and dp_mesh_dims is None and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim} dims); "
            "expected a 1-D mesh (shard) or a 2-D one (replicate, shard)"
        )
    if mesh is not None and dp_mesh_dims is None and mesh.ndim == 2 and not mesh.mesh_dim_names:
        # FSDP2's type for this mistake; mf's line names what to pass.
        raise AssertionError(
            "fully_shard: mesh is 2-D without mesh_dim_names; expected init_device_mesh(..., "
            "mesh_dim_names=(replicate, shard)). Please init the 2D mesh for HSDP with "
            "mesh_dim_names specified"
        )
    if dp_mesh_dims is not None:
        _check_mesh_dims(mesh, dp_mesh_dims)
    check_placement_fn(shard_placement_fn)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "fully_shard: mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{mp_policy!r}"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "fully_shard: offload_policy must be torch.distributed.fsdp.OffloadPolicy, got "
            f"{offload_policy!r}"
        )
    if type(offload_policy) not in (OffloadPolicy, CPUOffloadPolicy):
        raise NotImplementedError(
            f"fully_shard: offload_policy={type(offload_policy).__name__} is not supported by "
            "mf_fsdp.fsdp2; expected OffloadPolicy() (no offload) or CPUOffloadPolicy()"
        )


def reshard_flag(reshard_after_forward: object, mesh: DeviceMesh | None) -> bool:
    """FSDP2's ``reshard_after_forward`` as a bool: None and True free, False keeps.

    An int is the size of the group the weights are resharded to after forward:
    the shard group's own size is True, 1 (no resharding) is False, as FSDP2
    reads them; another factor of the shard group's size would need a second,
    smaller gather group, which mf does not have.
    """
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward is not False
    if not isinstance(reshard_after_forward, int):
        raise TypeError(
            "fully_shard: reshard_after_forward must be a bool, an int or None, got "
            f"{reshard_after_forward!r}"
        )
    if mesh is not None:
        size = mesh.size(mesh.ndim - 1)
    elif dist.is_initialized():
        size = dist.get_world_size()
    else:
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first"
        )
    if reshard_after_forward < 1 or size % reshard_after_forward:
        raise ValueError(
            f"fully_shard: reshard_after_forward={reshard_after_forward}: an int must divide "
            f"the shard group's size {size}"
        )
    if reshard_after_forward in (1, size):
        return reshard_after_forward == size
    raise NotImplementedError(
        f"fully_shard: reshard_after_forward={reshard_after_forward} (reshard to a group of "
        f"{reshard_after_forward} of the {size} shard ranks) is not supported by mf_fsdp.fsdp2; "
        f"expected True, False, {size} or 1"
    )


def _check_mesh_dims(mesh: DeviceMesh | None, dp_mesh_dims: object) -> None:
    """Refuse a ``dp_mesh_dims`` of another type, or without a named ``mesh`` to name dims of."""
    if not hasattr(dp_mesh_dims, "shard") or not hasattr(dp_mesh_dims, "replicate"):
        raise TypeError(
            f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims or None, got "
            f"{dp_mesh_dims!r}"
        )
    if mesh is None or mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} names dims of mesh, got mesh={mesh}; "
            "expected the named SPMD storage mesh"
        )
