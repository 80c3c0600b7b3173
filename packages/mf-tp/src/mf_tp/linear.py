"""Tensor-parallel linear layers: the column- and row-parallel weight splits.

Responsibility: :class:`ColumnParallelLinear` (weight split along its output
dim), :class:`RowParallelLinear` (split along its input dim), the state they
share, and :func:`param_is_not_tensor_parallel_duplicate`. Their forward runs
one of the linear autograd functions of :mod:`mf_tp.linear_autograd`, which
hold the collectives of the input and its gradient. Legend: ``S`` sequence,
``B`` batch, ``I`` input features, ``O`` output features, ``t`` the TP group
size.

It must not: hard-code a device; the group's backend decides (mf_utils).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mf_tp.config import ModelParallelConfig
from mf_tp.init import allocate_sharded_weight
from mf_tp.layer_checks import (
    check_config_tp_size,
    check_last_dim,
    check_positive_size,
    check_stride,
    per_partition_size,
)
from mf_tp.linear_autograd import (
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mf_tp.mappings import (
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
    "RowParallelLinear",
    "param_is_not_tensor_parallel_duplicate",
]


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> bool:
    """True for a TP-sharded parameter, or for a replicated one on TP rank 0.

    Use it to count or norm each parameter element once across the TP group.
    """
    return is_mcore_tensor_model_parallel(param) or dist.get_rank(resolve_tp_group(tp_group)) == 0


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
        check_stride(self.output_size_per_partition, stride, where)
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
        check_last_dim(input_, self.input_size, "input_", where)
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
        check_stride(self.input_size_per_partition, stride, where)
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
            # setattr: an attribute the bias carries at run time, unknown to Parameter's type
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)  # noqa: B010
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply the layer and sum (or reduce-scatter) the partial outputs over the group.

        Raises:
            ValueError: for an input whose last dim is not the (per-partition) input size.
        """
        where = "RowParallelLinear.forward"
        if self.input_is_parallel:
            check_last_dim(input_, self.input_size_per_partition, "input_", where)
            input_parallel = input_
        else:
            check_last_dim(input_, self.input_size, "input_", where)
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
