"""The part of FSDP2's per-module state that torch's free functions read, answered by mf.

torch's ``register_fsdp_forward_method(module, name)`` and ``share_comm_ctx(modules)``
take any ``FSDPModule`` and reach for its state through ``module._get_fsdp_state()``:

- the forward method wrapper calls ``state._pre_forward(module, args, kwargs)``
  before the method and ``state._post_forward(module, args, output)`` after it;
- ``share_comm_ctx`` reads ``state._comm_ctx``, assigns it to the other modules'
  states and to their param groups' ``comm_ctx`` (``state._fsdp_param_groups`` on
  torch 2.15, the one ``state._fsdp_param_group`` or None on torch 2.11).

A module sharded by ``mf_fsdp.fsdp2`` answers with a ``TorchStateView``. Its
pre/post forward run the forward hooks mf itself put on the module (the engine's
gather and release of the unit or the root, the policy's input and output casts),
and none of the user's, as FSDP2 runs only its own logic around such a method. mf
issues every collective on the caller's current stream and allocates no stream of
its own, so all mf modules already share one communication context: the view's
``_comm_ctx`` is the one ``CALLER_STREAM`` object, and it has no param groups to
hand it to. Any other piece of FSDP2's state (its memory tracker reads many) raises
naming itself.

Invariants: a view runs only the hooks whose ids it was given, in the module's
registration order, and keeps only the keyword arguments of the method calls in
flight. It is handed the engine's builder (``records.ensure_built``) rather than
importing it: this module imports nothing else of ``mf_fsdp.fsdp2``, registers no
hook, and must not gather, release or reduce anything except through those hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NoReturn

from torch import nn

__all__ = ["CALLER_STREAM", "TorchStateView"]


class _CallerStream:
    """mf's communication context: the caller's current stream (no stream of mf's own)."""

    def __repr__(self) -> str:
        return "mf_fsdp: collectives on the caller's current stream"


CALLER_STREAM = _CallerStream()


class TorchStateView:
    """What torch's free functions over FSDP2 modules read of one ``fully_shard`` call's state.

    Args:
        ensure_built: builds the model's engine on first use (given the module).
        hook_ids: the ids of the forward (pre-)hooks mf registered on the call's modules.
    """

    __slots__ = (
        "_comm_ctx",
        "_ensure_built",
        "_fsdp_param_group",
        "_fsdp_param_groups",
        "_hook_ids",
        "_kwargs",
    )

    def __init__(
        self, ensure_built: Callable[[nn.Module], object], hook_ids: Collection[int]
    ) -> None:
        self._ensure_built = ensure_built
        self._hook_ids = frozenset(hook_ids)
        self._kwargs: list[dict[str, Any]] = []  # one per method call in flight, innermost last
        self._comm_ctx: object = CALLER_STREAM
        self._fsdp_param_groups: tuple[()] = ()  # torch 2.15's share_comm_ctx reads these
        self._fsdp_param_group: None = None  # and torch 2.11's this

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run mf's forward pre-hooks of ``module`` (gather, input casts), as its forward would."""
        self._ensure_built(module)
        with_kwargs = module._forward_pre_hooks_with_kwargs
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if hook_id not in self._hook_ids:
                continue
            if hook_id in with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        self._kwargs.append(kwargs)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Run mf's forward hooks of ``module`` (release, backward hooks, output casts)."""
        kwargs = self._kwargs.pop() if self._kwargs else {}
        with_kwargs = module._forward_hooks_with_kwargs
        for hook_id, hook in list(module._forward_hooks.items()):
            if hook_id not in self._hook_ids:
                continue
            if hook_id in with_kwargs:
                result = hook(module, args, kwargs, output)
            else:
                result = hook(module, args, output)
            if result is not None:
                output = result
        return output

    def __getattr__(self, name: str) -> NoReturn:
        raise NotImplementedError(
            f"FSDP2's FSDPState.{name} of a module sharded by mf_fsdp.fsdp2: mf answers only "
            "what register_fsdp_forward_method and share_comm_ctx read (_pre_forward, "
            "_post_forward, _comm_ctx and the param groups)"
        )
