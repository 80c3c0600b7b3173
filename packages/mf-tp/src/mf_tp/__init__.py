"""mf_tp: Megatron-style tensor parallelism in pure torch, on any backend.

- :mod:`mf_tp.parallel_state`: TP/DP groups over the world or a DeviceMesh.
- :mod:`mf_tp.config`: :class:`ModelParallelConfig`.
- :mod:`mf_tp.mappings`: autograd-aware TP/SP collectives.
- :mod:`mf_tp.init`: TP-size-independent sharded weight initialisation.
- :mod:`mf_tp.linear`: Column/RowParallelLinear.
- :mod:`mf_tp.linear_autograd`: the linear functions they run (async all-reduce, main_grad).
- :mod:`mf_tp.embedding`: VocabParallelEmbedding.
- :mod:`mf_tp.cross_entropy`: vocab-parallel cross entropy.
- :mod:`mf_tp.data`: broadcast_data.
- :mod:`mf_tp.grouped_experts`: experts as grouped 3-D weights, one grouped matmul.
- :mod:`mf_tp.expert_parallel`: expert parallelism for transformers' grouped experts.
- :mod:`mf_tp.moe`: dropless expert-parallel mixture of experts (router, dispatch, MoELayer).
- :mod:`mf_tp.inference`: inference layers with the fused RS + residual + RMSNorm + AG path.
- :mod:`mf_tp.partition`: split helpers and VocabUtility.
- :mod:`mf_tp.context_parallelism`: sequences split over ranks, attention over all of them.

Every op takes an explicit ``group=`` / ``tp_group=``; the groups of
:func:`initialize_model_parallel` are only the default.
"""

from __future__ import annotations

from mf_tp.config import ModelParallelConfig
from mf_tp.context_parallelism import context_parallel, context_parallel_unshard
from mf_tp.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from mf_tp.data import broadcast_data
from mf_tp.embedding import VocabParallelEmbedding
from mf_tp.expert_parallel import expert_parallel
from mf_tp.grouped_experts import GroupedExperts, convert_per_expert_state_dict
from mf_tp.inference import (
    InferenceLayerNormColumnParallelLinear,
    InferenceRowParallelLinear,
    rms_norm,
)
from mf_tp.init import initialize_affine_weight_cpu, initialize_affine_weight_on_device
from mf_tp.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    param_is_not_tensor_parallel_duplicate,
)
from mf_tp.linear_autograd import (
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mf_tp.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mf_tp.moe import (
    ExpertMLP,
    MoELayer,
    RoutingResult,
    TokenDispatchState,
    TopKRouter,
    combine_tokens,
    dispatch_tokens,
)
from mf_tp.parallel_state import (
    ModelParallelGroups,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_groups,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
    use_model_parallel_groups,
)
from mf_tp.partition import (
    VocabUtility,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)
from mf_utils import (
    copy_tensor_model_parallel_attributes,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ColumnParallelLinear",
    "ExpertMLP",
    "GroupedExperts",
    "InferenceLayerNormColumnParallelLinear",
    "InferenceRowParallelLinear",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "MoELayer",
    "ModelParallelConfig",
    "ModelParallelGroups",
    "RoutingResult",
    "RowParallelLinear",
    "TokenDispatchState",
    "TopKRouter",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabUtility",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "broadcast_data",
    "combine_tokens",
    "context_parallel",
    "context_parallel_unshard",
    "convert_per_expert_state_dict",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "destroy_model_parallel",
    "dispatch_tokens",
    "expert_parallel",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_split_1d_tensor",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_groups",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "initialize_affine_weight_cpu",
    "initialize_affine_weight_on_device",
    "initialize_model_parallel",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "model_parallel_is_initialized",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "rms_norm",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "use_model_parallel_groups",
    "vocab_parallel_cross_entropy",
]
