"""Inference tensor-parallel layers in pure torch (no autograd collectives).

Responsibility: the sequence-parallel inference pair

- :class:`InferenceLayerNormColumnParallelLinear`: RMSNorm of the local
  sequence shard, all-gather along the sequence, then the column-parallel GEMM;
- :class:`InferenceRowParallelLinear`: the row-parallel GEMM, then
  reduce-scatter along the sequence; optionally fused with the residual add,
  the next layer's RMSNorm and the all-gather that layer would do.

Legend: ``S`` sequence, ``B`` batch, ``H`` hidden, ``t`` the TP group size.
The fused path runs the same four steps in sequence (torch has no portable
symmetric-memory kernel for them on every backend), so it equals the unfused
chain exactly; what it saves is the caller's bookkeeping.

It must not: be used for training (the collectives carry no gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mf_tp import _collectives as C
from mf_tp.config import ModelParallelConfig
from mf_tp.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["InferenceLayerNormColumnParallelLinear", "InferenceRowParallelLinear", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight``, computed in fp32, returned in ``x.dtype``."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


class InferenceLayerNormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm -> sequence all-gather -> column-parallel GEMM, for inference.

    Input ``[S/t, B, I]`` (this rank's sequence shard); output ``[S, B, O/t]``
    (``[S, B, O]`` with ``gather_output``). ``self.layer_norm_weight`` ``[I]`` is
    the RMSNorm scale (ones at init), ``config.layernorm_epsilon`` its epsilon.
    ``forward`` returns ``(output, output_bias)`` like :class:`ColumnParallelLinear`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], object],
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        stride: int = 1,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            gather_output=gather_output,
            stride=stride,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
        )
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype, device=self.param_device())
        )

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Normalise, gather the sequence, multiply.

        Raises:
            ValueError: if ``x``'s last dim is not ``input_size``.
        """
        if x.dim() == 0 or x.shape[-1] != self.input_size:
            raise ValueError(
                f"InferenceLayerNormColumnParallelLinear.forward: x must have last dim "
                f"{self.input_size}, got shape {tuple(x.shape)}"
            )
        normed, _ = C.gather_first_dim(rms_norm(x, self.layer_norm_weight, self.eps), self.tp_group)
        output = torch.matmul(normed, self.weight.t())
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        if self.gather_output:
            output = C.gather_last_dim(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class InferenceRowParallelLinear(RowParallelLinear):
    """Row-parallel GEMM -> sequence reduce-scatter, optionally fused with the next norm.

    Input ``[S, B, I/t]``; output ``[S/t, B, O]``. After
    :meth:`set_next_layer_norm_weights`, ``forward(x, residual)`` adds the
    reduce-scattered output into ``residual`` (``[S/t, B, O]``, updated in place
    to the new residual stream) and returns the all-gathered RMSNorm of it,
    ``[S, B, O]``: exactly what the next
    :class:`InferenceLayerNormColumnParallelLinear` would compute before its GEMM.
    ``forward`` returns ``(output, output_bias)``.
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
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not input_is_parallel:
            raise ValueError(
                "InferenceRowParallelLinear: input_is_parallel must be True (the input is the "
                f"previous column layer's shard), got {input_is_parallel!r}"
            )
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
        )
        self.next_layer_norm_weights: torch.Tensor | None = None
        self.next_layer_norm_eps = config.layernorm_epsilon

    def set_next_layer_norm_weights(self, weights: torch.Tensor, eps: float | None = None) -> None:
        """Enable the fused path with the next layer's RMSNorm scale ``[O]`` (and epsilon).

        Raises:
            ValueError: if ``weights`` is not ``[output_size]``.
        """
        if tuple(weights.shape) != (self.output_size,):
            raise ValueError(
                "InferenceRowParallelLinear.set_next_layer_norm_weights: weights must have "
                f"shape {(self.output_size,)}, got {tuple(weights.shape)}"
            )
        self.next_layer_norm_weights = weights
        if eps is not None:
            self.next_layer_norm_eps = eps

    def _matmul_reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.matmul(x, self.weight.t())  # [S, B, O], partial over ranks
        output, _ = C.reduce_scatter_first_dim(partial, self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        return output

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Multiply and reduce-scatter; see the class docstring for the fused path.

        Raises:
            ValueError: if ``x``'s last dim is not the per-partition input size.
        """
        if x.dim() == 0 or x.shape[-1] != self.input_size_per_partition:
            raise ValueError(
                f"InferenceRowParallelLinear.forward: x must have last dim "
                f"{self.input_size_per_partition}, got shape {tuple(x.shape)}"
            )
        output = self._matmul_reduce_scatter(x)
        output_bias = self.bias if self.skip_bias_add else None
        if self.next_layer_norm_weights is None or residual is None:
            return output, output_bias
        residual.add_(output)
        normed = rms_norm(residual, self.next_layer_norm_weights, self.next_layer_norm_eps)
        return C.gather_first_dim(normed, self.tp_group)[0], output_bias
