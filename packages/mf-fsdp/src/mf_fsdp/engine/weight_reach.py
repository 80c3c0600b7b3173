"""Whether the backwards of a step reached the weights: gradients that never came are refused.

The engine's gradients are autograd's own accumulation into the bucket buffers
(each compute parameter's ``.grad`` is a view of one), reduced when the backward
ends or the step finishes. A backward that computes gradients for some inputs
only (``torch.autograd.grad(loss, inputs=...)``) runs the units' backward hooks
but never accumulates. That is harmless where a backward that does reach the
weights follows before the step (torch's pipeline stages infer their shapes
with an input-only backward first; a gradient penalty takes input grads beside
the loss's backward). But where the step's only backwards reached no weight,
the engine would hand out gradients that are not there and the step would go
on without them. So each backward's start asks autograd whether it will run
the accumulation of any trainable compute parameter
(``torch._C._will_engine_execute_node``, as torch's FSDP asks it for its flat
parameters), and finishing the step's gradients stops with one line when
backwards ran since the last step and none of them reached a weight.

A zero-bubble pipeline schedule (ZBVZeroBubble, InterleavedZeroBubble,
DualPipeV) splits each backward: an input pass (``autograd.grad`` on the stage
inputs: no weight reached), then a weight pass that asks ``autograd.grad`` for
the weights' gradients and adds them to ``.grad`` of ``module.parameters()``
itself, which are then the compute forms (see [Note: forms in a pipeline] in
``megatron_fsdp.py``), so into the buffers. autograd accumulates nothing there,
so a backward that missed the weights records, at its end, the version
counters of the compute forms' grads, and the check counts a grad written in
place since then as reached.

Cost: the accumulation nodes are found once per set of compute parameters (one
``view_as`` each, first trainable parameter of each bucket); a backward asks
one question per bucket until one says yes, on the host; only a backward that
missed reads one version counter per bucket at its end and at the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.engine.rank_paths import default_store, stop_every_rank

__all__ = ["WeightReach"]


class WeightReach:
    """Whether this step's backwards reached a trainable parameter (see the module docstring)."""

    __slots__ = ("_key", "_missed", "_nodes", "_reached", "_versions")

    def __init__(self) -> None:
        self._key: tuple[int, ...] = ()
        self._nodes: list[torch.autograd.graph.Node] = []
        self._reached = False  # a backward since the last step accumulated into a weight
        self._missed = False  # a backward since the last step reached no weight
        self._versions: tuple[int, ...] = ()  # the grads' versions a missing backward left

    def note_backward(self, groups: Sequence[Bucket]) -> None:
        """Inside a backward's start: record whether it will accumulate into a weight."""
        if self._reached:
            return
        nodes = self._accumulators(groups)
        try:
            reached = not nodes or any(torch._C._will_engine_execute_node(n) for n in nodes)
        except RuntimeError:  # autograd.grad with a weight among its inputs: a weight pass
            reached = True
        if reached:
            self._reached = True
        else:
            self._missed = True

    def note_backward_end(self, groups: Sequence[Bucket]) -> None:
        """After a backward: where none reached a weight yet, remember the grads' versions."""
        if self._missed and not self._reached:
            self._versions = self._grad_versions(groups)

    def check_step(self, groups: Sequence[Bucket]) -> None:
        """Before the step's gradients are finished: refuse gradients that never came.

        Raises:
            UnitOrderError: one line naming the kind of backward and what is served,
                when backwards ran since the last step and none reached a weight; the
                line is posted and this rank's groups torn down first
                (``rank_paths.stop_every_rank``), so peers waiting on it in a pipeline's
                collectives fail instead of waiting for it.
        """
        missed = self._missed and not self._reached
        if missed and self._grad_versions(groups) != self._versions:
            missed = False  # written in place since (a pipeline's weight pass)
        self._missed = self._reached = False
        if not missed:
            return
        stop_every_rank(
            default_store(),
            "mf_fsdp: the backwards since the last step computed no gradient of any trainable "
            "parameter (torch.autograd.grad(..., inputs=...) calls, and no backward or weight "
            "pass after them wrote a weight's grad); the engine reduces the gradients autograd "
            "accumulates into its buffers: run loss.backward() before the step",
        )

    @staticmethod
    def _grad_versions(groups: Sequence[Bucket]) -> tuple[int, ...]:
        """The version counter of each bucket's first trainable compute grad (-1: none)."""
        return tuple(
            -1 if (grad := fp.compute.grad) is None else grad._version
            for group in groups
            for fp in group.fsdp_params[:1]
            if fp.compute.requires_grad
        )

    def _accumulators(self, groups: Sequence[Bucket]) -> list[torch.autograd.graph.Node]:
        firsts = [
            fp.compute
            for group in groups
            for fp in group.fsdp_params[:1]
            if fp.compute.requires_grad
        ]
        key = tuple(id(param) for param in firsts)
        if key != self._key:
            self._key = key
            self._nodes = [_accumulator(param) for param in firsts]
        return self._nodes


def _accumulator(param: torch.Tensor) -> torch.autograd.graph.Node:
    """The ``AccumulateGrad`` node of leaf ``param`` (the first input of a view's backward)."""
    with torch.enable_grad():  # a backward runs its hooks with grad mode off
        grad_fn = param.view_as(param).grad_fn
    node = None if grad_fn is None else grad_fn.next_functions[0][0]
    assert node is not None  # a leaf that requires grad: its view's backward feeds it
    return node
