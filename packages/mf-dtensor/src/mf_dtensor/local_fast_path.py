"""The local fast path: layout-keeping ops run on an UnevenDTensor's local pieces directly.

Elementwise and foreach ops whose tensor operands are UnevenDTensors laid out
alike compute, on every rank, exactly the local op DTensor would run, so they
skip DTensor's sharding propagation; every op of an Adam or SGD step is one
(see [Note: local fast path] in :func:`run_locally`). Any other op gets
:data:`NOT_LOCAL` back and goes through DTensor.

Invariants: each output is wrapped like the operand it is computed from, with
the same spec and PieceMap objects (an in-place op hands back the very input);
random ops and device moves never take this path. It must not communicate,
and must not import the UnevenDTensor class (``uneven_tensor.py`` imports this
module): it takes the class as ``uneven``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from mf_dtensor.pieces import same_pieces
from mf_dtensor.wrapping import Uneven, wrap

__all__ = ["NOT_LOCAL", "run_locally"]

NOT_LOCAL = object()
"""What ``run_locally`` returns for an op it leaves to DTensor."""

_LAYOUT_KEEPING = frozenset(
    {
        "clone",
        "copy_",
        "detach",
        "_to_copy",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "zero_",
        "fill_",
    }
)
"""Ops that are not tagged pointwise but keep every element where it is."""

_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})


def _keeps_layout(func: torch._ops.OpOverload) -> bool:
    """True for ops whose result at each element depends on that element alone (and scalars)."""
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False  # random ops: DTensor keeps shards' random streams apart
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return name not in _FOREACH_REDUCTIONS
    return torch.Tag.pointwise in tags or name in _LAYOUT_KEEPING


def run_locally(
    uneven: type[Any], func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """[Note: local fast path] Run a layout-keeping op on the local pieces, or return NOT_LOCAL.

    An elementwise op whose DTensor operands are all UnevenDTensors laid out
    alike computes, on every rank, exactly the local op DTensor would run; so
    it is run on the local tensors directly, without DTensor's sharding
    propagation (the optimizer's hot path: every Adam or SGD op is one). Any
    other op, or a mix with plain DTensors or with non-scalar plain tensors,
    goes through DTensor (``NOT_LOCAL``). Foreach ops take their own path,
    one pass per list, since they carry every parameter of a step at once.
    """
    if not _keeps_layout(func) or kwargs.get("device") is not None:
        return NOT_LOCAL  # a device move changes more than the elements: DTensor's job
    try:
        if func.__name__.startswith("_foreach_"):
            return _foreach_locally(uneven, func, args, kwargs)
        return _pointwise_locally(uneven, func, args, kwargs)
    except _NotLocalError:
        return NOT_LOCAL


def _local_operand(value: Any) -> Any:
    """A non-UnevenDTensor operand as the local op takes it: scalars only (else not local)."""
    if isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.dim()):
        raise _NotLocalError
    return value


def _pointwise_locally(
    uneven: type[Any], func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """One op on tensors (lists of them too) laid out like its first UnevenDTensor operand."""
    reference: Uneven | None = None

    def local(value: Any) -> Any:
        nonlocal reference
        if type(value) is uneven:
            if reference is None:
                reference = value
            elif not _laid_out_alike(reference, value):
                raise _NotLocalError
            return value._local_tensor
        if isinstance(value, list | tuple):
            return type(value)(local(item) for item in value)
        return _local_operand(value)

    local_args = [local(value) for value in args]
    local_kwargs = {key: local(value) for key, value in kwargs.items()}
    if reference is None:
        return NOT_LOCAL
    out = func(*local_args, **local_kwargs)
    if isinstance(out, list | tuple):
        return type(out)(_wrap_like(uneven, item, reference) for item in out)
    return _wrap_like(uneven, out, reference)


def _foreach_locally(
    uneven: type[Any], func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A foreach op: the i-th tensor of every list laid out like the first list's i-th."""
    likes: list[Any] | None = None  # the first list: the layout of each position

    def local(value: Any) -> Any:
        nonlocal likes
        if not isinstance(value, list | tuple):
            if type(value) is uneven:
                raise _NotLocalError  # a tensor shared by every position: leave it to DTensor
            return _local_operand(value)
        if likes is None:
            likes = list(value)
            return [
                item._local_tensor if type(item) is uneven else _local_operand(item)
                for item in value
            ]
        if len(value) != len(likes):
            raise _NotLocalError
        out = []
        for like, item in zip(likes, value, strict=True):
            if type(item) is uneven:
                if type(like) is not uneven or not _laid_out_alike(like, item):
                    raise _NotLocalError
                out.append(item._local_tensor)
            else:
                if type(like) is uneven and isinstance(item, torch.Tensor):
                    raise _NotLocalError
                out.append(_local_operand(item))
        return out

    local_args = [local(value) for value in args]
    local_kwargs = {key: local(value) for key, value in kwargs.items()}
    if likes is None or not any(type(like) is uneven for like in likes):
        return NOT_LOCAL
    out = func(*local_args, **local_kwargs)
    if out is None:
        return None
    return type(out)(
        _wrap_like(uneven, item, like if type(like) is uneven else None)
        for item, like in zip(out, likes, strict=True)
    )


class _NotLocalError(Exception):
    """An operand the local fast path does not take: let DTensor run the op."""


def _laid_out_alike(a: Uneven, b: Uneven) -> bool:
    sa, sb = a._spec, b._spec
    if sa is sb and a._pieces is b._pieces:  # e.g. optimizer state made from its parameter
        return True
    return (
        (sa.mesh is sb.mesh or sa.mesh == sb.mesh)
        and sa.placements == sb.placements
        and sa.shape == sb.shape
        and a._local_tensor.shape == b._local_tensor.shape
        and same_pieces(a._pieces, b._pieces)
    )


def _wrap_like(uneven: type[Any], out: Any, like: Uneven | None) -> Any:
    """``out`` (a local result) as an UnevenDTensor laid out like ``like``."""
    if like is None or not isinstance(out, torch.Tensor):
        return out
    if out is like._local_tensor:
        return like  # an in-place op: hand back the very input
    spec = like._spec
    meta = spec.tensor_meta
    assert meta is not None  # an UnevenDTensor's spec always carries its TensorMeta
    if out.dtype != meta.dtype:
        spec = DTensorSpec(
            spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, out.dtype)
        )
    return wrap(uneven, out, spec, like._pieces, requires_grad=out.requires_grad)
