"""Whether the backwards of a step reached the weights: gradients that never came are refused.

The engine's gradients are autograd's own accumulation into the bucket buffers
(each compute parameter's ``.grad`` is a view of one), reduced when the backward
ends or the step finishes. A backward that computes gradients for some inputs
only (``torch.autograd.grad(loss, inputs=...)``; the input pass of a zero-bubble
pipeline schedule, which later computes the weights' gradients by a second
``autograd.grad`` and adds them to ``.grad`` of ``module.parameters()`` itself)
runs the units' backward hooks but never accumulates. That is harmless where a
backward that does reach the weights follows before the step (torch's pipeline
stages infer their shapes with an input-only backward first; a gradient penalty
takes input grads beside the loss's backward). But where the step's only
backwards reached no weight, the engine would hand out gradients that are not
there and the step would go on without them. So each backward's start asks
autograd whether it will run the accumulation of any trainable compute
parameter (``torch._C._will_engine_execute_node``, as torch's FSDP asks it for
its flat parameters), and finishing the step's gradients stops with one line
when backwards ran since the last step and none of them reached a weight.

Cost: the accumulation nodes are found once per set of compute parameters (one
``view_as`` each, first trainable parameter of each bucket); a backward asks
one question per bucket until one says yes, on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.engine.rank_paths import default_store, stop_every_rank

__all__ = ["WeightReach"]


class WeightReach:
    """Whether this step's backwards reached a trainable parameter (see the module docstring)."""

    __slots__ = ("_key", "_missed", "_nodes", "_reached")

    def __init__(self) -> None:
        self._key: tuple[int, ...] = ()
        self._nodes: list[torch.autograd.graph.Node] = []
        self._reached = False  # a backward since the last step accumulated into a weight
        self._missed = False  # a backward since the last step reached no weight

    def note_backward(self, groups: Sequence[Bucket]) -> None:
        """Inside a backward's start: record whether it will accumulate into a weight."""
        if self._reached:
            return
        nodes = self._accumulators(groups)
        if not nodes or any(torch._C._will_engine_execute_node(node) for node in nodes):
            self._reached = True
        else:
            self._missed = True

    def check_step(self) -> None:
        """Before the step's gradients are finished: refuse gradients that never came.

        Raises:
            UnitOrderError: one line naming the kind of backward and what is served,
                when backwards ran since the last step and none reached a weight; the
                line is posted and this rank's groups torn down first
                (``rank_paths.stop_every_rank``), so peers waiting on it in a pipeline's
                collectives fail instead of waiting for it.
        """
        missed, self._missed = self._missed and not self._reached, False
        self._reached = False
        if not missed:
            return
        stop_every_rank(
            default_store(),
            "mf_fsdp: the backwards since the last step computed no gradient of any trainable "
            "parameter (torch.autograd.grad(..., inputs=...) calls, or the input-only passes of "
            "a zero-bubble pipeline schedule such as ZBVZeroBubble or InterleavedZeroBubble, "
            "whose weight passes mf cannot serve); the engine reduces the gradients autograd "
            "accumulates into its buffers: use loss.backward(), or a schedule without a split "
            "backward (GPipe, 1F1B, Interleaved1F1B)",
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
