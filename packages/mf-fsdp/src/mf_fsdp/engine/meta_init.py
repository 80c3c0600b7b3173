"""Models built on the meta device: the two ways their values arrive.

[Note: meta-device flows]
- FSDP2's flow (``init_model_with_meta_device=False``, torchtitan's way): the
  model is built on the meta device and wrapped; the engine gives each meta
  parameter real storage (``allocate_meta_params``) but copies nothing in.
  ``model.to_empty(device=...)`` then gives the meta buffers real storage, and
  the model's own init method (any name: ``init_weights``,
  ``reset_parameters``, ...) writes the sharded parameters in place. Random
  fills of a sharded parameter draw the whole parameter on every rank and
  keep this rank's rows (``mf_dtensor``'s [Note: random fills]), so the
  result is exactly what that init gives one process from the same seed. The
  next forward installs the weights into the compute buffers. A forward
  before ``to_empty`` is refused.
- ``init_model_with_meta_device=True`` (Megatron-FSDP's flag): the engine
  materialises one unit at a time (``materialize_meta_params``), so no rank
  ever holds the whole model, and initialises each module that holds meta
  parameters or buffers as building the model on a real device would: its
  ``reset_parameters()``, then the model's ``_init_weights(module)`` (how
  Hugging Face models initialise after construction), whichever of the two
  exist. It says which, once (``describe_meta_init``). Values are drawn in
  the engine's unit order, not the model's, so they follow the same
  distributions as one process's but not its exact numbers.

The ``Parameter`` objects are kept (``torch.utils.swap_tensors``) so
optimizers and tied weights still refer to them. No communication.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "allocate_meta_params",
    "describe_meta_init",
    "materialize_meta_params",
    "unready_error",
]


def _initialisers(model: nn.Module, module: nn.Module) -> list[Callable[[], object]]:
    """``module.reset_parameters`` and ``model._init_weights(module)``, those that exist."""
    found: list[Callable[[], object]] = []
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        found.append(reset)
    init_weights = getattr(model, "_init_weights", None)
    if callable(init_weights):
        found.append(functools.partial(init_weights, module))
    return found


def describe_meta_init(model: nn.Module) -> str:
    """What ``init_model_with_meta_device=True`` calls to initialise ``model``'s modules."""
    name = type(model).__name__
    if callable(getattr(model, "_init_weights", None)):
        how = (
            f"each module's reset_parameters() where it has one, then {name}._init_weights(module)"
        )
    else:
        how = "each module's reset_parameters()"
    return (
        f"init_model_with_meta_device: {name}'s meta parameters are initialised unit by unit "
        f"with {how}; for exactly the values of the model's own init on one process, wrap "
        "without it, call model.to_empty(device=...) and then the model's init method"
    )


def _swap_to_empty(params: Iterable[nn.Parameter], device: torch.device) -> None:
    for p in params:
        # swap_tensors keeps the Parameter object (optimizers and ties refer to it) but
        # swaps its __dict__ too: the attributes set on it (tensor-parallel marks,
        # spmd_types annotations) go with it, as nn.Module.to_empty keeps them. Its grad
        # hooks live on the tensor it had: they are registered again on the new one.
        fresh = nn.Parameter(_empty(p, device), p.requires_grad)
        fresh.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, fresh)
        if p._backward_hooks:
            p._backward_hooks = p._backward_hooks


def _empty(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Empty storage for meta ``p`` on ``device``; a DTensor keeps its mesh and placements."""
    if not isinstance(p, DTensor):
        return torch.empty(p.shape, dtype=p.dtype, device=device)
    local = torch.empty(p._local_tensor.shape, dtype=p.dtype, device=device)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def allocate_meta_params(params: Iterable[nn.Parameter], device: torch.device) -> None:
    """Give meta parameters empty storage on ``device`` (values come from the model's init)."""
    _swap_to_empty([p for p in params if p.is_meta], device)


def materialize_meta_params(
    model: nn.Module, root: nn.Module, params: set[nn.Parameter], device: torch.device
) -> None:
    """Allocate on ``device`` and initialise the meta parameters of ``params`` under ``root``.

    Meta buffers of the modules under ``root`` are allocated and initialised as well.

    Args:
        model: the wrapped model (whose ``_init_weights`` initialises modules).
        root: the unit's module (the model for the root unit).
        params: the unit's parameters.
        device: where the values go.

    Raises:
        ValueError: if a module holding such a parameter or buffer has no
            ``reset_parameters()`` and ``model`` no ``_init_weights``.
    """
    for module in root.modules():
        direct = [p for p in module.parameters(recurse=False) if p in params and p.is_meta]
        buffers = [
            (n, b) for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta
        ]
        if not direct and not buffers:
            continue
        initialisers = _initialisers(model, module)
        if not initialisers:
            raise ValueError(
                f"init_model_with_meta_device: {type(module).__name__} holds meta parameters or "
                "buffers but has no reset_parameters(), and the model no _init_weights(module); "
                "expected one of them to initialise it, or wrap without "
                "init_model_with_meta_device, then call model.to_empty(device=...) and the "
                "model's own init method (FSDP2's flow)"
            )
        _swap_to_empty(direct, device)
        for name, buffer in buffers:  # replaced in place: persistence is kept by name
            module._buffers[name] = torch.empty_like(buffer, device=device)
        with torch.no_grad():
            for init in initialisers:
                init()


def unready_error(
    model: str, unit_fqns: Iterable[Iterable[str]], awaiting: bool, unassigned: AbstractSet[str]
) -> RuntimeError:
    """The error for a forward of a meta-device model whose values have not all arrived.

    Its first two lines are FSDP2's own (code that matches on them keeps working):
    the parameters still without a value of the first unit that has any, the root's
    first, then the units in module order, which is the order FSDP2 checks its groups
    in. A third line says what mf saw: the model was wrapped on the meta device and
    ``to_empty`` has not run (``awaiting``), or ``load_state_dict(assign=True,
    strict=False)`` has not given ``unassigned`` (parameters and buffers) a value yet.

    Args:
        model: the wrapped model's class name.
        unit_fqns: each unit's parameter names, the root's first.
        awaiting: ``to_empty`` has not run yet (every parameter lacks a value).
        unassigned: the tensors a partial ``load_state_dict(assign=True)`` left out.
    """
    names = next(
        (
            found
            for fqns in unit_fqns
            if (found := [fqn for fqn in fqns if awaiting or fqn in unassigned])
        ),
        sorted(unassigned),  # buffers alone are left: name them
    )
    if awaiting:
        seen = (
            f"mf_fsdp: {model} was wrapped on the meta device; after model.to_empty(device=...) "
            "run the model's own init method (any name) or load every tensor with "
            "load_state_dict(assign=True); mf_fsdp.fully_shard can also initialise it "
            "(init_model_with_meta_device=True)"
        )
    else:
        seen = (
            f"mf_fsdp: {model} was built on the meta device and load_state_dict(assign=True, "
            f"strict=False) has not given {min(unassigned)!r} a value yet ({len(unassigned)} "
            "tensors without one); expected every parameter and buffer loaded before the "
            "first forward"
        )
    return RuntimeError(
        "FSDP parameters should be materialized from meta device before training, but the "
        f"following were still on meta device: {names}\n"
        "For example, call module.to_empty(device) to materialize to device and call "
        f"module.reset_parameters() on each module to initialize values.\n{seen}"
    )
