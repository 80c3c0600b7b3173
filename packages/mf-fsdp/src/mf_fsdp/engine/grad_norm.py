"""Gradient norm and clipping on sharded gradients, one all-reduce per mesh dim.

Each gradient's local (possibly empty) piece contributes ``sum |g|^p`` (or
``max |g|``) to the partial of its *signature*: the process groups its
pieces are spread over, i.e. the mesh dims a DTensor gradient is ``Shard``-ed
on (the engine's dp shards, and tp for a TP-partitioned parameter). The
partials form one vector that is all-reduced once per distinct group. A
partial whose signature lacks that group holds the same value on all of the
group's ranks (a TP-duplicated parameter's grad is equal on every TP rank),
so only the group's rank 0 keeps it for the sum: it is counted once, not
group-size times. Expert gradients form a grid of their own (see
``get_grad_norm``). The result equals ``torch.nn.utils.clip_grad_norm_`` on the
unsharded model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.tp_params import local_value
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP, owner_of
from mf_fsdp.engine.sharded_params import SPREAD_ATTR
from mf_utils import get_group_device, is_expert_parallel_parameter

__all__ = ["clip_grad_norm_", "get_grad_norm"]


def _params(parameters: MegatronFSDP | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, MegatronFSDP):
        parameters.finish_grad_sync()
        return [p for _, p in parameters.optimizer_named_parameters()]
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    expected = "expected a MegatronFSDP, a tensor or an iterable of tensors"
    if isinstance(parameters, str | bytes) or not isinstance(parameters, Iterable):
        raise TypeError(f"parameters: {expected}, got {parameters!r}")
    params = list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters: {expected}, got {type(p).__name__} {p!r} at index {i}")
    return params


def _refuse_step_in_backward(params: list[torch.Tensor], caller: str) -> None:
    """Raise if ``params`` belong to a model whose optimizer steps inside the backward.

    Its gradients are freed bucket by bucket as soon as each is stepped, so after the
    backward there is nothing left to measure: a norm would be a silent 0.
    """
    if any(engine is not None and engine.steps_in_backward for engine in map(owner_of, params)):
        raise RuntimeError(
            f"{caller}: this model was wrapped with optimizer_step_in_backward=True, "
            "so each bucket is stepped (and its gradients freed) inside the backward, as "
            "soon as they are reduced; a global gradient norm needs every gradient before "
            "any step. Turn optimizer_step_in_backward off to measure or clip gradients."
        )


def _check_norm_type(norm_type: object) -> float:
    """``norm_type`` as a float: a positive number, ``inf``, or a string of one (``'inf'``)."""
    expected = "expected a positive number or inf (p of the p-norm; 2.0 is the Frobenius norm)"
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real | str):
        raise TypeError(f"norm_type: {expected}, got {norm_type!r}")
    try:
        value = float(norm_type)
    except ValueError:
        raise ValueError(f"norm_type: {expected}, got {norm_type!r}") from None
    if not value > 0:
        raise ValueError(f"norm_type: {expected}, got {norm_type!r}")
    return value


def _check_max_norm(max_norm: object) -> float:
    """``max_norm`` as a float: positive, ``inf`` meaning no clipping."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"max_norm: expected a positive number, got {max_norm!r}")
    value = float(max_norm)
    if not value > 0:
        raise ValueError(
            f"max_norm: expected a positive number (inf: never clip), got {max_norm!r}; "
            "a max_norm <= 0 would zero or flip the sign of every gradient (to only measure "
            "the norm, call get_grad_norm)"
        )
    return value


def _signature(grad: torch.Tensor) -> list[dist.ProcessGroup]:
    """The groups over which ``grad``'s pieces are spread (in a fixed order)."""
    if not isinstance(grad, DTensor):
        return []
    return [
        grad.device_mesh.get_group(dim)
        for dim, placement in enumerate(grad.placements)
        if isinstance(placement, Shard)
    ]


def get_grad_norm(
    parameters: MegatronFSDP | Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0
) -> torch.Tensor:
    """Total ``norm_type``-norm of all gradients (dp-sharded and TP-sharded grads included).

    Expert gradients (parameters an engine marked with the expert-parallel groups
    they are spread over) form their own grid: summed over the expert-data-parallel,
    expert-TP and expert-parallel groups, so each expert counts once.

    Args:
        parameters: a ``MegatronFSDP`` (its pending reductions finish first) or tensors.
        norm_type: p of the p-norm; ``inf`` for the max norm.

    Raises:
        TypeError: if ``parameters`` is not one of those, or ``norm_type`` is not a
            number (or a string of one, such as ``'inf'``, as torch accepts).
        ValueError: if ``norm_type`` is not positive (``'fro'`` is not a p-norm: the
            Frobenius norm of the gradients is ``norm_type=2``).
        RuntimeError: for a model (or its parameters) whose optimizer steps inside
            the backward (``optimizer_step_in_backward``): its gradients are freed as
            each bucket steps, so no norm of them is left to compute.
    """
    norm_type = _check_norm_type(norm_type)
    params = _params(parameters)
    _refuse_step_in_backward(params, "get_grad_norm")
    return _total_norm(params, norm_type)


def _total_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total norm of ``params``' gradients, each grid summed over its own groups."""
    is_inf = math.isinf(norm_type)
    # Keyed by (expert?, spread groups): an expert DTensor split over the expert-parallel
    # dim (grouped experts) has no spread groups left, yet is no dense parameter either.
    grids: dict[tuple[bool, int], list[tuple[torch.Tensor, list[dist.ProcessGroup]]]] = {}
    for p in params:
        if p.grad is None:
            continue
        spread = list(getattr(p, SPREAD_ATTR, ()))
        key = (is_expert_parallel_parameter(p), len(spread))
        grids.setdefault(key, []).append((p.grad, _signature(p.grad) + spread))
    if not grids:
        return torch.tensor(0.0)
    totals = [_grid_part(grids[key], norm_type, is_inf) for key in sorted(grids)]
    total = torch.stack([t.to(totals[0].device) for t in totals])
    return total.max() if is_inf else total.sum().pow(1.0 / norm_type)


def _grid_part(
    grads: list[tuple[torch.Tensor, list[dist.ProcessGroup]]], norm_type: float, is_inf: bool
) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|``) over one grid's gradients, reduced over its groups.

    A partial whose signature lacks one of the grid's groups is equal on that group's
    ranks, so only the group's rank 0 keeps it: counted once, not group-size times.
    """
    grads_by_key: dict[tuple[int, ...], list[torch.Tensor]] = {}
    groups: dict[int, dist.ProcessGroup] = {}
    for grad, signature in grads:
        groups.update((id(g), g) for g in signature)
        key = tuple(sorted({id(g) for g in signature}))
        grads_by_key.setdefault(key, []).append(local_value(grad))
    keys = list(grads_by_key)
    device = grads_by_key[keys[0]][0].device
    if groups:  # the collectives' device (grads in host memory: offload_optimizer_state)
        device = get_group_device(next(iter(groups.values())))
    parts = torch.stack([_local_part(grads_by_key[k], norm_type, is_inf).to(device) for k in keys])
    for gid, group in groups.items():
        if is_inf:
            collectives.all_reduce(parts, dist.ReduceOp.MAX, group)
            continue
        if dist.get_rank(group) != 0:
            replicated = torch.tensor([gid not in k for k in keys], device=device)
            parts.masked_fill_(replicated, 0.0)
        collectives.all_reduce(parts, dist.ReduceOp.SUM, group)
    return parts.max() if is_inf else parts.sum()


def _local_part(grads: list[torch.Tensor], norm_type: float, is_inf: bool) -> torch.Tensor:
    device = grads[0].device
    if is_inf:
        maxes = [g.detach().abs().max() for g in grads if g.numel()]
        return torch.stack(maxes).max().float() if maxes else torch.zeros((), device=device)
    present = [g.detach() for g in grads if g.numel()]
    if not present:  # this rank owns no rows of these (ZeRO-3 over more ranks than rows)
        return torch.zeros((), device=device)
    norms = torch._foreach_norm(present, norm_type)
    return torch.stack(norms).float().pow(norm_type).sum()


def clip_grad_norm_(
    parameters: MegatronFSDP | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale all gradients so their total norm is at most ``max_norm``; return the norm.

    Same clipping rule as ``torch.nn.utils.clip_grad_norm_``:
    ``coef = min(1, max_norm / (total + 1e-6))``. ``max_norm`` must be positive:
    ``inf`` leaves the gradients as they are (only the norm is computed); 0, a
    negative value (which would flip every gradient's sign) or NaN is an error.

    Raises:
        TypeError: if ``parameters``, ``max_norm`` or ``norm_type`` has the wrong type.
        ValueError: if ``max_norm`` or ``norm_type`` is not positive.
        RuntimeError: for a model (or its parameters) whose optimizer steps inside
            the backward (``optimizer_step_in_backward``): there is no moment where
            every gradient is held and none is stepped yet.
    """
    max_norm = _check_max_norm(max_norm)
    norm_type = _check_norm_type(norm_type)
    params = _params(parameters)
    _refuse_step_in_backward(params, "clip_grad_norm_")
    total = _total_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = []
    for p in params:
        if p.grad is not None:
            g = local_value(p.grad)
            if g.numel():
                grads.append(g)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
