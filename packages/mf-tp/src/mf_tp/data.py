"""broadcast_data: send a dict of same-dtype tensors from TP rank 0 to its group.

Responsibility: the data-loader step where only the first rank of each TP
group reads a batch. Two broadcasts carry the metadata (its length, then every
key's ndim and sizes: explicit ndims, so zero-size and zero-dim tensors
round-trip), one carries all payloads flattened into a single buffer.

It must not: read ``data`` on ranks other than the group's rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from mf_tp.parallel_state import resolve_tp_group
from mf_utils import get_group_device

__all__ = ["broadcast_data"]


def _check_data(
    keys: Sequence[str], data: Mapping[str, torch.Tensor] | None, datatype: torch.dtype
) -> Mapping[str, torch.Tensor]:
    """Return ``data`` once it holds every key as a tensor of ``datatype``; raise otherwise."""
    if not isinstance(data, Mapping):
        raise TypeError(f"broadcast_data: data must be a mapping of tensors, got {data!r}")
    for key in keys:
        if key not in data:
            raise ValueError(f"broadcast_data: key {key!r} is missing from data ({list(data)!r})")
        value = data[key]
        if not isinstance(value, torch.Tensor) or value.dtype != datatype:
            raise ValueError(
                f"broadcast_data: data[{key!r}] must be a tensor of dtype {datatype}, "
                f"got {getattr(value, 'dtype', value)!r}"
            )
    return data


def _broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=src, group=group)


def broadcast_data(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    datatype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Broadcast ``data[key]`` for every key from rank 0 of ``tp_group`` to the group.

    Args:
        keys: the keys to send, the same on every rank.
        data: the tensors (only read on the group's rank 0; may be None elsewhere).
        datatype: the dtype every tensor must have.
        tp_group: the group (default: the initialised TP group).

    Returns:
        ``{key: tensor}`` on the group's device, equal on every rank.

    Raises:
        TypeError, ValueError: on rank 0 for a missing key or a tensor of another dtype.
    """
    group = resolve_tp_group(tp_group)
    if not keys:
        return {}
    device = get_group_device(group)
    src = dist.get_global_rank(group, 0)
    is_src = dist.get_rank(group) == 0
    source: Mapping[str, torch.Tensor] = {}  # read on the source rank only
    if is_src:
        source = _check_data(keys, data, datatype)
        meta_list: list[int] = []
        for key in keys:
            meta_list += [source[key].dim(), *source[key].shape]
        meta = torch.tensor(meta_list, dtype=torch.int64, device=device)
        length = torch.tensor([meta.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.empty(1, dtype=torch.int64, device=device)
    _broadcast(length, src, group)
    if not is_src:
        meta = torch.empty(int(length.item()), dtype=torch.int64, device=device)
    _broadcast(meta, src, group)

    shapes: list[tuple[int, ...]] = []
    meta_host = meta.tolist()
    position = 0
    for _ in keys:
        ndim = meta_host[position]
        shapes.append(tuple(meta_host[position + 1 : position + 1 + ndim]))
        position += 1 + ndim
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    if is_src:
        flat = torch.cat([source[key].to(device).reshape(-1) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    if flat.numel() > 0:
        _broadcast(flat, src, group)
    return {
        key: piece.view(shape)
        for key, piece, shape in zip(keys, flat.split(numels), shapes, strict=True)
    }
