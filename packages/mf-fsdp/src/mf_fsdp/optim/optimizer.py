"""Optimizer integration: rebind to sharded parameters, finish reductions, install weights.

An optimizer works on mf's sharded parameters whichever way it was built:

- built on the original module's parameters before wrapping:
  ``fully_shard_optimizer`` swaps each one for its sharded form (groups and
  options kept) and creates the state at once (see [Note: eager optimizer
  state] in ``optim/state.py``);
- built after wrapping on ``model.parameters()`` (as with PyTorch FSDP2): it
  already holds the sharded forms; ``fully_shard_optimizer`` adds the eager
  state and zero_grad integration, and works without it too.

Step hooks do what every such optimizer needs: before ``step()`` finish every
pending gradient reduction of the engines owning its parameters (no strategy
ever steps on unreduced grads) and drop unused initial buffers; after it,
install the updated weights into the model's buffers. An optimizer bound by
``fully_shard_optimizer`` carries them itself. For the others (built on
``model.parameters()`` after wrapping, as with FSDP2) they are process-wide
(``install_optimizer_hooks``), registered when the first engine is built, not
when mf_fsdp is imported; an optimizer of no engine's parameters passes them
at the cost of one cached lookup. The same pre-hook rejects an optimizer that
still holds compute parameters (the original objects, whose values live in
the engine's buffers), which would otherwise silently train nothing.

With ``optimizer_step_in_backward`` the engine steps each bucket inside the
backward through ``step_some``: the optimizer's own ``step()`` on that bucket's
parameters, whose hooks then only swap in the local pieces (the engine
reduces, installs and frees per bucket itself). This module never builds the sharded
parameters (``engine/sharded_params.py`` does) and imports the engine for type
hints only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from mf_fsdp.engine.megatron_fsdp import ENGINE_BUILT, owner_of
from mf_fsdp.engine.sharded_params import MANAGED_ATTR
from mf_fsdp.optim.kernel_choice import prefer_fast_kernels
from mf_fsdp.optim.local_step import enter_local_step, exit_local_step, forget_local_plans
from mf_fsdp.optim.shape_aware import (
    ELEMENTWISE_OPTIMIZERS,
    check_supported,
    serve_step,
    served,
)
from mf_fsdp.optim.state import (
    drop_unused_initial_state,
    init_optimizer_state,
    initializing,
    localize_loaded_state,
    snapshot_state,
)

if TYPE_CHECKING:
    from mf_fsdp.engine.megatron_fsdp import MegatronFSDP

__all__ = ["Optimizers", "fully_shard_optimizer", "install_optimizer_hooks", "optimizer_list"]

Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...]
"""One optimizer, or several stepping one model together (Muon for matrices, AdamW for the rest)."""

_HOOKS_INSTALLED = False
_LOAD_HOOK_ATTR = "_mf_fsdp_load_hook"
_CHECKED_ATTR = "_mf_fsdp_checked"
_HIDDEN_ATTR = "_mf_fsdp_hidden_grads"
_ENGINES_ATTR = "_mf_fsdp_engines"
_BOUND_AT_STEP_ATTR = "_mf_fsdp_bound_at_step"
_PARTIAL_ATTR = "_mf_fsdp_partial_step"
_BIND_AT_STEP: weakref.WeakSet[MegatronFSDP] = weakref.WeakSet()
"""Engines whose unbound optimizers are bound for the step at their first ``step()``."""


def optimizer_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list: itself, or the optimizers of a list or tuple."""
    return list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]


def install_optimizer_hooks() -> None:
    """Register (once per process) the step hooks of optimizers not bound to an engine.

    Building an engine calls it (``ENGINE_BUILT``); importing mf_fsdp does not.
    """
    global _HOOKS_INSTALLED
    if not _HOOKS_INSTALLED:
        register_optimizer_step_pre_hook(_before_unbound_step)
        register_optimizer_step_post_hook(_after_unbound_step)
        _HOOKS_INSTALLED = True


ENGINE_BUILT.append(install_optimizer_hooks)


def _before_unbound_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_mf_fsdp_model", None) is None:  # bound ones carry their own
        _before_step(optimizer, args, kwargs)


def _after_unbound_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_mf_fsdp_model", None) is None:
        _after_step(optimizer, args, kwargs)


def _engines(optimizer: torch.optim.Optimizer) -> list[MegatronFSDP]:
    """The engines owning ``optimizer``'s parameters, in first-seen order.

    Remembered per optimizer until its param lists change (checked by identity
    and length: ``add_param_group``, or parameters set into a group).

    Raises:
        RuntimeError: if the optimizer holds compute parameters of a wrapped model.
    """
    signature = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
    known = getattr(optimizer, _ENGINES_ATTR, None)
    if known is not None and known[0] == signature:
        return known[1]
    engines = _find_engines(optimizer)
    setattr(optimizer, _ENGINES_ATTR, (signature, engines))
    return engines


def _find_engines(optimizer: torch.optim.Optimizer) -> list[MegatronFSDP]:
    engines: dict[int, MegatronFSDP] = {}
    for group in optimizer.param_groups:
        _take_sharded_forms(optimizer, group["params"])
        for param in group["params"]:
            if getattr(param, MANAGED_ATTR, False):
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): this optimizer holds the original "
                    "parameters of a model wrapped by mf_fsdp, whose values and grads live in "
                    "the engine's buffers; stepping it would silently train nothing. Pass it "
                    "through mf_fsdp.fully_shard_optimizer(optimizer) (or fully_shard(model, "
                    "optimizer)), or build it on model.parameters() after wrapping."
                )
            engine = owner_of(param)
            if engine is not None:
                engines.setdefault(id(engine), engine)
    return list(engines.values())


def _take_sharded_forms(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Put the sharded form in place of each original parameter of an FSDP2-front-end engine.

    FSDP2's ``fully_shard`` swaps a module's parameters at the call, so an optimizer
    built on a plain parent's ``parameters()`` before the first forward (no root
    ``fully_shard``) holds its sharded parameters. mf builds its engine at the
    model's first use, so such an optimizer holds the originals: here, at its first
    step, each one is replaced in place in its group by the parameter FSDP2 would
    have given (only for the engines of ``mf_fsdp.fsdp2``, and only while the
    optimizer has no state for it; the others keep the refusal below).
    """
    for i, param in enumerate(params):
        if not getattr(param, MANAGED_ATTR, False) or param in optimizer.state:
            continue
        engine = owner_of(param)
        if engine is not None and engine in _BIND_AT_STEP:
            params[i] = engine.optimizer_param(cast(nn.Parameter, param))


def _delegates(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a container whose ``step()`` steps inner torch optimizers.

    torchtitan's ``OptimizersContainer`` (``optimizers``) and wrappers such as
    Accelerate's (``optimizer``) are ``Optimizer`` subclasses over the same
    parameters; the inner optimizers' own steps take the hooks below, so the
    container's must pass.
    """
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, list | tuple) and inner:
        return all(isinstance(o, torch.optim.Optimizer) for o in inner)
    return isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _delegates(optimizer):
        return
    if getattr(optimizer, _PARTIAL_ATTR, False):  # one bucket's step inside the backward
        drop_unused_initial_state(optimizer)
        enter_local_step(optimizer)
        return
    engines = _engines(optimizer)
    if not engines or initializing(optimizer):
        return
    if not getattr(optimizer, _CHECKED_ATTR, False):  # built after wrapping: check it once
        check_supported(optimizer, _params(optimizer))
        for option, (on, _) in _ELEMENTWISE_ONLY.items():
            if any(on(engine) for engine in engines):
                check_elementwise(optimizer, option)
        setattr(optimizer, _CHECKED_ATTR, True)
        if all(engine in _BIND_AT_STEP for engine in engines):
            _bind_step(optimizer, engines)
    _ensure_load_hooks(optimizer)
    for engine in engines:
        engine.finish_grad_sync()
    drop_unused_initial_state(optimizer)
    # Shape-aware optimizers: the engine steps their sharded parameters itself (see
    # [Note: served optimizers]); torch's step must not see those grads.
    hidden = [(param, param.grad) for param in serve_step(optimizer)]
    for param, _ in hidden:
        param.grad = None
    setattr(optimizer, _HIDDEN_ATTR, hidden)
    bound = getattr(optimizer, "_mf_fsdp_model", None) is not None
    if bound or getattr(optimizer, _BOUND_AT_STEP_ATTR, False):  # its step() restores the swap
        enter_local_step(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _delegates(optimizer):
        return
    exit_local_step(optimizer)
    if initializing(optimizer) or getattr(optimizer, _PARTIAL_ATTR, False):
        return
    for param, grad in getattr(optimizer, _HIDDEN_ATTR, ()):
        param.grad = grad
    setattr(optimizer, _HIDDEN_ATTR, [])
    for engine in _engines(optimizer):
        engine.install_optimized_model_weights()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _remember_layouts(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    snapshot_state(optimizer)


def _ensure_load_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Loaded state of another layout goes into the layout of the state it replaces."""
    if not getattr(optimizer, _LOAD_HOOK_ATTR, False):
        optimizer.register_load_state_dict_pre_hook(_remember_layouts)
        optimizer.register_load_state_dict_post_hook(localize_loaded_state)
        optimizer.register_load_state_dict_post_hook(prefer_fast_kernels)
        optimizer.register_load_state_dict_post_hook(forget_local_plans)
        setattr(optimizer, _LOAD_HOOK_ATTR, True)


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer, model: MegatronFSDP | None = None
) -> torch.optim.Optimizer:
    """Bind ``optimizer`` to the engine's sharded parameters and create its state.

    Args:
        optimizer: any ``torch.optim.Optimizer`` whose params are the wrapped model's
            parameters (the original ones, which must not have stepped yet, or the
            sharded ones from ``model.parameters()``).
        model: the ``MegatronFSDP`` owning them; found from the parameters when None.

    Returns:
        The same optimizer object, stepping on the engine's sharded parameters, with
        its state already created (so ``dcp.load`` into its ``state_dict()`` works).

    Raises:
        TypeError: if ``optimizer`` is not a torch optimizer.
        ValueError: if it was already passed through, has state keyed by the original
            parameters, holds a parameter that no ``MegatronFSDP`` manages, or is an
            optimizer the engine cannot step correctly on sharded parameters (see
            ``mf_fsdp.optim.shape_aware.check_supported``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fully_shard_optimizer: optimizer must be a torch.optim.Optimizer, got {optimizer!r}"
        )
    if getattr(optimizer, "_mf_fsdp_model", None) is not None:
        raise ValueError("fully_shard_optimizer: optimizer was already passed through it once")
    if model is None:
        model = _find_model(optimizer)
    # cast: optimizer_param is typed for parameters and refuses any tensor it does not manage
    params = cast(list[nn.Parameter], _params(optimizer))
    originals = any(
        getattr(p, MANAGED_ATTR, False) or model.optimizer_param(p) is not p for p in params
    )
    if originals and optimizer.state:
        raise ValueError(
            "fully_shard_optimizer: optimizer already has state (it has stepped on the "
            "original parameters); expected a fresh optimizer built on the model's parameters"
        )
    check_supported(optimizer, [model.optimizer_param(p) for p in params])
    for option, (on, _) in _ELEMENTWISE_ONLY.items():
        if on(model):
            check_elementwise(optimizer, option)
    for group in optimizer.param_groups:
        group["params"] = [model.optimizer_param(p) for p in group["params"]]
    setattr(optimizer, _CHECKED_ATTR, True)
    optimizer._mf_fsdp_model = model  # type: ignore[attr-defined]
    optimizer.register_step_pre_hook(_before_step)
    optimizer.register_step_post_hook(_after_step)
    _ensure_load_hooks(optimizer)
    _route_zero_grad(optimizer, [model])
    model.add_optimizer(optimizer, step_some)
    _restore_after_step(optimizer)
    init_optimizer_state(optimizer)
    prefer_fast_kernels(optimizer)
    return optimizer


_ELEMENTWISE_ONLY: dict[str, tuple[Callable[[MegatronFSDP], bool], str]] = {
    "optimizer_step_in_backward": (
        lambda model: model.steps_in_backward,
        "steps each bucket's parameters on their own as soon as their gradients are reduced",
    ),
    "offload_optimizer_state": (
        lambda model: model.offloads_optimizer_state,
        "steps this rank's pieces of the parameters in host memory, away from the "
        "collectives a shape-aware step needs",
    ),
}
"""Engine options that step elementwise optimizers only: whether an engine has it on, and why."""


def check_elementwise(optimizer: torch.optim.Optimizer, option: str) -> None:
    """Refuse an optimizer that engine option ``option`` cannot step (see ``_ELEMENTWISE_ONLY``).

    Raises:
        ValueError: naming the optimizer's class and the option, unless it is
            elementwise and not differentiable (a shape-aware step reads whole
            parameters or many at once).
    """
    differentiable = any(group.get("differentiable", False) for group in optimizer.param_groups)
    if (
        served(optimizer) is not None
        or differentiable
        or not isinstance(optimizer, tuple(ELEMENTWISE_OPTIMIZERS))
    ):
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        why = "differentiable=True" if differentiable else "not elementwise"
        raise ValueError(
            f"optimizer: {name} is {why}; {option}=True {_ELEMENTWISE_ONLY[option][1]}, which "
            "only an elementwise optimizer (SGD, Adam, AdamW, ...) computes exactly as one "
            f"step of all; turn {option} off for this optimizer"
        )


@torch.no_grad()
def step_some(optimizer: torch.optim.Optimizer, ids: set[int]) -> None:
    """One step of ``optimizer`` on its parameters whose ``id`` is in ``ids`` (the others wait).

    Its param groups hold only those parameters for the duration of the call
    (options, and each parameter's state, untouched); the step hooks then skip
    the engine's work (``optimizer_step_in_backward`` does it per bucket).
    """
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in ids]
    setattr(optimizer, _PARTIAL_ATTR, True)
    try:
        optimizer.step()
    finally:
        setattr(optimizer, _PARTIAL_ATTR, False)
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params


def bind_optimizers_at_step(engine: MegatronFSDP) -> None:
    """Step the optimizers built on ``engine``'s parameters as bound ones, unbound.

    For FSDP2's interface (``mf_fsdp.fsdp2``), where the optimizer is built on
    ``model.parameters()`` and never passed to ``fully_shard_optimizer``: at its
    first ``step()`` it gets the bound optimizers' step path (the local step on
    plain tensors and the multi-tensor kernels, see ``prefer_fast_kernels`` and
    [Note: local step]), the same arithmetic with the host cost of
    ``mf_fsdp.fully_shard``'s. Its ``zero_grad`` and state stay torch's (no eager
    state): only the step changes.
    """
    _BIND_AT_STEP.add(engine)


def _bind_step(optimizer: torch.optim.Optimizer, engines: list[MegatronFSDP]) -> None:
    """From this step on: fast kernels and the local step, restored if a step raises.

    The step running now (from whose pre-hook this is called) is not yet wrapped:
    it swaps too, and its post-hook restores the swap unless it raises. An engine
    that offloads the optimizer state also learns of the optimizer's ``zero_grad``:
    its parameters' grads are host copies of the engine's, so zeroing them in place
    (``set_to_none=False``) would leave the engine's own to accumulate onto.
    """
    prefer_fast_kernels(optimizer)
    setattr(optimizer, _BOUND_AT_STEP_ATTR, True)
    _restore_after_step(optimizer)
    offloading = [engine for engine in engines if engine.offloads_optimizer_state]
    if offloading:
        _route_zero_grad(optimizer, offloading)
        for engine in offloading:
            engine.add_optimizer(optimizer)


def _route_zero_grad(optimizer: torch.optim.Optimizer, engines: list[MegatronFSDP]) -> None:
    """Wrap ``optimizer.zero_grad`` so that ``engines`` zero their buffers with it."""
    plain_zero_grad = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        plain_zero_grad(set_to_none)
        for engine in engines:
            engine.request_zero_grad(optimizer, set_to_none)

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def _restore_after_step(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` so that a step that raised still gives the sharded params back."""
    plain_step = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            return plain_step(*args, **kwargs)
        finally:
            exit_local_step(optimizer)

    optimizer.step = step  # type: ignore[method-assign]


def _find_model(optimizer: torch.optim.Optimizer) -> MegatronFSDP:
    for group in optimizer.param_groups:
        for param in group["params"]:
            model = owner_of(param)
            if model is not None:
                return model
    raise ValueError(
        "fully_shard_optimizer: none of the optimizer's parameters belongs to a MegatronFSDP "
        "model; pass model= or build the optimizer on the wrapped model's parameters"
    )
