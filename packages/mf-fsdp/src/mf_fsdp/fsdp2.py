"""FSDP2's interface on mf's engine: ``fully_shard(module, *, mesh=..., ...)`` applied in place.

A trainer written against PyTorch FSDP2 (torchtitan's ``parallelize``,
Accelerate) switches to mf's flat buckets by one import::

    from mf_fsdp.fsdp2 import fully_shard   # instead of torch.distributed.fsdp

Each call marks what it is given (a module, or a list of modules making one
unit) and swaps the module's class for an ``FSDPModule`` subclass, as FSDP2
does; the calls go per block, then on the root. The engine is mf's one
``MegatronFSDP`` (same buckets, hooks and collectives as ``mf_fsdp.fully_shard``),
built over the outermost marked module with every marked module inside it as a
unit, when the model is first used: ``parameters()`` / ``named_parameters()``
(the optimizer is built after wrapping, on them), ``state_dict()``,
``load_state_dict()``, a forward or an ``FSDPModule`` method. Until then the
parameters are the plain ones, so ``to_empty()`` and the model's init run on
them as usual (FSDP2 defers its own root set-up to the first forward too).
The optimizer sees parameter-shaped ``UnevenDTensor``s; state-dict keys are
the module's own.

[Note: what is honoured] Every public method of torch's ``FSDPModule`` is
either honoured through the engine or raises ``NotImplementedError`` naming
itself (``_UNSUPPORTED``); nothing silently does nothing. Options FSDP2 has
and mf cannot honour yet (``shard_placement_fn``, ``dp_mesh_dims``, an int
``reshard_after_forward`` other than 1 or the shard group's size, a mesh over
part of the ranks, units nested below others, a ``param_dtype_override_fn``
that splits one call's parameters over two compute dtypes) raise naming the
option. torch's free functions ``register_fsdp_forward_method`` and
``share_comm_ctx`` work on these modules through ``_get_fsdp_state``
(``fsdp2_state``); ``load_state_dict(assign=True)`` loads the values into the
engine's buffers, a meta-device model's included, and refuses another dtype.

This module builds no buckets and runs no collective itself; it must not
keep a second engine's state: everything lives in the ``MegatronFSDP``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from mf_fsdp.config import DistributedDataParallelConfig
from mf_fsdp.config import MixedPrecisionPolicy as EngineMixedPrecision
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.engine._tensor_tree import flatten
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP, check_module_to_wrap
from mf_fsdp.engine.unit import Unit
from mf_fsdp.fsdp2_state import TorchStateView
from mf_fsdp.optim.optimizer import bind_optimizers_at_step
from mf_utils import get_group_device

if TYPE_CHECKING:  # torch 2.15 has it; the floor of mf's range (2.11) does not
    from torch.distributed.fsdp import DataParallelMeshDims

__all__ = ["FSDPModule", "fully_shard"]

_RECORD_ATTR = "_mf_fsdp2_record"
_PENDING: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The first module of every ``fully_shard`` call whose engine is not built yet."""
_building = False
"""True while an engine is being built: its own parameter walks must not start another."""


@dataclass(eq=False)
class _Record:
    """One ``fully_shard`` call: its modules and options, and the engine once built."""

    modules: tuple[nn.Module, ...]
    mesh: DeviceMesh | None
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    engine: MegatronFSDP | None = None
    unit: Unit | None = None  # the engine's unit (None for the root, or a unit left no weight)
    is_root: bool = False
    hooks: list[Any] = field(default_factory=list)
    ignored_params: tuple[nn.Parameter, ...] = ()
    offload: bool = False  # CPUOffloadPolicy
    hook_ids: frozenset[int] = frozenset()  # the forward (pre-)hooks mf put on the modules
    state_view: TorchStateView | None = None  # what torch's free functions read (fsdp2_state)


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
        mesh: a 1-D mesh over every rank (shard), or a named 2-D one
            ``(replicate, shard)`` for HSDP; None: a 1-D mesh over the world.
        reshard_after_forward: True frees the unit's gathered weights after its
            forward (gathered again in backward); False keeps them until the
            backward. None means True. The root always keeps its own (as FSDP2's).
            An int is the group size to reshard to, as FSDP2's: the shard group's
            size means True, 1 means False; other sizes are not supported.
        shard_placement_fn: must be None (mf shards flat buckets by rows).
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
        dp_mesh_dims: must be None (torch 2.15's full SPMD mesh, whose parameters are
            DTensors over every dim, is not supported): pass the data-parallel mesh as
            ``mesh`` and tensor-parallel parameters as DTensors over their own tp mesh.

    Returns:
        ``module``, now an ``FSDPModule`` (each module of a list).

    Raises:
        TypeError: for a module that is not an ``nn.Module`` (or a list of them), or a
            policy of another type.
        ValueError: for a module already sharded.
        NotImplementedError: naming an option mf cannot honour yet.
    """
    modules = tuple(module) if isinstance(module, list | tuple) else (module,)
    if not modules:
        raise ValueError("fully_shard: module is an empty list; expected modules to shard")
    for item in modules:
        if not isinstance(item, nn.Module):
            raise TypeError(
                f"fully_shard: module must be an nn.Module or a list of them, got {item!r}"
            )
        if _RECORD_ATTR in item.__dict__:
            raise ValueError(
                f"fully_shard: {type(item).__name__} was already passed to fully_shard; "
                "expected each module once"
            )
        check_module_to_wrap(item)
    _check_options(mesh, shard_placement_fn, mp_policy, offload_policy, dp_mesh_dims)
    reshard = _reshard_flag(reshard_after_forward, mesh)
    record = _Record(modules, mesh, reshard, mp_policy)
    record.ignored_params = _ignored_tuple(ignored_params)
    record.offload = isinstance(offload_policy, CPUOffloadPolicy)
    for item in modules:
        item.__dict__[_RECORD_ATTR] = record
        # Only the casts the policy asks for: a hook that does nothing still costs a call.
        if mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None:
            record.hooks.append(
                item.register_forward_pre_hook(_cast_inputs(mp_policy), with_kwargs=True)
            )
        if mp_policy.output_dtype is not None:
            record.hooks.append(item.register_forward_hook(_cast_output(mp_policy)))
        item.__class__ = _fsdp_class(type(item))
    _PENDING.add(modules[0])
    return module


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
    if mesh is not None and mesh.ndim not in (1, 2):
        raise NotImplementedError(
            f"fully_shard: mesh has {mesh.ndim} dims; mf_fsdp.fsdp2 supports a 1-D mesh "
            "(shard) or a 2-D one (replicate, shard)"
        )
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} (parameters as DTensors over a full "
            "SPMD mesh) is not supported by mf_fsdp.fsdp2; expected None, the data-parallel "
            "mesh as mesh (1-D shard, or 2-D (replicate, shard)) and tensor-parallel "
            "parameters as DTensors over their own tp mesh"
        )
    if shard_placement_fn is not None:
        raise NotImplementedError(
            "fully_shard: shard_placement_fn is not supported by mf_fsdp.fsdp2 (mf shards each "
            "unit's flat bucket by rows, Shard(0)); expected None"
        )
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


def _reshard_flag(reshard_after_forward: object, mesh: DeviceMesh | None) -> bool:
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


def _cast_to(dtype: torch.dtype | None, tree: Any) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype`` (unchanged when None).

    Dataclass instances are looked into, as FSDP2 does (``engine._tensor_tree``).
    """
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    leaves, rebuild = flatten(tree)
    return rebuild([cast(leaf) for leaf in leaves])


def _cast_inputs(policy: MixedPrecisionPolicy) -> Callable[..., Any]:
    """FSDP2's ``cast_forward_inputs``: floating inputs in ``param_dtype``."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            return _cast_to(policy.param_dtype, (args, kwargs))
        return None

    return hook


def _cast_output(policy: MixedPrecisionPolicy) -> Callable[..., Any]:
    """FSDP2's ``output_dtype``: floating outputs in that dtype."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return None if policy.output_dtype is None else _cast_to(policy.output_dtype, output)

    return hook


# ---------------------------------------------------------------------- building the engine
def _record(module: nn.Module) -> _Record:
    return module.__dict__[_RECORD_ATTR]


def _ensure_built(module: nn.Module) -> MegatronFSDP:
    """The engine of ``module``'s model, built now if this is the model's first use."""
    record = _record(module)
    if record.engine is None and not _building:
        _build(_outermost(record))
    if record.engine is None:  # only inside a build, which never asks
        raise RuntimeError("mf_fsdp.fsdp2: the engine is being built")
    return record.engine


def _subtree(record: _Record) -> set[int]:
    return {id(m) for top in record.modules for m in nn.Module.modules(top)}


def _outermost(record: _Record) -> _Record:
    """The pending record whose modules contain ``record``'s, and no other contains."""
    pending = [_record(m) for m in list(_PENDING)]
    first = id(record.modules[0])
    outer = [r for r in pending if first in _subtree(r)]
    return max(outer, key=lambda r: len(_subtree(r)))


def _build(root: _Record) -> None:
    """Build one ``MegatronFSDP`` over ``root``'s module with the records inside as units."""
    global _building
    _building = True  # the engine's and this build's parameter walks must not start another
    try:
        _build_engine(root)
    finally:
        _building = False


def _build_engine(root: _Record) -> None:
    if len(root.modules) != 1:
        raise NotImplementedError(
            "fully_shard: the outermost call was on a list of modules; mf_fsdp.fsdp2 needs "
            "the outermost call on one module (the root, e.g. fully_shard(model))"
        )
    module = root.modules[0]
    inside = _subtree(root)
    units = [_record(m) for m in list(_PENDING) if _record(m) is not root and id(m) in inside]
    for unit in units:
        _check_same(root, unit)
    policies = _resolved_policies(module, root, units)
    hooks_before = _forward_hook_ids(module)
    engine_policy = _engine_policy(module, policies[id(root)])
    engine = MegatronFSDP(
        module,
        _dist_index(root.mesh),
        DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params",
            offload_optimizer_state=root.offload,
        ),
        sync_model_each_microbatch=True,
        mixed_precision_policy=engine_policy,
        unit_modules=[u.modules for u in units],
        ignored_params=list({id(p): p for r in (root, *units) for p in r.ignored_params}.values()),
        unit_mixed_precision={
            unit.modules[0]: _engine_policy(module, policies[id(unit)])
            for unit in units
            if _own_dtypes(policies[id(root)], policies[id(unit)])
        },
    )
    hook_ids = _forward_hook_ids(module) - hooks_before
    bind_optimizers_at_step(engine)  # the user's optimizer steps as mf_fsdp.fully_shard's
    by_module = {id(u.module): u for u in engine._units}
    root.is_root = True
    for record in (root, *units):
        record.engine = engine
        record.hook_ids = hook_ids | {handle.id for handle in record.hooks}
        _PENDING.discard(record.modules[0])
    for record in units:
        record.unit = by_module.get(id(record.modules[0]))
        if record.unit is not None:
            record.unit.reshard_after_forward = record.reshard_after_forward
    module.__dict__["_mf_fsdp2_engine"] = engine  # kept alive with the model


def _check_same(root: _Record, unit: _Record) -> None:
    """Units of one model share the mesh and the offload policy."""
    if unit.mesh is not root.mesh and unit.mesh is not None and root.mesh is not None:
        raise NotImplementedError(
            "fully_shard: mesh differs between calls on one model; mf_fsdp.fsdp2 needs the "
            "same mesh for every call"
        )
    if unit.offload != root.offload:
        raise NotImplementedError(
            "fully_shard: offload_policy differs between calls on one model (CPUOffloadPolicy "
            "on some, OffloadPolicy() on others); mf_fsdp.fsdp2 needs the same for every call"
        )


def _own_dtypes(root: MixedPrecisionPolicy, unit: MixedPrecisionPolicy) -> bool:
    """Whether a unit computes or reduces in other dtypes than the root (its own policy)."""
    return any(
        getattr(unit, name) != getattr(root, name) for name in ("param_dtype", "reduce_dtype")
    )


def _forward_hook_ids(module: nn.Module) -> set[int]:
    """The ids of every forward and forward-pre hook in ``module``'s tree (ids are unique)."""
    return {
        hook_id
        for sub in nn.Module.modules(module)
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks)
        for hook_id in hooks
    }


def _resolved_policies(
    module: nn.Module, root: _Record, units: list[_Record]
) -> dict[int, MixedPrecisionPolicy]:
    """Each call's policy (by record id) with ``param_dtype_override_fn`` applied.

    A unit's parameters are those of its modules; the root's are the rest, as the
    engine assigns them. Ignored parameters are not asked about.
    """
    ignored = {id(p) for r in (root, *units) for p in r.ignored_params}
    named = [(n, p) for n, p in nn.Module.named_parameters(module) if id(p) not in ignored]
    taken: set[int] = set()
    policies = {}
    for unit in units:
        own = {id(p) for m in unit.modules for p in nn.Module.parameters(m)}
        taken |= own
        mine = [(name, p) for name, p in named if id(p) in own]
        policies[id(unit)] = _resolve_override(unit.mp_policy, mine)
    rest = [x for x in named if id(x[1]) not in taken]
    policies[id(root)] = _resolve_override(root.mp_policy, rest)
    return policies


def _resolve_override(
    policy: MixedPrecisionPolicy, named: Iterable[tuple[str, nn.Parameter]]
) -> MixedPrecisionPolicy:
    """``policy`` with its ``param_dtype_override_fn`` (torch 2.15) decided for ``named``.

    The function may give each parameter None or ``param_dtype`` (compute in
    ``param_dtype``) or the parameter's own dtype (keep it), as FSDP2 allows. mf
    computes one call's parameters in one dtype, so they must all get the same.

    Raises:
        TypeError / ValueError: for an answer FSDP2 refuses too.
        NotImplementedError: if the call's parameters would compute in several dtypes.
    """
    override = getattr(policy, "param_dtype_override_fn", None)
    if override is None:
        return policy
    first: dict[torch.dtype, str] = {}  # compute dtype -> the first parameter given it
    for name, param in named:
        answer = override(param)
        if answer is not None and not isinstance(answer, torch.dtype):
            raise TypeError(
                f"fully_shard: mp_policy.param_dtype_override_fn returned {answer!r} for "
                f"{name}; expected a torch.dtype or None"
            )
        if answer not in (None, policy.param_dtype, param.dtype):
            raise ValueError(
                f"fully_shard: mp_policy.param_dtype_override_fn returned {answer} for {name} "
                f"({param.dtype}); expected None, param_dtype={policy.param_dtype} or "
                f"{param.dtype}"
            )
        compute = answer or policy.param_dtype or param.dtype
        first.setdefault(compute, name)
    if len(first) > 1:
        (a, a_name), (b, b_name) = list(first.items())[:2]
        raise NotImplementedError(
            f"fully_shard: mp_policy.param_dtype_override_fn gives {a_name} {a} but {b_name} "
            f"{b} in one fully_shard call; mf_fsdp.fsdp2 computes each call's parameters in "
            "one dtype: call fully_shard separately on the modules that keep their dtype"
        )
    compute = next(iter(first), policy.param_dtype)
    return dataclasses.replace(policy, param_dtype=compute, param_dtype_override_fn=None)


def _engine_policy(module: nn.Module, policy: MixedPrecisionPolicy) -> EngineMixedPrecision:
    """The engine's dtypes for torch's policy (the sharded weights keep the model's dtype)."""
    dtypes = {p.dtype for p in nn.Module.parameters(module) if p.is_floating_point()}
    if len(dtypes) > 1:
        raise NotImplementedError(
            f"fully_shard: the model's parameters have several dtypes {sorted(map(str, dtypes))}; "
            "mf_fsdp.fsdp2 needs one (the sharded weights keep it)"
        )
    main = dtypes.pop() if dtypes else torch.float32
    return EngineMixedPrecision(
        param_dtype=policy.param_dtype,
        main_params_dtype=main,
        grad_comm_dtype=policy.reduce_dtype or policy.param_dtype,
    )


def _dist_index(mesh: DeviceMesh | None) -> FSDPDistributedIndex:
    """The engine's index for FSDP2's mesh (1-D: shard; 2-D: replicate, shard)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if mesh is None:
        mesh = init_device_mesh(get_group_device(None).type, (world,), mesh_dim_names=("dp_shard",))
    if mesh.size() != world:
        raise NotImplementedError(
            f"fully_shard: mesh covers {mesh.size()} of {world} ranks; mf_fsdp.fsdp2 needs a "
            "mesh over every rank"
        )
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        if names is None:
            mesh = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=("dp_shard",))
            names = ("dp_shard",)
        return FSDPDistributedIndex(mesh, dp_shard_dim=names[0])
    if names is None:
        raise ValueError("fully_shard: a 2-D mesh needs dim names (replicate, shard)")
    return FSDPDistributedIndex(mesh, dp_shard_dim=names[1], dp_outer_dim=names[0])


# ---------------------------------------------------------------------- the module class
_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: ``FSDPModule`` first in the MRO, then ``cls`` (one class per ``cls``)."""
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy}
        )
    return _CLASSES[cls]


def _no_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise NotImplementedError(
        "deepcopy of a module sharded by mf_fsdp.fsdp2 is not supported (as with FSDP2); "
        "copy through its state_dict()"
    )


class FSDPModule(TorchFSDPModule):
    """What a module becomes under ``mf_fsdp.fsdp2.fully_shard``: torch's ``FSDPModule``, on mf.

    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` holds, as for FSDP2 (torch's
    DSD and DCP never look at it: DSD checks for FSDP1's wrapper class only; torch's
    pipelining schedules do, and then call these methods). Each method of torch's
    class is honoured through the engine or raises ``NotImplementedError`` naming
    itself (see [Note: what is honoured]).
    """

    _orig_cls_mro_index = 3  # [FSDP<Orig>, FSDPModule (mf), FSDPModule (torch), Orig, ...]

    # -- the module contract: the first use builds the engine
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Build the engine on the first call, then run the module (with its hooks)."""
        if self.__dict__[_RECORD_ATTR].engine is None:
            _ensure_built(self)
        return super().__call__(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters, sharded (parameter-shaped DTensors) between passes."""
        if not _building:
            _ensure_built(self)
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state dict: its own keys, sharded DTensor values."""
        engine = _ensure_built(self)
        with engine._forms.sharded():
            return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load any layout (sharded, other world size, full) into the engine's storage.

        ``assign=True`` (FSDP2's way to give a meta-device model its values without
        ``to_empty``) loads the same values: mf keeps every parameter in its flat
        buffers, so they are copied there (the parameter objects stay). A model
        built on the meta device gets storage first (``to_empty`` on the engine's
        device) and must then find every tensor in ``state_dict``. What assigning
        would change beyond the values, a tensor's dtype, is refused.

        Raises:
            TypeError: with ``assign=True``, for an entry whose dtype is not its tensor's.
            KeyError: with ``assign=True`` on a meta-device model, for a missing tensor.
        """
        engine = _ensure_built(self)
        if assign:
            _check_assignable(self, state_dict, meta=engine._awaiting_to_empty)
            if engine._awaiting_to_empty:
                engine.to_empty(device=engine.device)
        with engine._forms.sharded():
            return super().load_state_dict(state_dict, strict=strict)

    def _get_fsdp_state(self) -> TorchStateView:
        """What torch's ``register_fsdp_forward_method`` and ``share_comm_ctx`` read.

        torch's free functions over FSDP2 modules reach for FSDP2's state through this
        method; mf answers with a view over its engine (see ``fsdp2_state``).
        """
        _ensure_built(self)  # mf's hooks on the module are known once the engine is built
        record = self.__dict__[_RECORD_ATTR]
        if record.state_view is None:
            record.state_view = TorchStateView(_ensure_built, record.hook_ids)
        return record.state_view

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Any:
        """FSDP2's meta-device flow: storage for meta tensors, before or after sharding."""
        record = self.__dict__[_RECORD_ATTR]
        if record.engine is None:
            return super().to_empty(device=device, recurse=recurse)
        if not record.is_root:
            raise NotImplementedError(
                "to_empty on a block after the model was sharded: call it on the root"
            )
        record.engine.to_empty(device=device, recurse=recurse)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to()`` / ``.float()`` and the like: only before the parameters are sharded."""
        if self.__dict__[_RECORD_ATTR].engine is not None:
            raise NotImplementedError(
                "module.to() / .cuda() / .float() after mf_fsdp.fsdp2 sharded the model "
                "(its first parameters(), state_dict() or forward) is not supported; move or "
                "convert the model before"
            )
        return nn.Module._apply(self, fn, recurse)

    # -- FSDPModule's methods
    def _engine_and_record(self) -> tuple[MegatronFSDP, _Record]:
        engine = _ensure_built(self)
        return engine, self.__dict__[_RECORD_ATTR]

    def _records_below(self, recurse: bool) -> list[_Record]:
        """This call's record and, with ``recurse``, those of the FSDP modules inside it."""
        own = self.__dict__[_RECORD_ATTR]
        if not recurse:
            return [own]
        found = {id(own): own}
        for sub in nn.Module.modules(self):
            record = sub.__dict__.get(_RECORD_ATTR)
            if record is not None:
                found.setdefault(id(record), record)
        return list(found.values())

    def _units(self, recurse: bool) -> list[Unit]:
        """The engine's units of this call and, with ``recurse``, of those inside it.

        The root's own unit holds the parameters outside every other unit.
        """
        engine, _ = self._engine_and_record()
        units = [
            engine._root if record.is_root else record.unit
            for record in self._records_below(recurse)
        ]
        return [unit for unit in units if unit is not None]

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients in backward (True) or accumulate them locally (False).

        On the root with ``recurse`` (the default) it applies to the whole model, as
        mf's ``no_sync``: every unit's own setting returns to True. Otherwise it
        applies to this module's unit (and, with ``recurse``, the units inside it):
        a unit whose sync is off keeps its grads local across backwards and reduces
        them with its first backward whose sync is on (or before the optimizer step).
        """
        engine, record = self._engine_and_record()
        policy = engine.sync_policy
        flag = bool(requires_gradient_sync)
        if record.is_root and recurse:
            for unit in (engine._root, *engine._units):
                unit.requires_gradient_sync = True
            policy.suppressed = not flag
            policy.last_microbatch = flag
            return
        if flag and policy.suppressed:
            raise NotImplementedError(
                f"{type(self).__name__}.set_requires_gradient_sync(True) on one module while "
                "the root turned sync off for the whole model: mf cannot sync one unit then; "
                "turn it on at the root (recurse=True) first"
            )
        for unit in self._units(recurse):
            unit.requires_gradient_sync = flag

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) each unit's gathered weights after its forward."""
        if not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"set_reshard_after_forward({reshard_after_forward!r}): only a bool is supported"
            )
        self._engine_and_record()
        for record in self._records_below(recurse):
            record.reshard_after_forward = reshard_after_forward
            if record.unit is not None:
                record.unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free (True) or keep (False) the unit's gathered weights after its backward.

        A kept unit is reused by its next forward or backward, until ``reshard()``
        or the optimizer step (which changes its shards) releases it.
        """
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(
                "set_reshard_after_backward: reshard_after_backward must be a bool, got "
                f"{reshard_after_backward!r}"
            )
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's unit now (not recursive), as FSDP2's ``unshard``.

        With ``async_op`` the gather is started and a handle returned whose
        ``wait()`` finishes it (the unit's next use waits too); else None once done.
        """
        hooks = self._engine_and_record()[0]._unit_hooks
        waits = [hooks.unshard(unit, bool(async_op)) for unit in self._units(recurse=False)]
        return _Unshard(waits) if async_op else None

    def reshard(self) -> None:
        """Release this module's gathered weights now (not recursive), as FSDP2's ``reshard``."""
        hooks = self._engine_and_record()[0]._unit_hooks
        for unit in self._units(recurse=False):
            hooks.reshard(unit)

    def set_modules_to_forward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """Gather exactly ``modules``' units, coalesced, when this unit's forward gathers it.

        Replaces the default (the next units of the last forward's order that fit
        in the communication window); as FSDP2's, not on the root.
        """
        units = _prefetched_units(self, modules, "set_modules_to_forward_prefetch")
        for unit in self._units(recurse=False):
            unit.prefetch_forward = units

    def set_modules_to_backward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """Gather exactly ``modules``' units, coalesced, when this unit's backward gathers it.

        Replaces the default (the previous units of the forward's order that fit in
        the communication window); as FSDP2's, not on the root.
        """
        units = _prefetched_units(self, modules, "set_modules_to_backward_prefetch")
        for unit in self._units(recurse=False):
            unit.prefetch_backward = units

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce gradients as their sum over the data-parallel ranks divided by ``factor``.

        On the root: every unit; on another module it must match the model's factor.
        """
        engine, record = self._engine_and_record()
        if record.is_root:
            engine.set_gradient_divide_factor(factor)
        elif engine._gradient_divide_factor != factor:
            raise NotImplementedError(
                "set_gradient_divide_factor on a module other than the root: mf uses one "
                "factor per model; call it on the root"
            )


def _check_assignable(module: nn.Module, state_dict: Mapping[str, Any], meta: bool) -> None:
    """Refuse a ``load_state_dict(assign=True)`` that copying its values would not honour.

    An entry whose dtype differs from its tensor's; on a model built on the meta
    device (``meta``), a tensor the state dict leaves without a value.
    """
    engine = _ensure_built(module)
    with engine._forms.sharded():
        own = dict(nn.Module.state_dict(module, keep_vars=True))
    missing = sorted(own.keys() - state_dict.keys())
    if meta and missing:
        raise KeyError(
            f"load_state_dict(assign=True): the model was built on the meta device and the "
            f"state dict has no {missing[0]!r} ({len(missing)} missing); expected every "
            "parameter and buffer, or call model.to_empty() and initialise the rest first"
        )
    for key, value in state_dict.items():
        mine = own.get(key)
        if isinstance(value, torch.Tensor) and mine is not None and value.dtype != mine.dtype:
            raise TypeError(
                f"load_state_dict(assign=True): {key} is {value.dtype} in the state dict but "
                f"{mine.dtype} in the model; mf_fsdp.fsdp2 copies the values into its flat "
                "buffers and cannot take the state dict's dtype: cast the state dict, or load "
                "with assign=False"
            )


def _prefetched_units(owner: FSDPModule, modules: object, method: str) -> list[Unit]:
    """The engine's units of ``modules`` (FSDP modules of ``owner``'s model, not the root)."""
    engine, record = owner._engine_and_record()
    if record.is_root:
        raise NotImplementedError(
            f"{method} on the root: mf prefetches the root's window itself; set the list on "
            "the blocks"
        )
    if not isinstance(modules, list | tuple):
        raise TypeError(f"{method}: modules must be a list of FSDP modules, got {modules!r}")
    units = []
    for module in modules:
        other = module.__dict__.get(_RECORD_ATTR) if isinstance(module, nn.Module) else None
        if other is None or _ensure_built(module) is not engine or other.is_root:
            raise ValueError(
                f"{method}: {module!r} is not a non-root module sharded by "
                "mf_fsdp.fsdp2.fully_shard in this model"
            )
        if other.unit is not None:
            units.append(other.unit)
    return units


class _Unshard(UnshardHandle):
    """FSDP2's ``UnshardHandle`` for mf: ``wait()`` finishes the unit's gather."""

    def __init__(self, waits: list[Callable[[], None]]) -> None:
        self._waits = waits

    def wait(self) -> None:
        """Finish the gather (once); the unit's parameters hold the whole weights."""
        waits, self._waits = self._waits, []
        for wait in waits:
            wait()


_HONOURED = {
    name for name, value in vars(FSDPModule).items() if callable(value) and not name.startswith("_")
}
_UNSUPPORTED = sorted(
    name
    for name, value in vars(TorchFSDPModule).items()
    if callable(value) and not name.startswith("_") and name not in _HONOURED
)
"""Torch's ``FSDPModule`` methods mf cannot honour yet; each raises naming itself."""


class _Refused:
    """A method of torch's ``FSDPModule`` that mf refuses: calling it raises naming it.

    A descriptor rather than a function: the set follows the installed torch's class,
    so it is no part of mf's recorded API (``api.txt``).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(
        self, module: nn.Module | None, owner: type | None = None
    ) -> Callable[..., NoReturn]:
        name, shown = self.name, type(module).__name__ if module is not None else "FSDPModule"

        def method(*args: Any, **kwargs: Any) -> NoReturn:
            raise NotImplementedError(
                f"{shown}.{name} (FSDP2's FSDPModule.{name}) is not supported by mf_fsdp.fsdp2 yet"
            )

        method.__name__ = method.__qualname__ = name
        method.__doc__ = "Not supported by mf_fsdp.fsdp2 yet: raises ``NotImplementedError``."
        return method


for _name in _UNSUPPORTED:
    setattr(FSDPModule, _name, _Refused(_name))
del _name
