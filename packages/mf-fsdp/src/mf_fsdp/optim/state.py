"""Optimizer state on sharded parameters: created eagerly, and loaded from any layout.

[Note: eager optimizer state]
torch optimizers create their state lazily, at the first ``step()``. A fresh
optimizer's ``state_dict()`` is then empty, so ``dcp.load`` into it loads no
optimizer state at all and training silently restarts the moments (the
reference's recipe drifted by 3.7e-4 after resume this way). So
``fully_shard_optimizer`` creates the state at once: one ``step()`` on zero
gradients with ``lr`` and ``weight_decay`` set to zero, then every entry that
step moved away from its fresh value is put back (step counters to 0, NAdam's
``mu_product`` to 1, ...; ``_FRESH``). The step counters are not advanced, so
the first real step is exactly a fresh optimizer's first step.

One case cannot be put back by value: SGD with momentum and ``dampening != 0``
starts its buffer as the first gradient itself, not ``(1 - dampening)`` times it.
Such buffers are remembered as *unused* and dropped right before the first real
step, unless a ``load_state_dict`` replaced them first.

``localize_loaded_state`` (a ``load_state_dict`` post-hook) turns loaded state
tensors of another layout (full tensors, DTensors of another world size, e.g.
from torch's DSD with ``full_state_dict=True``) into the parameter's own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from mf_dtensor import UnevenDTensor, uneven_local_piece
from mf_fsdp.buckets.extension import in_layout_of
from mf_fsdp.optim.shape_aware import init_served_state

__all__ = [
    "drop_unused_initial_state",
    "init_optimizer_state",
    "localize_loaded_state",
    "snapshot_state",
]

_INITIALIZING_ATTR = "_mf_fsdp_initializing"
_UNUSED_ATTR = "_mf_fsdp_unused_state"
_SNAPSHOT_ATTR = "_mf_fsdp_state_before_load"

StateLayouts = dict[int, dict[str, torch.Tensor]]
"""Per parameter (by ``id``): the state tensors whose layout loaded values take."""


def _zeros(value: Any, group: dict[str, Any]) -> Any:
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else type(value)(0)


def _ones(value: Any, group: dict[str, Any]) -> Any:
    return torch.ones_like(value) if isinstance(value, torch.Tensor) else type(value)(1)


def _lr(value: Any, group: dict[str, Any]) -> Any:
    lr = group["lr"]
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, float(lr))
    return type(value)(lr)


_FRESH: dict[tuple[str, str], Callable[[Any, dict[str, Any]], Any]] = {
    ("*", "step"): _zeros,
    ("NAdam", "mu_product"): _ones,
    ("Adamax", "exp_inf"): _zeros,
    ("ASGD", "eta"): _lr,
    ("ASGD", "mu"): _ones,
    ("ASGD", "ax"): _zeros,
    ("Rprop", "prev"): _zeros,
    ("Rprop", "step_size"): _lr,
}
"""(optimizer class name or "*", state key) -> the value a fresh optimizer starts from."""


def _zero_rate(value: Any) -> Any:
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0


def initializing(optimizer: torch.optim.Optimizer) -> bool:
    """True while ``init_optimizer_state`` runs its zero step (engines skip their hooks)."""
    return getattr(optimizer, _INITIALIZING_ATTR, False)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of every parameter with ``requires_grad`` at its fresh values.

    See [Note: eager optimizer state]. A no-op when the optimizer already has state.
    Local only: no collective (the engines' step hooks are skipped).
    """
    if optimizer.state or init_served_state(optimizer):
        return
    groups = optimizer.param_groups
    setattr(optimizer, _INITIALIZING_ATTR, True)
    try:
        # One parameter at a time, so the zero gradient is never more than one
        # parameter's worth of memory.
        for group in groups:
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                zeroed: dict[str, Any] = {
                    k: _zero_rate(group[k]) for k in ("lr", "weight_decay") if k in group
                }
                if group.get("fused"):  # torch's fused kernels take no DTensors
                    zeroed["fused"] = False
                optimizer.param_groups = [{**group, **zeroed, "params": [param]}]
                param.grad = torch.zeros_like(param)
                try:
                    optimizer.step()
                finally:
                    param.grad = None
    finally:
        optimizer.param_groups = groups
        setattr(optimizer, _INITIALIZING_ATTR, False)
    name = type(optimizer).__name__
    unused: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        sgd_dampened = name == "SGD" and group.get("momentum") and group.get("dampening")
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in list(state.items()):
                fresh = _FRESH.get((name, key)) or _FRESH.get(("*", key))
                if fresh is not None:
                    state[key] = fresh(value, group)
            if sgd_dampened and "momentum_buffer" in state:
                unused.append(state["momentum_buffer"])
    setattr(optimizer, _UNUSED_ATTR, {id(t) for t in unused})


def drop_unused_initial_state(optimizer: torch.optim.Optimizer) -> None:
    """Before a real step: drop buffers a fresh optimizer would not have yet (see the Note)."""
    unused = getattr(optimizer, _UNUSED_ATTR, None)
    if not unused:
        return
    for state in optimizer.state.values():
        buffer = state.get("momentum_buffer")
        if buffer is not None and id(buffer) in unused:
            del state["momentum_buffer"]
    setattr(optimizer, _UNUSED_ATTR, set())


def snapshot_state(optimizer: torch.optim.Optimizer) -> StateLayouts:
    """Remember the current state tensors (a ``load_state_dict`` pre-hook), and return them."""
    layouts = {
        id(param): {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        for param, state in optimizer.state.items()
    }
    setattr(optimizer, _SNAPSHOT_ATTR, layouts)
    return layouts


def localize_loaded_state(
    optimizer: torch.optim.Optimizer, previous: StateLayouts | None = None
) -> None:
    """Give loaded state tensors the layout of the state they replace (or of their parameter).

    A ``load_state_dict`` post-hook; collective when a value is a DTensor of another
    layout (every rank loads the same state dict). A loaded tensor takes the layout
    of the tensor of the same key and shape that held the state before (``previous``,
    or what ``snapshot_state`` remembered): a parameter's rows, or a row statistic's
    rows; else, shaped like its parameter, the parameter's. Loaded buffers are no
    longer *unused* (see [Note: eager optimizer state]).
    """
    if previous is None:
        previous = getattr(optimizer, _SNAPSHOT_ATTR, None) or {}
    setattr(optimizer, _SNAPSHOT_ATTR, {})
    setattr(optimizer, _UNUSED_ATTR, set())
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            before = previous.get(id(param), {})
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor):
                    continue
                like = before.get(key)
                if like is None or like.shape != value.shape:
                    like = param if value.shape == param.shape else None
                if like is not None:
                    state[key] = _in_layout_of(value, like)


def _in_layout_of(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` laid out like ``like`` (same shape): its rows, or whole."""
    if isinstance(like, UnevenDTensor):
        if isinstance(value, UnevenDTensor) and value.pieces is like.pieces:
            return value
        local = uneven_local_piece(value, like).to(value.dtype).clone()
        return UnevenDTensor.from_local(
            local, like.device_mesh, like.placements, shape=like.shape, pieces=like.pieces
        )
    if isinstance(like, DTensor):  # an extension parameter's torch.chunk pieces
        return in_layout_of(value, like)
    if isinstance(value, DTensor):
        return value.full_tensor().to(like.device)
    return value
