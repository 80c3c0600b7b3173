"""One FSDP unit, and the autograd pieces that let the engine see its backward.

- ``Unit``: a unit (or the root), its buckets and its per-iteration state;
- ``RegisterFSDPBackwardFunction``: the identity a unit's inputs go through, whose
  backward tells the engine the unit's backward is done (``thread_inputs``);
- ``on_first_grad``: a hook run once when the first gradient of some outputs is made
  (a unit's pre-backward);
- ``eager``: a hook that runs eagerly when a compiled module calls it.

Records and autograd glue only: no collectives, no decisions (``engine/hooks.py``
decides when a unit gathers, releases and reduces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.config import TrainingState
from mf_fsdp.engine._tensor_tree import flatten

__all__ = [
    "RegisterFSDPBackwardFunction",
    "Unit",
    "eager",
    "grad_tensors",
    "on_first_grad",
    "thread_inputs",
]


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


class Unit:
    """One FSDP unit (or the root) and its per-iteration state.

    A unit of several modules (``members``, FSDP2's ``fully_shard([norm, output])``)
    has hooks on each. A unit may run more than once per forward while it is still
    gathered (a group's members, a layer applied twice in a row); its post-backward
    waits until the backward of every forward call of the iteration has run
    (``pending``, where its inputs are threaded, see [Note: where a unit's backward
    ends]), or until the backward's end when one of them had no input requiring
    grad. ``reshard_after_forward=False`` keeps the unit gathered from
    its forward to its backward, ``reshard_after_backward=False`` after its
    backward, and ``requires_gradient_sync=False`` keeps its grads local
    (unreduced, accumulating) across backwards, and ``unshard_in_backward=False``
    never gathers it for its backward, where autograd needs no weight of it
    (an embedding's; FSDP2's per-module options).
    ``solo_pending`` counts its calls by itself whose backward has not run (see
    [Note: a unit called by itself]). ``prefetch_forward`` / ``prefetch_backward``,
    when set, are the units its forward / backward prefetches instead of the
    recorded order's window.

    ``index`` is the unit's place in the units' order (the walk order, see
    ``UnitHooks._reorder``; -1 for the root). Per forward: ``forwarded`` (its
    collectives were issued: it ran, or it was skipped and stood in for) and
    ``ran`` (its module ran here).
    """

    __slots__ = (
        "_numel",
        "forwarded",
        "groups",
        "index",
        "members",
        "module",
        "name",
        "pending",
        "prefetch_backward",
        "prefetch_forward",
        "ran",
        "requires_gradient_sync",
        "reshard_after_backward",
        "reshard_after_forward",
        "solo_pending",
        "state",
        "unshard_in_backward",
    )

    def __init__(
        self,
        module: nn.Module | None,
        name: str,
        groups: list[Bucket],
        members: tuple[nn.Module, ...] = (),
    ) -> None:
        self.module = module
        self.name = name
        self.groups = groups
        self.members = members
        self.index = -1  # set by UnitHooks
        self.state = TrainingState.IDLE
        self.forwarded = False
        self.ran = False
        self.pending = 0
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.unshard_in_backward = True
        self.solo_pending = 0
        self.prefetch_forward: list[Unit] | None = None  # None: the recorded order's window
        self.prefetch_backward: list[Unit] | None = None
        self._numel: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the unit's whole buckets (what a gather or a reduction moves).

        Read once the engine is built (its groups are final then) and remembered.
        """
        if self._numel is None:
            self._numel = sum(group.layout.padded_numel for group in self.groups)
        return self._numel


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, run eagerly when a compiled module calls it (dynamo steps over it).

    [Note: hooks outside the compiled graph] A unit compiled by itself
    (``block.compile(fullgraph=True)``, before or after wrapping) or inside a
    compiled model runs the engine's hooks around its graph, as FSDP2 runs its
    own: they gather and release buffers, swap parameter forms and start
    collectives, none of which a graph can hold. The graph sees the gathered
    parameters as inputs.
    """
    return torch.compiler.disable(hook, recursive=True, reason="mf-fsdp hooks run eagerly")


def grad_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in ``out`` (any pytree, dataclasses included) that require grad."""
    if isinstance(out, torch.Tensor):  # the common case, without flattening
        return [out] if out.requires_grad else []
    flat, _ = flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


def thread_inputs(
    post_backward: Callable[[], None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The unit's inputs, their grad-requiring tensors threaded through the identity.

    Returns ``(args, kwargs)`` with those tensors replaced by the outputs of
    ``RegisterFSDPBackwardFunction`` (so ``post_backward`` runs at their
    backward), or None when no input requires grad.

    Positional tensors alone (a block's ``block(x)``) skip the pytree round
    trip: it was most of a unit's forward hook cost.
    """
    flat: list[Any]
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        flat, rebuild = list(args), None
    else:
        flat, rebuild = flatten((args, kwargs))
    slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not slots:
        return None
    wrapped = RegisterFSDPBackwardFunction.apply(post_backward, *(flat[i] for i in slots))
    for i, t in zip(slots, wrapped, strict=True):
        flat[i] = t
    return (tuple(flat), kwargs) if rebuild is None else rebuild(flat)


def on_first_grad(tensors: list[torch.Tensor], hook: Callable[[torch.Tensor | None], None]) -> None:
    """Run ``hook`` once per backward, when the first grad of ``tensors`` is computed.

    A single tensor (a block's output, the loss) takes a plain tensor hook: what
    ``register_multi_grad_hook(mode="any")`` amounts to for one tensor, at a
    third of its host cost (measured: 8 against 22 us to register and fire).
    """
    if len(tensors) == 1:
        tensors[0].register_hook(hook)
    else:
        torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
