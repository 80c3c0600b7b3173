"""Raw tensor-parallel collectives along the first or last dim; no autograd.

Responsibility: the forward/backward building blocks of :mod:`mf_tp.mappings`
and the layers. Every function takes a resolved, non-None group and returns a
new tensor (the input is never modified); a group of size 1 returns the input
unchanged. Shapes use ``t`` for the group size.

[Note: backend fallbacks] gloo (torch >= 2.13) runs ``all_gather_into_tensor``,
``reduce_scatter_tensor``, list ``reduce_scatter`` with uneven sizes and
``all_to_all_single`` with uneven splits, but its list ``all_gather`` refuses
tensors of different sizes. An uneven first-dim all-gather therefore pads every
shard to the largest one, gathers into one tensor and slices, on gloo only;
other backends gather straight into views of the output.

It must not: allocate from the global memory buffer unless asked
(``use_global_buffer``); such results are views of a shared scratch tensor that
the next call with the same name overwrites.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mf_utils import get_global_memory_buffer

_BUFFER_NAME = "mf_tp"


def world(group: dist.ProcessGroup) -> tuple[int, int]:
    """Return ``(rank, size)`` of this process in ``group``."""
    return dist.get_rank(group), dist.get_world_size(group)


def _is_gloo(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def _empty(shape: Sequence[int], like: torch.Tensor, use_global_buffer: bool) -> torch.Tensor:
    if use_global_buffer:
        return get_global_memory_buffer().get_tensor(
            shape, like.dtype, _BUFFER_NAME, device=like.device
        )
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def check_split_sizes(
    split_sizes: Sequence[int], size: int, world_size: int, argument: str, where: str
) -> list[int]:
    """Validate per-rank sizes: ``world_size`` non-negative ints summing to ``size``."""
    sizes = list(split_sizes)
    if (
        len(sizes) != world_size
        or any(not isinstance(s, int) or s < 0 for s in sizes)
        or sum(sizes) != size
    ):
        raise ValueError(
            f"{where}: {argument} must be {world_size} non-negative ints summing to {size}, "
            f"got {split_sizes!r}"
        )
    return sizes


def check_divisible(size: int, world_size: int, what: str, where: str) -> None:
    if size % world_size != 0:
        raise ValueError(
            f"{where}: {what} {size} is not divisible by the tensor-parallel size {world_size}"
        )


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, *, inplace: bool = False) -> torch.Tensor:
    """Sum ``x`` over ``group``; ``inplace`` reuses ``x``'s storage (only for fresh tensors)."""
    if dist.get_world_size(group) == 1:
        return x
    out = x.contiguous() if inplace else x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[..., H] -> [..., H/t]``: this rank's slice, contiguous."""
    rank, world_size = world(group)
    if world_size == 1:
        return x
    check_divisible(x.shape[-1], world_size, "the last dim", "split along the last dim")
    return x.chunk(world_size, dim=-1)[rank].contiguous()


def split_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """``[S, ...] -> [S/t, ...]`` (or ``[split_sizes[rank], ...]``): this rank's rows."""
    rank, world_size = world(group)
    if world_size == 1:
        return x
    if split_sizes is None:
        check_divisible(x.shape[0], world_size, "the first dim", "split along the first dim")
        sizes = [x.shape[0] // world_size] * world_size
    else:
        sizes = check_split_sizes(
            split_sizes, x.shape[0], world_size, "split_sizes", "split along the first dim"
        )
    return x.split(sizes, dim=0)[rank].contiguous()


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[..., H/t] -> [..., H]``: all-gather, concatenated in rank order."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    # Flat buffers: gloo wants the output to be the inputs laid end to end.
    flat = torch.empty(world_size * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, x.contiguous().reshape(-1), group=group)
    stacked = flat.view(world_size, *x.shape)
    return torch.cat(stacked.unbind(0), dim=-1)


def reduce_scatter_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[..., H] -> [..., H/t]``: sum over ranks, keep this rank's slice of the last dim."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    check_divisible(x.shape[-1], world_size, "the last dim", "reduce-scatter along the last dim")
    stacked = torch.stack(x.chunk(world_size, dim=-1))  # [t, ..., H/t]
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out.view(-1), stacked.reshape(-1), group=group)
    return out


def gather_first_dim(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
    *,
    async_op: bool = False,
) -> tuple[torch.Tensor, dist.Work | None]:
    """``[S/t, ...] -> [S, ...]`` (or ``[sum(output_split_sizes), ...]``), rank order.

    Returns the output and, with ``async_op`` (even sizes only), the pending work.
    See [Note: backend fallbacks] for uneven sizes on gloo.
    """
    rank, world_size = world(group)
    if world_size == 1:
        return x, None
    x = x.contiguous()
    if output_split_sizes is None:
        out = _empty((x.shape[0] * world_size, *x.shape[1:]), x, use_global_buffer)
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
        return out, work
    sizes = check_split_sizes(
        output_split_sizes,
        sum(output_split_sizes),
        world_size,
        "output_split_sizes",
        "gather along the first dim",
    )
    if sizes[rank] != x.shape[0]:
        raise ValueError(
            f"gather along the first dim: output_split_sizes[{rank}]={sizes[rank]} does not "
            f"match this rank's input of {x.shape[0]} rows"
        )
    out = _empty((sum(sizes), *x.shape[1:]), x, use_global_buffer)
    if not _is_gloo(group):
        dist.all_gather(list(out.split(sizes, dim=0)), x, group=group)
        return out, None
    longest = max(sizes)
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    gathered = torch.empty((world_size * longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, padded, group=group)
    for index, (dst, src) in enumerate(zip(out.split(sizes), gathered.split(longest), strict=True)):
        dst.copy_(src[: sizes[index]])
    return out, None


def reduce_scatter_first_dim(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    input_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
    *,
    async_op: bool = False,
) -> tuple[torch.Tensor, dist.Work | None]:
    """``[S, ...] -> [S/t, ...]`` (or ``[input_split_sizes[rank], ...]``): sum, keep my rows.

    Returns the output and, with ``async_op``, the pending work.
    """
    rank, world_size = world(group)
    if world_size == 1:
        return x, None
    x = x.contiguous()
    if input_split_sizes is None:
        check_divisible(x.shape[0], world_size, "the first dim", "reduce-scatter")
        out = _empty((x.shape[0] // world_size, *x.shape[1:]), x, use_global_buffer)
        return out, dist.reduce_scatter_tensor(out, x, group=group, async_op=async_op)
    sizes = check_split_sizes(
        input_split_sizes, x.shape[0], world_size, "input_split_sizes", "reduce-scatter"
    )
    out = _empty((sizes[rank], *x.shape[1:]), x, use_global_buffer)
    work = dist.reduce_scatter(out, list(x.split(sizes, dim=0)), group=group, async_op=async_op)
    return out, work


def all_to_all_first_dim(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Send rows ``input_split_sizes[j]`` of ``x`` to rank ``j``; receive ``output_split_sizes``.

    Even splits of the first dim when the sizes are None.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    x = x.contiguous()
    where = "all_to_all"
    if input_split_sizes is not None:
        check_split_sizes(input_split_sizes, x.shape[0], world_size, "input_split_sizes", where)
    else:
        check_divisible(x.shape[0], world_size, "the first dim", where)
    if output_split_sizes is None:
        rows = x.shape[0]  # even receive: as many rows as this rank sends
    else:
        rows = sum(output_split_sizes)
        check_split_sizes(output_split_sizes, rows, world_size, "output_split_sizes", where)
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(
        out,
        x,
        output_split_sizes=None if output_split_sizes is None else list(output_split_sizes),
        input_split_sizes=None if input_split_sizes is None else list(input_split_sizes),
        group=group,
    )
    return out
