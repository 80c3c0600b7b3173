"""ModelParallelConfig: the options the tensor-parallel layers read.

Responsibility: one validated, immutable bag of layer options. It holds no
process group; the layers take their group explicitly or from
:func:`mf_tp.initialize_model_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ModelParallelConfig"]


@dataclass(frozen=True, slots=True)
class ModelParallelConfig:
    """Options shared by the tensor-parallel layers.

    Attributes:
        tensor_model_parallel_size: the TP size the model is built for.
        sequence_parallel: shard activations outside the TP regions along the
            sequence (first) dim; needs ``tensor_model_parallel_size > 1``.
        params_dtype: dtype of the weights the layers allocate.
        use_cpu_initialization: build the full master weight on the CPU from the
            default CPU generator, then keep this rank's shard.
        perform_initialization: run the init method at all (False leaves the
            memory uninitialised, e.g. before loading a checkpoint).
        gradient_accumulation_fusion: accumulate weight gradients into
            ``weight.main_grad`` (fp32 usually) instead of ``weight.grad``.
        async_tensor_model_parallel_allreduce: kept for reference compatibility;
            the input-gradient all-reduce always overlaps the weight-gradient GEMM.
        defer_embedding_wgrad_compute: let ColumnParallelLinear hand its
            input and output gradient to buffers instead of computing the weight
            gradient (the caller computes it later).
        wgrad_deferral_limit: how many weight gradients may be deferred (0: all).
        expert_model_parallel_size: expert-parallel size (is_expert layers).
        layernorm_epsilon: epsilon of the RMSNorm in the inference layers.
    """

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    expert_model_parallel_size: int = 1
    layernorm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        """Reject option values the layers cannot honour."""
        for name in ("tensor_model_parallel_size", "expert_model_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelParallelConfig: {name} must be an int >= 1, got {value!r}")
        if (
            not isinstance(self.params_dtype, torch.dtype)
            or not self.params_dtype.is_floating_point
        ):
            raise TypeError(
                "ModelParallelConfig: params_dtype must be a floating torch.dtype, "
                f"got {self.params_dtype!r}"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "ModelParallelConfig: sequence_parallel=True needs tensor_model_parallel_size > 1, "
                f"got tensor_model_parallel_size={self.tensor_model_parallel_size!r}"
            )
        if not isinstance(self.wgrad_deferral_limit, int) or self.wgrad_deferral_limit < 0:
            raise ValueError(
                "ModelParallelConfig: wgrad_deferral_limit must be an int >= 0, "
                f"got {self.wgrad_deferral_limit!r}"
            )
        if not self.layernorm_epsilon > 0:
            raise ValueError(
                "ModelParallelConfig: layernorm_epsilon must be positive, "
                f"got {self.layernorm_epsilon!r}"
            )
