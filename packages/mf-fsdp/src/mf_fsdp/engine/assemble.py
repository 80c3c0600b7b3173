"""Assembling the engine: buckets from the planned specs, units from the buckets, values in.

``assemble`` turns the planned bucket specs (``buckets/units.py``) into the
engine's parts (``Assembly``): one ``Bucket`` per laid-out bucket, with its
dtypes resolved and checked and its gradient reduction decided
(``reduce_spec_for``), grouped into ``Unit``s (the root first), and every
parameter's value copied into its bucket (see [Note: meta-device flows] in
``meta_init.py`` for models built on the meta device). An extension bucket is
gathered once on the way: that builds its compute form (see [Note: the
all-gather extension] in ``buckets/extension.py``), unless its hooks are
still to come or its values are (``gather_fresh``, at the first
forward).

Functions of what they are given: no module state, nothing registered on the
model (the wrapper does that).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.bucket import Bucket, ParamSource
from mf_fsdp.buckets.buffer_pool import BufferPool
from mf_fsdp.buckets.dtypes import BucketDtypes
from mf_fsdp.buckets.extension import ExtensionWeights, has_extension
from mf_fsdp.buckets.layout import BucketLayout
from mf_fsdp.buckets.reduce_spec import ReduceSpec
from mf_fsdp.buckets.units import BucketSpec, lay_out
from mf_fsdp.config import DistributedDataParallelConfig, MixedPrecisionPolicy, ZeroDPStrategy
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.engine.meta_init import allocate_meta_params, materialize_meta_params
from mf_fsdp.engine.rank_paths import default_store, translated
from mf_fsdp.engine.sharded_params import MANAGED_ATTR, OWNER_ATTR
from mf_fsdp.engine.unit import Unit

__all__ = [
    "Assembly",
    "BucketOptions",
    "assemble",
    "first_gather",
    "gather_fresh",
    "reduce_spec_for",
]


@dataclass(frozen=True, slots=True)
class BucketOptions:
    """The engine's options that decide how each bucket is built and reduced.

    Attributes:
        dist_index: meshes and groups (the expert index is taken for expert buckets).
        strategy: the ZeRO strategy inside dp_shard.
        ddp_config: overlap, reduction and offload options.
        device: where buffers live.
        policy: the dtypes of every unit without a policy of its own.
        unit_policies: a unit's own dtypes, by the ``id`` of its module.
        per_token: reduce gradients with a sum (``calculate_per_token_loss``).
        scaling_factor: an extra factor on every reduced gradient, or None.
        divide_factor: FSDP2's ``set_gradient_divide_factor``, or None (the mean).
        alignment: per-tensor start alignment inside a bucket, in elements.
        expert_mean_over_own_group: expert gradients are averaged over their own
            (expert-data-parallel) group, FSDP2's rule, not over every dp rank.
    """

    dist_index: FSDPDistributedIndex
    strategy: ZeroDPStrategy
    ddp_config: DistributedDataParallelConfig
    device: torch.device
    policy: MixedPrecisionPolicy
    unit_policies: dict[int, MixedPrecisionPolicy]
    per_token: bool
    scaling_factor: float | None
    divide_factor: float | None
    alignment: int
    expert_mean_over_own_group: bool = False


@dataclass(slots=True)
class Assembly:
    """The engine's parts: the root unit, the FSDP units in order, every bucket in order.

    ``awaiting_to_empty``: the model was built on the meta device and its values
    come from its own init after ``to_empty()`` (FSDP2's flow).
    """

    root: Unit
    units: list[Unit]
    groups: list[Bucket]
    awaiting_to_empty: bool = False


def reduce_spec_for(index: FSDPDistributedIndex, options: BucketOptions) -> ReduceSpec:
    """How the gradients of buckets on ``index`` are reduced (the engine's options).

    Over gloo the mean is taken in the collective whatever the option says
    (the sum divided by the ranks: rounded once, not per rank), which spares
    the main thread a pass over the whole bucket (see
    ``collectives.divides_after_reduction``).
    """
    mean_over = index if options.expert_mean_over_own_group else options.dist_index
    return ReduceSpec.build(
        mean_over.dp_size,
        options.per_token,
        options.ddp_config.average_in_collective
        or collectives.divides_after_reduction(index.fsdp_group),
        options.scaling_factor,
        reduce_size=index.dp_size,
        divide_factor=options.divide_factor,
    )


def extension_dtypes(name: str, param: nn.Parameter, policy: MixedPrecisionPolicy) -> BucketDtypes:
    """The dtypes of an extension parameter's bucket.

    Its shard is stepped in its own dtype, as FSDP2 steps the sharded subclass:
    main weights and grads are the parameter's dtype; the compute dtype (what
    ``fsdp_post_all_gather`` is given) and the reduction's follow the policy.

    Raises:
        ValueError: for a trainable parameter whose dtype is not the policy's
            ``main_params_dtype``.
    """
    main = param.dtype
    wanted = policy.main_params_dtype
    if param.requires_grad and wanted is not None and wanted != main:
        raise ValueError(
            f"mixed_precision_policy: main_params_dtype={wanted} but parameter {name!r} "
            f"({type(param).__qualname__}, {main}) implements FSDP2's all-gather extension, "
            "whose shard the optimizer steps in its own dtype; expected main_params_dtype="
            f"{main} or None (or the subclass built in {wanted})"
        )
    compute = policy.param_dtype or main
    comm = policy.grad_comm_dtype or policy.main_grads_dtype or main
    return BucketDtypes(compute, main, main, comm)


def _new_group(
    spec: BucketSpec,
    sources: dict[int, ParamSource],
    layout: BucketLayout,
    index: FSDPDistributedIndex,
    options: BucketOptions,
    pool: BufferPool,
) -> Bucket:
    """The ``Bucket`` of one laid-out bucket, with its dtypes resolved and checked."""
    policy = options.unit_policies.get(id(spec.unit), options.policy)
    dtypes = BucketDtypes(*policy.resolve(spec.params[0].dtype))
    if spec.extension:
        dtypes = extension_dtypes(spec.names[0], spec.params[0], policy)
    strategy = options.strategy
    if strategy.level > 0 and dtypes.grads != dtypes.main:
        raise ValueError(
            f"mixed_precision_policy: main_grads_dtype={dtypes.grads} must equal "
            f"main_params_dtype={dtypes.main} for sharded strategies (the optimizer "
            "reads the reduced gradient store directly)"
        )
    if options.ddp_config.grad_reduce_in_fp32:
        dtypes = BucketDtypes(dtypes.compute, dtypes.main, dtypes.grads, torch.float32)
    return Bucket(
        list(spec.params),
        [sources[id(p)] for p in spec.params],
        layout,
        strategy,
        dtypes,
        index,
        options.device,
        pool,
        reduce_spec_for(index, options),
        late_grads=spec.extension or (spec.unit is None and strategy.shards_grads),
        mark_unused_params=options.ddp_config.find_unused_parameters,
        offload=options.ddp_config.offload_optimizer_state,
        extension=spec.extension,
        row_dims=spec.row_dims,
    )


def assemble(
    module: nn.Module,
    specs: list[BucketSpec],
    sources: dict[int, ParamSource],
    options: BucketOptions,
    pool: BufferPool,
    meta_init: bool,
) -> Assembly:
    """Build every bucket and unit of ``module`` from ``specs`` and copy the values in."""
    by_unit: dict[int, Unit] = {}
    parts = Assembly(Unit(None, "", []), [], [])
    dense = options.dist_index
    for spec in specs:
        index = dense.get_expert_index("MegatronFSDP") if spec.expert else dense
        world = index.dp_size if index.hsdp_outer_dp_shard else index.shard_size
        for part, layout in lay_out(spec, world, options.alignment):
            group = _new_group(part, sources, layout, index, options, pool)
            parts.groups.append(group)
            if part.unit is None:
                unit = parts.root
            else:
                known = by_unit.get(id(part.unit))
                if known is None:
                    known = Unit(part.unit, part.unit_name, [], part.members)
                    by_unit[id(part.unit)] = known
                    parts.units.append(known)
                unit = known
            unit.groups.append(group)
    for unit in (parts.root, *parts.units):
        if _fill(module, unit, options.device, meta_init):
            parts.awaiting_to_empty = True
    return parts


def _fill(module: nn.Module, unit: Unit, device: torch.device, meta_init: bool) -> bool:
    """Copy a unit's parameter values into its buckets; whether they await the model's init.

    See [Note: meta-device flows] in ``meta_init.py``.
    """
    params = {p for g in unit.groups for p in g.params}
    awaiting: set[int] = set()
    if any(p.is_meta for p in params):
        if meta_init:
            root = module if unit.module is None else unit.module
            materialize_meta_params(module, root, params, device)
        else:  # FSDP2's flow: the values come from the model's init after to_empty()
            awaiting = {id(p) for p in params if p.is_meta}
            extensions = {id(g.params[0]) for g in unit.groups if g.extension}
            allocate_meta_params([p for p in params if id(p) not in extensions], device)
    for group in unit.groups:
        for index, param in enumerate(group.params):
            if id(param) not in awaiting or group.extension:  # a meta shard, materialised
                group.copy_in(index, param)  # by to_empty()
        if group.extension:
            if id(group.params[0]) not in awaiting and has_extension(group.params[0]):
                first_gather(group)  # else at the first forward (gather_fresh)
        else:
            group.point_params_at_buffer()
        group.reshard()
    return bool(awaiting)


@translated(lambda group: default_store())
def first_gather(group: Bucket) -> None:
    """Gather an extension bucket once: that builds its compute form (``buckets/extension``).

    A hook that fails on one rank stops every rank (the peers may be waiting in
    a collective the hooks started, or in the gather).
    """
    group.point_params_at_buffer()


def gather_fresh(groups: list[Bucket], peers: dist.ProcessGroup | None, owner: object) -> bool:
    """Gather once the extension buckets not gathered at the wrap; whether there were any.

    At the first forward (every rank): buckets wrapped on the meta device, and
    subclasses whose hooks were to be set on the sharded local tensor after the
    wrap (see [Note: hooks set after the wrap] in ``buckets/extension.py``). The
    ranks of ``peers`` first agree, in one small collective, that each such tensor
    has both hooks now. Each compute form made is marked as ``owner``'s.

    Hooks set after the wrap on a plain parameter's sharded local tensor are
    refused here (that tensor is a view of a flat bucket, gathered without them).

    Raises:
        TypeError: on every rank, naming the first parameter whose sharded local
            tensor lacks a hook on some rank, or a plain parameter given hooks.
    """
    _refuse_late_hooks_on_flat(groups)
    fresh = [g for g in groups if g.extension and g.replaced is None]
    if not fresh:
        return False
    locals_ = [cast(ExtensionWeights, g.weights).sharded_local() for g in fresh]
    mine = [i for i, local in enumerate(locals_) if not has_extension(local)]
    every = [mine]
    if peers is not None and dist.get_world_size(peers) > 1:
        every = [mine] * dist.get_world_size(peers)
        dist.all_gather_object(every, mine, group=peers)
    lacking = sorted({i for found in every for i in found})
    if lacking:
        i = lacking[0]
        kind = type(locals_[i])
        ranks = [r for r, found in enumerate(every) if i in found]
        raise TypeError(
            f"module: parameter {fresh[i].fsdp_params[0].fqns[0]!r} is a {kind.__module__}."
            f"{kind.__qualname__} without FSDP2's all-gather extension at the first forward "
            f"(ranks {ranks} of its group); expected fsdp_pre_all_gather and "
            "fsdp_post_all_gather on its class or on its sharded local tensor "
            "(param._local_tensor) before the first forward: mf-fsdp does not carry a tensor "
            "subclass's values in flat buffers"
        )
    for group in fresh:
        first_gather(group)
        group.reshard()
        compute = group.fsdp_params[0].compute
        setattr(compute, OWNER_ATTR, weakref.ref(owner))
        setattr(compute, MANAGED_ATTR, True)
    return True


def _refuse_late_hooks_on_flat(groups: list[Bucket]) -> None:
    """Stop where a plain parameter's sharded local tensor was given an extension hook."""
    for group in groups:
        if group.extension:
            continue
        for fp in group.fsdp_params:
            local = fp.sharded._local_tensor if isinstance(fp.sharded, DTensor) else fp.sharded
            if callable(getattr(local, "fsdp_pre_all_gather", None)) or callable(
                getattr(local, "fsdp_post_all_gather", None)
            ):
                raise TypeError(
                    f"module: parameter {fp.fqns[0]!r} is a plain tensor whose sharded local "
                    "tensor was given fsdp_pre_all_gather / fsdp_post_all_gather after "
                    "fully_shard; mf-fsdp gathers plain parameters in flat buckets and would "
                    "not call them: expected the hooks on the parameter before fully_shard, "
                    "or on a tensor subclass"
                )
