"""MegatronFSDP: the module wrapper and its public training controls.

``MegatronFSDP`` wraps a model whose parameters live in flat sharded buckets
and exposes the Megatron-FSDP controls: gradient sync (``no_sync``,
``finish_grad_sync``, ...), parameter sync, broadcasts and introspection. The
jobs around it live in their own modules:

- construction: ``engine/discover.py`` (every parameter checked and described),
  ``engine/assemble.py`` (buckets and units built and filled),
  ``engine/sharded_params.py`` (the DTensors the optimizer steps on);
- a step: ``engine/hooks.py`` (the forward/backward state machine),
  ``engine/comm_window.py`` (gathers ahead, reductions together),
  ``engine/grad_sync.py`` (grads reduced, handed out, zeroed; when is
  ``engine/sync_policy.py``'s), ``engine/backward_step.py`` (the step inside
  the backward);
- the module it wraps: ``engine/module_contract.py`` (attribute access, state
  dicts, ``to_empty``), ``engine/forms.py`` (which parameter form the modules
  hold), ``engine/load_hooks.py`` (loading from any layout);
- what it tells about itself (optimizer parameters, buckets, bytes):
  ``engine/introspection.py``;
- the optimizer side, which the engine never imports: ``optim/``.

The buffers themselves belong to ``buckets/bucket.py``, and every collective on
them to ``buckets/collectives.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.buffer_pool import BufferPool
from mf_fsdp.buckets.layout import DEFAULT_ALIGNMENT
from mf_fsdp.buckets.param import FSDPParam
from mf_fsdp.buckets.units import plan_buckets, resolve_unit_classes
from mf_fsdp.config import (
    DistributedDataParallelConfig,
    MixedPrecisionPolicy,
    ZeroDPStrategy,
)
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.engine.assemble import BucketOptions, assemble, gather_fresh, reduce_spec_for
from mf_fsdp.engine.backward_step import BackwardStep, StepSome
from mf_fsdp.engine.discover import discover
from mf_fsdp.engine.forms import ParamForms
from mf_fsdp.engine.grad_sync import GradSync
from mf_fsdp.engine.hooks import UnitHooks
from mf_fsdp.engine.introspection import EngineIntrospection
from mf_fsdp.engine.load_hooks import register_load_hooks
from mf_fsdp.engine.meta_init import describe_meta_init, unready_error
from mf_fsdp.engine.module_contract import WrappedModule, check_module_to_wrap
from mf_fsdp.engine.options import check_engine_options, check_gradient_factor, unit_policies
from mf_fsdp.engine.rank_paths import translated
from mf_fsdp.engine.sharded_params import OWNER_ATTR, build_sharded_params
from mf_fsdp.engine.stats import BucketStats
from mf_fsdp.engine.sync_policy import SyncPolicy
from mf_fsdp.engine.unit import RegisterFSDPBackwardFunction, eager
from mf_utils import get_group_device

__all__ = [
    "ENGINE_BUILT",
    "BucketStats",
    "MegatronFSDP",
    "RegisterFSDPBackwardFunction",
    "owner_of",
]

ENGINE_BUILT: list[Callable[[], None]] = []
"""Called each time an engine is built. The optimizer side registers its process-wide
step hooks here (``optim/optimizer.py``), so that importing mf_fsdp installs nothing in
torch, and the engine never imports the optimizer side."""


def owner_of(param: torch.Tensor) -> MegatronFSDP | None:
    """The engine managing ``param`` (a compute or sharded parameter), or None."""
    ref = getattr(param, OWNER_ATTR, None)
    return None if ref is None else ref()


class MegatronFSDP(EngineIntrospection, WrappedModule):
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
        gradient_scaling_factor: extra factor applied to every reduced gradient
            (finite and positive; None means 1).
        alignment: per-tensor start alignment inside a bucket, in elements.
        unit_modules: units given as instances, each a group of one or more
            submodules gathered and released together (FSDP2's front end,
            ``mf_fsdp.fsdp2``, passes what ``fully_shard`` was called on); they may
            not contain one another.
        ignored_params: parameters of ``module`` the engine leaves alone, as FSDP2's
            ``ignored_params``: plain tensors on every rank, in no bucket, never
            gathered or reduced (their ``.grad`` is the local one autograd gives),
            outside ``clip_grad_norm_``; syncing them is the caller's (e.g. DDP's).
        unit_mixed_precision: a unit's own dtypes, in place of
            ``mixed_precision_policy``, keyed by the unit's module (the first of its
            group), as FSDP2 takes an ``mp_policy`` per ``fully_shard`` call.
        expert_mean_over_own_group: average expert gradients over the expert-data-parallel
            group (FSDP2's rule for a parameter on its own mesh) instead of over every
            data-parallel rank (Megatron's rule, the default).

    Raises:
        TypeError: if ``module``, ``dist_index``, ``ddp_config``,
            ``mixed_precision_policy`` or ``gradient_scaling_factor`` has the wrong type.
        ValueError: for a module that is already wrapped (a ``MegatronFSDP``, or a
            module with a parameter an engine manages), a ``gradient_scaling_factor``
            that is not finite and positive, a model without parameters, unknown unit
            classes, meta init with ``no_shard``, a main-grad dtype that differs from
            the main dtype, an outer strategy that does not match
            ``dist_index.hsdp_outer_dp_shard``, a scalar parameter under a sharded
            strategy, or a TP split without a parameter-shaped form (see
            ``tp_params.tp_info``).
    """

    def __init__(
        self,
        module: nn.Module,
        dist_index: FSDPDistributedIndex,
        ddp_config: DistributedDataParallelConfig | None = None,
        fsdp_unit_modules: Sequence[type[nn.Module] | str] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | None = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = False,
        *,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        gradient_scaling_factor: float | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        unit_modules: Sequence[Sequence[nn.Module]] = (),
        ignored_params: Collection[nn.Parameter] = (),
        unit_mixed_precision: Mapping[nn.Module, MixedPrecisionPolicy] | None = None,
        expert_mean_over_own_group: bool = False,
    ) -> None:
        super().__init__()
        check_module_to_wrap(module)
        if not isinstance(dist_index, FSDPDistributedIndex):
            raise TypeError(
                f"MegatronFSDP: dist_index must be an FSDPDistributedIndex, got {dist_index!r}"
            )
        if ddp_config is not None and not isinstance(ddp_config, DistributedDataParallelConfig):
            raise TypeError(
                f"ddp_config: expected a DistributedDataParallelConfig or None, got {ddp_config!r}"
            )
        check_engine_options(mixed_precision_policy, gradient_scaling_factor)
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
        self.sync_policy = SyncPolicy(self.strategy.shards_grads, sync_model_each_microbatch)
        self.device = device or get_group_device(dist_index.fsdp_group)
        self._pool = BufferPool()
        self._install_pending = False
        self._unassigned: frozenset[str] = frozenset()  # see _refuse_unready
        if init_model_with_meta_device and any(p.is_meta for p in module.parameters()):
            warnings.warn(describe_meta_init(module), stacklevel=3)
        found = discover(
            module,
            dist_index,
            self.strategy,
            self.ddp_config,
            ignored_params,
            init_model_with_meta_device,
        )
        specs = plan_buckets(
            module,
            resolve_unit_classes(fsdp_unit_modules),
            disable_bucketing,
            unit_modules,
            found.ignored,
        )
        self._bucket_options = BucketOptions(
            dist_index,
            self.strategy,
            self.ddp_config,
            self.device,
            self.mixed_precision_policy,
            unit_policies(module, unit_mixed_precision),
            calculate_per_token_loss,
            gradient_scaling_factor,
            None,
            alignment,
            expert_mean_over_own_group,
        )
        parts = assemble(
            module,
            specs,
            found.sources,
            self._bucket_options,
            self._pool,
            init_model_with_meta_device,
        )
        self._root, self._units, self.groups = parts.root, parts.units, parts.groups
        self._awaiting_to_empty = parts.awaiting_to_empty  # see [Note: meta-device flows]
        self._first_forward = True  # see gather_fresh
        build_sharded_params(self, self.groups, self.strategy)
        self.fsdp_params: list[FSDPParam] = [fp for g in self.groups for fp in g.fsdp_params]
        self._forms = ParamForms(self.fsdp_params, self.groups)
        self._grads = grads = GradSync(
            self.groups,
            self.fsdp_params,
            self.sync_policy,
            self.ddp_config,
            self.device,
            self._pool,
            self._forms,
        )
        if self.ddp_config.optimizer_step_in_backward:
            grads.backward_step = BackwardStep(self, grads.hand_out)
        grads.zero_buffers(release=True)  # no grads yet: ZeRO-2/3 stores hold no bytes
        self._forms.register_sharded()
        self._unit_hooks = UnitHooks(
            self._root,
            self._units,
            self.groups,
            self.strategy,
            self.ddp_config,
            reduce_now=self.sync_policy.reduce_at_unit_end,
            on_backward_start=grads.on_backward_start,
            on_backward_end=grads.on_backward_end,
            on_idle=self._between_passes,
            step=lambda: self.sync_policy.steps,
            peers=dist.get_process_group_ranks(dist_index.get_dp_group())
            if dist.is_initialized()
            else None,
            on_compute=self._forms.register_compute,
            on_reduced=None if grads.backward_step is None else grads.backward_step.step_units,
            on_solo_end=lambda units: grads.on_solo_backward_end(
                [g for u in units for g in u.groups]
            ),
        )
        self._unit_hooks.held.show = lambda unit, compute: self._forms.show_unit(
            [fp for group in unit.groups for fp in group.fsdp_params], compute
        )
        # The root's gather and release run around every call of the wrapped module,
        # also one the wrapper does not make (HF ``generate`` calls the module itself).
        module.register_forward_pre_hook(eager(self._root_pre_forward), prepend=True)
        module.register_forward_hook(eager(self._root_post_forward))
        register_load_hooks(
            module, self.fsdp_params, weakref.WeakMethod(self.install_optimized_model_weights)
        )
        for built in ENGINE_BUILT:
            built()

    def _between_passes(self) -> None:
        """The modules hold the sharded forms; in a pipeline, gathered units their compute ones.

        [Note: forms in a pipeline] torch's pipeline stages (manual backward
        finalization) read ``module.parameters()`` between passes: a zero-bubble
        schedule's input pass finds the weights' places in the graph by them, its
        weight pass adds their grads to their ``.grad``. As FSDP2 registers the
        unsharded parameters while a unit is gathered, so do mf's units then
        (``reshard_after_forward=False``, torchtitan's default under PP, and
        ``reshard_after_backward=False``, the stages'): the compute forms, whose
        ``.grad`` are views of the grad buffers. ``finalize_backward`` releases
        them and the sharded forms come back for the step.
        """
        self._forms.register_sharded()
        if self.sync_policy.manual_finalization:
            self._unit_hooks.held.show_gathered((self._root, *self._units))

    @staticmethod
    def owner_of(param: nn.Parameter) -> MegatronFSDP | None:
        """The engine managing model parameter ``param``, or None."""
        return owner_of(param)

    # ------------------------------------------------------------------ construction
    def _gather_new_extensions(self) -> None:
        """Gather once the extension buckets the wrap did not: that makes their forms.

        Runs at the first forward (after ``to_empty`` and the model's init for a
        meta-device model), on every rank.
        """
        peers = self.dist_index.get_dp_group() if dist.is_initialized() else None
        if gather_fresh(self.groups, peers, self):
            self._forms.rebuild(self.fsdp_params, self.groups)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce gradients as their sum over the data-parallel ranks divided by ``factor``.

        FSDP2's method of the same name: ``1.0`` sums, for a loss the user divides
        by a global count itself (torchtitan sums the loss over tokens and divides
        by the global token count). It replaces the default mean and
        ``calculate_per_token_loss``; ``gradient_scaling_factor`` still multiplies.
        Takes effect from the next reduction.

        Raises:
            TypeError / ValueError: if ``factor`` is not a finite positive number.
        """
        factor = check_gradient_factor("factor", factor)
        if self.calculate_per_token_loss or self.ddp_config.average_in_collective:
            warnings.warn(
                f"set_gradient_divide_factor({factor}): gradients are now summed over the "
                "data-parallel ranks and divided by the factor; calculate_per_token_loss and "
                "average_in_collective no longer apply",
                stacklevel=2,
            )
        self._bucket_options = dataclasses.replace(self._bucket_options, divide_factor=factor)
        for group in self.groups:
            group.reduce_spec = reduce_spec_for(group.dist_index, self._bucket_options)

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module with the engine's gathers, releases and reductions."""
        return self.module(*inputs, **kwargs)

    def _root_pre_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Before the wrapped module runs: compute forms registered, root bucket(s) gathered.

        The pool's large idle buffers (last backward's gradients) are freed first,
        so they do not add to this forward's activation peak.
        """
        if self._awaiting_to_empty or self._unassigned:
            self._refuse_unready()
        if self._install_pending or self._first_forward:
            self._first_forward = False  # extension hooks set after the wrap are checked now
            self._gather_new_extensions()
        if self._install_pending:  # the model's init wrote the sharded forms
            self._install_pending = False
            self.install_optimized_model_weights()
        self._pool.release_large()
        self._forms.register_compute()
        self._unit_hooks.root_pre_forward(self.sync_policy.manual_finalization)

    def _refuse_unready(self) -> None:
        """Stop a forward of a meta-device model whose values are not all given yet."""
        raise unready_error(
            type(self.module).__name__,
            (
                [fp.fqns[0] for group in unit.groups for fp in group.fsdp_params]
                for unit in (self._root, *self._units)
            ),
            self._awaiting_to_empty,
            self._unassigned,
        )

    def _root_post_forward(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        """After it: hook the backward, or release the root when no backward follows."""
        return self._unit_hooks.root_post_forward(out)

    # The reference's public sync switches, kept in the policy.
    @property
    def model_auto_sync(self) -> bool:
        """Wait for the reductions at the end of every backward (see ``SyncPolicy``)."""
        return self.sync_policy.auto_sync

    @model_auto_sync.setter
    def model_auto_sync(self, value: bool) -> None:
        self.sync_policy.auto_sync = bool(value)

    @property
    def is_last_microbatch(self) -> bool:
        """The current backward is the step's last micro-batch (see ``SyncPolicy``)."""
        return self.sync_policy.last_microbatch

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        self.sync_policy.last_microbatch = bool(value)

    @property
    def microbatch_count(self) -> int:
        """Backwards since the last ``finish_grad_sync``."""
        return self.sync_policy.microbatch_count

    # ------------------------------------------------------------------ sync control
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally, with no communication, inside the block.

        The reduction runs on the first backward after the block, or at the
        latest before ``optimizer.step()`` (``finish_grad_sync``).
        """
        with self.sync_policy.no_sync():
            yield

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Reduce and wait at the end of every backward inside the block."""
        with self.sync_policy.sync():
            yield

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """Turn per-backward waiting on (True) or defer it to ``finish_grad_sync`` (False)."""
        self.model_auto_sync = bool(sync_model)

    def get_distributed_index(self) -> FSDPDistributedIndex:
        """The meshes and groups this engine uses."""
        return self.dist_index

    # ------------------------------------------------------------------ grads
    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reduction of every group holding unreduced local grads."""
        self._grads.start()

    def synchronize_gradient_reduce(self) -> None:
        """Wait for every launched reduction and fold results into the grad stores.

        Also runs the deferred dp_outer stage of the reduction (HSDP; once per step).
        """
        self._grads.synchronize()

    @translated(lambda self: self._unit_hooks.store)
    def finish_grad_sync(self) -> None:
        """Reduce everything still local, wait, and attach grads for the optimizer.

        Safe to call any number of times; the wrapped optimizer's ``step`` calls it,
        so no strategy ever steps on unreduced gradients. Units left gathered
        (FSDP2's ``reshard_after_backward=False``, ``unshard``) are released: the
        step changes their shards.

        After a backward that reduced, waited and handed out every grad (auto-sync,
        the last micro-batch), or a call of this since, with no backward, zeroing
        or scaling after it, the grads are final: nothing is reduced, waited or
        handed out again (per bucket a few host ops, and with
        ``find_unused_parameters`` a device sync, each step), and a ``.grad`` the
        user replaced since stays replaced, as torch leaves it.
        """
        self._grads.finish(self._unit_hooks.release_held)

    def attach_grad_to_optimizer_state(self) -> None:
        """Point each sharded parameter's ``.grad`` at its reduced gradient.

        A no-op while a zeroing is deferred (no backward since an optimizer's
        ``zero_grad``): the grads it dropped must stay dropped.
        """
        self._grads.attach()

    def hand_out_grads(self, groups: list[Bucket]) -> None:
        """Point the ``.grad`` of ``groups``' sharded parameters at their reduced grads.

        With ``offload_optimizer_state`` those are host copies, whose copying has
        ended when this returns.
        """
        self._grads.hand_out(groups)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient held by the engine by ``scaling_factor``."""
        self._grads.scale(scaling_factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient: the engine's buffers and the optimizer parameters' ``.grad``."""
        self.zero_grad_buffer(release=set_to_none)
        if set_to_none:
            for fp in self.fsdp_params:
                if fp.grad is not None:
                    fp.sharded.grad = None

    def zero_grad_buffer(self, release: bool = False) -> None:
        """Zero every gradient buffer now.

        ``release``: nothing reads the gradients until the next backward (the
        optimizer parameters' ``.grad`` are None), so their buffers free their bytes
        and so do the idle temporaries: between steps a rank holds its weights and
        optimizer state only, as with FSDP2.
        """
        self._grads.zero_buffers(release)

    def add_optimizer(
        self, optimizer: torch.optim.Optimizer, step_some: StepSome | None = None
    ) -> None:
        """Count ``optimizer`` among those stepping this model (``fully_shard_optimizer`` does).

        ``step_some`` steps an optimizer on some of its parameters: what
        ``optimizer_step_in_backward`` runs per bucket (see ``engine/backward_step.py``).
        """
        self._grads.add_optimizer(optimizer)
        if self._grads.backward_step is not None and step_some is not None:
            self._grads.backward_step.step_some = step_some

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers bound to this model (``fully_shard_optimizer``)."""
        return self._grads.optimizers()

    @property
    def steps_in_backward(self) -> bool:
        """Whether the optimizer steps inside the backward (``optimizer_step_in_backward``)."""
        return self._grads.backward_step is not None

    @property
    def offloads_optimizer_state(self) -> bool:
        """Whether main weights and optimizer state live in host memory (the option)."""
        return self.ddp_config.offload_optimizer_state

    def request_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """``optimizer`` zeroed its parameters' grads: zero the buffers once every optimizer has.

        The buffers hold every parameter's gradient. With several optimizers (Muon
        and AdamW), one's ``zero_grad`` may run before the other's ``step``: the
        zeroing then waits until every optimizer of the model asked for it, or at
        the latest until the next backward starts.
        """
        self._grads.request_zero(optimizer, set_to_none)

    # ------------------------------------------------------------------ params
    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """Gather weights: ZeRO-3 buckets, or the ZeRO-1/2 all-gather of updated shards."""
        self._param_works = []
        with collectives.coalescing(self.ddp_config.suggested_communication_unit_size):
            for group in self.groups:
                if group.strategy.shards_params:
                    group.unshard(async_op=True)
                else:
                    work = group.install_main_weights(async_op=True)
                    if work is not None:
                        self._param_works.append(work)
        if force_sync or not (self.ddp_config.overlap_param_gather or force_dispatch):
            self.synchronize_param_gather()

    def synchronize_param_gather(self) -> None:
        """Wait for the gathers started by ``start_param_sync``."""
        for work in getattr(self, "_param_works", ()):
            work.wait()
        self._param_works = []
        for group in self.groups:
            group.wait_unshard()

    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's updated main weights into the model's compute weights.

        Buckets stepped inside this backward (``optimizer_step_in_backward``) were
        installed then.
        """
        groups = self.groups
        if self._grads.backward_step is not None:
            groups = self._grads.backward_step.unstepped(groups)
        with collectives.coalescing(self.ddp_config.suggested_communication_unit_size):
            works = [g.install_main_weights(async_op=True) for g in groups]
        for work in works:
            if work is not None:
                work.wait()

    def broadcast_params(self) -> None:
        """Make every replica of the weights equal to data-parallel rank 0's copy.

        Full weights (ZeRO-0/1/2) are broadcast over the whole data-parallel group and
        the main weights refreshed from them; ZeRO-3 shards only have replicas across
        ``dp_outer``, so they are broadcast there (nothing to do without it).
        """
        for group in self.groups:
            group.weights.broadcast_replicas()
