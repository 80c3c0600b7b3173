"""What each ``fully_shard`` call marked, and the one engine built over a model at its first use.

Every call of ``mf_fsdp.fsdp2.fully_shard`` leaves a ``CallRecord`` on each module
it was given (``module.__dict__[RECORD_ATTR]``), as FSDP2 keeps its state on the
module: the call's modules and options and, once built, the model's
``MegatronFSDP`` and the call's unit of it. A record is *pending* until its
model's engine is built.

Finding a model's records needs nothing outside its modules:

- downwards, a walk of a module's submodules finds every record below it;
- upwards, the pending records of one model share a *family* (one list): a call
  on a module that holds pending records (FSDP2's order: the blocks, then the
  root) joins their families (``link_pending``), so a block used first
  (``parameters()``, a prefetch list set before the first forward) finds its
  root among its family: the largest pending record around its first module.

The first use of any marked module (``ensure_built``) builds one ``MegatronFSDP``
over that outermost pending record: its module is the engine's module, and every
pending record whose first module lies below it is a unit, in module order. While
a build runs its records are ``building``, so the engine's own parameter walks
start no other build. A root marked before its blocks takes them as units at its
own first use; a block used before such a root cannot see it (torch's FSDP2
refuses that order outright).

Invariants: records live only on the modules (and the records that point at
them), never in a module global, so two models, or the models of two tests in
one interpreter, never see each other's pending marks, and a model dropped
before its first use is collected with its records. Every record of one model
gets its engine at once. This module builds no bucket and runs no collective
itself (the engine does), registers no hook of its own, and never swaps a
module's class (``module.py`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.distributed._composable.contract import _get_registry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from mf_fsdp.config import DistributedDataParallelConfig
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP
from mf_fsdp.engine.unit import Unit
from mf_fsdp.fsdp2.meshes import call_mesh, dist_index, mesh_roles
from mf_fsdp.fsdp2.mixed_precision import engine_policy, own_dtypes, resolve_policies
from mf_fsdp.fsdp2.placement import place_params
from mf_fsdp.fsdp2.storage_mesh import SpmdAnnotation
from mf_fsdp.optim.optimizer import bind_optimizers_at_step

if TYPE_CHECKING:
    from mf_fsdp.fsdp2.torch_state import TorchStateView

__all__ = [
    "RECORD_ATTR",
    "CallRecord",
    "engine_or_none",
    "ensure_built",
    "link_pending",
    "record_of",
]

RECORD_ATTR = "_mf_fsdp2_record"
"""The key of a marked module's ``__dict__`` that holds its call's ``CallRecord``."""
_ENGINE_ATTR = "_mf_fsdp2_engine"
"""The key of the root module's ``__dict__`` that keeps its engine alive with the model."""


@dataclass(eq=False)
class CallRecord:
    """One ``fully_shard`` call: its modules and options, and the engine once built."""

    modules: tuple[nn.Module, ...]
    mesh: DeviceMesh | None
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    unshard_in_backward: bool = True  # set_unshard_in_backward, given to the unit at the build
    engine: MegatronFSDP | None = None
    unit: Unit | None = None  # the engine's unit (None for the root, or a unit left no weight)
    is_root: bool = False
    hooks: list[Any] = field(default_factory=list)
    ignored_params: tuple[nn.Parameter, ...] = ()
    offload: bool = False  # CPUOffloadPolicy
    dp_mesh_dims: Any = None  # torch 2.15's DataParallelMeshDims (see meshes.py)
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None  # asked at the build
    # spmd_types' annotations, read at the call (storage_mesh.read_annotations)
    annotations: list[tuple[nn.Module, str, SpmdAnnotation]] = field(default_factory=list)
    hook_ids: AbstractSet[int] = frozenset()  # the forward (pre-)hooks mf put on the modules
    state_view: TorchStateView | None = None  # what torch's free functions read (torch_state)
    building: bool = False  # its model's engine is being built now
    inert: bool = False  # its model has no parameter to shard: no engine, a plain module
    family: list[CallRecord] = field(default_factory=list, repr=False)  # see link_pending

    def __post_init__(self) -> None:
        self.family.append(self)


def record_of(module: nn.Module) -> CallRecord:
    """The record of the ``fully_shard`` call that marked ``module``."""
    return module.__dict__[RECORD_ATTR]


def _below(record: CallRecord) -> Iterator[tuple[nn.Module, CallRecord]]:
    """Each marked module in ``record``'s modules' trees (theirs included), with its record."""
    for top in record.modules:
        for sub in nn.Module.modules(top):
            found = sub.__dict__.get(RECORD_ATTR)
            if found is not None:
                yield sub, found


def _pending_firsts_below(record: CallRecord) -> list[CallRecord]:
    """The pending records, other than ``record``, whose first module lies below it."""
    found: dict[int, CallRecord] = {}
    for sub, other in _below(record):
        if other is not record and other.engine is None and sub is other.modules[0]:
            found.setdefault(id(other), other)
    return list(found.values())


def _subtree(record: CallRecord) -> set[int]:
    return {id(m) for top in record.modules for m in nn.Module.modules(top)}


def _outermost(record: CallRecord) -> CallRecord:
    """The pending record of ``record``'s family whose modules contain its, and no other's do."""
    first = id(record.modules[0])
    outer = [r for r in record.family if r.engine is None and first in _subtree(r)]
    return max(outer, key=lambda r: len(_subtree(r)))


def link_pending(record: CallRecord) -> None:
    """Join ``record``'s family with those of the pending records below it.

    Called once a call's modules carry ``record``: every pending record whose first
    module lies below them, and every record of their families, shares one family
    with ``record`` from now on.
    """
    for other in _pending_firsts_below(record):
        if other.family is not record.family:
            joined = record.family
            for member in other.family:
                joined.append(member)
                member.family = joined


def engine_or_none(module: nn.Module) -> MegatronFSDP | None:
    """The engine of ``module``'s model, built now on its first use; None if it has none.

    A model with no parameter to shard (FSDP2 accepts one: it runs as a plain
    module) gets no engine: its records are ``inert``.
    """
    record = record_of(module)
    if record.engine is None and not record.building and not record.inert:
        # The first use may come inside a torch.func transform (jvp, vmap): the build's
        # own tensors (the ranks' agreement check, the buckets) are plain, outside it.
        with temporarily_clear_interpreter_stack():
            _build(_outermost(record))
    if record.inert:
        return None
    if record.engine is None:  # only inside a build, which never asks
        raise RuntimeError("mf_fsdp.fsdp2: the engine is being built")
    return record.engine


def ensure_built(module: nn.Module) -> MegatronFSDP:
    """The engine of ``module``'s model, built now if this is the model's first use.

    Raises:
        NotImplementedError: for a model with no parameter to shard (no engine to act).
    """
    engine = engine_or_none(module)
    if engine is None:
        raise NotImplementedError(
            f"mf_fsdp.fsdp2: {type(module).__name__}'s model has no parameter to shard, so it "
            "runs as a plain module without an engine; this FSDPModule method has nothing "
            "to act on"
        )
    return engine


def _build(root: CallRecord) -> None:
    """Build one ``MegatronFSDP`` over ``root``'s module with the records inside as units."""
    units = _pending_firsts_below(root)
    records = (root, *units)
    for record in records:  # the engine's and this build's parameter walks start no other
        record.building = True
    try:
        _build_engine(root, units)
    finally:
        for record in records:
            record.building = False


def _build_engine(root: CallRecord, units: list[CallRecord]) -> None:
    if len(root.modules) != 1:
        raise NotImplementedError(
            "fully_shard: the outermost call was on a list of modules; mf_fsdp.fsdp2 needs "
            "the outermost call on one module (the root, e.g. fully_shard(model))"
        )
    module = root.modules[0]
    for unit in units:
        _check_same(root, unit)
    ignored = {id(p): p for r in (root, *units) for p in r.ignored_params}
    ignored.update(_replicated_params(module))
    if all(id(param) in ignored for param in nn.Module.parameters(module)):
        for record in (root, *units):  # nothing to shard: FSDP2 runs it as a plain module
            record.inert = True
        return
    root_policy, unit_policies = resolve_policies(
        module, root.mp_policy, [(u.modules, u.mp_policy) for u in units], ignored.keys()
    )
    hooks_before = _forward_hook_ids(module)
    root_engine_policy = engine_policy(module, root_policy)
    mesh = call_mesh(root.mesh)
    asked = [
        (r.shard_placement_fn, _call_params(r, ignored.keys()))
        for r in (root, *units)
        if r.shard_placement_fn is not None
    ]
    experts = place_params(asked, mesh)
    managed = (p for p in nn.Module.parameters(module) if id(p) not in ignored)
    annotations = {
        id(param): annotation
        for record in (root, *units)
        for owner, name, annotation in record.annotations
        if (param := owner._parameters.get(name)) is not None
    }
    roles = mesh_roles(mesh, managed, root.dp_mesh_dims, annotations)
    engine = MegatronFSDP(
        module,
        dist_index(roles, experts),
        DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params",
            offload_optimizer_state=root.offload,
            find_unused_parameters=True,  # FSDP2 leaves .grad None where no backward reached
        ),
        sync_model_each_microbatch=True,
        mixed_precision_policy=root_engine_policy,
        unit_modules=[u.modules for u in units],
        ignored_params=list(ignored.values()),
        unit_mixed_precision={
            unit.modules[0]: engine_policy(module, policy)
            for unit, policy in zip(units, unit_policies, strict=True)
            if own_dtypes(root_policy, policy)
        },
        expert_mean_over_own_group=True,  # FSDP2 averages over each parameter's own mesh
    )
    hook_ids = _forward_hook_ids(module) - hooks_before
    bind_optimizers_at_step(engine)  # the user's optimizer steps as mf_fsdp.fully_shard's
    by_module = {id(u.module): u for u in engine._units}
    root.is_root = True
    for record in (root, *units):
        record.engine = engine
        record.hook_ids = hook_ids | {handle.id for handle in record.hooks}
    for record in units:
        record.unit = by_module.get(id(record.modules[0]))
        if record.unit is not None:
            record.unit.reshard_after_forward = record.reshard_after_forward
            record.unit.unshard_in_backward = record.unshard_in_backward
    engine._root.unshard_in_backward = root.unshard_in_backward
    # FSDP2's .grad is fully reduced when backward() returns, HSDP's replicate dim included.
    engine.sync_policy.outer_each_backward = True
    module.__dict__[_ENGINE_ATTR] = engine  # kept alive with the model


def _replicated_params(module: nn.Module) -> dict[int, nn.Parameter]:
    """The parameters under ``module``'s submodules that torch's ``replicate()`` manages.

    FSDP2 leaves them to DDP (``replicate`` on a child of a ``fully_shard`` root): its
    reducer averages their gradients, so sharding them too would step them with
    gradients reduced twice.
    """
    found: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        if sub is not module and "replicate" in (_get_registry(sub) or {}):
            found.update((id(p), p) for _, p in nn.Module.named_parameters(sub))
    return found


def _call_params(
    record: CallRecord, ignored: AbstractSet[int]
) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters ``record``'s call manages: under its modules, not under another call's."""
    seen: set[int] = set()
    stack = [(type(m).__name__, m) for m in reversed(record.modules)]
    while stack:
        prefix, module = stack.pop()
        for attr, param in module._parameters.items():
            if param is not None and id(param) not in ignored and id(param) not in seen:
                seen.add(id(param))
                yield f"{prefix}.{attr}", param
        for attr, child in reversed(module._modules.items()):
            if child is not None and child.__dict__.get(RECORD_ATTR, record) is record:
                stack.append((f"{prefix}.{attr}", child))


def _check_same(root: CallRecord, unit: CallRecord) -> None:
    """Units of one model share the mesh (equal: each ``world["dp"]`` is a new object)."""
    if unit.mesh != root.mesh and unit.mesh is not None and root.mesh is not None:
        raise NotImplementedError(
            "fully_shard: mesh differs between calls on one model; mf_fsdp.fsdp2 needs the "
            "same mesh for every call"
        )
    if unit.offload != root.offload:
        raise NotImplementedError(
            "fully_shard: offload_policy differs between calls on one model (CPUOffloadPolicy "
            "on some, OffloadPolicy() on others); mf_fsdp.fsdp2 needs the same for every call"
        )


def _forward_hook_ids(module: nn.Module) -> set[int]:
    """The ids of every forward and forward-pre hook in ``module``'s tree (ids are unique)."""
    return {
        hook_id
        for sub in nn.Module.modules(module)
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks)
        for hook_id in hooks
    }
