"""The fused linear autograd functions the tensor-parallel linear layers run.

Responsibility: :func:`linear_with_grad_accumulation_and_async_allreduce`
(:class:`LinearWithGradAccumulationAndAsyncCommunication`: the TP collectives of
the input and its gradient fused into ``x W^T + b``, the weight gradient
optionally accumulated into ``weight.main_grad``) and
:func:`linear_with_frozen_weight` (:class:`LinearWithFrozenWeight`: no weight
gradient). Each class's docstring tables its shapes and collectives. Legend:
``S`` sequence, ``B`` batch, ``I`` input features, ``O`` output features, ``t``
the TP group size.

[Note: overlapping the input gradient] In backward the input-gradient
all-reduce (or, with sequence parallelism, reduce-scatter) is launched with
``async_op=True`` right after the input-gradient GEMM and waited for only after
the weight-gradient GEMM, so communication and the second GEMM overlap. With
sequence parallelism the forward all-gather of the input is redone in backward
(asynchronously, overlapping the input-gradient GEMM) instead of being saved.

It must not: hold module state or parameters (the layers in :mod:`mf_tp.linear`
do), or hard-code a device; the group's backend decides (mf_utils).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from mf_tp import _collectives as C
from mf_tp.layer_checks import check_last_dim
from mf_tp.mappings import (
    gather_from_sequence_parallel_region,
)
from mf_tp.parallel_state import resolve_tp_group

__all__ = [
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
]


def _resolve_allreduce_dgrad(
    allreduce_dgrad: bool, async_grad_allreduce: bool | None, where: str
) -> bool:
    if async_grad_allreduce is None:
        return allreduce_dgrad
    warnings.warn(
        f"{where}: async_grad_allreduce is deprecated, use allreduce_dgrad "
        f"(using allreduce_dgrad={async_grad_allreduce!r})",
        DeprecationWarning,
        stacklevel=3,
    )
    return async_grad_allreduce


class LinearWithFrozenWeight(torch.autograd.Function):
    """``y = x W^T + b`` for a weight that gets no gradient.

    | pass     | input            | output           | collective                          |
    |----------|------------------|------------------|-------------------------------------|
    | forward  | x [*, I]         | y [*, O]         | none                                |
    | backward | dy [*, O]        | dx [*, I]        | all-reduce dx when allreduce_dgrad  |
    """

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        allreduce_dgrad: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """Save the weight; ``x W^T + b``."""
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.group = tp_group
        output = torch.matmul(input_, weight.t())
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``dx = dy W`` (all-reduced when asked); no weight gradient."""
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            grad_input = C.all_reduce(grad_input, ctx.group, inplace=True)
        grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, None, grad_bias, None, None


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: dist.ProcessGroup | None,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: None = None,
    async_grad_allreduce: bool | None = None,
) -> torch.Tensor:
    """Linear layer forward for a frozen weight, with the TP input-gradient collective.

    ``gradient_accumulation_fusion``, ``grad_output_buffer`` and
    ``wgrad_deferral_limit`` are accepted for signature compatibility; a frozen
    weight has no gradient to accumulate or defer. With ``sequence_parallel`` the
    input is all-gathered along the sequence dim first (its gradient is
    reduce-scattered), so no all-reduce is done.
    """
    del gradient_accumulation_fusion, grad_output_buffer, wgrad_deferral_limit
    allreduce_dgrad = _resolve_allreduce_dgrad(
        allreduce_dgrad, async_grad_allreduce, "linear_with_frozen_weight"
    )
    check_last_dim(input, weight.shape[1], "input", "linear_with_frozen_weight")
    group = resolve_tp_group(tp_group) if (sequence_parallel or allreduce_dgrad) else None
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, True, group)
        allreduce_dgrad = False
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, group)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``y = x W^T + b`` with the TP collectives of the input and its gradient fused in.

    | pass     | input          | output         | collective                            |
    |----------|----------------|----------------|---------------------------------------|
    | forward  | x [S/t, B, I]  | y [S, B, O]    | all-gather x along S (SP only)        |
    |          | or [*, I]      | or [*, O]      |                                       |
    | backward | dy [S, B, O]   | dx [S/t, B, I] | SP: all-gather x again, then async    |
    |          | or [*, O]      | or [*, I]      | reduce-scatter dx; else async         |
    |          |                |                | all-reduce dx when allreduce_dgrad    |

    The weight gradient goes to ``weight.main_grad`` (added in place, pure torch)
    when ``gradient_accumulation_fusion``; see [Note: overlapping the input gradient].
    """

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: list[torch.Tensor] | None,
        wgrad_deferral_limit: int,
        tp_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """Save the shard of x; gather it along S under SP; ``x W^T + b``."""
        ctx.save_for_backward(input_, weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.group = tp_group
        total_input = input_
        if sequence_parallel:
            if tp_group is None:
                raise ValueError(
                    "LinearWithGradAccumulationAndAsyncCommunication: sequence_parallel needs "
                    "the resolved tp_group, got None"
                )
            # Scratch memory: consumed by the GEMM right away.
            total_input, _ = C.gather_first_dim(input_, tp_group, use_global_buffer=True)
        output = torch.matmul(total_input, weight.t())
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Compute dx, keep its collective in flight while dW is computed."""
        input_, weight = ctx.saved_tensors
        group = ctx.group
        buffer = ctx.grad_output_buffer
        defer_wgrad = buffer is not None and (
            ctx.wgrad_deferral_limit == 0 or len(buffer) < ctx.wgrad_deferral_limit
        )
        total_input, gather_work = input_, None
        if ctx.sequence_parallel and not defer_wgrad:
            total_input, gather_work = C.gather_first_dim(
                input_, group, use_global_buffer=True, async_op=True
            )
        grad_input = grad_output.matmul(weight)
        if gather_work is not None:
            gather_work.wait()

        dgrad_work = None
        if ctx.sequence_parallel:
            grad_input, dgrad_work = C.reduce_scatter_first_dim(grad_input, group, async_op=True)
        elif ctx.allreduce_dgrad and dist.get_world_size(group) > 1:
            grad_input = grad_input.contiguous()
            dgrad_work = dist.all_reduce(grad_input, group=group, async_op=True)

        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [S*B, O]
        grad_weight = None
        if defer_wgrad:
            buffer.append(grad_output)
        else:
            total_input_2d = total_input.reshape(-1, total_input.shape[-1])  # [S*B, I]
            grad_weight = _weight_gradient(weight, grad_output_2d, total_input_2d, ctx)
        grad_bias = grad_output_2d.sum(0) if ctx.use_bias else None
        if dgrad_work is not None:
            dgrad_work.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _weight_gradient(
    weight: torch.Tensor, grad_output_2d: torch.Tensor, total_input_2d: torch.Tensor, ctx: Any
) -> torch.Tensor | None:
    """``dW = dy^T x``, or its in-place addition to ``weight.main_grad`` (then a zero dummy)."""
    if not ctx.gradient_accumulation_fusion:
        return grad_output_2d.t().matmul(total_input_2d)
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape:
        raise RuntimeError(
            "gradient_accumulation_fusion needs weight.main_grad, a tensor of the weight's "
            f"shape {tuple(weight.shape)}, got {main_grad!r}"
        )
    dtype = main_grad.dtype
    main_grad.addmm_(grad_output_2d.t().to(dtype), total_input_2d.to(dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        # The caller's grad hook reads this flag; it needs a (zero) grad to fire.
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    async_grad_allreduce: bool | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Linear layer with the TP input/gradient collectives overlapped with the GEMMs.

    Args:
        input: ``[*, I]``, or ``[S/t, B, I]`` with ``sequence_parallel``.
        weight: ``[O, I]``.
        bias: ``[O]`` or None.
        gradient_accumulation_fusion: add dW into ``weight.main_grad``.
        allreduce_dgrad: all-reduce the input gradient over ``tp_group``.
        sequence_parallel: all-gather the input along S in forward and
            reduce-scatter its gradient in backward (excludes ``allreduce_dgrad``).
        grad_output_buffer: when a list, output gradients are appended to it and
            the weight gradient is left to the caller (deferred wgrad).
        wgrad_deferral_limit: defer at most this many (0: no limit).
        async_grad_allreduce: deprecated alias of ``allreduce_dgrad``.
        tp_group: the TP group (default: the initialised one; unused when no
            collective is needed).

    Raises:
        ValueError: if the input's last dim is not the weight's input size, or
            both ``allreduce_dgrad`` and ``sequence_parallel`` are set.
    """
    where = "linear_with_grad_accumulation_and_async_allreduce"
    allreduce_dgrad = _resolve_allreduce_dgrad(allreduce_dgrad, async_grad_allreduce, where)
    check_last_dim(input, weight.shape[1], "input", where)
    if allreduce_dgrad and sequence_parallel:
        raise ValueError(
            f"{where}: allreduce_dgrad and sequence_parallel are exclusive (the input gradient "
            "is reduce-scattered with sequence parallelism), got both True"
        )
    group = resolve_tp_group(tp_group) if (sequence_parallel or allreduce_dgrad) else tp_group
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit or 0,
        group,
    )
