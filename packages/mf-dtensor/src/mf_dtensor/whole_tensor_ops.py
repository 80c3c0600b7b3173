"""The ops an UnevenDTensor runs on the whole tensor: random fills, whole copies, ``any``/``all``.

DTensor runs these ops assuming ``torch.chunk`` pieces, so
``UnevenDTensor.__torch_dispatch__`` sends them here first: an in-place random
fill draws the whole tensor and keeps this rank's boxes (see [Note: random
fills] in :func:`fill_randomly`), ``copy_`` from a value every rank holds whole
keeps this rank's boxes of it, ``any()``/``all()`` combine every rank's
answer, and an infinity norm lets an empty piece stand in as one neutral element.

Invariants: each returns what DTensor would (the target itself for an in-place
op, a replicated 0-dim DTensor for a reduction). Only :func:`reduce_whole`
communicates (one all-gather of a byte per rank). This module must not import
the UnevenDTensor class (``uneven_tensor.py`` imports this module): the
predicates take it as ``uneven``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from mf_dtensor._collectives import all_gather_over_mesh_dims
from mf_dtensor.pieces import cut_boxes
from mf_dtensor.wrapping import Uneven

__all__ = [
    "WHOLE_REDUCTIONS",
    "copy_whole",
    "fill_randomly",
    "is_random_fill",
    "is_whole_copy",
    "reduce_whole",
    "stand_in_empty_pieces",
]


def is_random_fill(
    uneven: type[Any], func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """An in-place random op (``normal_``, ``uniform_``...) on an UnevenDTensor, no other tensor."""
    return (
        torch.Tag.nondeterministic_seeded in func.tags
        and func.overloadpacket.__name__.endswith("_")
        and bool(args)
        and isinstance(args[0], uneven)
        and not any(isinstance(v, torch.Tensor) for v in (*args[1:], *kwargs.values()))
    )


def fill_randomly(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Uneven:
    """[Note: random fills] Draw the whole tensor on every rank, keep this rank's boxes.

    A sharded parameter initialised in place (``nn.init.normal_(p)``, what a model's
    init method does after ``to_empty``) then holds exactly the rows one process
    draws for the whole parameter from the same generator state, whatever the
    pieces, device or world size, and every rank's generator advances as that one
    process's does. DTensor's own random ops assume ``torch.chunk`` pieces and, on
    the CPU, draw each shard from the local generator. Costs one temporary tensor
    of the global shape per call.
    """
    target: Uneven = args[0]
    local = target._local_tensor
    full = torch.empty(tuple(target.shape), dtype=local.dtype, device=local.device)
    func(full, *args[1:], **kwargs)
    with torch.no_grad():
        local.copy_(cut_boxes(full, target.local_boxes(), local.shape))
    return target


def is_whole_copy(uneven: type[Any], func: torch._ops.OpOverload, args: tuple[Any, ...]) -> bool:
    """``target.copy_(whole)``: an UnevenDTensor from a value every rank holds whole.

    The value is a plain tensor or an all-``Replicate`` DTensor of the target's
    global shape (torchtitan's fused-QKV init builds one and copies it in).
    """
    if func is not torch.ops.aten.copy_.default or len(args) < 2:
        return False
    target, value = args[0], args[1]
    if not isinstance(target, uneven) or tuple(value.shape) != tuple(target.shape):
        return False
    if isinstance(value, DTensor):
        return type(value) is DTensor and all(p.is_replicate() for p in value.placements)
    return True


def copy_whole(target: Uneven, value: torch.Tensor) -> Uneven:
    """Copy this rank's boxes of ``value`` (held whole on every rank) into ``target``."""
    whole = value._local_tensor if isinstance(value, DTensor) else value
    local = target._local_tensor
    with torch.no_grad():
        local.copy_(cut_boxes(whole, target.local_boxes(), local.shape))
    return target


WHOLE_REDUCTIONS = {torch.ops.aten.any.default, torch.ops.aten.all.default}
"""Reductions of the whole tensor that DTensor does only after gathering it by ``torch.chunk``."""


def reduce_whole(func: torch._ops.OpOverload, tensor: Uneven) -> DTensor:
    """``any()`` / ``all()`` of the whole tensor: each rank's answer, combined; collective.

    An empty piece answers the identity (False for any, True for all). The
    result is a replicated 0-dim DTensor, as DTensor gives. ``nn.init.trunc_normal_``
    asks ``mask.any()`` of a sharded parameter in its rejection loop.
    """
    mesh = tensor._spec.mesh
    mesh_dims = [m for m, p in enumerate(tensor._spec.placements) if not isinstance(p, Replicate)]
    local = func(tensor._local_tensor).reshape(1).to(torch.uint8)
    answers = all_gather_over_mesh_dims(local, mesh, mesh_dims).to(torch.bool)
    result = func(answers).to(tensor._local_tensor.device)
    return DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim, run_check=False)


_INF_NORMS = {torch.ops.aten._foreach_norm.Scalar, torch.ops.aten.linalg_vector_norm.default}


def stand_in_empty_pieces(func: torch._ops.OpOverload, args: list[Any]) -> list[Any]:
    """``args`` for an infinity norm with each empty local piece given one neutral element.

    torch's kernels refuse the infinity norms (a max or a min of ``|x|``) of an empty
    tensor, having no identity; a rank that holds no rows of a parameter holds an
    empty piece of a tensor that has elements (``clip_grad_norm_(...,
    norm_type=inf)`` over sharded grads). Such a piece is computed as one element
    that changes no answer: 0 for ``inf`` (every ``|x|`` is at least 0), ``inf`` for
    ``-inf``. ``args`` are the op's, DTensors already base DTensors; anything else
    comes back as it is. A whole tensor with no element is left to torch's error.
    """
    if func not in _INF_NORMS or len(args) < 2 or args[1] not in (math.inf, -math.inf):
        return args
    neutral = 0.0 if args[1] > 0 else math.inf

    def stand_in(tensor: Any) -> Any:
        if not isinstance(tensor, DTensor) or tensor._local_tensor.numel() or not tensor.numel():
            return tensor
        local = tensor._local_tensor
        one = torch.full((1,), neutral, dtype=local.dtype, device=local.device)
        return DTensor(one, tensor._spec, requires_grad=False)

    first = args[0]
    if isinstance(first, list | tuple):
        return [[stand_in(tensor) for tensor in first], *args[1:]]
    return [stand_in(first), *args[1:]]
