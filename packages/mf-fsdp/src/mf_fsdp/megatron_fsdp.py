"""MegatronFSDP: the module wrapper that drives gathers, reductions and the training state.

Hooks (per unit, registered once):

- forward pre-hook: gather the unit's bucket(s) (ZeRO-3), prefetch the next
  unit in last iteration's forward order, and thread the unit's inputs
  through ``RegisterFSDPBackwardFunction`` so its backward end is observable;
- forward post-hook: release the bucket (ZeRO-3) and hook the outputs' grads
  (pre-backward: gather again, prefetch the previous unit, get the grad buffer);
- post-backward (the identity function's backward): reduce the unit's grads
  now (overlapped with the rest of backward) and release its bucket;
- a callback queued on the autograd engine at the first pre-backward finishes
  the root and any unit whose post-backward did not fire.

A forward seen while a unit is already in backward is activation
recomputation: the gathered weights are reused, nothing is released, so
recompute and backward share one gather.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from mf_dtensor import attach_chunk_metadata, uneven_dtensor_from_local
from mf_fsdp.config import (
    DistributedDataParallelConfig,
    MixedPrecisionPolicy,
    TrainingState,
    ZeroDPStrategy,
)
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.layout import DEFAULT_ALIGNMENT, compute_bucket_layout
from mf_fsdp.param_group import BufferPool, GroupDtypes, ParamGroup, ReduceSpec
from mf_fsdp.tp_params import annotate_optimizer_param, local_shape, validate_tp_params
from mf_fsdp.units import BucketSpec, plan_buckets, resolve_unit_classes
from mf_utils import get_group_device

__all__ = ["BucketStats", "MegatronFSDP", "RegisterFSDPBackwardFunction"]

MANAGED_ATTR = "_mf_fsdp_managed"
"""Set on model parameters whose values the optimizer must not step directly."""


OWNER_ATTR = "_mf_fsdp_owner"
"""Weak reference from a model parameter to the engine managing it."""


_GUARD_INSTALLED = False


def _reject_unwrapped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        params = group["params"]
        if params and getattr(params[0], MANAGED_ATTR, False):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): this optimizer holds the original parameters "
                "of a model wrapped by mf_fsdp, whose values and grads live in the engine's "
                "buffers; stepping it would silently train nothing. Pass it through "
                "mf_fsdp.fully_shard_optimizer(optimizer) (or fully_shard(model, optimizer))."
            )


def install_unwrapped_optimizer_guard() -> None:
    """Register (once per process) the step pre-hook that rejects unwrapped optimizers."""
    global _GUARD_INSTALLED
    if not _GUARD_INSTALLED:
        register_optimizer_step_pre_hook(_reject_unwrapped)
        _GUARD_INSTALLED = True


class RegisterFSDPBackwardFunction(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs the unit's post-backward.

    =========  ==========================  ===========================
    pass       tensors                     effect
    =========  ==========================  ===========================
    forward    ``*inputs`` -> same tensors  none (no copy, no comm)
    backward   ``*grads`` -> same grads     calls ``post_backward()``
    =========  ==========================  ===========================
    """

    @staticmethod
    def forward(ctx: Any, post_backward: Callable[[], None], *inputs: torch.Tensor) -> Any:
        """Remember the callback; return the inputs unchanged."""
        ctx.post_backward = post_backward
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        """Run the callback (the unit's backward is complete), pass grads through."""
        ctx.post_backward()
        return (None, *grads)


@dataclass(slots=True)
class BucketStats:
    """Size facts of one bucket, as the benchmark and the scale simulation read them.

    Attributes:
        unit_name: the unit's qualified name ("" for the root bucket).
        dtype: compute dtype.
        numel: elements of real data.
        padded_numel: bucket size including alignment and tail padding.
        padding_fraction: ``1 - numel / padded_numel``.
        shard_numel: elements each rank holds of the bucket (padding included).
        rank_numel: real elements this rank owns.
    """

    unit_name: str
    dtype: torch.dtype
    numel: int
    padded_numel: int
    padding_fraction: float
    shard_numel: int
    rank_numel: int


class _Unit:
    """One FSDP unit (or the root) and its per-iteration state."""

    __slots__ = ("forwarded", "groups", "module", "name", "state")

    def __init__(self, module: nn.Module | None, name: str, groups: list[ParamGroup]) -> None:
        self.module = module
        self.name = name
        self.groups = groups
        self.state = TrainingState.IDLE
        self.forwarded = False


class MegatronFSDP(nn.Module):
    """Fully sharded data parallelism over flat, bucketed buffers (ZeRO-0..3).

    Args:
        module: the model; its parameters move into the engine's buffers.
        dist_index: meshes and groups (see ``FSDPDistributedIndex``).
        ddp_config: strategy, overlap and reduction options.
        fsdp_unit_modules: classes (or dotted class paths) whose instances are
            gathered and released as one unit; the outermost match wins.
        disable_bucketing: put every parameter in one bucket (per dtype).
        device: where buffers live; default: the fsdp group's device.
        calculate_per_token_loss: reduce grads with a sum instead of a mean.
        init_model_with_meta_device: the model's parameters are on the meta device;
            materialise them one unit at a time with each module's ``reset_parameters``.
        sync_model_each_microbatch: wait for the reduction at the end of every backward
            (else it overlaps the next forward and finishes at ``finish_grad_sync``).
        mixed_precision_policy: compute / main / grad / communication dtypes.
        gradient_scaling_factor: extra factor applied to every reduced gradient.
        alignment: per-tensor start alignment inside a bucket, in elements.

    Raises:
        TypeError: if ``module`` or ``dist_index`` has the wrong type.
        ValueError: for a model without parameters, unknown unit classes, meta init
            with ``no_shard``, a main-grad dtype that differs from the main dtype, or an
            outer strategy that does not match ``dist_index.hsdp_outer_dp_shard``.
    """

    def __init__(
        self,
        module: nn.Module,
        dist_index: FSDPDistributedIndex,
        ddp_config: DistributedDataParallelConfig | None = None,
        fsdp_unit_modules: list[type[nn.Module]] | list[str] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | None = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = False,
        *,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        gradient_scaling_factor: float | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"MegatronFSDP: module must be an nn.Module, got {module!r}")
        if not isinstance(dist_index, FSDPDistributedIndex):
            raise TypeError(
                f"MegatronFSDP: dist_index must be an FSDPDistributedIndex, got {dist_index!r}"
            )
        self.module = module
        self.dist_index = dist_index
        self.ddp_config = ddp_config or DistributedDataParallelConfig()
        self.strategy: ZeroDPStrategy = self.ddp_config.data_parallel_sharding_strategy  # type: ignore[assignment]
        dist_index.check_outer_strategy(self.ddp_config.outer_dp_sharding_strategy)  # type: ignore[arg-type]
        if init_model_with_meta_device and self.strategy is ZeroDPStrategy.NO_SHARD:
            raise ValueError(
                "init_model_with_meta_device=True needs a sharded strategy; got "
                "zero_dp_strategy='no_shard' (every rank would hold the whole model)"
            )
        self.mixed_precision_policy = mixed_precision_policy or MixedPrecisionPolicy()
        self.calculate_per_token_loss = calculate_per_token_loss
        self.model_auto_sync = sync_model_each_microbatch
        self.is_last_microbatch = False
        self.microbatch_count = 0
        self.device = device or get_group_device(dist_index.fsdp_group)
        self._no_sync = False
        self._callback_queued = False
        self._spec = ReduceSpec.build(
            dist_index.dp_size,
            calculate_per_token_loss,
            self.ddp_config.average_in_collective,
            gradient_scaling_factor,
        )
        self._pool = BufferPool()
        validate_tp_params(module.named_parameters(), dist_index, init_model_with_meta_device)
        specs = plan_buckets(module, resolve_unit_classes(fsdp_unit_modules), disable_bucketing)
        self._build_units(specs, alignment, init_model_with_meta_device)
        self._build_optimizer_params()
        self._fwd_order: list[_Unit] = []
        self._prev_order: list[_Unit] = []
        self._register_hooks()
        install_unwrapped_optimizer_guard()

    # ------------------------------------------------------------------ construction
    def _build_units(self, specs: list[BucketSpec], alignment: int, meta_init: bool) -> None:
        by_unit: dict[int, _Unit] = {}
        self._root = _Unit(None, "", [])
        self._units: list[_Unit] = []
        self.groups: list[ParamGroup] = []
        index = self.dist_index
        world = index.dp_size if index.hsdp_outer_dp_shard else index.shard_size
        outer_op = dist.ReduceOp.AVG if self._spec.op == dist.ReduceOp.AVG else dist.ReduceOp.SUM
        for spec in specs:
            dtypes = GroupDtypes(*self.mixed_precision_policy.resolve(spec.params[0].dtype))
            if self.strategy.level > 0 and dtypes.grads != dtypes.main:
                raise ValueError(
                    f"mixed_precision_policy: main_grads_dtype={dtypes.grads} must equal "
                    f"main_params_dtype={dtypes.main} for sharded strategies (the optimizer "
                    "reads the reduced gradient store directly)"
                )
            if self.ddp_config.grad_reduce_in_fp32:
                dtypes = GroupDtypes(dtypes.compute, dtypes.main, dtypes.grads, torch.float32)
            layout = compute_bucket_layout([local_shape(p) for p in spec.params], world, alignment)
            group = ParamGroup(
                list(spec.params),
                list(spec.names),
                layout,
                self.strategy,
                dtypes,
                self.dist_index,
                self.device,
                self._pool,
            )
            group.set_outer_op(outer_op)
            self.groups.append(group)
            if spec.unit is None:
                unit = self._root
            else:
                unit = by_unit.get(id(spec.unit))
                if unit is None:
                    unit = by_unit[id(spec.unit)] = _Unit(spec.unit, spec.unit_name, [])
                    self._units.append(unit)
            unit.groups.append(group)
        for unit in (self._root, *self._units):
            self._fill(unit, meta_init)

    def _fill(self, unit: _Unit, meta_init: bool) -> None:
        """Copy a unit's parameter values into its buffers, materialising meta ones first."""
        params = {p for g in unit.groups for p in g.params}
        if meta_init and any(p.is_meta for p in params):
            _materialize(self.module if unit.module is None else unit.module, params, self.device)
        for group in unit.groups:
            for index, param in enumerate(group.params):
                group.copy_in(index, param)
            group.point_params_at_buffer()
            group.reshard()

    def _build_optimizer_params(self) -> None:
        """Create the parameters the optimizer steps on and their gradient views."""
        self._opt_params: dict[nn.Parameter, nn.Parameter] = {}
        self._grad_pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        level = self.strategy.level
        mesh = self.dist_index.dp_mesh()
        placements = [Shard(0)] * mesh.ndim
        if self.dist_index.dp_outer_dim and not self.dist_index.hsdp_outer_dp_shard:
            placements = [Replicate(), Shard(0)]
        for group in self.groups:
            for index, param in enumerate(group.params):
                if level == 0:
                    # The model's own parameter, unless it is a DTensor (TP): then a
                    # plain view of its local values, as the optimizer contract says.
                    if not group.main_is_separate and not isinstance(param, DTensor):
                        setattr(param, OWNER_ATTR, weakref.ref(self))
                        annotate_optimizer_param(param, param, self.dist_index)
                        self._opt_params[param] = param
                        continue
                    start, end, shape = group.param_range(index)
                    opt = nn.Parameter(group.main[start:end].view(shape), param.requires_grad)
                    grad = group.grad_store[start:end].view(shape) if group.requires_grad else None
                else:
                    numel = local_shape(param).numel()
                    local, offset = group.local_main_piece(index, group.main)
                    opt = nn.Parameter(
                        uneven_dtensor_from_local(
                            local,
                            mesh,
                            placements,
                            global_shape=(numel,),
                            global_offset=(offset,),
                            validate=False,
                        ),
                        param.requires_grad,
                    )
                    grad = None
                    if group.requires_grad:
                        glocal, _ = group.local_main_piece(index, group.grad_store)
                        grad = uneven_dtensor_from_local(
                            glocal,
                            mesh,
                            placements,
                            global_shape=(numel,),
                            global_offset=(offset,),
                            validate=False,
                        )
                    opt.local_offset = offset  # type: ignore[attr-defined]
                opt.orig_shape = local_shape(param)  # type: ignore[attr-defined]
                annotate_optimizer_param(opt, param, self.dist_index)
                setattr(param, MANAGED_ATTR, True)
                setattr(param, OWNER_ATTR, weakref.ref(self))
                self._opt_params[param] = opt
                if grad is not None:
                    self._grad_pairs.append((opt, grad))

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self) -> None:
        self._hook_handles = []
        for unit in self._units:
            assert unit.module is not None  # internal invariant
            self._hook_handles.append(
                unit.module.register_forward_pre_hook(
                    functools.partial(self._unit_pre_forward, unit), with_kwargs=True
                )
            )
            self._hook_handles.append(
                unit.module.register_forward_hook(functools.partial(self._unit_post_forward, unit))
            )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module with the engine's gathers, releases and reductions."""
        self._root_pre_forward()
        out = self.module(*inputs, **kwargs)
        return self._root_post_forward(out)

    def _root_pre_forward(self) -> None:
        self._fwd_order = []
        self._root.state = TrainingState.FORWARD
        self._root.forwarded = True
        for group in self._root.groups:
            group.unshard(async_op=False)
            group.wait_unshard()
        if self._prefetching and self._prev_order:
            for group in self._prev_order[0].groups:
                group.unshard(async_op=True)

    @property
    def _prefetching(self) -> bool:
        return self.strategy.shards_params and self.ddp_config.overlap_param_gather

    def _root_post_forward(self, out: Any) -> Any:
        self._prev_order = self._fwd_order
        tensors = _grad_tensors(out)
        if torch.is_grad_enabled() and tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, self._root_pre_backward, mode="any"
            )
        else:
            for group in self._root.groups:
                group.reshard()
            self._root.state = TrainingState.IDLE
        return out

    def _unit_pre_forward(
        self, unit: _Unit, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if unit.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            self._gather(unit, async_op=False)  # recomputation: reuse or regather
            return None
        unit.state = TrainingState.FORWARD
        unit.forwarded = True
        self._fwd_order.append(unit)
        if self.strategy.shards_params:
            self._gather(unit, async_op=False)
            if self._prefetching:
                self._prefetch(unit, self._prev_order, +1)
        if not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs))
        slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            return None
        wrapped = RegisterFSDPBackwardFunction.apply(
            functools.partial(self._unit_post_backward, unit), *(flat[i] for i in slots)
        )
        for i, t in zip(slots, wrapped, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _unit_post_forward(
        self, unit: _Unit, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        if unit.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return
        for group in unit.groups:
            group.reshard()
        tensors = _grad_tensors(output)
        if torch.is_grad_enabled() and tensors and self.strategy.shards_grads:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._unit_pre_backward, unit), mode="any"
            )

    def _gather(self, unit: _Unit, async_op: bool) -> None:
        for group in unit.groups:
            group.unshard(async_op=async_op)
        for group in unit.groups:
            group.wait_unshard()

    def _prefetch(self, unit: _Unit, order: list[_Unit], step: int) -> None:
        try:
            position = order.index(unit) + step
        except ValueError:
            return
        if 0 <= position < len(order):
            for group in order[position].groups:
                group.unshard(async_op=True)

    def _ensure_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._root_post_backward)

    def _root_pre_backward(self, grad: torch.Tensor | None) -> None:
        self._ensure_callback()
        self._root.state = TrainingState.PRE_BACKWARD
        self._gather(self._root, async_op=False)
        accumulate = self.groups if not self.strategy.shards_grads else self._root.groups
        for group in accumulate:
            group.begin_accumulate(self._spec)
        if self._prefetching and self._fwd_order:
            for group in self._fwd_order[-1].groups:
                group.unshard(async_op=True)

    def _unit_pre_backward(self, unit: _Unit, grad: torch.Tensor | None) -> None:
        self._ensure_callback()
        unit.state = TrainingState.PRE_BACKWARD
        if self.strategy.shards_params:
            self._gather(unit, async_op=False)
            if self._prefetching:
                self._prefetch(unit, self._fwd_order, -1)
        for group in unit.groups:
            group.begin_accumulate(self._spec)

    def _reduce_now(self) -> bool:
        if self._no_sync:
            return False
        return self.model_auto_sync or self.is_last_microbatch or self.strategy.shards_grads

    def _unit_post_backward(self, unit: _Unit) -> None:
        if unit.state is TrainingState.POST_BACKWARD or not unit.forwarded:
            return
        unit.state = TrainingState.POST_BACKWARD
        if self._reduce_now():
            overlap = self.ddp_config.overlap_grad_reduce
            for group in unit.groups:
                group.start_reduce(self._spec, async_op=overlap)
                if not overlap:
                    group.finish_reduce()
        for group in unit.groups:
            group.reshard()

    def _root_post_backward(self) -> None:
        for unit in reversed(self._fwd_order):
            self._unit_post_backward(unit)
        self._root.forwarded = True
        self._unit_post_backward(self._root)
        for unit in (self._root, *self._units):
            unit.state = TrainingState.IDLE
            unit.forwarded = False
        self._callback_queued = False
        self.microbatch_count += 1
        if self.model_auto_sync and self._reduce_now():
            # The dp_outer stage runs once per step: here only on the last micro-batch.
            for group in self.groups:
                (group.reduce_outer if self.is_last_microbatch else group.finish_reduce)()
            self.attach_grad_to_optimizer_state()

    # ------------------------------------------------------------------ sync control
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally, with no communication, inside the block.

        The reduction runs on the first backward after the block, or at the
        latest before ``optimizer.step()`` (``finish_grad_sync``).
        """
        previous = self._no_sync
        self._no_sync = True
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self._no_sync = previous
            self.is_last_microbatch = True

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Reduce and wait at the end of every backward inside the block."""
        previous = self.model_auto_sync
        self.model_auto_sync = True
        try:
            yield
        finally:
            self.model_auto_sync = previous

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """Turn per-backward waiting on (True) or defer it to ``finish_grad_sync`` (False)."""
        self.model_auto_sync = bool(sync_model)

    def get_distributed_index(self) -> FSDPDistributedIndex:
        """The meshes and groups this engine uses."""
        return self.dist_index

    # ------------------------------------------------------------------ grads
    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reduction of every group holding unreduced local grads."""
        for group in self.groups:
            group.start_reduce(self._spec, async_op=self.ddp_config.overlap_grad_reduce)

    def synchronize_gradient_reduce(self) -> None:
        """Wait for every launched reduction and fold results into the grad stores.

        Also runs the deferred dp_outer stage of the reduction (HSDP; once per step).
        """
        for group in self.groups:
            group.reduce_outer()

    def finish_grad_sync(self) -> None:
        """Reduce everything still local, wait, and attach grads for the optimizer.

        Safe to call any number of times; the wrapped optimizer's ``step`` calls it,
        so no strategy ever steps on unreduced gradients.
        """
        self.start_grad_sync()
        self.synchronize_gradient_reduce()
        self.attach_grad_to_optimizer_state()
        self.is_last_microbatch = False
        self.microbatch_count = 0

    def attach_grad_to_optimizer_state(self) -> None:
        """Point each optimizer parameter's ``.grad`` at its reduced gradient."""
        for opt, grad in self._grad_pairs:
            opt.grad = grad
        if self.strategy.level == 0:
            for group in self.groups:
                if not group.main_is_separate:
                    group.attach_local_grads()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient held by the engine by ``scaling_factor``."""
        for group in self.groups:
            group.scale_gradients(scaling_factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient: the engine's buffers and the optimizer parameters' ``.grad``."""
        self.zero_grad_buffer()
        if set_to_none:
            for opt, _ in self._grad_pairs:
                opt.grad = None

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer (call with ``optimizer.zero_grad``; the wrapped one does)."""
        for group in self.groups:
            group.zero_grad()

    # ------------------------------------------------------------------ params
    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """Gather weights: ZeRO-3 buckets, or the ZeRO-1/2 all-gather of updated shards."""
        async_op = not force_sync and (self.ddp_config.overlap_param_gather or force_dispatch)
        self._param_works = []
        for group in self.groups:
            if group.strategy.shards_params:
                group.unshard(async_op=async_op)
            else:
                work = group.install_main_weights(async_op=async_op)
                if work is not None:
                    self._param_works.append(work)

    def synchronize_param_gather(self) -> None:
        """Wait for the gathers started by ``start_param_sync``."""
        for work in getattr(self, "_param_works", ()):
            work.wait()
        self._param_works = []
        for group in self.groups:
            group.wait_unshard()

    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's updated main weights into the model's compute weights."""
        works = [g.install_main_weights(async_op=True) for g in self.groups]
        for work in works:
            if work is not None:
                work.wait()

    def broadcast_params(self) -> None:
        """Make every replica of the weights equal to data-parallel rank 0's copy.

        Full weights (ZeRO-0/1/2) are broadcast over the whole data-parallel group and
        the main weights refreshed from them; ZeRO-3 shards only have replicas across
        ``dp_outer``, so they are broadcast there (nothing to do without it).
        """
        index = self.dist_index
        for group in self.groups:
            if group.strategy.shards_params:
                pg = index.outer_fsdp_group
                if pg is None:
                    continue
                tensors = [group.model_shard]
                if group.main_is_separate and not group.hybrid:
                    tensors.append(group.main)
                for tensor in tensors:
                    dist.broadcast(tensor, src=dist.get_global_rank(pg, 0), group=pg)
                if group.main_is_separate and group.hybrid:  # sub-shards have no replicas
                    group.main.copy_(group.own_sub_shard())
                continue
            assert group.model_full is not None  # internal invariant
            pg = index.get_dp_group()
            dist.broadcast(group.model_full, src=dist.get_global_rank(pg, 0), group=pg)
            if group.main_is_separate:
                own = group.model_full if group.strategy.level == 0 else group.own_weights()
                group.main.copy_(own)

    # ------------------------------------------------------------------ introspection
    @staticmethod
    def owner_of(param: nn.Parameter) -> MegatronFSDP | None:
        """The engine managing model parameter ``param``, or None."""
        ref = getattr(param, OWNER_ATTR, None)
        return None if ref is None else ref()

    def optimizer_param(self, param: nn.Parameter) -> nn.Parameter:
        """The parameter the optimizer steps on in place of model parameter ``param``.

        Raises:
            ValueError: if ``param`` is not a parameter of the wrapped module.
        """
        try:
            return self._opt_params[param]
        except KeyError:
            raise ValueError(
                f"param: a tensor of shape {tuple(param.shape)} is not a parameter managed by "
                "this MegatronFSDP; expected a parameter of the wrapped module"
            ) from None

    def optimizer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, optimizer parameter) for every managed parameter, in bucket order."""
        for group in self.groups:
            for name, param in zip(group.names, group.params, strict=True):
                yield name, self._opt_params[param]

    def bucket_stats(self) -> list[BucketStats]:
        """Size and padding of every bucket, as seen from this rank."""
        rank = self.dist_index.shard_rank
        return [
            BucketStats(
                unit_name=self._unit_name(g),
                dtype=g.dtypes.compute,
                numel=g.layout.numel,
                padded_numel=g.layout.padded_numel,
                padding_fraction=g.layout.padding_fraction,
                shard_numel=g.layout.shard_size,
                rank_numel=g.layout.rank_numel(rank),
            )
            for g in self.groups
        ]

    def _unit_name(self, group: ParamGroup) -> str:
        for unit in self._units:
            if group in unit.groups:
                return unit.name
        return ""

    def memory_footprint(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds: params, separate main params, grads, pool (and optimizer).

        ``pool`` is the reusable temporaries currently idle; with ``optimizer``, the
        local pieces of its state tensors are counted under ``optimizer_state``.
        """
        total = {"params": 0, "main_params": 0, "grads": 0}
        for group in self.groups:
            for key, value in group.owned_bytes().items():
                total[key] += value
        total["pool"] = self._pool.held_bytes()
        if optimizer is not None:
            total["optimizer_state"] = sum(
                _local(v).numel() * v.element_size()
                for state in optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
        return total

    # ------------------------------------------------------------------ state dict
    preproc_state_dict_for_dcp_ckpt: bool = True  # attach DTensors' true DCP offsets

    def state_dict(  # type: ignore[override]
        self, *args: Any, prefix: str = "", keep_vars: bool = False, **kwargs: Any
    ) -> dict[str, Any]:
        """Parameters as the optimizer's (sharded, DCP-ready) tensors, keyed by module names."""
        out: dict[str, Any] = {}
        for name, opt in self.optimizer_named_parameters():
            value = opt if keep_vars else opt.detach()
            if self.preproc_state_dict_for_dcp_ckpt and isinstance(value, DTensor):
                start = torch.Size([opt.local_offset])  # type: ignore[attr-defined]
                attach_chunk_metadata(value, ChunkStorageMetadata(start, value.to_local().shape))
            out[prefix + name] = value
        for name, buf in self.module.named_buffers():
            out[prefix + name] = buf if keep_vars else buf.detach()
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load values shaped like ``state_dict()`` (sharded) or full tensors, then install.

        Raises:
            ValueError: for a missing/unexpected key (strict) or a shape mismatch.
        """
        expected = dict(self.optimizer_named_parameters())
        buffers = dict(self.module.named_buffers())
        missing = [k for k in (*expected, *buffers) if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected and k not in buffers]
        if strict and (missing or unexpected):
            raise ValueError(
                f"state_dict: missing keys {missing!r}, unexpected keys {unexpected!r}; "
                "expected the keys of MegatronFSDP.state_dict()"
            )
        with torch.no_grad():
            for name, opt in expected.items():
                if name in state_dict:
                    _load_into(name, opt, state_dict[name])
            for name, buf in buffers.items():
                if name in state_dict:
                    buf.copy_(state_dict[name])
        self.install_optimized_model_weights()
        return None


def _load_into(name: str, opt: nn.Parameter, value: Any) -> None:
    target = opt.to_local() if isinstance(opt, DTensor) else opt.data
    shape = getattr(opt, "orig_shape", opt.shape)
    if isinstance(value, DTensor):
        local = value.to_local()
        if local.shape != target.shape:
            raise ValueError(
                f"state_dict[{name!r}]: local shard of shape {tuple(local.shape)} does not match "
                f"this rank's shard {tuple(target.shape)}; expected the same sharding"
            )
        target.copy_(local)
        return
    if not isinstance(opt, DTensor):
        if value.shape != opt.shape:
            raise ValueError(
                f"state_dict[{name!r}]: shape {tuple(value.shape)} does not match "
                f"{tuple(opt.shape)}"
            )
        target.copy_(value)
        return
    if value.numel() != opt.numel() or (value.dim() > 1 and value.shape != shape):
        raise ValueError(
            f"state_dict[{name!r}]: shape {tuple(value.shape)} does not match the parameter's "
            f"{tuple(shape)}"
        )
    start = opt.local_offset  # type: ignore[attr-defined]
    target.copy_(value.reshape(-1)[start : start + target.numel()])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grad_tensors(out: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


def _materialize(root: nn.Module, params: set[nn.Parameter], device: torch.device) -> None:
    """Allocate and initialise the meta parameters in ``params`` (one unit's worth)."""
    for module in root.modules():
        direct = [p for p in module.parameters(recurse=False) if p in params and p.is_meta]
        if not direct:
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"init_model_with_meta_device: {type(module).__name__} holds meta parameters but "
                "has no reset_parameters(); expected every module with parameters to define it"
            )
        for p in direct:
            # swap_tensors keeps the Parameter object (optimizers and ties refer to it).
            real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
            torch.utils.swap_tensors(p, real)
        with torch.no_grad():
            reset()
