"""Gradient norm and clipping on sharded gradients, one all-reduce per mesh dim.

Each gradient's local (possibly empty) piece contributes ``sum |g|^p`` (or
``max |g|``) to the partial of its *signature*: the process groups its
pieces are spread over, i.e. the mesh dims a DTensor gradient is ``Shard``-ed
on (the engine's dp shards, and tp for a TP-partitioned parameter). The
partials form one vector that is all-reduced once per distinct group. A
partial whose signature lacks that group holds the same value on all of the
group's ranks (a TP-duplicated parameter's grad is equal on every TP rank),
so only the group's rank 0 keeps it for the sum: it is counted once, not
group-size times. The result equals ``torch.nn.utils.clip_grad_norm_`` on the
unsharded model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from mf_fsdp.megatron_fsdp import MegatronFSDP
from mf_fsdp.tp_params import local_value

__all__ = ["clip_grad_norm_", "get_grad_norm"]


def _params(parameters: MegatronFSDP | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, MegatronFSDP):
        parameters.finish_grad_sync()
        return [p for _, p in parameters.optimizer_named_parameters()]
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


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

    Args:
        parameters: a ``MegatronFSDP`` (its pending reductions finish first) or tensors.
        norm_type: p of the p-norm; ``inf`` for the max norm.

    Raises:
        ValueError: if ``norm_type`` is not positive.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    is_inf = math.isinf(norm_type)
    grads_by_key: dict[tuple[int, ...], list[torch.Tensor]] = {}
    groups: dict[int, dist.ProcessGroup] = {}
    for p in _params(parameters):
        if p.grad is None:
            continue
        signature = _signature(p.grad)
        groups.update((id(g), g) for g in signature)
        key = tuple(sorted({id(g) for g in signature}))
        grad = local_value(p.grad)
        grads_by_key.setdefault(key, []).append(grad)
    if not grads_by_key:
        return torch.tensor(0.0)
    keys = list(grads_by_key)
    device = grads_by_key[keys[0]][0].device
    parts = torch.stack([_local_part(grads_by_key[k], norm_type, is_inf).to(device) for k in keys])
    for gid, group in groups.items():
        if is_inf:
            dist.all_reduce(parts, op=dist.ReduceOp.MAX, group=group)
            continue
        if dist.get_rank(group) != 0:
            replicated = torch.tensor([gid not in k for k in keys], device=device)
            parts.masked_fill_(replicated, 0.0)
        dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=group)
    return parts.max() if is_inf else parts.sum().pow(1.0 / norm_type)


def _local_part(grads: list[torch.Tensor], norm_type: float, is_inf: bool) -> torch.Tensor:
    device = grads[0].device
    if is_inf:
        maxes = [g.detach().abs().max() for g in grads if g.numel()]
        return torch.stack(maxes).max().float() if maxes else torch.zeros((), device=device)
    norms = torch._foreach_norm([g.detach() for g in grads if g.numel()], norm_type)
    if not norms:
        return torch.zeros((), device=device)
    return torch.stack(norms).float().pow(norm_type).sum()


def clip_grad_norm_(
    parameters: MegatronFSDP | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale all gradients so their total norm is at most ``max_norm``; return the norm.

    Same clipping rule as ``torch.nn.utils.clip_grad_norm_``:
    ``coef = min(1, max_norm / (total + 1e-6))``.
    """
    params = _params(parameters)
    total = get_grad_norm(params, norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    grads = []
    for p in params:
        if p.grad is not None:
            g = local_value(p.grad)
            if g.numel():
                grads.append(g)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
