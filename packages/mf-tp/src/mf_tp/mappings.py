"""Autograd-aware tensor-parallel mappings: forward/backward collective pairs.

Responsibility: one ``torch.autograd.Function`` per reference mapping and the
functional wrapper that callers use. Every wrapper takes ``group=`` (default:
the TP group of :func:`mf_tp.initialize_model_parallel`). Shapes: ``t`` is the
group size, ``S`` the sequence (first) dim, ``H`` the hidden (last) dim.

| mapping                                   | forward                    | backward          |
|-------------------------------------------|----------------------------|-------------------|
| copy_to_tensor_model_parallel_region      | identity                   | all-reduce        |
| reduce_from_tensor_model_parallel_region  | all-reduce                 | identity          |
| scatter_to_tensor_model_parallel_region   | split last dim             | all-gather last   |
| gather_from_tensor_model_parallel_region  | all-gather last dim        | split last dim    |
| scatter_to_sequence_parallel_region       | split first dim            | all-gather first  |
| gather_from_sequence_parallel_region      | all-gather first dim       | reduce-scatter    |
|                                           |                            | first (or split)  |
| reduce_scatter_to_sequence_parallel_region| reduce-scatter first dim   | all-gather first  |
| all_gather_last_dim_from_tensor_parallel_ | all-gather last dim        | reduce-scatter    |
| region                                    |                            | last dim          |
| reduce_scatter_last_dim_to_tensor_parallel| reduce-scatter last dim    | all-gather last   |
| _region                                   |                            |                   |
| all_to_all (sp2hp, hp2sp)                 | all-to-all first dim       | inverse all-to-all|

It must not: hold state between calls, or modify its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mf_tp import _collectives as C
from mf_tp.parallel_state import resolve_tp_group

__all__ = [
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]

_Group = dist.ProcessGroup


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Enter a TP region whose branches each produce a partial input gradient.

    | pass     | input   | output  | collective        |
    |----------|---------|---------|-------------------|
    | forward  | [*, H]  | [*, H]  | none              |
    | backward | [*, H]  | [*, H]  | all-reduce (sum)  |
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.all_reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Sum partial outputs of a TP region.

    | pass     | input   | output  | collective        |
    |----------|---------|---------|-------------------|
    | forward  | [*, H]  | [*, H]  | all-reduce (sum)  |
    | backward | [*, H]  | [*, H]  | none              |
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: _Group) -> torch.Tensor:
        return C.all_reduce(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim.

    | pass     | input     | output    | collective           |
    |----------|-----------|-----------|----------------------|
    | forward  | [*, H]    | [*, H/t]  | none (slice)         |
    | backward | [*, H/t]  | [*, H]    | all-gather last dim  |
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return C.split_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.gather_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Concatenate the ranks' slices of the last dim.

    | pass     | input     | output    | collective           |
    |----------|-----------|-----------|----------------------|
    | forward  | [*, H/t]  | [*, H]    | all-gather last dim  |
    | backward | [*, H]    | [*, H/t]  | none (slice)         |
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return C.gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.split_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's rows of the first (sequence) dim.

    | pass     | input     | output    | collective            |
    |----------|-----------|-----------|-----------------------|
    | forward  | [S, *]    | [S/t, *]  | none (slice)          |
    | backward | [S/t, *]  | [S, *]    | all-gather first dim  |
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return C.split_first_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.gather_first_dim(grad_output, ctx.group)[0], None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather sequence shards (uneven with ``output_split_sizes``).

    | pass     | input        | output    | collective                                  |
    |----------|--------------|-----------|---------------------------------------------|
    | forward  | [S_r, *]     | [S, *]    | all-gather first dim                        |
    | backward | [S, *]       | [S_r, *]  | reduce-scatter first dim when               |
    |          |              |           | tensor_parallel_output_grad, else slice     |

    ``S_r`` is ``S/t`` or ``output_split_sizes[rank]``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        group: _Group,
        tensor_parallel_output_grad: bool,
        output_split_sizes: Sequence[int] | None,
        use_global_buffer: bool,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return C.gather_first_dim(input_, group, output_split_sizes, use_global_buffer)[0]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.tensor_parallel_output_grad:
            grad, _ = C.reduce_scatter_first_dim(
                grad_output, ctx.group, ctx.output_split_sizes, ctx.use_global_buffer
            )
        else:
            grad = C.split_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        return grad, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum partial outputs and keep this rank's sequence rows (uneven with split sizes).

    | pass     | input     | output    | collective                |
    |----------|-----------|-----------|---------------------------|
    | forward  | [S, *]    | [S_r, *]  | reduce-scatter first dim  |
    | backward | [S_r, *]  | [S, *]    | all-gather first dim      |
    """

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        group: _Group,
        input_split_sizes: Sequence[int] | None,
        use_global_buffer: bool,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return C.reduce_scatter_first_dim(input_, group, input_split_sizes, use_global_buffer)[0]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad, _ = C.gather_first_dim(
            grad_output, ctx.group, ctx.input_split_sizes, ctx.use_global_buffer
        )
        return grad, None, None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dim, whose consumer's gradient is partial on every rank.

    | pass     | input     | output    | collective                |
    |----------|-----------|-----------|---------------------------|
    | forward  | [*, H/t]  | [*, H]    | all-gather last dim       |
    | backward | [*, H]    | [*, H/t]  | reduce-scatter last dim   |
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return C.gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.reduce_scatter_last_dim(grad_output, ctx.group), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Sum partial tensors and keep this rank's slice of the last dim.

    | pass     | input     | output    | collective                |
    |----------|-----------|-----------|---------------------------|
    | forward  | [*, H]    | [*, H/t]  | reduce-scatter last dim   |
    | backward | [*, H/t]  | [*, H]    | all-gather last dim       |
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return C.reduce_scatter_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.gather_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """Exchange first-dim row blocks between ranks.

    | pass     | input                        | output                        | collective  |
    |----------|------------------------------|-------------------------------|-------------|
    | forward  | [sum(input_split_sizes), *]  | [sum(output_split_sizes), *]  | all-to-all  |
    | backward | [sum(output_split_sizes), *] | [sum(input_split_sizes), *]   | all-to-all  |
    |          |                              |                               | (swapped)   |
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: _Group,
        input_: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return C.all_to_all_first_dim(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = C.all_to_all_first_dim(
            grad_output[0], ctx.group, ctx.input_split_sizes, ctx.output_split_sizes
        )
        return None, grad, None, None


def copy_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: _Group | None = None
) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over ``group``."""
    return _CopyToModelParallelRegion.apply(input_, resolve_tp_group(group))


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: _Group | None = None
) -> torch.Tensor:
    """All-reduce (sum) over ``group``; identity gradient."""
    return _ReduceFromModelParallelRegion.apply(input_, resolve_tp_group(group))


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: _Group | None = None
) -> torch.Tensor:
    """Keep this rank's slice of the last dim; the gradient is all-gathered."""
    return _ScatterToModelParallelRegion.apply(input_, resolve_tp_group(group))


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: _Group | None = None
) -> torch.Tensor:
    """All-gather the last dim; the gradient is sliced back."""
    return _GatherFromModelParallelRegion.apply(input_, resolve_tp_group(group))


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group: _Group | None = None
) -> torch.Tensor:
    """Keep this rank's rows of the first dim; the gradient is all-gathered."""
    return _ScatterToSequenceParallelRegion.apply(input_, resolve_tp_group(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group: _Group | None = None,
    output_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """All-gather the first dim (rank ``r`` holds ``output_split_sizes[r]`` rows when given).

    Args:
        input_: this rank's rows.
        tensor_parallel_output_grad: the consumer is tensor parallel, so each
            rank's output gradient is partial and is reduce-scattered; when
            False the gradient is already complete and is only sliced.
        group: the group to gather over (default: the TP group).
        output_split_sizes: rows per rank for an uneven gather.
        use_global_buffer: gather into the mf_utils global memory buffer (the
            result is then overwritten by the next such call).
    """
    return _GatherFromSequenceParallelRegion.apply(
        input_,
        resolve_tp_group(group),
        tensor_parallel_output_grad,
        output_split_sizes,
        use_global_buffer,
    )


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: _Group | None = None,
    input_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Reduce-scatter the first dim (rank ``r`` keeps ``input_split_sizes[r]`` rows when given)."""
    return _ReduceScatterToSequenceParallelRegion.apply(
        input_, resolve_tp_group(group), input_split_sizes, use_global_buffer
    )


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: _Group | None = None
) -> torch.Tensor:
    """All-gather the last dim; the gradient is reduce-scattered along it."""
    return _AllGatherFromTensorParallelRegion.apply(input_, resolve_tp_group(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: _Group | None = None
) -> torch.Tensor:
    """Reduce-scatter the last dim; the gradient is all-gathered along it."""
    return _ReduceScatterToTensorParallelRegion.apply(input_, resolve_tp_group(group))


def all_to_all(
    group: _Group | None,
    input_: torch.Tensor,
    output_split_sizes_: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Autograd-aware all-to-all of first-dim row blocks (even when the sizes are None)."""
    return _AllToAll.apply(resolve_tp_group(group), input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_: torch.Tensor, group: _Group | None = None) -> torch.Tensor:
    """Sequence-sharded to hidden-sharded: ``[S/t, ..., H] -> [S, H/t]`` (leading dims flattened).

    Row block ``j`` of the result came from rank ``j``, so the rows keep the
    global sequence order.

    Raises:
        ValueError: if ``H`` is not divisible by the group size.
    """
    group = resolve_tp_group(group)
    world_size = dist.get_world_size(group)
    rows_SH = input_.reshape(-1, input_.shape[-1])
    C.check_divisible(rows_SH.shape[-1], world_size, "the last dim", "all_to_all_sp2hp")
    # [t * S/t, H/t]: block j holds hidden slice j, which goes to rank j.
    blocks = torch.cat(rows_SH.chunk(world_size, dim=-1), dim=0)
    return all_to_all(group, blocks)


def all_to_all_hp2sp(input_: torch.Tensor, group: _Group | None = None) -> torch.Tensor:
    """Hidden-sharded to sequence-sharded: ``[S, ..., H/t] -> [S/t, H]``; inverse of sp2hp.

    Raises:
        ValueError: if ``S`` is not divisible by the group size.
    """
    group = resolve_tp_group(group)
    world_size = dist.get_world_size(group)
    rows = input_.reshape(-1, input_.shape[-1])
    C.check_divisible(rows.shape[0], world_size, "the first dim", "all_to_all_hp2sp")
    exchanged = all_to_all(group, rows)  # block j: my sequence rows, hidden slice j
    return torch.cat(exchanged.chunk(world_size, dim=0), dim=-1)
