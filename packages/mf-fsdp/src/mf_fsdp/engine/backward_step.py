"""The optimizer step inside the backward: each bucket stepped once its grads are reduced.

[Note: optimizer step inside the backward] Under ZeRO-2/3 a bucket's reduced
gradient is final once its reduction completes (outside gradient
accumulation). With ``optimizer_step_in_backward`` the engine steps that
bucket's parameters right then, with the bound optimizers' own step given only
those parameters (torch's optimizers keep their state per parameter and skip a
parameter without a grad, so a step per bucket is the arithmetic of one step of
all), writes the stepped weights back (``install``: the ZeRO-2 all-gather, the
ZeRO-3 shard) and frees the bucket's gradient store. The gradients of the
model are then never all held at once.

A unit's bucket is stepped once its reduction has finished, which is after its
backward ended and its weights were released: nothing of this backward reads
them again. The root's buckets (and tied weights, which live there) are reduced
and stepped at the backward's end, as is every bucket whose reduction finished
there. Inside ``no_sync`` nothing is reduced, so nothing is stepped: the
backward that reduces (the step's last micro-batch) steps. Every rank reduces
the buckets in one order, so the all-gathers of ZeRO-2's install match.

[Note: host steps on a worker thread] With ``offload_optimizer_state`` a
bucket's step runs on the host, which must wait for the copy of its reduced
grads from the device. Waited for on the backward's own thread, that wait
drains the device's queue, and the device then idles through the host step:
the backward and every host step ran one after the other (0.88B GPT on an
H200: 443 ms a step, the backward about 65). Instead the copy is queued, the
device's grad store released behind it, and the step handed to one worker
thread that waits for that copy alone (an event) and steps; the backward's
thread goes on queueing the backward. Host steps and the device's backward
then overlap, and torch's kernels release the GIL while they run. The stepped
weights are installed (the ZeRO-1/2 all-gather, the ZeRO-3 copy into the
compute shard) once every host step is done, at the backward's end, on the
backward's thread, so every collective stays on one thread in one order. Only
the worker touches the optimizer until then; a backward that raised leaves its
steps to be settled when the next backward begins. A host step that raises on
one rank has its buckets installed all the same before its error is raised
there, so the other ranks' install collectives are matched, not left waiting.

This module knows the engine and takes the optimizers' partial step from the
optimizer side (``optim/optimizer.py`` registers it when it binds an
optimizer), so the engine still never imports ``optim``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.host import device_copies_mark
from mf_fsdp.config import DistributedDataParallelConfig

if TYPE_CHECKING:
    from mf_fsdp.engine.unit import Unit

__all__ = [
    "BackwardStep",
    "HandOut",
    "HostSteps",
    "StepOwner",
    "StepSome",
    "run_post_accumulate_grad_hooks",
]

StepSome = Callable[[torch.optim.Optimizer, set[int]], None]
"""Step ``optimizer`` on those of its parameters whose ``id`` is in the set, once."""

HandOut = Callable[[list[Bucket], bool], None]
"""The engine's ``hand_out_grads``, told whether to wait for copies into host grads."""


class StepOwner(Protocol):
    """What ``BackwardStep`` reads of the engine it steps (``StepOwner``)."""

    groups: list[Bucket]
    device: torch.device
    ddp_config: DistributedDataParallelConfig

    @property
    def offloads_optimizer_state(self) -> bool:
        """Whether main weights and optimizer state live in host memory."""
        ...

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers bound to the engine."""
        ...


class BackwardStep:
    """Steps an engine's buckets inside the backward (see the module note).

    Args:
        engine: the engine whose buckets it steps (held weakly).
        hand_out: the engine's way of handing out grads (see ``HandOut``).
    """

    def __init__(self, engine: StepOwner, hand_out: HandOut) -> None:
        self._engine = weakref.ref(engine)
        self._hand_out = hand_out
        self.step_some: StepSome | None = None
        self.stepped: set[int] = set()  # ids of the groups stepped since the backward began
        self._host_steps = HostSteps()

    def _owner(self) -> StepOwner:
        engine = self._engine()
        assert engine is not None  # internal invariant: the engine owns this object
        return engine

    def begin(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """A backward starts: nothing stepped yet; an optimizer must be bound.

        Raises:
            RuntimeError: if no optimizer was bound to the engine.
        """
        self.settle()  # steps a backward that raised left running
        if self.step_some is None or not list(optimizers):
            raise RuntimeError(
                "optimizer_step_in_backward=True: no optimizer is bound to this model, so "
                "the backward cannot step it; pass it to mf_fsdp.fully_shard(model, "
                "optimizer, ...) or mf_fsdp.fully_shard_optimizer(optimizer, model) before "
                "the first backward"
            )
        self.stepped = set()

    def unstepped(self, groups: list[Bucket]) -> list[Bucket]:
        """The ``groups`` not stepped in this backward (their grads are still to hand out)."""
        if not self.stepped:
            return groups
        return [group for group in groups if id(group) not in self.stepped]

    def step_units(self, units: list[Unit]) -> None:
        """The reductions of ``units`` finished: step their buckets (the hooks call this)."""
        self.step([group for unit in units for group in unit.groups])

    def finish(self) -> None:
        """The reducing backward ends: finish every reduction, step what is left, install."""
        engine = self._owner()
        for group in engine.groups:
            group.reduce_outer()
        self.step(engine.groups)
        self.settle()

    def settle(self) -> None:
        """Wait for the host steps still running, install their weights, raise their error.

        The buckets of a step that raised are installed too (their main weights as
        the step left them): the install's collectives (ZeRO-1/2's all-gather) then
        match those of ranks whose steps all succeeded, which would otherwise wait
        in them for good. The error is raised after.
        """
        if self._host_steps.pending:
            groups, error = self._host_steps.wait()
            self._install(groups)
            if error is not None:
                raise error

    def step(self, groups: list[Bucket]) -> None:
        """Step the bound optimizers on ``groups``' parameters; install, free their grads.

        With host-side state the step goes to the worker thread and the install
        waits for ``settle`` (see [Note: host steps on a worker thread]).
        """
        groups = [group for group in self.unstepped(groups) if group.requires_grad]
        if not groups:
            return
        engine = self._owner()
        for group in groups:
            group.reduce_outer()  # the dp_outer stage (HSDP); nothing without dp_outer
        on_host = engine.offloads_optimizer_state
        self._hand_out(groups, not on_host)
        if _hooked(groups):  # FSDP2's hooks see the reduced grad, before the step
            if on_host:
                device_copies_mark(engine.device)()  # the host grads they read
            run_post_accumulate_grad_hooks(groups)
        ids = {id(fp.sharded) for group in groups for fp in group.fsdp_params}
        optimizers = list(engine.optimizers())
        step_some = self.step_some
        assert step_some is not None  # checked by begin()
        self.stepped.update(id(group) for group in groups)
        if not on_host:
            for optimizer in optimizers:
                step_some(optimizer, ids)
            self._install(groups)
            return
        copied = device_copies_mark(engine.device)

        def host_step() -> None:
            copied()
            for optimizer in optimizers:
                step_some(optimizer, ids)

        self._host_steps.submit(host_step, groups)
        for group in groups:  # the device's store: the copy queued before reads it
            group.zero_grad(release=True)

    def _install(self, groups: list[Bucket]) -> None:
        """Copy ``groups``' stepped main weights into their compute weights; free their grads."""
        engine = self._owner()
        with collectives.coalescing(engine.ddp_config.suggested_communication_unit_size):
            works = [group.install_main_weights(async_op=True) for group in groups]
        for work in works:
            if work is not None:
                work.wait()
        for group in groups:
            for fp in group.fsdp_params:
                fp.sharded.grad = None
            group.zero_grad(release=True)


class HostSteps:
    """Host steps running on one worker thread, and the buckets each steps."""

    def __init__(self) -> None:
        self._worker: ThreadPoolExecutor | None = None  # started by the first step
        self.pending: list[tuple[Future[None], list[Bucket]]] = []

    def submit(self, step: Callable[[], None], groups: list[Bucket]) -> None:
        """Run ``step`` (which steps ``groups``) after the steps submitted before it."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="mf-fsdp-host-step")
        self.pending.append((self._worker.submit(step), groups))

    def wait(self) -> tuple[list[Bucket], BaseException | None]:
        """Wait for every submitted step: the groups they stepped, and the first error raised."""
        pending, self.pending = self.pending, []
        errors = [future.exception() for future, _ in pending]
        first = next((error for error in errors if error is not None), None)
        return [group for _, groups in pending for group in groups], first


def _hooked(groups: list[Bucket]) -> bool:
    """Whether a sharded parameter of ``groups`` has a post-accumulate-grad hook."""
    return any(fp.sharded._post_accumulate_grad_hooks for g in groups for fp in g.fsdp_params)


def run_post_accumulate_grad_hooks(groups: list[Bucket]) -> None:
    """Run the post-accumulate-grad hooks of the sharded parameters given a reduced grad.

    FSDP2 runs them on the sharded parameter once its reduced gradient is in place,
    after each backward that reduces (an optimizer stepped parameter by parameter in
    such a hook, torchtitan's and torch's recipe, relies on it). mf writes ``.grad``
    itself, outside autograd's accumulation, so it runs them where it hands a
    bucket's grads out: at the backward's end, or with ``optimizer_step_in_backward``
    per bucket before its step. A bucket that handed out no grad runs none.
    """
    for group in groups:
        if not group.grads_handed_out:
            continue
        for fp in group.fsdp_params:
            hooks = fp.sharded._post_accumulate_grad_hooks
            if hooks and fp.sharded.grad is not None:
                for hook in tuple(hooks.values()):
                    hook(fp.sharded)
