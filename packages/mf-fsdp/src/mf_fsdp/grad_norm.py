"""Gradient norm and clipping on sharded gradients, one all-reduce per mesh.

Local (possibly empty) shards contribute ``sum |g|^p`` (or ``max |g|``); the
partial results of DTensor gradients are reduced over the mesh dims they are
sharded on, once per distinct (mesh, placements), so the result equals
``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from mf_fsdp.megatron_fsdp import MegatronFSDP

__all__ = ["clip_grad_norm_", "get_grad_norm"]


def _params(parameters: MegatronFSDP | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, MegatronFSDP):
        parameters.finish_grad_sync()
        return [p for _, p in parameters.optimizer_named_parameters()]
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def get_grad_norm(
    parameters: MegatronFSDP | Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0
) -> torch.Tensor:
    """Total ``norm_type``-norm of all gradients (sharded DTensor grads included).

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
    buckets: dict[tuple[object, ...], list[torch.Tensor]] = {}
    meshes: dict[tuple[object, ...], DTensor | None] = {}
    for p in _params(parameters):
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(grad, DTensor):
            key: tuple[object, ...] = (id(grad.device_mesh), tuple(grad.placements))
            meshes.setdefault(key, grad)
            grad = grad.to_local()
        else:
            key = ("plain", grad.device)
            meshes.setdefault(key, None)
        buckets.setdefault(key, []).append(grad)
    total: torch.Tensor | None = None
    for key, grads in buckets.items():
        part = _local_part(grads, norm_type, is_inf)
        sample = meshes[key]
        if sample is not None:
            for dim, placement in enumerate(sample.placements):
                if isinstance(placement, Shard):
                    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
                    dist.all_reduce(part, op=op, group=sample.device_mesh.get_group(dim))
        total = (
            part
            if total is None
            else (
                torch.maximum(total, part.to(total.device))
                if is_inf
                else total + part.to(total.device)
            )
        )
    if total is None:
        return torch.tensor(0.0)
    return total if is_inf else total.pow(1.0 / norm_type)


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
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if g.numel():
                grads.append(g)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
