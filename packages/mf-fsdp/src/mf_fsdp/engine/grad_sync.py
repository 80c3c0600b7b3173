"""The engine's gradients from the backward to the optimizer: reduced, handed out, zeroed.

``GradSync`` applies the sync policy (``engine/sync_policy.py``: *when* to
reduce) at the end of each backward, finishes what is still local before an
optimizer steps (``finish``), points the sharded parameters' ``.grad`` at the
reduced grads (``hand_out``, withholding those no rank made, see [Note: grads
no rank made] in ``buckets/bucket.py``), and zeroes the buffers once
every optimizer of the model asked for it (``request_zero``). The buffers
themselves and the collectives on them are the buckets'.

A plain slots class holding the flags that change every step: setting an
attribute of an ``nn.Module`` runs its ``__setattr__`` checks (parameter?
submodule? buffer?), and these are set several times a step. Not a dataclass:
torch 2.11's dynamo takes a dataclass instance it meets while tracing for a
constant and fails to guard on it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.buffer_pool import BufferPool
from mf_fsdp.buckets.host import wait_for_device_copies
from mf_fsdp.buckets.param import FSDPParam
from mf_fsdp.config import DistributedDataParallelConfig
from mf_fsdp.engine.backward_step import BackwardStep, run_post_accumulate_grad_hooks
from mf_fsdp.engine.forms import ParamForms
from mf_fsdp.engine.sync_policy import SyncPolicy
from mf_fsdp.engine.weight_reach import WeightReach

__all__ = ["GradSync"]


class GradSync:
    """The gradient controls of one engine (see the module docstring).

    Args:
        groups: the engine's buckets, in order.
        fsdp_params: every managed parameter.
        policy: when the backward reduces and waits.
        ddp_config: overlap, offload and unused-parameter options.
        device: where the buffers live.
        pool: the engine's temporaries (freed when the grads are dropped).
        forms: the parameters' forms (the compute forms are registered for a backward).
    """

    __slots__ = (
        "_ddp_config",
        "_device",
        "_forms",
        "_optimizers",
        "_policy",
        "_pool",
        "_reach",
        "_zeroed_by",
        "backward_step",
        "fsdp_params",
        "grads_final",
        "groups",
        "zero_pending",
        "zero_releases",
    )

    def __init__(
        self,
        groups: list[Bucket],
        fsdp_params: list[FSDPParam],
        policy: SyncPolicy,
        ddp_config: DistributedDataParallelConfig,
        device: torch.device,
        pool: BufferPool,
        forms: ParamForms,
    ) -> None:
        self.groups = groups
        self.fsdp_params = fsdp_params
        self._policy = policy
        self._ddp_config = ddp_config
        self._device = device
        self._pool = pool
        self._forms = forms
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._zeroed_by: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.backward_step: BackwardStep | None = None  # optimizer_step_in_backward
        self.zero_pending = False  # an optimizer's zero_grad waits for the others'
        self.zero_releases = True  # every zero_grad since the last zeroing set grads to None
        self.grads_final = False  # see finish()
        self._reach = WeightReach()  # refuses a step whose backwards reached no weight

    # ------------------------------------------------------------------ the backward
    def on_backward_start(self) -> None:
        """Register the compute forms; run the zeroing deferred by ``request_zero``.

        Whether it reaches a trainable parameter is noted (``weight_reach.py``).
        """
        self._reach.note_backward(self.groups)
        self.grads_final = False
        self._forms.register_compute()
        if self.backward_step is not None:
            self.backward_step.begin(self._optimizers)
        if not self.zero_pending:
            return
        kept = [type(o).__name__ for o in self._optimizers if o not in self._zeroed_by]
        if kept:
            warnings.warn(
                f"MegatronFSDP: optimizers {kept} did not call zero_grad since the last step, "
                "but another optimizer of this model did: the model's gradient buffers are "
                "shared, so their parameters' gradients start from zero in this backward "
                "instead of accumulating",
                stacklevel=2,
            )
        self.zero_buffers(release=self.zero_releases)

    def on_backward_end(self) -> None:
        """Count the micro-batch; with auto-sync, wait for the reductions and attach grads.

        With ``optimizer_step_in_backward``, a backward that reduced finishes every
        reduction and steps the buckets not stepped yet: the step is then done.
        Then the grads' versions are noted (``weight_reach.py``).
        """
        self._end_backward()
        self._reach.note_backward_end(self.groups)

    def _end_backward(self) -> None:
        policy = self._policy
        policy.backward_ended()
        if self.backward_step is not None and policy.reduce_at_unit_end():
            self.backward_step.finish()  # every bucket stepped: the step is done
            policy.step_finished()
            return
        if policy.wait_at_backward_end():
            outer = policy.outer_at_backward_end()
            if outer:
                self.synchronize()
            else:
                for group in self.groups:
                    group.finish_reduce()
            self.attach()
            self.grads_final = outer or all(group.outer is None for group in self.groups)
            run_post_accumulate_grad_hooks(self.groups)

    def on_solo_backward_end(self, groups: list[Bucket]) -> None:
        """A backward of units called by themselves only, reduced into ``groups``, ended.

        A root forward still waits for its backward (torchtitan's chunked loss), so
        this is no micro-batch; with auto-sync the reduced grads are handed out now,
        as FSDP2 gives ``.grad`` after every backward, not only after the root's.
        """
        policy = self._policy
        if not groups or self.backward_step is not None or not policy.wait_at_backward_end():
            return
        if policy.outer_at_backward_end():
            self.synchronize(groups)
        self.hand_out(groups)
        run_post_accumulate_grad_hooks(groups)

    # ------------------------------------------------------------------ reductions
    def start(self) -> None:
        """Launch the reduction of every group holding unreduced local grads."""
        with collectives.coalescing(self._ddp_config.suggested_communication_unit_size):
            for group in self.groups:
                group.start_reduce(async_op=True)
        if not self._ddp_config.overlap_grad_reduce:
            for group in self.groups:
                group.finish_reduce()

    def synchronize(self, groups: list[Bucket] | None = None) -> None:
        """Wait for every launched reduction (of ``groups``, default all) and fold them in.

        Also runs the deferred dp_outer stage of the reduction (HSDP; once per step):
        the replicated buckets' all-reduces go out coalesced (one collective for the
        small ones, as the dp_shard stage's).
        """
        groups = self.groups if groups is None else groups
        for group in groups:
            group.finish_reduce()
        due = [group for group in groups if group.outer_due]
        if due:
            with collectives.coalescing(self._ddp_config.suggested_communication_unit_size):
                launched = [group.launch_outer(async_op=True) for group in due]
            for group, work in zip(due, launched, strict=True):
                group.land_outer(work)
        for group in groups:
            if group.hybrid:
                group.reduce_outer()

    def finish(self, release_held: Callable[[], None]) -> None:
        """Reduce everything still local, wait, and attach grads for the optimizer.

        ``release_held`` releases the units left gathered (the step changes their
        shards). After a backward that reduced, waited and handed out every grad,
        or a call of this since, with no backward, zeroing or scaling after it, the
        grads are final: nothing is reduced, waited or handed out again, and a
        ``.grad`` the user replaced since stays replaced, as torch leaves it.
        """
        self._reach.check_step(self.groups)
        release_held()
        if not self.grads_final:
            self.start()
            self.synchronize()
            self.attach()
            self.grads_final = True
        self._policy.step_finished()

    # ------------------------------------------------------------------ hand-out
    def attach(self) -> None:
        """Point each sharded parameter's ``.grad`` at its reduced gradient.

        A no-op while a zeroing is deferred (no backward since an optimizer's
        ``zero_grad``): the grads it dropped must stay dropped.
        """
        if self.zero_pending:
            return
        groups = self.groups
        if self.backward_step is not None:  # stepped ones had their grads already
            self.backward_step.settle()  # host steps a backward that raised left running
            groups = self.backward_step.unstepped(groups)
        self.hand_out(groups)

    def hand_out(self, groups: list[Bucket], wait: bool = True) -> None:
        """Point the ``.grad`` of ``groups``' sharded parameters at their reduced grads.

        With ``offload_optimizer_state`` those are host copies, whose copying has
        ended when this returns (``wait=False`` leaves that wait to the caller).
        """
        for group in groups:  # dropped by an optimizer's zero_grad, no backward since
            group.forget_dropped_grads()
        # A bucket no backward reached since its grads were zeroed (a unit called by
        # itself leaves the others alone) hands out nothing: its parameters keep the
        # ``.grad`` the optimizer left them (None after ``zero_grad``, as torch leaves
        # them; zeros that DSD sets to create state), never stale or zero buffers.
        for group in groups:
            if group.requires_grad and group.untouched:
                group.grads_handed_out = False
        groups = [group for group in groups if not (group.requires_grad and group.untouched)]
        for group in groups:
            for fp in group.fsdp_params:
                if fp.grad is not None and fp.sharded.requires_grad:  # frozen: no grad
                    fp.sharded.grad = fp.grad
        for group in groups:
            if group.unused_mark and group.unused_everywhere():
                # No rank ran its unit in this step: no grads, as torch leaves them
                # (see [Note: grads no rank made] in buckets/bucket.py).
                for fp in group.fsdp_params:
                    fp.sharded.grad = None
                    fp.compute.grad = None
                group.grads_handed_out = False
                continue
            group.hold_grads()
            group.offload_grads()
            if group.replicated and not group.main_is_separate:
                group.attach_local_grads()
            group.grads_handed_out = group.requires_grad
        if self._ddp_config.offload_optimizer_state and wait:
            wait_for_device_copies(self._device)  # the host step reads what they wrote
        if self._ddp_config.find_unused_parameters:
            self._withhold_unused(groups)

    def _withhold_unused(self, groups: list[Bucket]) -> None:
        """Take back the grads of parameters no rank's backward reached.

        One device sync a step (the quick look), a second one where some bucket may
        hold such a parameter.
        """
        groups = [group for group in groups if group.grads_handed_out]
        if not groups:
            return
        # A quick look first (three ops a bucket): a bucket whose store holds no -0.0 and
        # whose rowless parameters were all reached has nothing to withhold, the usual step.
        maybe = torch.stack([group.may_hold_unused() for group in groups]).tolist()
        groups = [group for group, flag in zip(groups, maybe, strict=True) if flag]
        if not groups:
            return
        unused = iter(torch.cat([group.unused_params() for group in groups]).tolist())
        for group in groups:
            withheld = [fp for fp in group.fsdp_params if next(unused)]
            if withheld:
                group.withhold_grads(withheld)

    def follow_requires_grad(self) -> None:
        """Freeze (or unfreeze) each compute form as its sharded form is, FSDP2's rule.

        ``requires_grad_(False)`` on a parameter of the sharded model (its sharded
        form, what ``parameters()`` gives) leaves it without a gradient: autograd
        skips its compute form and ``hand_out`` gives it none, so no optimizer moves
        it. One comparison per parameter; run before each forward of the root.

        Raises:
            NotImplementedError: for a parameter unfrozen in a bucket built frozen
                (it has no gradient buffers).
        """
        for fp in self.fsdp_params:
            wanted = fp.sharded.requires_grad
            if fp.compute.requires_grad != wanted:
                if wanted and not self._bucket_of(fp).requires_grad:
                    raise NotImplementedError(
                        f"requires_grad_(True) on {fp.fqn}, frozen when the model was sharded "
                        "(its first parameters(), state_dict() or forward): mf built its bucket "
                        "without gradient buffers; unfreeze it before, or freeze after"
                    )
                fp.compute.requires_grad_(wanted)

    def _bucket_of(self, fp: FSDPParam) -> Bucket:
        return next(g for g in self.groups if any(f is fp for f in g.fsdp_params))

    def scale(self, factor: float) -> None:
        """Multiply every gradient held by the engine by ``factor``."""
        self.grads_final = False
        for group in self.groups:
            group.scale_gradients(factor)

    # ------------------------------------------------------------------ zeroing
    def zero_buffers(self, release: bool = False) -> None:
        """Zero every gradient buffer now.

        ``release``: nothing reads the gradients until the next backward (the
        optimizer parameters' ``.grad`` are None), so their buffers free their bytes
        and so do the idle temporaries: between steps a rank holds its weights and
        optimizer state only, as with FSDP2.
        """
        self.zero_pending = False
        self.grads_final = False
        self.zero_releases = True
        self._zeroed_by.clear()
        for group in self.groups:
            group.zero_grad(release)
        if release:
            self._pool.clear()
            collectives.release_workspaces()

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer`` among those stepping the model."""
        self._optimizers.add(optimizer)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers counted by ``add_optimizer``."""
        return list(self._optimizers)

    def request_zero(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        """``optimizer`` zeroed its parameters' grads: zero the buffers once every optimizer has.

        The buffers hold every parameter's gradient. With several optimizers (Muon
        and AdamW), one's ``zero_grad`` may run before the other's ``step``: the
        zeroing then waits until every optimizer of the model asked for it, or at
        the latest until the next backward starts.
        """
        self.grads_final = False
        self.zero_releases = self.zero_releases and set_to_none
        # One optimizer (the usual case) needs no record of who zeroed: a weak set's
        # iteration and membership tests are Python loops, a per-step host cost.
        if len(self._optimizers) != 1 or optimizer not in self._optimizers:
            self._zeroed_by.add(optimizer)
            if not all(o in self._zeroed_by for o in self._optimizers):
                self.zero_pending = True
                return
        self.zero_buffers(release=self.zero_releases)
