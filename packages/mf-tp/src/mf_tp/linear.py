"""Tensor-parallel linear layers and their fused linear autograd functions.

Responsibility: :class:`ColumnParallelLinear` (weight split along its output
dim), :class:`RowParallelLinear` (split along its input dim), and the two
linear autograd functions they run:
:func:`linear_with_grad_accumulation_and_async_allreduce` and
:func:`linear_with_frozen_weight`. Legend: ``S`` sequence, ``B`` batch, ``I``
input features, ``O`` output features, ``t`` the TP group size.

[Note: overlapping the input gradient] In backward the input-gradient
all-reduce (or, with sequence parallelism, reduce-scatter) is launched with
``async_op=True`` right after the input-gradient GEMM and waited for only after
the weight-gradient GEMM, so communication and the second GEMM overlap. With
sequence parallelism the forward all-gather of the input is redone in backward
(asynchronously, overlapping the input-gradient GEMM) instead of being saved.

It must not: hard-code a device; the group's backend decides (mf_utils).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mf_tp import _collectives as C
from mf_tp.config import ModelParallelConfig
from mf_tp.init import allocate_sharded_weight
from mf_tp.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mf_tp.parallel_state import resolve_tp_group
from mf_utils import (
    get_group_device,
    is_mcore_tensor_model_parallel,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ColumnParallelLinear",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "check_config_tp_size",
    "check_positive_size",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "per_partition_size",
]


def per_partition_size(size: int, world_size: int, argument: str, where: str) -> int:
    """``size / world_size``, or a ValueError naming ``argument`` when it does not divide."""
    if not isinstance(size, int) or size < 1 or size % world_size != 0:
        raise ValueError(
            f"{where}: {argument}={size!r} must be a positive int divisible by the "
            f"tensor-parallel size {world_size}"
        )
    return size // world_size


def check_positive_size(size: object, argument: str, where: str) -> int:
    """``size`` itself, or a ValueError naming ``argument`` unless it is an int >= 1."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{where}: {argument} must be a positive int, got {size!r}")
    return size


def check_config_tp_size(config: ModelParallelConfig, tp_size: int, where: str) -> None:
    """Raise a ValueError unless ``config`` was built for a TP group of ``tp_size`` ranks.

    The layers split their weights over the group they are given; a config
    that says another size means the model was set up for another layout
    (e.g. a checkpoint's), which would otherwise go unnoticed.
    """
    if config.tensor_model_parallel_size != tp_size:
        raise ValueError(
            f"{where}: config.tensor_model_parallel_size={config.tensor_model_parallel_size} "
            f"but the tensor-parallel group (tp_group) has {tp_size} ranks; expected them "
            "equal (build the config with tensor_model_parallel_size="
            "torch.distributed.get_world_size(tp_group))"
        )


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> bool:
    """True for a TP-sharded parameter, or for a replicated one on TP rank 0.

    Use it to count or norm each parameter element once across the TP group.
    """
    return is_mcore_tensor_model_parallel(param) or dist.get_rank(resolve_tp_group(tp_group)) == 0


def _check_stride(per_partition: int, stride: int, where: str) -> None:
    if not isinstance(stride, int) or stride < 1 or per_partition % stride != 0:
        raise ValueError(
            f"{where}: stride={stride!r} must be a positive int dividing the per-partition "
            f"size {per_partition}"
        )


def _check_last_dim(tensor: torch.Tensor, expected: int, argument: str, where: str) -> None:
    if tensor.dim() == 0 or tensor.shape[-1] != expected:
        raise ValueError(
            f"{where}: {argument} must have last dim {expected}, got shape {tuple(tensor.shape)}"
        )


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
    _check_last_dim(input, weight.shape[1], "input", "linear_with_frozen_weight")
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
    _check_last_dim(input, weight.shape[1], "input", where)
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


_LinearImpl = Callable[..., torch.Tensor]


class _ParallelLinearBase(torch.nn.Module):
    """State shared by the column and row layers: group, config, weight, bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        is_expert: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        self.input_size = check_positive_size(input_size, "input_size", where)
        self.output_size = check_positive_size(output_size, "output_size", where)
        if not isinstance(config, ModelParallelConfig):
            raise TypeError(f"{where}: config must be a ModelParallelConfig, got {config!r}")
        self.config = config
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_rank = dist.get_rank(self.tp_group)
        self.tp_size = dist.get_world_size(self.tp_group)
        if not is_expert:  # expert layers run on the expert-TP group, of another size
            check_config_tp_size(config, self.tp_size, where)
        self.is_expert = is_expert
        self.explicit_expert_comm = is_expert and (
            self.tp_size > 1 or config.expert_model_parallel_size > 1
        )
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and self.tp_size == 1:
            warnings.warn(
                f"{type(self).__name__}: sequence_parallel is ignored for a TP group of size 1",
                UserWarning,
                stacklevel=3,
            )
            self.sequence_parallel = False
        self.device = get_group_device(self.tp_group)
        self.master_weight: torch.Tensor | None = None

    def _make_weight(
        self,
        shard_shape: tuple[int, int],
        partition_dim: int,
        init_method: Callable[[torch.Tensor], object],
        stride: int,
        keep_master_weight_for_test: bool,
    ) -> None:
        weight, master = allocate_sharded_weight(
            shard_shape,
            (self.output_size, self.input_size),
            partition_dim,
            config=self.config,
            init_method=init_method,
            stride=stride,
            rank=self.tp_rank,
            world_size=self.tp_size,
            device=self.device,
            is_expert=self.is_expert,
        )
        self.weight = weight
        if keep_master_weight_for_test:
            self.master_weight = master

    def param_device(self) -> torch.device:
        """Where this layer's parameters are allocated (the CPU with CPU initialisation)."""
        return torch.device("cpu") if self.config.use_cpu_initialization else self.device

    def _make_bias(self, size: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(
            torch.zeros(size, dtype=self.config.params_dtype, device=self.param_device())
        )

    def _linear_impl(self, weight: torch.Tensor) -> _LinearImpl:
        if weight.requires_grad:
            return linear_with_grad_accumulation_and_async_allreduce
        return linear_with_frozen_weight

    def set_extra_state(self, state: Any) -> None:
        """Accept (and ignore) the extra state other engines store for this layer."""

    def get_extra_state(self) -> None:
        """No extra state: present so checkpoints of TE-style layers load here."""
        return None

    def __repr__(self) -> str:
        """Show the full sizes, bias and TP size."""
        return (
            f"{type(self).__name__}(in_features={self.input_size}, "
            f"out_features={self.output_size}, bias={self.bias is not None}, TP={self.tp_size})"
        )


class ColumnParallelLinear(_ParallelLinearBase):
    """``Y = X A + b`` with ``A``'s output dim split over the TP group: ``A = [A_1 ... A_t]``.

    Weight shard ``[O/t, I]``, bias shard ``[O/t]``. Input ``[*, I]`` (or
    ``[S/t, B, I]`` with sequence parallelism); output ``[*, O/t]``, or ``[*, O]``
    with ``gather_output``. ``forward`` returns ``(output, output_bias)``, where
    ``output_bias`` is the bias when ``skip_bias_add`` (left for the caller to
    fuse) and None otherwise.

    Args mirror the reference: ``stride`` for interleaved (fused) weights,
    ``keep_master_weight_for_test`` keeps the full master weight in
    ``self.master_weight``, ``skip_weight_param_allocation`` expects the weight in
    ``forward``, ``embedding_activation_buffer`` / ``grad_output_buffer`` collect
    inputs and output gradients for a deferred weight gradient
    (``config.defer_embedding_wgrad_compute``), ``disable_grad_reduce`` leaves the
    input gradient partial, ``tp_comm_buffer_name`` is unused (TE only).

    Raises:
        TypeError: if ``config`` is not a ``ModelParallelConfig``.
        ValueError: if ``input_size`` or ``output_size`` is not a positive int,
            ``output_size`` is not divisible by the TP size, or (unless
            ``is_expert``) ``config.tensor_model_parallel_size`` is not the size
            of ``tp_group``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], object],
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list[torch.Tensor] | None = None,
        grad_output_buffer: list[torch.Tensor] | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, config=config, is_expert=is_expert, tp_group=tp_group
        )
        del tp_comm_buffer_name
        where = "ColumnParallelLinear"
        self.output_size_per_partition = per_partition_size(
            output_size, self.tp_size, "output_size", where
        )
        _check_stride(self.output_size_per_partition, stride, where)
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self._make_weight(
                (self.output_size_per_partition, input_size),
                0,
                init_method,
                stride,
                keep_master_weight_for_test,
            )
        if bias:
            self.bias = self._make_bias(self.output_size_per_partition)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply the layer; ``weight`` overrides (or supplies) the weight shard.

        Raises:
            ValueError: for an input or weight of the wrong shape, or
                gathering the output under sequence parallelism.
            RuntimeError: if no weight is allocated and none is passed.
        """
        where = "ColumnParallelLinear.forward"
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    f"{where}: skip_weight_param_allocation=True, so weight must be passed"
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"{where}: weight must have shape "
                f"{(self.output_size_per_partition, self.input_size)}, got {tuple(weight.shape)}"
            )
        _check_last_dim(input_, self.input_size, "input_", where)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.sequence_parallel:
            raise ValueError(
                f"{where}: gather_output cannot be combined with sequence_parallel "
                "(the output stays sharded along the hidden dim)"
            )
        allreduce_dgrad = (
            self.tp_size > 1
            and not self.sequence_parallel
            and not self.disable_grad_reduce
            and not self.explicit_expert_comm
        )
        defer = self.config.defer_embedding_wgrad_compute
        if defer and self.embedding_activation_buffer is not None and weight.requires_grad:
            self.embedding_activation_buffer.append(input_)
        output_parallel = self._linear_impl(weight)(
            input_,
            weight,
            None if self.skip_bias_add else self.bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=self.sequence_parallel and not self.explicit_expert_comm,
            grad_output_buffer=self.grad_output_buffer if defer else None,
            wgrad_deferral_limit=self.config.wgrad_deferral_limit if defer else None,
            tp_group=self.tp_group,
        )
        output = output_parallel
        if gather and not self.explicit_expert_comm:
            output = gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_ParallelLinearBase):
    """``Y = X A + b`` with ``A``'s input dim split over the TP group: ``A = [A_1; ...; A_t]``.

    Weight shard ``[O, I/t]``; the bias ``[O]`` is replicated (and tagged
    ``sequence_parallel`` under sequence parallelism, whose gradient is then
    partial per rank and must be all-reduced over the TP group by the caller,
    as for LayerNorm weights). Input ``[*, I/t]`` when ``input_is_parallel``,
    else ``[*, I]`` (scattered here); output ``[*, O]``, or ``[S/t, B, O]`` with
    sequence parallelism. ``forward`` returns ``(output, output_bias)``.

    Raises:
        TypeError: if ``config`` is not a ``ModelParallelConfig``.
        ValueError: if ``input_size`` or ``output_size`` is not a positive int,
            ``input_size`` is not divisible by the TP size, (unless ``is_expert``)
            ``config.tensor_model_parallel_size`` is not the size of ``tp_group``,
            or sequence parallelism is asked without ``input_is_parallel``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], object],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, config=config, is_expert=is_expert, tp_group=tp_group
        )
        del tp_comm_buffer_name
        where = "RowParallelLinear"
        self.input_size_per_partition = per_partition_size(
            input_size, self.tp_size, "input_size", where
        )
        _check_stride(self.input_size_per_partition, stride, where)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                f"{where}: sequence_parallel needs input_is_parallel=True, "
                f"got input_is_parallel={input_is_parallel!r}"
            )
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self._make_weight(
            (output_size, self.input_size_per_partition),
            1,
            init_method,
            stride,
            keep_master_weight_for_test,
        )
        if bias:
            self.bias = self._make_bias(output_size)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply the layer and sum (or reduce-scatter) the partial outputs over the group.

        Raises:
            ValueError: for an input whose last dim is not the (per-partition) input size.
        """
        where = "RowParallelLinear.forward"
        if self.input_is_parallel:
            _check_last_dim(input_, self.input_size_per_partition, "input_", where)
            input_parallel = input_
        else:
            _check_last_dim(input_, self.input_size, "input_", where)
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = self._linear_impl(self.weight)(
            input_parallel,
            self.weight,
            None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=self.tp_group,
        )
        if self.explicit_expert_comm:
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None
